"""Helpers for bad-input tests: damage a private copy of a checkpoint, then expect a clean failure."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][tensor]


def edit_tensor(ckpt: Path, tensor: str, change: Callable[[torch.Tensor], torch.Tensor | None], *,
                unindex: bool = False) -> None:
    """Replace `tensor` by `change(tensor)` in its shard; None deletes it (and, with `unindex`, its
    index entry too, so the checkpoint is consistent but lacks it)."""
    path = shard_of(ckpt, tensor)
    tensors = load_file(path)
    new = change(tensors[tensor])
    if new is None:
        del tensors[tensor]
        if unindex:
            index = json.loads((ckpt / INDEX).read_text())
            del index["weight_map"][tensor]
            (ckpt / INDEX).write_text(json.dumps(index))
    else:
        tensors[tensor] = new
    save_file(tensors, path, metadata={"format": "pt"})


def convert_fails(cli: Callable[..., tuple[int, str, str]], ckpt: Path, tmp_path: Path, *needles: str) -> str:
    """`qwen2om convert` exits non-zero without a traceback, naming every needle (line breaks of the
    terminal ignored), and leaves neither OUT nor a partial output behind."""
    out = tmp_path / "out"
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64", "--prefill-chunk", "16")
    assert code != 0
    assert "Traceback" not in err
    flat = " ".join(err.split())
    for needle in needles:
        assert needle in err or needle in flat, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "partial output left behind"
    return err
