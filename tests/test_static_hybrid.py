"""The hybrids' static forward in torch: the chunked delta rule, and parity with transformers."""

from __future__ import annotations

import pytest
import torch

from qwen2om.arch import ModelDims, resolve_arch
from qwen2om.fixtures.tiny import TINY, build_tiny_model
from qwen2om.static_hybrid import (
    StaticHybrid,
    delta_rule_chunked,
    delta_rule_step,
    hybrid_rope_tables,
    state_shapes,
    unit_lower_inverse,
)
from qwen2om.verify import judge_step
from qwen2om.weights import Weights

HYBRIDS = ["tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-next"]
LO = torch.finfo(torch.float32).min


def test_unit_lower_inverse() -> None:
    g = torch.Generator().manual_seed(0)
    for c in (1, 2, 8, 64):
        # Entries as the delta rule makes them: β k_i·k_j e^(γi-γj), |·| ≤ 1.
        n = (torch.rand(3, c, c, generator=g, dtype=torch.float64) * 2 - 1).tril(-1)
        eye = torch.eye(c, dtype=torch.float64)
        want = torch.linalg.solve_triangular(eye + n, eye.expand(3, c, c), upper=False, unitriangular=True)
        assert torch.allclose(unit_lower_inverse(n), want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))


@pytest.mark.parametrize("t", [1, 6, 16, 48, 128])
def test_chunked_delta_rule_is_the_recurrence(t: int) -> None:
    """The matrix form over T tokens (sub-chunks of up to 64) = T recurrent steps, from a non-zero state."""
    g = torch.Generator().manual_seed(t)
    b, h, dk, dv = 2, 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=g), dim=-1)
    v = torch.randn(b, h, t, dv, generator=g)
    decay = -torch.rand(b, h, t, generator=g) * 2
    beta = torch.rand(b, h, t, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g)
    state, outs = s0, []
    for i in range(t):
        o, state = delta_rule_step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], decay[:, :, i:i + 1],
                                   beta[:, :, i:i + 1], state)
        outs.append(o)
    out, final = delta_rule_chunked(q, k, v, decay, beta, s0) if t > 1 else (torch.cat(outs, 2), state)
    assert (out - torch.cat(outs, 2)).abs().max() < 1e-5 and (final - state).abs().max() < 1e-5


def static_from_hf(model: torch.nn.Module, capacity: int, *, logits_last: bool = False) -> StaticHybrid:
    cfg = model.config.to_dict()
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    weights = Weights(sd.__getitem__, {k: tuple(v.shape) for k, v in sd.items()}, torch.float32, lazy=False)
    arch, dims = resolve_arch(cfg), ModelDims.from_config(cfg)
    cos, sin = hybrid_rope_tables(cfg, dims, capacity)
    fused = any(k.endswith(".experts.gate_up_proj") for k in sd)
    return StaticHybrid(arch, dims, weights, cos, sin, logits_last=logits_last, fused_experts=fused).eval()


class Runner:
    """What the runtime does, in torch: chunked prefill (first chunk left-padded), then decode steps."""

    def __init__(self, model: StaticHybrid, capacity: int, chunk: int) -> None:
        d = self.d = model.d
        self.model, self.p, self.chunk, self.length = model, capacity, chunk, 0
        conv, rec = state_shapes(d, 1)
        self.past = [t for i in range(d.layers) for t in (
            (torch.zeros(conv), torch.zeros(rec)) if d.is_linear(i) else
            (torch.zeros(1, d.kv_heads, capacity, d.head_dim), torch.zeros(1, d.kv_heads, capacity, d.head_dim)))]

    def call(self, ids: list[int], t: int) -> torch.Tensor:
        pad, p, n = t - len(ids), self.p, len(ids)
        x = torch.tensor([[0] * pad + ids])
        mask = torch.full((1, 1, t, p + t), LO)
        mask[0, 0, pad:, :self.length] = 0
        mask[0, 0, pad:, p + pad:] = torch.triu(torch.full((n, n), LO), 1)
        for i in range(pad):
            mask[0, 0, i, p + i] = 0
        pos = torch.tensor([[0] * pad + list(range(self.length, self.length + n))])
        with torch.no_grad():
            out = self.model(x, mask, pos, tuple(self.past))
        for i in range(self.d.layers):
            a, b = out[1 + 2 * i], out[2 + 2 * i]
            if self.d.is_linear(i):
                self.past[2 * i], self.past[2 * i + 1] = a, b
            else:
                self.past[2 * i][:, :, self.length:self.length + n] = a[:, :, pad:]
                self.past[2 * i + 1][:, :, self.length:self.length + n] = b[:, :, pad:]
        self.length += n
        return out[0][0, -1]

    def prefill(self, ids: list[int]) -> torch.Tensor:
        first = len(ids) % self.chunk or self.chunk
        logits = self.call(ids[:first], self.chunk)
        for s in range(first, len(ids), self.chunk):
            logits = self.call(ids[s:s + self.chunk], self.chunk)
        return logits


@pytest.mark.numerics
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_matches_transformers(name: str) -> None:
    """A 45-token prompt in 16-token chunks (three calls, the first left-padded: states carry across
    chunks), then 16 greedy steps: every token equal, fp32 max |Δlogits| ≤ 1e-4."""
    hf = build_tiny_model(TINY[name])
    runner = Runner(static_from_hf(hf, 96), 96, 16)
    prompt = torch.randint(0, runner.d.vocab, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    tokens, ref_logits = ref.sequences[0, 45:].tolist(), torch.stack(ref.logits, 1)[0]
    logits, judged, worst = runner.prefill(prompt[0].tolist()), [], 0.0
    for step in range(16):
        worst = max(worst, float((logits - ref_logits[step]).abs().max()))
        # verify's rule: an argmax that differs only between tokens tied to 1e-4 in the reference is a tie
        judged.append(judge_step(logits.numpy(), ref_logits[step].numpy(), tokens[step], 1e-4))
        logits = runner.call([tokens[step]], 1)
    assert None not in judged, judged
    assert worst <= 1e-4, worst
