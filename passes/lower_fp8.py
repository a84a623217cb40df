"""Lower FP8 linears: the weight stays e4m3fn in the graph and is dequantised by its block scale.

Up to here an FP8 linear is an ordinary `MatMul(x, Wᵀ)` whose initializer reads as the exact
dequantisation (so a recipe without this pass upcasts FP8 to the compute dtype at conversion time:
4× the bytes in fp32, the fastest form for ONNX Runtime). With this pass each one becomes

    Wq   [K, N]  the checkpoint's e4m3fn bytes, transposed once at write time
    S    [⌈N/bn⌉, ⌈K/bk⌉] float32, the checkpoint's scale grid as published
    W    = decode(Wq) · tile(S)          (in float32, then cast to the compute dtype)
    y    = MatMul(x, W)

`tile(S)` is Transpose → Unsqueeze → Expand → Reshape (→ Slice for a partial last tile): shape
arithmetic on a grid of a few hundred floats. `decode` depends on `storage`:

- `float8` (default): Wq is a float8e4m3fn initializer and decode is `Cast` (ai.onnx opset 19,
  IR version 9; ONNX Runtime runs it, the pass raises the models' opset and IR version to that);
- `bytes`: Wq is uint8 and decode is a `Gather` from the 256-entry e4m3fn table: opset 18 / IR 8,
  for compilers that cannot read FP8 tensors.

`scale_inputs` can then turn every S into a graph input (`<weight>.scale`), the default for FP8.
Dequantisation happens on every call: ONNX Runtime's CPU kernels never fuse an FP8 dequantise into
the MatMul. With scales as constants ORT folds the whole dequantisation at session load (float
weights in memory, the speed of a float model); with scales as inputs it cannot.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.pipeline import PassResult, RunContext, Workspace, register
from qwen2om.quant import fp8
from qwen2om.quantized import Fp8Weight
from qwen2om.weights import WeightRef

STORAGES = ("float8", "bytes")
WEIGHT_SUFFIX = ".weight_fp8"
SCALE_SUFFIX = ".weight_fp8_scale"  # scale_inputs finds FP8 scales by this suffix
FP8_OPSET, FP8_IR = 19, 9
STACK = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up|down)$")  # SparseMoE's expert stacks


def expert_stacks(graph: ir.Graph, ckpt: Any) -> Iterator[tuple[ir.Value, str, str, dict[str, list[Any]]]]:
    """Each MoE layer's float expert stack still in use (`gate_up` or `down`), with its layer prefix,
    which stack it is, and the checkpoint's quantised weight of each of its projections per expert
    (None where an expert's weight is not quantised); a snapshot, so the caller may rewrite as it goes."""
    for init in list(graph.initializers.values()):
        m = STACK.match(init.name or "")
        if m is None or not init.uses():
            continue
        p, which = m.group(1), m.group(2)
        projs = ("gate", "up") if which == "gate_up" else ("down",)
        yield init, p, which, {proj: [ckpt.quantized.get(f"{p}.experts.{e}.{proj}_proj.weight")
                                      for e in range(ckpt.dims.experts)] for proj in projs}


def const(graph: ir.Graph, name: str, value: np.ndarray) -> ir.Value:
    """A small inline constant, shared by name."""
    if name in graph.initializers:
        return graph.initializers[name]
    v = ir.Value(name=name, shape=ir.Shape(value.shape), type=ir.TensorType(ir.DataType.from_numpy(value.dtype)),
                 const_value=ir.tensor(value, name=name))
    graph.register_initializer(v)
    return v


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
            gathered = [LowerFp8.op(nodes, scope, "GatherND", v, idx) for v in (wq, *scales)]
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


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float().numpy()


@register
class LowerFp8:
    """FP8 MatMuls → e4m3fn weight + float32 block scale, dequantised in the graph (no-op for other models)."""

    name: ClassVar[str] = "lower_fp8"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "legal_graphs", "weights", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("fp8_lowered",)

    def __init__(self, storage: str = "float8", experts: bool = False) -> None:
        """`experts`: keep MoE experts FP8 in the graph (see lower_expert_stacks). Off by default: on
        ONNX Runtime's CPU kernels experts dequantised at conversion decode faster in less memory."""
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {', '.join(STORAGES)}, not {storage!r}")
        self.storage, self.experts = storage, bool(experts)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        ckpt = ws.need("checkpoint")
        weights, bindings = ws.need("weights")
        ws["fp8_lowered"] = True
        if not any(q.kind == "fp8" for q in ckpt.quantized.values()):
            return PassResult(False, {"lowered": 0})
        compute = ir.DataType.FLOAT if weights.dtype == torch.float32 else ir.DataType.FLOAT16
        self.raw = ckpt.raw
        lowered, stacks = 0, 0
        for model in ws.need("graphs").values():
            graph = model.graph
            for node, q in quantized_matmuls(graph, bindings, ckpt.quantized, Fp8Weight):
                w = node.inputs[1]
                dequantized = self.dequantize(graph, q, ckpt, weights, bindings, compute)
                node.replace_input_with(1, dequantized)
                if not w.uses():
                    graph.initializers.pop(w.name)
                lowered += 1
            if self.experts:
                stacks += self.lower_expert_stacks(ws, graph, ckpt, weights, bindings, compute)
            if self.storage == "float8":
                model.opset_imports[""] = max(model.opset_imports.get("", FP8_OPSET), FP8_OPSET)
                model.ir_version = max(model.ir_version or FP8_IR, FP8_IR)
        return PassResult(True, {"lowered": lowered, "expert_stacks": stacks, "storage": self.storage})

    # -- MoE expert stacks -------------------------------------------------------------------------
    def lower_expert_stacks(self, ws: Workspace, graph: ir.Graph, ckpt: Any, weights: Any,
                            bindings: dict[str, WeightRef], compute: ir.DataType) -> int:
        """Each FP8 MoE layer's `gate_up` [E, H, 2I] and `down` [E, I, H] stacks stay e4m3fn bytes (uint8,
        decoded by table: GatherND takes no float8 tensor), with one stacked float32 scale per
        projection ([E, ⌈N/bn⌉, ⌈K/bk⌉]: three per layer, not 3·E).
        Decode's GatherND of the k routed experts moves before the dequantisation, so a step
        dequantises k experts, not E; prefill's MatMul dequantises the whole stack."""
        done = 0
        for init, p, which, qs in expert_stacks(graph, ckpt):
            projs = tuple(qs)
            if not all(isinstance(q, Fp8Weight) for group in qs.values() for q in group):
                continue  # float (or int4) experts: the stack stays as converted
            wq = self.expert_bytes(graph, weights, bindings, p, which, qs, list(init.shape))
            scales = {proj: self.expert_scales(ws, graph, weights, bindings, p, proj, qs[proj], ckpt)
                      for proj in projs}
            scope = f"/{p}/{which}/fp8"
            replace_stack_uses(graph, init, scope, wq, list(scales.values()),
                               lambda nodes, w, ss, lead, scope=scope, projs=projs, qs=qs: self.stack_dequant(
                                   graph, nodes, scope, w, dict(zip(projs, ss, strict=True)), qs, lead, compute))
            done += 1
        return done

    def expert_bytes(self, graph: ir.Graph, weights: Any, bindings: dict[str, WeightRef], p: str, which: str,
                     qs: dict[str, list[Fp8Weight]], shape: list[int]) -> ir.Value:
        name = f"{p}.experts.{which}{WEIGHT_SUFFIX}"
        if name in graph.initializers:
            return graph.initializers[name]
        ckpt_raw = self.raw

        def part(e: int) -> torch.Tensor:  # the stack holds Wᵀ; gate and up side by side
            return torch.cat([ckpt_raw(qs[proj][e].name).view(torch.uint8).T for proj in qs], dim=1)

        # Always bytes: GatherND takes no float8 tensor (opset 19-23), and decode gathers first.
        v = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.UINT8))
        graph.initializers.add(v)
        weights.stored_stack(name, tuple(shape[1:]), [lambda e=e: part(e) for e in range(shape[0])])
        bindings[name] = WeightRef(name)
        return v

    def expert_scales(self, ws: Workspace, graph: ir.Graph, weights: Any, bindings: dict[str, WeightRef], p: str,
                      proj: str, qs: list[Fp8Weight], ckpt: Any) -> ir.Value:
        name = f"{p}.experts.{proj}_proj{SCALE_SUFFIX}"
        shape = [len(qs), *qs[0].scale_shape]
        v = derived_initializer(graph, bindings, weights, name, ir.DataType.FLOAT, shape,
                         lambda: torch.stack([q.scale(ckpt) for q in qs]).contiguous())
        ws.setdefault("stacked_scales", {})[name] = {
            "input": f"{p}.experts.{proj}_proj.weight.scale", "source": f"{p}.experts.*.{proj}_proj.weight_scale_inv",
            "module": f"{p}.experts.*.{proj}_proj", "weight": f"{p}.experts.*.{proj}_proj.weight", "shape": shape,
            "experts": len(qs), "block_size": list(qs[0].block), "scheme": "fp8", "format": qs[0].fmt,
            "values": lambda: torch.stack([q.scale(ckpt) for q in qs]).contiguous()}
        return v

    def stack_dequant(self, graph: ir.Graph, nodes: list[ir.Node], p: str, wq: ir.Value, scales: dict[str, ir.Value],
                      qs: dict[str, list[Fp8Weight]], lead: int, compute: ir.DataType) -> ir.Value:
        """decode(wq) · tiles, for stacks [*lead, K, N] whose scale grids are [*lead, gn, gk]."""
        tiles = [self.tile(graph, nodes, p, s, qs[proj][0], lead) for proj, s in scales.items()]
        tiled = tiles[0] if len(tiles) == 1 else self.op(nodes, p, "Concat", *tiles, axis=-1)
        decoded = self.op(nodes, p, "Gather", const(graph, "/fp8/e4m3fn_table", e4m3_table()),
                          self.op(nodes, p, "Cast", wq, to=ir.DataType.INT32.value))
        out = self.op(nodes, p, "Mul", decoded, tiled)
        return out if compute == ir.DataType.FLOAT else self.op(nodes, p, "Cast", out, to=compute.value)

    def tile(self, graph: ir.Graph, nodes: list[ir.Node], p: str, s: ir.Value, q: Fp8Weight, lead: int) -> ir.Value:
        """A scale grid [*lead, gn, gk] as the per-element scale of Wᵀ: [*lead, k, n]."""
        (gn, gk), (bn, bk) = q.scale_shape, q.block
        i64 = np.int64
        t = self.op(nodes, p, "Transpose", s, perm=[*range(lead), lead + 1, lead])
        u = self.op(nodes, p, "Unsqueeze", t, const(graph, f"/fp8/axes_{lead + 1}_{lead + 3}",
                                                   np.array([lead + 1, lead + 3], i64)))
        x = self.op(nodes, p, "Expand", u, const(graph, f"/fp8/tile_1x{bk}x1x{bn}", np.array([1, bk, 1, bn], i64)))
        r = self.op(nodes, p, "Reshape", x, const(graph, f"/fp8/keep{lead}_{gk * bk}x{gn * bn}",
                                                  np.array([0] * lead + [gk * bk, gn * bn], i64)))
        if (gk * bk, gn * bn) != (q.k, q.n):
            r = self.op(nodes, p, "Slice", r, const(graph, "/fp8/zeros_2", np.zeros(2, i64)),
                        const(graph, f"/fp8/ends_{q.k}x{q.n}", np.array([q.k, q.n], i64)),
                        const(graph, f"/fp8/axes_{lead}_{lead + 1}", np.array([lead, lead + 1], i64)))
        return r

    @staticmethod
    def op(nodes: list[ir.Node], p: str, kind: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
        attributes = [ir.AttrInt64(a, v) if isinstance(v, int) else ir.AttrInt64s(a, v)  # type: ignore[arg-type]
                      for a, v in attrs.items()]
        node = ir.Node("", kind, list(inputs), attributes, num_outputs=1, name=f"{p}/{kind}_{len(nodes)}")
        node.outputs[0].name = f"{p}/{kind}_{len(nodes)}_out"
        nodes.append(node)
        return node.outputs[0]

    def dequantize(self, graph: ir.Graph, q: Fp8Weight, ckpt: object, weights: object,
                   bindings: dict[str, WeightRef], compute: ir.DataType) -> ir.Value:
        """The nodes computing q's float weight [K, N] in the compute dtype, inserted at the top."""
        n, k, (bn, bk) = q.n, q.k, q.block
        gn, gk = q.scale_shape
        stored = ir.DataType.FLOAT8E4M3FN if self.storage == "float8" else ir.DataType.UINT8
        wq = derived_initializer(graph, bindings, weights, q.base + WEIGHT_SUFFIX, stored, [k, n],
                          lambda: ckpt.raw(q.name).T.contiguous().view(torch.uint8))  # type: ignore[attr-defined]
        s = derived_initializer(graph, bindings, weights, q.base + SCALE_SUFFIX, ir.DataType.FLOAT, [gn, gk],
                         lambda: q.scale(ckpt).contiguous())
        p = f"/{q.base}/fp8"
        nodes: list[ir.Node] = []

        def op(kind: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
            attributes = [ir.AttrInt64(a, v) if isinstance(v, int) else ir.AttrInt64s(a, v) for a, v in attrs.items()]
            node = ir.Node("", kind, list(inputs), attributes, num_outputs=1, name=f"{p}/{kind}_{len(nodes)}")
            node.outputs[0].name = f"{p}/{kind}_{len(nodes)}_out"
            nodes.append(node)
            return node.outputs[0]

        i64 = np.int64
        tiled = op("Reshape", op("Expand", op("Unsqueeze", op("Transpose", s, perm=[1, 0]),
                                              const(graph, "/fp8/axes_1_3", np.array([1, 3], i64))),
                                 const(graph, f"/fp8/tiles_{gk}x{bk}x{gn}x{bn}", np.array([gk, bk, gn, bn], i64))),
                      const(graph, f"/fp8/shape_{gk * bk}x{gn * bn}", np.array([gk * bk, gn * bn], i64)))
        if (gk * bk, gn * bn) != (k, n):  # a partial last tile
            tiled = op("Slice", tiled, const(graph, "/fp8/zeros_2", np.zeros(2, i64)),
                       const(graph, f"/fp8/ends_{k}x{n}", np.array([k, n], i64)))
        if self.storage == "float8":
            decoded = op("Cast", wq, to=ir.DataType.FLOAT.value)
        else:
            decoded = op("Gather", const(graph, "/fp8/e4m3fn_table", e4m3_table()),
                         op("Cast", wq, to=ir.DataType.INT32.value))
        out = op("Mul", decoded, tiled)
        if compute != ir.DataType.FLOAT:
            out = op("Cast", out, to=compute.value)
        out.shape, out.type = ir.Shape([k, n]), ir.TensorType(compute)
        graph.insert_before(graph.node(0), nodes)
        return out

