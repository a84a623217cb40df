"""Replace each layer's cache attention with ONNX Runtime's kernel, `com.microsoft::GroupQueryAttention`.

The static graph's attention (`self_attn.cache_attention`, static_model.CacheAttention) scores
every query against all P cache slots, filled or not, because its shapes are static: a decode step
of Qwen3-0.6B reads 112 MiB of fp32 K/V (P = 512) for a 64-token conversation, a third of what its
int4 weights cost. GroupQueryAttention takes the cache with a per-row length (`seqlens_k`) and reads
only the filled slots; with an `attention_bias` it applies the graph's own mask to them.

    /model/layers.N/self_attn/cache_attention/*  (MatMul, Concat, Softmax, ... over P + T columns)
        becomes
    GroupQueryAttention(q [B, T, N·D], k, v [B, T, Nkv·D], past_key, past_value sliced to [B, Nkv, max L, D],
                        seqlens_k = L + T − 1, total_sequence_length = max L + T, bias)

The lengths come from the mask, once per graph: L (per row) is one past the last cache slot that
any of the T rows may attend to, and `bias` [B, 1, T, max L + T] gathers, for each row, the mask's
columns 0..L−1 (cache) then P..P+T−1 (the new tokens). So holes in the cache, left padding in a
chunk and rows of different lengths keep exactly the graph's masking; only slots at L and beyond,
which the mask already excludes, are skipped. The kernel writes the new K/V into its own copy of
the cache (`present_*`, unused): the graph keeps its new-K/V-only outputs, computed before it.

The cache is sliced to its filled length because the kernel copies its past input into its present
output: a P-long past cost 0.55 ms per layer against 0.11 sliced (Qwen3-0.6B shapes). RoPE
(`self_attn.rotary`) becomes two `com.microsoft::RotaryEmbedding` on the [B, T, heads·D] view.

A layer is left as it was, with the reason in the pass's log, when its region is not the expected
shape (six inputs: q, k, v, mask, past K/V; one output), and a prefill graph at batch > 1 keeps the
portable attention (the kernel takes a chunk with a cache only at batch 1). Recipes for targets
without these kernels (Ascend) leave the pass out.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import (
    MS_DOMAIN,
    attention_roles,
    boundary,
    const,
    derived_from,
    is_constant,
    regions,
    remove_unread,
    sweep,
)
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.signature import ROLE_CACHE_KEY, ROLE_CACHE_VALUE

SCOPE = QWEN_NAMES.attention_scope_re("cache_attention")
ROTARY = QWEN_NAMES.attention_scope_re("rotary")
LENGTHS = "/model/attention_lengths"


def cache_name(past: str) -> str:
    """`past_key.{i}` → `cache_key.{i}`: the shared-cache output bound to that input's buffer."""
    return past.replace("past_", "cache_", 1)


def node(graph: ir.Graph, before: ir.Node, op: str, inputs: list[ir.Value | None], name: str,
         attrs: list[ir.Attr] | None = None, *, like: tuple[ir.DataType, list[int | str]] | None = None,
         outputs: int = 1, domain: str = "") -> list[ir.Value]:
    """A node inserted before `before`; `like` types and shapes its outputs (symbolic dims by name)."""
    out = [ir.Value(name=f"{name}/output_{i}") for i in range(outputs)]
    if like is not None:
        for v in out:
            v.type, v.shape = ir.TensorType(like[0]), ir.Shape(like[1])
    graph.insert_before(before, ir.Node(domain, op, inputs, attrs or [], outputs=out, name=name))
    return out


def origin(out: ir.Value, sources: list[ir.Value], members: set[ir.Node]) -> ir.Value | None:
    """Which of `sources` the region computes `out` from (q's rotation never reads k)."""
    seen: set[int] = set()
    stack = [out]
    while stack:
        v = stack.pop()
        if v in sources:
            return v
        producer = v.producer()
        if producer is None or producer not in members or id(v) in seen:
            continue
        seen.add(id(v))
        stack.extend(i for i in producer.inputs if i is not None)
    return None


