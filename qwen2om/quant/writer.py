"""Write a checkpoint directory tensor by tensor: shards flushed as they fill, an index at the end."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


class ShardWriter:
    """Tensors go to `model-NNNNN-of-MMMMM.safetensors` shards of about `shard_bytes` each."""

    def __init__(self, root: Path, shard_bytes: int = 1 << 30) -> None:
        self.root, self.shard_bytes = Path(root), shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.pending or any(name in s for s in self.shards):
            raise ValueError(f"tensor {name!r} written twice")
        self.pending[name] = t.contiguous()
        self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        n = len(self.shards) + 1
        save_file(self.pending, str(self.root / f"part-{n:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """Name the shards with their final count and write the index."""
        self.flush()
        count = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            (self.root / f"part-{i:05d}.safetensors").rename(self.root / final)
            weight_map |= {name: final for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
