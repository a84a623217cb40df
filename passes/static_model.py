"""Rewrite the checkpoint into the static-shape forward (see qwen2om/static_model.py)."""

from __future__ import annotations

from typing import ClassVar

import torch

from qwen2om.pipeline import PassResult, RunContext, Workspace, register
from qwen2om.rope import rope_tables
from qwen2om.static_model import StaticQwen

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@register
class BuildStaticModel:
    """Build the static model in the compute dtype; bf16 weights are converted here."""

    name: ClassVar[str] = "static_model"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint",)
    produces: ClassVar[tuple[str, ...]] = ("static_model",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        ckpt, r = ws.need("checkpoint"), ctx.recipe
        dtype = TORCH_DTYPES[r.dtype]
        cos, sin = rope_tables(ckpt.config, int(r.max_seq_len))

        def get(name: str) -> torch.Tensor | None:
            return ckpt.get(name, dtype) if name in ckpt else None

        model = StaticQwen(ckpt.arch, ckpt.dims, get, cos, sin, logits_last=r.logits == "last").eval()
        ws["static_model"] = model
        params = sum(p.numel() for p in model.parameters())
        return PassResult(True, {"parameters": params, "dtype": r.dtype, "rope_rows": int(r.max_seq_len)})
