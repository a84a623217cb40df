"""Quantised checkpoints as `convert` reads them: W4A16 in two formats.

- compressed-tensors `pack-quantized` (written by `qwen2om calibrate` and by llm-compressor,
  `scheme="W4A16"` / `"W4A16_ASYM"`), announced by `quantization_config` in config.json. Each
  quantised linear `X` holds `X.weight_packed` (int32 [N, K/8]), `X.weight_scale` ([N, K/g], any
  float dtype), `X.weight_shape` ([N, K]) and, asymmetric, `X.weight_zero_point` (int32 [N/8, K/g]).
- msModelSlim's W4A16 (`calibrate --format ascendv1`; what MindIE and vLLM-Ascend load), announced
  by `quant_model_description.json` (tensor name → "W4A16" or "FLOAT", `model_quant_type`): `X.weight`
  int8 [N, K] holding int4 values in [-8, 7], `X.weight_scale` and `X.weight_offset` float32
  [N, K/g], `w = (weight − offset) · scale` (offset all zero when symmetric).

Either way `w = (q − zp) · scale` per group, and a quantised `X.weight` reads as that, in float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from qwen2om.errors import CheckpointError
from qwen2om.quant.int4 import dequantize, pack_int4, unpack_int4
from qwen2om.safetensors_io import Shard


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    name: str  # the logical float weight, `X.weight`
    n: int
    k: int
    group: int
    symmetric: bool
    fmt: str = "compressed-tensors"  # or "ascendv1"

    @property
    def base(self) -> str:
        return self.name.removesuffix(".weight")

    def tensor(self, part: str) -> str:
        return f"{self.base}.weight_{part}"

    def validate(self, ckpt: Any) -> None:
        if self.fmt == "ascendv1":
            want = {"scale": (self.n, self.k // self.group), "offset": (self.n, self.k // self.group)}
            if ckpt.info(self.name).dtype != torch.int8:
                raise CheckpointError(f"{ckpt.root}: {self.name!r} is {ckpt.info(self.name).dtype}; W4A16 in "
                                      "quant_model_description.json needs int8 values in [-8, 7]")
        else:
            want = {"packed": (self.n, math.ceil(self.k / 8)), "scale": (self.n, self.k // self.group)}
        if not self.symmetric and self.fmt != "ascendv1":
            want["zero_point"] = (math.ceil(self.n / 8), self.k // self.group)
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
        if self.fmt == "ascendv1":
            return ckpt.raw(self.name), ckpt.raw(self.tensor("scale")), ckpt.raw(self.tensor("offset"))
        q = unpack_int4(ckpt.raw(self.tensor("packed")), self.k)
        scale = ckpt.raw(self.tensor("scale"))
        zp = None if self.symmetric else unpack_int4(ckpt.raw(self.tensor("zero_point")), self.n, dim=0)
        return q, scale, zp

    def nbits_b(self, ckpt: Any) -> torch.Tensor:
        """ONNX Runtime MatMulNBits' B: uint8 [N, K/block, block/2], low nibble first, value + 8."""
        packed = pack_int4(ckpt.raw(self.name)) if self.fmt == "ascendv1" else ckpt.raw(self.tensor("packed"))
        return packed.view(torch.uint8).reshape(self.n, self.k // self.group, self.group // 2)

    @property
    def has_zero_point(self) -> bool:
        return self.fmt == "ascendv1" or not self.symmetric

    def nbits_zero_points(self, ckpt: Any) -> torch.Tensor:
        """MatMulNBits' zero points: uint8, two blocks per byte along K, value + 8."""
        zp = self.unpacked(ckpt)[2]
        assert zp is not None
        zi = torch.round(zp.float())
        if not torch.equal(zi, zp.float()) or zi.min() < -8 or zi.max() > 7:
            raise CheckpointError(f"{self.tensor('offset' if self.fmt == 'ascendv1' else 'zero_point')!r}: zero "
                                  "points must be integers in [-8, 7] for an int4 kernel")
        z = zi.to(torch.int32) + 8
        if z.shape[1] % 2:
            z = torch.nn.functional.pad(z, (0, 1), value=8)
        pairs = z.reshape(self.n, -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).reshape(-1)

    def dequantize(self, ckpt: Any) -> torch.Tensor:
        q, scale, zp = self.unpacked(ckpt)
        return dequantize(q, scale, zp, self.group)


DESCRIPTION = "quant_model_description.json"


def read_description(root: Path, where: dict[str, Any]) -> dict[str, Int4Weight]:
    """msModelSlim W4A16: the description names the quantised tensors; shapes give the group."""
    path = root / DESCRIPTION
    try:
        desc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    kind = desc.get("model_quant_type")
    if kind != "W4A16":
        raise CheckpointError(f"{path}: model_quant_type {kind!r} is not supported (supported: W4A16)")
    out: dict[str, Int4Weight] = {}
    shards: dict[Any, Shard] = {}
    for name, typ in sorted(desc.items()):
        if typ != "W4A16" or not name.endswith(".weight"):
            continue
        base = name.removesuffix(".weight")
        missing = [t for t in (name, f"{base}.weight_scale", f"{base}.weight_offset") if t not in where]
        if missing:
            raise CheckpointError(f"{path} marks {name!r} W4A16, but the checkpoint has no {missing[0]!r}")
        shard = shards.setdefault(where[name], Shard(where[name]))
        n, k = shard.tensors[name].shape
        sshard = shards.setdefault(where[f"{base}.weight_scale"], Shard(where[f"{base}.weight_scale"]))
        groups = sshard.tensors[f"{base}.weight_scale"].shape[-1]
        group = int(desc.get("group_size") or (k // groups))
        out[name] = Int4Weight(name, n, k, group, symmetric=False, fmt="ascendv1")
    for shard in shards.values():
        shard.close()
    return out


def read_quantization(cfg: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, Int4Weight]:
    """The quantised weights of a checkpoint ({} for a float one); unsupported schemes are refused."""
    if (Path(source) / DESCRIPTION).is_file():
        return read_description(Path(source), where)
    qc = cfg.get("quantization_config")
    if not qc:
        return {}
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"{source}/config.json: quantization {method!r} is not supported "
                              "(supported: compressed-tensors pack-quantized W4A16)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{source}/config.json: {len(groups)} quantisation config groups; one is supported")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format")
    if (fmt, w.get("num_bits"), w.get("type"), w.get("strategy")) != ("pack-quantized", 4, "int", "group") or (
            group.get("input_activations")):
        raise CheckpointError(f"{source}/config.json: compressed-tensors {fmt} {w.get('type')}{w.get('num_bits')} "
                              f"{w.get('strategy')} with activations {group.get('input_activations')} is not "
                              "supported (supported: pack-quantized int4 group weights, float activations)")
    if w.get("actorder") == "group":
        raise CheckpointError(f"{source}/config.json: actorder 'group' needs a run-time permutation (g_idx); "
                              "re-quantise with actorder 'static' or none")
    shards: dict[Any, Shard] = {}
    out = {}
    for name in sorted(where):
        if not name.endswith(".weight_packed"):
            continue
        base = name.removesuffix(".weight_packed")
        shape_name = f"{base}.weight_shape"
        if shape_name not in where:
            raise CheckpointError(f"{source}: quantised weight {base!r} has no {shape_name!r}")
        shard = shards.setdefault(where[shape_name], Shard(where[shape_name]))
        n, k = (int(x) for x in shard.read(shape_name).tolist())
        out[f"{base}.weight"] = Int4Weight(f"{base}.weight", n, k, int(w.get("group_size") or k),
                                           bool(w.get("symmetric", True)))
    for shard in shards.values():
        shard.close()
    return out
