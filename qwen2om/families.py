"""Model families as data: what converting each kind of Qwen decoder takes.

An architecture (qwen2om/arch.py) names its family; the family entry says which static model the
`static_model` pass builds, which decoder layer and final norm layerwise calibration runs and how a
layer starts a sequence, how the RoPE tables are computed, AWQ's scaling groups, whether one graph
can serve several prefill lengths, and how its tensors are named. Callers write
`family_of(arch).static_model(...)`, never a branch on the architecture:

- `dense`: Qwen2 / Qwen2.5, Qwen3, Qwen2-MoE, Qwen3-MoE (static_model.py);
- `hybrid`: Qwen3.5 / Qwen3-Next, dense or MoE: Gated DeltaNet linear attention between gated
  full-attention layers, zero-centred norms, partial RoPE (static_hybrid.py).

Hugging Face tensor names (which the static model's parameters and the graph's initializers keep),
the static model's stacked expert weights and the exporter's node scopes are spelled by
`TensorNames` here and by the checkpoint readers (arch.py, checkpoint.py), nowhere else in the
converter: tests/test_family_registry.py looks for them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from qwen2om.arch import EMBED, ArchSpec, ModelDims
from qwen2om.registry import Registry
from qwen2om.rope import rope_tables
from qwen2om.static_hybrid import HybridLayer, StaticHybrid, ZeroCentredRMSNorm, hybrid_rope_tables, state_shapes
from qwen2om.static_model import DecoderLayer, RMSNorm, StaticLM, StaticQwen
from qwen2om.weights import Weights


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """How a family names its tensors and modules. `mlp` arguments are a layer's MLP prefix
    (`model.layers.3.mlp`, from `mlp()`); `proj` is "gate", "up" or "down"; `which` is one of the
    static model's expert stacks, "gate_up" (gate ‖ up) or "down"."""

    embed: str = EMBED
    final_norm: str = "model.norm"  # a module: its weight is `model.norm.weight`

    EXPERT: ClassVar[re.Pattern[str]] = re.compile(
        r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
    FUSED: ClassVar[re.Pattern[str]] = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up|down)_proj$")
    STACK: ClassVar[re.Pattern[str]] = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up|down)$")
    FUSED_SUFFIXES: ClassVar[tuple[str, ...]] = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    ANY_EXPERT: ClassVar[re.Pattern[str]] = re.compile(r"\.mlp\.experts\.(\d+\.|gate_up_proj$|down_proj$)")

    def head_count(self, name: str, dims: ModelDims) -> int:
        """How many attention heads a weight's output rows are (q_proj: heads, k/v_proj: kv heads), else 0."""
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        return {"q_proj": dims.heads, "k_proj": dims.kv_heads, "v_proj": dims.kv_heads}.get(module, 0)

    def is_expert_tensor(self, name: str) -> bool:
        """Any stored tensor of the routed experts: one expert's (a weight, its scales) or a fused stack."""
        return bool(self.ANY_EXPERT.search(name))

    def layer(self, i: int) -> str:
        """Decoder layer `i`'s module: `model.layers.3`."""
        return f"model.layers.{i}"

    def input_norm(self, i: int) -> str:
        """Layer `i`'s input RMSNorm weight."""
        return f"{self.layer(i)}.input_layernorm.weight"

    def mlp(self, i: int) -> str:
        return f"{self.layer(i)}.mlp"

    # -- MoE experts: as published, fused 3-D (transformers 5), and as the static model stacks them
    def experts(self, mlp: str) -> str:
        """The routed experts' module (static_model.RoutedExperts)."""
        return f"{mlp}.experts"

    def expert_module(self, mlp: str, proj: str, e: int | str = "*") -> str:
        """Expert `e`'s projection module; `*`: every expert's (scale_map.json's entry for a stack)."""
        return f"{mlp}.experts.{e}.{proj}_proj"

    def expert(self, mlp: str, e: int | str, proj: str) -> str:
        """Expert `e`'s weight as published, one tensor per expert: `….mlp.experts.7.gate_proj.weight`."""
        return f"{self.expert_module(mlp, proj, e)}.weight"

    def parse_expert(self, name: str) -> tuple[str, int, str] | None:
        """(mlp, expert, proj) of a per-expert weight's name; None for any other tensor."""
        m = self.EXPERT.match(name)
        return (m.group(1), int(m.group(2)), m.group(3)) if m else None

    def parse_fused(self, name: str) -> tuple[str, str] | None:
        """(mlp, which) of a fused 3-D expert tensor (`….mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`)."""
        m = self.FUSED.match(name)
        return (m.group(1), m.group(2)) if m else None

    def is_fused(self, name: str) -> bool:
        """A fused 3-D expert tensor, wherever its model puts its layers (transformers' own state dicts)."""
        return name.endswith(self.FUSED_SUFFIXES)

    def unfused(self, fused: str, e: int) -> dict[str, str]:
        """Expert `e`'s per-expert weights inside the fused tensor `fused`, in its row order: proj → name."""
        experts, which = fused.rsplit(".", 1)
        projs = ("gate", "up") if which == "gate_up_proj" else ("down",)
        return {proj: f"{experts}.{e}.{proj}_proj.weight" for proj in projs}

    def stack(self, mlp: str, which: str) -> str:
        """The static model's [E, ...] parameter holding every expert's `which` weights."""
        return f"{mlp}.experts.{which}"

    def parse_stack(self, name: str) -> tuple[str, str] | None:
        """(mlp, which) of a static expert stack's name; None for any other tensor."""
        m = self.STACK.match(name)
        return (m.group(1), m.group(2)) if m else None

    def stacked_proj(self, mlp: str, proj: str) -> str:
        """One projection of every expert: the base name of the [E, ...] tensors derived from it (scales)."""
        return f"{mlp}.experts.{proj}_proj"

    # -- the exporter's node scopes (`/model/layers.3/self_attn/rotary/Mul`), which fusion passes match
    def attention_scope(self, layer: int, module: str) -> str:
        """The node scope of `module` (static_model's `rotary`, `cache_attention`) in layer's full attention."""
        return f"/model/layers.{layer}/self_attn/{module}"

    def attention_scope_re(self, module: str) -> re.Pattern[str]:
        """Nodes inside `module` of any layer's full attention; group 1 is the layer."""
        return re.compile(rf"^/model/layers\.(\d+)/self_attn/{re.escape(module)}/")

    def experts_scope(self, layer: int) -> str:
        return f"/model/layers.{layer}/mlp/experts"

    def experts_scope_re(self) -> re.Pattern[str]:
        """Nodes inside any layer's routed experts; group 1 is the layer."""
        return re.compile(r"^/model/layers\.(\d+)/mlp/experts/")

    def norm_scope_re(self) -> re.Pattern[str]:
        """Nodes inside a decoder layer's two RMSNorms or the final one; group 1 is the norm's scope."""
        return re.compile(r"^(/model/layers\.\d+/(input|post_attention)_layernorm|/model/norm)/")

    def rms_norm_scope_re(self) -> re.Pattern[str]:
        """Nodes inside any RMSNorm of the standard form: a layer's two, full attention's q/k norms, the
        final one (not the linear-attention layers' gated norm); group 1 is the norm's scope."""
        return re.compile(r"^(/model/layers\.\d+/(?:input_layernorm|post_attention_layernorm|self_attn/[qk]_norm)"
                          r"|/model/norm)/")


