"""Open the checkpoint lazily and check its layout against the config (no weights read)."""

from __future__ import annotations

from typing import ClassVar

from qwen2om.checkpoint import Checkpoint, check_tokenizer_sources
from qwen2om.errors import RecipeError
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register


@register
class LoadCheckpoint:
    """Open the checkpoint, resolve its architecture, check every tensor's name and shape."""

    name: ClassVar[str] = "load_checkpoint"
    requires: ClassVar[tuple[str, ...]] = ()
    produces: ClassVar[tuple[str, ...]] = ("checkpoint",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        # convert opened it for its checks before any work (config.json read once); run alone, open it here
        ckpt = Checkpoint(ctx.source) if ctx.opened_checkpoint is None else ctx.opened_checkpoint
        if ctx.recipe.family not in (ckpt.arch.name, ckpt.arch.recipe):  # MoE families use their dense recipes
            raise RecipeError(
                f"recipe {ctx.recipe.name or '?'} is for family {ctx.recipe.family!r}, "
                f"but {ctx.model or ctx.source} is {ckpt.arch.name!r}"
            )
        expected = ckpt.validate_layout()
        check_tokenizer_sources(ckpt.root)  # package builds tokenizer.json from vocab + merges when needed
        for part, n in ckpt.ignored.items():
            ctx.log(f"ignoring {n} tensors under {part}.* (not part of the text model qwen2om converts)")
        state.checkpoint = ckpt
        extra = len(set(ckpt.names()) - set(expected))
        return PassResult(True, {"arch": ckpt.arch.name, "tensors": len(expected), "ignored_tensors": extra,
                                 "shards": len({p for p in ckpt.files if p.suffix == ".safetensors"})})
