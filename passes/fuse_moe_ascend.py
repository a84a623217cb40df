"""MoE routing as the NPU's own kernel: Softmax + TopK → `npu::NPUMoeGatingTopKSoftmax`.

The static model routes each token with `topk(softmax(logits.float()))` (static_model.RoutedExperts),
exported inside `/model/layers.N/mlp/experts/` as Cast → Softmax → TopK (→ ReduceSum, Div when
norm_topk_prob). GE's TopK takes an int32 k only, so without this pass lower_topk_ascend rewrites the
TopK into k rounds of ArgMax/GatherElements/Equal/Where over [N, E]. Where the SoC has the kernel,
CANN's fused gating op does softmax and top-k in one:

    p = Softmax(x);  values, indices = TopK(p, k)          (x: the float32 logits the Cast made)
        becomes
    values, expert_idx, row_idx = NPUMoeGatingTopKSoftmax(x; k);  indices = Cast(expert_idx, int64)

The op (facts and file@commit#line sources in the table's `_constraints.ops.NPUMoeGatingTopKSoftmax`;
reference kernel in kernels/npu_moe.py): a softmax over all E experts computed in float32, then the
k largest, descending, in x's dtype and NOT renormalised (so the graph's own ReduceSum/Div still
renormalises `values`, exactly as it did TopK's); expert_idx is int32, so a Cast feeds the GatherND /
ScatterElements that take int64 indices; row_idx is unused. Ties put the lower expert first, as
TopK does. The plugin requires the INT attribute `k`, with 0 < k ≤ min(E, 1024).

The gating op reads the Softmax's own input, the float32 logits after the Cast, so the routing
weights are the float32 softmax the portable graph computes; the float32 kernel exists wherever
the op does. Kernels (op-info config): ascend910b, ascend910_93, ascend950 in fp16/fp32/bf16; none for
310B, and 310P's later fp16-only config is unverified, so both keep the ArgMax rounds, logged. A
layer whose routing is not that pattern is also left as it was, with the reason in the log. The
experts' own compute is untouched (decode already gathers only the k routed experts' weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import onnx_ir as ir

from qwen2om.ascend import Soc, soc_info
from qwen2om.cann import load_table
from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import log_once, regions
from qwen2om.kernels.npu_moe import GATING, MAX_K
from qwen2om.npu_kernels import NPU_DOMAIN, missing_kernel
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

SCOPE = QWEN_NAMES.experts_scope_re()
FLOATS = (ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.BFLOAT16)


def last_axis(node: ir.Node, rank: int, default: int) -> bool:
    return node.attributes.get_int("axis", default) % rank == rank - 1


def routing(nodes: list[ir.Node], max_k: int) -> tuple[ir.Node, ir.Node, int] | str:
    """The region's (Softmax, TopK, k) when it is the gating op's pattern, else why not."""
    topks = [n for n in nodes if n.op_type == "TopK" and n.domain in ("", "ai.onnx")]
    if len(topks) != 1:
        return f"expected one routing TopK, found {len(topks)}"
    topk = topks[0]
    probs, k_value = topk.inputs[0], topk.inputs[1]
    softmax = probs.producer() if probs is not None else None
    if softmax is None or softmax.op_type != "Softmax" or softmax not in nodes:
        return f"the TopK reads {softmax.op_type if softmax else 'no node'}, not the region's Softmax"
    x = softmax.inputs[0]
    if x is None or x.shape is None or x.dtype not in FLOATS or len(x.shape) not in (2, 3):
        return "the Softmax's input is not a 2-D or 3-D float tensor of known shape"
    rank, experts = len(x.shape), x.shape[-1]
    if not last_axis(softmax, rank, -1) or not last_axis(topk, rank, -1):
        return "the Softmax or the TopK is not over the last axis (the experts)"
    if topk.attributes.get_int("largest", 1) != 1 or topk.attributes.get_int("sorted", 1) != 1:
        return "the TopK is not the sorted largest k"
    if k_value is None or k_value.const_value is None or k_value.const_value.size != 1:
        return "the TopK's k is not a constant"
    k = int(k_value.const_value.numpy().reshape(-1)[0])
    if not isinstance(experts, int) or not 0 < k <= min(experts, max_k):
        return f"k={k} over {experts} experts is outside the kernel's 0 < k ≤ min(E, {max_k})"
    return softmax, topk, k


def replace(graph: ir.Graph, softmax: ir.Node, topk: ir.Node, k: int) -> None:
    """The gating op (and an int64 Cast of its experts) in place of the TopK; the Softmax goes when
    nothing else reads it. The new values take the exporter's names, so the graph reads as before."""
    x = softmax.inputs[0]
    assert x is not None and x.shape is not None
    scope = (topk.name or "").rsplit("/", 1)[0]
    shape = ir.Shape([*list(x.shape)[:-1], k])
    outputs = [ir.Value(name=f"{scope}/gating_values", type=x.type, shape=shape),
               ir.Value(name=f"{scope}/expert_idx", type=ir.TensorType(ir.DataType.INT32), shape=shape),
               ir.Value(name=f"{scope}/row_idx", type=ir.TensorType(ir.DataType.INT32), shape=shape)]
    gating = ir.Node(NPU_DOMAIN, GATING, [x], [ir.AttrInt64("k", k)], outputs=outputs, name=f"{scope}/{GATING}")
    cast = ir.Node("", "Cast", [outputs[1]], [ir.AttrInt64("to", ir.DataType.INT64)], num_outputs=1,
                   name=f"{scope}/expert_idx_Cast")
    cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.INT64, shape
    graph.insert_before(topk, [gating, cast])
    news = (outputs[0], cast.outputs[0])
    for old, new in zip(topk.outputs, news, strict=True):
        if old.is_graph_output():  # first: replace_all_uses_with refuses a graph output
            graph.outputs[list(graph.outputs).index(old)] = new
        old.replace_all_uses_with(new)
    names = [o.name for o in topk.outputs]
    graph.remove(topk, safe=True)
    for new, name in zip(news, names, strict=True):
        new.name = name
    if not cast.outputs[0].uses() and not cast.outputs[0].is_graph_output():
        graph.remove(cast, safe=True)
    probs = softmax.outputs[0]
    if not probs.uses() and not probs.is_graph_output():
        graph.remove(softmax, safe=True)


