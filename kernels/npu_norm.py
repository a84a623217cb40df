"""Reference kernels of the NPU's RMSNorm ops, as qwen2om emits them in the `npu` domain.

`npu::NPURmsNorm(x, gamma)` → (y, rstd)   (GE RmsNorm)
    rstd = 1 / sqrt(mean(x², over gamma's axes) + epsilon)   float32, x's shape with those axes kept as 1
    y    = x · rstd · gamma                                     computed in float32, returned in x's dtype

`npu::NPUAddRmsNorm(x1, x2, gamma)` → (y, rstd, x)   (GE AddRmsNorm)
    x = x1 + x2 in x1's dtype (the residual stream the next layer reads), rstd as RmsNorm's of x, and
    y = x·rstd rounded to x's dtype, then · gamma (fp16: in fp16; bf16: in float32, rounded again),
    the rounding order of Hugging Face's Qwen RMSNorm.

ε is 1e-6 whatever the node says: both ONNX plugins read no attribute and set it (the table's
`_constraints.ops.NPURmsNorm.lines.epsilon`), so qwen2om emits no `epsilon` and fuses only norms whose
ε is 1e-6 (every Qwen release's). Sources: the table's `_constraints.ops` entries of both ops.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto

from qwen2om.kernels.builder import Builder, shape

DOMAIN = "npu"
RMS_NORM = "NPURmsNorm"
ADD_RMS_NORM = "NPUAddRmsNorm"
EPSILON = 1e-6  # the plugins' default when the node has no `epsilon`


def rms_norm(x: np.ndarray, gamma: np.ndarray, *, epsilon: float = EPSILON) -> tuple[np.ndarray, np.ndarray]:
    """(y in x's dtype, rstd float32) over gamma's trailing axes; gamma may be float32 with fp16 x."""
    xf = np.asarray(x).astype(np.float32)
    axes = tuple(range(xf.ndim - np.ndim(gamma), xf.ndim))
    mean = np.mean(xf * xf, axis=axes, keepdims=True)
    rstd = (np.float32(1) / np.sqrt(mean + np.float32(epsilon))).astype(np.float32)
    y = xf * rstd * np.asarray(gamma).astype(np.float32)
    return y.astype(np.asarray(x).dtype), rstd


def add_rms_norm(x1: np.ndarray, x2: np.ndarray, gamma: np.ndarray, *, epsilon: float = EPSILON
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, rstd, x = x1 + x2): the sum rounded to x1's dtype, normalised, rounded, then · gamma."""
    x = (np.asarray(x1).astype(np.float32) + np.asarray(x2).astype(np.float32)).astype(np.asarray(x1).dtype)
    ones = np.ones(np.shape(gamma), np.float32)
    normed, rstd = rms_norm(x, ones, epsilon=epsilon)  # x·rstd, rounded to x's dtype
    y = (normed.astype(np.float32) * np.asarray(gamma).astype(np.float32)).astype(x.dtype)
    return y, rstd, x


# -- decompositions into standard ONNX ops --------------------------------------------------------
def _norm(b: Builder, x: str, gamma: str, y: str, rstd: str | None, y_type: int, *, round_first: bool) -> None:
    """y = x·rstd·gamma in float32 (one rounding), or with `round_first` x·rstd rounded, then · gamma."""
    rank = len(shape(b.graph, gamma) or [1])
    xf = b.op("Cast", x, to=TensorProto.FLOAT)
    axes = b.const(np.arange(-rank, 0, dtype=np.int64))
    mean = b.op("ReduceMean", b.op("Mul", xf, xf), axes, keepdims=1)
    root = b.op("Sqrt", b.op("Add", mean, b.const(np.array(EPSILON, np.float32))))
    # Div, not Reciprocal: ONNX Runtime's CPU Reciprocal is an approximation (1e-5 relative, measured)
    inv = b.op("Div", b.const(np.array(1, np.float32)), root, out=rstd or None)
    normed = b.op("Mul", xf, inv)
    if round_first:  # fp16 · fp16 is exact in float32: one rounding after it is the fp16 product
        normed = b.op("Cast", b.op("Cast", normed, to=y_type), to=TensorProto.FLOAT)
    scaled = b.op("Mul", normed, b.op("Cast", gamma, to=TensorProto.FLOAT))
    b.op("Cast", scaled, out=y, to=y_type)


def _outputs(node: onnx.NodeProto, n: int) -> list[str]:
    return [*node.output, *[""] * n][:n]


def decompose_rms_norm(b: Builder, node: onnx.NodeProto, types: Mapping[str, int]) -> None:
    x, gamma = node.input[0], node.input[1]
    y, rstd = _outputs(node, 2)
    _norm(b, x, gamma, y, rstd, types.get(x, TensorProto.FLOAT16), round_first=False)


def decompose_add_rms_norm(b: Builder, node: onnx.NodeProto, types: Mapping[str, int]) -> None:
    x1, x2, gamma = node.input[0], node.input[1], node.input[2]
    y, rstd, total = _outputs(node, 3)
    x_type = types.get(x1, TensorProto.FLOAT16)
    total = b.op("Add", x1, x2, out=total or None)
    _norm(b, total, gamma, y, rstd, x_type, round_first=True)


DECOMPOSE = {(DOMAIN, RMS_NORM): decompose_rms_norm, (DOMAIN, ADD_RMS_NORM): decompose_add_rms_norm}
