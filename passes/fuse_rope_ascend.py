"""RoPE as the NPU's own kernel: `npu::NPURotaryPositionEmbedding` (mode 0, rotate_half).

Each full-attention layer's `self_attn.rotary` rotates q and k in a dozen standard ops per operand
(Mul by cos, two Slices, Neg, Concat, Mul by sin, Add); CANN has a kernel for the whole formula:

    y = Add(Mul(x, cos), Mul(Concat(Neg(x[..., D/2:]), x[..., :D/2]), sin))
        becomes
    y = NPURotaryPositionEmbedding(x, cos, sin; mode=0)

x is q or k [B, T, heads, D] (BSND) and cos/sin the graph's position-gathered tables [B, T, 1, D] in
x's dtype, from which the kernel infers the layout. Facts (the table's
`_constraints.ops.NPURotaryPositionEmbedding`, from CANN's plugin, proto and tiling; kernels/npu_rope.py):
the ONNX plugin refuses a node without the INT attribute `mode` (0 = half); cos/sin have x's full
last dim and dtype; D must be even and at most the SoC's `max_head_dim` (896 on 910B/910_93); the
half-mode kernel takes B and N below 1000 on A2/A3. The op has no partial rotary: for Qwen3.5
(partial_rotary_factor) the exporter already rotates `x[..., :R]` with width-R tables and concatenates
`x[..., R:]`, so only the rotation between that Slice and Concat becomes the kernel.

A layer is left in standard ops, logged, when its region is not this pattern, when the SoC's op-info
config has no kernel for x's dtype (qwen2om/npu_kernels.py; e.g. 310B has none), or when D exceeds
the limit. The shared cos/sin Transposes the exporter puts in the first layer's scope stay.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

from qwen2om.ascend import Soc, soc_info
from qwen2om.cann import load_table
from qwen2om.families import QWEN_NAMES
from qwen2om.graph_rewrite import derived_from, is_constant, log_once, regions
from qwen2om.kernels.npu_rope import HALF, ROPE
from qwen2om.npu_kernels import NPU_DOMAIN, missing_kernel
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

ROTARY = QWEN_NAMES.attention_scope_re("rotary")
# Half mode on A2/A3 takes B, N < 1000: mirror-cann/ops-transformer:posembedding/rotary_position_embedding/
# docs/aclnnRotaryPositionEmbedding.md@3a280bcc34d8716c477c5506f3e507c1d0ea3214#L302-309
MAX_BN = 1000


def ints(v: ir.Value | None) -> list[int] | None:
    if v is None or v.const_value is None:
        return None
    return [int(i) for i in v.const_value.numpy().reshape(-1)]


def producer(v: ir.Value | None, op: str, members: set[ir.Node]) -> ir.Node | None:
    node = v.producer() if v is not None else None
    return node if node is not None and node in members and node.op_type == op and node.domain in ("", "ai.onnx") \
        else None


def half_of(node: ir.Node | None, x: ir.Value, d: int) -> str | None:
    """'low' for Slice(x)[..., :D/2], 'high' for [..., D/2:] on the last axis, else None."""
    if node is None or node.inputs[0] is not x or len(node.inputs) < 4:
        return None
    starts, ends, axes = (ints(v) for v in node.inputs[1:4])
    steps = ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    if axes not in ([-1], [len(x.shape or []) - 1]) or steps != [1] or not starts or not ends:
        return None
    if starts == [0] and ends == [d // 2]:
        return "low"
    return "high" if starts == [d // 2] and ends[0] >= d else None


class Rotation:
    """One `x·cos + rotate_half(x)·sin` ending at the Add `add`, read as (x, cos, sin), or why not."""

    def __init__(self, add: ir.Node, members: set[ir.Node], positions: ir.Value) -> None:
        self.add, self.why = add, ""
        muls = [producer(v, "Mul", members) for v in add.inputs]
        if len(muls) != 2 or None in muls:
            self.why = "an Add that is not the sum of two Muls"
            return
        parts: dict[str, tuple[ir.Value, ir.Value]] = {}  # "cos"/"sin" → (operand, table)
        for mul in muls:
            tables = [v for v in mul.inputs if v is not None and derived_from(v, positions)]  # type: ignore[union-attr]
            other = [v for v in mul.inputs if v is not None and v not in tables]  # type: ignore[union-attr]
            if len(tables) != 1 or len(other) != 1:
                self.why = "a Mul that does not read exactly one position-derived table"
                return
            role = "sin" if producer(other[0], "Concat", members) is not None else "cos"
            parts[role] = (other[0], tables[0])
        if set(parts) != {"cos", "sin"}:
            self.why = "not one Mul by cos and one by rotate_half · sin"
            return
        (self.x, self.cos), (rotated, self.sin) = parts["cos"], parts["sin"]
        shape = self.x.shape
        if shape is None or len(shape) != 4 or not isinstance(shape[-1], int):
            self.why = f"x is not [B, T, heads, D] with a static D ({shape})"
            return
        self.d = d = shape[-1]
        concat = producer(rotated, "Concat", members)
        axis = concat.attributes.get_int("axis") if concat is not None else None
        if concat is None or axis not in (-1, 3) or len(concat.inputs) != 2:
            self.why = "rotate_half is not a Concat on the last axis"
            return
        neg = producer(concat.inputs[0], "Neg", members)
        high = half_of(producer(neg.inputs[0], "Slice", members) if neg is not None else None, self.x, d)
        low = half_of(producer(concat.inputs[1], "Slice", members), self.x, d)
        if d % 2 or (high, low) != ("high", "low"):
            self.why = "rotate_half is not Concat(−x[..., D/2:], x[..., :D/2])"
            return
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            if t.dtype != self.x.dtype or t.shape is None or len(t.shape) != 4 or t.shape[-1] != d or \
                    any(c != 1 and c != s for c, s in zip(t.shape, shape, strict=True)):
                self.why = f"{name} {t.shape} {t.dtype} is not x's dtype and full width, broadcasting to x {shape}"
                return
        heads = [s for c, s in zip(self.cos.shape[:-1], shape[:-1], strict=True) if c == 1 and s != 1]  # type: ignore[index]
        if any(isinstance(s, int) and s >= MAX_BN for s in (shape[0], *heads)):
            self.why = f"B and N must be below {MAX_BN} for the half-mode kernel (x {shape})"


@register
class FuseRopeAscend:
    """RoPE regions (rotate_half) → npu::NPURotaryPositionEmbedding, mode 0 (Ascend)."""

    name: ClassVar[str] = "fuse_rope_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal")
    produces: ClassVar[tuple[str, ...]] = ("rope_fused",)
    modifies: ClassVar[tuple[str, ...]] = ("graphs",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        soc = soc_info(ctx.recipe.soc_version)
        limit = load_table().constraints.get(ROPE, {}).get("params", {}).get("max_head_dim", {}).get(soc.kernels)
        stats: dict[str, int | float | str] = {}
        log = log_once(ctx.log)

        for kind, model in state.graphs.items():
            fused = kept = 0
            positions = next((v for v in model.graph.inputs if v.name == "position_ids"), None)
            for layer, region in regions(model.graph, scope=ROTARY).items():
                found = self.rotations(region, positions)
                if found is None:
                    continue
                if isinstance(found, str):
                    log(f"{kind} graph, layer {layer}: RoPE left in standard ops: {found}")
                    kept += 1
                    continue
                if why := next(filter(None, (self.unsupported(r, soc, limit) for r in found)), None):
                    log(f"RoPE left in standard ops: {why}")  # the same for every layer: once
                    kept += 1
                    continue
                self.fuse(model.graph, layer, region, found)
                fused += 1
            if fused:
                model.opset_imports[NPU_DOMAIN] = 1
            stats |= {f"{kind}_fused_rope": fused, f"{kind}_kept_rope": kept}
        return PassResult(any(v for k, v in stats.items() if k.endswith("_fused_rope")), stats)

    @staticmethod
    def rotations(region: list[ir.Node], positions: ir.Value | None) -> list[Rotation] | str | None:
        """The region's rotations (q's and k's), or why it is not the pattern; None when nothing is
        left to fuse (a second run sees only the kernels and the shared Slices and Transposes)."""
        members = set(region)
        # the rotations' Adds; with prefill gears the region also adds shape values (constants)
        adds = [n for n in region if n.op_type == "Add" and n.domain in ("", "ai.onnx")
                and not all(is_constant(v) for v in n.inputs)]
        if not adds and any(n.op_type == ROPE and n.domain == NPU_DOMAIN for n in region):
            return None
        if not adds or positions is None:
            return "no x·cos + rotate_half(x)·sin reading position_ids in the region"
        found = [Rotation(add, members, positions) for add in adds]
        return next((r.why for r in found if r.why), None) or found

    @staticmethod
    def unsupported(r: Rotation, soc: Soc, limit: int | None) -> str | None:
        if why := missing_kernel(ROPE, soc, {"x": r.x.dtype, "cos": r.cos.dtype}):
            return why
        if limit is not None and r.d > limit:
            return f"head dim {r.d} exceeds the {soc.family} kernel's limit of {limit}"
        return None

    @staticmethod
    def fuse(graph: ir.Graph, layer: int, region: list[ir.Node], rotations: list[Rotation]) -> None:
        scope = QWEN_NAMES.attention_scope(layer, "rotary")
        renamed: list[tuple[ir.Value, str]] = []  # a graph output keeps its name, once the old value is gone
        for i, r in enumerate(rotations):
            y = r.add.outputs[0]
            out = ir.Value(name=f"{y.name}_npu", type=y.type, shape=y.shape)
            graph.insert_before(r.add, ir.Node(NPU_DOMAIN, ROPE, [r.x, r.cos, r.sin], [ir.AttrInt64("mode", HALF)],
                                               outputs=[out], name=f"{scope}/{ROPE}" + (f"_{i}" if i else "")))
            if y.is_graph_output():
                renamed.append((out, y.name))  # type: ignore[arg-type]
            y.replace_all_uses_with(out, replace_graph_outputs=True)
        # The region's dead nodes, then the small constants (slice bounds) only they read
        freed: set[ir.Value] = set()
        for n in reversed(region):
            if not any(v.uses() or v.is_graph_output() for v in n.outputs):
                freed.update(v for v in n.inputs if v is not None and v.is_initializer())
                graph.remove(n, safe=True)
        for v in freed:
            if not v.uses() and not v.is_graph_output() and v.const_value is not None and v.const_value.size <= 16:
                graph.initializers.pop(v.name)  # type: ignore[arg-type]
        for out, name in renamed:
            out.name = name
