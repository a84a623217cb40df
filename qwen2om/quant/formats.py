"""Quantised checkpoint formats as data: how each announces itself, how its int4 values and zero
points are stored, how `convert` reads it and how `calibrate` writes it. Code asks the entry
(`FORMATS.get(w.fmt).packs_int32`), not `if fmt == "ascendv1"`; qwen2om/quantized.py describes the
layouts tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qwen2om.errors import CheckpointError
from qwen2om.quant.int4 import Int4Spec, pack_int4
from qwen2om.quantized import DESCRIPTION, Int4Weight, QuantWeight, block_size, read_fp8
from qwen2om.registry import Registry
from qwen2om.safetensors_io import Shard, opened

# (quantization_config or {}, safetensors name → its file, the checkpoint directory) → weight name → weight
Reader = Callable[[dict[str, Any], dict[str, Any], str], dict[str, QuantWeight]]
# (X.weight, q int8 [N, K], scale, zero point, spec, the float weight's dtype) → the stored tensors
Writer = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, Int4Spec, torch.dtype], dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantised checkpoint format, as `--format` and a weight's `fmt` name it."""

    name: str
    summary: str
    read: Reader
    # What announces it: config.json's quantization_config.quant_method, or a file beside config.json
    # (which wins: an msModelSlim checkpoint may carry a stale quantization_config).
    quant_method: str | None = None
    marker: str | None = None
    # int4 storage: eight values per int32 in `X.weight_packed` (zero points packed along N), or one
    # int8 per value in `X.weight` (zero points as stored, one per group).
    packs_int32: bool = True
    zero_point: str = "zero_point"  # the zero point's tensor, `X.weight_<zero_point>`
    always_zero_point: bool = False  # stored (all zero) even when symmetric
    write: Writer | None = None  # int4 tensors of one weight, as `calibrate --format` writes them


