"""int4 group quantisation in the compressed-tensors convention, and its packed storage.

Convention (compressed-tensors, what llm-compressor writes and transformers/vLLM read): signed
int4 q in [-8, 7] per group of `group` input columns, `w ≈ (q - zp) · scale`; symmetric means
zp = 0 and scale = amax / 7.5. Storage ("pack-quantized"): `weight_packed` int32 [N, K/8] with
column 8w+i in bits 4i..4i+3 of word w, each value offset by +8 to unsigned; `weight_scale`
[N, K/group]; asymmetric adds `weight_zero_point` packed the same way along N: [ceil(N/8), K/group].

Read as little-endian bytes, `weight_packed` is exactly ONNX Runtime's MatMulNBits `B`
([N, K/block, block/2], low nibble first, zero point 8 when symmetric), so no repacking is needed.
"""

from __future__ import annotations

import dataclasses

import torch

QMIN, QMAX = -8, 7


@dataclasses.dataclass(frozen=True)
class Int4Spec:
    group: int = 128
    symmetric: bool = True

    def groups(self, k: int, name: str = "weight") -> int:
        if k % self.group:
            raise ValueError(f"{name}: input width {k} is not a multiple of the group size {self.group}")
        return k // self.group


def qparams(w: torch.Tensor, spec: Int4Spec, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale and zero point of w [N, K] (float32): [N, K/group] each."""
    n, k = w.shape
    g = w.float().reshape(n, spec.groups(k, name), spec.group)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    if spec.symmetric:
        scale = torch.maximum(-lo, hi) / ((QMAX - QMIN) / 2)
        zp = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / (QMAX - QMIN)
        zp = torch.zeros_like(scale)
        nz = scale > 0
        zp[nz] = torch.clamp(QMIN - torch.round(lo[nz] / scale[nz]), QMIN, QMAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale works
    return scale, zp


def quantize(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, group: int) -> torch.Tensor:
    """int8 tensor of int4 values, w [N, K] with per-group scale/zp [N, K/group]."""
    s = scale.repeat_interleave(group, dim=1)
    z = zp.repeat_interleave(group, dim=1)
    return torch.clamp(torch.round(w.float() / s) + z, QMIN, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, group: int) -> torch.Tensor:
    s = scale.float().repeat_interleave(group, dim=1)
    qf = q.float()
    if zp is not None:
        qf = qf - zp.float().repeat_interleave(group, dim=1)
    return qf * s


def rtn(w: torch.Tensor, spec: Int4Spec, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (q int8 [N, K], scale [N, K/g], zp [N, K/g])."""
    scale, zp = qparams(w, spec, name)
    return quantize(w, scale, zp, spec.group), scale, zp


def pack_int4(q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """int8 values in [-8, 7] → int32 words of 8 nibbles along `dim` (zero-padded at the end)."""
    if dim == 0:
        return pack_int4(q.T, 1).T.contiguous()
    n, k = q.shape
    u = (q.to(torch.int32) + 8) & 0xF
    pad = -k % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(n, -1, 8)
    out = torch.zeros(u.shape[:-1], dtype=torch.int64)
    for i in range(8):
        out |= u[..., i].to(torch.int64) << (4 * i)
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)  # two's complement into int32
    return out.to(torch.int32)


def unpack_int4(packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int4: int8 values in [-8, 7], `size` entries along `dim`."""
    if dim == 0:
        return unpack_int4(packed.T, size, 1).T.contiguous()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return (nib.reshape(packed.shape[0], -1)[:, :size] - 8).to(torch.int8)
