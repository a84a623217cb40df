"""Reference kernel of the NPU's rotary position embedding, as qwen2om emits it in the `npu` domain.

`npu::NPURotaryPositionEmbedding(x, cos, sin; mode)` → y   (GE RotaryPositionEmbedding)
    mode 0 (half, rotate_half as Qwen and GPT-NeoX use it):
        y = x · cos + rotate_half(x) · sin,    rotate_half(x) = concat(−x[..., D/2:], x[..., :D/2])
    cos and sin have x's full last dim D (not D/2 frequencies) and x's dtype, and broadcast to x
    (BSND x [B, T, N, D] with [B, T, 1, D] tables); fp16 and bf16 are computed in float32 and
    rounded once to x's dtype.

`mode` is required by CANN's ONNX plugin (an INT attribute; the node is refused without it); qwen2om
emits mode 0 only, so modes 1-3 (interleave, quarter, interleave-half) have no reference here.
Sources: the table's `_constraints.ops.NPURotaryPositionEmbedding` (plugin, proto, tiling and kernel lines).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto

from qwen2om.kernels.builder import Builder, attrs

DOMAIN = "npu"
ROPE = "NPURotaryPositionEmbedding"
HALF = 0  # mode 0: rotate_half


def rotary_position_embedding(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, mode: int = HALF) -> np.ndarray:
    """y = x·cos + rotate_half(x)·sin in float32, rounded once to x's dtype (mode 0 only)."""
    if mode != HALF:
        raise NotImplementedError(f"RotaryPositionEmbedding mode {mode}: qwen2om emits mode 0 (half) only")
    x = np.asarray(x)
    d = x.shape[-1]
    if d % 2 or np.shape(cos)[-1] != d or np.shape(sin)[-1] != d:
        raise ValueError(f"x's last dim must be even and equal cos/sin's: x {x.shape}, cos {np.shape(cos)}, "
                         f"sin {np.shape(sin)}")
    xf = x.astype(np.float32)
    rotated = np.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    y = xf * np.asarray(cos).astype(np.float32) + rotated * np.asarray(sin).astype(np.float32)
    return y.astype(x.dtype)


# -- decomposition into standard ONNX ops --------------------------------------------------------
def decompose_rope(b: Builder, node: onnx.NodeProto, types: Mapping[str, int]) -> None:
    mode = int(attrs(node).get("mode", -1))  # type: ignore[call-overload]
    if mode != HALF:
        raise NotImplementedError(f"{node.name}: {ROPE} mode {mode} has no decomposition (qwen2om emits mode 0)")
    x, cos, sin = node.input[0], node.input[1], node.input[2]
    xf = b.op("Cast", x, to=TensorProto.FLOAT)
    # D/2 from x's shape at run time: the same nodes serve any head width (and partial rotary's R)
    half = b.op("Div", b.op("Shape", x, start=-1), b.const(np.array([2], np.int64)))
    last = b.const(np.array([-1], np.int64))
    first = b.op("Slice", xf, b.const(np.array([0], np.int64)), half, last)
    second = b.op("Slice", xf, half, b.const(np.array([np.iinfo(np.int64).max], np.int64)), last)
    rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
    y = b.op("Add", b.op("Mul", xf, b.op("Cast", cos, to=TensorProto.FLOAT)),
             b.op("Mul", rotated, b.op("Cast", sin, to=TensorProto.FLOAT)))
    b.op("Cast", y, out=node.output[0], to=types.get(x, TensorProto.FLOAT16))


DECOMPOSE = {(DOMAIN, ROPE): decompose_rope}
