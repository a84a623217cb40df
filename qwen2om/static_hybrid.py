"""The static-shape forward of the Qwen3.5 / Qwen3-Next hybrids (dense and MoE).

Three of every four layers are Gated DeltaNet linear attention; the others are gated full
attention. Same signature as qwen2om/static_model.py, plus per linear-attention layer:

- `conv_state` [B, K-1, conv_dim] (compute dtype): the last K-1 inputs of the causal depthwise
  conv, time-major like the activations, so the graph concatenates it without a transpose;
- `recurrent_state` [B, Hv, dk, dv] (float32 in every graph: the delta rule runs in float32, as
  transformers does); both come back updated as outputs, the runtime copies them in place.

The delta rule, S ← S·e^g + k ⊗ β(v − kᵀS), o = qᵀS (q, k L2-normalised, q scaled by dk^-½):
decode (T = 1) takes this one step. A prefill chunk uses the chunked matrix form (the "UT
transform" of DeltaNet / FLA) instead of transformers' export fallback, which unrolls a
per-row forward substitution into ~1.2k nodes with ~135 Scatters: within a sub-chunk of c
tokens the updates are one unit lower-triangular system L = I + strictly_lower(β_i k_i·k_j
e^{γ_i-γ_j}); its inverse is built by block doubling (log2 c levels of two batched MatMuls,
no loop over rows), then the state passes from sub-chunk to sub-chunk with three MatMuls each.

Pad rows (the first prefill chunk is left-padded, see docs/design.md) must not touch the
states: they get β = 0 and g = 0 (no write, no decay), and the conv reads each real token's
true predecessors from `conv_state` rather than the pads in front of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qwen2om.arch import ArchSpec, ModelDims, text_config
from qwen2om.errors import CheckpointError
from qwen2om.stages import Stage
from qwen2om.static_model import (
    MLP,
    CacheAttention,
    Embedding,
    LayerStack,
    Linear,
    RMSNorm,
    Rotary,
    SparseMoE,
    StaticLM,
    stage_layers,
)
from qwen2om.weights import Weights

MAX_SUBCHUNK = 64  # tokens per block of the chunked delta rule (FLA and transformers use 64)


def hybrid_rope_tables(cfg: dict[str, Any], d: ModelDims, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, rotary_dim], float32. Qwen3.5's interleaved multimodal RoPE gives every
    section the same position for text, so it is plain RoPE on the first rotary_dim channels."""
    rope = text_config(cfg).get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"config.json: rope_type {rope['rope_type']!r} is not supported for hybrids yet")
    dim = d.rotary_dim
    inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq.to(torch.float64))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


