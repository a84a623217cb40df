"""A test double for CANN's pyACL (`import acl`): only the calls qwen2om's ACL backend makes.

No machine that runs these tests has CANN or an NPU. This fake stands in for pyACL so the backend's
bookkeeping can be checked end to end: device buffers, datasets, the KV cache appended device to
device, dynamic gears and teardown. It is not pyACL; it proves nothing about the real runtime.

- Device memory is numpy byte arrays behind fake pointers (ints from DEVICE_BASE, one STRIDE
  apart, so `ptr + offset` inside an allocation resolves). New allocations are filled with 0xFF
  bytes (NaN as float) as real device memory holds garbage. Host pointers are real addresses
  (numpy's `ctypes.data`), read and written with ctypes.
- An ".om" is a JSON file: `{"onnx": path of the ONNX graph it stands for, "gears": [T, ...]
  (optional: the token counts it was "compiled" for with --dynamic_dims), "gear_format":
  "dynamic" | "all" (which inputs' shapes a gear lists), "drop_inputs": [names]}`.
- `mdl.execute` reads the input buffers, runs the ONNX graph with onnxruntime and writes the
  outputs back. A gear t below the ONNX graph's static T is emulated by left-padding the call to T
  (pad rows attend only to themselves) and keeping the last t positions of the outputs; a graph
  with a symbolic T (`convert --gears`) runs at t itself.
- Return codes follow pyACL: 0, or `(value, ret)` pairs where pyACL returns them. Misuse (a copy
  out of bounds or with the wrong pointer kind, an unknown gear, a freed handle) returns
  ACL_ERROR_INVALID_PARAM; `leaks()` lists whatever was not released.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import types
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from qwen2om.kernels.ascend import cpu_runnable

DEVICE_BASE = 0xA000_0000_0000_0000
STRIDE = 1 << 36
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_REPEAT_INITIALIZE = 100002
H2D, D2H, D2D = 1, 2, 3
KINDS = {H2D: "h2d", D2H: "d2h", D2D: "d2d"}
DYNAMIC = "ascend_mbatch_shape_data"
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32}


class FakeModel:
    """A loaded fake .om: the ONNX session, its I/O at each gear, and the gears' dims lists."""

    def __init__(self, om: Path) -> None:
        spec = json.loads(om.read_text())
        onnx = Path(spec["onnx"]) if Path(spec["onnx"]).is_absolute() else om.parent / spec["onnx"]
        # An Ascend graph's NPU ops run as their reference kernels' decompositions, as ATC would run the
        # kernels themselves (the session holds the graph and the mapped data once built)
        with cpu_runnable(onnx.parent) as view:
            self.session = ort.InferenceSession(str(view / onnx.name), providers=["CPUExecutionProvider"])
        drop = set(spec.get("drop_inputs", ()))
        self.inputs = [(i.name, list(i.shape), ORT_DTYPES[i.type]) for i in self.session.get_inputs()
                       if i.name not in drop]
        self.outputs = [(o.name, list(o.shape), ORT_DTYPES[o.type]) for o in self.session.get_outputs()]
        shapes = {n: s for n, s, _ in self.inputs}
        self.gears: list[int] = sorted(spec.get("gears") or [])
        # A graph exported for gears (`convert --gears`) has a symbolic T: each gear runs as it is, the
        # way ATC compiles each gear on its own. A static graph is left-padded to its T.
        first = self.inputs[0][0]  # input_ids; hidden_in in a pipeline stage after the first
        self.symbolic = not isinstance(shapes[first][1], int)
        if self.symbolic:
            past = next(s for n, s, _ in self.inputs if n.startswith("past_key"))
            self.T, self.P = max(self.gears), past[2]
        else:
            self.T, self.P = shapes[first][1], shapes["attention_mask"][3] - shapes[first][1]
        listed = (first, "attention_mask", "position_ids") if spec.get("gear_format", "dynamic") == "dynamic" \
            else tuple(shapes)
        self.gear_dims = {t: [d for n, s, _ in self.inputs if n in listed for d in self.shape(n, s, t)]
                          for t in self.gears}

    def shape(self, name: str, shape: list[int], t: int) -> list[int]:
        b = shape[0]
        if name in ("input_ids", "position_ids"):
            return [b, t]
        if name in ("hidden_in", "hidden_out"):  # a pipeline stage's hidden states [B, T, hidden]
            return [b, t, shape[2]]
        if name == "attention_mask":
            return [b, 1, t, self.P + t]
        if name.startswith(("present_key", "present_value")):  # present_*_state: whole states, no T axis
            return [*shape[:2], t, shape[3]]
        if name == "logits" and shape[1] == self.T:
            return [b, t, shape[2]]
        return shape

    @property
    def top(self) -> int:
        return self.gears[-1] if self.gears else self.T

    def in_sizes(self) -> list[tuple[str, int]]:
        sizes = [(n, int(np.prod(self.shape(n, s, self.top))) * np.dtype(d).itemsize) for n, s, d in self.inputs]
        return sizes + ([(DYNAMIC, 8 * len(self.gear_dims[self.top]))] if self.gears else [])

    def out_sizes(self) -> list[int]:
        return [int(np.prod(self.shape(n, s, self.top))) * np.dtype(d).itemsize for n, s, d in self.outputs]

    def pad(self, feeds: dict[str, np.ndarray], t: int) -> None:
        """Left-pad a t-token call to the graph's static T, as the runtime's own chunks are padded."""
        k, p = self.T - t, self.P
        for name in ("input_ids", "hidden_in", "position_ids"):
            if name in feeds:
                v = feeds[name]
                feeds[name] = np.concatenate([np.zeros((v.shape[0], k, *v.shape[2:]), v.dtype), v], axis=1)
        m = feeds["attention_mask"]
        big = np.full((m.shape[0], 1, self.T, p + self.T), np.finfo(m.dtype).min, m.dtype)
        big[:, :, k:, :p] = m[:, :, :, :p]
        big[:, :, k:, p + k:] = m[:, :, :, p:]
        for i in range(k):
            big[:, :, i, p + i] = 0
        feeds["attention_mask"] = big


