"""Fold each residual Add into the RMSNorm that reads it: `com.microsoft::SkipSimplifiedLayerNormalization`.

ONNX Runtime already fuses qwen2om's RMSNorm (`x / sqrt(mean(x²) + eps) · w`) into one
SimplifiedLayerNormalization at load, but not the residual Add in front of it, which its graph
optimizer only folds for the exporter patterns it knows. Every decoder layer has two such pairs
(`x + attn` → post_attention_layernorm, `x + mlp` → the next layer's input_layernorm or the final
norm):

    s = Add(a, b);  y = RMSNorm(s)     (s also read by the next residual Add)
        becomes
    y, _, _, s = SkipSimplifiedLayerNormalization(a, b, w; epsilon)

one pass over the hidden state instead of two, and two nodes fewer per layer. A pipeline stage's first
norm reads the stage's `hidden_in` input, which the stage before computed with the Add: it becomes
SkipSimplifiedLayerNormalization(hidden_in, 0), so that a staged model runs the same kernel on the same
sum as the unstaged one and gives bit-identical logits (SimplifiedLayerNormalization rounds differently).
Only the exact fp32
pattern is rewritten (Pow, ReduceMean, Add ε, Sqrt, Div, Mul w); anything else (fp16 graphs, whose
statistics go through Casts, or the hybrids' zero-centred norms) is left to ONNX Runtime's own fusion.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import MS_DOMAIN
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.signature import HIDDEN_IN

NORM = QWEN_NAMES.norm_scope_re()
PATTERN = ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]


def norm_regions(graph: ir.Graph) -> dict[str, list[ir.Node]]:
    found: dict[str, list[ir.Node]] = {}
    for node in graph:
        if m := NORM.match(node.name or ""):
            found.setdefault(m.group(1), []).append(node)
    return found


def scalar(v: ir.Value | None) -> float | None:
    if v is None or v.const_value is None or v.const_value.size != 1:
        return None
    return float(np.asarray(v.const_value.numpy()).reshape(()))


@register
class FuseNorm:
    """Residual Add + RMSNorm → one com.microsoft::SkipSimplifiedLayerNormalization (ONNX Runtime)."""

    name: ClassVar[str] = "fuse_norm"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal")
    produces: ClassVar[tuple[str, ...]] = ("norms_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        stats: dict[str, int | float | str] = {}  # per graph: a sum counts each layer's norms twice
        for kind, model in state.graphs.items():
            here = sum(self.fuse(model.graph, scope, nodes) for scope, nodes in norm_regions(model.graph).items())
            if here:
                model.opset_imports[MS_DOMAIN] = 1
            stats[f"{kind}_fused_norms"] = here
        return PassResult(any(stats.values()), stats)

    @staticmethod
    def fuse(graph: ir.Graph, scope: str, nodes: list[ir.Node]) -> bool:
        """Rewrite one norm and the Add that feeds it, if they are the exact pattern; say whether."""
        if [n.op_type for n in nodes] != PATTERN:
            return False
        pow_, mean, add_eps, sqrt, div, mul = nodes
        s = pow_.inputs[0]
        residual = s.producer() if s is not None else None
        if s is not None and residual is None and s.name == HIDDEN_IN and s.dtype == ir.DataType.FLOAT:
            a, b = s, zeros_like(graph, s, pow_, scope)  # a stage's hidden_in: the sum the stage before made
        elif residual is None or residual.op_type != "Add" or residual.domain not in ("", "ai.onnx"):
            return False
        else:
            a, b = residual.inputs
        if a is None or b is None or a.shape != b.shape or a.dtype != ir.DataType.FLOAT:
            return False  # a broadcasting Add is not a residual; fp16 goes through Casts and never gets here
        weight = next((v for v in mul.inputs if v is not None and v.is_initializer()), None)
        eps = next((scalar(v) for v in add_eps.inputs if scalar(v) is not None), None)
        if (scalar(pow_.inputs[1]) != 2.0 or div.inputs[0] is not s or weight is None or eps is None
                or mean.inputs[0] is not pow_.outputs[0] or sqrt.inputs[0] is not add_eps.outputs[0]):
            return False
        out, total = mul.outputs[0], residual.outputs[0] if residual is not None else s
        if total.is_graph_output() or out.is_graph_output():  # a graph output keeps its producer and name
            return False
        outputs = [ir.Value(name=f"{out.name}_skipnorm", type=out.type, shape=out.shape),
                   ir.Value(name=f"{scope}/mean"), ir.Value(name=f"{scope}/inv_std_var"),
                   ir.Value(name=f"{total.name}_skipnorm", type=total.type, shape=total.shape)]
        fused = ir.Node(MS_DOMAIN, "SkipSimplifiedLayerNormalization", [a, b, weight],
                        [ir.AttrFloat32("epsilon", eps)], outputs=outputs,
                        name=f"{scope}/SkipSimplifiedLayerNormalization")
        graph.insert_before(pow_, fused)
        out.replace_all_uses_with(outputs[0])
        if residual is not None:
            total.replace_all_uses_with(outputs[3])
        for n in reversed([*([residual] if residual is not None else []), *nodes]):
            graph.remove(n, safe=True)
        return True


def zeros_like(graph: ir.Graph, x: ir.Value, before: ir.Node, scope: str) -> ir.Value:
    """0 shaped as `x` (float32), computed in the graph: a gears graph's token axis is symbolic."""
    shape = ir.Node("", "Shape", [x], outputs=[ir.Value(name=f"{scope}/zero_skip_shape")], name=f"{scope}/Shape")
    zero = ir.tensor(np.zeros(1, np.float32))
    fill = ir.Node("", "ConstantOfShape", [shape.outputs[0]], [ir.AttrTensor("value", zero)],
                   outputs=[ir.Value(name=f"{scope}/zero_skip", type=x.type, shape=x.shape)],
                   name=f"{scope}/ConstantOfShape")
    graph.insert_before(before, [shape, fill])
    return fill.outputs[0]
