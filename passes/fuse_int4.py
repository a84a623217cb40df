"""Fuse int4 MatMulNBits that read the same activation into one wider MatMulNBits and a Split.

A decoder layer runs q/k/v on the same normed hidden state and gate/up on the same one: five
MatMulNBits calls where two do the same work. At decode (M = 1) each call is short and its fixed
cost (activation quantisation at accuracy_level 4, thread dispatch, output allocation) is paid per
call. ONNX Runtime GenAI's builder writes one fused qkv MatMulNBits per layer (5 per layer with
gate, up, o, down); this pass fuses q/k/v and gate/up (4 per layer) after `lower_int4`:

    MatMulNBits(x, B_q, s_q) ─┐           MatMulNBits(x, [B_q; B_k; B_v], [s_q; s_k; s_v])
    MatMulNBits(x, B_k, s_k) ─┼─ becomes                  └─ Split(axis -1, [N_q, N_k, N_v])
    MatMulNBits(x, B_v, s_v) ─┘

Nodes fuse when they share the input value and K, bits, block_size, accuracy_level and whether
they have zero points. MatMulNBits stores everything per output row (B [N, K/block, block/2],
scales [N·K/block], zero points [N·⌈(K/block)/2⌉]), so concatenating along N is concatenating the
stored tensors. The fused tensors stay lazy: each is a `weights.derived` producer that concatenates
its parts' producers when `write_onnx` asks for it, so one fused tensor (one layer's projections) is
in memory at a time. Scales that `scale_inputs` turned into graph inputs are left alone (their
names are part of the graph signature), so this pass runs after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.graph_rewrite import MS_DOMAIN, NBITS_SCALE, NBITS_WEIGHT, NBITS_ZERO_POINT
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.weights import WeightRef, Weights

SUFFIXES = (NBITS_WEIGHT, NBITS_SCALE, NBITS_ZERO_POINT)  # B, scales, zero points: lower_int4's names
ATTRS = ("K", "bits", "block_size", "accuracy_level")


@register
class FuseInt4:
    """MatMulNBits sharing an input (q/k/v, gate/up) → one MatMulNBits over the concatenated rows + Split."""

    name: ClassVar[str] = "fuse_int4"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings", "int4_lowered")
    produces: ClassVar[tuple[str, ...]] = ("int4_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")
    follows: ClassVar[tuple[str, ...]] = ("scale_map",)  # scales that became inputs are left alone, so after

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        weights, bindings = state.weights, state.bindings
        stats: dict[str, int | float | str] = {}  # per graph: a sum counts each layer's groups twice
        for kind, model in state.graphs.items():
            graph = model.graph
            groups = nodes = 0
            for members in candidates(graph, weights):
                fuse(graph, members, weights, bindings)
                groups += 1
                nodes += len(members)
            stats |= {f"{kind}_fused_groups": groups, f"{kind}_fused_nodes": nodes}
        return PassResult(any(stats.values()), stats)


def candidates(graph: ir.Graph, weights: Weights) -> list[list[ir.Node]]:
    """Groups of two or more fusable MatMulNBits, each in graph order."""
    by_key: dict[tuple[object, ...], list[ir.Node]] = {}
    for node in graph:
        if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len(node.inputs) not in (3, 4):
            continue
        data = node.inputs[1:]
        if any(v is None or not v.is_initializer() or v.name not in weights.derived for v in data):
            continue  # scales as graph inputs, or tensors this pass cannot produce lazily
        if node.outputs[0].is_graph_output():
            continue
        attrs = tuple(node.attributes[a].as_int() if a in node.attributes else None for a in ATTRS)
        by_key.setdefault((id(node.inputs[0]), len(node.inputs), *attrs), []).append(node)
    return [members for members in by_key.values() if len(members) > 1]


def fused_base(bases: list[str]) -> tuple[str, str]:
    """`m.layers.0.self_attn.q_proj`, `…k_proj`, `…v_proj` → (`m.layers.0.self_attn.`, `q_proj+k_proj+v_proj`)."""
    prefix = os.path.commonprefix(bases)
    prefix = prefix[:prefix.rfind(".") + 1]
    return prefix, "+".join(b[len(prefix):] for b in bases)


def fuse(graph: ir.Graph, members: list[ir.Node], weights: Weights, bindings: dict[str, WeightRef]) -> None:
    first = members[0]
    bases = [n.inputs[1].name.removesuffix(SUFFIXES[0]) for n in members]  # type: ignore[union-attr]
    prefix, joined = fused_base(bases)
    base = prefix + joined
    sizes = [n.attributes["N"].as_int() for n in members]
    inputs: list[ir.Value | None] = [first.inputs[0]]
    for i, suffix in enumerate(SUFFIXES[:len(first.inputs) - 1], start=1):
        parts = [n.inputs[i] for n in members]
        inputs.append(concatenated(graph, f"{base}{suffix}", parts, weights, bindings))  # type: ignore[arg-type]
    attrs = [ir.AttrInt64("N", sum(sizes))] + [a for name, a in first.attributes.items() if name != "N"]
    # /model/layers.0/self_attn/q_proj/MatMulNBits → /model/layers.0/self_attn/q_proj+k_proj+v_proj/MatMulNBits
    name = (first.name or base).replace(f"/{bases[0][len(prefix):]}/", f"/{joined}/")
    matmul = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, attrs, num_outputs=1, name=name)
    out = matmul.outputs[0]
    out.name = f"{name}/output_0"
    out.type = first.outputs[0].type
    shape = first.outputs[0].shape
    if shape is not None:
        out.shape = ir.Shape([*list(shape)[:-1], sum(sizes)])
    split_sizes = ir.Value(name=f"{base}/split_sizes", shape=ir.Shape([len(sizes)]),
                           type=ir.TensorType(ir.DataType.INT64),
                           const_value=ir.tensor(np.array(sizes, dtype=np.int64), name=f"{base}/split_sizes"))
    graph.register_initializer(split_sizes)
    split = ir.Node("", "Split", [out, split_sizes], [ir.AttrInt64("axis", -1)], num_outputs=len(members),
                    name=name.replace("MatMulNBits", "Split"))
    graph.insert_before(first, [matmul, split])
    for node, new in zip(members, split.outputs, strict=True):
        old = node.outputs[0]
        new.shape, new.type = old.shape, old.type
        old.replace_all_uses_with(new)
        old_name = old.name
        data = [v for v in node.inputs[1:] if v is not None]
        graph.remove(node, safe=True)
        new.name = old_name
        for v in data:
            if not v.uses():
                graph.initializers.pop(v.name)  # type: ignore[arg-type]


def concatenated(graph: ir.Graph, name: str, parts: list[ir.Value], weights: Weights,
                 bindings: dict[str, WeightRef]) -> ir.Value:
    """One initializer holding `parts` one after another along their first axis, produced lazily."""
    if name in graph.initializers:
        return graph.initializers[name]
    shapes = [list(p.shape) for p in parts]  # type: ignore[arg-type]
    shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
    v = ir.Value(name=name, shape=ir.Shape(shape), type=parts[0].type)
    graph.initializers.add(v)
    producers = [weights.derived[p.name] for p in parts]  # type: ignore[index]
    weights.derived[name] = lambda: cat(producers)
    bindings[name] = WeightRef(name)
    return v


def cat(producers: list[Callable[[], torch.Tensor]]) -> torch.Tensor:
    return torch.cat([p() for p in producers], dim=0)
