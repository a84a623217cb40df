"""Make exported graphs deterministic and portable: IR 8, opset ≤ 18, no bf16, readable names.

torch's exporter writes IR 10 and attaches stack traces (with absolute paths) to every node;
both are stripped so two conversions of the same inputs give byte-identical graphs. Nodes are
renamed after the module that produced them (`/model/layers.3/self_attn/q_proj/MatMul`).

Two shape constructs of the exporter's that CANN's ONNX parser misreads are rewritten for every
target (ONNX Runtime computes the same numbers either way; shared/reference/cann-onnx-ops.json,
`_constraints`):

- `Shape(x, start, end)`: GE's Shape has no start/end, so the plugin returns the whole shape. A
  prefill graph exported with gears reads T and P + T that way from the mask, into the Concat that
  builds a Reshape target. It becomes the static dims as a constant where all of them are static,
  else `Gather(Shape(x), [start..end-1])`.
- `Reshape`'s `allowzero`, set by the exporter on every Reshape: copied to an attribute GE's
  Reshape does not declare. It is dropped where it cannot change the result (see
  `allowzero_irrelevant`); one it might is kept, and the Ascend checker names it.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.errors import Qwen2omError
from qwen2om.graph_rewrite import const
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def scope_path(scopes: list[str]) -> str:
    """`model.layers.3.self_attn.q_proj` → `/model/layers.3/self_attn/q_proj`."""
    module = scopes[-2] if len(scopes) >= 2 else ""
    parts, out = module.split(".") if module else [], []
    for p in parts:
        if p.isdigit() and out:
            out[-1] = f"{out[-1]}.{p}"
        else:
            out.append(p)
    return "/" + "/".join(out) if out else ""


def node_names(graph: ir.Graph) -> dict[ir.Node, str]:
    """A readable, unique name per node, derived from the module scope the exporter recorded."""
    names: dict[ir.Node, str] = {}
    seen: Counter[str] = Counter()
    for node in graph:
        raw = node.metadata_props.get(SCOPES_KEY)
        scopes = ast.literal_eval(raw) if raw else []
        base = f"{scope_path(scopes)}/{node.op_type}"
        seen[base] += 1
        names[node] = base if seen[base] == 1 else f"{base}_{seen[base] - 1}"
    return names


def bf16_tensors(graph: ir.Graph) -> list[str]:
    bad = [v.name for v in graph.initializers.values() if v.dtype == ir.DataType.BFLOAT16]
    bad += [v.name or "?" for n in graph for v in n.outputs if v.dtype == ir.DataType.BFLOAT16]
    bad += [v.name or "?" for v in (*graph.inputs, *graph.outputs) if v.dtype == ir.DataType.BFLOAT16]
    return bad


def standard(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def slice_shapes(graph: ir.Graph) -> int:
    """Every `Shape(x, start, end)` → a constant (the dims it reads are static) or `Gather(Shape(x),
    [start..end-1])`; how many. Run before the nodes are named: the new nodes take the Shape's scope."""
    done = 0
    for node in list(graph):
        if not standard(node, "Shape") or not ({"start", "end"} & set(node.attributes)) or node.inputs[0] is None:
            continue
        dims = node.inputs[0].shape
        if dims is None:  # no rank to resolve negative bounds against; the checker names what is left
            continue
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", len(dims))
        picked = list(dims)[start:end]  # Python's slice clamps and wraps exactly as Shape's start/end do
        out = node.outputs[0]
        if out.is_graph_output():
            continue
        if all(isinstance(d, int) for d in picked):
            out.replace_all_uses_with(const(graph, f"shape{picked}", np.array(picked, np.int64)))
            graph.remove(node, safe=True)
        else:
            node.attributes.pop("start", None)
            node.attributes.pop("end", None)
            index = const(graph, f"shape_index{list(range(len(dims)))[start:end]}",
                          np.array(range(len(dims))[start:end], np.int64))
            gather = ir.Node("", "Gather", [out, index], [ir.AttrInt64("axis", 0)], num_outputs=1)
            gather.metadata_props.update(node.metadata_props)  # named after the same module
            gather.outputs[0].shape, gather.outputs[0].type = ir.Shape([len(picked)]), out.type
            for user, i in list(out.uses()):
                if user is not gather:
                    user.replace_input_with(i, gather.outputs[0])
            out.shape = ir.Shape([len(dims)])
            graph.insert_after(node, gather)
        done += 1
    return done


