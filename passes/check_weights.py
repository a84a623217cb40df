"""Scan every weight for NaN/Inf, one tensor at a time, before any export work."""

from __future__ import annotations

from typing import ClassVar

from qwen2om.arch import expected_tensors
from qwen2om.pipeline import PassResult, RunContext, Workspace, register


@register
class CheckWeights:
    """Fail naming the tensor when a weight holds NaN or Inf."""

    name: ClassVar[str] = "check_weights"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint",)
    produces: ClassVar[tuple[str, ...]] = ("weights_checked",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        ckpt = ws.need("checkpoint")
        names = list(expected_tensors(ckpt.arch, ckpt.dims))
        for i, name in enumerate(names):
            ckpt.check_finite(name)
            ctx.progress("checking weights", i + 1, len(names))
        ws["weights_checked"] = True
        return PassResult(False, {"tensors_checked": len(names)})
