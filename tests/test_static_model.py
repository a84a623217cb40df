"""The static-shape forward itself, in torch, against transformers' own Qwen classes."""

from __future__ import annotations

import pytest
import torch

from qwen2om.arch import ARCHS, ModelDims
from qwen2om.fixtures.tiny import TINY, build_tiny_model
from qwen2om.rope import rope_tables
from qwen2om.static_model import StaticQwen
from qwen2om.weights import WeightRef, Weights


def static_from_hf(model: torch.nn.Module, capacity: int, *, lazy: bool = False) -> tuple[StaticQwen, Weights]:
    cfg = model.config.to_dict()
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    weights = Weights(sd.__getitem__, {k: tuple(v.shape) for k, v in sd.items()}, torch.float32, lazy=lazy)
    cos, sin = rope_tables(cfg, capacity)
    arch, dims = ARCHS.get(cfg["model_type"]), ModelDims.from_config(cfg)
    fused = any(k.endswith(".experts.gate_up_proj") for k in sd)  # MoE as transformers holds it in memory
    return StaticQwen(arch, dims, weights, cos, sin, logits_last=False, fused_experts=fused).eval(), weights


@pytest.mark.numerics
@pytest.mark.parametrize("name", [n for n, s in TINY.items() if "linear_num_value_heads" not in s.config])
def test_prefill_and_decode_match_transformers(name: str) -> None:
    hf = build_tiny_model(TINY[name])
    p, t = 48, 10
    static, _ = static_from_hf(hf, p)
    d = static.d
    ids = torch.randint(0, d.vocab, (1, t + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        # Prefill T tokens into an empty cache, then decode one more token from the returned K/V.
        lo = torch.finfo(torch.float32).min
        mask = torch.full((1, 1, t, p + t), lo)
        mask[0, 0, :, p:] = torch.triu(torch.full((t, t), lo), 1)
        past = [torch.zeros(1, d.kv_heads, p, d.head_dim) for _ in range(2 * d.layers)]
        out = static(ids[:, :t], mask, torch.arange(t)[None], tuple(past))
        assert (out[0] - ref[:, :t]).abs().max() < 1e-5
        for i, kv in enumerate(out[1:]):
            past[i][:, :, :t] = kv
        mask1 = torch.full((1, 1, 1, p + 1), lo)
        mask1[0, 0, 0, : t] = 0
        mask1[0, 0, 0, p] = 0
        step = static(ids[:, t:], mask1, torch.tensor([[t]]), tuple(past))
        assert (step[0][0, 0] - ref[0, t]).abs().max() < 1e-5


def test_lazy_model_holds_no_weights() -> None:
    hf = build_tiny_model(TINY["tiny-qwen3"])
    static, weights = static_from_hf(hf, 32, lazy=True)
    assert all(p.device.type == "meta" for p in static.parameters())
    bindings = weights.bindings(static)
    # Tied: the LM head is the transposed embedding, and nothing else claims the embedding.
    assert bindings["lm_head.weight"].source == "model.embed_tokens.weight" and bindings["lm_head.weight"].transpose
    q = weights.value(bindings, "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].T)


@pytest.mark.parametrize("transpose", [False, True])
def test_weight_pieces_reassemble_the_whole(transpose: bool) -> None:
    """Large weights are converted in slices of source rows; placed by (axis, start) they are exactly
    the converted tensor, and each slice reads only its own rows of the source."""
    src = torch.randn(37, 11).to(torch.bfloat16)
    reads: list[tuple[int, int] | None] = []

    def read(name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        reads.append(rows)
        return src if rows is None else src[rows[0]:rows[1]]

    w = Weights(read, {"t": (37, 11)}, torch.float32, lazy=True, sliced=True)
    ref = WeightRef("t", transpose)
    whole = w.materialize(ref)
    reads.clear()
    out = torch.full_like(whole, float("nan"))
    pieces = list(w.pieces(ref, block_bytes=3 * 11 * 4))
    assert len(pieces) > 1 and all(p.dtype == torch.float32 and p.is_contiguous() for _, _, p in pieces)
    for axis, start, piece in pieces:
        assert axis == (1 if transpose else 0)
        if axis == 0:
            out[start:start + piece.shape[0]] = piece
        else:
            out[:, start:start + piece.shape[1]] = piece
    assert torch.equal(out, whole)
    assert None not in reads and sum(r1 - r0 for r0, r1 in reads) == 37  # every source row read once