# Every family registered today keeps the Hugging Face Qwen layout. Graph passes that match node scopes
# (they have no checkpoint at hand) use this directly.
QWEN_NAMES = TensorNames()

# AWQ's scaling groups: (the module whose output feeds them, the linears sharing that input), as paths
# inside a decoder layer. In a hybrid they apply to the full-attention layers (v → o still commutes
# with the per-channel output gate) and the dense MLPs; linear attention's projections have none.
QWEN_AWQ_GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                   ("self_attn.v_proj", ("self_attn.o_proj",)),
                   ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                   ("mlp.up_proj", ("mlp.down_proj",)))

Layer = DecoderLayer | HybridLayer
RopeTables = Callable[[dict[str, Any], ModelDims, int], tuple[torch.Tensor, torch.Tensor]]
FirstCall = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ModelDims], torch.Tensor]


class StaticModelClass(Protocol):
    def __call__(self, arch: ArchSpec, d: ModelDims, w: Weights, cos: torch.Tensor, sin: torch.Tensor, *,
                 logits_last: bool, layers: int | None = None, fused_experts: bool = False) -> StaticLM: ...


class LayerClass(Protocol):
    def __call__(self, arch: ArchSpec, d: ModelDims, w: Weights, p: str, layer: int, *, fused: bool) -> Layer: ...


@dataclasses.dataclass(frozen=True)
class Family:
    """What converting one family of architectures takes."""

    name: str
    static_model: StaticModelClass  # the exported forward: (arch, dims, weights, cos, sin, *, logits_last, ...)
    layer: LayerClass  # one decoder layer, as layerwise calibration builds it
    norm: type[RMSNorm]  # the final norm (the layers' own are the same kind)
    # cos, sin [positions, rotary dim] float32 from config.json and its dims; refuses what it cannot build
    rope_tables: RopeTables
    # A layer over a sequence's first tokens (layerwise calibration): x, cos, sin, mask → its output
    first_call: FirstCall
    awq_groups: tuple[tuple[str, tuple[str, ...]], ...]
    # One graph with a symbolic T serves several prefill lengths ("gears")
    prefill_gears: bool
    names: TensorNames = QWEN_NAMES


def whole_head_rope(cfg: dict[str, Any], d: ModelDims, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rope.rope_tables: every static RoPE type transformers knows, on the whole head (the dims are not needed)."""
    return rope_tables(cfg, positions)


def empty_cache(d: ModelDims, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-attention layer's past key and value before a sequence's first tokens: capacity 0."""
    empty = torch.zeros(1, d.kv_heads, 0, d.head_dim, dtype=x.dtype)
    return empty, empty


def dense_first_call(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                     d: ModelDims) -> torch.Tensor:
    return layer(x, cos, sin, mask, *empty_cache(d, x))[0]


def hybrid_first_call(layer: HybridLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor, d: ModelDims) -> torch.Tensor:
    """No pad rows (valid = None); linear attention from zero conv (compute dtype) and recurrent (float32) states."""
    if not layer.linear:
        return layer(x, cos, sin, mask, None, *empty_cache(d, x))[0]
    conv, rec = state_shapes(d, x.shape[0])
    return layer(x, cos, sin, mask, None, torch.zeros(conv, dtype=x.dtype), torch.zeros(rec))[0]


FAMILIES: Registry[Family] = Registry("model family")

DENSE = FAMILIES.add(Family("dense", StaticQwen, DecoderLayer, RMSNorm, whole_head_rope, dense_first_call,
                            QWEN_AWQ_GROUPS, prefill_gears=True))
# The chunked delta rule splits a prefill chunk into blocks by its length (static_hybrid.py), so one graph
# cannot serve every gear.
HYBRID = FAMILIES.add(Family("hybrid", StaticHybrid, HybridLayer, ZeroCentredRMSNorm, hybrid_rope_tables,
                             hybrid_first_call, QWEN_AWQ_GROUPS, prefill_gears=False))


def family_of(arch: ArchSpec) -> Family:
    """The family an architecture names (an unknown name lists the registered ones)."""
    return FAMILIES.get(arch.family)
