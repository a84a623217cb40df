"""Lazy, validated access to a Hugging Face checkpoint directory.

Tensors are read one at a time from memory-mapped safetensors shards (single file or sharded
with an index), so opening a checkpoint costs its headers, not its weights.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from qwen2om.arch import ArchSpec, ModelDims, expected_tensors, resolve_arch
from qwen2om.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file and the problem."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


class Checkpoint:
    """A checkpoint directory: config, architecture, and a lazy tensor table."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")
        self.config = read_json(self.root / "config.json", "config.json")
        self.arch: ArchSpec = resolve_arch(self.config, str(self.root / "config.json"))
        self.dims = ModelDims.from_config(self.config, str(self.root / "config.json"))
        self._handles: dict[Path, Any] = {}
        self._where = self._locate_tensors()

    # -- discovery -------------------------------------------------------------------------
    def _locate_tensors(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if index.exists():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no 'weight_map' in the index")
            where = {name: self.root / shard for name, shard in weight_map.items()}
            for shard in sorted(set(where.values())):
                if not shard.is_file():
                    raise CheckpointError(f"{index} names shard {shard.name}, which does not exist")
        else:
            single = self.root / SINGLE_FILE
            shards = [single] if single.is_file() else sorted(self.root.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.root}: no *.safetensors weights and no {INDEX_FILE}")
            where = {}
            for shard in shards:
                for name in self._open(shard).keys():
                    where[name] = shard
        # Open every shard now so a truncated or corrupt file fails before any work.
        for shard in sorted(set(where.values())):
            present = set(self._open(shard).keys())
            for name, path in where.items():
                if path == shard and name not in present:
                    raise CheckpointError(f"{shard}: the index says it holds {name!r}, but it does not")
        return where

    def _open(self, shard: Path) -> Any:
        if shard not in self._handles:
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{shard}: not a readable safetensors file ({e})") from None
        return self._handles[shard]

    @cached_property
    def files(self) -> list[Path]:
        """Every file the conversion reads (config, index, shards, tokenizer files present)."""
        found = {self.root / "config.json", *self._where.values()}
        for extra in (INDEX_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (self.root / extra).is_file():
                found.add(self.root / extra)
        return sorted(found)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        sl = self._open(self._shard(name)).get_slice(name)
        return tuple(int(x) for x in sl.get_shape())

    def _shard(self, name: str) -> Path:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: tensor {name!r} is missing from the checkpoint") from None

    # -- access ----------------------------------------------------------------------------
    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, converted to `dtype` (bf16 never leaves this method when a dtype is given)."""
        shard = self._shard(name)
        try:
            t = self._open(shard).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{shard}: cannot read tensor {name!r} ({e})") from None
        return t if dtype is None else t.to(dtype)

    def validate_layout(self) -> dict[str, tuple[int, ...]]:
        """Check every tensor the architecture needs is present with the config's shape."""
        want = expected_tensors(self.arch, self.dims)
        for name, shape in want.items():
            got = self.shape(name)
            if got != shape:
                raise CheckpointError(
                    f"{self._where[name]}: tensor {name!r} has shape {list(got)}, "
                    f"but config.json implies {list(shape)}"
                )
        return want

    def check_finite(self, name: str) -> None:
        """Raise naming the tensor if it holds NaN or Inf."""
        t = self.get(name)
        if not t.is_floating_point():
            return
        # Row blocks of ~16M elements: isfinite on a whole embedding makes large temporaries.
        flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
        rows = max(1, (1 << 24) // max(1, flat.shape[1]))
        bad = sum(int((~torch.isfinite(flat[i:i + rows])).sum()) for i in range(0, flat.shape[0], rows))
        if bad:
            raise CheckpointError(
                f"{self._where[name]}: tensor {name!r} has {bad} non-finite values (NaN/Inf) of {math.prod(t.shape)}"
            )

    def close(self) -> None:
        self._handles.clear()
