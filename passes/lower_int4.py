"""Lower int4-quantised linears to ONNX Runtime's MatMulNBits (target ort).

Up to here a quantised linear is an ordinary `MatMul(x, W)` whose weight initializer happens to
come from a compressed-tensors checkpoint (the representation stays target-neutral; the Ascend
target lowers the same MatMuls its own way). For ONNX Runtime each becomes
`com.microsoft::MatMulNBits(x, B, scales[, zero_points])`:

- B is `weight_packed` read as bytes, [N, K/block, block/2]: the same nibble order, no repacking;
- scales [N·K/block] in the compute dtype (MatMulNBits wants the activations' type);
- zero points, asymmetric only: uint8, two 4-bit blocks per byte along K (value + 8); symmetric
  weights use MatMulNBits' default zero point 8, which is compressed-tensors' offset.

`accuracy_level` 0 computes in the activations' float type (exact against the dequantised
weights); 4 lets ORT quantise activations to int8 per block for speed, at a small error.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir
import torch

from qwen2om.errors import Qwen2omError
from qwen2om.pipeline import PassResult, RunContext, Workspace, register
from qwen2om.quantized import Int4Weight
from qwen2om.weights import WeightRef

MS_DOMAIN = "com.microsoft"


@register
class LowerInt4:
    """Quantised MatMuls → com.microsoft::MatMulNBits with the checkpoint's int4 storage (no-op for float models)."""

    name: ClassVar[str] = "lower_int4"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "legal_graphs", "weights", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("int4_lowered",)

    def __init__(self, accuracy_level: int = 0) -> None:
        if accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0-4, not {accuracy_level}")
        self.accuracy_level = accuracy_level

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        ckpt = ws.need("checkpoint")
        weights, bindings = ws.need("weights")
        ws["int4_lowered"] = True
        if not any(q.kind == "int4" for q in ckpt.quantized.values()):
            return PassResult(False, {"lowered": 0})
        dtype = weights.dtype
        onnx_dtype = ir.DataType.FLOAT if dtype == torch.float32 else ir.DataType.FLOAT16
        lowered = 0
        for model in ws.need("graphs").values():
            graph = model.graph
            for node in list(graph):
                if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                    continue
                w = node.inputs[1]
                ref = bindings.get(w.name) if w is not None and w.is_initializer() else None
                q = ckpt.quantized.get(ref.source) if ref is not None and ref.transpose else None
                if not isinstance(q, Int4Weight):  # float, or FP8 (lower_fp8's)
                    continue
                if q.k % q.group or q.group < 16 or q.group & (q.group - 1):
                    raise Qwen2omError(f"{q.base}: MatMulNBits needs a power-of-two group ≥ 16 dividing K={q.k}; "
                                       f"this checkpoint has group {q.group}")
                blocks = q.k // q.group
                inputs = [node.inputs[0],
                          self.initializer(graph, bindings, weights, f"{q.base}.weight_nbits", ir.DataType.UINT8,
                                           [q.n, blocks, q.group // 2],
                                           lambda q=q: q.nbits_b(ckpt)),
                          self.initializer(graph, bindings, weights, f"{q.base}.weight_nbits_scale", onnx_dtype,
                                           [q.n * blocks],
                                           lambda q=q: q.unpacked(ckpt)[1].to(dtype).reshape(-1))]
                if q.has_zero_point:
                    inputs.append(self.initializer(graph, bindings, weights, f"{q.base}.weight_nbits_zero_point",
                                                   ir.DataType.UINT8, [q.n * ((blocks + 1) // 2)],
                                                   lambda q=q: q.nbits_zero_points(ckpt)))
                new = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, [
                    ir.AttrInt64("K", q.k), ir.AttrInt64("N", q.n), ir.AttrInt64("bits", 4),
                    ir.AttrInt64("block_size", q.group), ir.AttrInt64("accuracy_level", self.accuracy_level)],
                    num_outputs=1, name=(node.name or "").replace("MatMul", "MatMulNBits"))
                out, new_out = node.outputs[0], new.outputs[0]
                new_out.shape, new_out.type = out.shape, out.type
                graph.insert_before(node, new)
                if out.is_graph_output():  # an fp32 LM head's output is `logits` itself; first, or
                    idx = list(graph.outputs).index(out)  # replace_all_uses_with refuses
                    graph.outputs[idx] = new_out
                out.replace_all_uses_with(new_out)
                name = out.name
                graph.remove(node, safe=True)
                new_out.name = name
                if not w.uses():
                    graph.initializers.pop(w.name)
                lowered += 1
            model.opset_imports[MS_DOMAIN] = 1
        return PassResult(True, {"lowered": lowered, "accuracy_level": self.accuracy_level})

    @staticmethod
    def initializer(graph: ir.Graph, bindings: dict[str, WeightRef], weights: object, name: str,
                    dtype: ir.DataType, shape: list[int], produce: object) -> ir.Value:
        if name in graph.initializers:
            return graph.initializers[name]
        v = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
        graph.initializers.add(v)
        weights.derived[name] = produce  # type: ignore[attr-defined]
        bindings[name] = WeightRef(name)
        return v
