"""`scales: inputs`: quantisation scales leave the graph and become graph inputs.

Field engineers deploying on Ascend feed each layer's scales as separate inputs rather than baking
them into the compiled model. With `--scales inputs` every quantised weight's scale becomes a
float32 graph input named `<weight>.scale` in the checkpoint's own shape — int4: [N, K/group]
(reshaped, and cast for fp16 graphs, inside the graph); FP8: the block grid [⌈N/bn⌉, ⌈K/bk⌉] —
and the output directory gets:

- `scales.safetensors`: the values, float32, one tensor per input;
- `scale_map.json`: input name → source tensor, layer, module, shape, dtype, block size.

The runtime loads scales.safetensors once into buffers bound for every call. `scales: auto` (the
default) means inputs for FP8 checkpoints, as deployments do, and constants for int4 ones: ONNX
Runtime's int4 kernel cannot prepack what it does not see at load time.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch
from safetensors.torch import save_file

from qwen2om.graph_rewrite import FP8_SCALE, NBITS_SCALE, scale_input
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.quantized import QuantWeight
from qwen2om.signature import ROLE_SCALE, IOSpec

SCALE_MAP = "scale_map.json"
SCALES_FILE = "scales.safetensors"


@register
class ScaleInputs:
    """With `scales: inputs`, turn each quantised MatMul's scales into a `<weight>.scale` graph input."""

    name: ClassVar[str] = "scale_inputs"
    # after both lowering passes: the scales it lifts are the initializers they leave in the graph
    requires: ClassVar[tuple[str, ...]] = ("graphs", "signatures", "weights", "bindings", "checkpoint",
                                           "stacked_scales", "int4_lowered", "fp8_lowered")
    produces: ClassVar[tuple[str, ...]] = ("scale_map",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "signatures", "weights", "bindings")

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt = state.checkpoint
        if state.scale_map is None:
            state.scale_map = {}
        mode = scale_mode(ctx.recipe.scales, ckpt.quantized)
        if mode != "inputs":
            return PassResult(False, {"scales": mode, "scale_inputs": 0})
        weights, bindings = state.weights, state.bindings
        entries: dict[str, dict[str, Any]] = {}
        values: dict[str, torch.Tensor] = {}
        stacked = (state.stacked_scales or {})  # MoE: one [E, ...] scale per layer and projection
        for kind, model in state.graphs.items():
            graph = model.graph
            inputs, outputs = state.signatures[kind]
            added: list[IOSpec] = []
            for init in list(graph.initializers.values()):
                base = next((init.name.removesuffix(sfx) for sfx in (NBITS_SCALE, FP8_SCALE)
                             if init.name.endswith(sfx)), None)
                if base is None or not init.uses():
                    continue
                if init.name in stacked:
                    info = stacked[init.name]
                    name, shape = info["input"], list(info["shape"])
                    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
                    graph.inputs.append(value)
                    init.replace_all_uses_with(value)
                    graph.initializers.pop(init.name)
                    weights.derived.pop(init.name, None)
                    bindings.pop(init.name, None)
                    layer = layer_of(base)
                    added.append(IOSpec(name, "float32", tuple(shape), ROLE_SCALE, layer))
                    if name not in entries:
                        entries[name] = {k: v for k, v in info.items() if k not in ("input", "values")} | {
                            "layer": layer, "dtype": "float32", "stacked": True}
                        values[name] = info["values"]()
                    continue
                q = ckpt.quantized[f"{base}.weight"]
                name = scale_input(base)
                value = ir.Value(name=name, shape=ir.Shape(list(q.scale_shape)), type=ir.TensorType(ir.DataType.FLOAT))
                graph.inputs.append(value)
                init.replace_all_uses_with(self.adapt(graph, value, init, base))
                graph.initializers.pop(init.name)
                weights.derived.pop(init.name, None)
                bindings.pop(init.name, None)
                layer = layer_of(base)
                added.append(IOSpec(name, "float32", tuple(q.scale_shape), ROLE_SCALE, layer))
                if name not in entries:
                    entries[name] = entry(q, layer)
                    values[name] = q.scale_values(ckpt)
            state.signatures[kind] = (inputs + added, outputs)
        if not entries:  # nothing left to lift (a second run): the files written stay as they are
            return PassResult(False, {"scales": mode, "scale_inputs": len(state.scale_map)})
        stage = ctx.stage_dir
        save_file(dict(sorted(values.items())), str(stage / SCALES_FILE), metadata={"format": "pt"})
        (stage / SCALE_MAP).write_text(json.dumps(dict(sorted(entries.items())), indent=2) + "\n")
        state.scale_map = entries
        return PassResult(True, {"scales": mode, "scale_inputs": len(entries)})

    @staticmethod
    def adapt(graph: ir.Graph, value: ir.Value, init: ir.Value, base: str) -> ir.Value:
        """`value` (float32, the checkpoint's shape) in the shape and dtype `init` had."""
        nodes, src = [], value
        if list(init.shape) != list(value.shape):
            shape_init = ir.Value(name=f"{value.name}/shape", shape=ir.Shape([len(init.shape)]),
                                  type=ir.TensorType(ir.DataType.INT64),
                                  const_value=ir.tensor(np.array(list(init.shape), dtype=np.int64)))
            graph.register_initializer(shape_init)
            nodes.append(ir.Node("", "Reshape", [src, shape_init], num_outputs=1, name=f"/{base}/scale/Reshape"))
            src = nodes[-1].outputs[0]
        if init.dtype != ir.DataType.FLOAT:
            nodes.append(ir.Node("", "Cast", [src], [ir.AttrInt64("to", init.dtype.value)], num_outputs=1,
                                 name=f"/{base}/scale/Cast"))
            src = nodes[-1].outputs[0]
        if nodes:
            src.name, src.shape, src.type = f"{value.name}/graph", init.shape, init.type
            graph.insert_before(graph.node(0), nodes)
        return src


def scale_mode(setting: str, quantized: dict[str, QuantWeight]) -> str:
    """`auto` → inputs for FP8 checkpoints, constants otherwise; float models have no scales."""
    if not quantized:
        return "none"
    if setting == "auto":
        return "inputs" if any(q.auto_scales == "inputs" for q in quantized.values()) else "constants"
    return setting


def layer_of(base: str) -> int | None:
    m = re.search(r"\blayers\.(\d+)\.", base)
    return int(m.group(1)) if m else None


def entry(q: QuantWeight, layer: int | None) -> dict[str, Any]:
    """scale_map.json's record of one scale input."""
    e: dict[str, Any] = {"source": q.scale_name, "layer": layer, "module": q.base, "weight": q.name,
                         "shape": list(q.scale_shape), "dtype": "float32", "scheme": q.kind, "format": q.fmt}
    return e | q.scale_grid()
