"""Quantised checkpoints as `convert` reads them: compressed-tensors W4A16 `pack-quantized`.

Written by `qwen2om calibrate` and by llm-compressor (`scheme="W4A16"` / `"W4A16_ASYM"`). Each
quantised linear `X` holds `X.weight_packed` (int32 [N, K/8]), `X.weight_scale` ([N, K/g], any
float dtype), `X.weight_shape` ([N, K]) and, asymmetric, `X.weight_zero_point` (int32 [N/8, K/g]).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from qwen2om.errors import CheckpointError
from qwen2om.quant.int4 import dequantize, unpack_int4
from qwen2om.safetensors_io import Shard


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    name: str  # the logical float weight, `X.weight`
    n: int
    k: int
    group: int
    symmetric: bool

    @property
    def base(self) -> str:
        return self.name.removesuffix(".weight")

    def tensor(self, part: str) -> str:
        return f"{self.base}.weight_{part}"

    def validate(self, ckpt: Any) -> None:
        want = {"packed": (self.n, math.ceil(self.k / 8)), "scale": (self.n, self.k // self.group)}
        if not self.symmetric:
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
        q = unpack_int4(ckpt.get(self.tensor("packed")), self.k)
        scale = ckpt.get(self.tensor("scale"))
        zp = None if self.symmetric else unpack_int4(ckpt.get(self.tensor("zero_point")), self.n, dim=0)
        return q, scale, zp

    def dequantize(self, ckpt: Any) -> torch.Tensor:
        q, scale, zp = self.unpacked(ckpt)
        return dequantize(q, scale, zp, self.group)


def read_quantization(cfg: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, Int4Weight]:
    """The quantised weights of a checkpoint ({} for a float one); unsupported schemes are refused."""
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
