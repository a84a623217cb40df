"""Compile targets as data: which bundled recipe each converts with, the recipe fields only it reads
and the values they take, the SoCs it compiles for, and the dtype it holds quantisation scales in.
Code asks the registry (`TARGETS.get(r.target)`), not `if target == "ascend"`.

Scale ranges: a quantisation scale must be representable, as a normal number, in the dtype the
target's graph holds it in; outside that range it flushes to zero or overflows and every weight of
its group or tile is lost. ONNX Runtime (and Ascend, for FP8): FP8 scales stay float32 (the graph dequantises in fp32);
int4 MatMulNBits takes its scales in the activations' dtype. A recipe's `scale_range: [lo, hi]`
replaces these bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qwen2om.ascend import SOCS, Soc
from qwen2om.registry import Registry

FLOAT32_NORMAL = (1.1754944e-38, 3.4028235e38)
FLOAT16_NORMAL = (6.103515625e-05, 65504.0)
DTYPE_RANGE = {"float32": FLOAT32_NORMAL, "float16": FLOAT16_NORMAL}

PRECISIONS = ("origin", "mixed_float16", "fp16")  # ATC --precision_mode_v2: origin keeps the graph's dtypes
WEIGHT_STORAGE = ("auto", "int8")  # int8: int4 weights stored as int8, dequantised by Cast + Mul (310B: W8A16)
COMPILE = ("auto", "dry-run")  # auto: run atc when CANN is installed; dry-run: write the commands only
MAX_GEARS = 100  # ATC accepts at most 100 --dynamic_dims gears; recipes hold every target to that


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target, as `--target` names it."""

    name: str
    summary: str
    # The bundled recipes/<recipe>.yaml: this target's pipeline, with no family (the checkpoint says
    # which). Converting without --recipe uses it.
    recipe: str
    # The name of that recipe filled in for one family and compute dtype: what manifest.json records and
    # `--recipe` takes (`qwen3-ascend-fp16`, from when each family had its own copy).
    recipe_name: str
    # scheme → compute dtype → the dtype the graph holds that scheme's scales in
    scale_dtype: Mapping[str, Mapping[str, str]]
    # Recipe fields only this target reads. Every other target refuses them at anything but their default:
    # a setting that shapes nothing must not be recorded in a manifest as if it had.
    fields: tuple[str, ...] = ()
    choices: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # values of those fields
    # The chips its `soc_version` may name (ascend.py); a target with SoCs needs one named before it converts.
    socs: tuple[Soc, ...] = ()
    # run.py's --backend that runs the compiled model on the device; none: run.py runs the ONNX graphs
    device_backend: str = ""

    def named(self, family: str, dtype: str) -> str:
        """This target's bundled recipe for `family` in `dtype`, by name (`qwen3-fp32`)."""
        return self.recipe_name.format(family=family, dtype=dtype)


TARGETS: Registry[Target] = Registry("target")

ORT = TARGETS.add(Target(
    "ort", "ONNX Runtime: an optimised offline ONNX model, the portable reference backend",
    recipe="ort", recipe_name="{family}-{dtype}",
    scale_dtype={"fp8": {"fp32": "float32", "fp16": "float32"}, "int4": {"fp32": "float32", "fp16": "float16"}},
))
ASCEND = TARGETS.add(Target(
    "ascend", "Huawei Ascend NPU: ATC (CANN, --framework=5) compiles the graph into an offline model (.om)",
    recipe="ascend", recipe_name="{family}-ascend-{dtype}",
    # WeightQuantBatchMatmulV2's antiquant_scale is fp16 (int4 needs fp16 activations);
    # FP8 is dequantised by standard ops in float32, as for ort.
    scale_dtype={"fp8": {"fp32": "float32", "fp16": "float32"}, "int4": {"fp32": "float16", "fp16": "float16"}},
    fields=("soc_version", "precision", "weight_storage", "compile"),
    choices={"precision": PRECISIONS, "weight_storage": WEIGHT_STORAGE, "compile": COMPILE},
    socs=SOCS,
    device_backend="acl",
))


def scale_range(target: str, scheme: str, compute: str) -> tuple[str, tuple[float, float]]:
    """(the scale's dtype in the graph, its accepted [lo, hi])."""
    dtype = TARGETS.get(target).scale_dtype[scheme][compute]
    return dtype, DTYPE_RANGE[dtype]