class ZeroCentredRMSNorm(RMSNorm):
    """x̂ · (1 + w), all in float32, then the compute dtype (Qwen3.5 / Qwen3-Next)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """w · x̂ · silu(z): the linear layer's output norm, per value head (weights near 1, not zero-centred)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = super().forward(x).float()
        return (h * nn.functional.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate and partial RoPE; cache handling as static_model.Attention."""

    def __init__(self, d: ModelDims, w: Weights, p: str) -> None:
        super().__init__()
        self.d = d
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, proj, Linear(w, f"{p}.{proj}"))
        self.q_norm = ZeroCentredRMSNorm(w, f"{p}.q_norm", d.rms_eps)
        self.k_norm = ZeroCentredRMSNorm(w, f"{p}.k_norm", d.rms_eps)
        self.rotary = Rotary(d.rotary_dim or d.head_dim)
        self.cache_attention = CacheAttention(d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
        past_k: torch.Tensor, past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.d
        b, t, _ = x.shape
        # q_proj's rows are per head: the head's query (D), then its gate (D).
        qg = self.q_proj(x).view(b, t, d.heads, 2 * d.head_dim)
        q, gate = qg[..., :d.head_dim], qg[..., d.head_dim:].reshape(b, t, d.heads * d.head_dim)
        q, k = self.rotary(self.q_norm(q), self.k_norm(self.k_proj(x).view(b, t, d.kv_heads, d.head_dim)), cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        out = self.cache_attention(q, k, v, mask, past_k, past_v)
        return self.o_proj(out * torch.sigmoid(gate)), k, v


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def unit_lower_inverse(n: torch.Tensor) -> torch.Tensor:
    """(I + N)⁻¹ for N strictly lower triangular [..., c, c], c a power of two, by block doubling:
    [[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]], from 1×1 blocks up, all blocks of a level at once."""
    c = n.shape[-1]
    lead = n.shape[:-2]
    inv = torch.ones((*lead, c, 1, 1), dtype=n.dtype, device=n.device)
    s = 1
    while s < c:
        m = c // (2 * s)
        # The diagonal 2s-blocks of N, [..., m, 2s, 2s]; their lower-left s-block is C.
        eye = torch.eye(m, dtype=n.dtype, device=n.device).view(m, 1, m, 1)
        diag = (n.reshape(*lead, m, 2 * s, m, 2 * s) * eye).sum(-2)
        lower = diag[..., s:, :s]
        pairs = inv.reshape(*lead, m, 2, s, s)
        a_inv, d_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        x = -torch.matmul(torch.matmul(d_inv, lower), a_inv)
        top = torch.cat((a_inv, torch.zeros_like(a_inv)), dim=-1)
        inv = torch.cat((top, torch.cat((x, d_inv), dim=-1)), dim=-2)
        s *= 2
    return inv.reshape(*lead, c, c)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k [B, H, 1, dk], v [B, H, 1, dv], g, beta [B, H, 1], state [B, H, dk, dv]."""
    state = state * torch.exp(g)[..., None]
    delta = (v - torch.matmul(k, state)) * beta[..., None]
    state = state + torch.matmul(k.transpose(-1, -2), delta)
    return torch.matmul(q, state), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens in matrix form: q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T], state [B, H, dk, dv]."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    c = min(MAX_SUBCHUNK, t & -t)  # the largest power of two dividing T, at most 64
    n = t // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    gamma = g.cumsum(-1)  # log of the decay from the sub-chunk start to each row
    causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")))
    kb = k * beta[..., None]
    strict = torch.ones(c, c, device=k.device).tril(-1)
    inv = unit_lower_inverse(torch.matmul(kb, k.transpose(-1, -2)) * decay * strict)
    u = torch.matmul(inv, v * beta[..., None])  # what each row writes, before the state's prediction
    w = torch.matmul(inv, kb * torch.exp(gamma)[..., None])  # how each row reads the incoming state
    attn = torch.matmul(q, k.transpose(-1, -2)) * decay
    q_in = q * torch.exp(gamma)[..., None]
    k_out = k * torch.exp(gamma[..., -1:] - gamma)[..., None]
    last = torch.exp(gamma[..., -1])[..., None, None]
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - torch.matmul(w[:, :, i], state)
        outs.append(torch.matmul(q_in[:, :, i], state) + torch.matmul(attn[:, :, i], v_new))
        state = state * last[:, :, i] + torch.matmul(k_out[:, :, i].transpose(-1, -2), v_new)
    return torch.stack(outs, dim=2).reshape(b, h, t, dv), state


class CausalConv(nn.Module):
    """Depthwise causal conv over [conv_state; x] as K shifted multiply-adds (weights [C, 1, K] as stored)."""

    def __init__(self, w: Weights, name: str) -> None:
        super().__init__()
        self.weight = w.param(f"{name}.weight")

    def forward(self, seq: torch.Tensor, t: int) -> torch.Tensor:
        """seq [B, K-1+T, C] → silu(conv) [B, T, C]."""
        kernel = self.weight.shape[-1]
        wk = self.weight.reshape(self.weight.shape[0], kernel)
        out = seq[:, 0:t] * wk[:, 0]
        for j in range(1, kernel):
            out = out + seq[:, j:j + t] * wk[:, j]
        return nn.functional.silu(out)


class GatedDeltaNet(nn.Module):
    """Qwen3.5 / Qwen3-Next linear attention with explicit conv and recurrent states."""

    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str) -> None:
        super().__init__()
        self.d, self.packed = d, arch.packed_linear_proj
        split = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        for proj in ("in_proj_qkvz", "in_proj_ba") if self.packed else split:
            setattr(self, proj, Linear(w, f"{p}.{proj}"))
        self.conv1d = CausalConv(w, f"{p}.conv1d")
        self.A_log = w.param(f"{p}.A_log")
        self.dt_bias = w.param(f"{p}.dt_bias")
        self.norm = GatedRMSNorm(w, f"{p}.norm", d.rms_eps)
        self.out_proj = Linear(w, f"{p}.out_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x → the conv input [B, T, conv_dim] (q, k, v), z [B, T, Hv, dv], b and a [B, T, Hv]."""
        d = self.d
        bsz, t, _ = x.shape
        if not self.packed:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(bsz, t, d.lin_v_heads, d.lin_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        # Qwen3-Next packs per key head: [q (dk), k (dk), v (r·dv), z (r·dv)] and [b (r), a (r)].
        r, dk = d.lin_v_heads // d.lin_k_heads, d.lin_k_dim
        qkvz = self.in_proj_qkvz(x).view(bsz, t, d.lin_k_heads, 2 * dk + 2 * r * d.lin_v_dim)
        q, k = qkvz[..., :dk].reshape(bsz, t, -1), qkvz[..., dk:2 * dk].reshape(bsz, t, -1)
        v = qkvz[..., 2 * dk:2 * dk + r * d.lin_v_dim].reshape(bsz, t, -1)
        z = qkvz[..., 2 * dk + r * d.lin_v_dim:].reshape(bsz, t, d.lin_v_heads, d.lin_v_dim)
        ba = self.in_proj_ba(x).view(bsz, t, d.lin_k_heads, 2 * r)
        return (torch.cat((q, k, v), dim=-1), z, ba[..., :r].reshape(bsz, t, -1), ba[..., r:].reshape(bsz, t, -1))

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None, conv_state: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`valid` [B, T] (prefill; None for decode): false on the left-pad rows."""
        d = self.d
        bsz, t, _ = x.shape
        mixed, z, b, a = self.project(x)
        seq = torch.cat((conv_state.to(mixed.dtype), mixed), dim=1)  # [B, K-1+T, C]
        if valid is not None:
            # Real rows must see conv_state right before the first real token, not the pads: move
            # conv_state to just in front of it (rows left of it are only read by pads).
            km1 = conv_state.shape[1]
            pads = t - valid.to(torch.int64).sum(-1, keepdim=True)  # [B, 1]
            i = torch.arange(km1 + t, device=x.device)[None]
            src = torch.where(i < km1 + pads, torch.clamp(i - pads, min=0), i)
            seq = torch.gather(seq, 1, src[..., None].expand(bsz, km1 + t, seq.shape[-1]))
        new_conv = seq[:, t:]
        mixed = self.conv1d(seq, t)
        kd, r = d.lin_k_heads * d.lin_k_dim, d.lin_v_heads // d.lin_k_heads
        q = mixed[..., :kd].reshape(bsz, t, d.lin_k_heads, d.lin_k_dim).float()
        k = mixed[..., kd:2 * kd].reshape(bsz, t, d.lin_k_heads, d.lin_k_dim).float()
        v = mixed[..., 2 * kd:].reshape(bsz, t, d.lin_v_heads, d.lin_v_dim).float()
        # Each key head serves r consecutive value heads.
        q, k = (y[:, :, :, None].expand(bsz, t, d.lin_k_heads, r, d.lin_k_dim).reshape(bsz, t, d.lin_v_heads, -1)
                for y in (q, k))
        q = l2norm(q) * (d.lin_k_dim ** -0.5)
        k = l2norm(k)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * nn.functional.softplus(a.float() + self.dt_bias.float())
        if valid is not None:
            beta, g = beta * valid[..., None], g * valid[..., None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, Hv, T, d]
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        rule = delta_rule_step if t == 1 else delta_rule_chunked
        out, new_state = rule(q, k, v, g, beta, state.float())
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)
        return self.out_proj(out.reshape(bsz, t, d.lin_v_heads * d.lin_v_dim)), new_conv, new_state


class HybridLayer(nn.Module):
    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str, layer: int, *, fused: bool) -> None:
        super().__init__()
        self.linear = d.is_linear(layer)
        self.input_layernorm = ZeroCentredRMSNorm(w, f"{p}.input_layernorm", d.rms_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(arch, d, w, f"{p}.linear_attn")
        else:
            self.self_attn = GatedAttention(d, w, f"{p}.self_attn")
        self.post_attention_layernorm = ZeroCentredRMSNorm(w, f"{p}.post_attention_layernorm", d.rms_eps)
        self.mlp = SparseMoE(arch, d, w, f"{p}.mlp", fused=fused) if d.is_sparse(layer) else MLP(w, f"{p}.mlp")

    def forward(self, x, cos, sin, mask, valid, s0, s1):  # type: ignore[no-untyped-def]
        h = self.input_layernorm(x)
        a, o0, o1 = self.linear_attn(h, valid, s0, s1) if self.linear else self.self_attn(h, cos, sin, mask, s0, s1)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), o0, o1


class HybridBody(nn.Module):
    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, layers: range, *, fused: bool,
                 stage: Stage | None = None) -> None:
        super().__init__()
        stage = stage or Stage.whole(d.layers)
        self.embed_tokens = Embedding(w, "model.embed_tokens") if stage.first and not d.tied else None
        self.layers = LayerStack((i, HybridLayer(arch, d, w, f"model.layers.{i}", i, fused=fused)) for i in layers)
        self.norm = ZeroCentredRMSNorm(w, "model.norm", d.rms_eps) if stage.last else None


class StaticHybrid(StaticLM):
    """Qwen3.5 / Qwen3-Next with the static signature; `past` per layer is (past_key, past_value)
    for full attention and (conv_state, recurrent_state) for linear attention, in layer order, and
    the outputs after the logits follow the same order with the new values."""

    def __init__(self, arch: ArchSpec, d: ModelDims, w: Weights, cos: torch.Tensor, sin: torch.Tensor,
                 *, logits_last: bool, layers: int | None = None, fused_experts: bool = False,
                 stage: Stage | None = None) -> None:
        body = HybridBody(arch, d, w, stage_layers(d, stage, layers), fused=fused_experts, stage=stage)
        super().__init__(d, w, cos, sin, body, logits_last=logits_last, stage=stage)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        past: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        x = self.entry(input_ids)
        t = x.shape[1]
        cos, sin = self.rope(position_ids, x.dtype)  # [B, 1, T, rotary dim]
        # The last row is always a real token; the rows it cannot see among the new ones are pads.
        p_len = attention_mask.shape[-1] - t
        valid = (attention_mask[:, 0, -1, p_len:].float() > -1.0).to(torch.float32) if t > 1 else None
        new: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            x, o0, o1 = layer(x, cos, sin, attention_mask, valid, past[2 * i], past[2 * i + 1])
            new += [o0, o1]
        return (self.head(x), *new)


def state_shapes(d: ModelDims, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """conv_state and recurrent_state shapes of one linear-attention layer."""
    return (batch, d.conv_kernel - 1, d.conv_dim), (batch, d.lin_v_heads, d.lin_k_dim, d.lin_v_dim)



