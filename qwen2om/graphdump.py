"""`inspect --dump-graph` and `convert --dump-graph`: a graph as text or a picture that stays readable.

A 28- or 64-layer LLM is thousands of nodes; drawn whole it is a wall (that is what generic
viewers show). Every decoder layer is the same, so one layer (`layer`, default 0) is drawn node
by node and each other layer becomes a single box that says what it holds (node count, op
histogram, its KV, state and scale inputs). The layers stand in one column, in order, with the
drawn layer's place in it and its cluster beside it. Nodes keep the model's names
(`/model/layers.3/self_attn/q_proj/MatMul`); edges carry dtype and shape; graph inputs and outputs
are coloured by role, with a legend of the roles the graph has.

Two forms, both written here without graphviz's Python package:
- text: one line per node (`name  op  inputs → outputs`, each tensor with dtype[shape]); it is
  what `convert --dump-graph` writes after every pass, so consecutive files diff cleanly;
- DOT, rendered to SVG/PNG by graphviz's `dot` executable when it is installed: the SVG at full
  size, the PNG scaled down to fit a 1920×1200 screen (the result says by how much). When `dot`
  is not installed, the .dot is written next to the requested file and `GraphvizMissing` (exit
  code 3) says how to install graphviz.

Shapes come from the graph's value_info; when that is incomplete, ONNX shape inference runs on
the graph as loaded (without its external data), so the weights are never read.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import itertools
import math
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from qwen2om.errors import Qwen2omError
from qwen2om.onnxfile import dtype_name, graph_files, load_graph, manifest_roles

FORMATS = ("dot", "svg", "png", "txt")
EXIT_NO_GRAPHVIZ = 3
# /model/layers.3/self_attn/q_proj/MatMul, /model.layers.3.mlp.down_proj/fp8/Mul_6, model.layers.3.…weight
LAYER_IN_NAME = re.compile(r"(?:^|[/.])layers\.(\d+)(?=[/.]|$)")
# KV cache and (hybrids' linear-attention layers) conv / recurrent state, in and out, by layer
KV_LAYER = r"^(?:(?:past|present|cache)_(?:key|value)|(?:present_)?(?:conv|recurrent)_state)\.(\d+)$"
LAYER_WEIGHT = re.compile(rf"^model\.layers\.(\d+)\.|{KV_LAYER}")  # inputs that place an unnamed node
LAYER_OUTPUT = re.compile(rf"^/?model[./]layers\.(\d+)[./]|{KV_LAYER}")
ROLE_BY_NAME = {"input_ids": "ids", "attention_mask": "mask", "position_ids": "positions", "logits": "logits"}
KV_NAME = re.compile(r"^((?:past|present|cache)_(?:key|value)|(?:present_)?(?:conv|recurrent)_state)\.\d+$")
# Fill colour by I/O role, and the legend under the picture's title (only the roles the graph has)
LEGEND: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("ids", "mask", "positions"), "ids / mask / positions", "#dbeafe"),
    (("past_key", "past_value"), "past KV (in)", "#fed7aa"),
    (("present_key", "present_value"), "present KV (out)", "#fb923c"),
    (("cache_key", "cache_value"), "cache KV (out: the past buffer, updated in place)", "#fed7aa"),
    (("conv_state", "recurrent_state"), "conv / recurrent state (in)", "#e9d5ff"),
    (("present_conv_state", "present_recurrent_state"), "conv / recurrent state (out)", "#c084fc"),
    (("scale",), "scale inputs", "#fde047"),
    (("logits",), "logits", "#bbf7d0"),
)
COLOURS = {role: colour for roles, _, colour in LEGEND for role in roles}
NO_ROLE, BOX, DRAWN = "#f3f4f6", "#e5e7eb", "#2563eb"  # I/O without a role; collapsed layer; drawn layer's frame
# A PNG is scaled down to fit one screen (graphviz `size`, at `dpi`); the SVG keeps the full size
PNG_DPI = 96
PNG_MAX_PX = (1920, 1200)
SMALL_CONSTANT = 16  # initializers this small (shape vectors, axes) stay out of the picture, unless a model weight


class GraphvizMissing(Qwen2omError):
    """SVG/PNG asked but graphviz's `dot` is not installed; the .dot was written instead."""

    exit_code = EXIT_NO_GRAPHVIZ
    label = "graphviz missing"


