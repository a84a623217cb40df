"""Write the graphs with one shared external-data file, each weight stored once.

The decode and prefill graphs hold the same weights; every initializer at or above
`inline_limit` bytes goes into `model.onnx.data` once (keyed by name and content hash) and both
graphs point at the same offset. Offsets are 4 KiB-aligned so runtimes can memory-map them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, ClassVar

import onnx
import onnx_ir as ir

from qwen2om.pipeline import PassResult, RunContext, Workspace, register

DATA_FILE = "model.onnx.data"
ALIGN = 4096


def graph_file(kind: str) -> str:
    return f"model.{kind}.onnx"


class SharedData:
    """Append-only external data file with content-addressed de-duplication."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.offset = fh, 0
        self.index: dict[tuple[str, str], tuple[int, int]] = {}
        self.by_name: dict[str, tuple[int, int]] = {}

    def append(self, name: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, int]:
        """Write the chunks back to back at the next aligned offset (no copies of the buffers)."""
        pad = -self.offset % ALIGN
        self.fh.write(b"\0" * pad)
        start = self.offset = self.offset + pad
        for chunk in chunks:
            self.fh.write(chunk)
            self.offset += len(chunk)
        self.by_name[name] = (start, self.offset - start)
        return self.by_name[name]

    def put(self, name: str, data: bytes) -> tuple[int, int, bool]:
        """Write exporter constants once per (name, content): graphs may reuse a name for other values."""
        key = (name, hashlib.sha256(data).hexdigest())
        if key in self.index:
            return (*self.index[key], False)
        self.index[key] = self.append(name, [data])
        return (*self.index[key], True)


@register
class WriteOnnx:
    """Save model.<kind>.onnx files and the shared model.onnx.data into the staging directory."""

    name: ClassVar[str] = "write_onnx"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "legal_graphs", "weights")
    produces: ClassVar[tuple[str, ...]] = ("onnx_files",)

    def __init__(self, inline_limit: int = 1024) -> None:
        self.inline_limit = inline_limit

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        stage: Path = ctx.stage_dir
        files: dict[str, Path] = {}
        stored = shared = 0
        weights, bindings = ws.need("weights")
        graphs = ws.need("graphs")
        total = sum(1 for m in graphs.values() for _ in m.graph.initializers)
        done = 0
        with open(stage / DATA_FILE, "wb") as fh:
            data = SharedData(fh)
            for kind, model in graphs.items():
                for init in model.graph.initializers.values():
                    done += 1
                    ctx.progress("writing weights", done, total)
                    tensor = init.const_value
                    if tensor is None and init.name in data.by_name:  # a weight the other graph wrote
                        offset, length = data.by_name[init.name]
                        init.const_value = ir.ExternalTensor(
                            DATA_FILE, offset, length, init.dtype, shape=init.shape, name=init.name, base_dir=stage)
                        shared += 1
                        continue
                    if tensor is None:  # a weight: read it from the checkpoint now, write it once
                        nbytes = init.dtype.itemsize * math.prod(init.shape.numpy())
                        if init.name in weights.constants or nbytes < self.inline_limit:
                            array = weights.value(bindings, init.name).numpy()
                            if nbytes < self.inline_limit:
                                init.const_value = ir.tensor(array, name=init.name)
                                continue
                            offset, length = data.append(init.name, [memoryview(array).cast("B")])
                        else:
                            chunks = (memoryview(b.numpy()).cast("B") for b in weights.blocks(bindings[init.name]))
                            offset, length = data.append(init.name, chunks)
                        stored += 1
                    elif tensor.nbytes < self.inline_limit:
                        continue
                    else:
                        offset, length, new = data.put(init.name, tensor.tobytes())
                        stored, shared = stored + new, shared + (not new)
                    init.const_value = ir.ExternalTensor(
                        DATA_FILE, offset, length, init.dtype, shape=init.shape, name=init.name, base_dir=stage)
                proto = ir.to_proto(model)
                path = stage / graph_file(kind)
                onnx.save_model(proto, path)
                files[kind] = path
        files["data"] = stage / DATA_FILE
        ws["onnx_files"] = files
        return PassResult(True, {"external_tensors": stored, "shared_between_graphs": shared,
                                 "data_bytes": data.offset})
