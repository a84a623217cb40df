"""Write the graphs with one shared external-data file, each weight stored once.

The decode and prefill graphs hold the same weights. The layout of `model.onnx.data` is planned
before a byte is written: every initializer at or above `inline_limit` bytes gets a 4 KiB-aligned
region (runtimes can memory-map them), weights keyed by name so both graphs share them,
exporter constants by name and content. Because every region's place is known up front:

- the file is allocated whole first, so a full disk fails at once, not an hour in;
- tensors are converted and written by `workers` threads in any order (positioned writes),
  and the bytes are the same whatever the order: output is deterministic;
- finished tensors are recorded in the journal (after the data is synced) with their sha256,
  so `--resume` re-checks and skips them and writes only the rest.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import onnx
import onnx_ir as ir

from qwen2om.output import graph_file
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.weights import WeightRef, Weights

DATA_FILE = "model.onnx.data"
ALIGN = 4096
SYNC_BYTES = 256 << 20  # journal at least this often (and at every finished layer)
LAYER = re.compile(r"\blayers\.(\d+)\.")


@dataclasses.dataclass
class Region:
    """One tensor's bytes in the data file: a checkpoint weight (`ref`) or known bytes (`data`)."""

    key: str
    offset: int
    length: int
    ref: WeightRef | None = None
    data: bytes | None = None
    layer: int | None = None


class Layout:
    """Regions in order of first use; the same graphs always give the same layout."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}
        self.end = 0

    def add(self, key: str, length: int, **kw: Any) -> Region:
        if key not in self.regions:
            start = self.end + (-self.end % ALIGN)
            m = LAYER.search(key)
            self.regions[key] = Region(key, start, length, layer=int(m.group(1)) if m else None, **kw)
            self.end = start + length
        return self.regions[key]

    def fingerprint(self) -> str:
        spans = [(r.key, r.offset, r.length) for r in self.regions.values()]
        return hashlib.sha256(json.dumps(spans).encode()).hexdigest()


def plan(graphs: dict[str, ir.Model], weights: Weights, bindings: dict[str, WeightRef],
         inline_limit: int) -> tuple[Layout, dict[tuple[str, str], str]]:
    """Every large initializer's region; small ones are made inline tensors here."""
    layout, where = Layout(), {}
    for kind, model in graphs.items():
        for init in model.graph.initializers.values():
            tensor = init.const_value
            if tensor is None and init.name not in weights.constants:  # a checkpoint weight
                nbytes = int(init.dtype.itemsize * math.prod(init.shape.numpy()))
                if nbytes < inline_limit:
                    value = weights.value(bindings, init.name).numpy()
                    if init.dtype == ir.DataType.FLOAT8E4M3FN:  # produced as its bytes (numpy has no fp8)
                        value = value.view(ml_dtypes.float8_e4m3fn)
                    init.const_value = ir.tensor(value, name=init.name)
                    continue
                where[(kind, init.name)] = layout.add(init.name, nbytes, ref=bindings[init.name]).key
                continue
            if tensor is None:  # a computed constant (RoPE tables)
                tensor = ir.tensor(weights.value(bindings, init.name).numpy(), name=init.name)
                if tensor.nbytes < inline_limit:
                    init.const_value = tensor
                    continue
            if tensor.nbytes < inline_limit:
                continue
            data = tensor.tobytes()
            key = f"{init.name}#{hashlib.sha256(data).hexdigest()[:16]}"  # a name may be reused for other values
            where[(kind, init.name)] = layout.add(key, len(data), data=data).key
    return layout, where


