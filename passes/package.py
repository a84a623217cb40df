"""Copy what the runtime needs next to the graphs: tokenizer, configs, run.py, a graph summary."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import ClassVar

from qwen2om.checkpoint import TOKENIZER_FILES, check_tokenizer_sources
from qwen2om.confine import confined
from qwen2om.errors import CheckpointError
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

# Every tokenizer file a Hugging Face checkpoint may carry (qwen2om.checkpoint.TOKENIZER_FILES) is copied into
# OUT when present: run.py renders the chat template from chat_template.jinja / tokenizer_config.json
# (chat_template.json: a processor's), and transformers loads OUT as a tokenizer directory. convert's
# preflight checks the same names.
CONFIG_FILES = ("config.json", "generation_config.json")


def graph_summary(kind: str, model: object) -> str:
    """A compact, diffable text summary: I/O and op histogram."""
    g = model.graph  # type: ignore[attr-defined]
    lines = [f"# {kind}: {len(list(g))} nodes, opset {model.opset_imports.get('', '?')}, "  # type: ignore[attr-defined]
             f"IR {model.ir_version}"]  # type: ignore[attr-defined]
    for v in g.inputs:
        lines.append(f"input  {v.name} {v.dtype} {list(v.shape)}")
    for v in g.outputs:
        lines.append(f"output {v.name} {v.dtype} {list(v.shape)}")
    for op, n in sorted(Counter(n.op_type for n in g).items()):
        lines.append(f"op     {op} {n}")
    return "\n".join(lines) + "\n"


def fast_tokenizer(source: Path, stage: Path) -> Path:
    """tokenizer.json for a checkpoint that ships only the slow tokenizer's vocab.json + merges.txt (older
    Qwen2 uploads, some fine-tunes): run.py reads tokenizers' format only. transformers builds it from
    those files and tokenizer_config.json's added tokens, as its own fast loader does."""
    check_tokenizer_sources(source)
    import tempfile

    from transformers import AutoTokenizer

    path = stage / "tokenizer.json"
    try:
        # transformers reads from a private copy of the checkpoint's tokenizer files, each confined: given
        # the checkpoint itself, it would open whatever else is there (tokenizer.model, links out of it).
        with tempfile.TemporaryDirectory(prefix="qwen2om-tokenizer-") as tmp:
            for name in (*TOKENIZER_FILES, "config.json"):
                if (source / name).exists() or (source / name).is_symlink():
                    shutil.copyfile(confined(source, name), Path(tmp) / name)
            AutoTokenizer.from_pretrained(tmp, use_fast=True).backend_tokenizer.save(str(path))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{source}: cannot build tokenizer.json from vocab.json + merges.txt "
                              f"({' '.join(str(e).split())[:200]})") from None
    return path


@register
class Package:
    """Write tokenizer and config files, the standalone run.py, and graphs/summary.txt."""

    name: ClassVar[str] = "package"
    requires: ClassVar[tuple[str, ...]] = ("checkpoint", "graphs", "onnx_files")
    produces: ClassVar[tuple[str, ...]] = ("package_files",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt, stage = state.checkpoint, ctx.stage_dir
        written: list[Path] = []
        for name in (*TOKENIZER_FILES, *CONFIG_FILES):
            if (ckpt.root / name).exists() or (ckpt.root / name).is_symlink():
                shutil.copyfile(confined(ckpt.root, name), stage / name)
                written.append(stage / name)
        if not (stage / "tokenizer.json").exists():
            written.append(fast_tokenizer(ckpt.root, stage))
        from qwen2om.runtime import standalone

        run_py = stage / "run.py"
        shutil.copyfile(standalone.__file__, run_py)
        run_py.chmod(0o755)
        (stage / "graphs").mkdir(exist_ok=True)
        summary = stage / "graphs" / "summary.txt"
        summary.write_text("".join(graph_summary(k, m) for k, m in state.graphs.items()))
        written += [run_py, summary]
        state.package_files = written
        return PassResult(True, {"files": len(written)})