def token_symbols(graph: ir.Graph) -> set[str]:
    """The symbolic dims of the graph's inputs: the token count T of a prefill graph exported for gears
    (qwen2om's only symbolic axis). Each is ≥ 1 at run time: recipes refuse a gear below 1."""
    return {d.value for v in graph.inputs if v.shape is not None for d in v.shape
            if isinstance(d, ir.SymbolicDim) and d.value and d.value.isidentifier()}


def positive(dim: int | ir.SymbolicDim, symbols: set[str]) -> bool:
    """`dim` is ≥ 1 for sure: a positive integer, or sums and products of token symbols and positive
    integers (`T`, `T+256`, `2*T`)."""
    if isinstance(dim, int):
        return dim > 0
    text = dim.value or ""
    return bool(re.fullmatch(r"[\w\s+*()]+", text)) and all(
        t in symbols or (t.isdigit() and int(t) > 0) for t in re.findall(r"\w+", text))


def allowzero_irrelevant(node: ir.Node, symbols: set[str]) -> bool:
    """allowzero only decides what a 0 in the target shape means. A constant target without a 0 has
    none; and a non-empty input has none either (every dim ≥ 1), since a target with a 0 would hold
    no elements. So dropping the attribute changes nothing in those cases."""
    data, target = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if target is not None and target.const_value is not None and 0 not in target.const_value.numpy():
        return True
    return data is not None and data.shape is not None and all(positive(d, symbols) for d in data.shape)


def drop_allowzero(graph: ir.Graph) -> tuple[int, int]:
    """Remove `allowzero` from every Reshape where it is irrelevant; (dropped, kept)."""
    symbols, dropped, kept = token_symbols(graph), 0, 0
    for node in graph:
        if not standard(node, "Reshape") or "allowzero" not in node.attributes:
            continue
        if node.attributes.get_int("allowzero", 0) == 0 or allowzero_irrelevant(node, symbols):
            node.attributes.pop("allowzero")
            dropped += 1
        else:
            kept += 1
    return dropped, kept


@register
class LegalizeOrt:
    """IR version / opset pinned, exporter metadata stripped, nodes named after modules, bf16 refused."""

    name: ClassVar[str] = "legalize_ort"
    requires: ClassVar[tuple[str, ...]] = ("graphs",)
    produces: ClassVar[tuple[str, ...]] = ("graphs_legal",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        r = ctx.recipe
        renamed = stripped = versions = sliced = dropped = kept = 0
        for kind, model in state.graphs.items():
            graph = model.graph
            if bad := bf16_tensors(graph):
                raise Qwen2omError(f"{kind} graph has bf16 tensors, which no target accepts: {bad[:5]}")
            # com.microsoft is ONNX Runtime's own (the fuse_* passes' kernels, run after this pass; a
            # finished ORT graph passed through again keeps them). check_ascend refuses it for Ascend.
            if unknown := {d: v for d, v in model.opset_imports.items() if d not in ("", "ai.onnx", "com.microsoft")}:
                raise Qwen2omError(f"{kind} graph imports non-standard domains {unknown}")
            if model.opset_imports.get("", 0) > r.opset:
                raise Qwen2omError(f"{kind} graph uses opset {model.opset_imports['']}, above {r.opset}")
            if model.functions:
                raise Qwen2omError(f"{kind} graph has {len(model.functions)} local functions; IR 8 wants none")
            sliced += slice_shapes(graph)
            d, k = drop_allowzero(graph)
            dropped, kept = dropped + d, kept + k
            for node, new in node_names(graph).items():
                if node.name != new:
                    node.name, renamed = new, renamed + 1
            for item in (*graph, *graph.inputs, *graph.outputs, *graph.initializers.values()):
                if item.metadata_props:
                    stripped += 1
                    item.metadata_props.clear()
            for node in graph:
                for v in node.outputs:
                    if v.metadata_props:
                        v.metadata_props.clear()
            if model.ir_version != r.ir_version:
                model.ir_version, versions = r.ir_version, versions + 1
            model.producer_name, model.producer_version = "qwen2om", ctx.tool_version
        changed = bool(renamed or stripped or versions or sliced or dropped)
        return PassResult(changed, {"nodes_renamed": renamed, "metadata_stripped": stripped,
                                    "ir_version_set": versions, "shapes_sliced": sliced, "allowzero_dropped": dropped,
                                    "allowzero_kept": kept})
