"""qwen2om's GPTQ (qwen2om/quant/gptq.py: blocked, Cholesky of H⁻¹, float32) against GPTQ written out
here independently from the paper's update rule (Frantar et al. 2022, eq. 3 — the OBS step with the
inverse Hessian eliminated one column at a time, float64), on one real layer of the trained model:
the input of layer 0's attention projections over held-out text.

What is pinned is the behaviour llm-compressor 0.14's GPTQModifier shares (read from its source for issue
28): group scales computed up front from the original weight in the original column order and rounded
to the checkpoint's dtype before any weight is rounded, columns visited by decreasing diag(H) (static
act-order), dampening 1 % of the mean diagonal, symmetric int4 in [-8, 7] with scale = absmax / 7.5.
"""

from __future__ import annotations

import pytest
import torch

from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import Checkpoint
from qwen2om.quant.gptq import CLIP_RATIOS, gptq, output_error
from qwen2om.quant.int4 import Int4Spec, dequantize, rtn


def reference_gptq(w: torch.Tensor, h: torch.Tensor, group: int, damp: float = 0.01,
                   scale_dtype: torch.dtype = torch.bfloat16, ratio: float = 1.0) -> torch.Tensor:
    """Symmetric int4 GPTQ with static act-order, every group's range clipped to `ratio` × its absmax:
    returns the int codes [N, K]."""
    w = w.double().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    absmax = w.abs().reshape(n, k // group, group).amax(-1)
    scale = (absmax * ratio / 7.5).to(scale_dtype).double()
    scale[scale == 0] = 1.0
    order = torch.argsort(torch.diag(h), descending=True)
    h = h + damp * torch.diag(h).mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    q = torch.zeros(n, k, dtype=torch.float64)
    left = list(order.tolist())
    while left:
        j = left.pop(0)
        s = scale[:, j // group]
        q[:, j] = torch.clamp(torch.round(w[:, j] / s), -8, 7)
        err = (w[:, j] - q[:, j] * s) / hinv[j, j]
        rest = torch.tensor(left, dtype=torch.long)
        if len(left):
            w[:, rest] -= torch.outer(err, hinv[j, rest])
            # OBS: remove column j from the inverse Hessian of the columns still to quantise
            hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q


def layer0_inputs(tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's weight [N, K] and its inputs [T, K]: held-out text's embeddings after input_layernorm."""
    from tokenizers import Tokenizer

    from qwen2om.fixtures.trained import heldout_text

    root = resolve_model("builtin:tiny-qwen3-trained")
    ckpt = Checkpoint(root)
    ids = Tokenizer.from_file(str(root / "tokenizer.json")).encode(heldout_text()).ids[:tokens]
    x = ckpt.get("model.embed_tokens.weight", torch.float32)[torch.tensor(ids)]
    norm = ckpt.get("model.layers.0.input_layernorm.weight", torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ckpt.dims.rms_eps) * norm
    return ckpt.get("model.layers.0.self_attn.q_proj.weight", torch.float32), x


def test_gptq_equals_an_independent_reference_on_a_real_layer() -> None:
    w, x = layer0_inputs()
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    got = gptq(w, h, spec, scale_dtype=torch.bfloat16)
    want = reference_gptq(w, h, spec.group)
    same = (got.q.double() == want).double().mean().item()
    # float32 blocked Cholesky vs float64 explicit inverse: a value that lands within rounding of a
    # half-step can round the other way, and the difference then propagates; nearly all codes agree
    assert same > 0.99, same
    w_ref = dequantize(want.to(torch.int8), got.scale, None, spec.group)
    err, err_ref = output_error(w, dequantize(got.q, got.scale, None, spec.group), h), output_error(w, w_ref, h)
    q0, s0, z0 = rtn(w, spec)
    err_rtn = output_error(w, dequantize(q0, s0.to(torch.bfloat16).float(), z0, spec.group), h)
    assert abs(err - err_ref) <= 0.02 * err_ref and err < 0.8 * err_rtn, (err, err_ref, err_rtn)
    # the scales are the static, up-front ones: absmax/7.5 of the original weight, rounded to bf16
    absmax = w.abs().reshape(w.shape[0], -1, spec.group).amax(-1)
    assert torch.equal(got.scale, (absmax / 7.5).to(torch.bfloat16).float())


def row_errors(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    dw = (w - w_hat).double()
    return ((dw @ h.double()) * dw).sum(-1)


def test_clip_search_keeps_each_rows_best_ratio() -> None:
    """qwen2om's clip search (not in llm-compressor): every output row is GPTQ run with its groups'
    ranges clipped by one of the candidate ratios, the ratio with the least output error for that row.
    Checked against the float64 reference run once per ratio."""
    w, x = layer0_inputs()
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    got = gptq(w, h, spec, scale_dtype=torch.bfloat16, clip_ratios=CLIP_RATIOS)
    absmax = w.abs().reshape(w.shape[0], -1, spec.group).amax(-1)
    scales = torch.stack([(absmax * r / 7.5).to(torch.bfloat16).float() for r in CLIP_RATIOS])  # [R, N, G]
    refs = torch.stack([reference_gptq(w, h, spec.group, ratio=r) for r in CLIP_RATIOS])  # [R, N, K]
    errors = torch.stack([row_errors(w, dequantize(refs[i].to(torch.int8), scales[i], None, spec.group), h)
                          for i in range(len(CLIP_RATIOS))])  # [R, N]
    picked = (got.scale[None] == scales).all(-1)  # [R, N]: which candidates' scales each row carries
    assert picked.any(0).all(), "a row's scales are none of the candidates'"
    ratio = picked.int().argmax(0)  # the first (largest) matching ratio; ties keep the larger one
    rows = torch.arange(w.shape[0])
    # the codes are the reference's at the ratio the row picked (float32 vs float64: nearly all)
    assert (got.q.double() == refs[ratio, rows]).double().mean() > 0.99
    # and that ratio is the row's best, never worse than ratio 1's: up to 2 %, since the row chose on its
    # float32 codes and is judged here on the float64 reference's (~1 % of codes differ; equal on this
    # machine's CPU, but a near-tie may fall the other way on another)
    chosen, best = errors[ratio, rows], errors.min(0).values
    assert (chosen <= best * 1.02).all() and (chosen <= errors[0] * 1.02).all()
    assert len(set(ratio.tolist())) > 1, "every row kept one ratio: the search decided nothing here"
    plain = output_error(w, dequantize(refs[0].to(torch.int8), scales[0], None, spec.group), h)
    searched = output_error(w, dequantize(got.q, got.scale, None, spec.group), h)
    assert searched < 0.95 * plain, (searched, plain)


def test_one_ratio_is_plain_gptq() -> None:
    w, x = layer0_inputs(1024)
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    a = gptq(w, h, spec, scale_dtype=torch.bfloat16)
    b = gptq(w, h, spec, scale_dtype=torch.bfloat16, clip_ratios=(1.0,))
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match="clip ratios must be in"):
        gptq(w, h, spec, clip_ratios=(1.2,))


def test_ratios_searched_a_few_at_a_time_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide weight (an LM head) stacks fewer candidates per pass; the rows' choices do not change."""
    import qwen2om.quant.gptq as gptq_module

    w, x = layer0_inputs(1024)
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    together = gptq(w, h, spec, scale_dtype=torch.bfloat16, clip_ratios=CLIP_RATIOS)
    monkeypatch.setattr(gptq_module, "STACK_ELEMENTS", w.numel())  # one ratio per pass
    apart = gptq(w, h, spec, scale_dtype=torch.bfloat16, clip_ratios=CLIP_RATIOS)
    # equal here; not asserted bit for bit, since a BLAS may block a product of another width differently
    # and flip a rounding tie on another CPU
    assert (together.q == apart.q).double().mean() > 0.999
    assert (together.scale == apart.scale).all(-1).double().mean() > 0.99
