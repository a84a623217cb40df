"""Build an L-layer graph from an exported 2-layer one by cloning the last layer's nodes.

Hybrids (Qwen3.5: linear, linear, linear, full, ...) trace the first layers up to one stamp per kind
after layer 0 (four layers) and clone each later layer from the stamp of its kind.

Exporting all L layers costs time and memory in proportion to L (the exporter traces and
optimises every layer; 28 layers of Qwen3-1.7B take minutes and gigabytes even with meta
weights). Every decoder layer of a kind has the same structure and differs only in its weights
and cache I/O, so the exporter sees two layers and this module stamps out the rest.

Why two and not one: in a two-layer export, layer 1's inputs from outside itself are exactly
what any later layer needs: the hidden state carried in from the previous layer (the only
input that depends on layer 0's weights or cache) and values shared by all layers (RoPE rows,
the broadcast mask, shape constants), which the exporter's CSE may have placed in layer 0.

Nothing is assumed silently. Which nodes belong to layer 1 comes from the exporter's module
scopes, and is then checked by data flow: every value that depends on layer 1's weights or
cache must be produced inside layer 1 or downstream of its carried-out hidden state, exactly
one input may depend on layer 0, exactly one output may leave for the tail. Any surprise
raises TemplateError and the caller exports all layers instead.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Hashable, Sequence

import onnx_ir as ir

from qwen2om.arch import ModelDims

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
LAYER_SCOPE = re.compile(r"^model\.layers\.(\d+)$")
LAYER_NAME = re.compile(r"(?:\blayers\.(\d+)\.)|(?:^\w+\.(\d+)$)")  # weights, and per-layer I/O like past_key.3


class TemplateError(Exception):
    """The exported graph does not have the shape this module relies on."""


def node_layer(node: ir.Node) -> int | None:
    raw = node.metadata_props.get(SCOPES_KEY)
    for scope in ast.literal_eval(raw) if raw else []:
        if m := LAYER_SCOPE.match(scope):
            return int(m.group(1))
    return None


def name_layer(name: str | None) -> int | None:
    m = LAYER_NAME.search(name or "")
    return int(m.group(1) or m.group(2)) if m else None


def rename_layer(name: str, src: int, dst: int) -> str:
    """`model.layers.1.mlp.up_proj.weight` → `...layers.7...`; `past_key.1` → `past_key.7`."""
    name = re.sub(rf"\blayers\.{src}\.", f"layers.{dst}.", name)
    return re.sub(rf"^(\w+)\.{src}$", rf"\g<1>.{dst}", name)


def taints(graph: ir.Graph, cut: ir.Value | None = None) -> dict[ir.Value, frozenset[int]]:
    """For each value, the layers whose weights or cache it depends on. `cut` is treated as
    depending on nothing (to ask what is computed from a layer *besides* its carried output)."""
    out: dict[ir.Value, frozenset[int]] = {}
    for v in (*graph.inputs, *graph.initializers.values()):
        layer = name_layer(v.name)
        out[v] = frozenset() if layer is None else frozenset([layer])
    for node in graph:
        t = frozenset().union(*(out.get(v, frozenset()) for v in node.inputs if v is not None))
        for v in node.outputs:
            out[v] = frozenset() if v is cut else t
    return out


@dataclasses.dataclass
class LayerTemplate:
    """One traced layer as a stamp: its nodes, the hidden state in and out, its own weights and I/O."""

    index: int
    body: list[ir.Node]
    carry_in: ir.Value
    carry_out: ir.Value
    sources: list[ir.Value]
    io_out: list[ir.Value]


def layer_template(graph: ir.Graph, src: int, taint: dict[ir.Value, frozenset[int]], first: int = 0) -> LayerTemplate:
    """Layer `src` of the traced graph, checked to be self-contained but for its carried hidden state
    (`first`: the graph's first layer, 0 but in a pipeline stage's graph)."""
    body = [n for n in graph if node_layer(n) == src]
    members = set(body)
    if not body:
        raise TemplateError(f"no nodes are scoped to model.layers.{src}")
    if any(a.type == ir.AttributeType.GRAPH or a.type == ir.AttributeType.GRAPHS
           for n in body for a in n.attributes.values()):
        raise TemplateError("the layer has subgraphs")
    outside_in = {v for n in body for v in n.inputs
                  if v is not None and v.producer() is not None and v.producer() not in members}
    carry_in = [v for v in outside_in if first in taint[v]]
    if len(carry_in) != 1:
        raise TemplateError(f"layer {src} takes {len(carry_in)} inputs computed from layer {first}, not 1")
    leaving = {v for n in body for v in n.outputs
               if not v.is_graph_output() and any(user not in members for user, _ in v.uses())}
    if len(leaving) != 1:
        raise TemplateError(f"layer {src} hands {len(leaving)} values to the rest of the graph, not 1")
    carry_out = leaving.pop()
    beside_carry = taints(graph, cut=carry_out)
    escaped = [n for n in graph if n not in members and any(src in beside_carry[v] for v in n.outputs)]
    if escaped:
        raise TemplateError(f"{len(escaped)} nodes outside layer {src} use its weights or cache directly")
    io_out = [v for v in graph.outputs if v.producer() in members]  # in signature order
    if any(name_layer(v.name) != src for v in io_out):
        raise TemplateError(f"layer {src} produces graph outputs that are not its own")
    sources = [v for v in (*graph.inputs, *graph.initializers.values()) if name_layer(v.name) == src]
    return LayerTemplate(src, body, carry_in[0], carry_out, sources, io_out)


def layer_kinds(d: ModelDims) -> list[Hashable]:
    """What makes two layers' graphs differ: attention kind (hybrids) and dense or sparse MLP."""
    return [(d.layer_types[i] if d.layer_types else "", d.is_sparse(i)) for i in range(d.layers)]


