"""Lower int4-quantised linears for the Ascend target (ONNX Runtime's are `lower_int4`'s).

Up to here a quantised linear is `MatMul(x, W)` with W read from the checkpoint (target-neutral).
Which Ascend form it becomes depends on the SoC (qwen2om/ascend.py, SOCS, `w4a16`):

- **910B / 910_93: `npu::WeightQuantBatchMatmulV2`**, CANN's weight-only quantised matmul,
  reached from ONNX through its parser plugin (origin type "npu::1::WeightQuantBatchMatmulV2"):

      Reshape(x → [M, K]) → WQBMM(x, W [K, N/8] int32, Transpose(S) [K/g, N], offset [K/g, N])
                          → Reshape([.., N])

  W holds the int4 values two's complement, 8 per int32 along N (kernels/ascend.py,
  pack_int4_int32; the layout torch_npu's int4 packing uses). The op adds its offset, so
  offset = −zero point; symmetric checkpoints have none. `antiquant_group_size` = the group.
  S is stored [N, K/g] as in the checkpoint and transposed in the graph (ATC folds the
  Transpose of a constant), so `scale_inputs` can make it the `<weight>.scale` input unchanged.
- **310B and 310P: no int4 matmul ONNX can reach** (310B has no WeightQuantBatchMatmulV2; 310P's
  takes only int8 weights in FRACTAL_NZ with transpose_weight, which the parser plugin forces off).
  With `weight_storage: int8` (explicit consent, see below) the same int4 values are stored one per
  int8 byte and dequantised by standard ops, `Cast` (int8 → fp16, exact for int4 values) +
  per-group offset `Add` and scale `Mul` + MatMul: **W8A16 storage**, twice the weight bytes of
  int4, the same numbers. Without consent the conversion stops. Not `AscendAntiQuant`: it takes
  only scalar scale/offset attributes, and its kernels are Ascend950-only (ops-nn) or, in older op
  info, int8 in the 5-D NC1HWC0 layout only, where these weights are 2-D. Not `npu::NPUAntiQuant`
  (AscendAntiQuantV2, tensor scales): its AI Core configs are ascend950/ascend350 only
  (hicann/ops-nn quant/ascend_anti_quant_v2/op_host/ascend_anti_quant_v2_def.cpp).

The activations must be fp16 (WeightQuantBatchMatmulV2 takes fp16/bf16 x): an fp32 graph with
int4 weights is refused with the fix named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
import torch

from qwen2om.ascend import soc_info
from qwen2om.errors import Qwen2omError
from qwen2om.graph_rewrite import NBITS_SCALE, const, derived_initializer, quantized_matmuls, replace_matmul
from qwen2om.kernels.ascend import NPU_DOMAIN, WQBMM, pack_int4_int32
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.quantized import Int4Weight, QuantWeight
from qwen2om.weights import WeightRef


def node_scope(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` → `/model/layers.3/self_attn/q_proj`: the exporter's naming, which
    every other pass (and keep_dtype.cfg) uses, so one layer's nodes sort and grep together."""
    return "/" + re.sub(r"/(\d+)(?=/|$)", r".\1", module.replace(".", "/"))


def int4_form(quantized: Mapping[str, QuantWeight], soc_version: str, weight_storage: str, *,
              fp16: bool) -> str | None:
    """The form int4 linears take on `soc_version`, "wqbmm" or "w8a16" (None: the checkpoint has
    none), or the refusal. Needs only the tensor table: `convert` asks it before any work too
    (qwen2om/convert.py, preflight), since this pass runs after the export."""
    if not any(isinstance(q, Int4Weight) for q in quantized.values()):
        return None
    form = "wqbmm" if soc_info(soc_version).w4a16 else "w8a16"
    if form == "w8a16" and weight_storage != "int8":
        raise Qwen2omError(
            f"{soc_version} has no int4 weight-quantised matmul an ONNX graph can reach (WeightQuantBatchMatmulV2 "
            "with int4 weights runs on 910B and 910_93), so this W4A16 checkpoint cannot run there as int4. Rerun with "
            "--set weight_storage=int8 to store the same int4 values as int8 and dequantise them in the graph "
            "(W8A16: twice the weight memory of int4), or choose a 910B/910_93 --soc-version.")
    if not fp16:
        raise Qwen2omError("int4 weights on Ascend need fp16 activations (WeightQuantBatchMatmulV2 takes fp16 "
                           "x): convert with --dtype fp16")
    return form


