"""Attention over the filled cache as the NPU's own kernel: `npu::NPUPromptFlashAttention`.

The static graph's attention (`self_attn.cache_attention`) scores every query against all P cache
slots: at P = 32k a prefill chunk of T = 128 materialises [N, T, P + T] float32 scores per layer
(512 MiB for 32 heads). CANN's PromptFlashAttention takes per-row actual lengths and reads only
key slots below them, without materialising the scores (kernels/npu_attention.py):

    /model/layers.N/self_attn/cache_attention/*
        becomes
    K = Concat(k, past_key), V = Concat(v, past_value)             [B, Nkv, T + P, D]: the new tokens first
    PromptFlashAttention(q, K, V, —, mask′, T, L + T; BNSD, num_key_value_heads = Nkv, scale 1/√D)

so that the slots read, 0 .. L + T − 1, are the T new tokens and the L filled cache slots. L (per row)
comes from the graph's own mask as in the ONNX Runtime pass: one past the last cache slot any of the
T rows may attend to. mask′ is the mask's columns in the same order (new tokens, then the cache) as
a boolean "masked", so holes in the cache, left padding and causality inside the chunk keep exactly
the graph's masking; only slots at L and beyond, which the mask excludes anyway, are skipped.

Why the new tokens are concatenated: the kernel reads one K/V tensor that must already hold them,
and the graph may not write into its cache input (the signature returns new K/V only; CANN has no
ONNX parser for an in-place cache update: ScatterND becomes TensorMove + ScatterNdUpdate, a copy).
So the fused form copies each layer's cache once per call (2·P·Nkv·D elements). A prefill chunk
gains far more than that (no [T, P + T] scores, compute ∝ L + T: −45 % to −80 % of the bytes a
Qwen3-8B chunk reads). A decode step does not: each form touches the whole cache once per step (the
portable one in its K Transpose and MatMuls, the fused one in the copy), −7 % to +7 % of the bytes
read on paper. Decode attention therefore stays portable unless the recipe asks
(`fuse_attention_ascend: {decode: true}`); docs/ascend.md has the table (bench/ascend_bytes.py).

Why not NPUIncreFlashAttention for decode: its ONNX plugin never forwards num_key_value_heads (the
op's default, 1, then applies) and wires its key/value inputs from index 1, so grouped-query models
cannot go through it (the table's `_constraints.ops.NPUIncreFlashAttention`). PromptFlashAttention
takes T = 1 as well. It is registered in ai.onnx only for opsets 11-16 and 19, so the `npu` domain
(version 1) is used. A layer stays portable, logged, when its region is not the expected shape, or
the SoC has no kernel for the graph's dtype (fp32 graphs; Ascend310B1 none at all).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.arch import ModelDims
from qwen2om.ascend import Soc, soc_info
from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import attention_roles, const, is_constant, regions, remove_unread, sweep
from qwen2om.kernels.npu_attention import NO_LIMIT, PFA
from qwen2om.npu_kernels import NPU_DOMAIN, missing_kernel
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

SCOPE = QWEN_NAMES.attention_scope_re("cache_attention")
LENGTHS = "/model/npu_attention_lengths"
I64 = ir.DataType.INT64


class Emit:
    """Inserts nodes before one anchor node, typing their outputs."""

    def __init__(self, graph: ir.Graph, before: ir.Node) -> None:
        self.graph, self.before = graph, before

    def __call__(self, op: str, inputs: list[ir.Value | None], name: str, dtype: ir.DataType,
                 shape: list[int | str | ir.SymbolicDim | None] | None, *attrs: ir.Attr, domain: str = "") -> ir.Value:
        node = ir.Node(domain, op, inputs, list(attrs), num_outputs=1, name=name)
        out = node.outputs[0]
        out.name, out.type = f"{name}/output_0", ir.TensorType(dtype)
        out.shape = ir.Shape(shape) if shape is not None else None  # type: ignore[arg-type]
        self.graph.insert_before(self.before, node)
        return out

    def const(self, name: str, value: np.ndarray) -> ir.Value:
        return const(self.graph, f"{LENGTHS}.{name}", value)


class Lengths:
    """What every layer's kernel shares, from the mask [B, 1, T, P + T], built once per graph:
    the query lengths (T per row), the key lengths L + T, and mask′ (new-token columns first)."""

    def __init__(self, emit: Emit, mask: ir.Value, p: int, t: int | ir.SymbolicDim | None) -> None:
        b = mask.shape[0]  # type: ignore[index]
        if isinstance(t, int):
            tokens = emit.const("t", np.array(t, np.int64))
        else:  # a prefill graph exported with gears: T is the mask's axis 2, read per call
            dims = emit("Shape", [mask], f"{LENGTHS}/mask_shape", I64, [4])
            tokens = emit("Gather", [dims, emit.const("axis2_s", np.array(2, np.int64))], f"{LENGTHS}/tokens", I64, [])
        zero, start_p, axis3 = (emit.const(n, np.array([v], np.int64)) for n, v in (("zero", 0), ("p", p),
                                                                                     ("axis3", 3)))
        cached = emit("Slice", [mask, zero, start_p, axis3], f"{LENGTHS}/cached", mask.dtype, [b, 1, t, p])
        # The mask's "masked" value is the dtype's minimum (or −inf): anything above half of it attends.
        lowest = np.float16 if mask.dtype == ir.DataType.FLOAT16 else np.float32
        floor = emit.const("floor", np.array(np.finfo(lowest).min / 2).astype(lowest))
        opened = emit("Greater", [cached, floor], f"{LENGTHS}/open", ir.DataType.BOOL, [b, 1, t, p])
        opened = emit("Cast", [opened], f"{LENGTHS}/open_i64", I64, [b, 1, t, p], ir.AttrInt64("to", I64))
        slot = emit("Mul", [opened, emit.const("slots", np.arange(1, p + 1, dtype=np.int64))], f"{LENGTHS}/slot", I64,
                    [b, 1, t, p])
        length = emit("ReduceMax", [slot, emit.const("axes123", np.array([1, 2, 3], np.int64))], f"{LENGTHS}/length",
                      I64, [b], ir.AttrInt64("keepdims", 0))  # [B]: one past the last attended cache slot
        self.kv = emit("Add", [length, tokens], f"{LENGTHS}/actual_seq_lengths_kv", I64, [b])
        self.q = emit("Expand", [tokens, emit.const("batch", np.array([b], np.int64))], f"{LENGTHS}/actual_seq_lengths",
                      I64, [b])
        end = emit.const("end", np.array([2**62], np.int64))
        new = emit("Slice", [mask, start_p, end, axis3], f"{LENGTHS}/new_columns", mask.dtype, [b, 1, t, t])
        ordered = emit("Concat", [new, cached], f"{LENGTHS}/columns", mask.dtype, [b, 1, t, None],
                       ir.AttrInt64("axis", 3))
        self.mask = emit("LessOrEqual", [ordered, floor], f"{LENGTHS}/atten_mask", ir.DataType.BOOL, [b, 1, t, None])


@register
class FuseAttentionAscend:
    """Cache attention (portable standard ops) → one npu::NPUPromptFlashAttention per layer (Ascend)."""

    name: ClassVar[str] = "fuse_attention_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("attention_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __init__(self, decode: bool = False) -> None:
        """`decode`: fuse decode graphs (T = 1) too, although their fused form copies the cache each step."""
        self.decode = bool(decode)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        soc = soc_info(ctx.recipe.soc_version)
        dims = state.checkpoint.dims
        stats: dict[str, int | float | str] = {}
        for kind, model in state.graphs.items():
            fused, kept = self.fuse_graph(model, kind, dims, soc, ctx)
            stats |= {f"{kind}_fused_attention": fused, f"{kind}_kept_attention": kept}
            if fused:
                model.opset_imports[NPU_DOMAIN] = 1
        return PassResult(any(v for k, v in stats.items() if k.endswith("_fused_attention")), stats)

    def fuse_graph(self, model: ir.Model, kind: str, dims: ModelDims, soc: Soc, ctx: RunContext) -> tuple[int, int]:
        graph = model.graph
        found = regions(graph, scope=SCOPE)
        mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
        if not found or mask is None or mask.shape is None or not isinstance(mask.shape[0], int):
            return 0, 0
        t, pt = mask.shape[2], mask.shape[3]
        p = pt - t if isinstance(t, int) and isinstance(pt, int) else next(
            (v.shape[2] for v in graph.inputs if v.name.startswith("past_key") and v.shape is not None), None)
        if not isinstance(p, int):
            return 0, len(found)
        if t == 1 and not self.decode:
            ctx.log(f"{kind} graph: attention left in standard ops: fused, a decode step would first copy each "
                    "layer's cache (the kernel reads one K/V tensor holding the new token), which on paper costs "
                    "what the kernel saves (docs/ascend.md); `fuse_attention_ascend: {decode: true}` fuses it anyway")
            return 0, len(found)
        why = missing_kernel(PFA, soc, {"query": mask.dtype, "atten_mask": ir.DataType.BOOL})
        if why:
            ctx.log(f"{kind} graph: attention left in standard ops: {why}")
            return 0, len(found)
        lengths: Lengths | None = None
        fused = kept = 0
        for layer, region in found.items():
            constants = [n for n in region if all(is_constant(v) for v in n.inputs)]
            nodes = [n for n in region if n not in constants]
            roles = attention_roles(graph, nodes, mask)
            if isinstance(roles, str):
                ctx.log(f"{kind} graph, layer {layer}: attention left in standard ops: {roles}")
                kept += 1
                continue
            if lengths is None:
                first = next(n for n in graph if n.name and SCOPE.match(n.name))
                lengths = Lengths(Emit(graph, first), mask, p, t)
            self.fuse(graph, layer, nodes, roles, lengths, dims)
            remove_unread(graph, constants)
            fused += 1
        if fused:
            sweep(graph, SCOPE)
        return fused, kept

    @staticmethod
    def fuse(graph: ir.Graph, layer: int, nodes: list[ir.Node], roles: dict[str, ir.Value], lengths: Lengths,
             dims: ModelDims) -> None:
        scope = QWEN_NAMES.attention_scope(layer, "cache_attention")
        emit = Emit(graph, nodes[0])
        heads, kv_heads, d = dims.heads, dims.kv_heads, dims.head_dim
        q, old = roles["q"], roles["out"]
        b, t = q.shape[0], q.shape[2]  # type: ignore[index]
        full = []
        for new, past, name in ((roles["k"], roles["past_k"], "key"), (roles["v"], roles["past_v"], "value")):
            p = past.shape[2]  # type: ignore[index]
            total = t + p if isinstance(t, int) else None
            full.append(emit("Concat", [new, past], f"{scope}/{name}_Concat", q.dtype, [b, kv_heads, total, d],  # type: ignore[list-item]
                             ir.AttrInt64("axis", 2)))
        out = emit(PFA, [q, *full, None, lengths.mask, lengths.q, lengths.kv], f"{scope}/{PFA}", q.dtype,
                   [b, heads, t, d],
                   ir.AttrInt64("num_heads", heads), ir.AttrString("input_layout", "BNSD"),
                   ir.AttrFloat32("scale_value", d ** -0.5), ir.AttrInt64("pre_tokens", NO_LIMIT),
                   ir.AttrInt64("next_tokens", NO_LIMIT), ir.AttrInt64("num_key_value_heads", kv_heads),
                   ir.AttrInt64("sparse_mode", 0), ir.AttrInt64("inner_precise", 0), domain=NPU_DOMAIN)
        bsnd = emit("Transpose", [out], f"{scope}/Transpose_out", q.dtype, [b, t, heads, d],
                    ir.AttrInt64s("perm", [0, 2, 1, 3]))
        flat = const(graph, f"/model/attention.merged_{heads * d}", np.array([0, 0, heads * d], np.int64))
        merged = emit("Reshape", [bsnd, flat], f"{scope}/Reshape_out", q.dtype, list(old.shape))  # type: ignore[arg-type]
        old.replace_all_uses_with(merged)
        remove_unread(graph, nodes)  # shared mask reshapes stay


