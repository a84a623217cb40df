"""The static-shape Qwen forward that gets exported (Qwen2 / Qwen3, dense and MoE).

Signature (DESIGN.md): input_ids int64 [B,T], additive attention_mask [B,1,T,P+T] in the
compute dtype, position_ids int64 [B,T], and per layer past_key / past_value [B,Nkv,P,D]
(BNSD). Outputs: logits (float32; all T or the last), and the K/V of the T new tokens only.

Two choices keep decode fast on a runtime that cannot alias buffers:
- attention scores against the cache and against the new tokens are computed separately and
  only the small score rows are concatenated, so the [P]-long cache is never copied per step
  (CacheAttention; on ONNX Runtime `fuse_attention` swaps it for a kernel that reads only the
  filled slots);
- linear weights are stored transposed ([in, out]) so the graph has no Transpose of a weight
  at run time; with tied embeddings the single [hidden, vocab] table serves both the
  embedding Gather (along axis 1) and the LM head, so it is stored once.
Parameter names stay the Hugging Face ones so graph initializers read like the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from qwen2om.arch import ArchSpec, ModelDims
from qwen2om.stages import Stage
from qwen2om.weights import Weights


class Linear(nn.Module):
    """y = x @ W (+ b) with W stored [in, out]."""

    def __init__(self, w: Weights, name: str, *, bias: bool = False, source: str | None = None) -> None:
        super().__init__()
        self.weight = w.param(f"{source or name}.weight", transpose=True)
        self.bias = w.param(f"{name}.bias") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """Qwen RMSNorm: statistics in float32, scale applied in the compute dtype (as transformers).
    The hybrids' norms (static_hybrid.py) differ only in how they apply the weight."""

    def __init__(self, w: Weights, name: str, eps: float) -> None:
        super().__init__()
        self.weight = w.param(f"{name}.weight")
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x̂ in float32. Written as x / sqrt(mean(x²) + eps): the pattern ONNX Runtime fuses into one
        SimplifiedLayerNormalization kernel (rsqrt exports as Sqrt + Reciprocal, which it does not)."""
        h = x.to(torch.float32)
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """RoPE (rotate-half form) on the first `rotary_dim` channels of each head of q and k (no weights).

    q [B, T, N, D] and k [B, T, Nkv, D]; cos, sin [B, 1, T, rotary_dim] gathered from the fp32
    tables by position. One module (`self_attn.rotary`) so that a target with a RoPE kernel can swap
    it: for ONNX Runtime, `fuse_attention` replaces it with two `com.microsoft.RotaryEmbedding`.
    """

    def __init__(self, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, T, 1, r]: broadcast over heads
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot = x[..., :r]
        return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., r:]), dim=-1)


class CacheAttention(nn.Module):
    """Softmax attention of T new queries over the P cache slots and the T new keys (no weights).

    q [B, N, T, D] and k, v [B, Nkv, T, D] after RoPE; mask [B, 1, T, P+T] additive; returns
    [B, T, N·D]. One module (`self_attn.cache_attention`) so that a target with an attention kernel
    can swap the whole of it: for ONNX Runtime, `fuse_attention` replaces it with
    `com.microsoft.GroupQueryAttention`, which reads only the filled part of the cache.
    """

    def __init__(self, d: ModelDims) -> None:
        super().__init__()
        self.d = d

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        d = self.d
        b, _, t, _ = q.shape
        # GQA without repeating K/V: query head h reads kv head h // groups, so fold the
        # groups into the row axis: [B, Nkv, G*T, D].
        q = q.reshape(b, d.kv_heads, d.groups * t, d.head_dim) * (d.head_dim ** -0.5)
        p_len = past_k.shape[2]
        # Scores against the cache and against the new keys separately: only the small score rows
        # are concatenated, never the [P]-long cache.
        scores = torch.cat((torch.matmul(q, past_k.transpose(2, 3)), torch.matmul(q, k.transpose(2, 3))), dim=-1)
        scores = scores.view(b, d.kv_heads, d.groups, t, p_len + t).float() + mask.float().unsqueeze(1)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, d.kv_heads, d.groups * t, p_len + t)
        out = torch.matmul(probs[..., :p_len], past_v) + torch.matmul(probs[..., p_len:], v)
        return out.view(b, d.heads, t, d.head_dim).transpose(1, 2).reshape(b, t, d.heads * d.head_dim)


class Attention(nn.Module):
    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str) -> None:
        super().__init__()
        self.d = d
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(self, proj, Linear(w, f"{p}.{proj}", bias=arch.qkv_bias))
        self.o_proj = Linear(w, f"{p}.o_proj")
        self.q_norm = RMSNorm(w, f"{p}.q_norm", d.rms_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(w, f"{p}.k_norm", d.rms_eps) if arch.qk_norm else None
        self.rotary = Rotary(d.head_dim)
        self.cache_attention = CacheAttention(d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
        past_k: torch.Tensor, past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.d
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, d.heads, d.head_dim)
        k = self.k_proj(x).view(b, t, d.kv_heads, d.head_dim)
        v = self.v_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, N, T, D]
        return self.o_proj(self.cache_attention(q, k, v, mask, past_k, past_v)), k, v


class MLP(nn.Module):
    def __init__(self, w: Weights, p: str) -> None:
        super().__init__()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, proj, Linear(w, f"{p}.{proj}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """The E routed experts of one MoE block, given the router's logits, with static shapes and no
    data-dependent control flow.

    Softmax over E in float32, top-k (renormalised when `norm_topk_prob`). The experts are two
    stacked parameters, `gate_up` [E, H, 2I] and `down` [E, I, H], written one expert at a time
    from either on-disk layout. Then, by call shape:

    - decode (T = 1): Gather the k selected experts' weights ([N, k, H, 2I]) and run only them:
      memory traffic ∝ k experts, not E;
    - prefill (T > 1): every expert on every token of the chunk ([E, N, H] @ [E, H, 2I]), outputs
      weighted by a dense [N, E] routing matrix that is zero off the top-k. Each expert's weights are
      read once per chunk; the arithmetic is E/k times the routed work (16× for Qwen3-30B-A3B).
      Gathering per token instead would copy N·k expert matrices per chunk (1,024 for a 128-token
      chunk at top-8), which costs more memory traffic than reading all 128 experts once.

    This is the portable form, in standard ONNX ops only. It is one module (`mlp.experts`) so that
    a target with a grouped-expert kernel can swap the whole of it: for ONNX Runtime, the
    `fuse_moe` pass replaces it with `com.microsoft.MoE`, which sorts tokens by expert and costs ∝ k.
    """

    def __init__(self, d: ModelDims, w: Weights, p: str, *, fused: bool) -> None:
        super().__init__()
        self.d = d
        h, i = d.hidden, d.moe_intermediate
        if fused:
            def gate_up(e: int) -> torch.Tensor:
                return w.read_rows(f"{p}.experts.gate_up_proj", e, e + 1)[0].T

            def down(e: int) -> torch.Tensor:
                return w.read_rows(f"{p}.experts.down_proj", e, e + 1)[0].T
        else:
            def gate_up(e: int) -> torch.Tensor:
                return torch.cat((w.read(f"{p}.experts.{e}.gate_proj.weight").T,
                                  w.read(f"{p}.experts.{e}.up_proj.weight").T), dim=1)

            def down(e: int) -> torch.Tensor:
                return w.read(f"{p}.experts.{e}.down_proj.weight").T
        parts = range(d.experts)
        self.gate_up = w.stacked(f"{p}.experts.gate_up", (h, 2 * i), [lambda e=e: gate_up(e) for e in parts])
        self.down = w.stacked(f"{p}.experts.down", (i, h), [lambda e=e: down(e) for e in parts])

    def forward(self, x: torch.Tensor, logits: torch.Tensor, t: int) -> torch.Tensor:
        """x [N, H], logits [N, E] → [N, H]; `t` is the call's sequence length."""
        d = self.d
        weight, index = torch.topk(torch.softmax(logits.float(), dim=-1), d.top_k, dim=-1)  # [N, k]
        if d.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(x.dtype)
        if t == 1:
            gu = torch.matmul(x[:, None, None, :], self.gate_up[index])  # [N, k, 1, 2I]
            g, u = gu[..., :d.moe_intermediate], gu[..., d.moe_intermediate:]
            y = torch.matmul(nn.functional.silu(g) * u, self.down[index])  # [N, k, 1, H]
            return (y.squeeze(2) * weight[..., None]).sum(dim=1)
        routing = x.new_zeros(x.shape[0], d.experts).scatter(1, index, weight)  # [N, E]
        gu = torch.matmul(x[None], self.gate_up)  # [E, N, 2I]
        g, u = gu[..., :d.moe_intermediate], gu[..., d.moe_intermediate:]
        y = torch.matmul(nn.functional.silu(g) * u, self.down)  # [E, N, H]
        return (y * routing.T[..., None]).sum(dim=0)