@register
class LowerInt4Ascend:
    """Quantised MatMuls → npu::WeightQuantBatchMatmulV2 (W4A16) or int8 + Cast/Add/Mul (W8A16, 310B/310P)."""

    name: ClassVar[str] = "lower_int4_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "weights", "bindings", "checkpoint")
    produces: ClassVar[tuple[str, ...]] = ("int4_lowered", "stacked_scales")
    modifies: ClassVar[tuple[str, ...]] = ("graphs", "weights", "bindings")

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        ckpt = state.checkpoint
        weights, bindings = state.weights, state.bindings
        state.start_scale_stacks()  # produced even when there is nothing to lower
        r = ctx.recipe
        form = int4_form(ckpt.quantized, r.soc_version, r.weight_storage, fp16=weights.dtype == torch.float16)
        if form is None:
            return PassResult(False, {"lowered": 0})
        lowered = 0
        for model in state.graphs.values():
            graph = model.graph
            for node, q in quantized_matmuls(graph, bindings, ckpt.quantized, Int4Weight):
                nodes: list[ir.Node] = []
                lower = self.wqbmm if form == "wqbmm" else self.w8a16
                replace_matmul(graph, node, nodes, lower(graph, nodes, q, node.inputs[0], ckpt, weights, bindings))
                lowered += 1
            if form == "wqbmm":
                model.opset_imports[NPU_DOMAIN] = 1
        return PassResult(True, {"lowered": lowered, "form": form, "soc": r.soc_version})

    # -- the two forms -------------------------------------------------------------------------
    @staticmethod
    def op(nodes: list[ir.Node], name: str, kind: str, *inputs: ir.Value | None, domain: str = "",
           **attrs: Any) -> ir.Value:
        node = ir.Node(domain, kind, list(inputs), [_attr(k, v) for k, v in attrs.items()], num_outputs=1,
                       name=name)
        nodes.append(node)
        return node.outputs[0]

    def operands(self, graph: ir.Graph, nodes: list[ir.Node], q: Int4Weight, ckpt: Any, weights: Any,
                 bindings: dict[str, WeightRef]) -> tuple[ir.Value, ir.Value | None]:
        """S [K/g, N] (via a Transpose of the checkpoint-shaped [N, K/g] initializer) and offset = −zp."""
        p = node_scope(q.base)
        s = derived_initializer(graph, bindings, weights, f"{q.base}{NBITS_SCALE}", ir.DataType.FLOAT16,
                                [q.n, q.k // q.group], lambda q=q: q.unpacked(ckpt)[1].to(torch.float16))
        scale = self.op(nodes, f"{p}/scale/Transpose", "Transpose", s, perm=[1, 0])
        scale.shape, scale.type = ir.Shape([q.k // q.group, q.n]), ir.TensorType(ir.DataType.FLOAT16)
        offset = None
        if q.has_zero_point:
            offset = derived_initializer(graph, bindings, weights, f"{q.base}.weight_ascend_offset",
                                         ir.DataType.FLOAT16, [q.k // q.group, q.n],
                                         lambda q=q: (-q.unpacked(ckpt)[2].float()).T.contiguous().to(torch.float16))
        return scale, offset

    def wqbmm(self, graph: ir.Graph, nodes: list[ir.Node], q: Int4Weight, x: ir.Value, ckpt: Any, weights: Any,
              bindings: dict[str, WeightRef]) -> ir.Value:
        p = node_scope(q.base)
        words = -(-q.n // 8)
        packed = derived_initializer(graph, bindings, weights, f"{q.base}.weight_int4x8", ir.DataType.INT32,
                                     [q.k, words], lambda q=q: torch.from_numpy(
                                         pack_int4_int32(q.unpacked(ckpt)[0].T.numpy())))
        scale, offset = self.operands(graph, nodes, q, ckpt, weights, bindings)
        flat = self.op(nodes, f"{p}/Reshape", "Reshape", x, const(graph, f"shape[-1,{q.k}]",
                                                                   np.array([-1, q.k], np.int64)))
        y = self.op(nodes, f"{p}/{WQBMM}", WQBMM, flat, packed, scale, offset, domain=NPU_DOMAIN,
                    antiquant_group_size=q.group, dtype=-1)
        # Back to x's leading dims. A prefill graph exported for gears has a symbolic T among them: one
        # symbolic dim is Reshape's -1; more than one are read from x at run time.
        lead = [d if isinstance(d, int) else -1 for d in x.shape[:-1]] if x.shape is not None else [-1]
        if lead.count(-1) > 1 and x.shape is not None:
            # Shape + Gather, not Shape(end=-1): CANN's Shape ignores start/end and returns every dim
            rank = len(x.shape)
            dims = self.op(nodes, f"{p}/Gather", "Gather", self.op(nodes, f"{p}/Shape", "Shape", x),
                           const(graph, f"shape_index{list(range(rank - 1))}", np.arange(rank - 1, dtype=np.int64)),
                           axis=0)
            shape = self.op(nodes, f"{p}/Concat", "Concat", dims,
                            const(graph, f"shape[{q.n}]", np.array([q.n], np.int64)), axis=0)
            return self.op(nodes, f"{p}/Reshape_1", "Reshape", y, shape)
        return self.op(nodes, f"{p}/Reshape_1", "Reshape", y,
                       const(graph, f"shape{lead + [q.n]}", np.array([*lead, q.n], np.int64)))

    def w8a16(self, graph: ir.Graph, nodes: list[ir.Node], q: Int4Weight, x: ir.Value, ckpt: Any, weights: Any,
              bindings: dict[str, WeightRef]) -> ir.Value:
        p = node_scope(q.base)
        stored = derived_initializer(graph, bindings, weights, f"{q.base}.weight_int8", ir.DataType.INT8,
                                     [q.k, q.n], lambda q=q: q.unpacked(ckpt)[0].T.contiguous())
        w = self.op(nodes, f"{p}/Cast", "Cast", stored, to=ir.DataType.FLOAT16)  # exact: |int4| ≤ 8
        scale, offset = self.operands(graph, nodes, q, ckpt, weights, bindings)
        if offset is not None:
            w = self.op(nodes, f"{p}/offset/Add", "Add", w, self.per_row(graph, nodes, f"{p}/offset", offset, q))
        w = self.op(nodes, f"{p}/scale/Mul", "Mul", w, self.per_row(graph, nodes, f"{p}/scale", scale, q))
        return self.op(nodes, f"{p}/MatMul", "MatMul", x, w)

    def per_row(self, graph: ir.Graph, nodes: list[ir.Node], p: str, v: ir.Value, q: Int4Weight) -> ir.Value:
        """[K/g, N] → [K, N]: each group's row repeated g times (K is a multiple of g for int4 checkpoints)."""
        groups = q.k // q.group
        e = self.op(nodes, f"{p}/Unsqueeze", "Unsqueeze", v, const(graph, "axes[1]", np.array([1], np.int64)))
        e = self.op(nodes, f"{p}/Expand", "Expand", e, const(graph, f"shape[{groups},{q.group},{q.n}]",
                                                              np.array([groups, q.group, q.n], np.int64)))
        return self.op(nodes, f"{p}/Reshape", "Reshape", e, const(graph, f"shape[{q.k},{q.n}]",
                                                                   np.array([q.k, q.n], np.int64)))


def _attr(name: str, value: Any) -> ir.Attr:
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    if isinstance(value, list):
        return ir.AttrInt64s(name, value)
    return ir.AttrInt64(name, int(value))
