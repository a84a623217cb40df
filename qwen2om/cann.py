"""CANN's ONNX parser as data, and the allow-list check built on it.

ATC (`--framework=5`) reads a node only through a parser plugin registered for the exact key
`<domain>::<the model's opset_import version for that domain>::<op_type>` (domain "" is ai.onnx;
no fallback to a lower opset), then each plugin maps the node's attributes onto a GE op, dropping or
refusing some. `data/cann-onnx-ops.json` lists every registration with the file, commit and line it
was read from, and the per-op constraints read from the plugins (tools/cann_table.py regenerates
it; docs/ascend.md says from what). `check` looks every node of a graph up as the parser does and
applies each constraint, so a construct nobody thought of fails here, with the source that says
why, instead of on the user's Ascend host after a long conversion.

What the table cannot know (qwen2om's own rules per CANN release, SoC capabilities) is
qwen2om/ascend.py's; `problems` there combines both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from qwen2om.errors import Qwen2omError

if TYPE_CHECKING:
    from qwen2om.ascend import Soc

ONNX = "ai.onnx"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing ATC would reject or mis-read, why, and the source that says so."""

    where: str  # a node name, tensor name, or "model"
    what: str  # op type / dtype / attribute
    reason: str
    source: str = ""  # repo:path@commit#Lline from the table, or the qwen2om rule

    def line(self) -> str:
        return f"{self.where}: {self.what}: {self.reason}" + (f" [{self.source}]" if self.source else "")


class CannTableError(Qwen2omError):
    """A --cann-table file that is not a table of CANN's registrations."""


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """Where one (domain, op_type) is registered: the opsets, the GE op and the lines."""

    opsets: frozenset[int]
    ge_op: str
    lines: tuple[str, ...]

    def opset_ranges(self) -> str:
        return ranges(self.opsets)


@dataclasses.dataclass(frozen=True)
class CannTable:
    """The registrations and constraints of one table file, with its provenance."""

    ops: Mapping[tuple[str, str], OpEntry]
    constraints: Mapping[str, Mapping[str, Any]]  # _constraints.ops
    parser: Mapping[str, Mapping[str, Any]]  # _constraints.parser by rule id
    history: tuple[Mapping[str, str], ...]
    repos: Mapping[str, str]
    path: str

    def source(self, rule: Mapping[str, Any] | None, fact: str) -> str:
        """file@commit#line of `fact` in a constraint, else the constraint's own source text."""
        if rule is None:
            return ""
        return str(rule.get("lines", {}).get(fact) or rule.get("source", ""))

    def provenance(self) -> str:
        """'hicann/ops-math@c41933244c31, ...': the repositories and commits the table was read from."""
        return ", ".join(f"{repo}@{commit[:12]}" if re.fullmatch(r"[0-9a-f]{40}", commit)
                         else f"{repo} (commits per file)" for repo, commit in self.repos.items())


