"""Write a checkpoint directory tensor by tensor, streamed: each tensor's bytes go to its shard file
as it is added, so memory holds no more than the tensor being written, whatever the checkpoint's size.

A safetensors file starts with its header (names, dtypes, shapes, offsets), which is only known once
the shard is complete. Each shard therefore reserves `header_bytes` up front, and the header is
written into that space when the shard closes, padded with spaces (the format allows trailing
whitespace); a shard is closed early when the next entry would not fit in it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

if TYPE_CHECKING:
    from qwen2om.checkpoint import Checkpoint

INDEX = "model.safetensors.index.json"
COPY_BLOCK = 64 << 20  # bytes of a tensor copied at a time
HEADER_BYTES = 1 << 20  # ~6,000 tensor entries; a shard whose header fills up closes early
METADATA = {"__metadata__": {"format": "pt"}}
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


class ShardWriter:
    """Tensors go to `model-NNNNN-of-MMMMM.safetensors` shards of at most about `shard_bytes` each."""

    def __init__(self, root: Path, shard_bytes: int = 1 << 30, header_bytes: int = HEADER_BYTES,
                 rename: Callable[[str], str] = str) -> None:
        if header_bytes % 8:
            raise ValueError(f"header_bytes {header_bytes} is not a multiple of 8 (safetensors aligns its data)")
        self.root, self.shard_bytes, self.header_bytes = Path(root), shard_bytes, header_bytes
        self.rename = rename  # the name a tensor is stored under (`shards` keeps the names given)
        self.shards: list[list[str]] = []  # the names in each closed shard, in order
        self.total = 0
        self._names: set[str] = set()
        self._file: BinaryIO | None = None
        self._entries: dict[str, dict[str, object]] = {}
        self._data = 0  # bytes of tensor data in the open shard
        self._header = len(_json(METADATA))  # bytes its header would take now

    def add(self, name: str, t: torch.Tensor) -> None:
        self.add_chunks(name, t.dtype, tuple(t.shape), [t])

    def add_chunks(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                   chunks: Iterable[torch.Tensor]) -> None:
        """Tensor `name` of `dtype` and `shape`, whose row-major bytes are `chunks` in order (e.g. row
        blocks read one at a time, so a large embedding never sits in memory whole)."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = math.prod(shape) * dtype.itemsize
        entry = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [0, size]}
        cost = len(_json({self.rename(name): entry})) + 16  # room for the real offsets' digits
        if len(_json(METADATA)) + cost > self.header_bytes:
            raise ValueError(f"tensor {name!r}: its header entry does not fit {self.header_bytes} bytes")
        if self._file is not None and (self._data + size > self.shard_bytes
                                       or self._header + cost > self.header_bytes):
            self.flush()
        if self._file is None:
            self._file = open(self.root / f"part-{len(self.shards) + 1:05d}.safetensors", "wb")  # noqa: SIM115
            self._file.seek(8 + self.header_bytes)
        start, written = self._file.tell(), 0
        try:
            for chunk in chunks:
                if chunk.dtype != dtype:
                    raise ValueError(f"tensor {name!r}: a {chunk.dtype} chunk in a {dtype} tensor")
                chunk = chunk.detach().contiguous()
                if chunk.numel():
                    self._file.write(memoryview(chunk.reshape(-1).view(torch.uint8).numpy()))
                written += chunk.numel() * dtype.itemsize
            if written != size:
                raise ValueError(f"tensor {name!r}: {written} bytes for {DTYPES[dtype]}{list(shape)} ({size})")
        except BaseException:  # the shard stays as it was before this tensor
            self._file.seek(start)
            self._file.truncate()
            raise
        entry["data_offsets"] = [self._data, self._data + size]
        self._entries[name] = entry
        self._names.add(name)
        self._data += size
        self._header += len(_json({self.rename(name): entry}))  # as it appears in the header, with its comma

    def flush(self) -> None:
        """Close the open shard: its header, padded to the reserved space, goes in front of its data."""
        if self._file is None:
            return
        header = _json({**METADATA, **{self.rename(n): e for n, e in self._entries.items()}}).encode()
        assert len(header) <= self.header_bytes, "add_chunks keeps the header inside its reserved space"
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.header_bytes) + header + b" " * (self.header_bytes - len(header)))
        self._file.close()
        self.shards.append(list(self._entries))
        self.total += self._data
        self._file, self._entries, self._data, self._header = None, {}, 0, len(_json(METADATA))

    def close(self) -> None:
        """Name the shards with their final count and write the index."""
        self.flush()
        count = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            (self.root / f"part-{i:05d}.safetensors").rename(self.root / final)
            weight_map |= {self.rename(name): final for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_tensor(writer: ShardWriter, ckpt: Checkpoint, name: str) -> None:
    """Tensor `name` of `ckpt` as stored, read and written in blocks of rows (an embedding can be
    gigabytes)."""
    info = ckpt.info(name)
    rows = info.shape[0] if info.shape else 1
    step = max(1, COPY_BLOCK // max(1, math.prod(info.shape[1:]) * info.dtype.itemsize))
    blocks = ((r, min(rows, r + step)) for r in range(0, rows, step))
    writer.add_chunks(name, info.dtype, tuple(info.shape),
                      (ckpt.raw(name, block if info.shape else None) for block in blocks))
