"""Validate every quantisation scale before anything is built, and report their range per layer.

A scale must be floating point (checked when the checkpoint opens: an integer scale truncates every
value to 0 or 1, a real field failure), finite, strictly positive, and inside the range the target
holds it in (qwen2om.targets; a recipe's `scale_range: [lo, hi]` overrides it). Every failure
names the tensor, how many values are bad and the first one.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from qwen2om.errors import CheckpointError
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.targets import scale_range

LAYER = re.compile(r"\blayers\.(\d+)\.")


def first_bad(s: torch.Tensor, bad: torch.Tensor) -> str:
    idx = tuple(int(i) for i in torch.nonzero(bad)[0])
    return f"{int(bad.sum())} of {s.numel()}, first at {list(idx)}: {float(s[idx]):.6g}"


@register
class CheckScales:
    """Scales finite, positive and within the target's range; per-layer min/max in the report."""

    name: ClassVar[str] = "check_scales"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint",)
    produces: ClassVar[tuple[str, ...]] = ("scales_checked",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt, r = state.checkpoint, ctx.recipe
        if not ckpt.quantized:
            return PassResult(False, {"scales": 0})
        layers: dict[Any, list[float]] = {}
        ranges = {}
        for i, q in enumerate(sorted(ckpt.quantized.values(), key=lambda q: q.name)):
            ctx.progress("checking scales", i, len(ckpt.quantized))
            dtype, (lo, hi) = scale_range(r.target, q.kind, r.dtype)
            why = f"the normal range of {dtype}, which target {r.target} holds {q.kind} scales in"
            if r.scale_range != "auto":
                (lo, hi), why = r.scale_range, "the recipe's scale_range"  # type: ignore[misc]
            ranges[q.kind] = {"held_as": dtype, "range": [lo, hi]}
            s = ckpt.raw(q.scale_name).float()
            where = f"{ckpt.root}: scale {q.scale_name!r}"
            if not bool(torch.isfinite(s).all()):
                raise CheckpointError(f"{where} has non-finite values (NaN/Inf): {first_bad(s, ~torch.isfinite(s))}")
            if bool((s <= 0).any()):
                raise CheckpointError(f"{where} has zero or negative values: {first_bad(s, s <= 0)}; "
                                      "scales must be > 0")
            out = (s < lo) | (s > hi)
            if bool(out.any()):
                raise CheckpointError(f"{where} is outside [{lo:.6g}, {hi:.6g}], {why}: {first_bad(s, out)} "
                                      "(a recipe's scale_range: [lo, hi] sets the accepted range)")
            m = LAYER.search(q.name)
            span = layers.setdefault(int(m.group(1)) if m else q.base, [float("inf"), 0.0, 0])
            span[0], span[1], span[2] = min(span[0], float(s.min())), max(span[1], float(s.max())), span[2] + 1
        report = [{"layer": k, "tensors": v[2], "min": v[0], "max": v[1]}
                  for k, v in sorted(layers.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))]
        return PassResult(False, {"scales": len(ckpt.quantized), "accepted": ranges,
                                  "min": min(x["min"] for x in report), "max": max(x["max"] for x in report),
                                  "layers": report})