def ranges(values: frozenset[int] | set[int]) -> str:
    """{8, 9, 10, 14} → '8-10, 14'."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


# -- loading ------------------------------------------------------------------------------------------
def _entry(raw: Mapping[str, Any]) -> OpEntry:
    opsets = raw["opsets"]
    # "any": built into the parser (Constant); no opset is ever missing for it
    return OpEntry(frozenset(range(1, 1000)) if opsets == "any" else frozenset(int(v) for v in opsets),
                   str(raw.get("ge_op", "")), tuple(raw.get("lines", ())) or (str(raw.get("source", "")),))


def parse_table(raw: Mapping[str, Any], path: str) -> CannTable:
    """A CannTable from the JSON form (tools/cann_table.py writes it)."""
    try:
        ops = {(ONNX, op): _entry(e) for op, e in raw.items() if not op.startswith("_")}
        for domain, by_op in raw.get("_other_domains", {}).items():
            ops.update({(domain, op): _entry(e) for op, e in by_op.items()})
        constraints = raw["_constraints"]
        parser = {str(c.get("rule", i)): c for i, c in enumerate(constraints.get("parser", []))}
        repos = {**raw["_meta"]["repos"], **raw["_meta"].get("parser_repos", {})}
        return CannTable(ops, constraints.get("ops", {}), parser, tuple(constraints.get("history", [])), repos, path)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CannTableError(f"{path}: not a table of CANN's ONNX registrations ({type(e).__name__}: {e}); "
                             "tools/cann_table.py writes one") from e


@functools.lru_cache(maxsize=1)
def shipped_table() -> CannTable:
    """qwen2om/data/cann-onnx-ops.json, read once per process (every graph of a conversion asks)."""
    text = resources.files("qwen2om").joinpath("data", "cann-onnx-ops.json").read_text(encoding="utf-8")
    return parse_table(json.loads(text), "qwen2om/data/cann-onnx-ops.json")


def load_table(path: str | Path | None = None) -> CannTable:
    """The shipped table, or the one at `path` (--cann-table; read each time: it may be edited)."""
    if path is None:
        return shipped_table()
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CannTableError(f"--cann-table {path}: {e}") from e
    if not isinstance(raw, dict):
        raise CannTableError(f"--cann-table {path}: a JSON object is expected, not {type(raw).__name__}")
    return parse_table(raw, str(path))


# -- the check ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Context:
    """What a per-op rule may look at besides the node."""

    table: CannTable
    soc: Soc | None
    version: int  # the model's opset_import version of the node's domain
    rule: Mapping[str, Any]  # the table's constraint entry

    @property
    def params(self) -> Mapping[str, Any]:
        return self.rule.get("params", {})


Finding = tuple[str, str, str]  # (what, fact, reason): fact names the line in the constraint's `lines`
OpRule = Callable[[ir.Node, Context], Iterator[Finding]]
RULES: dict[str, tuple[tuple[tuple[str, str], ...], OpRule]] = {}


def rule(key: str, *ops: str) -> Callable[[OpRule], OpRule]:
    """Register a check for the table's constraint `key`, applied to `ops` ("Shape", "npu::Op").
    A table without that constraint (a newer plugin that lifted it) turns the check off."""

    def add(fn: OpRule) -> OpRule:
        RULES[key] = (tuple(op_key(o) for o in ops), fn)
        return fn

    return add


def op_key(name: str) -> tuple[str, str]:
    """"npu::Op" → ("npu", "Op"); a bare name is ai.onnx's."""
    domain, _, op = name.rpartition("::")
    return (domain or ONNX, op)


def domain_versions(model: ir.Model) -> dict[str, int]:
    """opset_import as the parser keys it: "" is ai.onnx, a later entry overrides an earlier one."""
    return {(d or ONNX): v for d, v in model.opset_imports.items()}


def node_domain(node: ir.Node) -> str:
    return node.domain or ONNX


def what_of(node: ir.Node) -> str:
    return node.op_type if node_domain(node) == ONNX else f"{node.domain}::{node.op_type}"


def check(model: ir.Model, table: CannTable | None = None, soc: Soc | None = None) -> list[Problem]:
    """Every node, tensor and model-level fact of `model` the table says ATC rejects or mis-reads."""
    table = table or load_table()
    versions = domain_versions(model)
    out = [*model_problems(model, table, versions), *dtype_problems(model, table)]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        out += node_problems(node, table, versions, soc)
    return out


