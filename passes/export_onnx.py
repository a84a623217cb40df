"""Export the static model with torch.onnx (dynamo) once per call shape: decode and prefill.

With prefill gears (`gears`, ATC --dynamic_dims), the prefill graph is exported once with a symbolic
token count T (torch.export Dim, T in [2, largest gear]; the mask's last axis is the derived P + T):
one ONNX graph that is valid at every gear, so ATC compiles each gear from it, and ONNX Runtime runs
it on CPU at any of them. The signature in the manifest stays at the largest gear (what the runtime
allocates); `graph_gears` says which graph takes which gears.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import onnx_ir as ir
import onnxscript.optimizer
import torch

from qwen2om.errors import Qwen2omError, caused_by_interrupt
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.replicate import TemplateError, layer_kinds, replicate_layers
from qwen2om.signature import IOSpec, graph_io, token_axes
from qwen2om.stages import Stage

NP_TO_TORCH = {"int64": torch.int64, "float32": torch.float32, "float16": torch.float16}
NP_DTYPES = {"fp32": "float32", "fp16": "float16"}


def call_shapes(recipe: object) -> dict[str, int]:
    """Graph kind → T. One graph when the prefill chunk is a single token."""
    c = int(recipe.prefill_chunk)  # type: ignore[attr-defined]
    return {"decode": 1} if c == 1 else {"decode": 1, "prefill": c}


def example_args(inputs: list[IOSpec], device: str = "cpu") -> tuple[object, ...]:
    tensors = [torch.zeros(s.shape, dtype=NP_TO_TORCH[s.dtype], device=device) for s in inputs]
    return (*tensors[:3], tuple(tensors[3:]))


def drop_meta_values(model: ir.Model) -> int:
    """Initializers traced from meta parameters carry no data: make them value-less placeholders."""
    n = 0
    for init in model.graph.initializers.values():
        raw = getattr(init.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.device.type == "meta":
            init.const_value = None
            n += 1
    return n


@contextlib.contextmanager
def quiet_exporter():  # type: ignore[no-untyped-def]
    """torch's exporter prints progress and warnings meant for its own developers; keep ours readable."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        # onnx_ir also warns once per value-less (meta) initializer, which is the point here.
        loggers = [logging.getLogger(n) for n in ("torch", "onnxscript", "onnx_ir")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


TOKENS_DIM = "T"  # the symbolic token axis of a gears graph, as named in the ONNX file


def dynamic_shapes(inputs: list[IOSpec], gears: Sequence[int]) -> list[Any]:
    """torch.export dynamic_shapes for a graph whose token axes (signature.token_axes) are symbolic.

    T's lower bound is 2, not the smallest gear: a trace is valid for the range it was traced over, and
    at T = 1 the model's Python takes the decode branches (MoE gathers its top-k experts). The ONNX
    graph has no such branch left, so it still computes correctly at a gear of 1."""
    tokens = max(gears)
    t = torch.export.Dim(TOKENS_DIM, min=2, max=tokens)
    shapes: list[Any] = []
    for s in inputs:
        axes = token_axes(s.role, s.shape, tokens)
        shapes.append({axis: t + off if off else t for axis, off in axes.items()} or None)
    # torch.onnx rewrites nested tuples in dynamic_shapes into lists: the cache goes in as a list.
    return [*shapes[:3], shapes[3:]]


def name_token_dim(model: ir.Model) -> int:
    """Rename the exporter's symbol for T (`s69`, `s69 + 256`) to `T` in every shape; returns how many dims."""
    ids = model.graph.inputs[0].shape  # input_ids [B, T], or a pipeline stage's hidden_in [B, T, hidden]
    sym = ids[1] if ids is not None and len(ids) in (2, 3) else None
    if not isinstance(sym, ir.SymbolicDim) or not sym.value:
        return 0
    pattern, n = re.compile(rf"\b{re.escape(sym.value)}\b"), 0
    values = [*model.graph.inputs, *model.graph.outputs, *(v for node in model.graph for v in node.outputs)]
    for v in values:
        if v.shape is None or not any(isinstance(d, ir.SymbolicDim) and d.value and pattern.search(d.value)
                                      for d in v.shape):
            continue
        dims = [ir.SymbolicDim(pattern.sub(TOKENS_DIM, d.value).replace(" ", ""))
                if isinstance(d, ir.SymbolicDim) and d.value else d for d in v.shape]
        v.shape = ir.Shape(dims)
        n += sum(isinstance(d, ir.SymbolicDim) for d in dims)
    return n


def export(model: torch.nn.Module, inputs: list[IOSpec], outputs: list[IOSpec], opset: int,
           gears: Sequence[int] = ()) -> ir.Model:
    """The ONNX graph of `model` at the signature's shapes; with `gears`, its token axes symbolic."""
    device = next(model.parameters()).device.type
    args = example_args(inputs, device)
    extra: dict[str, Any] = {}
    if gears:
        args = (*args[:3], list(args[3]))  # type: ignore[misc]
        extra["dynamic_shapes"] = dynamic_shapes(inputs, gears)
    with quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            model, args, dynamo=True, opset_version=opset,
            input_names=[s.name for s in inputs], output_names=[s.name for s in outputs],
            optimize=False, verify=False, **extra,
        )
        drop_meta_values(program.model)
        onnxscript.optimizer.optimize_ir(program.model)
    if gears:
        name_token_dim(program.model)
    return program.model


