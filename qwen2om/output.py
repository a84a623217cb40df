"""Atomic output directories and the manifest that describes them."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qwen2om.errors import OutputExistsError, Qwen2omError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOOLS = ("qwen2om", "torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "safetensors",
         "tokenizers", "numpy")


@contextlib.contextmanager
def staged_output(out: Path, *, force: bool) -> Iterator[Path]:
    """A temporary sibling of `out` that becomes `out` only if the block succeeds.

    On any failure, Ctrl-C included, the sibling is removed and `out` is left as it was.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        # --force replaces an earlier output, never an arbitrary folder (think `-o ~ --force`).
        raise OutputExistsError(
            f"{out} is not empty and holds no {MANIFEST}: refusing to replace it, even with --force")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise Qwen2omError(f"cannot create the output directory next to {out}: {e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        yield stage
        if out.exists():
            out.rename(old)
        stage.rename(out)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            old.rename(out)  # put the previous output back: a failed --force run changes nothing
        if isinstance(e, OSError):
            raise Qwen2omError(f"cannot move the finished output into place at {out}: {e.strerror or e}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entries(root: Path, paths: list[Path]) -> list[dict[str, Any]]:
    return [{"name": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(paths)]


def tool_versions() -> dict[str, str]:
    out = {}
    for name in TOOLS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_manifest(stage: Path, manifest: dict[str, Any]) -> Path:
    """List every file in `stage` with its hash, then write manifest.json (not listed in itself)."""
    written = [p for p in stage.rglob("*") if p.is_file() and p.name != MANIFEST]
    manifest["files"] = file_entries(stage, written)
    path = stage / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_manifest(out: Path) -> dict[str, Any]:
    from qwen2om.checkpoint import read_json

    return read_json(Path(out) / MANIFEST, "qwen2om manifest")
