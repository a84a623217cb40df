"""Read safetensors shards with positioned reads instead of memory maps.

safetensors' own reader memory-maps each shard; every page a conversion touches then counts in
the process's resident set until the handle closes, so RSS grows to the size of the model.
Reading with `pread` into buffers we own keeps resident memory to the tensors in hand.
The format (8-byte little-endian header length, JSON header, raw little-endian data) is small
enough to parse here, and doing so lets a corrupt header be reported with the exact problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import torch

from qwen2om.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors itself refuses larger headers


class DuplicateKey(ValueError):
    """A JSON object names `key` twice; `json.loads` alone would keep the last silently."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def strict_json(text: str | bytes) -> Any:
    """`json.loads` refusing duplicate keys (DuplicateKey). Which of two `k_proj` entries is the real
    one is a guess the safetensors library refuses to make, and so do we. Callers also catch
    RecursionError: a 200k-deep `[[[...` exhausts the decoder's recursion limit."""
    return json.loads(text, object_pairs_hook=_unique)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first dimension (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class Shard:
    """One .safetensors file: its parsed header and positioned reads of its tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._lock = threading.Lock()
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):  # a FIFO would block open() forever; refuse before opening
                raise self._bad("not a regular file (a FIFO, device or directory)")
            size = st.st_size
            with open(self.path, "rb") as fh:
                raw = fh.read(8)
                if len(raw) < 8:
                    raise self._bad(f"{size} bytes is too short for a safetensors header")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER or 8 + n > size:
                    raise self._bad(f"header length {n} does not fit the file ({size} bytes)")
                self.header = fh.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None
        self.size, self.data_start = size, 8 + n
        try:
            table = strict_json(self.header)
        except DuplicateKey as e:
            raise self._bad(f"the header names {e.key!r} twice") from None
        except RecursionError:
            raise self._bad("header nests too deeply to be a tensor table") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not valid JSON ({e})") from None
        if not isinstance(table, dict):
            raise self._bad("header is not a JSON object")
        table.pop("__metadata__", None)
        self.tensors = {name: self._entry(name, spec) for name, spec in table.items()}
        self._check_tiling()

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file: {why}")

    def _entry(self, name: str, spec: Any) -> TensorInfo:
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(x) for x in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except KeyError as e:
            if isinstance(spec, dict) and "dtype" in spec and spec["dtype"] not in DTYPES:
                raise self._bad(f"tensor {name!r} has unsupported dtype {spec['dtype']!r}") from None
            raise self._bad(f"tensor {name!r} has no {e}") from None
        except (TypeError, ValueError):
            raise self._bad(f"tensor {name!r} has a malformed entry {spec!r}") from None
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want or begin < 0:
            raise self._bad(f"tensor {name!r} spans {end - begin} bytes, but {spec['dtype']}{list(shape)} "
                            f"needs {want}")
        if self.data_start + end > self.size:
            raise self._bad(f"tensor {name!r} ends at byte {self.data_start + end}, past the end of the file "
                            f"({self.size} bytes): truncated?")
        return TensorInfo(name, dtype, shape, self.data_start + begin, self.data_start + end)

    def _check_tiling(self) -> None:
        """The tensors, in offset order, tile the data area exactly, as the safetensors library requires:
        an overlap lets one name read another's bytes (k_proj pointing at v_proj's), and a gap or
        trailing bytes hold data no tensor accounts for."""
        pos, prev = self.data_start, None
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin < pos:
                assert prev is not None  # nothing starts before the data area (begin >= 0 in _entry)
                raise self._bad(f"tensors {prev.name!r} and {info.name!r} overlap (both hold data bytes "
                                f"{info.begin - self.data_start}–{min(pos, info.end) - self.data_start})")
            if info.begin > pos:
                after = f"between {prev.name!r} and" if prev else "before"
                raise self._bad(f"{info.begin - pos} bytes {after} {info.name!r} belong to no tensor "
                                "(safetensors data must be contiguous)")
            pos, prev = info.end, info
        if pos < self.size and prev is None:
            raise self._bad(f"{self.size - pos} bytes of data, but the header lists no tensor")
        if pos < self.size:
            raise self._bad(f"{self.size - pos} bytes after the last tensor {prev.name!r} belong to no tensor "
                            "(safetensors data must end with the last tensor)")

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def read_bytes(self, offset: int, n: int) -> bytearray:
        buf = bytearray(n)
        view, done = memoryview(buf), 0
        fd = self.fd()
        while done < n:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += got
        return buf

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or rows [r0, r1) of its first dimension, in a buffer of its own."""
        info = self.tensors[name]
        r0, r1 = rows if rows is not None else (0, info.shape[0] if info.shape else 1)
        shape = (r1 - r0, *info.shape[1:]) if info.shape else ()
        n = (r1 - r0) * info.row_bytes
        if n == 0:
            return torch.empty(shape, dtype=info.dtype)
        buf = self.read_bytes(info.begin + r0 * info.row_bytes, n)
        return torch.frombuffer(buf, dtype=info.dtype).reshape(shape)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def opened(shards: dict[Any, Shard], path: Any) -> Shard:
    """`path`'s Shard from `shards`, parsing its header only the first time (a checkpoint's quantisation
    metadata looks one up per weight: 31k weights of a published FP8 model)."""
    if path not in shards:
        shards[path] = Shard(path)
    return shards[path]
