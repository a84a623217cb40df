"""Reference kernel of the NPU's MoE gating op, as qwen2om emits it in the `npu` domain.

`npu::NPUMoeGatingTopKSoftmax(x; k)` → (y, expert_idx, row_idx)   (GE MoeGatingTopKSoftmax)
    x           [rows, E] or [d0, d1, E] router logits, float16 / float32 / bfloat16
    y           the k largest of softmax(x) over all E experts, descending: NOT renormalised;
                the softmax is computed in float32, y is returned in x's dtype
    expert_idx  int32, their experts; equal probabilities put the lower expert first
    row_idx     int32, row_idx[r, j] = j·rows + r (k-major), rows = the product of x's leading dims
    0 < k ≤ min(E, 1024); the plugin requires the INT attribute `k` (no default). The optional second
    input `finished` (rows whose expert_idx becomes E) is never emitted by qwen2om.

Sources: the table's `_constraints.ops.NPUMoeGatingTopKSoftmax` (the plugin's attribute, the op's
proto, README and kernel lines). The tie order follows AscendC's Sort (stable: lower index first), as
torch.topk and ONNX TopK order ties; it is not yet checked on hardware.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto

from qwen2om.kernels.builder import Builder, attrs

DOMAIN = "npu"
GATING = "NPUMoeGatingTopKSoftmax"
MAX_K = 1024  # the tiling's bound on k (the table's params.max_k)


def moe_gating_top_k_softmax(x: np.ndarray, *, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y in x's dtype, expert_idx int32, row_idx int32), each of shape x.shape[:-1] + (k,)."""
    x = np.asarray(x)
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be 2-D or 3-D, not shape {x.shape}")
    experts = x.shape[-1]
    if not 0 < k <= min(experts, MAX_K):
        raise ValueError(f"k={k} is outside 0 < k ≤ min(E={experts}, {MAX_K})")
    xf = x.astype(np.float32)
    p = np.exp(xf - xf.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    # a stable sort of −p: negation is exact, so equal probabilities keep the lower expert first
    index = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    y = np.take_along_axis(p, index, axis=-1).astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    row_idx = (np.arange(k)[None, :] * rows + np.arange(rows)[:, None]).reshape(*x.shape[:-1], k)
    return y, index.astype(np.int32), row_idx.astype(np.int32)


# -- decomposition into standard ONNX ops ---------------------------------------------------------
def decompose_gating(b: Builder, node: onnx.NodeProto, types: Mapping[str, int]) -> None:
    """Cast → Softmax (float32) → TopK (int64 k; ONNX orders ties by the lower index) → Cast back;
    row_idx from Range over the rows and the k slots."""
    if len(node.input) > 1 and node.input[1]:
        raise NotImplementedError(f"{node.name}: the `finished` input has no decomposition (qwen2om never emits it)")
    k = int(attrs(node)["k"])  # type: ignore[call-overload]
    x = node.input[0]
    y, expert_idx, row_idx = [*node.output, "", "", ""][:3]
    probs = b.op("Softmax", b.op("Cast", x, to=TensorProto.FLOAT), axis=-1)
    values, index = b.ops("TopK", probs, b.const(np.array([k], np.int64)), n=2, axis=-1, largest=1, sorted=1)
    if y:
        b.op("Cast", values, out=y, to=types.get(x, TensorProto.FLOAT16))
    if expert_idx:
        b.op("Cast", index, out=expert_idx, to=TensorProto.INT32)
    if row_idx:
        lead = b.op("Shape", x, end=-1)
        rows = b.op("ReduceProd", lead, keepdims=0)
        zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
        r = b.op("Unsqueeze", b.op("Range", zero, rows, one), b.const(np.array([1])))  # [rows, 1]
        j = b.op("Mul", b.const(np.arange(k, dtype=np.int64)[None, :]), rows)  # [1, k]
        flat = b.op("Add", r, j)  # [rows, k]
        shape = b.op("Concat", lead, b.const(np.array([k], np.int64)), axis=0)
        b.op("Cast", b.op("Reshape", flat, shape), out=row_idx, to=TensorProto.INT32)


DECOMPOSE = {(DOMAIN, GATING): decompose_gating}
