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

import torch

from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import Checkpoint
from qwen2om.quant.gptq import gptq, output_error
from qwen2om.quant.int4 import Int4Spec, dequantize, rtn


def reference_gptq(w: torch.Tensor, h: torch.Tensor, group: int, damp: float = 0.01,
                   scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Symmetric int4 GPTQ with static act-order: returns the int codes [N, K]."""
    w = w.double().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    absmax = w.abs().reshape(n, k // group, group).amax(-1)
    scale = (absmax / 7.5).to(scale_dtype).double()
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
