"""AWQ (Lin et al. 2023): protect the input channels that carry large activations.

For linears sharing one input x (q/k/v after input_layernorm, gate/up after
post_attention_layernorm, down after up_proj, o after v_proj when the shapes allow), scale the
input channels by s: `x Wᵀ = (x / s)(W·s)ᵀ`. The 1/s folds into the operation that produced x
(a norm's weight, or the producing linear's output rows), so the model computes the same thing,
but W·s is what gets rounded: channels with large |x| get more of the int4 grid. s = mean|x|^α,
α searched on a grid; then each group's clipping range is searched (shrinking amax can lower the
error of the other values).

Both searches score a candidate by the output error it causes on the calibration inputs,
tr(ΔW H ΔWᵀ) with H = mean 2xxᵀ, the same Hessian GPTQ accumulates — so no extra forward pass.
"""

from __future__ import annotations

import torch

from qwen2om.quant.int4 import QMAX, QMIN, Int4Spec, dequantize, qparams, quantize

ALPHAS = torch.linspace(0, 1, 21)
CLIP_RATIOS = torch.linspace(1.0, 0.5, 11)


def output_loss(dw: torch.Tensor, h: torch.Tensor) -> float:
    return float(((dw @ h) * dw).sum())


def fake_quant(w: torch.Tensor, spec: Int4Spec) -> torch.Tensor:
    scale, zp = qparams(w, spec)
    return dequantize(quantize(w, scale, zp, spec.group), scale, zp if not spec.symmetric else None, spec.group)


def search_scale(weights: list[torch.Tensor], hessians: list[torch.Tensor], x_mean: torch.Tensor,
                 spec: Int4Spec) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale s minimising Σ tr(ΔW H ΔWᵀ) over the linears, ΔW = W − Q(W·s)/s.
    Returns (s, loss at s = 1, loss at the best s)."""
    x_mean = x_mean.float().clamp(min=1e-5)
    best_s, best, base = torch.ones_like(x_mean), float("inf"), 0.0
    for alpha in ALPHAS:
        s = x_mean.pow(float(alpha))
        s = s / (s.max() * s.min()).sqrt()
        loss = sum(output_loss(w - fake_quant(w * s, spec) / s, h) for w, h in zip(weights, hessians, strict=True))
        if float(alpha) == 0.0:
            base = loss
        if loss < best:
            best, best_s = loss, s
    return best_s, base, best


def clip_quantize(w: torch.Tensor, h: torch.Tensor, spec: Int4Spec,
                  scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTN with each (row, group)'s range shrunk by the ratio that minimises its output error
    Δw H_gg Δwᵀ. Returns (q, scale, zp) as `int4.rtn` does."""
    n, k = w.shape
    g = spec.group
    groups = spec.groups(k)
    wg = w.float().reshape(n, groups, g)
    lo_full, hi_full = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    best_err = torch.full((n, groups), float("inf"), device=w.device)
    best_scale, best_zp = torch.ones(n, groups, device=w.device), torch.zeros(n, groups, device=w.device)
    for r in CLIP_RATIOS:
        lo, hi = lo_full * r, hi_full * r
        if spec.symmetric:
            scale = torch.maximum(-lo, hi) / ((QMAX - QMIN) / 2)
            zp = torch.zeros_like(scale)
        else:
            scale = (hi - lo) / (QMAX - QMIN)
            zp = torch.clamp(QMIN - torch.round(lo / scale.clamp(min=1e-12)), QMIN, QMAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
        q = torch.clamp(torch.round(wg / scale[..., None]) + zp[..., None], QMIN, QMAX)
        dw = wg - (q - zp[..., None]) * scale[..., None]
        err = torch.stack([torch.einsum("ng,gh,nh->n", dw[:, j], h[j * g:(j + 1) * g, j * g:(j + 1) * g], dw[:, j])
                           for j in range(groups)], dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zp = torch.where(better, zp, best_zp)
    return quantize(w, best_scale, best_zp, g), best_scale, best_zp