@register
class ExportOnnx:
    """torch.onnx.export(dynamo=True) of the static model, one graph per call shape.

    The model's parameters are meta tensors, so the trace holds no weights: the exporter's own
    optimizer cannot run on meta data, so it runs here after the placeholders are emptied.
    With `replicate` (the default) only the two-layer template is traced and its layer 1 is
    cloned for the others (qwen2om/replicate.py): export time and memory stay flat in the
    number of layers. If the template's graph is not shaped as expected, all layers are traced.
    """

    name: ClassVar[str] = "export_onnx"
    requires: ClassVar[tuple[str, ...]] = ("static_model", "template_model", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("graphs", "signatures", "graph_gears")

    def __init__(self, replicate: bool = True) -> None:
        self.replicate = replicate

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        full, template, ckpt, r = state.static_model, state.template_model, state.checkpoint, ctx.recipe
        dims, stage = ckpt.dims, ctx.stage or Stage.whole(ckpt.dims.layers)
        graphs, sigs, traced = {}, {}, {}
        shapes = call_shapes(r)
        # Prefill gears: the prefill graph's T is symbolic (the recipe made its chunk the largest gear).
        gear_map = {"prefill": list(r.gears)} if r.gears and "prefill" in shapes else {}
        for n, (kind, t) in enumerate(shapes.items()):
            gears = gear_map.get(kind, [])
            ctx.progress(f"exporting {kind} graph (T={t})", n, len(shapes))
            logits_t = 1 if (t == 1 or r.logits == "last") else t
            io = {"batch": r.batch_size, "t": t, "capacity": int(r.max_seq_len), "dtype": NP_DTYPES[r.dtype],
                  "logits_t": logits_t}
            inputs, outputs = graph_io(dims, **io, stage=stage)
            n_template, n_layers = len(template.model.layers), len(stage.layers)
            try:
                graph, traced[kind] = None, n_layers
                if self.replicate and n_template < n_layers:
                    small = graph_io(dims, **io, stage=dataclasses.replace(stage, stop=stage.start + n_template))
                    graph = export(template, *small, r.opset, gears)
                    try:
                        replicate_layers(graph, stage.stop, layer_kinds(dims))
                        traced[kind] = n_template
                    except TemplateError as e:
                        ctx.log(f"{kind} graph: cannot clone layers ({e}); tracing all {n_layers} layers instead")
                        graph = None
                if graph is None:
                    graph = export(full, inputs, outputs, r.opset, gears)
            except Exception as e:  # the exporter's own errors are long; keep the first line
                if caused_by_interrupt(e):
                    raise KeyboardInterrupt from e
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise Qwen2omError(f"torch.onnx.export failed for the {kind} graph: {first}") from e
            graphs[kind], sigs[kind] = graph, (inputs, outputs)
            ctx.progress(f"exporting {kind} graph (T={t})", n + 1, len(shapes))
        state.graphs, state.signatures, state.graph_gears = graphs, sigs, gear_map
        stats: dict[str, int | float | str] = {f"{k}_nodes": len(list(g.graph)) for k, g in graphs.items()}
        stats.update({f"{k}_gears": ",".join(map(str, g)) for k, g in gear_map.items()})
        stats.update({f"{k}_layers_traced": v for k, v in traced.items()})
        return PassResult(True, stats)
