"""Quantised checkpoints as `convert` reads them: W4A16 in two formats, FP8 in two.

- compressed-tensors `pack-quantized` (written by `qwen2om calibrate` and by llm-compressor,
  `scheme="W4A16"` / `"W4A16_ASYM"`), announced by `quantization_config` in config.json. Each
  quantised linear `X` holds `X.weight_packed` (int32 [N, K/8]), `X.weight_scale` ([N, K/g], any
  float dtype), `X.weight_shape` ([N, K]) and, asymmetric, `X.weight_zero_point` (int32 [N/8, K/g]).
- msModelSlim's W4A16 (`calibrate --format ascendv1`; what MindIE and vLLM-Ascend load), announced
  by `quant_model_description.json` (tensor name → "W4A16" or "FLOAT", `model_quant_type`): `X.weight`
  int8 [N, K] holding int4 values in [-8, 7], `X.weight_scale` and `X.weight_offset` float32
  [N, K/g], `w = (weight − offset) · scale` (offset all zero when symmetric).

Either way `w = (q − zp) · scale` per group, and a quantised `X.weight` reads as that, in float32.

FP8 (e4m3fn weights, float activations: what Qwen publishes as Qwen3-*-FP8):
- Hugging Face fine-grained FP8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`):
  `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` [ceil(N/128), ceil(K/128)] in any float
  dtype; modules without a scale (`modules_to_not_convert`: lm_head, norms, router) stay float.
- compressed-tensors `float-quantized` FP8_BLOCK (`strategy: block`, `block_structure`) and
  FP8_DYNAMIC (`strategy: channel`, a [N, 1] scale): the same with `X.weight_scale`. Their dynamic
  activation quantisation is not reproduced: activations stay in the compute dtype.

Either way `w = q · scale` per tile (see qwen2om.quant.fp8), read as that in float32.

Each format is an entry of qwen2om.quant.formats.FORMATS, which holds its reader (how it is
announced and parsed into these weights) and its storage facts; a weight asks its entry (`layout`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from qwen2om.errors import CheckpointError
from qwen2om.quant import fp8
from qwen2om.quant.int4 import dequantize, pack_int4, unpack_int4
from qwen2om.safetensors_io import Shard, opened

if TYPE_CHECKING:
    from qwen2om.quant.formats import Format


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    name: str  # the logical float weight, `X.weight`
    n: int
    k: int
    group: int
    symmetric: bool
    fmt: str = "compressed-tensors"  # a FORMATS name (qwen2om.quant.formats): how the values are stored
    kind = "int4"
    # `scales: auto`: int4 scales stay constants (ONNX Runtime fuses MatMulNBits only on constant scales)
    auto_scales = "constants"

    def scale_grid(self) -> dict[str, Any]:
        """scale_map.json's description of the scale grid."""
        return {"group_size": self.block[1]}

    def scale_values(self, ckpt: Any) -> torch.Tensor:
        """The values a scale input is fed: float32, in the graph's layout."""
        return self.unpacked(ckpt)[1].float().contiguous()

    @property
    def layout(self) -> Format:
        """Its format's registry entry: which tensors hold the values and the zero point."""
        from qwen2om.quant.formats import FORMATS  # formats' readers build this module's weights

        return FORMATS.get(self.fmt)

    @property
    def base(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def scale_name(self) -> str:
        return self.tensor("scale")

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.n, self.k // self.group

    @property
    def block(self) -> tuple[int, int]:
        return 1, self.group

    def tensor(self, part: str) -> str:
        return f"{self.base}.weight_{part}"

    def validate(self, ckpt: Any) -> None:
        layout = self.layout
        want = {"packed": (self.n, math.ceil(self.k / 8))} if layout.packs_int32 else {}
        if not layout.packs_int32 and ckpt.info(self.name).dtype != torch.int8:
            raise CheckpointError(f"{ckpt.root}: {self.name!r} is {ckpt.info(self.name).dtype}; W4A16 in "
                                  f"{layout.marker} needs int8 values in [-8, 7]")
        want["scale"] = (self.n, self.k // self.group)
        if self.has_zero_point:  # packed along N with the values; one per group as stored otherwise
            want[layout.zero_point] = (math.ceil(self.n / 8) if layout.packs_int32 else self.n, self.k // self.group)
        for part, shape in want.items():
            name = self.tensor(part)
            if name not in ckpt:
                raise CheckpointError(f"{ckpt.root}: quantised weight {self.base!r} has no {name!r}")
            if ckpt.info(name).shape != shape:
                raise CheckpointError(f"{ckpt.root}: {name!r} has shape {list(ckpt.info(name).shape)}, "
                                      f"expected {list(shape)} for int4 [{self.n}, {self.k}] in groups of {self.group}")
        scale = ckpt.info(self.tensor("scale"))
        if not scale.dtype.is_floating_point:
            raise CheckpointError(f"{ckpt.root}: {self.tensor('scale')!r} is {scale.dtype}, not a float: "
                                  "an integer scale truncates every value")

    def unpacked(self, ckpt: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q int8 [N, K], scale [N, K/g], zero point [N, K/g] or None), as stored."""
        if not self.layout.packs_int32:
            return ckpt.raw(self.name), ckpt.raw(self.tensor("scale")), ckpt.raw(self.tensor(self.layout.zero_point))
        q = unpack_int4(ckpt.raw(self.tensor("packed")), self.k)
        scale = ckpt.raw(self.tensor("scale"))
        zp = None if self.symmetric else unpack_int4(ckpt.raw(self.tensor(self.layout.zero_point)), self.n, dim=0)
        return q, scale, zp

    def nbits_b(self, ckpt: Any) -> torch.Tensor:
        """ONNX Runtime MatMulNBits' B: uint8 [N, K/block, block/2], low nibble first, value + 8."""
        packed = ckpt.raw(self.tensor("packed")) if self.layout.packs_int32 else pack_int4(ckpt.raw(self.name))
        return packed.view(torch.uint8).reshape(self.n, self.k // self.group, self.group // 2)

    @property
    def has_zero_point(self) -> bool:
        return self.layout.always_zero_point or not self.symmetric

    def nbits_zero_points(self, ckpt: Any) -> torch.Tensor:
        """MatMulNBits' zero points: uint8, two blocks per byte along K, value + 8."""
        zp = self.unpacked(ckpt)[2]
        assert zp is not None
        zi = torch.round(zp.float())
        if not torch.equal(zi, zp.float()) or zi.min() < -8 or zi.max() > 7:
            raise CheckpointError(f"{self.tensor(self.layout.zero_point)!r}: zero "
                                  "points must be integers in [-8, 7] for an int4 kernel")
        z = zi.to(torch.int32) + 8
        if z.shape[1] % 2:
            z = torch.nn.functional.pad(z, (0, 1), value=8)
        pairs = z.reshape(self.n, -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).reshape(-1)

    def dequantize(self, ckpt: Any, rows: tuple[int, int] | None = None) -> torch.Tensor:
        q, scale, zp = self.unpacked(ckpt)
        w = dequantize(q, scale, zp, self.group)
        return w if rows is None else w[rows[0]:rows[1]]


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An e4m3fn weight `X.weight` [n, k] with a scale grid `scale_name` in tiles of `block`."""

    name: str
    n: int
    k: int
    block: tuple[int, int]
    scale_name: str
    fmt: str = "fp8"  # a FORMATS name: Hugging Face fine-grained, or compressed-tensors
    kind = "fp8"
    auto_scales = "inputs"  # `scales: auto`: the design's per-layer scale inputs

    def scale_grid(self) -> dict[str, Any]:
        return {"block_size": list(self.block)}

    def scale_values(self, ckpt: Any) -> torch.Tensor:
        return self.scale(ckpt).contiguous()

    @property
    def base(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def scale_shape(self) -> tuple[int, int]:
        return fp8.grid(self.n, self.k, self.block)

    def validate(self, ckpt: Any) -> None:
        dtype = ckpt.info(self.name).dtype
        if dtype != fp8.FP8:
            raise CheckpointError(f"{ckpt.root}: {self.name!r} is {dtype}, but its scale {self.scale_name!r} "
                                  "marks it FP8: only float8_e4m3fn (F8_E4M3) weights are supported")
        scale = ckpt.info(self.scale_name)
        if not scale.dtype.is_floating_point or scale.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{ckpt.root}: {self.scale_name!r} is {scale.dtype}, not a float: an integer "
                                  "scale truncates every value (use float32, bfloat16 or float16)")
        if math.prod(scale.shape) != math.prod(self.scale_shape) or len(scale.shape) > 2 or (
                len(scale.shape) == 2 and tuple(scale.shape) != self.scale_shape):
            raise CheckpointError(f"{ckpt.root}: {self.scale_name!r} has shape {list(scale.shape)}, but "
                                  f"{self.name!r} [{self.n}, {self.k}] in {self.block[0]}×{self.block[1]} tiles "
                                  f"needs {list(self.scale_shape)}")

    def scale(self, ckpt: Any) -> torch.Tensor:
        """The scale grid in float32, shaped [ceil(n/bn), ceil(k/bk)]."""
        return ckpt.raw(self.scale_name).float().reshape(self.scale_shape)

    def dequantize(self, ckpt: Any, rows: tuple[int, int] | None = None) -> torch.Tensor:
        r0, r1 = rows if rows is not None else (0, self.n)
        bn = self.block[0]
        q = ckpt.raw(self.name, (r0, r1))
        s = self.scale(ckpt)[r0 // bn:math.ceil(r1 / bn)]
        # Rows [r0, r1) start inside tile r0 // bn: expand from that tile's first row, then cut.
        full = fp8.expand(s, s.shape[0] * bn, self.k, self.block)[r0 - (r0 // bn) * bn:][:r1 - r0]
        return q.float() * full


QuantWeight = Int4Weight | Fp8Weight


def block_size(value: Any, where: str) -> tuple[int, int]:
    """A 2-D tile size [rows, columns] of positive integers, or a CheckpointError naming `where`."""
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise CheckpointError(f"{where}: weight block size {value!r} must be two positive integers "
                              "[rows, columns], e.g. [128, 128]")
    return int(value[0]), int(value[1])


def read_fp8(where: dict[str, Any], source: str, block: tuple[int, int] | None, scale_suffix: str,
             fmt: str) -> dict[str, QuantWeight]:
    """Every `X.weight` with a sibling `X<scale_suffix>` is FP8; an e4m3 weight without one is an error.
    `block` None means per channel: (1, K)."""
    shards: dict[Any, Shard] = {}
    out: dict[str, QuantWeight] = {}
    for name in sorted(where):
        if not name.endswith(".weight"):
            continue
        shard = opened(shards, where[name])
        info = shard.tensors[name]
        scale = name.removesuffix(".weight") + scale_suffix
        if scale not in where:
            if info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{source}: FP8 weight {name!r} has no scale {scale!r}")
            continue
        if len(info.shape) != 2:
            raise CheckpointError(f"{source}: FP8 weight {name!r} has shape {list(info.shape)}; 2-D [N, K] expected")
        n, k = info.shape
        out[name] = Fp8Weight(name, n, k, block or (1, k), scale, fmt)
    for shard in shards.values():
        shard.close()
    return out


DESCRIPTION = "quant_model_description.json"
