"""Building the standard-ONNX decomposition of one Ascend op inside a GraphProto.

Each reference kernel (kernels/*.py) turns its op's node into standard ONNX nodes so that an
Ascend-bound graph runs on ONNX Runtime (kernels/ascend.py `decompose`). The nodes and constants it
adds are named under the replaced node's name, so two decompositions never collide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper


class Builder:
    """Nodes and small constants for one replaced op, named under its node's name."""

    def __init__(self, graph: onnx.GraphProto, prefix: str) -> None:
        self.graph, self.prefix, self.nodes, self.n = graph, prefix, [], 0

    def const(self, value: np.ndarray) -> str:
        name = f"{self.prefix}/c{self.n}"
        self.n += 1
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, kind: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        return self.ops(kind, *inputs, outs=[out] if out else None, **attrs)[0]

    def ops(self, kind: str, *inputs: str, outs: list[str | None] | None = None, n: int = 1,
            **attrs: object) -> list[str]:
        """A node with several outputs: `outs` names them (None: a fresh name), else `n` fresh ones."""
        outs = outs or [None] * n
        names = []
        for o in outs:
            names.append(o or f"{self.prefix}/{kind}_{self.n}")
            self.n += 1
        self.nodes.append(helper.make_node(kind, list(inputs), names, name=f"{self.prefix}/{kind}_{self.n}", **attrs))
        return names


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def shape(graph: onnx.GraphProto, name: str) -> list[int] | None:
    """A value's static shape from the initializers, inputs or value_info (0 for a symbolic dim)."""
    for init in graph.initializer:
        if init.name == name:
            return list(init.dims)
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.name == name:
            return [d.dim_value for d in vi.type.tensor_type.shape.dim]
    return None


def dtype(graph: onnx.GraphProto, name: str) -> int | None:
    for init in graph.initializer:
        if init.name == name:
            return init.data_type
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    return None


# A reference kernel's decomposition: (builder, the op's node, every value's ONNX element type by name)
Decomposition = Callable[["Builder", onnx.NodeProto, Mapping[str, int]], None]
