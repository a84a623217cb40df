"""Route MoE tokens without `TopK` in Ascend graphs: k rounds of ArgMax over the router's probabilities.

The static model picks each token's experts with `torch.topk` (static_model.RoutedExperts), which
exports as ONNX `TopK(probs, K int64)` with int64 indices. CANN's parser maps TopK (opset 10+) 1:1
onto GE's TopK, whose `k` input and indices output are int32 only (shared/reference/
cann-onnx-ops.json, `_constraints.TopK`), and ONNX requires an int64 K, so no TopK node is both
valid ONNX and what GE declares. Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE and Qwen3-Next routing all go
through it. Here each `TopK(p, k)` over a Softmax becomes, for j = 0..k-1:

    index_j = ArgMax(p_j, keepdims=1)              # the first of equal maxima, as TopK orders ties
    value_j = GatherElements(p, index_j)           # the probability itself, bit for bit
    p_j+1   = Where(Equal(iota, index_j), -inf, p_j)
    values, indices = Concat(value_0..k-1), Concat(index_0..k-1)

ArgMax (`select_last_index=0`), GatherElements, Equal, Where and Concat are registered plugins at
opset 18 with no dtype restriction that this touches. The result equals TopK with `sorted=1`:
the same experts in the same (descending, lower index first on ties) order, the same values.
That needs every row to hold at least k values above −inf, which a Softmax's probabilities do
(each ≥ 0, k ≤ E); so only a TopK that reads a Softmax is rewritten, and any other is refused.

It is an Ascend pass: ONNX Runtime's recipes keep TopK (a kernel there, and `fuse_moe` replaces the
whole experts region anyway). k rounds over [N, E] cost little next to the experts' matmuls
(k = 8, E = 128 for Qwen3-30B-A3B).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.errors import Qwen2omError
from qwen2om.graph_rewrite import const
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register


def _node(nodes: list[ir.Node], name: str, op: str, inputs: list[ir.Value], dtype: ir.DataType,
          shape: list[int | ir.SymbolicDim | str | None] | None, **attrs: int) -> ir.Value:
    node = ir.Node("", op, inputs, [ir.AttrInt64(k, v) for k, v in attrs.items()], num_outputs=1, name=name)
    out = node.outputs[0]
    out.type = ir.TensorType(dtype)
    out.shape = ir.Shape(shape) if shape is not None else None  # type: ignore[arg-type]
    nodes.append(node)
    return out


def topk_rounds(graph: ir.Graph, node: ir.Node) -> tuple[list[ir.Node], ir.Value, ir.Value]:
    """The nodes replacing `node` (a TopK over a Softmax), and its new values and indices outputs."""
    where = node.name or "TopK"
    probs, k_value = node.inputs[0], node.inputs[1]
    if node.attributes.get_int("largest", 1) != 1:
        raise Qwen2omError(f"{where}: a TopK of the smallest values; only routing TopK (largest=1) is rewritten")
    producer = probs.producer() if probs is not None else None
    if probs is None or producer is None or producer.op_type != "Softmax":
        raise Qwen2omError(f"{where}: TopK reads {producer.op_type if producer else 'no node'}, not a Softmax; only "
                           "the router's top-k is rewritten (GE's TopK takes int32 k and indices only)")
    logits = producer.inputs[0]
    if probs.shape is None and logits is not None:  # a Softmax keeps its input's shape and dtype
        probs.shape, probs.type = logits.shape, logits.type
    if k_value is None or k_value.const_value is None or probs.shape is None or probs.dtype is None:
        raise Qwen2omError(f"{where}: TopK needs a constant k and a known input shape to be rewritten")
    k = int(k_value.const_value.numpy().reshape(-1)[0])
    rank = len(probs.shape)
    axis = node.attributes.get_int("axis", -1) % rank
    experts = probs.shape[axis]
    if not isinstance(experts, int) or not 0 < k <= experts:
        raise Qwen2omError(f"{where}: TopK over {experts} values with k={k}")
    scope = where.rsplit("/", 1)[0] if "/" in where else ""
    # iota broadcasts along `axis`: [E] for the last axis, [E, 1, ..] otherwise; shared by every layer
    positions = np.arange(experts, dtype=np.int64).reshape([experts] + [1] * (rank - 1 - axis))
    iota = const(graph, f"top_k.iota{list(positions.shape)}", positions)
    lowest = const(graph, f"top_k.-inf.{probs.dtype.name}", np.array(-np.inf, probs.dtype.numpy()))
    one = [d if i != axis else 1 for i, d in enumerate(probs.shape)]
    nodes: list[ir.Node] = []
    values: list[ir.Value] = []
    indices: list[ir.Value] = []
    left = probs
    for j in range(k):
        p = f"{scope}/top_k/round_{j}"
        index = _node(nodes, f"{p}/ArgMax", "ArgMax", [left], ir.DataType.INT64, one, axis=axis, keepdims=1,
                      select_last_index=0)
        indices.append(index)
        values.append(_node(nodes, f"{p}/GatherElements", "GatherElements", [probs, index], probs.dtype, one,
                            axis=axis))
        if j < k - 1:
            hit = _node(nodes, f"{p}/Equal", "Equal", [iota, index], ir.DataType.BOOL, list(probs.shape))
            left = _node(nodes, f"{p}/Where", "Where", [hit, lowest, left], probs.dtype, list(probs.shape))
    shape = [d if i != axis else k for i, d in enumerate(probs.shape)]
    if k == 1:
        return nodes, values[0], indices[0]
    value = _node(nodes, f"{scope}/top_k/values", "Concat", values, probs.dtype, shape, axis=axis)
    index = _node(nodes, f"{scope}/top_k/indices", "Concat", indices, ir.DataType.INT64, shape, axis=axis)
    return nodes, value, index


@register
class LowerTopkAscend:
    """Routing TopK (int64 k and indices, which GE's TopK does not take) → k ArgMax rounds."""

    name: ClassVar[str] = "lower_topk_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal")
    produces: ClassVar[tuple[str, ...]] = ("topk_lowered",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)
    # after fuse_moe_ascend where it runs: the layers it fused have no TopK left, the others are lowered here
    follows: ClassVar[tuple[str, ...]] = ("moe_fused",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        lowered = 0
        for model in state.graphs.values():
            graph = model.graph
            for node in [n for n in graph if n.op_type == "TopK" and n.domain in ("", "ai.onnx")]:
                nodes, values, indices = topk_rounds(graph, node)
                graph.insert_before(node, nodes)
                for old, new in zip(node.outputs, (values, indices), strict=True):
                    if old.is_graph_output():  # first: replace_all_uses_with refuses a graph output
                        graph.outputs[list(graph.outputs).index(old)] = new
                    new.shape, new.type = old.shape or new.shape, old.type or new.type
                    old.replace_all_uses_with(new)
                names = [o.name for o in node.outputs]
                graph.remove(node, safe=True)
                for new, name in zip((values, indices), names, strict=True):
                    new.name = name  # the exporter's names, so the rest of the graph reads as before
                lowered += 1
        return PassResult(lowered > 0, {"lowered": lowered})