class Lengths:
    """The per-graph values every layer's kernel shares, built from the mask before the first layer."""

    def __init__(self, graph: ir.Graph, mask: ir.Value, before: ir.Node, p: int, t: int | ir.SymbolicDim) -> None:
        def op(kind: str, inputs: list[ir.Value | None], suffix: str, dtype: ir.DataType, shape: list[int | str],
               *attrs: ir.Attr) -> ir.Value:
            return node(graph, before, kind, inputs, f"{LENGTHS}/{suffix}", list(attrs), like=(dtype, shape))[0]

        def c(name: str, value: np.ndarray) -> ir.Value:
            return const(graph, f"{LENGTHS}.{name}", value)

        i64, I64, I32 = np.int64, ir.DataType.INT64, ir.DataType.INT32  # noqa: N806
        b, s = mask.shape[0], "total_sequence_length"  # type: ignore[index]
        if isinstance(t, int):
            def plus_t(offset: int, name: str) -> ir.Value:  # the constant T + offset
                return c(name, np.array(t + offset, i64))
        else:  # a prefill graph exported with gears: T is the mask's axis 2, read once per call
            mask_dims = op("Shape", [mask], "mask_shape", I64, [4])
            tokens = op("Gather", [mask_dims, c("axis2_s", np.array(2, i64))], "tokens", I64, [])

            def plus_t(offset: int, name: str) -> ir.Value:
                return tokens if offset == 0 else op("Add", [tokens, c(f"{name}_offset", np.array(offset, i64))],
                                                     name, I64, [])
        cached = op("Slice", [mask, c("zero", np.array([0], i64)), c("p", np.array([p], i64)),
                              c("axis3", np.array([3], i64))], "cached", mask.dtype, [b, 1, t, p])
        # The mask's "masked" value is the dtype's minimum (or −inf): anything above half of it attends.
        lowest = np.float16 if mask.dtype == ir.DataType.FLOAT16 else np.float32
        floor = np.array(np.finfo(lowest).min / 2).astype(lowest)
        attends = op("Greater", [cached, c("floor", floor)], "open", ir.DataType.BOOL, [b, 1, t, p])
        attends = op("Cast", [attends], "open_i64", I64, [b, 1, t, p], ir.AttrInt64("to", I64))
        slot = op("Mul", [attends, c("slots", np.arange(1, p + 1, dtype=i64))], "slot", I64, [b, 1, t, p])
        length = op("ReduceMax", [slot, c("axes123", np.array([1, 2, 3], i64))], "length", I64, [b],
                    ir.AttrInt64("keepdims", 0))  # [B]: one past the last attended cache slot
        last = op("Add", [length, plus_t(-1, "t_minus_1")], "last", I64, [b])
        self.seqlens = op("Cast", [last], "seqlens_k", I32, [b], ir.AttrInt64("to", I32))
        longest = op("ReduceMax", [length], "longest", I64, [], ir.AttrInt64("keepdims", 0))
        self.filled = op("Reshape", [longest, c("flat", np.array([1], i64))], "filled", I64, [1])  # Slice's end
        self.zero, self.axis2 = c("zero", np.array([0], i64)), c("axis2", np.array([2], i64))
        total = op("Add", [longest, plus_t(0, "t")], "total64", I64, [])
        self.total = op("Cast", [total], "total_sequence_length", I32, [], ir.AttrInt64("to", I32))
        # Row b's kernel column j is cache slot j while j < L_b, then new token j − L_b (mask column
        # P + j − L_b); columns past L_b + T are never read by the kernel (clipped to a valid index).
        j = op("Range", [c("zero_s", np.array(0, i64)), total, c("one_s", np.array(1, i64))], "j", I64, [s])
        j = op("Unsqueeze", [j, c("axis0", np.array([0], i64))], "j_row", I64, [1, s])
        lb = op("Unsqueeze", [length, c("axis1", np.array([1], i64))], "length_col", I64, [b, 1])
        new = op("Add", [op("Sub", [j, lb], "j_minus_l", I64, [b, s]), c("p_s", np.array(p, i64))],
                 "new_col", I64, [b, s])
        col = op("Where", [op("Less", [j, lb], "in_cache", ir.DataType.BOOL, [b, s]), j, new], "col_any", I64, [b, s])
        col = op("Min", [col, plus_t(p - 1, "last_col")], "col", I64, [b, s])
        rows = op("Reshape", [col, c("col_shape", np.array([b, 1, 1, -1], i64))], "col_4d", I64, [b, 1, 1, s])
        if isinstance(t, int):
            shape = op("Concat", [c("bias_lead", np.array([b, 1, t], i64)), self.filled], "bias_lead_filled", I64,
                       [4], ir.AttrInt64("axis", 0))
            shape = op("Add", [shape, c("bias_t", np.array([0, 0, 0, t], i64))], "bias_shape", I64, [4])
        else:  # [B, 1, T, L + T]
            t1 = op("Reshape", [tokens, c("flat", np.array([1], i64))], "tokens_1d", I64, [1])
            shape = op("Concat", [c("bias_b1", np.array([b, 1], i64)), t1, op("Add", [self.filled, t1], "filled_t",
                                  I64, [1])], "bias_shape", I64, [4], ir.AttrInt64("axis", 0))
        index = op("Expand", [rows, shape], "bias_index", I64, [b, 1, t, s])
        self.bias = op("GatherElements", [mask, index], "bias", mask.dtype, [b, 1, t, s], ir.AttrInt64("axis", 3))