def model_problems(model: ir.Model, table: CannTable, versions: dict[str, int]) -> Iterator[Problem]:
    if model.functions:
        r = table.parser.get("functions")
        yield Problem("model", "local functions", "CANN's parser proto has no FunctionProto: model-local functions are "
                      "dropped and the nodes calling them do not resolve", table.source(r, "proto"))
    used = {node_domain(n) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    for domain, version in versions.items():
        if domain == ONNX or domain not in used:
            continue
        entries = [e for (d, _), e in table.ops.items() if d == domain]
        if not any(version in e.opsets for e in entries):
            have = ranges(set().union(*(e.opsets for e in entries))) if entries else ""
            yield Problem("model", f"domain {domain}", f"no CANN plugin registers an op for {domain} version {version}"
                          + (f" (registered: versions {have})" if have else ""),
                          entries[0].lines[0] if entries else table.source(table.parser.get("lookup"), "registry"))


def node_problems(node: ir.Node, table: CannTable, versions: dict[str, int], soc: Soc | None) -> list[Problem]:
    """The parser's lookup of one node, then the table's constraints on it."""
    where, domain = node.name or node.op_type, node_domain(node)
    if node.op_type in table.parser.get("builtin", {}).get("params", {}).get("op_types", ("Constant",)):
        return []  # Constant/FileConstant: read by the parser itself, whatever the domain or opset
    if domain not in versions:
        return [Problem(where, what_of(node), f"the model imports no opset for domain '{domain}': ATC stops ('The "
                        f"opset of domain[{domain}] has no responding version')",
                        table.source(table.parser.get("domain"), "missing"))]
    version = versions[domain]
    entry = table.ops.get((domain, node.op_type))
    if entry is None or version not in entry.opsets:
        reason = unregistered(node, version, entry, table)
        return [Problem(where, what_of(node), reason, key_source(entry, table))]
    out = []
    for key, (ops, fn) in RULES.items():
        if (domain, node.op_type) in ops and key in table.constraints:
            ctx = Context(table, soc, version, table.constraints[key])
            out += [Problem(where, what, reason, table.source(ctx.rule, fact)) for what, fact, reason in fn(node, ctx)]
    return out


def unregistered(node: ir.Node, version: int, entry: OpEntry | None, table: CannTable) -> str:
    domain, op = node_domain(node), node.op_type
    key = f"{domain}::{version}::{op}"
    if entry is not None and domain == "npu":
        return (f"{key} is not registered: npu ops are registered as npu::1::<Op> only, so the model must import "
                f"domain npu version 1 (it imports {version})")
    if entry is not None:
        return (f"{key} is not registered: CANN registers {op} for {domain} opsets {entry.opset_ranges()} only, and "
                "the parser does not fall back to another opset")
    elsewhere = sorted(f"{d}::{o}" for d, o in table.ops if o == op and d != domain)
    return (f"no CANN parser plugin registers {domain}::{op} at any opset: ATC stops ('no parser is registered' for "
            f"{key})" + (f"; it is registered as {', '.join(elsewhere)}" if elsewhere else ""))


def key_source(entry: OpEntry | None, table: CannTable) -> str:
    """The registration that lists the opsets there are (else the parser's registry lookup)."""
    return entry.lines[0] if entry is not None else table.source(table.parser.get("lookup"), "registry")


# -- tensors -----------------------------------------------------------------------------------------
def graph_values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs


def inline_tensors(model: ir.Model) -> Iterator[tuple[str, ir.DataType]]:
    """(name, dtype) of every tensor stored in the protobuf itself: initializers without external
    data, and Constant values. The parser reads these through ParseConvertData."""
    for v in model.graph.initializers.values():
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor):
            yield v.name or "?", v.const_value.dtype
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].value
            if not isinstance(tensor, ir.ExternalTensor):
                yield node.name or node.outputs[0].name or "Constant", tensor.dtype


def dtype_problems(model: ir.Model, table: CannTable) -> Iterator[Problem]:
    """Types the parser maps to DT_UNDEFINED, and inline tensors it has no size for (inline FP8)."""
    mapped_rule, inline_rule = table.parser.get("dtype_map"), table.parser.get("inline_fp8")
    seen: set[str] = set()
    if inline_rule is not None:
        inline_ok = set(inline_rule.get("params", {}).get("inline", ()))
        for name, dt in inline_tensors(model):
            if dt.value not in inline_ok and name not in seen:
                seen.add(name)
                yield Problem(name, dt.name, f"an inline {dt.name} tensor is refused ('data_type {dt.value} not "
                              "support': the constant parser has no size for it); store it as external data",
                              table.source(inline_rule, "sizes"))
    if mapped_rule is None:
        return
    mapped = set(mapped_rule.get("params", {}).get("mapped", ()))
    for v in graph_values(model.graph):
        if v.dtype is not None and v.dtype.value not in mapped and (v.name or "?") not in seen:
            seen.add(v.name or "?")
            yield Problem(v.name or "?", v.dtype.name, f"{v.dtype.name} maps to DT_UNDEFINED in CANN's ONNX parser",
                          table.source(mapped_rule, "map"))


