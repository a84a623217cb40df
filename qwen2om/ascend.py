"""What the Ascend target can take: SoCs as data, and the ATC legality checker.

The checker lists every node or tensor of a graph that CANN's ONNX parser (ATC, `--framework=5`)
would reject or mis-read, with the reason and the source that says so: an allow-list built from the
table of CANN's parser registrations (qwen2om/cann.py), plus qwen2om's rules per CANN release.
`convert --target ascend` runs it before anything is written, and `qwen2om inspect PATH --check
ascend` runs it on any ONNX file or output directory. It works on onnx_ir models loaded without their external data, so
checking a 60 GB model reads only its graph.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from qwen2om.cann import (
    CannTable,
    Problem,
    domain_versions,
    dtype_problems,
    graph_values,
    load_table,
    model_problems,
    node_domain,
    node_problems,
)
from qwen2om.errors import Qwen2omError

__all__ = ["Problem", "Soc", "SOCS", "CannRelease", "RELEASES", "cann_release", "problems", "check_or_raise",
           "soc_info"]


@dataclasses.dataclass(frozen=True)
class Soc:
    """An Ascend SoC family as `--soc_version` names it, and what it runs."""

    pattern: str
    family: str
    # An int4 WeightQuantBatchMatmulV2 kernel exists here, so the int4 lowering emits one
    # (passes/lower_int4_ascend.py). Not 310P: its op info takes int8 weights only, under conditions
    # an ONNX node cannot state (the table's WeightQuantBatchMatmulV2 kernels); not 310B: none at all.
    w4a16: bool
    example: str
    kernels: str  # its op-info config name in CANN's ops repositories (op_host/config/<kernels>/)


SOCS = (
    Soc(r"910B[1-4]", "Atlas A2 (910B)", True, "Ascend910B3", "ascend910b"),
    Soc(r"910_93\d*", "Atlas A3 (910_93)", True, "Ascend910_9392", "ascend910_93"),
    Soc(r"310P[13]", "Atlas 300I Duo / 300V (310P)", False, "Ascend310P3", "ascend310p"),
    Soc(r"310B[1-4]", "Atlas 200I/500 A2, Orange Pi AIpro (310B)", False, "Ascend310B1", "ascend310b"),
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
# The authority is CANN's own parser, as data (qwen2om/cann.py). What follows is what that table
# cannot say: which CANN release the graph is for, and qwen2om's rules where the table and older
# releases disagree (docs/ascend.md, "Which rule wins").
@dataclasses.dataclass(frozen=True)
class CannRelease:
    """What qwen2om assumes of a CANN release beyond the table of registrations."""

    name: str
    summary: str
    max_opset: int | None  # the ai.onnx opset its parser is built for (None: the table's per-op opsets decide)
    max_ir: int | None
    trilu: bool  # Trilu's registration is trusted
    refused: frozenset[ir.DataType]  # tensor types refused although the table's GE maps them


RELEASE_7 = CannRelease("7", "CANN 7.x/8.x (the default, the safer rule): the table, and the older releases' "
                        "limits where the table is newer", 18, 8, False,
                        frozenset({ir.DataType.BFLOAT16, ir.DataType.INT4, ir.DataType.FLOAT8E4M3FN,
                                   ir.DataType.FLOAT8E5M2}))
RELEASES = {
    "7": RELEASE_7,
    "8": dataclasses.replace(RELEASE_7, name="8"),
    "table": CannRelease("table", "a CANN whose parser and plugins are built from the table's commits or later: the "
                         "table alone", None, None, True, frozenset()),
}


def cann_release(name: str | None) -> CannRelease:
    """`--cann-version`: 7.x and 8.x releases (7.0, 8.0.RC2, ...) share the default rules; `table` trusts the table."""
    if not name:
        return RELEASE_7
    key = name.lower() if name.lower() == "table" else name.split(".", 1)[0]
    if key not in RELEASES:
        raise Qwen2omError(f"--cann-version {name!r}: known are 7.x, 8.x (the default rules) and 'table' (the table "
                           "alone: a CANN built from its commits); CANN before 7.0 parses ai.onnx opset 15 at most, "
                           "below what qwen2om writes")
    return RELEASES[key]


# Sources of the rules that are qwen2om's, not read from CANN's code at the table's commits.
OLDER = "qwen2om rule for CANN 7/8 (docs/ascend.md, 'Which rule wins')"
OURS = "qwen2om rule (docs/ascend.md, 'What the checker checks')"
# Ops with what qwen2om does instead; Trilu only where the release's plugin is not trusted.
REJECTED_OPS = {
    "Trilu": "no parser in CANN 7/8 (the 2022 plugin tree: opset 14-15, no k input): masks must be precomputed "
             "(qwen2om's mask is a graph input)",
    "DequantizeLinear": "no parser in CANN: int4/int8 weights go through WeightQuantBatchMatmulV2",
    "QuantizeLinear": "no parser in CANN: use AscendQuant",
    "DynamicQuantizeLinear": "no parser in CANN",
    "MatMulInteger": "no parser in CANN: use WeightQuantBatchMatmulV2",
    "NonZero": "data-dependent output shape: an offline model needs static shapes",
}
BAD_DTYPES = {
    ir.DataType.BFLOAT16: "bfloat16 maps to DT_UNDEFINED in older releases of Ascend's ONNX parser (use fp16/fp32)",
    ir.DataType.INT4: "int4 ONNX tensors are parsed only by very recent CANN (pack int4 into int32 instead)",
    ir.DataType.FLOAT8E4M3FN: "FP8 tensors are not confirmed to parse before the table's parser (store FP8 as uint8 "
                              "bytes)",
    ir.DataType.FLOAT8E5M2: "FP8 tensors are not confirmed to parse before the table's parser",
    ir.DataType.DOUBLE: "float64 is not a compute type on the NPU",
}


def refused_dtype(dtype: ir.DataType | None, release: CannRelease) -> str | None:
    """The source of the rule refusing `dtype` under `release`, or None."""
    if dtype == ir.DataType.DOUBLE:
        return OURS
    return OLDER if dtype in release.refused else None


def model_rules(model: ir.Model, release: CannRelease) -> list[Problem]:
    out = []
    if release.max_ir is not None and model.ir_version > release.max_ir:
        out.append(Problem("model", f"ir_version {model.ir_version}", f"CANN {release.name}'s parser is built on ONNX "
                           f"1.12: IR version ≤ {release.max_ir}", OLDER))
    opset = domain_versions(model).get("ai.onnx")
    if release.max_opset is not None and opset is not None and opset > release.max_opset:
        out.append(Problem("model", f"opset {opset}", f"CANN {release.name} parses ai.onnx opset 9-{release.max_opset}",
                           OLDER))
    return out


def dtype_rules(model: ir.Model, release: CannRelease) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for v in graph_values(model.graph):
        source = refused_dtype(v.dtype, release)
        if v.dtype is not None and source and (v.name or "") not in seen:
            seen.add(v.name or "")
            out.append(Problem(v.name or "?", v.dtype.name, BAD_DTYPES[v.dtype], source))
    return out


def node_rules(node: ir.Node, release: CannRelease, table: CannTable) -> list[Problem]:
    where, domain = node.name or node.op_type, node_domain(node)
    if domain != "ai.onnx":
        return []
    if node.op_type in REJECTED_OPS and not (node.op_type == "Trilu" and release.trilu):
        source = table.constraints.get(node.op_type, {}).get("source", OURS)
        return [Problem(where, node.op_type, REJECTED_OPS[node.op_type], str(source))]
    if node.op_type == "Cast" and "to" in node.attributes:
        try:
            to = ir.DataType(node.attributes["to"].as_int())
        except ValueError:  # no ONNX type at all: the table's Cast rule names it
            return []
        if to == ir.DataType.INT8:
            return [Problem(where, "Cast to int8", "loses precision on Ascend: use AscendQuant", OURS)]
        if source := refused_dtype(to, release):
            return [Problem(where, f"Cast to {to.name}", BAD_DTYPES[to], source)]
    return []


def merged(first: list[Problem], then: list[Problem]) -> list[Problem]:
    """`first`, with each problem of `then` added, or its reason appended to the problem of `first`
    naming the same (where, what): one line per construct, every reason kept. Called per node, so
    two nodes sharing a name (or none) are never folded together."""
    out = list(first)
    for p in then:
        i = next((i for i, q in enumerate(out) if (q.where, q.what) == (p.where, p.what)), None)
        if i is None:
            out.append(p)
        elif p.reason not in out[i].reason:
            out[i] = dataclasses.replace(out[i], reason=f"{out[i].reason}; {p.reason}")
    return out


def problems(model: ir.Model, soc: Soc | None = None, table: CannTable | None = None,
             release: CannRelease | None = None) -> list[Problem]:
    """Everything in `model` that ATC would reject or mis-read (empty when legal): the table's
    allow-list (qwen2om/cann.py), then the release's and qwen2om's own rules."""
    table, release = table or load_table(), release or RELEASE_7
    versions = domain_versions(model)
    out = merged(list(model_problems(model, table, versions)), model_rules(model, release))
    out += merged(list(dtype_problems(model, table)), dtype_rules(model, release))
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        out += merged(node_problems(node, table, versions, soc), node_rules(node, release, table))
    return out


def check_or_raise(graphs: dict[str, ir.Model], soc: Soc | None, table: CannTable | None = None,
                   release: CannRelease | None = None) -> None:
    """Raise one error listing every problem of every graph; nothing has been written yet."""
    found = [(kind, p) for kind, model in graphs.items() for p in problems(model, soc, table, release)]
    if found:
        shown = "\n".join(f"  {kind} graph: {p.line()}" for kind, p in found[:40])
        more = f"\n  … and {len(found) - 40} more" if len(found) > 40 else ""
        raise Qwen2omError(f"the graphs would fail ATC ({len(found)} problems); nothing was written:\n{shown}{more}")