@dataclasses.dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int | str, ...] | None

    @property
    def numel(self) -> int:
        return math.prod(d for d in self.shape or () if isinstance(d, int))

    def __str__(self) -> str:
        dims = "?" if self.shape is None else ",".join(map(str, self.shape))
        return f"{self.dtype}[{dims}]"


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layer: int | None


@dataclasses.dataclass
class GraphView:
    """What the writers need of one graph, independent of protobuf vs onnx_ir."""

    title: str
    nodes: list[NodeInfo]
    inputs: list[str]
    outputs: list[str]
    initializers: dict[str, TensorType]
    types: dict[str, TensorType]
    roles: dict[str, str]
    opset: int | str
    ir_version: int

    @property
    def layers(self) -> list[int]:
        return sorted({n.layer for n in self.nodes if n.layer is not None})

    def is_weight(self, name: str) -> bool:
        """A model weight or table, not a shape vector or axes constant (those stay out of pictures)."""
        t = self.initializers.get(name)  # `/model/rotary.half` is a constant of ours, `model.norm.weight` a weight
        return t is not None and (t.numel > SMALL_CONSTANT or "." in name and not name.startswith("/"))

    def type_of(self, name: str) -> TensorType:
        return self.types.get(name) or self.initializers.get(name) or TensorType("?", None)


def role_of(name: str) -> str:
    """A graph I/O's role from its name, as qwen2om names them (the manifest says it when there is one)."""
    if name in ROLE_BY_NAME:
        return ROLE_BY_NAME[name]
    if m := KV_NAME.match(name):
        return m.group(1)
    return "scale" if name.endswith(".scale") else ""


def layer_of(name: str, inputs: Iterable[str], outputs: Iterable[str]) -> int | None:
    """The decoder layer a node belongs to: from its name, else from the layer-named tensors it
    writes or the layer weights and KV inputs it reads (a pass may add nodes without a scope).
    Only weights and KV count on the input side: the final norm reads the last layer's output."""
    for text, pattern in ((name, LAYER_IN_NAME), *((t, LAYER_OUTPUT) for t in outputs),
                          *((t, LAYER_WEIGHT) for t in inputs)):
        if m := pattern.search(text):
            return int(next(g for g in m.groups() if g is not None))
    return None


def ir_type(value: ir.Value) -> TensorType:
    dtype = dtype_name(int(value.dtype)) if value.dtype is not None else "?"
    shape = None if value.shape is None else tuple(d if isinstance(d, int) else str(d) for d in value.shape)
    return TensorType(dtype, shape)


def view_from_ir(model: ir.Model, title: str, roles: dict[str, str] | None = None) -> GraphView:
    """A GraphView of an onnx_ir model (what the passes hold in ConvertState.graphs)."""
    g = model.graph
    nodes, types = [], {}
    for n in g:
        ins = tuple(v.name or "" if v is not None else "" for v in n.inputs)
        outs = tuple(v.name or "" for v in n.outputs)
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        nodes.append(NodeInfo(n.name or "", op, ins, outs, layer_of(n.name or "", ins, outs)))
        for v in (*n.inputs, *n.outputs):
            if v is not None and v.name and (v.dtype is not None or v.shape is not None):
                types[v.name] = ir_type(v)
    for v in (*g.inputs, *g.outputs):
        types[v.name or ""] = ir_type(v)
    inits = {name: ir_type(v) for name, v in g.initializers.items()}
    all_roles = {v.name or "": role_of(v.name or "") for v in (*g.inputs, *g.outputs)}
    all_roles.update(roles or {})
    return GraphView(title, nodes, [v.name or "" for v in g.inputs], [v.name or "" for v in g.outputs], inits,
                     types, all_roles, model.opset_imports.get("", "?"), model.ir_version)


