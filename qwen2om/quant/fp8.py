"""FP8 (OCP e4m3fn) weights with block scales: the arithmetic of Hugging Face's fine-grained format.

A weight [N, K] is cut into tiles of `block` = (bn, bk) (128×128 in every Qwen FP8 release); the last
tile of a ragged dimension is partial, so the scale grid is [ceil(N/bn), ceil(K/bk)]. Each tile holds
`q = w / scale` rounded to e4m3fn, `scale = amax(|w| in the tile) / 448`, and reads back as
`w = q · scale` (the checkpoint calls the scale `weight_scale_inv`; the value is the multiplier).
Per-channel scales (compressed-tensors FP8_DYNAMIC) are the block (1, K).
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0  # largest finite e4m3fn value
FP8 = torch.float8_e4m3fn


def grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of an [n, k] weight in tiles of `block`, the last ones partial."""
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def expand(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """The [n, k] per-element scale of a scale grid (each tile's value repeated over its tile)."""
    s = scale.float().reshape(grid(n, k, block))
    return s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 `q · scale` per tile, exactly (an fp8 value times a float32 scale rounds once)."""
    n, k = q.shape
    return q.float() * expand(scale, n, k, block)


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3fn [n, k], scale float32 grid) with each tile's amax mapped to 448.

    An all-zero tile gets scale 1 rather than 0: zero scales are invalid (they cannot be inverted
    and the scale checks reject them) and its q is zero anyway."""
    w = w.float()
    n, k = w.shape
    gn, gk = grid(n, k, block)
    padded = torch.zeros(gn * block[0], gk * block[1])
    padded[:n, :k] = w
    tiles = padded.reshape(gn, block[0], gk, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.reshape(gn * block[0], gk * block[1])[:n, :k].contiguous(), scale
