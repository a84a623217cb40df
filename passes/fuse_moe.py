"""Replace each MoE layer's routed experts with ONNX Runtime's grouped-expert kernel, `com.microsoft::MoE`.

The static model's routed experts (`mlp.experts`, static_model.RoutedExperts) are written in
standard ONNX ops only, which costs E/k times the routed arithmetic for a prefill chunk (every
expert runs on every token; 16× for Qwen3-30B-A3B). ONNX Runtime's MoE contrib op takes the
router logits and does what no static standard-op graph can: softmax, top-k, then sorts the
N·k (token, expert) pairs by expert and runs each expert's GEMM on only its own rows. Cost is
∝ k, not E, at every T, and decode reads only the k routed experts' weights in place (no Gather
copy). Measured on a Qwen3-30B-A3B layer (E=128, k=8, H=2048, I=768, fp32, 2 cores): a 128-token
chunk 207 ms against 606 ms for the portable form's gate/up MatMul alone.

    /model/layers.N/mlp/experts/*  (Softmax, TopK, GatherND or MatMul over [E, ...] stacks, ...)
        becomes
    MoE(x [N, H], logits [N, E], fc1 [E, 2I, H], -, fc2 [E, H, I]; k, activation_type=swiglu,
        swiglu_fusion=1 (gate and up rows interleaved), activation_alpha=1, activation_beta=0,
        normalize_routing_weights=norm_topk_prob)

With alpha 1 and beta 0 the kernel's SwiGLU, g·σ(α·g)·(u + β), is Qwen's silu(g)·u exactly. The
fc1/fc2 stacks are re-laid out from the checkpoint one expert at a time when `write_onnx` asks for
them, like every expert stack. A layer is left in the portable form, with the reason in the pass's
log, when its region is not the shape this pass expects (two inputs, one output, float stacks
used only inside it): e.g. experts kept int4 / FP8 in the graph by `lower_int4`/`lower_fp8`
with `experts: true`. Recipes for targets without this kernel simply leave the pass out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import onnx_ir as ir
import torch

from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import MS_DOMAIN, boundary, is_constant, regions
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.quantized import Int4Weight
from qwen2om.weights import WeightRef, Weights

SCOPE = QWEN_NAMES.experts_scope_re()


def stack_source(weights: Weights, bindings: dict[str, WeightRef], init: ir.Value | None,
                 members: set[ir.Node]) -> list[Callable[[], torch.Tensor]] | str:
    """The per-expert producers behind a float expert stack, or why the layer cannot be fused."""
    if init is None or not init.uses():
        return "its expert stacks were rewritten by an earlier pass (experts kept quantised in the graph)"
    ref = bindings.get(init.name or "")
    if ref is None or ref.source not in weights.stacks or ref.source in weights.stored:
        return f"{init.name} is not a float expert stack"
    if any(user not in members for user, _ in init.uses()):
        return f"{init.name} is also used outside the experts"
    return weights.stacks[ref.source]


@register
class FuseMoe:
    """Routed experts (portable standard ops) → one com.microsoft::MoE per layer (ONNX Runtime)."""

    name: ClassVar[str] = "fuse_moe"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "weights", "bindings", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("moe_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")
    # after the lowering passes where they run: experts they keep int4 / FP8 are fused in that form
    follows: ClassVar[tuple[str, ...]] = ("int4_lowered", "fp8_lowered")

    def __init__(self, quantized: bool = True) -> None:
        """`quantized`: symmetric int4 experts (compressed-tensors, one group size) stay int4 in
        `com.microsoft::QMoE`; off, they run dequantised in `MoE` like float experts."""
        self.quantized = bool(quantized)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        weights, bindings = state.weights, state.bindings
        ckpt = self.ckpt = state.checkpoint
        stats: dict[str, int | float | str] = {}  # per graph: a sum counts each layer twice
        for kind, model in state.graphs.items():
            graph = model.graph
            fused = kept = quantized = 0
            for layer, nodes in regions(graph, scope=SCOPE).items():
                q = int4_experts(ckpt, layer) if self.quantized else None
                if reason := self.fuse(graph, layer, nodes, ckpt.dims, weights, bindings, q):
                    ctx.log(f"{kind} graph, layer {layer}: experts left in standard ops: {reason}")
                    kept += 1
                    continue
                fused += 1
                quantized += q is not None
            if fused:
                model.opset_imports[MS_DOMAIN] = 1
            stats |= {f"{kind}_fused_layers": fused, f"{kind}_kept_layers": kept}
            stats |= {f"{kind}_int4_layers": quantized} if quantized else {}
        return PassResult(any(n for k, n in stats.items() if k.endswith("_fused_layers")), stats)

    def fuse(self, graph: ir.Graph, layer: int, nodes: list[ir.Node], dims: object,
             weights: Weights, bindings: dict[str, WeightRef], q: dict[str, list[Int4Weight]] | None = None,
             ) -> str | None:
        """Rewrite one layer's region (QMoE when `q` holds its int4 experts); return why not instead
        when the region is not the expected shape."""
        p = QWEN_NAMES.experts(QWEN_NAMES.mlp(layer))
        # Nodes computing constants (a zeros tensor) may be shared with other layers after the
        # exporter's CSE: they stay, and go only if nothing else reads them.
        constants = [n for n in nodes if all(is_constant(v) for v in n.inputs)]
        nodes = [n for n in nodes if n not in constants]
        members = set(nodes)
        sources = [stack_source(weights, bindings, graph.initializers.get(f"{p}.{w}"), members)
                   for w in ("gate_up", "down")]
        for s in sources:
            if isinstance(s, str):
                return s
        gate_up, down = sources
        inputs, outputs = boundary(graph, nodes)
        logits = [v for v in inputs if any(u in members and u.op_type in ("Softmax", "Cast") for u, _ in v.uses())]
        if len(inputs) != 2 or len(logits) != 1 or len(outputs) != 1:
            return f"expected 2 inputs (x, router logits) and 1 output, found {len(inputs)} and {len(outputs)}"
        x = next(v for v in inputs if v is not logits[0])
        e, h, i = dims.experts, dims.hidden, dims.moe_intermediate  # type: ignore[attr-defined]
        compute = graph.initializers[f"{p}.gate_up"].dtype
        attrs = [
            ir.AttrInt64("k", dims.top_k),  # type: ignore[attr-defined]
            ir.AttrString("activation_type", "swiglu"),
            ir.AttrInt64("swiglu_fusion", 1),
            ir.AttrFloat32("activation_alpha", 1.0),
            ir.AttrFloat32("activation_beta", 0.0),
            ir.AttrInt64("normalize_routing_weights", int(dims.norm_topk_prob)),  # type: ignore[attr-defined]
        ]
        if q is None:
            op = "MoE"
            operands = [
                self.stack(graph, weights, bindings, f"{p}.fc1", compute, (2 * i, h),
                           [lambda e=e: interleave(gate_up[e](), i) for e in range(e)]),  # type: ignore[index]
                None,
                self.stack(graph, weights, bindings, f"{p}.fc2", compute, (h, i),
                           [lambda e=e: down[e]().T for e in range(e)])]  # type: ignore[index]
        else:
            op = "QMoE"
            operands = self.int4_operands(graph, weights, bindings, p, q, compute)
            attrs += [ir.AttrInt64("expert_weight_bits", 4), ir.AttrInt64("block_size", q["down"][0].group)]
        old = outputs[0]
        new = ir.Value(name=f"{old.name}_moe", shape=old.shape, type=old.type)
        moe = ir.Node(MS_DOMAIN, op, [x, logits[0], *operands], attrs, outputs=[new],
                      name=f"{QWEN_NAMES.experts_scope(layer)}/{op}")
        graph.insert_before(nodes[-1], moe)
        old.replace_all_uses_with(new)
        for node in reversed(nodes):
            graph.remove(node, safe=True)
        for node in reversed(constants):
            if not any(v.uses() or v.is_graph_output() for v in node.outputs):
                graph.remove(node, safe=True)
        for w in ("gate_up", "down"):
            if not graph.initializers[f"{p}.{w}"].uses():
                graph.initializers.pop(f"{p}.{w}")
        return None

    def int4_operands(self, graph: ir.Graph, weights: Weights, bindings: dict[str, WeightRef], p: str,
                      q: dict[str, list[Int4Weight]], compute: ir.DataType | None) -> list[ir.Value | None]:
        """QMoE's fc1 [E, 2I, H/2] (gate and up rows interleaved), fc1_scales [E, 2I, H/g], fc2 [E, H, I/2],
        fc2_scales [E, H, I/g]: each expert's packed bytes as stored (MatMulNBits' nibble order, value + 8,
        QMoE's implicit zero point), and its scales in the compute dtype."""
        ckpt = self.ckpt
        gate, up, down = q["gate"], q["up"], q["down"]

        def rows(w: Int4Weight) -> torch.Tensor:
            return w.nbits_b(ckpt).reshape(w.n, w.k // 2)

        def scales(w: Int4Weight) -> torch.Tensor:
            return ckpt.raw(w.scale_name)

        def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.stack((a, b), dim=1).reshape(2 * a.shape[0], a.shape[1])

        e, g = len(down), down[0].group
        i, h = gate[0].n, gate[0].k
        experts = range(e)
        return [
            self.stack(graph, weights, bindings, f"{p}.fc1_int4", ir.DataType.UINT8, (2 * i, h // 2),
                       [lambda e=e: pair(rows(gate[e]), rows(up[e])) for e in experts], stored=True),
            self.stack(graph, weights, bindings, f"{p}.fc1_scales", compute, (2 * i, h // g),
                       [lambda e=e: pair(scales(gate[e]), scales(up[e])) for e in experts]),
            None,
            self.stack(graph, weights, bindings, f"{p}.fc2_int4", ir.DataType.UINT8, (h, i // 2),
                       [lambda e=e: rows(down[e]) for e in experts], stored=True),
            self.stack(graph, weights, bindings, f"{p}.fc2_scales", compute, (h, i // g),
                       [lambda e=e: scales(down[e]) for e in experts]),
        ]

    @staticmethod
    def stack(graph: ir.Graph, weights: Weights, bindings: dict[str, WeightRef], name: str, dtype: ir.DataType | None,
              shape: tuple[int, ...], parts: list[Callable[[], torch.Tensor]], *, stored: bool = False) -> ir.Value:
        """An [E, *shape] initializer written one expert at a time (`stored`: bytes as produced)."""
        if name in graph.initializers:
            return graph.initializers[name]
        v = ir.Value(name=name, shape=ir.Shape([len(parts), *shape]), type=ir.TensorType(dtype or ir.DataType.FLOAT))
        graph.initializers.add(v)
        (weights.stored_stack if stored else weights.stack)(name, shape, parts)
        bindings[name] = WeightRef(name)
        return v


def int4_experts(ckpt: object, layer: int) -> dict[str, list[Int4Weight]] | None:
    """The layer's experts as QMoE can take them: every projection symmetric int4 (compressed-tensors),
    one power-of-two group ≥ 16 dividing K; else None (they run dequantised in MoE)."""
    quantized = ckpt.quantized  # type: ignore[attr-defined]
    e = ckpt.dims.experts  # type: ignore[attr-defined]
    q = {proj: [quantized.get(QWEN_NAMES.expert(QWEN_NAMES.mlp(layer), x, proj)) for x in range(e)]
         for proj in ("gate", "up", "down")}
    flat = [w for ws in q.values() for w in ws]
    if not all(isinstance(w, Int4Weight) and w.symmetric and w.layout.packs_int32 for w in flat):
        return None
    groups = {w.group for w in flat}
    g = groups.pop() if len(groups) == 1 else 0
    if g < 16 or g & (g - 1) or any(w.k % g or w.k % 2 for w in flat):
        return None
    return q  # type: ignore[return-value]


def interleave(gate_up: torch.Tensor, i: int) -> torch.Tensor:
    """[H, 2I] with gate | up side by side (the stack's Wᵀ) → [2I, H] with rows g₀, u₀, g₁, u₁, …"""
    return torch.stack((gate_up[:, :i].T, gate_up[:, i:].T), dim=1).reshape(2 * i, gate_up.shape[0])