class SparseMoE(nn.Module):
    """Router (a float linear, never quantised) + routed experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str, *, fused: bool) -> None:
        super().__init__()
        self.d = d
        self.gate = Linear(w, f"{p}.gate")
        self.experts = RoutedExperts(d, w, p, fused=fused)
        if arch.shared_expert:
            self.shared_expert = MLP(w, f"{p}.shared_expert")
            self.shared_expert_gate = Linear(w, f"{p}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        xf = x.reshape(b * t, h)
        out = self.experts(xf, self.gate(xf), t)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert(xf) * torch.sigmoid(self.shared_expert_gate(xf))
        return out.reshape(b, t, h)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str, layer: int = 0, *,
                 fused: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(w, f"{p}.input_layernorm", d.rms_eps)
        self.self_attn = Attention(arch, d, w, f"{p}.self_attn")
        self.post_attention_layernorm = RMSNorm(w, f"{p}.post_attention_layernorm", d.rms_eps)
        self.mlp = SparseMoE(arch, d, w, f"{p}.mlp", fused=fused) if d.is_sparse(layer) else MLP(w, f"{p}.mlp")

    def forward(self, x, cos, sin, mask, past_k, past_v):  # type: ignore[no-untyped-def]
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Embedding(nn.Module):
    def __init__(self, w: Weights, name: str) -> None:
        super().__init__()
        self.weight = w.param(f"{name}.weight")


class LayerStack(nn.Module):
    """Decoder layers under their model-wide numbers: a pipeline stage that starts at layer 5 holds
    `model.layers.5`, so its weights, scopes and cache names read as the checkpoint's."""

    def __init__(self, layers: Iterable[tuple[int, nn.Module]]) -> None:
        super().__init__()
        for i, layer in layers:
            self.add_module(str(i), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)