def with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with value_info for every intermediate tensor ONNX can infer; the model passed in
    was loaded without its external data, so only initializer dims are used, never their bytes."""
    known = {v.name for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    if all(o in known for n in model.graph.node for o in n.output if o):
        return model
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # custom-domain ops, or a graph ONNX cannot type: draw what is known
        return model


def load_view(path: Path, kind: str | None = None) -> GraphView:
    """The GraphView of one graph of an output directory (`kind`, default decode) or one .onnx file."""
    files = graph_files(path, kind or ("decode" if (Path(path) / "manifest.json").is_file() else None))
    (name, file), = files.items()
    model = with_shapes(load_graph(file))
    roles = manifest_roles(path).get(name, {}) if Path(path).is_dir() else {}
    return view_from_ir(ir.serde.deserialize_model(model), f"{name} ({file.name})", roles)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which nodes are drawn one by one, which layers are boxes."""

    expanded: int | None
    collapsed: tuple[int, ...]

    @staticmethod
    def choose(view: GraphView, layer: int, full: bool) -> Layout:
        layers = view.layers
        if full or not layers:
            return Layout(None, ())
        if layer not in layers:
            raise Qwen2omError(f"--layer {layer}: the graph has layers {layers[0]}-{layers[-1]}")
        return Layout(layer, tuple(x for x in layers if x != layer))

    def group(self, node: NodeInfo) -> int | None:
        """The collapsed layer a node is folded into, or None when it is drawn."""
        return node.layer if node.layer in self.collapsed else None


def op_histogram(nodes: Sequence[NodeInfo], top: int | None = None) -> str:
    counts = collections.Counter(n.op for n in nodes).most_common(top)
    return ", ".join(f"{op} {k}" for op, k in counts)


@dataclasses.dataclass
class Box:
    """One collapsed layer: its nodes and what crosses its border."""

    layer: int
    nodes: list[NodeInfo]
    inputs: list[str]  # consumed inside, produced outside (or graph inputs); weights excluded
    outputs: list[str]  # produced inside, consumed outside (or graph outputs)
    weights: list[str]


def boxes(view: GraphView, layout: Layout) -> dict[int, Box]:
    producer = {o: n for n in view.nodes for o in n.outputs if o}
    consumers: dict[str, list[NodeInfo]] = collections.defaultdict(list)
    for n in view.nodes:
        for i in n.inputs:
            if i:
                consumers[i].append(n)
    graph_outputs = set(view.outputs)
    found: dict[int, Box] = {}
    for n in view.nodes:
        if (g := layout.group(n)) is None:
            continue
        box = found.setdefault(g, Box(g, [], [], [], []))
        box.nodes.append(n)
        for i in n.inputs:
            if not i:
                continue
            if i in view.initializers:
                if i not in box.weights:
                    box.weights.append(i)
            elif (p := producer.get(i)) is None or layout.group(p) != g:
                if i not in box.inputs:
                    box.inputs.append(i)
        for o in n.outputs:
            if o and (o in graph_outputs or any(layout.group(c) != g for c in consumers.get(o, ()))):
                box.outputs.append(o)
    return found


