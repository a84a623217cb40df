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
        staged = ctx.stage is not None and ctx.stage.count > 1
        if staged:  # a pipeline stage reads, hashes and checks only the shards of its own tensors
            names = {n for n in names if ctx.stage.holds(n, ckpt.dims.tied)}  # type: ignore[union-attr]
        hashes = ckpt.scan(names, workers=ctx.workers, only=staged,
                           progress=lambda done, total: ctx.progress("reading shards", done, total, unit="bytes"))
        ctx.journal.check_sources(hashes)
        state.source_hashes = hashes
        return PassResult(False, {"tensors_checked": len(names), "shards_hashed": len(hashes)})
