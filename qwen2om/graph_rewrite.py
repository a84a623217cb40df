"""Graph-rewrite helpers the passes share, and the names passes use to find each other's tensors.

Passes never import one another (tests/test_pass_imports.py): what more than one pass needs lives
here. Two kinds of thing:

- helpers on an onnx_ir graph: shared constants and derived initializers, the quantised MatMuls
  of a graph and their replacement, the nodes of a named scope and the boundary of such a region,
  MoE expert stacks;
- the naming protocol: the initializer suffixes under which `lower_int4` / `lower_fp8` store their
  scales (`scale_inputs` finds scales by them, `fuse_int4` the MatMulNBits tensors) and the name of
  a scale once it is a graph input.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.families import QWEN_NAMES
from qwen2om.weights import WeightRef

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops

# -- naming protocol ----------------------------------------------------------------------------
NBITS_WEIGHT = ".weight_nbits"  # MatMulNBits' B, [N, K/block, block/2]
NBITS_SCALE = ".weight_nbits_scale"  # its scales: scale_inputs finds int4 scales by this suffix
NBITS_ZERO_POINT = ".weight_nbits_zero_point"
FP8_SCALE = ".weight_fp8_scale"  # an FP8 weight's block scale: scale_inputs finds FP8 scales by this suffix


def scale_input(base: str) -> str:
    """The graph input a scale becomes with `scales: inputs`: `<module>.weight.scale`."""
    return f"{base}.weight.scale"


# -- constants and initializers -----------------------------------------------------------------
def const(graph: ir.Graph, name: str, value: np.ndarray) -> ir.Value:
    """A small inline constant, shared by name."""
    if name in graph.initializers:
        return graph.initializers[name]
    v = ir.Value(name=name, shape=ir.Shape(value.shape), type=ir.TensorType(ir.DataType.from_numpy(value.dtype)),
                 const_value=ir.tensor(value, name=name))
    graph.register_initializer(v)
    return v


def is_constant(v: ir.Value | None) -> bool:
    """An initializer, or computed from initializers and tensor shapes only, never from tensor data
    (ConstantOfShape of a shape constant; in a graph with prefill gears, the exporter's arithmetic on
    `Shape` of the symbolic-T inputs, which it shares between layers like any constant)."""
    if v is None or v.is_initializer():
        return True
    node = v.producer()
    return node is not None and (node.op_type == "Shape" or all(is_constant(i) for i in node.inputs))


def derived_initializer(graph: ir.Graph, bindings: dict[str, WeightRef], weights: Any, name: str,
                        dtype: ir.DataType, shape: list[int], produce: Callable[[], torch.Tensor]) -> ir.Value:
    """An initializer that write_onnx fills from `produce()` (int4 / FP8 storage, scales), once per
    name whatever the number of graphs using it."""
    if name in graph.initializers:
        return graph.initializers[name]
    v = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
    graph.initializers.add(v)
    weights.derived[name] = produce
    bindings[name] = WeightRef(name)
    return v


def scoped_op(nodes: list[ir.Node], scope: str, kind: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
    """Append a standard-domain node `{scope}/{kind}_{i}` (i: its index in `nodes`) and return its
    one output, `{scope}/{kind}_{i}_out`; attributes are strings, ints or int lists."""
    attributes = [ir.AttrString(a, v) if isinstance(v, str) else ir.AttrInt64(a, v) if isinstance(v, int)
                  else ir.AttrInt64s(a, v) for a, v in attrs.items()]  # type: ignore[arg-type]
    node = ir.Node("", kind, list(inputs), attributes, num_outputs=1, name=f"{scope}/{kind}_{len(nodes)}")
    node.outputs[0].name = f"{scope}/{kind}_{len(nodes)}_out"
    nodes.append(node)
    return node.outputs[0]


# -- quantised MatMuls --------------------------------------------------------------------------
def quantized_matmuls(graph: ir.Graph, bindings: dict[str, WeightRef], quantized: dict[str, Any],
                      kind: type) -> list[tuple[ir.Node, Any]]:
    """The graph's `MatMul(x, Wᵀ)` nodes whose weight is a checkpoint weight of type `kind`
    (Int4Weight, Fp8Weight), with it; a snapshot, so the caller may rewrite as it goes."""
    found = []
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        w = node.inputs[1]
        ref = bindings.get(w.name) if w is not None and w.is_initializer() else None
        q = quantized.get(ref.source) if ref is not None and ref.transpose else None
        if isinstance(q, kind):
            found.append((node, q))
    return found


def replace_matmul(graph: ir.Graph, node: ir.Node, new: list[ir.Node], out: ir.Value) -> None:
    """Put `new` (computing `out`) where the MatMul `node` was: `out` takes its output's name, shape
    and uses (a graph output, the fp32 LM head's `logits`, included); its weight goes when unused."""
    old, w = node.outputs[0], node.inputs[1]
    graph.insert_before(node, new)
    out.shape, out.type = old.shape, old.type
    if old.is_graph_output():  # first: replace_all_uses_with refuses a graph output
        graph.outputs[list(graph.outputs).index(old)] = out
    old.replace_all_uses_with(out)
    name = old.name
    graph.remove(node, safe=True)
    out.name = name
    if w is not None and not w.uses():
        graph.initializers.pop(w.name)


# -- scoped regions -----------------------------------------------------------------------------
def regions(graph: ir.Graph, *, scope: re.Pattern[str]) -> dict[int, list[ir.Node]]:
    """Layer → the nodes whose name `scope` matches (group 1 is the layer), in graph order."""
    found: dict[int, list[ir.Node]] = {}
    for node in graph:
        if m := scope.match(node.name or ""):
            found.setdefault(int(m.group(1)), []).append(node)
    return found


def boundary(graph: ir.Graph, nodes: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Value]]:
    """Non-constant values the region reads from outside it, and values it produces that are read outside."""
    members = set(nodes)
    inputs: list[ir.Value] = []
    for node in nodes:
        for v in node.inputs:
            if is_constant(v) or v in inputs:
                continue
            if v.producer() not in members:
                inputs.append(v)
    outputs = [v for node in nodes for v in node.outputs
               if v.is_graph_output() or any(user not in members for user, _ in v.uses())]
    return inputs, outputs