def to_text(view: GraphView, layer: int = 0, full: bool = False) -> str:
    """The compact text form: I/O, then one line per drawn node and one per collapsed layer."""
    layout = Layout.choose(view, layer, full)
    layers = view.layers
    shown = (f"layers {layers[0]}-{layers[-1]}; " if layers else "") + (
        f"layer {layout.expanded} expanded, {len(layout.collapsed)} collapsed (--full lists every node)"
        if layout.expanded is not None else "every node")
    lines = [f"# {view.title}: {len(view.nodes)} nodes, opset {view.opset}, IR {view.ir_version}; {shown}"]
    lines += [f"input  {name}  {view.type_of(name)}  {view.roles.get(name, '')}".rstrip() for name in view.inputs]
    lines += [f"output {name}  {view.type_of(name)}  {view.roles.get(name, '')}".rstrip() for name in view.outputs]
    by_dtype = collections.Counter(t.dtype for t in view.initializers.values())
    lines.append("initializers " + ", ".join(f"{dt} {k}" for dt, k in sorted(by_dtype.items())))

    def tensors(names: Iterable[str]) -> str:
        return ", ".join(f"{t} {view.type_of(t)}" if t else "-" for t in names)

    collapsed = boxes(view, layout)
    for n in view.nodes:
        if (g := layout.group(n)) is None:
            lines.append(f"{n.name or '<unnamed>'}  {n.op}  {tensors(n.inputs)} → {tensors(n.outputs)}")
        elif n is collapsed[g].nodes[0]:
            b = collapsed[g]
            lines.append(f"layers.{g} (collapsed)  {len(b.nodes)} nodes: {op_histogram(b.nodes)}; "
                         f"{sum(map(view.is_weight, b.weights))} weights; {tensors(b.inputs)} → {tensors(b.outputs)}")
    return "\n".join(lines) + "\n"


def dot_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_attrs(**attrs: str) -> str:
    return "[" + ", ".join(f"{k}={dot_quote(v)}" for k, v in attrs.items()) + "]"


def scope(name: str, layer: int | None) -> tuple[str, str]:
    """(module, the rest of the name): /model/layers.0/self_attn/q_proj/MatMul → (self_attn,
    q_proj/MatMul); outside the layers, /model/attention_lengths/seqlens_k → (attention_lengths,
    seqlens_k)."""
    m = LAYER_IN_NAME.search(name)
    if layer is None or not m:
        outside = re.match(r"^/?model/([^/]+)/(.+)$", name)
        return (outside.group(1), outside.group(2)) if outside else ("", name.lstrip("/"))
    rest = name[m.end():].lstrip("/.")
    parts = re.split(r"[/.]", rest, maxsplit=1)
    return (parts[0], parts[1]) if len(parts) == 2 else ("", rest)


def short_weight(name: str, layer: int | None, module: str = "") -> str:
    """A weight's name inside its layer (self_attn.q_proj.weight) or a module's constant inside the
    module (/model/attention_lengths.slots → slots)."""
    if layer is not None:
        return re.sub(rf"^model\.layers\.{layer}\.", "", name)
    return name.removeprefix(f"/model/{module}.") if module else name


def io_names(names: Sequence[str]) -> str:
    """KV and state names paired up: past_key.1, past_value.1 → past_key/value.1."""
    groups: dict[str, list[str]] = {}
    for t in names:
        groups.setdefault(t.replace("_value.", "_key.").replace("recurrent_state.", "conv_state."), []).append(t)
    return ", ".join(
        g[0] if len(g) == 1 else re.sub(r"_key\.", "_key/value.", k) if "_key." in k
        else re.sub(r"conv_state\.", "conv/recurrent_state.", k) if "conv_state." in k else ", ".join(g)
        for k, g in groups.items())


def html_text(s: str) -> str:
    return html.escape(s, quote=True).replace("\n", "<br/>")


def legend(title: str, roles: Iterable[str], layout: Layout) -> str:
    """The picture's title and, under it, one cell per I/O role the graph has, in its colour."""
    have = set(roles)
    cells = [(colour, text) for rs, text, colour in LEGEND if have.intersection(rs)]
    if layout.expanded is not None:
        cells += [("white", f"layers.{layout.expanded}: drawn node by node (blue frame)")] + (
            [(BOX, "other layers: one box each, in order")] if layout.collapsed else [])
    row = "".join(f'<td bgcolor="{colour}">{html_text(text)}</td>' for colour, text in cells)
    row += '<td border="0">weights: listed in their node</td>'
    return (f'<<table border="0" cellborder="1" cellspacing="3" cellpadding="3"><tr><td border="0" '
            f'colspan="{len(cells) + 1}"><font point-size="14">{html_text(title)}</font></td></tr><tr>{row}</tr>'
            "</table>>")


