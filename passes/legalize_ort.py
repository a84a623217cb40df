"""Make exported graphs deterministic and portable: IR 8, opset ≤ 18, no bf16, readable names.

torch's exporter writes IR 10 and attaches stack traces (with absolute paths) to every node;
both are stripped so two conversions of the same inputs give byte-identical graphs. Nodes are
renamed after the module that produced them (`/model/layers.3/self_attn/q_proj/MatMul`).
"""

from __future__ import annotations

import ast
from collections import Counter
from typing import ClassVar

import onnx_ir as ir

from qwen2om.errors import Qwen2omError
from qwen2om.pipeline import PassResult, RunContext, Workspace, register

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


@register
class LegalizeOrt:
    """IR version / opset pinned, exporter metadata stripped, nodes named after modules, bf16 refused."""

    name: ClassVar[str] = "legalize_ort"
    requires: ClassVar[tuple[str, ...]] = ("graphs",)
    produces: ClassVar[tuple[str, ...]] = ("legal_graphs",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        r = ctx.recipe
        renamed = stripped = versions = 0
        for kind, model in ws.need("graphs").items():
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
        ws["legal_graphs"] = True
        changed = bool(renamed or stripped or versions)
        return PassResult(changed, {"nodes_renamed": renamed, "metadata_stripped": stripped,
                                    "ir_version_set": versions})
