"""GPTQ (Frantar et al. 2022): quantise a weight column by column, pushing each column's
rounding error onto the columns not yet quantised, weighted by the inverse input Hessian.

Act-order is *static* (as llm-compressor's `actorder="static"`): columns are visited in order of
decreasing Hessian diagonal, but every group's scale and zero point are computed up front from
the original weight in the original column order, so the stored weight needs no permutation
(no `g_idx`) at run time.

Clip search (qwen2om's addition, opt-in; llm-compressor's GPTQ takes the min-max scale as it is): GPTQ runs
once per clipping ratio r in `clip_ratios`, every group's range shrunk to r × its min-max range, all
ratios in one pass as stacked copies of the rows (the Cholesky factor is shared). GPTQ's rows are
independent of each other — a column's rounding error is pushed only along its own row — so each
output row can keep the ratio whose result has the least output error on the calibration inputs,
(w − ŵ) H (w − ŵ)ᵀ. Ratio 1 is always a candidate, so the search never does worse than plain
min-max on the calibration data. Measured on the trained builtins (docs/benchmarks.md, issue 28): ~23 %
less output error per linear with 1, 0.95, 0.9, 0.85, but no end-to-end gain beyond the noise, at ~3x
GPTQ's time; so `calibrate` leaves it off unless asked (`--clip-search`).
"""

from __future__ import annotations

import dataclasses

import torch

from qwen2om.quant.int4 import QMAX, QMIN, Int4Spec, dequantize, qparams, rtn


class SingularHessian(Exception):
    """Cholesky failed even after dampening: the caller falls back to RTN and says why."""


@dataclasses.dataclass
class GPTQResult:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # [N, K/g]
    zp: torch.Tensor  # [N, K/g]
    method: str  # "gptq", or "rtn" when it fell back
    note: str = ""


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """Relative error of the layer's output on the calibration inputs: tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)."""
    return output_errors(w, h, [w_hat])[0]


def output_errors(w: torch.Tensor, h: torch.Tensor, w_hats: list[torch.Tensor]) -> list[float]:
    """`output_error` of several approximations of one weight (the denominator computed once)."""
    # Report figures: float32 products (half the time of float64 here), summed in float64.
    w, h = w.float(), h.float()

    def quad(a: torch.Tensor) -> float:
        return float(((a @ h) * a).sum(dtype=torch.float64))
    den = quad(w)
    return [quad(w - w_hat.float()) / den if den > 0 else 0.0 for w_hat in w_hats]


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85)
# Candidates stacked into one pass at most this many weight elements at a time (float32: 256 MiB), so
# a wide LM head searches its ratios a few at a time instead of holding every copy at once.
STACK_ELEMENTS = 1 << 26

GRAM_BLOCK = 1024


def gram(x: torch.Tensor) -> torch.Tensor:
    """xᵀx of x [T, K]: for wide inputs (down_proj's), only the blocks on and above the diagonal are
    multiplied and the rest mirrored, a third less work at K = 3 blocks."""
    k = x.shape[1]
    if k <= GRAM_BLOCK:
        return x.T @ x
    out = torch.empty(k, k, dtype=x.dtype, device=x.device)
    edges = list(range(0, k, GRAM_BLOCK)) + [k]
    for a0, a1 in zip(edges, edges[1:], strict=False):
        for b0, b1 in zip(edges, edges[1:], strict=False):
            if b0 >= a0:
                out[a0:a1, b0:b1] = x[:, a0:a1].T @ x[:, b0:b1]
            else:
                out[a0:a1, b0:b1] = out[b0:b1, a0:a1].T
    return out