def to_dot(view: GraphView, layer: int = 0, full: bool = False) -> tuple[str, int]:
    """DOT text of the graph (layers other than `layer` collapsed unless `full`), and how many
    boxes it draws.

    The layers make one column, in order: a box per collapsed layer, and in the drawn layer's place
    a box pointing at its node-by-node cluster, which stands beside the column. Edges between the
    column and the cluster, or from the column to the nodes after the last layer, leave the ranking
    to invisible edges along the column, so the column reads top to bottom from the embedding to
    the LM head and the picture is as tall as the longer of the two, not their sum."""
    layout = Layout.choose(view, layer, full)
    collapsed = boxes(view, layout)
    producer: dict[str, str] = {}
    ids: dict[int, str] = {}
    layer_of_id: dict[str, int | None] = {}
    for i, n in enumerate(view.nodes):
        g = layout.group(n)
        ids[i] = f"L{g}" if g is not None else f"n{i}"
        layer_of_id[ids[i]] = n.layer
        for o in n.outputs:
            if o:
                producer[o] = ids[i]
    consumers: dict[str, set[str]] = collections.defaultdict(set)
    for i, n in enumerate(view.nodes):
        for t in n.inputs:
            if t:
                consumers[t].add(ids[i])
    # A tensor most layers read (mask, RoPE tables) is drawn into the expanded layer only; boxes list it.
    shared = {t for t, c in consumers.items()
              if sum(x.startswith("L") for x in c) >= 2 and not producer.get(t, "").startswith("L")}
    folded_io = {t for b in collapsed.values() for t in (*b.inputs, *b.outputs)
                 if t in view.inputs and consumers[t] == {f"L{b.layer}"}
                 or t in view.outputs and producer.get(t) == f"L{b.layer}"}

    title = f"{view.title}: {len(view.nodes)} nodes" + (
        f"; layer {layout.expanded} drawn node by node, layers {', '.join(map(str, layout.collapsed))} collapsed"
        if layout.expanded is not None and len(layout.collapsed) <= 4 else
        f"; layer {layout.expanded} drawn node by node, {len(layout.collapsed)} others collapsed"
        if layout.expanded is not None else "")
    out = [f"digraph {dot_quote(view.title)} {{",
           f"  graph [label={legend(title, view.roles.values(), layout)}, labelloc=\"t\", fontname=\"Helvetica\", "
           'fontsize="12", rankdir="TB", nodesep="0.15", ranksep="0.2", compound="true"];',
           "  node " + dot_attrs(shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica",
                                 fontsize="9", margin="0.06,0.03", height="0.25", width="0.4") + ";",
           "  edge " + dot_attrs(fontname="Helvetica", fontsize="7", color="#555555", fontcolor="#333333",
                                 arrowsize="0.5") + ";"]
    drawn = 0
    for kind, names in (("in", view.inputs), ("out", view.outputs)):
        for name in names:
            if name in folded_io or kind == "in" and name not in consumers:
                continue
            role = view.roles.get(name, "")
            out.append(f"  {dot_quote(f'{kind}:{name}')} " + dot_attrs(
                label=f"{name}\n{view.type_of(name)}", shape="ellipse", fillcolor=COLOURS.get(role, NO_ROLE),
                tooltip=f"graph {kind}put {name} ({role or 'no role'})") + ";")
            drawn += 1

    # Drawn nodes by (layer, module); outside the layers, a module of one node is not framed
    scopes = {i: scope(n.name, n.layer) for i, n in enumerate(view.nodes) if layout.group(n) is None}
    outside = collections.Counter(module for i, (module, _) in scopes.items() if view.nodes[i].layer is None)
    clusters: dict[tuple[int | None, str], list[str]] = collections.defaultdict(list)
    for i, (module, rest) in scopes.items():
        n = view.nodes[i]
        if n.layer is None and module and outside[module] < 2:
            module, rest = "", n.name.lstrip("/")
        label = rest or n.op
        if not re.sub(r"_\d+$", "", label.rsplit("/", 1)[-1]) == n.op.rsplit("::", 1)[-1]:
            label += f"\n{n.op}"
        for w in (w for w in n.inputs if w in view.initializers and view.is_weight(w)):
            label += f"\n{short_weight(w, n.layer, module)} {view.initializers[w]}"
        clusters[(n.layer, module)].append(f"n{i} " + dot_attrs(label=label, tooltip=n.name or n.op) + ";")
        drawn += 1
    for (lay, module), lines in clusters.items():
        indent = "  "
        if lay is not None:
            out.append(f"  subgraph {dot_quote(f'cluster_layer{lay}')} {{")
            out.append("    graph " + dot_attrs(label=f"layers.{lay}", style="rounded", color=DRAWN,
                                                 fontcolor=DRAWN) + ";")
            indent += "  "
        if module:
            name = f"cluster_layer{lay}_{module}" if lay is not None else f"cluster_{module}"
            out.append(f"{indent}subgraph {dot_quote(name)} {{")
            out.append(f"{indent}  graph " + dot_attrs(label=module, style="rounded,dashed", color="#9ca3af",
                                                       fontcolor="#6b7280") + ";")
        out += [f"{indent}{'  ' if module else ''}{line}" for line in lines]
        out += [f"{indent}}}"] if module else []
        out += ["  }"] if lay is not None else []

    for g, b in collapsed.items():
        folded_in = [t for t in b.inputs if t in folded_io]
        scales = [t for t in folded_in if view.roles.get(t) == "scale"]
        io = io_names([t for t in folded_in if t not in scales])
        if kv_out := [t for t in b.outputs if t in folded_io]:
            io += " → " + io_names(kv_out)
        also = [t for t in b.inputs if t in shared and t not in folded_io]
        label = [f"layers.{g} · {len(b.nodes)} nodes · {sum(map(view.is_weight, b.weights))} weights",
                 re.sub(r"\w+(?:\.\w+)*::", "", op_histogram(b.nodes, 4))]  # the domain is in the tooltip
        more = ([io] if io else []) + ([f"{len(scales)} scale inputs"] if scales else []) + (
            [f"+ {len(also)} shared inputs (drawn into layers.{layout.expanded})"] if also else [])
        label += [" · ".join(more)] if more else []  # three lines at most: 27 boxes stack in the column
        tooltip = f"layers.{g}: {op_histogram(b.nodes)}" + (f"; also reads {', '.join(also)}" if also else "")
        out.append(f"  L{g} " + dot_attrs(label="\n".join(label), shape="box3d", style="filled",
                                          fillcolor=BOX, margin="0.1,0.04", tooltip=tooltip) + ";")
        drawn += 1

    edges: set[tuple[str, str, str]] = set()
    for i, n in enumerate(view.nodes):
        dst = ids[i]
        for t in n.inputs:
            if not t or t in view.initializers or t in folded_io:
                continue
            src = producer.get(t, f"in:{t}" if t in view.inputs else None)
            if src is None or src == dst or (dst.startswith("L") and t in shared):
                continue
            edges.add((src, dst, t))
    for t in view.outputs:
        if t not in folded_io and t in producer:
            edges.add((producer[t], f"out:{t}", t))
    free, extra = layer_column(view, layout, ids, producer, layer_of_id)
    drawn += 0 if layout.expanded is None else 1  # the drawn layer's place in the column
    for src, dst, t in sorted(edges, key=lambda e: (_order(e[0]), _order(e[1]), e[2])):
        # xlabel: placed after the layout, so labels do not double the ranks (and dot 2.43 loses labelled
        # unconstrained edges: "lost n436 L3 edge")
        attrs = {"xlabel": str(view.type_of(t)), "tooltip": t} | ({"constraint": "false"} if free(src, dst) else {})
        out.append(f"  {dot_quote(src)} -> {dot_quote(dst)} " + dot_attrs(**attrs) + ";")
    out += extra
    out.append("}")
    return "\n".join(out) + "\n", drawn