@register
class FuseMoeAscend:
    """MoE routing Softmax + TopK → npu::NPUMoeGatingTopKSoftmax where the SoC has the kernel."""

    name: ClassVar[str] = "fuse_moe_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal")
    produces: ClassVar[tuple[str, ...]] = ("moe_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        soc = soc_info(ctx.recipe.soc_version)
        rule = load_table().constraints.get(GATING, {})
        max_k = int(rule.get("params", {}).get("max_k", MAX_K))
        stats: dict[str, int | float | str] = {}
        log = log_once(ctx.log)

        for kind, model in state.graphs.items():
            fused = kept = 0
            for layer, nodes in regions(model.graph, scope=SCOPE).items():
                done = self.fuse(model.graph, f"{kind} graph, layer {layer}", nodes, soc, max_k, log)
                fused += done is True
                kept += done is False
            if fused:
                model.opset_imports[NPU_DOMAIN] = 1
            stats |= {f"{kind}_fused_routing": fused, f"{kind}_kept_routing": kept}
        return PassResult(any(v for k, v in stats.items() if k.endswith("_fused_routing")), stats)

    def fuse(self, graph: ir.Graph, where: str, nodes: list[ir.Node], soc: Soc, max_k: int,
             log: Callable[[str], None]) -> bool | None:
        """True: fused; False: left as it was (logged); None: already fused (a second run)."""
        if any(n.domain == NPU_DOMAIN and n.op_type == GATING for n in nodes):
            return None
        found = routing(nodes, max_k)
        if isinstance(found, str):
            log(f"{where}: MoE routing left as Softmax + TopK: {found}")
            return False
        softmax, topk, k = found
        x = softmax.inputs[0]
        if why := missing_kernel(GATING, soc, {"x": x.dtype if x is not None else None}):
            log(f"MoE routing left as Softmax + TopK (lower_topk_ascend's ArgMax rounds): {why}")
            return False
        replace(graph, softmax, topk, k)
        return True
