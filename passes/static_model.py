"""Rewrite the checkpoint into the static-shape forward (see qwen2om/static_model.py)."""

from __future__ import annotations

from typing import ClassVar

import torch

from qwen2om.families import family_of
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.replicate import layer_kinds, template_layers
from qwen2om.stages import Stage
from qwen2om.weights import Weights

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@register
class BuildStaticModel:
    """Build the static model's structure (meta weights) and its two-layer template; values are bound when written."""

    name: ClassVar[str] = "static_model"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint",)
    produces: ClassVar[tuple[str, ...]] = ("static_model", "template_model", "weights", "bindings")

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt, r = state.checkpoint, ctx.recipe
        dtype = TORCH_DTYPES[r.dtype]
        family = family_of(ckpt.arch)
        static = family.static_model
        cos, sin = family.rope_tables(ckpt.config, ckpt.dims, int(r.max_seq_len))
        shapes = {name: ckpt.shape(name) for name in (*ckpt.names(), *ckpt.quantized)}
        weights = Weights(ckpt.get, shapes, dtype, lazy=True, sliced=True)
        fused, stage = ckpt.fused_experts, ctx.stage or Stage.whole(ckpt.dims.layers)
        model = static(ckpt.arch, ckpt.dims, weights, cos, sin, logits_last=r.logits == "last",
                       fused_experts=fused, stage=stage).eval()
        # The first layers (two; hybrids four) are what export_onnx traces; it clones the rest from them.
        kinds = layer_kinds(ckpt.dims)[stage.start:stage.stop]
        template = static(ckpt.arch, ckpt.dims, weights, cos, sin, logits_last=r.logits == "last",
                          layers=template_layers(kinds), fused_experts=fused, stage=stage).eval()
        state.static_model, state.weights, state.bindings = model, weights, weights.bindings(model)
        state.template_model = template
        params = sum(p.numel() for p in model.parameters())
        return PassResult(True, {"parameters": params, "dtype": r.dtype, "rope_rows": int(r.max_seq_len)})