def layer_column(view: GraphView, layout: Layout, ids: dict[int, str], producer: dict[str, str],
                 layer_of_id: dict[str, int | None]) -> tuple[Callable[[str, str], bool], list[str]]:
    """Which edges must not rank the picture, and the DOT lines that do: the drawn layer's place
    L{k} in the column (pointing at its cluster) and invisible edges along the column L0..L{N-1},
    from the embedding to the column's top and the drawn layer's entry nodes, and from the column's
    bottom to the nodes after the last layer."""
    if layout.expanded is None:
        return lambda src, dst: False, []
    k, column = layout.expanded, [f"L{x}" for x in view.layers]
    layer_made = {o for n in view.nodes if n.layer is not None for o in n.outputs if o}
    after = {ids[i] for i, n in enumerate(view.nodes) if n.layer is None and layer_made.intersection(n.inputs)}
    # The column starts under what feeds the first layer alone (the embedding), not under what every
    # layer reads (RoPE rows, the mask's lengths)
    readers: dict[str, set[int | None]] = collections.defaultdict(set)
    for n in view.nodes:
        for t in n.inputs:
            readers[t].add(n.layer)
    start = view.layers[0]
    top = {producer[t] for n in view.nodes if n.layer == start for t in n.inputs
           if t in producer and layer_of_id[producer[t]] is None and readers[t] <= {start, None}}
    # The drawn layer's entry: its nodes that read the layer before it (or, for the first, the embedding)
    before = view.layers[view.layers.index(k) - 1] if k != start else None
    entry = [f"n{i}" for i, n in enumerate(view.nodes) if n.layer == k and any(
        t in producer and (producer[t] in top if before is None else layer_of_id[producer[t]] == before)
        for t in n.inputs)] or [f"n{next(i for i, n in enumerate(view.nodes) if n.layer == k)}"]
    boxes_ = set(column) - {f"L{k}"}

    def free(src: str, dst: str) -> bool:
        return ((src in boxes_) != (dst in boxes_) and not dst.startswith("out:")
                or layer_of_id.get(src) == k and dst in after)

    invisible = '[style="invis", weight="10"];'
    lines = [f"  L{k} " + dot_attrs(
        label=f"layers.{k} · {sum(n.layer == k for n in view.nodes)} nodes\ndrawn node by node",
        style="rounded,bold", color=DRAWN, fontcolor=DRAWN, tooltip=f"layers.{k}: see its cluster") + ";",
             f"  {dot_quote(f'L{k}')} -> {dot_quote(entry[0])} " + dot_attrs(
        lhead=f"cluster_layer{k}", style="dashed", color=DRAWN, constraint="false") + ";"]
    lines += [f"  {dot_quote(a)} -> {dot_quote(b)} {invisible}" for a, b in itertools.pairwise(column)]
    lines += [f"  {dot_quote(a)} -> {dot_quote(column[0])} {invisible}" for a in sorted(top, key=_order)]
    if before is not None:
        lines += [f"  {dot_quote(a)} -> {dot_quote(b)} {invisible}" for a in sorted(top, key=_order) for b in entry]
    lines += [f"  {dot_quote(column[-1])} -> {dot_quote(b)} {invisible}" for b in sorted(after, key=_order)]
    return free, lines


