"""Architecture facts as data: what each supported Hugging Face Qwen family looks like.

An :class:`ArchSpec` says which tensors a checkpoint of that family holds and how the static
model treats them; :class:`ModelDims` carries the sizes read from one checkpoint's config.
Qwen3 is Qwen2 with the QKV bias dropped and a per-head RMSNorm on q and k. The Qwen3.5 /
Qwen3-Next hybrids are Qwen3 with most layers swapped for Gated DeltaNet linear attention
(`layer_types`), gated full attention, partial RoPE and zero-centred norms.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Collection, Iterable
from typing import Any

from qwen2om.errors import CheckpointError
from qwen2om.registry import Registry

# Tensors that always stay floating point, whatever the precision recipe says (norms, RoPE
# tables, router gates, embeddings): quantising them turns the output into repeated garbage.
KEEP_FLOAT = (
    r".*norm\.weight$",
    r".*rotary_emb\.inv_freq$",
    r".*rope\.(cos|sin)$",
    r".*mlp\.gate\.weight$",
    r".*mlp\.shared_expert_gate\.weight$",
    r"^model\.embed_tokens\.weight$",
)

QUANT_TARGETS = (r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$",
                 # MoE: every expert on its own (per-expert layout), and qwen2_moe's shared expert
                 r"^model\.layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj\.weight$",
                 # Hybrids' linear attention: the wide projections (in_proj_a / in_proj_b feed the decay
                 # and the write strength of every head: kept float, like the router)
                 r"^model\.layers\.\d+\.linear_attn\.(in_proj_qkvz?|in_proj_z|out_proj)\.weight$")
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"

INT32_MAX = 2**31 - 1
# Every size is at most int32's range: no real dimension comes near it, and an absurd one (2**40) is
# refused here, naming its key, rather than overflowing a shape or an allocation later.
# Layer and expert counts are bounded further: the expected-tensor table (and the MoE layer list) is
# built from them before any tensor is read, so a damaged count must not make qwen2om enumerate
# billions of names. The bounds are far above any published decoder (Llama 3.1 405B: 126 layers;
# Qwen3-Next: 512 routed experts; 48 × 512 = 24,576 expert MLPs).
MAX_LAYERS = 1024
MAX_EXPERTS = 8192
MAX_EXPERT_MLPS = 1 << 18

# Activations the static model computes: its MLPs, and the hybrids' conv and gated norm, use SiLU
# (transformers' "swish" is the same function).
SILU = ("silu", "swish")
# RoPE types transformers computes once for every position (rope.py builds a static table from them);
# "dynamic" and "longrope" change the frequencies with the live sequence length.
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")
LIVE_ROPE = {"dynamic": "NTK scaling follows the live sequence length",
             "longrope": "its frequencies switch once the sequence outgrows original_max_position_embeddings"}
# Numbers a rope_parameters / rope_scaling mapping may hold, and whether they must be positive
# (factors and rotation counts divide or take logs; mscale values only scale a log).
ROPE_NUMBERS = {"factor": True, "attention_factor": True, "beta_fast": True, "beta_slow": True,
                "low_freq_factor": True, "high_freq_factor": True, "mscale": False, "mscale_all_dim": False}


def shown(value: Any) -> str:
    """A config value as JSON writes it (null, true, Infinity, "four"), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: Any) -> bool:
    """A JSON number (not a boolean) that is finite: no NaN, no Infinity, no integer beyond a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


class ConfigFields:
    """Typed, range-checked reads of one config mapping: every refusal names the file and the key.

    JSON gives every value its own type, so the checks are strict: an integer key refuses 4.7, 4.0,
    "4", true and null alike (transformers' config classes refuse them too). An optional key that is
    absent or null takes its default, as transformers does."""

    def __init__(self, cfg: dict[str, Any], source: str, prefix: str = "") -> None:
        self.cfg, self.source, self.prefix = cfg, source, prefix

    def error(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {self.prefix}{key} {problem}")

    def _get(self, key: str, default: Any) -> Any:
        """The value, or `default` when absent or null; a required key (`default` None) must be set."""
        value = self.cfg.get(key)
        if value is None and default is None and key not in self.cfg:
            raise CheckpointError(f"{self.source}: missing required key {self.prefix + key!r}")
        return default if value is None and default is not None else value

    def integer(self, key: str, default: int | None = None, *, lo: int = 1, hi: int = INT32_MAX,
                why: str = "") -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer of at least {lo}")
            raise self.error(key, f"must be {kind}, got {shown(value)}")
        if value > hi:
            raise self.error(key, f"must be at most {hi:,}{why}, got {shown(value)}")
        return value

    def number(self, key: str, default: float | None = None, *, positive: bool = True) -> float:
        value = self._get(key, default)
        if not _finite(value) or (positive and value <= 0):
            raise self.error(key, f"must be a {'positive ' if positive else ''}finite number, got {shown(value)}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {shown(value)}")
        return value

    def int_list(self, key: str, *, lo: int, hi: int) -> list[int]:
        """A list of integers in [lo, hi) (absent or null: empty)."""
        value = self.cfg.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x < hi
                                              for x in value):
            raise self.error(key, f"must be a list of layer indices from {lo} to {hi - 1}, got {shown(value)}")
        return value

    def implemented(self, key: str, allowed: tuple[Any, ...], what: str) -> None:
        """Refuse a field that changes the numerics when it is set to what the static model does not do
        (absent or null: transformers' default, which is the implemented one)."""
        value = self.cfg.get(key)
        if value is None:
            return
        if isinstance(allowed[0], bool) and not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {shown(value)}")
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise CheckpointError(f"{self.source}: {self.prefix}{key}={shown(value)} is not supported "
                                  f"(qwen2om's static model {what})")


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """Facts the passes need about one Hugging Face architecture."""

    name: str
    model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    qkv_bias: bool = True
    qk_norm: bool = False
    keep_float: tuple[str, ...] = KEEP_FLOAT
    # Weights that weight-only quantisation may touch (keep_float wins over these).
    quant_targets: tuple[str, ...] = QUANT_TARGETS
    # The demo/test model that `builtin:` builds for this family.
    builtin: str = ""
    # Mixture of experts: sparse layers route each token to top-k of num_experts MLPs; qwen2_moe
    # adds a shared expert gated by sigmoid(shared_expert_gate(x)).
    moe: bool = False
    shared_expert: bool = False
    # Bundled recipes `<recipe>-<dtype>` this family converts with (default: its own name).
    recipe: str = ""
    # The model family (qwen2om/families.py) whose static model, layers, norms and RoPE tables convert it.
    family: str = "dense"
    # What a family's checkpoints hold and its configs say, as the config reader needs it. The hybrids
    # (Qwen3.5 / Qwen3-Next): `layer_types` mixes Gated DeltaNet linear attention with full attention
    # whose output is gated (q_proj twice as wide: query, then a sigmoid output gate, per head).
    linear_attention: bool = False
    attn_output_gate: bool = False
    # The RoPE types the family's tables implement, and whether they may rotate a fraction of head_dim
    # (rope.py: every static type, whole heads; static_hybrid.py: plain RoPE, partial).
    rope_types: tuple[str, ...] = STATIC_ROPE
    partial_rotary: bool = False
    # Qwen3-Next packs the linear layer's projections per key head (`in_proj_qkvz`, `in_proj_ba`);
    # Qwen3.5 keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
    packed_linear_proj: bool = False
    # The published vision-language wrapper: text config under `text_config`, text weights under
    # `model.language_model.*`, vision (`model.visual.*`) and MTP (`mtp.*`) weights ignored.
    wrapper_architectures: tuple[str, ...] = ()
    # The router's top-k weights are always renormalised (qwen3_5_moe has no norm_topk_prob key).
    norm_topk_always: bool = False


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Sizes of one checkpoint, read from its config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    tied: bool
    max_positions: int
    experts: int = 0  # num_experts; 0 for dense models
    top_k: int = 0  # num_experts_per_tok
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # qwen2_moe's shared expert
    norm_topk_prob: bool = False
    sparse: tuple[int, ...] = ()  # the layers whose MLP is the MoE block
    # Hybrids: "linear_attention" or "full_attention" per layer (empty: every layer is full attention).
    layer_types: tuple[str, ...] = ()
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    rotary_dim: int = 0  # RoPE on the first rotary_dim channels of each head (0: all of head_dim)
    rope_theta: float = 0.0

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def conv_dim(self) -> int:
        """Channels of the linear layer's causal conv: query and key (each Hk·dk), then value (Hv·dv)."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelDims:
        """The sizes of a config.json, every key the static model reads checked for type and range (see
        ConfigFields), and every field it does not implement refused by name (refuse_unimplemented)."""
        spec = next((a for a in ARCHS if cfg.get("model_type") in a.model_types), None)
        wrapped = isinstance(cfg.get("text_config"), dict)
        cfg = text_config(cfg)
        f = ConfigFields(cfg, source, "text_config." if wrapped else "")
        refuse_unimplemented(spec, f)
        hidden = f.integer("hidden_size")
        layers = f.integer("num_hidden_layers", hi=MAX_LAYERS, why=" (the tensor table is built from it)")
        heads = f.integer("num_attention_heads")
        kv_heads = f.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if cfg.get("head_dim") is None and hidden < heads:  # transformers' fallback, hidden // heads, would be 0
            raise CheckpointError(f"{source}: {f.prefix}num_attention_heads={heads} exceeds hidden_size={hidden}, and "
                                  "no head_dim is given")
        head_dim = f.integer("head_dim", hidden // heads)
        theta, partial = rope_settings(spec, f)
        hybrid = hybrid_dims(spec, f, layers, head_dim, theta, partial)
        if not hybrid:
            layer_types(f, layers, (FULL,))
            if head_dim % 2:  # rotate_half pairs channel i with i + head_dim/2
                raise f.error("head_dim", f"must be even: RoPE rotates pairs of channels, got {head_dim}")
        moe: dict[str, Any] = {}
        experts = 0
        if spec is None or spec.moe:  # transformers' dense classes ignore the MoE keys
            why = " (the tensor table is built from it)"
            experts = (f.integer("num_experts", 0, lo=0, hi=MAX_EXPERTS, why=why)  # transformers 5 writes the latter:
                       or f.integer("num_local_experts", 0, lo=0, hi=MAX_EXPERTS, why=why))
        if experts:
            moe = moe_dims(spec, f, layers, experts)
        dense_layers = not experts or len(moe["sparse"]) < layers
        return cls(
            **moe,
            **hybrid,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            # Only layers with a dense MLP read it: an MoE model whose every layer is sparse may omit it.
            intermediate=f.integer("intermediate_size") if dense_layers else f.integer("intermediate_size", 0, lo=0),
            vocab=f.integer("vocab_size"),
            rms_eps=f.number("rms_norm_eps", 1e-6),
            tied=f.flag("tie_word_embeddings", False),
            max_positions=f.integer("max_position_embeddings", 32768),
        )


LINEAR, FULL = "linear_attention", "full_attention"


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: the published Qwen3.5 wrapper nests it under `text_config`."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "tie_word_embeddings": tied}


def refuse_unimplemented(spec: ArchSpec | None, f: ConfigFields) -> None:
    """Refuse, by name, config fields that change the numerics and that the static model (static_model.py,
    static_hybrid.py) does not implement, rather than convert as if they were not there."""
    f.implemented("hidden_act", SILU, "implements silu")
    f.implemented("hidden_activation", SILU, "implements silu")
    f.implemented("mlp_bias", (False,), "has no MLP bias")
    f.implemented("use_sliding_window", (False,), "implements full attention only, no sliding window")
    if spec is None:
        return
    # qwen2_moe reads `qkv_bias` (default true); the Qwen3 family reads `attention_bias` (q/k/v/o).
    if spec.qkv_bias:
        f.implemented("qkv_bias", (True,), f"for {spec.name} always adds the q/k/v bias")
    else:
        f.implemented("attention_bias", (False,), f"for {spec.name} has no attention bias")
    norm = "always normalises q and k per head" if spec.qk_norm else "has no q/k norm"
    f.implemented("use_qk_norm", (spec.qk_norm,), f"for {spec.name} {norm}")
    gate = "always gates the attention output" if spec.attn_output_gate else "has no attention output gate"
    f.implemented("attn_output_gate", (spec.attn_output_gate,), f"for {spec.name} {gate}")


def rope_settings(spec: ArchSpec | None, f: ConfigFields) -> tuple[float, float]:
    """rope_theta and partial_rotary_factor as transformers resolves them (a legacy `rope_scaling` wins over
    `rope_parameters`; either falls back to the top-level keys), every RoPE number checked, and the RoPE
    types the static model cannot build refused by name."""
    cfg = f.cfg
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise f.error(key, f"must be a mapping, got {shown(params)}")
    p = ConfigFields(params, f.source, f"{f.prefix}{key}.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    supported = spec.rope_types if spec else STATIC_ROPE
    if isinstance(rope_type, str) and rope_type in LIVE_ROPE:
        raise CheckpointError(f"{f.source}: {f.prefix}{key}: rope_type {rope_type!r} has no static-shape equivalent "
                              f"({LIVE_ROPE[rope_type]})")
    if not isinstance(rope_type, str) or rope_type not in supported:
        narrowed = f" for {spec.family}s" if spec and supported != STATIC_ROPE else ""  # " for hybrids"
        raise CheckpointError(f"{f.source}: {p.prefix}rope_type={shown(rope_type)} is not supported (qwen2om's "
                              f"static model{narrowed} implements {', '.join(supported)})")
    theta = p.number("rope_theta") if "rope_theta" in params else f.number("rope_theta", 10_000.0)
    where = p if "partial_rotary_factor" in params else f
    partial = where.number("partial_rotary_factor", 1.0)
    if partial > 1:
        raise where.error("partial_rotary_factor", f"must be at most 1 (the fraction of head_dim RoPE rotates), "
                                                   f"got {partial}")
    if not (spec and spec.partial_rotary) and partial != 1:
        raise CheckpointError(f"{f.source}: {where.prefix}partial_rotary_factor={partial} is not supported "
                              f"(qwen2om's static model for {spec.name if spec else 'this model'} rotates the whole "
                              "head)")
    for name, positive in ROPE_NUMBERS.items():
        if params.get(name) is not None:  # null: transformers' default for that RoPE type
            p.number(name, positive=positive)
    if rope_type in ("linear", "yarn", "llama3"):
        p.number("factor")
    if params.get("original_max_position_embeddings") is not None:
        p.integer("original_max_position_embeddings")
    if rope_type == "llama3" and p.number("high_freq_factor") <= p.number("low_freq_factor"):
        # transformers divides by their difference
        raise p.error("high_freq_factor", f"must exceed low_freq_factor={params['low_freq_factor']}, "
                                          f"got {params['high_freq_factor']}")
    if params.get("truncate") is not None:
        p.flag("truncate", True)
    return theta, partial


def layer_types(f: ConfigFields, layers: int, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """`layer_types` checked against num_hidden_layers and the attention kinds the model implements
    (None when absent)."""
    types = f.cfg.get("layer_types")
    if types is None:
        return None
    kinds = " or ".join(map(repr, allowed))
    if not isinstance(types, list) or len(types) != layers:
        raise f.error("layer_types", f"must list {layers} entries (num_hidden_layers), each {kinds}, "
                                     f"got {shown(types)}")
    for i, kind in enumerate(types):
        if isinstance(kind, str) and kind in allowed:
            continue
        if kind == "sliding_attention":
            raise CheckpointError(f"{f.source}: {f.prefix}layer_types[{i}]=\"sliding_attention\" is not supported "
                                  "(qwen2om's static model implements full attention only, no sliding window)")
        raise f.error(f"layer_types[{i}]", f"must be {kinds}, got {shown(kind)}")
    return tuple(types)


def moe_dims(spec: ArchSpec | None, f: ConfigFields, layers: int, experts: int) -> dict[str, Any]:
    """The MoE fields of ModelDims for a config with `experts` routed experts."""
    top_k = f.integer("num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(f"{f.source}: num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    step = f.integer("decoder_sparse_step", 1)
    dense = set(f.int_list("mlp_only_layers", lo=0, hi=layers))
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if experts * len(sparse) > MAX_EXPERT_MLPS:
        raise CheckpointError(f"{f.source}: num_experts={experts} in {len(sparse)} sparse layers is "
                              f"{experts * len(sparse):,} expert MLPs, more than {MAX_EXPERT_MLPS:,} (the tensor "
                              "table is built from them)")
    shared = (f.integer("shared_expert_intermediate_size") if spec and spec.shared_expert
              else f.integer("shared_expert_intermediate_size", 0, lo=0))
    return {"experts": experts, "top_k": top_k, "moe_intermediate": f.integer("moe_intermediate_size"),
            "shared_intermediate": shared,
            "norm_topk_prob": f.flag("norm_topk_prob", False) or bool(spec and spec.norm_topk_always),
            "sparse": sparse}


def hybrid_dims(spec: ArchSpec | None, f: ConfigFields, layers: int, head_dim: int, theta: float,
                partial: float) -> dict[str, Any]:
    """The hybrid fields of ModelDims ({} for a config without linear-attention layers). A hybrid
    architecture must give its linear-attention sizes (transformers' defaults are a 9B model's)."""
    if not (spec.linear_attention if spec is not None else f.cfg.get("linear_num_value_heads")):
        return {}
    types = layer_types(f, layers, (LINEAR, FULL))
    if types is None:  # transformers derives them from the interval: every Nth layer is full attention
        interval = f.integer("full_attention_interval", 4)
        types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))
    k_heads, v_heads = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    if v_heads % k_heads:
        raise CheckpointError(f"{f.source}: linear_num_value_heads={v_heads} is not a multiple of "
                              f"linear_num_key_heads={k_heads}")
    rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2:
        raise CheckpointError(f"{f.source}: partial_rotary_factor={partial} of head_dim={head_dim} is {rotary} RoPE "
                              "channels; RoPE rotates pairs of channels, so that must be a positive even number")
    return {"layer_types": types, "lin_k_heads": k_heads, "lin_v_heads": v_heads,
            "lin_k_dim": f.integer("linear_key_head_dim"), "lin_v_dim": f.integer("linear_value_head_dim"),
            "conv_kernel": f.integer("linear_conv_kernel_dim", 4), "rotary_dim": rotary, "rope_theta": theta}


def linear_attn_tensors(arch: ArchSpec, d: ModelDims, p: str) -> dict[str, tuple[int, ...]]:
    """One Gated DeltaNet layer's tensors (`p` = model.layers.N.linear_attn)."""
    h, hv, vd = d.hidden, d.lin_v_heads, d.lin_v_heads * d.lin_v_dim
    out: dict[str, tuple[int, ...]] = {f"{p}.A_log": (hv,), f"{p}.dt_bias": (hv,),
                                       f"{p}.conv1d.weight": (d.conv_dim, 1, d.conv_kernel),
                                       f"{p}.norm.weight": (d.lin_v_dim,), f"{p}.out_proj.weight": (h, vd)}
    if arch.packed_linear_proj:
        return out | {f"{p}.in_proj_qkvz.weight": (d.conv_dim + vd, h), f"{p}.in_proj_ba.weight": (2 * hv, h)}
    return out | {f"{p}.in_proj_qkv.weight": (d.conv_dim, h), f"{p}.in_proj_z.weight": (vd, h),
                  f"{p}.in_proj_b.weight": (hv, h), f"{p}.in_proj_a.weight": (hv, h)}


def expert_tensors(d: ModelDims, p: str, *, fused: bool) -> dict[str, tuple[int, ...]]:
    """One sparse layer's experts: per expert as published, or fused 3-D as transformers 5 holds them."""
    e, h, i = d.experts, d.hidden, d.moe_intermediate
    if fused:
        return {f"{p}.experts.gate_up_proj": (e, 2 * i, h), f"{p}.experts.down_proj": (e, h, i)}
    out: dict[str, tuple[int, ...]] = {}
    for x in range(e):
        out |= {f"{p}.experts.{x}.gate_proj.weight": (i, h), f"{p}.experts.{x}.up_proj.weight": (i, h),
                f"{p}.experts.{x}.down_proj.weight": (h, i)}
    return out


def mlp_tensors(arch: ArchSpec, d: ModelDims, layer: int, *, fused: bool) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{layer}.mlp"
    if not d.is_sparse(layer):
        return {f"{p}.gate_proj.weight": (d.intermediate, d.hidden), f"{p}.up_proj.weight": (d.intermediate, d.hidden),
                f"{p}.down_proj.weight": (d.hidden, d.intermediate)}
    out = {f"{p}.gate.weight": (d.experts, d.hidden), **expert_tensors(d, p, fused=fused)}
    if arch.shared_expert:
        s = d.shared_intermediate
        out |= {f"{p}.shared_expert.gate_proj.weight": (s, d.hidden),
                f"{p}.shared_expert.up_proj.weight": (s, d.hidden),
                f"{p}.shared_expert.down_proj.weight": (d.hidden, s),
                f"{p}.shared_expert_gate.weight": (1, d.hidden)}
    return out


def expected_tensors(arch: ArchSpec, d: ModelDims, *, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this architecture must hold, with its shape (HF layout);
    `fused`: MoE experts as 3-D `gate_up_proj` / `down_proj` instead of one tensor per expert."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": (d.hidden,), f"{p}.post_attention_layernorm.weight": (d.hidden,),
                **mlp_tensors(arch, d, i, fused=fused)}
        if d.is_linear(i):
            out |= linear_attn_tensors(arch, d, f"{p}.linear_attn")
            continue
        out |= {
            # Hybrids' full attention: q_proj gives the query and its output gate, interleaved per head.
            f"{p}.self_attn.q_proj.weight": (2 * q if arch.attn_output_gate else q, d.hidden),
            f"{p}.self_attn.k_proj.weight": (kv, d.hidden),
            f"{p}.self_attn.v_proj.weight": (kv, d.hidden),
            f"{p}.self_attn.o_proj.weight": (d.hidden, q),
        }
        if arch.qkv_bias:
            out |= {
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            }
        if arch.qk_norm:
            out |= {f"{p}.self_attn.q_norm.weight": (d.head_dim,), f"{p}.self_attn.k_norm.weight": (d.head_dim,)}
    out["model.norm.weight"] = (d.hidden,)
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    return out


ARCHS: Registry[ArchSpec] = Registry("architecture")

QWEN2 = ARCHS.add(
    ArchSpec("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qkv_bias=True, builtin="tiny-qwen2")
)
# Qwen3 drops the QKV bias and normalises q/k per head; everything else carries over.
QWEN3 = ARCHS.add(
    dataclasses.replace(
        QWEN2, name="qwen3", model_types=("qwen3",), hf_architectures=("Qwen3ForCausalLM",),
        qkv_bias=False, qk_norm=True, builtin="tiny-qwen3",
    )
)


QWEN3_MOE = ARCHS.add(
    dataclasses.replace(
        QWEN3, name="qwen3_moe", model_types=("qwen3_moe",), hf_architectures=("Qwen3MoeForCausalLM",),
        moe=True, builtin="tiny-qwen3-moe", recipe="qwen3",
    )
)
QWEN2_MOE = ARCHS.add(
    dataclasses.replace(
        QWEN2, name="qwen2_moe", model_types=("qwen2_moe",), hf_architectures=("Qwen2MoeForCausalLM",),
        moe=True, shared_expert=True, builtin="tiny-qwen2-moe", recipe="qwen2",
    )
)


# Qwen3.5: Qwen3 attention (no bias, q/k norms) with the hybrid changes; the published checkpoints
# are the vision-language wrapper, transformers writes a text model as `qwen3_5_text`.
QWEN3_5 = ARCHS.add(
    dataclasses.replace(
        QWEN3, name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text"),
        hf_architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        wrapper_architectures=("Qwen3_5ForConditionalGeneration",), builtin="tiny-qwen3-5", recipe="qwen3",
        family="hybrid", linear_attention=True, attn_output_gate=True, rope_types=("default",), partial_rotary=True,
    )
)
# Every layer's MLP is the MoE block with a gated shared expert; top-k weights always renormalised.
QWEN3_5_MOE = ARCHS.add(
    dataclasses.replace(
        QWEN3_5, name="qwen3_5_moe", model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        hf_architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        wrapper_architectures=("Qwen3_5MoeForConditionalGeneration",), moe=True, shared_expert=True,
        norm_topk_always=True, builtin="tiny-qwen3-5-moe",
    )
)
# Qwen3-Next: the Qwen3.5-MoE layer pattern with packed linear-attention projections, text only.
QWEN3_NEXT = ARCHS.add(
    dataclasses.replace(
        QWEN3_5_MOE, name="qwen3_next", model_types=("qwen3_next",), hf_architectures=("Qwen3NextForCausalLM",),
        wrapper_architectures=(), packed_linear_proj=True, norm_topk_always=False, builtin="tiny-qwen3-next",
    )
)


def resolve_arch(cfg: dict[str, Any], source: str = "config.json") -> ArchSpec:
    """The registered architecture for a config, or an error listing the supported ones."""
    model_type = cfg.get("model_type")
    for arch in ARCHS:
        if model_type in arch.model_types:
            declared = cfg.get("architectures") or list(arch.hf_architectures)
            if not isinstance(declared, list) or not all(isinstance(a, str) for a in declared):
                raise CheckpointError(f"{source}: architectures must be a list of class names, got {shown(declared)}")
            if not set(declared) & set(arch.hf_architectures):
                raise CheckpointError(
                    f"{source}: architectures {declared} are not supported for model_type {model_type!r} "
                    f"(supported: {', '.join(arch.hf_architectures)})"
                )
            return arch
    supported = ", ".join(t for a in ARCHS for t in a.model_types)
    if model_type is None:
        raise CheckpointError(f"{source}: no 'model_type' key (supported model types: {supported})")
    raise CheckpointError(f"{source}: unsupported model_type {model_type!r} (supported: {supported})")


def quantizable(arch: ArchSpec, name: str, *, ignore: tuple[str, ...] = (), lm_head: bool = False) -> bool:
    """Whether weight-only quantisation may touch tensor `name`: the architecture's targets (plus
    the LM head when asked), never what it keeps float (norms, embeddings, RoPE, router gates),
    never what a recipe's `ignore` regexes match."""
    if any(re.search(p, name) for p in (*arch.keep_float, *ignore)):
        return False
    return (lm_head and name == LM_HEAD) or any(re.search(p, name) for p in arch.quant_targets)


def float_linears(names: Iterable[str], ndim: Callable[[str], int], quantized: Collection[str]) -> list[str]:
    """The modules a quantised checkpoint's config must list as float: every 2-D weight left
    unquantised (router gates, hybrids' in_proj_a / in_proj_b, what a recipe ignores) and the LM head
    unless it is quantised. Loaders that quantise every Linear not listed (transformers, vLLM) would
    otherwise look for packed weights there and initialise the module at random."""
    out = {n.removesuffix(".weight") for n in names
           if n.endswith(".weight") and n not in quantized and n != EMBED and ndim(n) == 2}
    if LM_HEAD not in quantized:
        out.add(LM_HEAD.removesuffix(".weight"))
    return sorted(out, key=lambda m: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", m)])  # 2 < 10
