"""Read every shard once before any export work: content hashes and a NaN/Inf scan."""

from __future__ import annotations

from typing import ClassVar

from qwen2om.arch import expected_tensors
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register


@register
class CheckWeights:
    """sha256 of every shard (what `--resume` and the manifest compare) and a NaN/Inf check of every weight."""

    name: ClassVar[str] = "check_weights"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint",)
    produces: ClassVar[tuple[str, ...]] = ("weights_checked", "source_hashes")

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt = state.checkpoint
        names = set(expected_tensors(ckpt.arch, ckpt.dims)) | set(ckpt.names())  # quantised: their scales too
        hashes = ckpt.scan(names, workers=ctx.workers,
                           progress=lambda done, total: ctx.progress("reading shards", done, total, unit="bytes"))
        ctx.journal.check_sources(hashes)
        state.source_hashes = hashes
        return PassResult(False, {"tensors_checked": len(names), "shards_hashed": len(hashes)})
