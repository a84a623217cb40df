"""`python -m qwen2om …` run from the repository root puts the root first on sys.path. There the top-level
folders that install as qwen2om.kernels / .passes / .fixtures / .recipes are importable under their bare
names and shadow installed packages of the same name: Hugging Face's `kernels`, which transformers imports
while it builds a model, fails with "cannot import name 'CUDAProperties' from 'kernels'". qwen2om never
imports those folders bare (ruff bans it), so its `-m` entry points drop the root before doing anything."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def is_source_root(entry: str) -> bool:
    """Whether a sys.path entry ("" is the working directory) is this checkout's root. An installed wheel
    has no pyproject.toml beside the package, so site-packages never matches."""
    try:
        here = Path(entry or os.getcwd()).resolve()
    except OSError:  # a working directory that was deleted, say
        return False
    return here == ROOT and (ROOT / "pyproject.toml").is_file() and (ROOT / "kernels" / "npu_norm.py").is_file()


def leave_source_root() -> None:
    """Drop the checkout's root from sys.path. qwen2om is imported by now; its submodules resolve through
    the package's own path and the install's finder, not through sys.path."""
    sys.path[:] = [p for p in sys.path if not is_source_root(p)]
