"""Lower FP8 linears: the weight stays e4m3fn in the graph and is dequantised by its block scale.

Up to here an FP8 linear is an ordinary `MatMul(x, Wᵀ)` whose initializer reads as the exact
dequantisation (so a recipe without this pass upcasts FP8 to the compute dtype at conversion time:
4× the bytes in fp32, the fastest form for ONNX Runtime). With this pass each one becomes

    Wq   [K, N]  the checkpoint's e4m3fn bytes, transposed once at write time
    S    [⌈N/bn⌉, ⌈K/bk⌉] float32, the checkpoint's scale grid as published
    W    = decode(Wq) · tile(S)          (in float32, then cast to the compute dtype)
    y    = MatMul(x, W)

`tile(S)` is Transpose → Unsqueeze → Expand → Reshape (→ Slice for a partial last tile): shape
arithmetic on a grid of a few hundred floats. `decode` depends on `storage`:

- `float8` (default): Wq is a float8e4m3fn initializer and decode is `Cast` (ai.onnx opset 19,
  IR version 9; ONNX Runtime runs it, the pass raises the models' opset and IR version to that);
- `bytes`: Wq is uint8 and decode is a `Gather` from the 256-entry e4m3fn table: opset 18 / IR 8,
  for compilers that cannot read FP8 tensors.

`scale_inputs` can then turn every S into a graph input (`<weight>.scale`), the default for FP8.
Dequantisation happens on every call: ONNX Runtime's CPU kernels never fuse an FP8 dequantise into
the MatMul. With scales as constants ORT folds the whole dequantisation at session load (float
weights in memory, the speed of a float model); with scales as inputs it cannot.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import (
    FP8_SCALE,
    const,
    derived_initializer,
    expert_stacks,
    quantized_matmuls,
    replace_stack_uses,
    scale_input,
    scoped_op,
)
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.quant import fp8
from qwen2om.quantized import Fp8Weight
from qwen2om.weights import WeightRef

STORAGES = ("float8", "bytes")
WEIGHT_SUFFIX = ".weight_fp8"
FP8_OPSET, FP8_IR = 19, 9


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float().numpy()


@register
class LowerFp8:
    """FP8 MatMuls → e4m3fn weight + float32 block scale, dequantised in the graph (no-op for other models)."""

    name: ClassVar[str] = "lower_fp8"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "weights", "bindings", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("fp8_lowered", "stacked_scales")
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")

    def __init__(self, storage: str = "float8", experts: bool = False) -> None:
        """`experts`: keep MoE experts FP8 in the graph (see lower_expert_stacks). Off by default: on
        ONNX Runtime's CPU kernels experts dequantised at conversion decode faster in less memory."""
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {', '.join(STORAGES)}, not {storage!r}")
        self.storage, self.experts = storage, bool(experts)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt = state.checkpoint
        weights, bindings = state.weights, state.bindings
        state.start_scale_stacks()  # produced even when there is nothing to lower
        if not any(isinstance(q, Fp8Weight) for q in ckpt.quantized.values()):
            return PassResult(False, {"lowered": 0})
        compute = ir.DataType.FLOAT if weights.dtype == torch.float32 else ir.DataType.FLOAT16
        self.raw = ckpt.raw
        lowered, stacks = 0, 0
        for model in state.graphs.values():
            graph = model.graph
            for node, q in quantized_matmuls(graph, bindings, ckpt.quantized, Fp8Weight):
                w = node.inputs[1]
                dequantized = self.dequantize(graph, q, ckpt, weights, bindings, compute)
                node.replace_input_with(1, dequantized)
                if not w.uses():
                    graph.initializers.pop(w.name)
                lowered += 1
            if self.experts:
                stacks += self.lower_expert_stacks(state, graph, ckpt, weights, bindings, compute)
            if self.storage == "float8":
                model.opset_imports[""] = max(model.opset_imports.get("", FP8_OPSET), FP8_OPSET)
                model.ir_version = max(model.ir_version or FP8_IR, FP8_IR)
        return PassResult(lowered + stacks > 0, {"lowered": lowered, "expert_stacks": stacks, "storage": self.storage})

    # -- MoE expert stacks -------------------------------------------------------------------------
    def lower_expert_stacks(self, state: ConvertState, graph: ir.Graph, ckpt: Any, weights: Any,
                            bindings: dict[str, WeightRef], compute: ir.DataType) -> int:
        """Each FP8 MoE layer's `gate_up` [E, H, 2I] and `down` [E, I, H] stacks stay e4m3fn bytes (uint8,
        decoded by table: GatherND takes no float8 tensor), with one stacked float32 scale per
        projection ([E, ⌈N/bn⌉, ⌈K/bk⌉]: three per layer, not 3·E).
        Decode's GatherND of the k routed experts moves before the dequantisation, so a step
        dequantises k experts, not E; prefill's MatMul dequantises the whole stack."""
        done = 0
        for init, p, which, qs in expert_stacks(graph, ckpt):
            projs = tuple(qs)
            if not all(isinstance(q, Fp8Weight) for group in qs.values() for q in group):
                continue  # float (or int4) experts: the stack stays as converted
            wq = self.expert_bytes(graph, weights, bindings, p, which, qs, list(init.shape))
            scales = {proj: self.expert_scales(state, graph, weights, bindings, p, proj, qs[proj], ckpt)
                      for proj in projs}
            scope = f"/{p}/{which}/fp8"
            replace_stack_uses(graph, init, scope, wq, list(scales.values()),
                               lambda nodes, w, ss, lead, scope=scope, projs=projs, qs=qs: self.stack_dequant(
                                   graph, nodes, scope, w, dict(zip(projs, ss, strict=True)), qs, lead, compute))
            done += 1
        return done

    def expert_bytes(self, graph: ir.Graph, weights: Any, bindings: dict[str, WeightRef], p: str, which: str,
                     qs: dict[str, list[Fp8Weight]], shape: list[int]) -> ir.Value:
        name = QWEN_NAMES.stack(p, which) + WEIGHT_SUFFIX
        if name in graph.initializers:
            return graph.initializers[name]
        ckpt_raw = self.raw

        def part(e: int) -> torch.Tensor:  # the stack holds Wᵀ; gate and up side by side
            return torch.cat([ckpt_raw(qs[proj][e].name).view(torch.uint8).T for proj in qs], dim=1)

        # Always bytes: GatherND takes no float8 tensor (opset 19-23), and decode gathers first.
        v = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.UINT8))
        graph.initializers.add(v)
        weights.stored_stack(name, tuple(shape[1:]), [lambda e=e: part(e) for e in range(shape[0])])
        bindings[name] = WeightRef(name)
        return v

    def expert_scales(self, state: ConvertState, graph: ir.Graph, weights: Any, bindings: dict[str, WeightRef], p: str,
                      proj: str, qs: list[Fp8Weight], ckpt: Any) -> ir.Value:
        name = QWEN_NAMES.stacked_proj(p, proj) + FP8_SCALE
        shape = [len(qs), *qs[0].scale_shape]
        v = derived_initializer(graph, bindings, weights, name, ir.DataType.FLOAT, shape,
                         lambda: torch.stack([q.scale(ckpt) for q in qs]).contiguous())
        every = QWEN_NAMES.expert_module(p, proj)  # each expert's, as `….experts.*.gate_proj`
        state.stacked_scales[name] = {
            "input": scale_input(QWEN_NAMES.stacked_proj(p, proj)), "source": f"{every}.weight_scale_inv",
            "module": every, "weight": f"{every}.weight", "shape": shape,
            "experts": len(qs), "block_size": list(qs[0].block), "scheme": "fp8", "format": qs[0].fmt,
            "values": lambda: torch.stack([q.scale(ckpt) for q in qs]).contiguous()}
        return v

    def stack_dequant(self, graph: ir.Graph, nodes: list[ir.Node], p: str, wq: ir.Value, scales: dict[str, ir.Value],
                      qs: dict[str, list[Fp8Weight]], lead: int, compute: ir.DataType) -> ir.Value:
        """decode(wq) · tiles, for stacks [*lead, K, N] whose scale grids are [*lead, gn, gk]."""
        tiles = [self.tile(graph, nodes, p, s, qs[proj][0], lead) for proj, s in scales.items()]
        tiled = tiles[0] if len(tiles) == 1 else self.op(nodes, p, "Concat", *tiles, axis=-1)
        decoded = self.op(nodes, p, "Gather", const(graph, "/fp8/e4m3fn_table", e4m3_table()),
                          self.op(nodes, p, "Cast", wq, to=ir.DataType.INT32.value))
        out = self.op(nodes, p, "Mul", decoded, tiled)
        return out if compute == ir.DataType.FLOAT else self.op(nodes, p, "Cast", out, to=compute.value)

    def tile(self, graph: ir.Graph, nodes: list[ir.Node], p: str, s: ir.Value, q: Fp8Weight, lead: int) -> ir.Value:
        """A scale grid [*lead, gn, gk] as the per-element scale of Wᵀ: [*lead, k, n]."""
        (gn, gk), (bn, bk) = q.scale_shape, q.block
        i64 = np.int64
        t = self.op(nodes, p, "Transpose", s, perm=[*range(lead), lead + 1, lead])
        u = self.op(nodes, p, "Unsqueeze", t, const(graph, f"/fp8/axes_{lead + 1}_{lead + 3}",
                                                   np.array([lead + 1, lead + 3], i64)))
        x = self.op(nodes, p, "Expand", u, const(graph, f"/fp8/tile_1x{bk}x1x{bn}", np.array([1, bk, 1, bn], i64)))
        r = self.op(nodes, p, "Reshape", x, const(graph, f"/fp8/keep{lead}_{gk * bk}x{gn * bn}",
                                                  np.array([0] * lead + [gk * bk, gn * bn], i64)))
        if (gk * bk, gn * bn) != (q.k, q.n):
            r = self.op(nodes, p, "Slice", r, const(graph, "/fp8/zeros_2", np.zeros(2, i64)),
                        const(graph, f"/fp8/ends_{q.k}x{q.n}", np.array([q.k, q.n], i64)),
                        const(graph, f"/fp8/axes_{lead}_{lead + 1}", np.array([lead, lead + 1], i64)))
        return r

    op = staticmethod(scoped_op)

    def dequantize(self, graph: ir.Graph, q: Fp8Weight, ckpt: object, weights: object,
                   bindings: dict[str, WeightRef], compute: ir.DataType) -> ir.Value:
        """The nodes computing q's float weight [K, N] in the compute dtype, inserted at the top."""
        n, k, (bn, bk) = q.n, q.k, q.block
        gn, gk = q.scale_shape
        stored = ir.DataType.FLOAT8E4M3FN if self.storage == "float8" else ir.DataType.UINT8
        wq = derived_initializer(graph, bindings, weights, q.base + WEIGHT_SUFFIX, stored, [k, n],
                          lambda: ckpt.raw(q.name).T.contiguous().view(torch.uint8))  # type: ignore[attr-defined]
        s = derived_initializer(graph, bindings, weights, q.base + FP8_SCALE, ir.DataType.FLOAT, [gn, gk],
                         lambda: q.scale(ckpt).contiguous())
        p = f"/{q.base}/fp8"
        nodes: list[ir.Node] = []

        def op(kind: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
            return scoped_op(nodes, p, kind, *inputs, **attrs)

        i64 = np.int64
        tiled = op("Reshape", op("Expand", op("Unsqueeze", op("Transpose", s, perm=[1, 0]),
                                              const(graph, "/fp8/axes_1_3", np.array([1, 3], i64))),
                                 const(graph, f"/fp8/tiles_{gk}x{bk}x{gn}x{bn}", np.array([gk, bk, gn, bn], i64))),
                      const(graph, f"/fp8/shape_{gk * bk}x{gn * bn}", np.array([gk * bk, gn * bn], i64)))
        if (gk * bk, gn * bn) != (k, n):  # a partial last tile
            tiled = op("Slice", tiled, const(graph, "/fp8/zeros_2", np.zeros(2, i64)),
                       const(graph, f"/fp8/ends_{k}x{n}", np.array([k, n], i64)))
        if self.storage == "float8":
            decoded = op("Cast", wq, to=ir.DataType.FLOAT.value)
        else:
            decoded = op("Gather", const(graph, "/fp8/e4m3fn_table", e4m3_table()),
                         op("Cast", wq, to=ir.DataType.INT32.value))
        out = op("Mul", decoded, tiled)
        if compute != ir.DataType.FLOAT:
            out = op("Cast", out, to=compute.value)
        out.shape, out.type = ir.Shape([k, n]), ir.TensorType(compute)
        graph.insert_before(graph.node(0), nodes)
        return out