# -- MoE expert stacks --------------------------------------------------------------------------


def expert_stacks(graph: ir.Graph, ckpt: Any) -> Iterator[tuple[ir.Value, str, str, dict[str, list[Any]]]]:
    """Each MoE layer's float expert stack still in use (`gate_up` or `down`), with its layer prefix,
    which stack it is, and the checkpoint's quantised weight of each of its projections per expert
    (None where an expert's weight is not quantised); a snapshot, so the caller may rewrite as it goes."""
    for init in list(graph.initializers.values()):
        stack = QWEN_NAMES.parse_stack(init.name or "")
        if stack is None or not init.uses():
            continue
        p, which = stack
        projs = ("gate", "up") if which == "gate_up" else ("down",)
        yield init, p, which, {proj: [ckpt.quantized.get(QWEN_NAMES.expert(p, e, proj))
                                      for e in range(ckpt.dims.experts)] for proj in projs}


def replace_stack_uses(graph: ir.Graph, init: ir.Value, scope: str, wq: ir.Value, scales: list[ir.Value],
                       dequant: Callable[[list[ir.Node], ir.Value, list[ir.Value], int], ir.Value]) -> None:
    """Point every use of the float expert stack `init` at `dequant(nodes, bytes, scales, lead)`.

    A GatherND of the routed experts (decode) becomes GatherNDs of the bytes and the scale stacks,
    dequantised after, so a step dequantises k experts, not E; any other use (prefill's MatMul)
    gets the whole stack, dequantised once at the top of the graph."""
    full: ir.Value | None = None
    for node, _ in list(init.uses()):
        nodes: list[ir.Node] = []
        if node.op_type == "GatherND" and node.inputs[0] is init:
            idx = node.inputs[1]
            lead = len(idx.shape) - 1 if idx.shape is not None else 2
            gathered = [scoped_op(nodes, scope, "GatherND", v, idx) for v in (wq, *scales)]
            out = dequant(nodes, gathered[0], gathered[1:], lead)
            graph.insert_before(node, nodes)
            old = node.outputs[0]
            out.shape, out.type = old.shape, old.type
            old.replace_all_uses_with(out)
            graph.remove(node, safe=True)
            continue
        if full is None:
            full = dequant(nodes, wq, scales, 1)
            full.shape, full.type = init.shape, init.type
            graph.insert_before(graph.node(0), nodes)
        node.replace_input_with(list(node.inputs).index(init), full)
    if not init.uses():
        graph.initializers.pop(init.name)