@register
class FuseAttention:
    """Cache attention (portable standard ops) → one com.microsoft::GroupQueryAttention per layer (ONNX Runtime)."""

    name: ClassVar[str] = "fuse_attention"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "checkpoint", "signatures")
    produces: ClassVar[tuple[str, ...]] = ("attention_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "signatures")

    def __init__(self, share_cache: bool = True) -> None:
        """`share_cache`: in a decode graph (T = 1), hand the kernel the whole static cache and return its
        present as `cache_key/value.{i}` [B, H, P, D], which the runtime binds to the past input's own
        buffer: ONNX Runtime then reads the cache in place and writes only the new token's slot, where
        a sliced past is copied twice per layer and step (a cost that grows with the conversation).
        Off, or in prefill graphs (a padded chunk could run past the buffer's end), the past is sliced."""
        self.share_cache = bool(share_cache)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        dims = state.checkpoint.dims
        # Per graph (decode_fused_layers=4, prefill_fused_layers=4): a sum read 8 layers in a 4-layer model.
        stats: dict[str, int | float | str] = {}
        for kind, model in state.graphs.items():
            here = self.fuse_graph(state, ctx, kind, model, dims)
            stats |= {f"{kind}_{k}": n for k, n in here.items() if n or k != "shared_cache_layers"}
        changed = any(n for k, n in stats.items() if k.endswith(("_fused_layers", "_rotary_layers")))
        return PassResult(changed, stats)

    def fuse_graph(self, state: ConvertState, ctx: RunContext, kind: str, model: ir.Model, dims: object
                   ) -> dict[str, int]:
        """Fuse one graph's rotary embeddings and attention layers; returns how many layers of it were
        fused, kept in standard ops, given a rotary kernel, and read their cache in place."""
        graph = model.graph
        counts = dict.fromkeys(("fused_layers", "kept_layers", "rotary_layers", "shared_cache_layers"), 0)
        counts["rotary_layers"] = self.fuse_rotary(graph, ctx, kind)
        if counts["rotary_layers"]:
            model.opset_imports[MS_DOMAIN] = 1
            sweep(graph, SCOPE, ROTARY)
        found = regions(graph, scope=SCOPE)
        mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
        if not found or mask is None or mask.shape is None or not isinstance(mask.shape[0], int):
            return counts
        b, t, pt = mask.shape[0], mask.shape[2], mask.shape[3]
        # With prefill gears T is symbolic ("T", the mask's last axis "T+P"): P is the cache's length.
        p = pt - t if isinstance(t, int) else next(
            (v.shape[2] for v in graph.inputs if v.name.startswith("past_key") and v.shape is not None), None)
        if not isinstance(p, int):
            return counts
        if b > 1 and (not isinstance(t, int) or t > 1):
            # ONNX Runtime 1.32: "batch_size must be 1 when sequence_length > 1 and past context is given".
            ctx.log(f"{kind} graph: attention left in standard ops: the kernel takes a chunk with a "
                    f"cache only at batch 1 (this graph: batch {b}, {t} tokens)")
            counts["kept_layers"] = len(found)
            return counts
        lengths: Lengths | None = None
        for layer, region in found.items():
            # Nodes computing constants may be shared with other layers after the exporter's
            # CSE: they stay, and go only if nothing else reads them.
            constants = [n for n in region if all(is_constant(v) for v in n.inputs)]
            nodes = [n for n in region if n not in constants]
            roles = attention_roles(graph, nodes, mask)
            if isinstance(roles, str):
                ctx.log(f"{kind} graph, layer {layer}: attention left in standard ops: {roles}")
                counts["kept_layers"] += 1
                continue
            if lengths is None:
                first = next(n for n in graph if n.name and SCOPE.match(n.name))
                lengths = Lengths(graph, mask, first, p, t)
            share = self.share_cache and t == 1
            self.fuse(graph, layer, nodes, roles, lengths, dims, share=share)
            if share:  # the signature lists the cache outputs as the past inputs, renamed
                inputs, outputs = state.signatures[kind]
                spec = {s.name: s for s in inputs}
                outputs += [dataclasses.replace(spec[roles[r].name], name=cache_name(roles[r].name), role=role)
                            for r, role in (("past_k", ROLE_CACHE_KEY), ("past_v", ROLE_CACHE_VALUE))]
                counts["shared_cache_layers"] += 1
            remove_unread(graph, constants)
            counts["fused_layers"] += 1
        if counts["fused_layers"]:
            model.opset_imports[MS_DOMAIN] = 1
            sweep(graph, SCOPE, ROTARY)
        return counts

    @staticmethod
    def fuse_rotary(graph: ir.Graph, ctx: RunContext, kind: str) -> int:
        """Each layer's `self_attn.rotary` → one com.microsoft::RotaryEmbedding for q and one for k,
        on the [B, T, heads·D] view, reading the graph's own fp32 tables (first half of each row);
        returns the number of layers rewritten."""
        found = regions(graph, scope=ROTARY)
        positions = next((v for v in graph.inputs if v.name == "position_ids"), None)
        table = {n: graph.initializers.get(n) for n in ("rope_cos", "rope_sin")}
        if not found or positions is None or None in table.values():
            return 0
        caches: dict[ir.DataType, list[ir.Value]] = {}
        done = 0
        for layer, region in found.items():
            constants = [n for n in region if all(is_constant(v) for v in n.inputs)]
            nodes = [n for n in region if n not in constants]
            inputs, outputs = boundary(graph, nodes)
            # cos/sin (and their reshapes, which the exporter may share with later layers) are not operands.
            operands = [v for v in inputs if not derived_from(v, positions)]
            outputs = [v for v in outputs if not derived_from(v, positions)]
            shapes = [v.shape for v in operands]
            if len(operands) != 2 or len(outputs) != 2 or any(x is None or len(x) != 4 for x in shapes):
                ctx.log(f"{kind} graph, layer {layer}: RoPE left in standard ops: expected q, k [B, T, heads, D] "
                        f"and two outputs, found {len(operands)} and {len(outputs)}")
                continue
            scope, before = QWEN_NAMES.attention_scope(layer, "rotary"), nodes[0]
            r = table["rope_cos"].shape[1]  # type: ignore[union-attr]
            dtype = operands[0].dtype
            if dtype not in caches:  # [positions, r/2] in the compute dtype; ONNX Runtime folds these at load
                half = const(graph, "/model/rotary.half", np.array([r // 2], np.int64))
                zero, one = const(graph, "/model/rotary.zero", np.array([0], np.int64)), \
                    const(graph, "/model/rotary.one", np.array([1], np.int64))
                caches[dtype] = []
                for name, t in table.items():
                    rows = [t.shape[0], r // 2]  # type: ignore[union-attr]
                    v = node(graph, before, "Slice", [t, zero, half, one], f"/model/rotary/{name}_half",
                             like=(ir.DataType.FLOAT, rows))[0]
                    if dtype != ir.DataType.FLOAT:
                        v = node(graph, before, "Cast", [v], f"/model/rotary/{name}_half_cast",
                                 [ir.AttrInt64("to", dtype)], like=(dtype, rows))[0]
                    caches[dtype].append(v)
            for out in outputs:
                source = origin(out, operands, set(nodes))
                if source is None:
                    raise AssertionError(f"{scope}: {out.name} reads neither q nor k")
                heads, d = source.shape[2], source.shape[3]  # type: ignore[index]
                flat = const(graph, "/model/rotary.flat", np.array([0, 0, -1], np.int64))
                bsh = (dtype, [*source.shape[:2], heads * d])  # type: ignore[index]
                x = node(graph, before, "Reshape", [source, flat], f"{scope}/{source.name}_bsh", like=bsh)[0]
                y = node(graph, before, "RotaryEmbedding", [x, positions, *caches[dtype]],
                         f"{scope}/RotaryEmbedding_{source.name}",
                         [ir.AttrInt64("num_heads", heads), ir.AttrInt64("rotary_embedding_dim", r),
                          ir.AttrInt64("interleaved", 0)], like=bsh, domain=MS_DOMAIN)[0]
                heads_shape = const(graph, f"/model/rotary.heads_{heads}", np.array([0, 0, heads, d], np.int64))
                out.replace_all_uses_with(node(graph, before, "Reshape", [y, heads_shape], f"{scope}/{out.name}",
                                               like=(dtype, list(source.shape)))[0])  # type: ignore[arg-type]
            remove_unread(graph, nodes)
            remove_unread(graph, constants)
            done += 1
        return done

    @staticmethod
    def fuse(graph: ir.Graph, layer: int, nodes: list[ir.Node], roles: dict[str, ir.Value], lengths: Lengths,
             dims: object, *, share: bool = False) -> None:
        scope = QWEN_NAMES.attention_scope(layer, "cache_attention")
        before = nodes[0]

        def packed(v: ir.Value, heads: int, name: str) -> ir.Value:
            """[B, heads, T, D] → [B, T, heads·D]: the kernel's packed layout. When `v` is itself the
            BNSD transpose of a BSND value (as the static model writes it), reshape that instead."""
            src = v.producer()
            if src is not None and src.op_type == "Transpose" and list(src.attributes["perm"].value) == [0, 2, 1, 3]:
                bsnd = src.inputs[0]
            else:
                n0, n1, n2, n3 = v.shape  # type: ignore[misc]
                bsnd = node(graph, before, "Transpose", [v], f"{scope}/{name}_bsnd",
                            [ir.AttrInt64s("perm", [0, 2, 1, 3])], like=(v.dtype, [n0, n2, n1, n3]))[0]
            shape = const(graph, f"/model/attention.packed_{heads}", np.array([0, 0, heads * dims.head_dim], np.int64))  # type: ignore[attr-defined]
            b, t = v.shape[0], v.shape[2]  # type: ignore[index]
            return node(graph, before, "Reshape", [bsnd, shape], f"{scope}/{name}_packed",
                        like=(v.dtype, [b, t, heads * dims.head_dim]))[0]  # type: ignore[attr-defined, list-item]

        heads, kv_heads = dims.heads, dims.kv_heads  # type: ignore[attr-defined]
        q, k, v = packed(roles["q"], heads, "q"), packed(roles["k"], kv_heads, "k"), packed(roles["v"], kv_heads, "v")
        # The kernel copies its past input into its present output: handing it only the filled
        # slots keeps that copy (and the output's allocation) ∝ the conversation, not P.
        def filled(v: ir.Value, name: str) -> ir.Value:
            b, n, _, d = v.shape  # type: ignore[misc]
            return node(graph, before, "Slice", [v, lengths.zero, lengths.filled, lengths.axis2], f"{scope}/{name}",
                        like=(v.dtype, [b, n, "filled", d]))[0]  # type: ignore[arg-type]

        if share:  # the whole cache, read in place once the runtime binds cache_* to the past buffers
            past_k, past_v = roles["past_k"], roles["past_v"]
            present_names = [cache_name(past_k.name), cache_name(past_v.name)]  # type: ignore[arg-type]
            present_shape = past_k.shape
        else:
            past_k, past_v = filled(roles["past_k"], "past_k_filled"), filled(roles["past_v"], "past_v_filled")
            present_names = [f"{scope}/present_key", f"{scope}/present_value"]
            present_shape = ir.Shape([past_k.shape[0], kv_heads, "present", dims.head_dim])  # type: ignore[index, attr-defined]
        old = roles["out"]
        gqa = ir.Node(MS_DOMAIN, "GroupQueryAttention",
                      [q, k, v, past_k, past_v, lengths.seqlens, lengths.total,
                       None, None, None, lengths.bias],
                      [ir.AttrInt64("num_heads", heads), ir.AttrInt64("kv_num_heads", kv_heads),
                       ir.AttrFloat32("scale", dims.head_dim ** -0.5)],  # type: ignore[attr-defined]
                      # Without the present outputs ONNX Runtime 1.32's CPU kernel ignores the cache
                      # (measured): sliced, they are produced and left unused; shared, they are the
                      # graph's cache_* outputs.
                      outputs=[ir.Value(name=f"{old.name}_gqa", shape=old.shape, type=old.type),
                               *(ir.Value(name=n, type=past_k.type, shape=ir.Shape(present_shape))  # type: ignore[arg-type]
                                 for n in present_names)],
                      name=f"{scope}/GroupQueryAttention")
        graph.insert_before(before, gqa)
        if share:
            graph.outputs.extend(gqa.outputs[1:])
        old.replace_all_uses_with(gqa.outputs[0])
        if old.is_graph_output():
            raise AssertionError(f"{old.name}: the attention output is a graph output")  # never: o_proj reads it
        remove_unread(graph, nodes)  # shared mask reshapes stay
        for r in ("q", "k", "v"):  # BNSD transposes that only the region read
            src = roles[r].producer()
            if src is not None and not roles[r].uses() and not roles[r].is_graph_output():
                graph.remove(src, safe=True)