def _order(node_id: str) -> tuple[int, int | str]:
    """Stable edge order: inputs, nodes by position, layer boxes, outputs."""
    if node_id.startswith("in:"):
        return (0, node_id)
    if node_id.startswith("n"):
        return (1, int(node_id[1:]))
    if node_id.startswith("L"):
        return (2, int(node_id[1:]))
    return (3, node_id)


def render(dot_text: str, out: Path, fmt: str) -> float:
    """SVG/PNG through graphviz's `dot` (looked up on PATH now); without it, the .dot next to `out`
    and GraphvizMissing (exit code 3). A PNG is scaled down to fit PNG_MAX_PX at PNG_DPI (never up);
    returns the scale graphviz drew it at (1.0 for SVG, which keeps the full size)."""
    width, height = (px / PNG_DPI for px in PNG_MAX_PX)
    fit = [f"-Gsize={width:g},{height:g}", f"-Gdpi={PNG_DPI}"] if fmt == "png" else []
    exe = shutil.which("dot")
    if exe is None:
        dot_file = out.with_suffix(".dot")
        dot_file.write_text(dot_text, encoding="utf-8")
        raise GraphvizMissing(
            f"graphviz's `dot` is not installed, so {out} was not drawn. The graph is written to {dot_file}; "
            f"install graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; conda: "
            f"conda install graphviz) and rerun, or draw it with: dot -T{fmt} {' '.join(fit + [str(dot_file)])} "
            f"-o {out}")
    # cairo drawing with gd's palette PNG writer is a third the size of plain -Tpng; not every build has gd.
    # -Tplain (to stdout, from the same layout) starts with "graph SCALE WIDTH HEIGHT".
    for renderer in ((f"{fmt}:cairo:gd", fmt) if fmt == "png" else (fmt,)):
        proc = subprocess.run([exe, *fit, f"-T{renderer}", "-o", str(out), *(["-Tplain"] if fit else [])],
                              input=dot_text, text=True, capture_output=True, check=False)
        if proc.returncode == 0:
            return float(proc.stdout.split(maxsplit=2)[1]) if fit else 1.0
    raise Qwen2omError(f"graphviz's dot failed to draw {out} (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")