def _write_packed(name: str, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: Int4Spec,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = name.removesuffix(".weight")
    out = {f"{base}.weight_packed": pack_int4(q), f"{base}.weight_scale": scale.to(dtype),
           f"{base}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not spec.symmetric:
        out[f"{base}.weight_zero_point"] = pack_int4(zp.to(torch.int8), dim=0)
    return out


def _write_int8(name: str, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: Int4Spec,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """msModelSlim: int8 holding int4 values, float32 scale and offset (= zero point)."""
    base = name.removesuffix(".weight")
    return {name: q.to(torch.int8), f"{base}.weight_scale": scale.float(), f"{base}.weight_offset": zp.float()}


def read_hf_fp8(qc: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, QuantWeight]:
    cfg = f"{source}/config.json"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{cfg}: FP8 fmt {qc.get('fmt')!r} is not supported (supported: e4m3)")
    if "weight_block_size" not in qc or qc["weight_block_size"] is None:
        raise CheckpointError(f"{cfg}: quantization_config has no weight_block_size; fine-grained FP8 needs "
                              "[rows, columns] (128, 128 in Qwen's releases)")
    block = block_size(qc["weight_block_size"], f"{cfg}: weight_block_size")
    return read_fp8(where, source, block, ".weight_scale_inv", HF_FP8.name)


def read_description(qc: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, QuantWeight]:
    """msModelSlim W4A16: the description names the quantised tensors; shapes give the group."""
    path = Path(source) / DESCRIPTION
    try:
        desc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    kind = desc.get("model_quant_type")
    if kind != "W4A16":
        raise CheckpointError(f"{path}: model_quant_type {kind!r} is not supported (supported: W4A16)")
    out: dict[str, QuantWeight] = {}
    shards: dict[Any, Shard] = {}
    for name, typ in sorted(desc.items()):
        if typ != "W4A16" or not name.endswith(".weight"):
            continue
        base = name.removesuffix(".weight")
        missing = [t for t in (name, f"{base}.weight_scale", f"{base}.weight_offset") if t not in where]
        if missing:
            raise CheckpointError(f"{path} marks {name!r} W4A16, but the checkpoint has no {missing[0]!r}")
        shard = opened(shards, where[name])
        n, k = shard.tensors[name].shape
        sshard = opened(shards, where[f"{base}.weight_scale"])
        groups = sshard.tensors[f"{base}.weight_scale"].shape[-1]
        group = int(desc.get("group_size") or (k // groups))
        out[name] = Int4Weight(name, n, k, group, symmetric=False, fmt=ASCENDV1.name)
    for shard in shards.values():
        shard.close()
    return out


def read_ct_fp8(w: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, QuantWeight]:
    """compressed-tensors FP8_BLOCK (`strategy: block`) and FP8_DYNAMIC (`strategy: channel`)."""
    strategy = w.get("strategy")
    if strategy == "block":
        block = block_size(w.get("block_structure"), f"{source}/config.json: block_structure")
    elif strategy == "channel":
        block = None
    else:
        raise CheckpointError(f"{source}/config.json: compressed-tensors FP8 strategy {strategy!r} is not supported "
                              "(supported: block, channel)")
    if not w.get("symmetric", True):
        raise CheckpointError(f"{source}/config.json: asymmetric FP8 weights are not supported")
    return read_fp8(where, source, block, ".weight_scale", COMPRESSED_TENSORS.name)


def read_quantization(cfg: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, QuantWeight]:
    """The quantised weights of a checkpoint ({} for a float one); unsupported schemes are refused."""
    qc = cfg.get("quantization_config")
    fmt = next((f for f in FORMATS if f.marker and (Path(source) / f.marker).is_file()), None)
    if fmt is None and not qc:
        return {}
    if fmt is None:
        method = qc.get("quant_method")
        fmt = next((f for f in FORMATS if f.quant_method is not None and f.quant_method == method), None)
        if fmt is None:
            raise CheckpointError(f"{source}/config.json: quantization {method!r} is not supported "
                                  "(supported: compressed-tensors W4A16 / FP8, fp8)")
    return fmt.read(qc or {}, where, source)


def read_compressed_tensors(qc: dict[str, Any], where: dict[str, Any], source: str) -> dict[str, QuantWeight]:
    """compressed-tensors: pack-quantized int4 groups, or float-quantized FP8."""
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{source}/config.json: {len(groups)} quantisation config groups; one is supported")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    fmt = group.get("format") or qc.get("format")
    if (w.get("type"), w.get("num_bits")) == ("float", 8):
        return read_ct_fp8(w, where, source)
    if (fmt, w.get("num_bits"), w.get("type"), w.get("strategy")) != ("pack-quantized", 4, "int", "group") or (
            group.get("input_activations")):
        raise CheckpointError(f"{source}/config.json: compressed-tensors {fmt} {w.get('type')}{w.get('num_bits')} "
                              f"{w.get('strategy')} with activations {group.get('input_activations')} is not "
                              "supported (supported: pack-quantized int4 group weights, float activations)")
    if w.get("actorder") == "group":
        raise CheckpointError(f"{source}/config.json: actorder 'group' needs a run-time permutation (g_idx); "
                              "re-quantise with actorder 'static' or none")
    shards: dict[Any, Shard] = {}
    out: dict[str, QuantWeight] = {}
    for name in sorted(where):
        if not name.endswith(".weight_packed"):
            continue
        base = name.removesuffix(".weight_packed")
        shape_name = f"{base}.weight_shape"
        if shape_name not in where:
            raise CheckpointError(f"{source}: quantised weight {base!r} has no {shape_name!r}")
        shard = opened(shards, where[shape_name])
        n, k = (int(x) for x in shard.read(shape_name).tolist())
        out[f"{base}.weight"] = Int4Weight(f"{base}.weight", n, k, int(w.get("group_size") or k),
                                           bool(w.get("symmetric", True)))
    for shard in shards.values():
        shard.close()
    return out


FORMATS: Registry[Format] = Registry("format")

COMPRESSED_TENSORS = FORMATS.add(Format(
    "compressed-tensors", "compressed-tensors (transformers, vLLM, llm-compressor)", read_compressed_tensors,
    quant_method="compressed-tensors", write=_write_packed,
))
ASCENDV1 = FORMATS.add(Format(
    "ascendv1", "msModelSlim's W4A16 (MindIE, vLLM-Ascend)", read_description, marker=DESCRIPTION,
    packs_int32=False, zero_point="offset", always_zero_point=True, write=_write_int8,
))
HF_FP8 = FORMATS.add(Format(
    "fp8", "Hugging Face's fine-grained FP8 format", read_hf_fp8, quant_method="fp8",
))