class FakeAcl(types.ModuleType):
    """`sys.modules["acl"] = FakeAcl()`; `calls` counts every call (memcpy by kind)."""

    def __init__(self) -> None:
        super().__init__("acl")
        self.memory: dict[int, np.ndarray] = {}
        self.data_buffers: dict[int, tuple[int, int]] = {}
        self.datasets: dict[int, list[int]] = {}
        self.models: dict[int, FakeModel] = {}
        self.descs: dict[int, int | None] = {}
        self.gear_of: dict[int, int] = {}
        self.contexts: set[int] = set()
        self.context_device: dict[int, int] = {}  # context → its device
        self.current: int | None = None  # the thread's current context
        self.devices: set[int] = set()
        self.initialized = False
        self.calls: Counter[str] = Counter()
        self._ids = itertools.count(1)
        self.rt = types.SimpleNamespace(
            set_device=self._set_device, reset_device=self._reset_device, create_context=self._create_context,
            destroy_context=self._destroy_context, malloc=self._malloc, free=self._free, memcpy=self._memcpy,
            memset=self._memset, set_context=self._set_context)
        self.mdl = types.SimpleNamespace(
            load_from_file=self._load, unload=self._unload, create_desc=self._create_desc, get_desc=self._get_desc,
            destroy_desc=self._destroy_desc, get_num_inputs=lambda d: len(self._model(d).in_sizes()),
            get_num_outputs=lambda d: len(self._model(d).outputs),
            get_input_name_by_index=lambda d, i: self._model(d).in_sizes()[i][0],
            get_input_size_by_index=lambda d, i: self._model(d).in_sizes()[i][1],
            get_output_size_by_index=lambda d, i: self._model(d).out_sizes()[i],
            get_input_index_by_name=self._index_by_name, get_input_dynamic_gear_count=self._gear_count,
            get_input_dynamic_dims=self._dynamic_dims, set_input_dynamic_dims=self._set_dynamic_dims,
            create_dataset=self._create_dataset, add_dataset_buffer=self._add_dataset_buffer,
            destroy_dataset=self._destroy_dataset, execute=self._execute)

    # -- bookkeeping ------------------------------------------------------------------------
    def leaks(self) -> list[str]:
        left = [(what, len(d)) for what, d in (("device allocations", self.memory), ("data buffers", self.data_buffers),
                                               ("datasets", self.datasets), ("models", self.models),
                                               ("model descs", self.descs), ("contexts", self.contexts),
                                               ("devices", self.devices)) if d]
        return [f"{n} {what}" for what, n in left] + (["acl not finalized"] if self.initialized else [])

    def _new(self) -> int:
        return next(self._ids)

    def _device(self, ptr: int, count: int) -> np.ndarray | None:
        """The `count` device bytes at `ptr`, or None if that is not inside one allocation."""
        if ptr < DEVICE_BASE:
            return None
        base = DEVICE_BASE + (ptr - DEVICE_BASE) // STRIDE * STRIDE
        mem = self.memory.get(base)
        off = ptr - base
        return None if mem is None or off + count > mem.size else mem[off:off + count]

    def _model(self, desc: int) -> FakeModel:
        return self.models[self.descs[desc]]  # type: ignore[index]

    # -- acl / acl.rt -----------------------------------------------------------------------
    def init(self) -> int:
        self.calls["init"] += 1
        if self.initialized:
            return ACL_ERROR_REPEAT_INITIALIZE
        self.initialized = True
        return 0

    def finalize(self) -> int:
        self.initialized = False
        return 0

    def _set_device(self, device: int) -> int:
        self.devices.add(device)
        return 0

    def _reset_device(self, device: int) -> int:
        self.devices.discard(device)
        return 0

    def _create_context(self, device: int) -> tuple[int, int]:
        ctx = self._new()
        self.contexts.add(ctx)
        self.context_device[ctx] = device
        self.current = ctx  # pyACL: a new context becomes the thread's current one
        return ctx, 0 if device in self.devices else ACL_ERROR_INVALID_PARAM

    def _set_context(self, ctx: int) -> int:
        self.calls["set_context"] += 1
        if ctx not in self.contexts:
            return ACL_ERROR_INVALID_PARAM
        self.current = ctx
        return 0

    def _destroy_context(self, ctx: int) -> int:
        self.contexts.discard(ctx)
        return 0

    def _malloc(self, size: int, policy: int) -> tuple[int, int]:
        if not self.devices or size <= 0 or size > STRIDE:
            return 0, ACL_ERROR_INVALID_PARAM
        ptr = DEVICE_BASE + self._new() * STRIDE
        self.memory[ptr] = np.full(size, 0xFF, dtype=np.uint8)
        return ptr, 0

    def _free(self, ptr: int) -> int:
        return 0 if self.memory.pop(ptr, None) is not None else ACL_ERROR_INVALID_PARAM

    def _memset(self, ptr: int, max_size: int, value: int, count: int) -> int:
        dst = self._device(ptr, count)
        if dst is None or count > max_size:
            return ACL_ERROR_INVALID_PARAM
        dst[:] = value
        return 0

    def _memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        self.calls[f"memcpy.{KINDS.get(kind, kind)}"] += 1
        if count > dst_max:
            return ACL_ERROR_INVALID_PARAM
        if kind == H2D:
            to = self._device(dst, count)
            if to is None or src >= DEVICE_BASE:
                return ACL_ERROR_INVALID_PARAM
            ctypes.memmove(to.ctypes.data, src, count)
        elif kind == D2H:
            frm = self._device(src, count)
            if frm is None or dst >= DEVICE_BASE:
                return ACL_ERROR_INVALID_PARAM
            ctypes.memmove(dst, frm.ctypes.data, count)
        elif kind == D2D:
            to, frm = self._device(dst, count), self._device(src, count)
            if to is None or frm is None:
                return ACL_ERROR_INVALID_PARAM
            to[:] = frm.copy()
        else:
            return ACL_ERROR_INVALID_PARAM
        return 0

    def create_data_buffer(self, ptr: int, size: int) -> int:
        h = self._new()
        self.data_buffers[h] = (ptr, size)
        return h

    def destroy_data_buffer(self, h: int) -> int:
        return 0 if self.data_buffers.pop(h, None) is not None else ACL_ERROR_INVALID_PARAM

    # -- acl.mdl ----------------------------------------------------------------------------
    def _load(self, path: str) -> tuple[int, int]:
        if not self.devices:
            return 0, ACL_ERROR_INVALID_PARAM
        model_id = self._new()
        self.models[model_id] = FakeModel(Path(path))
        return model_id, 0

    def _unload(self, model_id: int) -> int:
        return 0 if self.models.pop(model_id, None) is not None else ACL_ERROR_INVALID_PARAM

    def _create_desc(self) -> int:
        desc = self._new()
        self.descs[desc] = None
        return desc

    def _get_desc(self, desc: int, model_id: int) -> int:
        if desc not in self.descs or model_id not in self.models:
            return ACL_ERROR_INVALID_PARAM
        self.descs[desc] = model_id
        return 0

    def _destroy_desc(self, desc: int) -> int:
        if desc not in self.descs:
            return ACL_ERROR_INVALID_PARAM
        del self.descs[desc]
        return 0

    def _index_by_name(self, desc: int, name: str) -> tuple[int, int]:
        names = [n for n, _ in self._model(desc).in_sizes()]
        return (names.index(name), 0) if name in names else (0, ACL_ERROR_INVALID_PARAM)

    def _gear_count(self, desc: int, index: int) -> tuple[int, int]:
        return len(self._model(desc).gears), 0

    def _dynamic_dims(self, desc: int, index: int, count: int) -> tuple[list[dict[str, Any]], int]:
        m = self._model(desc)
        if count != len(m.gears):
            return [], ACL_ERROR_INVALID_PARAM
        return [{"name": "", "dimCount": len(m.gear_dims[t]), "dims": list(m.gear_dims[t])} for t in m.gears], 0

    def _set_dynamic_dims(self, model_id: int, dataset: int, index: int, dims: dict[str, Any]) -> int:
        m = self.models[model_id]
        if index != len(m.inputs) or not m.gears:
            return ACL_ERROR_INVALID_PARAM
        found = [t for t in m.gears if m.gear_dims[t] == list(dims["dims"][:dims["dimCount"]])]
        if not found:
            return ACL_ERROR_INVALID_PARAM
        self.gear_of[dataset] = found[0]
        return 0

    def _create_dataset(self) -> int:
        ds = self._new()
        self.datasets[ds] = []
        return ds

    def _add_dataset_buffer(self, ds: int, buf: int) -> tuple[int, int]:
        if ds not in self.datasets or buf not in self.data_buffers:
            return ds, ACL_ERROR_INVALID_PARAM
        self.datasets[ds].append(buf)
        return ds, 0

    def _destroy_dataset(self, ds: int) -> int:
        return 0 if self.datasets.pop(ds, None) is not None else ACL_ERROR_INVALID_PARAM

    def _execute(self, model_id: int, inputs: int, outputs: int) -> int:
        self.calls["execute"] += 1
        self.calls[f"execute on device {self.context_device.get(self.current)}"] += 1
        m = self.models.get(model_id)
        if m is None or len(self.datasets.get(inputs, ())) != len(m.in_sizes()) \
                or len(self.datasets.get(outputs, ())) != len(m.outputs):
            return ACL_ERROR_INVALID_PARAM
        t = self.gear_of.get(inputs) if m.gears else m.T
        if t is None:  # a dynamic-dims model run without acl.mdl.set_input_dynamic_dims
            return ACL_ERROR_INVALID_PARAM
        feeds = {}
        for (name, shape, dtype), buf in zip(m.inputs, self.datasets[inputs], strict=False):
            s = m.shape(name, shape, t)
            ptr, size = self.data_buffers[buf]
            raw = self._device(ptr, int(np.prod(s)) * np.dtype(dtype).itemsize)
            if raw is None:
                return ACL_ERROR_INVALID_PARAM
            feeds[name] = raw.view(dtype).reshape(s).copy()
        if t < m.T and not m.symbolic:
            m.pad(feeds, t)
        results = m.session.run(None, feeds)
        for (name, shape, dtype), value, buf in zip(m.outputs, results, self.datasets[outputs], strict=True):
            s = m.shape(name, shape, t)
            if t < m.T and s != list(value.shape):
                value = value[:, :, -t:] if name.startswith("present_") else value[:, -t:]
            raw = np.ascontiguousarray(value, dtype=dtype).view(np.uint8).reshape(-1)
            ptr, size = self.data_buffers[buf]
            out = self._device(ptr, raw.size)
            if out is None or raw.size > size:
                return ACL_ERROR_INVALID_PARAM
            out[:] = raw
        return 0