def gptq(w: torch.Tensor, h: torch.Tensor, spec: Int4Spec, *, damp: float = 0.01, block: int = 128,
         actorder: bool = True, scale_dtype: torch.dtype = torch.float32, name: str = "weight",
         clip_ratios: tuple[float, ...] = (1.0,)) -> GPTQResult:
    """w [N, K] float, h [K, K] = mean of 2·xxᵀ over calibration tokens. `clip_ratios`: the candidate
    clipping ratios of every row's group ranges (see the module's docstring); (1.0,) is plain GPTQ."""
    if not clip_ratios or any(not 0 < r <= 1 for r in clip_ratios):
        raise ValueError(f"{name}: clip ratios must be in (0, 1], got {clip_ratios}")
    w = w.float().clone()
    n, k = w.shape
    h = h.float().clone()
    if not torch.isfinite(h).all():
        raise ValueError(f"{name}: the input Hessian has NaN/Inf (the layer's inputs are not finite)")
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if actorder else torch.arange(k, device=h.device)
    hd = h[perm][:, perm]
    hd += damp * torch.mean(torch.diag(hd)) * torch.eye(k, device=h.device)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    except torch.linalg.LinAlgError as e:
        q, s, z = rtn(w, spec, name)
        return GPTQResult(q, s, z, "rtn", f"Hessian not positive definite after {damp:g} dampening ({e})")
    best: GPTQResult | None = None
    best_err = torch.zeros(n, device=w.device)
    per_pass = max(1, STACK_ELEMENTS // max(1, n * k))
    for i in range(0, len(clip_ratios), per_pass):
        ratios = clip_ratios[i:i + per_pass]
        # qparams of r·w: every group's range shrunk by r; quantised with the scale exactly as it is stored
        params = [qparams(w * r, spec, name) for r in ratios]
        scale = torch.cat([p[0] for p in params]).to(scale_dtype).float()
        zp = torch.cat([p[1] for p in params])
        stacked = w.repeat(len(ratios), 1)
        q = _quantise(stacked[:, perm], hinv, scale, zp, perm, spec, block)[:, torch.argsort(perm)].to(torch.int8)
        if len(clip_ratios) == 1:
            return GPTQResult(q.contiguous(), scale, zp, "gptq")
        dw = stacked - dequantize(q, scale, zp, spec.group)
        for j, err in enumerate(((dw @ h) * dw).sum(-1).reshape(len(ratios), n)):
            rows = slice(j * n, (j + 1) * n)
            if best is None:
                best, best_err = GPTQResult(q[rows], scale[rows], zp[rows], "gptq"), err
                continue
            better = (err < best_err)[:, None]  # ties keep the earlier (larger) ratio
            best_err = torch.minimum(err, best_err)
            best = GPTQResult(*(torch.where(better, new, old) for new, old in
                                ((q[rows], best.q), (scale[rows], best.scale), (zp[rows], best.zp))), "gptq")
    assert best is not None
    return GPTQResult(best.q.contiguous(), best.scale, best.zp, "gptq")


def _quantise(w: torch.Tensor, hinv: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, perm: torch.Tensor,
              spec: Int4Spec, block: int) -> torch.Tensor:
    """GPTQ's column loop: w [N, K] in the permuted column order, hinv the upper Cholesky factor of the
    permuted H⁻¹, scale/zp [N, K/g] in the original order. Returns the codes [N, K] (float), permuted."""
    n, k = w.shape
    group_of = perm // spec.group  # each permuted column keeps its original group's parameters
    # Per permuted column, laid out [K, N] so that column i is one contiguous row: the inner loop is
    # the slow part of GPTQ (a few small ops per column), so it indexes nothing it can precompute.
    s_cols, z_cols = scale[:, group_of].T.contiguous(), zp[:, group_of].T.float().contiguous()
    wt = w.T.contiguous()  # [K, N]
    qt = torch.zeros(k, n, device=w.device)
    diag = torch.diagonal(hinv).clone()
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2]
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col, s, z = w1[i], s_cols[i1 + i], z_cols[i1 + i]
            qc = torch.clamp(torch.round(col / s) + z, QMIN, QMAX)
            qt[i1 + i] = qc
            e = err1[i]
            torch.sub(col, (qc - z) * s, out=e).div_(diag[i1 + i])
            w1[i:].addr_(hinv1[i, i:], e, alpha=-1)
        wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1)
    return qt.T
