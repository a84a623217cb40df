"""Lower int4-quantised linears to ONNX Runtime's MatMulNBits (target ort).

Up to here a quantised linear is an ordinary `MatMul(x, W)` whose weight initializer happens to
come from a compressed-tensors checkpoint (the representation stays target-neutral; the Ascend
target lowers the same MatMuls its own way). For ONNX Runtime each becomes
`com.microsoft::MatMulNBits(x, B, scales[, zero_points])`:

- B is `weight_packed` read as bytes, [N, K/block, block/2]: the same nibble order, no repacking;
- scales [N·K/block] in the compute dtype (MatMulNBits wants the activations' type);
- zero points, asymmetric only: uint8, two 4-bit blocks per byte along K (value + 8); symmetric
  weights use MatMulNBits' default zero point 8, which is compressed-tensors' offset.

`accuracy_level` 0 computes in the activations' float type (exact against the dequantised
weights); 4 lets ORT quantise activations to int8 per block for speed, at a small error.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.errors import Qwen2omError
from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import (
    MS_DOMAIN,
    NBITS_SCALE,
    NBITS_WEIGHT,
    NBITS_ZERO_POINT,
    const,
    derived_initializer,
    expert_stacks,
    quantized_matmuls,
    replace_matmul,
    replace_stack_uses,
    scale_input,
    scoped_op,
)
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.quantized import Int4Weight
from qwen2om.weights import WeightRef


@register
class LowerInt4:
    """Quantised MatMuls → com.microsoft::MatMulNBits with the checkpoint's int4 storage (no-op for float models)."""

    name: ClassVar[str] = "lower_int4"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "weights", "bindings", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("int4_lowered", "stacked_scales")
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")

    def __init__(self, accuracy_level: int = 0, experts: bool = False) -> None:
        """`experts`: keep MoE experts int4 in the graph (gathered bytes, see lower_int4_stacks). Off
        by default: on ONNX Runtime's CPU kernels it decodes slower and holds more memory than
        experts dequantised at conversion (docs/benchmarks.md, MoE decode)."""
        if accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0-4, not {accuracy_level}")
        self.accuracy_level, self.experts = accuracy_level, bool(experts)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt = state.checkpoint
        weights, bindings = state.weights, state.bindings
        state.start_scale_stacks()  # produced even when there is nothing to lower
        if not any(isinstance(q, Int4Weight) for q in ckpt.quantized.values()):
            return PassResult(False, {"lowered": 0})
        dtype = weights.dtype
        onnx_dtype = ir.DataType.FLOAT if dtype == torch.float32 else ir.DataType.FLOAT16
        lowered = 0
        for model in state.graphs.values():
            graph = model.graph
            for node, q in quantized_matmuls(graph, bindings, ckpt.quantized, Int4Weight):  # not FP8: lower_fp8's
                if q.k % q.group or q.group < 16 or q.group & (q.group - 1):
                    raise Qwen2omError(f"{q.base}: MatMulNBits needs a power-of-two group ≥ 16 dividing K={q.k}; "
                                       f"this checkpoint has group {q.group}")
                blocks = q.k // q.group
                inputs = [node.inputs[0],
                          derived_initializer(graph, bindings, weights, f"{q.base}{NBITS_WEIGHT}", ir.DataType.UINT8,
                                              [q.n, blocks, q.group // 2],
                                              lambda q=q: q.nbits_b(ckpt)),
                          derived_initializer(graph, bindings, weights, f"{q.base}{NBITS_SCALE}", onnx_dtype,
                                              [q.n * blocks],
                                              lambda q=q: q.unpacked(ckpt)[1].to(dtype).reshape(-1))]
                if q.has_zero_point:
                    inputs.append(derived_initializer(graph, bindings, weights, f"{q.base}{NBITS_ZERO_POINT}",
                                                      ir.DataType.UINT8, [q.n * ((blocks + 1) // 2)],
                                                      lambda q=q: q.nbits_zero_points(ckpt)))
                new = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, [
                    ir.AttrInt64("K", q.k), ir.AttrInt64("N", q.n), ir.AttrInt64("bits", 4),
                    ir.AttrInt64("block_size", q.group), ir.AttrInt64("accuracy_level", self.accuracy_level)],
                    num_outputs=1, name=(node.name or "").replace("MatMul", "MatMulNBits"))
                replace_matmul(graph, node, [new], new.outputs[0])
                lowered += 1
            model.opset_imports[MS_DOMAIN] = 1
        stacks = sum(lower_int4_stacks(state, model.graph, ckpt, weights, bindings, onnx_dtype)
                     for model in state.graphs.values()) if self.experts else 0
        stats = {"lowered": lowered, "accuracy_level": self.accuracy_level}
        return PassResult(lowered + stacks > 0, stats | ({"expert_stacks": stacks} if stacks else {}))



# -- MoE expert stacks ---------------------------------------------------------------------------
def lower_int4_stacks(state: ConvertState, graph: ir.Graph, ckpt: Any, weights: Any, bindings: dict[str, WeightRef],
                      compute: ir.DataType) -> int:
    """Symmetric int4 experts stay int4 in the graph: each layer's `gate_up` / `down` stack becomes the
    experts' packed bytes [E, N, K/2] plus one scale stack per projection [E, N, K/group]; decode
    gathers the k routed experts' bytes and scales, then unpacks and dequantises only those
    (BitwiseAnd / BitShift, opset 18); prefill dequantises the whole stack. MatMulNBits cannot be
    used: it takes one constant weight, not a gathered one. Other int4 experts (asymmetric,
    msModelSlim's layout) are dequantised at conversion, as before."""
    done = 0
    for init, p, which, qs in expert_stacks(graph, ckpt):
        projs = tuple(qs)
        flat = [q for group in qs.values() for q in group]
        if not all(isinstance(q, Int4Weight) and q.symmetric and q.layout.packs_int32 and not q.k % q.group
                   for q in flat) or len({q.group for q in flat}) != 1:
            continue
        n = sum(group[0].n for group in qs.values())
        k, g = flat[0].k, flat[0].group
        name = f"{QWEN_NAMES.stack(p, which)}.weight_int4"
        if name not in graph.initializers:
            def part(e: int, qs: dict[str, list[Int4Weight]] = qs) -> torch.Tensor:
                return torch.cat([group[e].nbits_b(ckpt).reshape(group[e].n, group[e].k // 2) for group in qs.values()])
            wq = ir.Value(name=name, shape=ir.Shape([len(flat) // len(projs), n, k // 2]),
                          type=ir.TensorType(ir.DataType.UINT8))
            graph.initializers.add(wq)
            weights.stored_stack(name, (n, k // 2), [lambda e=e, part=part: part(e) for e in range(ckpt.dims.experts)])
            bindings[name] = WeightRef(name)
        wq = graph.initializers[name]
        scales = []
        for proj, group in qs.items():
            sname = QWEN_NAMES.stacked_proj(p, proj) + NBITS_SCALE
            every = QWEN_NAMES.expert_module(p, proj)  # each expert's, as `….experts.*.gate_proj`
            shape = [len(group), group[0].n, k // g]
            def values(group: list[Int4Weight] = group) -> torch.Tensor:
                return torch.stack([q.unpacked(ckpt)[1].float() for q in group]).contiguous()

            scales.append(derived_initializer(graph, bindings, weights, sname, ir.DataType.FLOAT, shape, values))
            state.stacked_scales[sname] = {  # for `scales: inputs` (scale_inputs.py)
                "input": scale_input(QWEN_NAMES.stacked_proj(p, proj)), "source": f"{every}.weight_scale",
                "module": every, "weight": f"{every}.weight",
                "shape": shape, "experts": len(group), "group_size": g, "scheme": "int4", "format": group[0].fmt,
                "values": values}
        scope = f"{p}/{which}"
        replace_stack_uses(graph, init, f"/{scope}/int4", wq, scales,
                           lambda nodes, w, ss, lead, scope=scope, n=n, k=k, g=g: unpack_dequant(
                               graph, nodes, scope, w, ss, lead, n, k, g, compute))
        done += 1
    return done


def op(nodes: list[ir.Node], p: str, kind: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
    return scoped_op(nodes, f"/{p}/int4", kind, *inputs, **attrs)


def unpack_dequant(graph: ir.Graph, nodes: list[ir.Node], p: str, wq: ir.Value, scales: list[ir.Value], lead: int,
                   n: int, k: int, g: int, compute: ir.DataType) -> ir.Value:
    """[*lead, n, k/2] bytes (low nibble first, value + 8) and [*lead, n_p, k/g] scales → Wᵀ [*lead, k, n]."""
    i64 = np.int64
    low = op(nodes, p, "BitwiseAnd", wq, const(graph, "/int4/mask_15", np.array(15, np.uint8)))
    high = op(nodes, p, "BitShift", wq, const(graph, "/int4/shift_4", np.array(4, np.uint8)), direction="RIGHT")
    axis = const(graph, "/int4/axes_-1", np.array([-1], i64))
    pairs = op(nodes, p, "Concat", op(nodes, p, "Unsqueeze", low, axis), op(nodes, p, "Unsqueeze", high, axis), axis=-1)
    keep = [0] * lead
    q = op(nodes, p, "Reshape", pairs, const(graph, f"/int4/keep{lead}_{n}x{k}", np.array([*keep, n, k], i64)))
    q = op(nodes, p, "Sub", op(nodes, p, "Cast", q, to=ir.DataType.FLOAT.value),
           const(graph, "/int4/eight", np.array(8, np.float32)))
    s = scales[0] if len(scales) == 1 else op(nodes, p, "Concat", *scales, axis=-2)
    s = op(nodes, p, "Expand", op(nodes, p, "Unsqueeze", s, axis),
           const(graph, f"/int4/group_{g}", np.array([1, g], i64)))
    s = op(nodes, p, "Reshape", s, const(graph, f"/int4/keep{lead}_{n}x{k}", np.array([*keep, n, k], i64)))
    w = op(nodes, p, "Transpose", op(nodes, p, "Mul", q, s), perm=[*range(lead), lead + 1, lead])
    return w if compute == ir.DataType.FLOAT else op(nodes, p, "Cast", w, to=compute.value)
