"""What each compile target accepts, as data (not as `if target == ...` scattered through passes).

Scale ranges: a quantisation scale must be representable, as a normal number, in the dtype the
target's graph holds it in; outside that range it flushes to zero or overflows and every weight of
its group or tile is lost. ONNX Runtime (and Ascend, for FP8): FP8 scales stay float32 (the graph dequantises in fp32);
int4 MatMulNBits takes its scales in the activations' dtype. A recipe's `scale_range: [lo, hi]`
replaces these bounds.
"""

from __future__ import annotations

FLOAT32_NORMAL = (1.1754944e-38, 3.4028235e38)
FLOAT16_NORMAL = (6.103515625e-05, 65504.0)

# target → scheme → compute dtype → the dtype the graph holds that scheme's scales in
SCALE_DTYPE: dict[str, dict[str, dict[str, str]]] = {
    "ort": {"fp8": {"fp32": "float32", "fp16": "float32"}, "int4": {"fp32": "float32", "fp16": "float16"}},
    # Ascend: WeightQuantBatchMatmulV2's antiquant_scale is fp16 (int4 needs fp16 activations);
    # FP8 is dequantised by standard ops in float32, as for ort.
    "ascend": {"fp8": {"fp32": "float32", "fp16": "float32"}, "int4": {"fp32": "float16", "fp16": "float16"}},
}
DTYPE_RANGE = {"float32": FLOAT32_NORMAL, "float16": FLOAT16_NORMAL}


def scale_range(target: str, scheme: str, compute: str) -> tuple[str, tuple[float, float]]:
    """(the scale's dtype in the graph, its accepted [lo, hi])."""
    dtype = SCALE_DTYPE[target][scheme][compute]
    return dtype, DTYPE_RANGE[dtype]
