"""`scales: inputs`: quantisation scales leave the graph and become graph inputs.

Field engineers deploying on Ascend feed each layer's scales as separate inputs rather than baking
them into the compiled model. With `--scales inputs` every int4 MatMulNBits' scales become a
float32 graph input named `<weight>.scale` with the checkpoint's shape [N, K/group] (reshaped, and
cast for fp16 graphs, inside the graph), and the output directory gets:

- `scales.safetensors`: the values, float32, one tensor per input;
- `scale_map.json`: input name → source tensor, layer, module, shape, dtype, group size.

The runtime loads scales.safetensors once into buffers bound for every call. On ONNX Runtime this
is slower than constants (its int4 kernel cannot prepack what it does not see at load time); it is
the form other compilers take, and the default stays `constants`.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch
from safetensors.torch import save_file

from qwen2om.pipeline import PassResult, RunContext, Workspace, register
from qwen2om.signature import ROLE_SCALE, IOSpec

SCALE_MAP = "scale_map.json"
SCALES_FILE = "scales.safetensors"
NBITS_SCALE = ".weight_nbits_scale"


@register
class ScaleInputs:
    """With `scales: inputs`, turn each quantised MatMul's scales into a `<weight>.scale` graph input."""

    name: ClassVar[str] = "scale_inputs"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "signatures", "int4_lowered", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("scale_map",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        ckpt = ws.need("checkpoint")
        ws["scale_map"] = {}
        if ctx.recipe.scales != "inputs" or not ckpt.quantized:
            return PassResult(False, {"scale_inputs": 0})
        weights, bindings = ws.need("weights")
        entries: dict[str, dict[str, Any]] = {}
        values: dict[str, torch.Tensor] = {}
        for kind, model in ws.need("graphs").items():
            graph = model.graph
            inputs, outputs = ws["signatures"][kind]
            added: list[IOSpec] = []
            for node in list(graph):
                if node.op_type != "MatMulNBits":
                    continue
                init = node.inputs[2]
                if init is None or not init.is_initializer() or not (init.name or "").endswith(NBITS_SCALE):
                    continue
                base = init.name.removesuffix(NBITS_SCALE)
                q = ckpt.quantized[f"{base}.weight"]
                name = f"{base}.weight.scale"
                shape = [q.n, q.k // q.group]
                m = re.search(r"\blayers\.(\d+)\.", base)
                layer = int(m.group(1)) if m else None
                value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
                graph.inputs.append(value)
                flat = ir.Value(name=f"{name}/flat", shape=ir.Shape([q.n * shape[1]]), type=init.type)
                shape_init = ir.Value(name=f"{name}/shape", shape=ir.Shape([1]),
                                      type=ir.TensorType(ir.DataType.INT64),
                                      const_value=ir.tensor(np.array([q.n * shape[1]], dtype=np.int64)))
                graph.register_initializer(shape_init)
                reshape = ir.Node("", "Reshape", [value, shape_init], num_outputs=1, name=f"/{base}/scale/Reshape")
                new_nodes = [reshape]
                src = reshape.outputs[0]
                if init.dtype != ir.DataType.FLOAT:
                    cast = ir.Node("", "Cast", [src], [ir.AttrInt64("to", init.dtype.value)], num_outputs=1,
                                   name=f"/{base}/scale/Cast")
                    new_nodes.append(cast)
                    src = cast.outputs[0]
                src.name, src.shape, src.type = flat.name, flat.shape, flat.type
                graph.insert_before(node, new_nodes)
                node.replace_input_with(2, src)
                if not init.uses():
                    graph.initializers.pop(init.name)
                    weights.derived.pop(init.name, None)
                    bindings.pop(init.name, None)
                added.append(IOSpec(name, "float32", tuple(shape), ROLE_SCALE, layer))
                if name not in entries:
                    entries[name] = {"source": q.tensor("scale") if q.fmt != "ascendv1" else f"{base}.weight_scale",
                                     "layer": layer, "module": base, "weight": q.name, "shape": shape,
                                     "dtype": "float32", "group_size": q.group, "format": q.fmt}
                    values[name] = q.unpacked(ckpt)[1].float().contiguous()
            ws["signatures"][kind] = (inputs + added, outputs)
        stage = ctx.stage_dir
        save_file(dict(sorted(values.items())), str(stage / SCALES_FILE), metadata={"format": "pt"})
        (stage / SCALE_MAP).write_text(json.dumps(dict(sorted(entries.items())), indent=2) + "\n")
        ws["scale_map"] = entries
        return PassResult(True, {"scale_inputs": len(entries)})