# -- per-op constraints (keys are the table's `_constraints.ops` keys) --------------------------------
def attr_int(node: ir.Node, name: str) -> int | None:
    a = node.attributes.get(name)
    return None if a is None else a.as_int()


def attr_str(node: ir.Node, name: str) -> str | None:
    a = node.attributes.get(name)
    return None if a is None else a.as_string()


@rule("Shape", "Shape")
def shape_start_end(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    start, end = attr_int(node, "start"), attr_int(node, "end")
    if (start or 0) != 0 or end is not None:
        yield ("Shape start/end", "start_end", f"start={start}, end={end}: CANN's Shape plugin drops them (GE's Shape "
               "has no such attributes) and returns the full shape")


@rule("GatherND", "GatherND")
def gather_nd_batch_dims(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    if b := attr_int(node, "batch_dims"):
        yield f"GatherND batch_dims={b}", "batch_dims", "the plugin takes only batch_dims=0 and fails the parse"


@rule("ArgMax", "ArgMax")
@rule("ArgMin", "ArgMin")
def arg_select_last(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    if attr_int(node, "select_last_index"):
        yield (f"{node.op_type} select_last_index=1", "select_last_index",
               "the plugin takes only select_last_index=0 and fails the parse")


@rule("ScatterND", "ScatterND")
def scatter_nd_reduction(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    reduction = attr_str(node, "reduction") or "none"
    if reduction not in ctx.params.get("reductions", ("none", "add")):
        yield (f"ScatterND reduction={reduction}", "reduction", "ops-nn's plugin refuses 'mul', and ops-math registers "
               "the same key as TensorScatterUpdate, which drops 'reduction'; the registry keeps whichever loads first")


@rule("ReduceMean/ReduceMax/ReduceMin/ReduceProd/ReduceL1/ReduceL2",
      "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2")
def reduce_noop(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    if ctx.version < 13 and attr_int(node, "noop_with_empty_axes"):
        yield (f"{node.op_type} noop_with_empty_axes=1", "noop_with_empty_axes",
               f"the opset-{ctx.version} plugin ignores it (a warning): empty axes reduce over every axis")


@rule("TopK", "TopK")
def topk_int32(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    if ctx.version in ctx.params.get("attribute_k_opsets", (8, 9)):
        if attr_int(node, "k") is None:
            yield "TopK without k", "k_attr", f"opset-{ctx.version} TopK needs the attribute k"
        return
    k = node.inputs[1] if len(node.inputs) > 1 else None
    indices = node.outputs[1] if len(node.outputs) > 1 else None
    # A type the graph does not record is ONNX's: int64 for both.
    if k is None or k.dtype != ir.DataType.INT32:
        yield ("TopK k int64", "k_int32", "the plugin maps TopK 1:1 onto GE's TopK, whose k is int32 only "
               f"(here {k.dtype.name if k is not None and k.dtype else 'INT64'})")
    if indices is not None and indices.dtype != ir.DataType.INT32:
        yield ("TopK indices int64", "indices_int32", "GE's TopK returns int32 indices only "
               f"(the graph declares {indices.dtype.name if indices.dtype else 'INT64'})")


@rule("Cast", "Cast")
def cast_target(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    to = attr_int(node, "to")
    if to is not None and to not in ctx.params.get("ge_dtypes", range(1, 17)):
        name = dtype_name(to)
        yield (f"Cast to {name}", "map", f"{name} has no entry in the Cast plugin's onnx2om_dtype_map: dst_type "
               "becomes DT_UNDEFINED")


def dtype_name(value: int) -> str:
    try:
        return ir.DataType(value).name
    except ValueError:
        return str(value)


def constant_ints(v: ir.Value | None) -> list[int] | None:
    """The values of an inline constant (initializer or Constant output); None when computed or
    stored outside the graph file."""
    if v is None:
        return None
    tensor, producer = v.const_value, v.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is None or isinstance(tensor, ir.ExternalTensor):
        return None
    return [int(x) for x in tensor.numpy().reshape(-1)]


@rule("Reshape", "Reshape")
def reshape_allowzero(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    """allowzero only changes anything where the shape may hold a 0: a computed shape, or a constant one with a 0."""
    if not attr_int(node, "allowzero"):
        return
    shape = constant_ints(node.inputs[1] if len(node.inputs) > 1 else None)
    if shape is None or 0 in shape:
        yield ("Reshape allowzero=1", "allowzero", "the plugin copies allowzero onto an attribute GE's Reshape does "
               "not declare, so a 0 in the " + ("computed shape" if shape is None else f"shape {shape}")
               + " is read as 'copy the input dim', not as a zero-sized dim")


@rule("AscendAntiQuant", "AscendAntiQuant")
def antiquant_kernel(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    if len([i for i in node.inputs if i is not None]) > 1:
        yield "AscendAntiQuant tensor scale", "scalar", "the plugin reads scale/offset from float attributes only"
    if ctx.soc is None or ctx.soc.kernels not in ctx.params.get("nd_kernels", ()):
        on = ctx.soc.family if ctx.soc else "the SoCs qwen2om targets"
        yield ("AscendAntiQuant", "kernels", f"no kernel for ND int8 on {on}: the open-source kernel is Ascend950-only "
               "and the older op info lists int8 NC1HWC0 → fp16 NC1HWC0 only")


# -- WeightQuantBatchMatmulV2 ------------------------------------------------------------------------------
WEIGHT_DTYPES = {ir.DataType.INT8, ir.DataType.INT4, ir.DataType.INT32, ir.DataType.FLOAT8E4M3FN}


def static_dims(v: ir.Value | None) -> tuple[int | None, ...] | None:
    if v is None or v.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in v.shape)


def wqbmm_dims(node: ir.Node) -> tuple[int | None, int | None]:
    """(k, n): k from x's last dim or the weight's first, n from the scale's or the output's last."""
    x, w = static_dims(node.inputs[0]), static_dims(node.inputs[1] if len(node.inputs) > 1 else None)
    scale, y = static_dims(node.inputs[2] if len(node.inputs) > 2 else None), static_dims(node.outputs[0])
    k = (x[-1] if x else None) or (w[0] if w else None)
    n = (scale[-1] if scale and len(scale) == 2 else None) or (y[-1] if y else None)
    return k, n


@rule("WeightQuantBatchMatmulV2", "npu::WeightQuantBatchMatmulV2", "NPUWeightQuantBatchMatmulV2")
def wqbmm(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    yield from wqbmm_transpose(node)
    yield from wqbmm_group(node, ctx)
    yield from wqbmm_layout(node)
    yield from wqbmm_kernels(node, ctx)


def wqbmm_transpose(node: ir.Node) -> Iterator[Finding]:
    for name in ("transpose_x", "transpose_weight"):
        if attr_int(node, name):
            yield (f"{node.op_type} {name}=1", "transpose", f"the plugin forces {name}=false: this node's transpose "
                   "is ignored and the product is wrong")


def wqbmm_group(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    g, (k, _) = attr_int(node, "antiquant_group_size") or 0, wqbmm_dims(node)
    multiple = int(ctx.params.get("group_multiple", 32))
    if g and (g % multiple or (k is not None and g >= k)):
        yield (f"{node.op_type} antiquant_group_size={g}", "group_size",
               f"antiquant_group_size must be 0 or a multiple of {multiple} below k" + (f" = {k}" if k else ""))


def wqbmm_layout(node: ir.Node) -> Iterator[Finding]:
    """Weight (k, n), or (k, ⌈n/8⌉) int32 holding packed int4; scale (⌈k/g⌉, n) in x's dtype."""
    x, w = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    scale = node.inputs[2] if len(node.inputs) > 2 else None
    k, n = wqbmm_dims(node)
    g = attr_int(node, "antiquant_group_size") or 0
    if x is not None and x.dtype not in (None, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        yield f"{node.op_type} x {x.dtype.name}", "dtypes", "x must be float16 or bfloat16"
    if w is not None and w.dtype is not None and w.dtype not in WEIGHT_DTYPES:
        yield f"{node.op_type} weight {w.dtype.name}", "dtypes", "weight must be int8, int4, int32 (packed int4) or fp8"
    wd = static_dims(w)
    if wd and k and n and w is not None:
        want = (k, math.ceil(n / 8)) if w.dtype == ir.DataType.INT32 else (k, n)
        if wd != want:
            yield (f"{node.op_type} weight {list(wd)}", "layout", f"weight must be {list(want)} (k, n"
                   + (" / 8 int32 words of packed int4" if w.dtype == ir.DataType.INT32 else "")
                   + "): the plugin forces transpose_weight=false")
    sd = static_dims(scale)
    if sd and k and n:
        allowed = [(math.ceil(k / g), n)] if g else [(n,), (1, n), (1,), (1, 1)]
        if sd not in allowed:
            yield (f"{node.op_type} antiquant_scale {list(sd)}", "layout",
                   f"antiquant_scale must be {' or '.join(str(list(a)) for a in allowed)} (group size {g})")
    if scale is not None and x is not None and None not in (scale.dtype, x.dtype) and scale.dtype != x.dtype:
        yield (f"{node.op_type} antiquant_scale {scale.dtype.name}", "dtypes", "antiquant_scale must have x's dtype "
               f"({x.dtype.name})")


def wqbmm_kernels(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    """The SoC's op-info config (op_host/..._def.cpp AddConfig): which dtypes have a kernel there."""
    if ctx.soc is None:
        return
    kernels = ctx.params.get("kernels", {}).get(ctx.soc.kernels)
    fact = f"kernels_{ctx.soc.kernels.removeprefix('ascend')}"
    fact = fact if fact in ctx.rule.get("lines", {}) else "kernels"
    if kernels is None:
        yield (node.op_type, fact, f"{ctx.soc.family} has no WeightQuantBatchMatmulV2 kernel (configured for "
               f"{', '.join(ctx.params.get('kernels', {}))}); qwen2om's --set weight_storage=int8 stores int4 "
               "weights as int8 and dequantises them with standard ops (W8A16)")
        return
    x, w = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    have = [v.dtype.name for v in (x, w) if v is not None and v.dtype is not None]
    if (x is not None and x.dtype and x.dtype.name not in kernels["x"]) or (
            w is not None and w.dtype and w.dtype.name not in kernels["weight"]):
        yield (f"{node.op_type} {'/'.join(have)}", fact, f"{ctx.soc.family}'s kernel takes x {'/'.join(kernels['x'])} "
               f"and weight {'/'.join(kernels['weight'])} only")
    elif "conditions" in kernels:
        yield (node.op_type, f"conditions_{ctx.soc.kernels.removeprefix('ascend')}",
               f"{ctx.soc.family}'s kernel needs {kernels['conditions']}")


def npu_kernel(node: ir.Node, ctx: Context) -> Iterator[Finding]:
    """A fused npu op on a SoC whose op-info config has no kernel for it, or not for its dtypes."""
    from qwen2om.npu_kernels import missing_kernel  # it reads this module's table

    if ctx.soc is None:
        return
    names = ctx.params.get("inputs", [])
    dtypes = {name: v.dtype for name, v in zip(names, node.inputs, strict=False) if v is not None}
    if why := missing_kernel(node.op_type, ctx.soc, dtypes, ctx.table):
        yield (node.op_type, "kernels", why.rsplit(" [", 1)[0])


# The fused ops qwen2om emits (or, IncreFlashAttention, refuses to): each checked against the SoC's kernels
FUSED_NPU_OPS = ("NPURmsNorm", "NPUAddRmsNorm", "NPURotaryPositionEmbedding", "NPUIncreFlashAttention",
                 "NPUPromptFlashAttention", "NPUMoeGatingTopKSoftmax")
for _op in FUSED_NPU_OPS:
    rule(_op, f"npu::{_op}", _op)(npu_kernel)
