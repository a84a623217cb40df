"""Small hand-built states for the unit lane: build an onnx_ir graph, drive one pass, run it in ONNX Runtime.

Each `tests/test_pass_*.py` builds the few nodes its pass rewrites (named as the exporter names them),
runs the pass on a ConvertState holding them, and compares ONNX Runtime's numbers before and after.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

from qwen2om.pipeline import RunContext
from qwen2om.recipe import Recipe, bundled_recipes, load_recipe
from qwen2om.weights import WeightRef, Weights

F32 = ir.DataType.FLOAT


def recipe(**changes: Any) -> Recipe:
    """The bundled ORT recipe (or, while recipes are being renamed, any bundled one), with `changes`."""
    try:
        base = load_recipe("ort")
    except Exception:  # noqa: BLE001 - a renamed recipe: any bundled one carries the fields a pass reads
        base = load_recipe(bundled_recipes()[0])
    return dataclasses.replace(base, target="ort", **changes)


def context(tmp_path: Path, **changes: Any) -> RunContext:
    return RunContext(recipe=recipe(**changes), stage_dir=tmp_path, source=tmp_path, tool_version="test")


def value(name: str, shape: Sequence[int | str], dtype: ir.DataType = F32) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype))


def constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """An initializer that holds its value (an exported weight, a shape); shared by name."""
    if name in graph.initializers:
        return graph.initializers[name]
    v = value(name, array.shape, ir.DataType.from_numpy(array.dtype))
    v.const_value = ir.tensor(array, name=name)
    graph.register_initializer(v)
    return v


def add(graph: ir.Graph, op: str, inputs: Sequence[ir.Value | None], name: str, *,
        domain: str = "", attrs: Sequence[ir.Attr] = (), out: str | None = None,
        shape: ir.Shape | Sequence[int | str] | None = None, dtype: ir.DataType | None = F32) -> ir.Value:
    """Append one single-output node named `name`; its output is `out` (default `name` + `_out`)."""
    node = ir.Node(domain, op, list(inputs), list(attrs), num_outputs=1, name=name)
    node.outputs[0].name = out or f"{name}_out"
    if shape is not None:
        node.outputs[0].shape, node.outputs[0].type = ir.Shape(list(shape)), ir.TensorType(dtype or F32)
    graph.append(node)
    return node.outputs[0]


def op_counts(model: ir.Model) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph)


def lazy_weights(dtype: torch.dtype = torch.float32) -> Weights:
    """A lazy Weights whose checkpoint reads are never made (every initializer here holds its value
    or is derived by the pass)."""
    def unread(name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise AssertionError(f"the pass read {name!r} from the checkpoint")
    return Weights(unread, {}, dtype, lazy=True)


def materialize(model: ir.Model, weights: Weights, bindings: dict[str, WeightRef]) -> None:
    """Give each initializer a pass left to write_onnx (const_value None) its value, as write_onnx does."""
    for name, init in model.graph.initializers.items():
        if init.const_value is None:
            array = weights.value(bindings, name).numpy()
            if init.dtype == ir.DataType.FLOAT8E4M3FN:  # produced as its bytes (numpy has no fp8)
                array = array.view(ml_dtypes.float8_e4m3fn)
            init.const_value = ir.tensor(array, name=name)


def run(model: ir.Model, feeds: dict[str, np.ndarray], weights: Weights | None = None,
        bindings: dict[str, WeightRef] | None = None) -> list[np.ndarray]:
    """The graph's outputs in ONNX Runtime (CPU, int4 at accuracy level 0), derived initializers filled in."""
    if weights is not None and bindings is not None:
        materialize(model, weights, bindings)
    proto = ir.serde.serialize_model(model)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    opts.log_severity_level = 3  # not the unused-initializer warnings of a graph a pass left them in
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in wanted})


@dataclasses.dataclass
class FakeCheckpoint:
    """What the lowering passes read of a Checkpoint: `quantized`, `raw`, `dims`."""

    quantized: dict[str, Any]
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    dims: Any = None
    reads: list[str] = dataclasses.field(default_factory=list)

    def raw(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        self.reads.append(name)
        t = self.tensors[name]
        return t if rows is None else t[rows[0]:rows[1]]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors
