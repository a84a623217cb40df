"""RMSNorms as the NPU's own kernels: `npu::NPURmsNorm`, and `npu::NPUAddRmsNorm` with the residual Add.

The Ascend graphs carry each RMSNorm as a dozen standard ops (Cast to float32, Pow, ReduceMean, Add ε,
Sqrt, Div, Cast back, Mul by the weight; the hybrids' zero-centred norms add the weight to 1 first).
Every decoder layer has four (input, post-attention, and Qwen3's q/k norms) and the model a final one:

    s = Add(a, b);  y = RMSNorm(s)          (s also read by the next residual Add)
        becomes
    y, rstd, s = NPUAddRmsNorm(a, b, gamma)     where the SoC has the kernel, else
    y, rstd    = NPURmsNorm(s, gamma)

gamma is the norm's weight; for a zero-centred norm (the hybrids') it is the graph's own float32
`1 + w`, which RmsNorm takes with fp16 x on 910B (ATC folds it; cast to fp16 where a SoC's kernel
wants x's dtype), so such a norm keeps its Add apart (AddRmsNorm's gamma has x's dtype). The kernels'
ε is fixed at 1e-6 by CANN's plugins: a norm with another ε stays (kernels/npu_norm.py). A norm is
also left as it was, logged, when its region is not the RMSNorm pattern, or when the SoC's op-info
config has no kernel for its dtype (qwen2om/npu_kernels.py).
Gated norms (the linear-attention layers' `norm(x) · silu(z)`) are not RMSNorm regions and stay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from qwen2om.ascend import Soc, soc_info
from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import boundary, log_once, remove_unread
from qwen2om.kernels.npu_norm import EPSILON
from qwen2om.npu_kernels import NPU_DOMAIN, missing_kernel
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

SCOPE = QWEN_NAMES.rms_norm_scope_re()
CORE = ["Pow", "ReduceMean", "Add", "Sqrt", "Div"]
FLOATS = (ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.BFLOAT16)


def scalar(v: ir.Value | None) -> float | None:
    if v is None or v.const_value is None or v.const_value.size != 1:
        return None
    return float(np.asarray(v.const_value.numpy()).reshape(()))


def is_weight(v: ir.Value | None) -> bool:
    """A per-channel initializer (the norm's weight), not one of the region's scalar constants."""
    return (v is not None and v.is_initializer() and v.dtype in FLOATS and v.shape is not None
            and len(v.shape) == 1 and v.shape[0] != 1)


def norm_regions(graph: ir.Graph) -> dict[str, list[ir.Node]]:
    found: dict[str, list[ir.Node]] = {}
    for node in graph:
        if m := SCOPE.match(node.name or ""):
            found.setdefault(m.group(1), []).append(node)
    return found


class Norm:
    """One RMSNorm region read as (x, weight, ε, zero-centred, y), or the reason it is not one."""

    def __init__(self, graph: ir.Graph, nodes: list[ir.Node]) -> None:
        self.nodes, self.why = nodes, ""
        inputs, outputs = boundary(graph, nodes)
        kinds = [n.op_type for n in nodes]
        core = [k for k in kinds if k not in ("Cast", "Mul")]
        if len(inputs) != 1 or len(outputs) != 1:
            self.why = f"expected one input and one output, found {len(inputs)} and {len(outputs)}"
            return
        self.x, self.y = inputs[0], outputs[0]
        pow_ = next((n for n in nodes if n.op_type == "Pow"), None)
        mean = next((n for n in nodes if n.op_type == "ReduceMean"), None)
        weights = [v for n in nodes for v in n.inputs if is_weight(v)]
        self.zero_centred = core == [*CORE, "Add"]
        if core not in (CORE, [*CORE, "Add"]) or pow_ is None or mean is None or len(weights) != 1:
            self.why = f"not the RMSNorm pattern ({' '.join(kinds)})"
            return
        axes = mean.inputs[1] if len(mean.inputs) > 1 else None
        rank = len(self.x.shape) if self.x.shape is not None else None
        last = {-1, (rank or 0) - 1}
        if scalar(pow_.inputs[1]) != 2.0 or axes is None or axes.const_value is None or \
                [int(a) for a in axes.const_value.numpy().reshape(-1)] not in ([a] for a in last):
            self.why = "not a mean of squares over the last axis"
            return
        adds = [n for n in nodes if n.op_type == "Add"]
        self.eps = scalar(next((v for v in adds[0].inputs if scalar(v) is not None), None))
        self.weight = weights[0]
        if self.eps is None or self.x.dtype not in FLOATS or self.y.dtype != self.x.dtype:
            self.why = "no constant ε, or the norm changes the dtype"
            return
        if self.zero_centred:
            one = next((scalar(v) for v in adds[1].inputs if scalar(v) is not None), None)
            if one != 1.0:
                self.why = "a second Add that is not 1 + w"
                return
            self.gamma_source = adds[1].outputs[0]  # the graph's own 1 + w (float32)

    def gamma(self, graph: ir.Graph, before: ir.Node, scope: str, soc: Soc) -> ir.Value:
        """The kernel's gamma: the weight, or the region's float32 `1 + w` where the SoC's kernel takes a
        float32 gamma with this x (910B: the hybrid norm's own arithmetic), else cast to x's dtype."""
        source = self.gamma_source if self.zero_centred else self.weight
        if source.dtype == self.x.dtype or not missing_kernel("NPURmsNorm", soc, {"x": self.x.dtype,
                                                                                 "gamma": source.dtype}):
            return source
        cast = ir.Node("", "Cast", [source], [ir.AttrInt64("to", self.x.dtype)], num_outputs=1,
                       name=f"{scope}/gamma_Cast")
        cast.outputs[0].name = f"{scope}/gamma"
        cast.outputs[0].dtype, cast.outputs[0].shape = self.x.dtype, source.shape
        graph.insert_before(before, cast)
        return cast.outputs[0]


def residual_add(x: ir.Value) -> ir.Node | None:
    """The Add computing x from two activations of x's shape (a residual), if that is what x is."""
    node = x.producer()
    if node is None or node.op_type != "Add" or node.domain not in ("", "ai.onnx") or x.is_graph_output():
        return None
    a, b = node.inputs
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or a.is_initializer() or b.is_initializer():
        return None
    return node


@register
class FuseNormAscend:
    """RMSNorm regions (and the residual Add before each) → npu::NPURmsNorm / npu::NPUAddRmsNorm (Ascend)."""

    name: ClassVar[str] = "fuse_norm_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal")
    produces: ClassVar[tuple[str, ...]] = ("norms_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __init__(self, add: bool = True) -> None:
        """`add`: fold a residual Add into the norm that reads it (NPUAddRmsNorm) where the SoC has it."""
        self.add = bool(add)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        soc = soc_info(ctx.recipe.soc_version)
        stats: dict[str, int | float | str] = {}
        log = log_once(ctx.log)

        for kind, model in state.graphs.items():
            fused = with_add = kept = 0
            for scope, nodes in norm_regions(model.graph).items():
                done = self.fuse(model.graph, scope, Norm(model.graph, nodes), soc, log)
                fused += done > 0
                with_add += done > 1
                kept += done == 0
            if fused:
                model.opset_imports[NPU_DOMAIN] = 1
            stats |= {f"{kind}_fused_norms": fused, f"{kind}_add_rms_norms": with_add, f"{kind}_kept_norms": kept}
        return PassResult(any(v for k, v in stats.items() if k.endswith("_fused_norms")), stats)

    def fuse(self, graph: ir.Graph, scope: str, norm: Norm, soc: Soc, log: Callable[[str], None]) -> int:
        """0: left as it was (logged); 1: NPURmsNorm; 2: NPUAddRmsNorm with the residual Add."""
        if norm.why:
            log(f"{scope}: RMSNorm left in standard ops: {norm.why}")
            return 0
        if abs(norm.eps - EPSILON) > 1e-12:  # type: ignore[operator]
            log(f"{scope}: RMSNorm left in standard ops: its ε is {norm.eps:g}, and CANN's ONNX plugins fix "
                f"the kernels' ε at {EPSILON:g}")
            return 0
        why = missing_kernel("NPURmsNorm", soc, {"x": norm.x.dtype, "gamma": norm.x.dtype})
        if why:
            log(f"RMSNorm left in standard ops: {why}")
            return 0
        # before y's producer, not the region's first node: a zero-centred norm computes its `1 + w`
        # (the kernel's gamma) inside the region, after x's first use
        before = norm.y.producer() or norm.nodes[-1]
        gamma = norm.gamma(graph, before, scope, soc)
        residual = residual_add(norm.x) if self.add else None
        if residual is not None and gamma.dtype != norm.x.dtype:
            residual = None  # AddRmsNorm takes gamma in x's dtype only: the hybrid's float32 1 + w stays exact
        if residual is not None and (why := missing_kernel("NPUAddRmsNorm", soc, {"x1": norm.x.dtype})):
            log(f"residual Add kept apart from its RMSNorm: {why}")
            residual = None
        y = norm.y
        outputs = [ir.Value(name=f"{y.name}_npu", type=y.type, shape=y.shape),
                   ir.Value(name=f"{scope}/rstd", type=ir.TensorType(ir.DataType.FLOAT))]
        if residual is not None:
            total = norm.x
            outputs.append(ir.Value(name=f"{total.name}_npu", type=total.type, shape=total.shape))
            fused = ir.Node(NPU_DOMAIN, "NPUAddRmsNorm", [*residual.inputs, gamma], outputs=outputs,
                            name=f"{scope}/NPUAddRmsNorm")
        else:
            fused = ir.Node(NPU_DOMAIN, "NPURmsNorm", [norm.x, gamma], outputs=outputs, name=f"{scope}/NPURmsNorm")
        graph.insert_before(before, fused)
        y.replace_all_uses_with(outputs[0])
        if residual is not None:
            norm.x.replace_all_uses_with(outputs[2])
        remove_unread(graph, norm.nodes)
        if residual is not None:
            graph.remove(residual, safe=True)
            return 2
        return 1