@dataclasses.dataclass(frozen=True)
class DumpResult:
    file: Path
    format: str
    graph: str
    nodes: int  # in the graph
    drawn: int  # boxes and lines in the dump
    expanded: int | None
    collapsed: int
    scale: float = 1.0  # a PNG scaled down to fit one screen: below 1
    note: str = ""  # what to say besides "wrote FILE": that a scaled PNG has a full-size SVG

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["file"] = str(self.file)
        return d


def dump_graph(path: Path | str, out: Path | str, *, kind: str | None = None, layer: int = 0,
               full: bool = False) -> DumpResult:
    """Write one graph of `path` (output directory or .onnx file) to `out`, in the form its suffix
    names (.dot, .svg, .png, .txt)."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise Qwen2omError(f"--dump-graph {out}: the file name must end in one of "
                           f"{', '.join('.' + f for f in FORMATS)}")
    if not out.parent.is_dir():
        raise Qwen2omError(f"--dump-graph {out}: the directory {out.parent} does not exist")
    view = load_view(Path(path), kind)
    layout = Layout.choose(view, layer, full)
    scale, note = 1.0, ""
    if fmt == "txt":
        text = to_text(view, layer, full)
        out.write_text(text, encoding="utf-8")
        drawn = text.count("\n")
    else:
        dot_text, drawn = to_dot(view, layer, full)
        if fmt == "dot":
            out.write_text(dot_text, encoding="utf-8")
        else:
            scale = render(dot_text, out, fmt)
    if scale < 1:
        note = (f"{out.name} is scaled to {scale:.0%} to fit {PNG_MAX_PX[0]}×{PNG_MAX_PX[1]} px; "
                f"--dump-graph {out.with_suffix('.svg').name} draws every node and label at full size")
    return DumpResult(out, fmt, view.title, len(view.nodes), drawn, layout.expanded, len(layout.collapsed),
                      scale, note)


def pass_dumper(graphs_dir: Path) -> Callable[[int, str, Any], None]:
    """`convert --dump-graph`: after pass number `index` (1-based), write every graph the state
    holds to graphs_dir/NN_<pass>.<kind>.txt, every node listed so a diff shows all a pass did."""

    def after(index: int, name: str, state: Any) -> None:
        graphs = state.graphs or {}
        if not graphs:
            return
        graphs_dir.mkdir(parents=True, exist_ok=True)
        for kind, model in graphs.items():
            view = view_from_ir(model, f"{kind} after {index:02d} {name}")
            (graphs_dir / f"{index:02d}_{name}.{kind}.txt").write_text(to_text(view, full=True), encoding="utf-8")

    return after