def unread(node: ir.Node) -> bool:
    """Nothing reads any output of `node`, and none is a graph output."""
    return not any(v.uses() or v.is_graph_output() for v in node.outputs)


def remove_unread(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove the nodes of a rewritten region that nothing reads any more, last first (so a chain goes
    whole); a node another region shares (the exporter's common mask reshapes, constants) stays."""
    for n in reversed(nodes):
        if unread(n):
            graph.remove(n, safe=True)


def sweep(graph: ir.Graph, *scopes: re.Pattern[str]) -> None:
    """Remove what is left of fused regions (nodes in `scopes`) once nothing reads it (mask reshapes
    the exporter shared between layers outlive the region that computed them), then the small
    initializers nothing reads any more (the regions' shape constants)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph)):
            if any(s.match(n.name or "") for s in scopes) and unread(n):
                graph.remove(n, safe=True)
                changed = True
    for name, v in list(graph.initializers.items()):
        if not v.uses() and not v.is_graph_output() and v.const_value is not None and v.const_value.size <= 16:
            graph.initializers.pop(name)


def log_once(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` that says each message once: a reason that holds for every layer (no kernel on this SoC)
    is logged once per pass, not once per layer and graph."""
    said: set[str] = set()

    def once(message: str) -> None:
        if message not in said:
            said.add(message)
            log(message)

    return once


# -- attention regions ---------------------------------------------------------------------------
def derived_from(v: ir.Value, source: ir.Value) -> bool:
    """`v` is `source` (the mask, the positions), or computed from it and constants only (an Unsqueeze, a Cast)."""
    if v is source:
        return True
    node = v.producer()
    if node is None:
        return False
    operands = [i for i in node.inputs if not is_constant(i)]
    return bool(operands) and all(derived_from(i, source) for i in operands)


def attention_roles(graph: ir.Graph, nodes: list[ir.Node], mask: ir.Value) -> dict[str, ir.Value] | str:
    """q, k, v, past_k, past_v of a region, told apart by how the region reads them: K operands
    are transposed before their MatMul, V operands are a MatMul's second input, the cache is a
    graph input; or why the region is not the expected shape. The mask may arrive through a
    node of another layer's region (the exporter shares identical mask reshapes), and the
    region may likewise hand its mask reshape to later layers: those values are not operands."""
    inputs, outputs = boundary(graph, nodes)
    operands = [v for v in inputs if not derived_from(v, mask)]
    results = [v for v in outputs if not derived_from(v, mask)]
    # Mask-derived inputs: the mask (or its shared reshape), and with a symbolic T its shape values too.
    if len(operands) != 5 or len(results) != 1 or len(inputs) == len(operands):
        return (f"expected q, k, v, past K/V and the mask in, 1 output, found {len(operands)} operands, "
                f"{len(inputs) - len(operands)} mask-derived inputs and {len(results)} outputs")
    members = set(nodes)
    roles: dict[str, ir.Value] = {"out": results[0]}
    for v in operands:
        uses = [(u, i) for u, i in v.uses() if u in members]
        keyish = any(u.op_type == "Transpose" for u, _ in uses)
        valueish = any(u.op_type == "MatMul" and i == 1 for u, i in uses)
        cache = v.is_graph_input()
        role = ("past_k" if cache else "k") if keyish else ("past_v" if cache else "v") if valueish else "q"
        if role in roles:
            return f"two inputs look like {role}"
        roles[role] = v
    return roles
