"""`calibrate --scheme fp8-block`: float checkpoint → Hugging Face fine-grained FP8, data-free.

Every weight W4A16 would quantise (the same architecture rule: never embeddings, norms, RoPE or
router gates; lm_head only with `--quantize-lm-head`; minus `ignore` regexes) becomes e4m3fn in
128×128 tiles, each tile's amax mapped to 448 (qwen2om.quant.fp8). The result is the layout
Qwen publishes as Qwen3-*-FP8, which transformers, vLLM and `qwen2om convert` read:

- `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` [⌈N/128⌉, ⌈K/128⌉] float32 (Qwen's
  releases store the scale in bf16; float32 costs a few KiB and keeps every scale exact);
- config.json `quantization_config`: quant_method fp8, fmt e4m3, activation_scheme dynamic,
  weight_block_size [128, 128], modules_to_not_convert = the linear modules left float.

MoE experts stored fused 3-D (`experts.gate_up_proj` / `experts.down_proj`, the layout transformers 5
saves) are written per expert (`experts.E.gate_proj.weight` + its scale), each read as a slice of its
stack, as in Qwen's own FP8 releases; a fused float stack would leave most of an MoE model's weights float.

One tensor (one expert's projection, for fused stacks) is in memory at a time; layers are written in order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from qwen2om.arch import EMBED, LM_HEAD, float_linears, quantizable
from qwen2om.checkpoint import Checkpoint
from qwen2om.quant import fp8
from qwen2om.quant.experts import expand_names, expanded_shape, unfused_experts
from qwen2om.quant.writer import ShardWriter, copy_tensor

BLOCK = (128, 128)


@dataclasses.dataclass
class Fp8Report:
    name: str
    relative_error: float  # ‖W − q·s‖ / ‖W‖
    scale_min: float
    scale_max: float


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def quantize_checkpoint(ckpt: Checkpoint, writer: ShardWriter, *, ignore: tuple[str, ...], lm_head: bool,
                        finite: Callable[[str, torch.Tensor], torch.Tensor],
                        progress: Callable[..., None]) -> tuple[list[Fp8Report], list[float], list[str]]:
    """Write every tensor of `ckpt`, the targets as FP8. Returns (per-weight reports, seconds per
    layer, linear modules left float)."""
    arch, layers = ckpt.arch, ckpt.dims.layers
    slices = unfused_experts(ckpt)  # per-expert name → its slice of a fused expert stack
    names = expand_names(ckpt.names(), slices)

    def read(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return slices[name].read(ckpt, dtype) if name in slices else ckpt.get(name, dtype)

    targets = {n for n in names if quantizable(arch, n, ignore=ignore, lm_head=lm_head)}
    tied_head = lm_head and LM_HEAD not in names
    reports: list[Fp8Report] = []
    seconds: list[float] = []

    def emit(name: str, source: str) -> None:
        w = finite(source, read(source, torch.float32))
        q, scale = fp8.quantize(w, BLOCK)
        err = float((fp8.dequantize(q, scale, BLOCK) - w).norm() / w.norm().clamp_min(1e-30))
        writer.add(name, q)
        writer.add(name.removesuffix(".weight") + ".weight_scale_inv", scale)
        reports.append(Fp8Report(name, err, float(scale.min()), float(scale.max())))

    def copy(name: str) -> None:
        if name in slices:
            writer.add(name, read(name))
        else:
            copy_tensor(writer, ckpt, name)

    by_layer: dict[int | None, list[str]] = {}
    for n in names:
        by_layer.setdefault(layer_of(n), []).append(n)
    for n in by_layer.pop(None, []):
        emit(n, n) if n in targets else copy(n)
    for i in range(layers):
        t0 = time.perf_counter()
        for n in by_layer.get(i, []):
            emit(n, n) if n in targets else copy(n)
        seconds.append(time.perf_counter() - t0)
        progress("quantising layers", i + 1, layers)
    if tied_head:  # the head becomes its own FP8 tensor; the embedding stays float
        emit(LM_HEAD, EMBED)
    quantized = targets | ({LM_HEAD} if tied_head else set())
    left_float = float_linears(names, lambda n: len(expanded_shape(ckpt, slices, n)), quantized)
    return reports, seconds, left_float


def hf_quantization_config(left_float: list[str]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": left_float}