def stage_layers(d: ModelDims, stage: Stage | None, layers: int | None) -> range:
    """The decoder layers a static model builds: the stage's (all by default), or its first `layers`
    (the template export_onnx replicates)."""
    run = (stage or Stage.whole(d.layers)).layers
    return run if layers is None else run[:layers]


class Body(nn.Module):
    """`model.*` of the Hugging Face layout: of a pipeline stage, only the parts it runs (the embedding
    in the first, the final norm in the last)."""

    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, layers: range, *, fused: bool = False,
                 stage: Stage | None = None) -> None:
        super().__init__()
        stage = stage or Stage.whole(d.layers)
        self.embed_tokens = Embedding(w, "model.embed_tokens") if stage.first and not d.tied else None
        self.layers = LayerStack((i, DecoderLayer(arch, d, w, f"model.layers.{i}", i, fused=fused)) for i in layers)
        self.norm = RMSNorm(w, "model.norm", d.rms_eps) if stage.last else None


class StaticLM(nn.Module):
    """What every static Qwen shares around its decoder layers (`model`, a Body): the embedding (tied
    or not), the final norm and LM head, and the RoPE tables, which stay float32 constants whatever
    the compute dtype (see rope.py)."""

    def __init__(self, d: ModelDims, w: Weights, cos: torch.Tensor, sin: torch.Tensor, body: nn.Module,
                 *, logits_last: bool, stage: Stage | None = None) -> None:
        super().__init__()
        self.d, self.logits_last = d, logits_last
        self.stage = stage or Stage.whole(d.layers)
        self.model = body
        # Tied: one [hidden, vocab] table, Gather along axis 1 for the embedding, MatMul for the head
        # (a first stage that is not also the last holds it for the embedding only).
        if self.stage.last or (self.stage.first and d.tied):
            self.lm_head = Linear(w, "lm_head", source="model.embed_tokens" if d.tied else None)
        self.register_buffer("rope_cos", w.constant("rope_cos", cos), persistent=True)
        self.register_buffer("rope_sin", w.constant("rope_sin", sin), persistent=True)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens.weight[ids]
        return self.lm_head.weight.index_select(1, ids.reshape(-1)).T.reshape(b, t, self.d.hidden)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of the positions: [B, 1, T, rotary dim], gathered in fp32, then in `dtype`."""
        cos = nn.functional.embedding(position_ids, self.rope_cos).to(dtype).unsqueeze(1)
        sin = nn.functional.embedding(position_ids, self.rope_sin).to(dtype).unsqueeze(1)
        return cos, sin

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.logits_last:
            x = x[:, -1:, :]
        return self.lm_head(self.model.norm(x)).float()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The first output: logits, or in a stage before the last the hidden states for the next stage."""
        return self.logits(x) if self.stage.last else x

    def entry(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states the layers start from: embedded ids, or in a stage after the first its input."""
        return self.embed(input_ids) if self.stage.first else input_ids


class StaticQwen(StaticLM):
    """Qwen2/Qwen3 (dense or MoE) with the static forward signature; weights in the compute dtype."""

    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, cos: torch.Tensor, sin: torch.Tensor,
                 *, logits_last: bool, layers: int | None = None, fused_experts: bool = False,
                 stage: Stage | None = None) -> None:
        """`layers` builds only the first ones (of the stage): the template export_onnx replicates.
        `fused_experts`: the checkpoint holds MoE experts 3-D (see arch.expert_tensors). `stage`: a
        pipeline stage's layers and ends (qwen2om/stages.py); default the whole model."""
        body = Body(arch, d, w, stage_layers(d, stage, layers), fused=fused_experts, stage=stage)
        super().__init__(d, w, cos, sin, body, logits_last=logits_last, stage=stage)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        past: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        x = self.entry(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, attention_mask, past[2 * i], past[2 * i + 1])
            new_kv += [k, v]
        return (self.head(x), *new_kv)
