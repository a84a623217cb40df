"""GPTQ (Frantar et al. 2022): quantise a weight column by column, pushing each column's
rounding error onto the columns not yet quantised, weighted by the inverse input Hessian.

Act-order is *static* (as llm-compressor's `actorder="static"`): columns are visited in order of
decreasing Hessian diagonal, but every group's scale and zero point are computed up front from
the original weight in the original column order, so the stored weight needs no permutation
(no `g_idx`) at run time.
"""

from __future__ import annotations

import dataclasses

import torch

from qwen2om.quant.int4 import QMAX, QMIN, Int4Spec, qparams, rtn


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
         actorder: bool = True, scale_dtype: torch.dtype = torch.float32, name: str = "weight") -> GPTQResult:
    """w [N, K] float, h [K, K] = mean of 2·xxᵀ over calibration tokens."""
    w = w.float().clone()
    n, k = w.shape
    h = h.float().clone()
    if not torch.isfinite(h).all():
        raise ValueError(f"{name}: the input Hessian has NaN/Inf (the layer's inputs are not finite)")
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    scale, zp = qparams(w, spec, name)
    scale = scale.to(scale_dtype).float()  # quantise with the scale exactly as it will be stored
    perm = torch.argsort(torch.diag(h), descending=True) if actorder else torch.arange(k, device=h.device)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, device=h.device)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError as e:
        q, s, z = rtn(w[:, torch.argsort(perm)], spec, name)
        return GPTQResult(q, s, z, "rtn", f"Hessian not positive definite after {damp:g} dampening ({e})")
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
    inv = torch.argsort(perm)
    return GPTQResult(qt.T[:, inv].to(torch.int8).contiguous(), scale, zp, "gptq")