class DataWriter:
    """Positioned writes into the preallocated data file; one instance, many threads."""

    def __init__(self, path: Path, size: int, weights: Weights) -> None:
        self.path, self.weights = path, weights
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        self.written = 0
        self._lock = threading.Lock()
        if os.fstat(self.fd).st_size > size:
            os.ftruncate(self.fd, size)
        try:
            os.posix_fallocate(self.fd, 0, size)  # reserve the space: ENOSPC now rather than mid-way
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise OSError(e.errno, e.strerror, str(path)) from None
            os.ftruncate(self.fd, size)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            try:
                done += os.pwrite(self.fd, buf[done:], offset + done)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(self.path)) from None
        with self._lock:
            self.written += len(buf)

    def write(self, r: Region) -> str:
        """Write one region; its sha256 as it lies on disk."""
        if r.data is not None:
            self.pwrite(memoryview(r.data), r.offset)
            return hashlib.sha256(r.data).hexdigest()
        assert r.ref is not None
        h, strided = hashlib.sha256(), False
        shape = self.weights.shapes.get(r.ref.source, ())  # derived tensors are written whole
        width = shape[0] if shape else 1  # the output's row length when transposed
        for axis, start, piece in self.weights.pieces(r.ref):
            raw = memoryview(piece.numpy()).cast("B")
            if axis == 0:  # rows of the output; `start` > 0 only for untransposed row blocks
                self.pwrite(raw, r.offset + start * (r.length // width))
                h.update(raw)
                continue
            strided = True  # columns of a transposed weight: one positioned write per output row
            itemsize, n = piece.element_size(), piece.shape[1]
            for i in range(piece.shape[0]):
                self.pwrite(raw[i * n * itemsize:(i + 1) * n * itemsize], r.offset + (i * width + start) * itemsize)
        return self.digest(r) if strided else h.hexdigest()

    def digest(self, r: Region, block: int = 16 << 20) -> str:
        """sha256 of the region as it lies on disk (what --resume compares)."""
        h = hashlib.sha256()
        buf = bytearray(min(block, max(1, r.length)))
        view, pos = memoryview(buf), 0
        while pos < r.length:
            n = os.preadv(self.fd, [view[:min(block, r.length - pos)]], r.offset + pos)
            if n <= 0:
                return ""
            h.update(view[:n])
            pos += n
        return h.hexdigest()

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def run_bounded(pool: ThreadPoolExecutor, jobs: list[Region], fn: Callable[[Region], str], limit: int,
                on_done: Callable[[Region, str], None]) -> None:
    """`fn` over `jobs` with at most `limit` in flight (bounds memory), results handed over in the
    calling thread; the first failure cancels the rest and is raised."""
    pending: dict[Future[str], Region] = {}
    queue = iter(jobs)
    try:
        while True:
            while len(pending) < limit and (r := next(queue, None)) is not None:
                pending[pool.submit(fn, r)] = r
            if not pending:
                return
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in sorted(finished, key=lambda f: pending[f].offset):
                on_done(pending.pop(f), f.result())
    finally:
        for f in pending:
            f.cancel()
        wait(pending)


@register
class WriteOnnx:
    """Save model.<kind>.onnx files and the shared model.onnx.data into the staging directory."""

    name: ClassVar[str] = "write_onnx"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "weights", "bindings")
    produces: ClassVar[tuple[str, ...]] = ("onnx_files",)
    freezes: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")

    def __init__(self, inline_limit: int = 1024) -> None:
        self.inline_limit = inline_limit

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        stage: Path = ctx.stage_dir
        weights, bindings = state.weights, state.bindings
        graphs: dict[str, ir.Model] = state.graphs
        layout, where = plan(graphs, weights, bindings, self.inline_limit)
        fingerprint = layout.fingerprint()
        writer = DataWriter(stage / DATA_FILE, layout.end, weights)
        try:
            reused = self.write_all(writer, layout, fingerprint, ctx)
            writer.sync()
        finally:
            writer.close()
        files: dict[str, Path] = {}
        for kind, model in graphs.items():
            for init in model.graph.initializers.values():
                if (kind, init.name) in where:
                    r = layout.regions[where[(kind, init.name)]]
                    init.const_value = ir.ExternalTensor(
                        DATA_FILE, r.offset, r.length, init.dtype, shape=init.shape, name=init.name, base_dir=stage)
            files[kind] = stage / graph_file(kind)
            onnx.save_model(ir.to_proto(model), files[kind])
        files["data"] = stage / DATA_FILE
        state.onnx_files = files
        shared = len(where) - len(layout.regions)  # initializers that point at a region another wrote
        if reused:
            ctx.log(f"resumed: {reused} of {len(layout.regions)} tensors were already written, re-hashed and kept")
        # Stats go in the manifest, so only what the same inputs always give (not `reused`).
        return PassResult(True, {"external_tensors": len(layout.regions), "shared_between_graphs": shared,
                                 "data_bytes": layout.end})

    def write_all(self, writer: DataWriter, layout: Layout, fingerprint: str, ctx: RunContext) -> int:
        """Write every region not already on disk; returns how many were reused from a resumed run."""
        regions = list(layout.regions.values())
        done = ctx.journal.data_done(fingerprint)
        per_layer = Counter(r.layer for r in regions if r.layer is not None)
        layers_total = len(per_layer)
        limit = max(1, ctx.workers) * 2  # tensors in flight: bounds memory whatever the model size
        with ThreadPoolExecutor(max(1, ctx.workers)) as pool:
            # What the journal says is written is re-read and compared before it is trusted.
            claimed = [r for r in regions if r.key in done]
            intact: dict[str, str] = {}
            run_bounded(pool, claimed, writer.digest, limit,
                        lambda r, sha: intact.update({r.key: sha}) if sha == done[r.key] else None)
            ctx.journal.mark_data(fingerprint, intact)
            todo = [r for r in regions if r.key not in intact]
            total = sum(r.length for r in regions)
            bytes_done = total - sum(r.length for r in todo)
            for r in regions:
                if r.key in intact and r.layer is not None:
                    per_layer[r.layer] -= 1
            unsynced = 0

            def progress() -> None:
                finished = sum(1 for n in per_layer.values() if n == 0)
                ctx.progress("writing layers", finished, layers_total)
                ctx.progress("writing weights", bytes_done, total, unit="bytes")

            def finished(r: Region, sha: str) -> None:
                nonlocal bytes_done, unsynced
                intact[r.key] = sha
                bytes_done, unsynced = bytes_done + r.length, unsynced + r.length
                layer_complete = False
                if r.layer is not None:
                    per_layer[r.layer] -= 1
                    layer_complete = per_layer[r.layer] == 0
                if layer_complete or unsynced >= SYNC_BYTES:
                    writer.sync()  # the journal never claims bytes that are not on disk
                    ctx.journal.mark_data(fingerprint, intact)
                    unsynced = 0
                progress()

            progress()
            run_bounded(pool, todo, writer.write, limit, finished)
        writer.sync()
        ctx.journal.mark_data(fingerprint, intact)
        return len(regions) - len(todo)