def template_layers(kinds: Sequence[Hashable]) -> int:
    """How many leading layers to trace so that every later layer's kind has a stamp other than the first
    (2 for uniform layers; 4 for Qwen3.5's linear, linear, linear, full pattern). `kinds`: the layers of
    the graph, in order (a pipeline stage's own)."""
    for n in range(2, len(kinds) + 1):
        if set(kinds[n:]) <= set(kinds[1:n]):
            return n
    return len(kinds)


def replicate_layers(model: ir.Model, layers: int, kinds: Sequence[Hashable] | None = None) -> int:
    """Grow the traced leading layers of an export to `layers` layers in place; returns the number of
    nodes added. `kinds` (one per layer; default all alike) says which traced layer stamps which:
    each later layer is cloned from the last traced layer (not the first) of its kind.

    A pipeline stage's graph (qwen2om/stages.py) starts at its first layer, not 0: layers are numbered
    model-wide throughout, `layers` is the stop of the stage's run and `kinds` is indexed model-wide."""
    graph = model.graph
    kinds = list(kinds) if kinds is not None else [0] * layers
    scoped = [node_layer(n) for n in graph if node_layer(n) is not None]
    first, traced = min(scoped, default=0), 1 + max(scoped, default=-1)
    if layers <= max(traced, first + 2):
        return 0
    if traced < first + 2:
        raise TemplateError(f"no nodes are scoped to model.layers.{first + 1}")
    taint = taints(graph)
    stamps: dict[Hashable, LayerTemplate] = {}
    for src in range(first + 1, traced):
        stamps[kinds[src]] = layer_template(graph, src, taint, first)
    if missing := {kinds[i] for i in range(traced, layers)} - set(stamps):
        raise TemplateError(f"no traced layer after layer 0 is of kind {sorted(map(str, missing))}")
    last = stamps[kinds[traced - 1]]
    if last.index != traced - 1:
        raise TemplateError("the last traced layer is not the stamp of its kind")
    members = set(last.body)
    tail_uses = [(user, i) for user, i in last.carry_out.uses() if user not in members]

    anchor, prev_out, added = last.body[-1], last.carry_out, 0
    for layer in range(traced, layers):
        t = stamps[kinds[layer]]
        vmap: dict[ir.Value, ir.Value] = {t.carry_in: prev_out}
        for v in t.sources:
            new = ir.Value(name=rename_layer(v.name or "", t.index, layer), shape=v.shape, type=v.type)
            if v.is_initializer():
                # Weights are value-less placeholders until write_onnx binds them (like the traced ones).
                graph.initializers.add(new)
            else:
                graph.inputs.append(new)
            vmap[v] = new
        clones = [clone_node(n, vmap, t.index, layer) for n in t.body]
        graph.insert_after(anchor, clones)
        anchor, added = clones[-1], added + len(clones)
        for v in t.io_out:
            graph.outputs.append(vmap[v])
        prev_out = vmap[t.carry_out]
    for user, i in tail_uses:
        user.replace_input_with(i, prev_out)
    return added


def clone_node(node: ir.Node, vmap: dict[ir.Value, ir.Value], src: int, layer: int) -> ir.Node:
    """A copy of `node` for `layer`: inputs mapped, outputs and scope names renamed."""
    inputs = [None if v is None else vmap.get(v, v) for v in node.inputs]
    attrs = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    new = ir.Node(node.domain, node.op_type, inputs, attrs, num_outputs=len(node.outputs), version=node.version,
                  name=None if node.name is None else rename_layer(node.name, src, layer))
    for old, out in zip(node.outputs, new.outputs, strict=True):
        out.name = rename_layer(old.name, src, layer) if old.is_graph_output() else f"l{layer}/{old.name}"
        out.shape, out.type = old.shape, old.type
        vmap[old] = out
    scopes = node.metadata_props.get(SCOPES_KEY)
    if scopes:
        new.metadata_props[SCOPES_KEY] = re.sub(rf"model\.layers\.{src}(?=[.'])", f"model.layers.{layer}", scopes)
    return new

