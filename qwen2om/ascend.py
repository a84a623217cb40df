"""What the Ascend target can take: SoCs as data, and the ATC legality checker.

The checker lists every node or tensor of a graph that CANN's ONNX parser (ATC, `--framework=5`)
would reject or mis-read, with the reason (shared/reference/ascend-atc.md). `convert --target
ascend` runs it before anything is written, and `qwen2om inspect PATH --check ascend` runs it on any
ONNX file or output directory. It works on onnx_ir models loaded without their external data, so
checking a 60 GB model reads only its graph.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import onnx_ir as ir

from qwen2om.errors import Qwen2omError
from qwen2om.kernels.ascend import ANTIQUANT, NPU_DOMAIN, WQBMM


@dataclasses.dataclass(frozen=True)
class Soc:
    """An Ascend SoC family as `--soc_version` names it, and what it runs."""

    pattern: str
    family: str
    w4a16: bool  # has WeightQuantBatchMatmulV2 (int4/int8 weights, fp16 activations)
    example: str


SOCS = (
    Soc(r"910B[1-4]", "Atlas A2 (910B)", True, "Ascend910B3"),
    Soc(r"910_93\d*", "Atlas A3 (910_93)", True, "Ascend910_9392"),
    Soc(r"310P[13]", "Atlas 300I Duo / 300V (310P)", True, "Ascend310P3"),
    Soc(r"310B[1-4]", "Atlas 200I/500 A2, Orange Pi AIpro (310B)", False, "Ascend310B1"),
)
KNOWN = "Ascend910B1..B4, Ascend910_93xx, Ascend310P1/P3, Ascend310B1..B4"


class SocError(Qwen2omError):
    """An SoC name ATC would not take."""


def soc_info(name: str) -> Soc:
    for soc in SOCS:
        if re.fullmatch(rf"Ascend{soc.pattern}", name or ""):
            return soc
    shown = repr(name) if name else "(none given)"
    raise SocError(f"--soc-version {shown} is not an Ascend SoC ATC takes; known: {KNOWN} "
                   "(the chip name `npu-smi info` prints, prefixed with 'Ascend')")


# -- legality ---------------------------------------------------------------------------------------
MAX_OPSET, MAX_IR = 18, 8
# Ops the CANN parser has no (reliable) mapping for, with what qwen2om does instead.
REJECTED_OPS = {
    "Trilu": "no parser in CANN 7/8: masks must be precomputed (qwen2om's mask is a graph input)",
    "DequantizeLinear": "no parser in older CANN: int4/int8 weights go through WeightQuantBatchMatmulV2",
    "QuantizeLinear": "no parser in older CANN: use AscendQuant",
    "DynamicQuantizeLinear": "no parser in CANN",
    "MatMulInteger": "no parser in CANN: use WeightQuantBatchMatmulV2",
    "NonZero": "data-dependent output shape: an offline model needs static shapes",
}
BAD_DTYPES = {
    ir.DataType.BFLOAT16: "bfloat16 maps to DT_UNDEFINED in Ascend's ONNX parser (use fp16/fp32)",
    ir.DataType.INT4: "int4 ONNX tensors are parsed only by very recent CANN (pack int4 into int32 instead)",
    ir.DataType.UINT4: "uint4 ONNX tensors are parsed only by very recent CANN",
    ir.DataType.FLOAT8E4M3FN: "FP8 initializers are not confirmed to parse (store FP8 as uint8 bytes)",
    ir.DataType.FLOAT8E4M3FNUZ: "FP8 tensors are not confirmed to parse",
    ir.DataType.FLOAT8E5M2: "FP8 tensors are not confirmed to parse",
    ir.DataType.FLOAT8E5M2FNUZ: "FP8 tensors are not confirmed to parse",
    ir.DataType.DOUBLE: "float64 is not a compute type on the NPU",
}
ASCEND_OPS = {(NPU_DOMAIN, WQBMM), ("", ANTIQUANT)}


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str  # a node name, tensor name, or "model"
    what: str  # op type / dtype / field
    reason: str

    def line(self) -> str:
        return f"{self.where}: {self.what}: {self.reason}"


def _values(graph: ir.Graph) -> Iterable[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


def problems(model: ir.Model, soc: Soc | None = None) -> list[Problem]:
    """Everything in `model` that ATC would reject or mis-read (empty when legal)."""
    out: list[Problem] = []
    if model.ir_version > MAX_IR:
        out.append(Problem("model", f"ir_version {model.ir_version}", f"CANN's parser is built on ONNX 1.12: IR "
                                                                      f"version ≤ {MAX_IR}"))
    for domain, version in model.opset_imports.items():
        if domain in ("", "ai.onnx") and version > MAX_OPSET:
            out.append(Problem("model", f"opset {version}", f"CANN parses ai.onnx opset 9-{MAX_OPSET}"))
        elif domain not in ("", "ai.onnx", NPU_DOMAIN):
            out.append(Problem("model", f"domain {domain}", "a custom domain CANN's parser does not know"))
    if model.functions:
        out.append(Problem("model", "local functions", "CANN's parser (ONNX 1.12, IR 8) takes no model functions"))
    graph = model.graph
    seen: set[str] = set()
    for v in _values(graph):
        if v.dtype in BAD_DTYPES and (v.name or "") not in seen:
            seen.add(v.name or "")
            out.append(Problem(v.name or "?", v.dtype.name, BAD_DTYPES[v.dtype]))
    for node in graph:
        where = node.name or node.op_type
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain not in ("", NPU_DOMAIN):
            out.append(Problem(where, f"{domain}::{node.op_type}", "not an op CANN's parser knows (an ONNX Runtime "
                                                                   "contrib op: convert with --target ascend)"))
        elif domain == NPU_DOMAIN and (domain, node.op_type) not in ASCEND_OPS:
            out.append(Problem(where, f"npu::{node.op_type}", "not an Ascend op qwen2om knows how to emit"))
        elif node.op_type in REJECTED_OPS and domain == "":
            out.append(Problem(where, node.op_type, REJECTED_OPS[node.op_type]))
        elif node.op_type == "Cast" and "to" in node.attributes:
            to = ir.DataType(node.attributes["to"].as_int())
            if to == ir.DataType.INT8:
                out.append(Problem(where, "Cast to int8", "loses precision on Ascend: use AscendQuant"))
            elif to in BAD_DTYPES:
                out.append(Problem(where, f"Cast to {to.name}", BAD_DTYPES[to]))
        if soc is not None and not soc.w4a16 and (domain, node.op_type) == (NPU_DOMAIN, WQBMM):
            out.append(Problem(where, WQBMM, f"{soc.family} has no WeightQuantBatchMatmulV2 (W4A16): use int8 "
                                             "storage + AscendAntiQuant (weight_storage=int8)"))
    return out


def check_or_raise(graphs: dict[str, ir.Model], soc: Soc | None) -> None:
    """Raise one error listing every problem of every graph; nothing has been written yet."""
    found = [(kind, p) for kind, model in graphs.items() for p in problems(model, soc)]
    if found:
        shown = "\n".join(f"  {kind} graph: {p.line()}" for kind, p in found[:40])
        more = f"\n  … and {len(found) - 40} more" if len(found) > 40 else ""
        raise Qwen2omError(f"the graphs would fail ATC ({len(found)} problems); nothing was written:\n{shown}{more}")
