"""Architecture facts as data: what each supported Hugging Face Qwen family looks like.

An :class:`ArchSpec` says which tensors a checkpoint of that family holds and how the static
model treats them; :class:`ModelDims` carries the sizes read from one checkpoint's config.
Qwen3 is Qwen2 with the QKV bias dropped and a per-head RMSNorm on q and k. The Qwen3.5 /
Qwen3-Next hybrids are Qwen3 with most layers swapped for Gated DeltaNet linear attention
(`layer_types`), gated full attention, partial RoPE and zero-centred norms.
"""

from __future__ import annotations

import dataclasses
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
    # Hybrids (Qwen3.5 / Qwen3-Next): `layer_types` mixes Gated DeltaNet linear attention with full
    # attention whose q_proj is twice as wide (query, then a sigmoid output gate, per head), RoPE on a
    # fraction of head_dim, and RMSNorms that scale by (1 + w).
    hybrid: bool = False
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
        spec = next((a for a in ARCHS if cfg.get("model_type") in a.model_types), None)
        cfg = text_config(cfg)

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if cfg.get("use_sliding_window"):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported yet")
        moe: dict[str, Any] = {}
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the latter
        if experts:
            top_k = int(need("num_experts_per_tok"))
            if not 1 <= top_k <= experts:
                raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be between 1 and "
                                      f"num_experts={experts}")
            layers = int(need("num_hidden_layers"))
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = {"experts": experts, "top_k": top_k, "moe_intermediate": int(need("moe_intermediate_size")),
                   "shared_intermediate": int(cfg.get("shared_expert_intermediate_size") or 0),
                   "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) or bool(spec and spec.norm_topk_always),
                   "sparse": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)}
        return cls(
            **moe,
            **hybrid_dims(cfg, source),
            hidden=hidden,
            layers=int(need("num_hidden_layers")),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg.get("intermediate_size") or 0) if experts else int(need("intermediate_size")),
            vocab=int(need("vocab_size")),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings", 32768)),
        )


LINEAR, FULL = "linear_attention", "full_attention"


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: the published Qwen3.5 wrapper nests it under `text_config`."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "tie_word_embeddings": tied}


def hybrid_dims(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The hybrid fields of ModelDims ({} for a config without linear-attention layers)."""
    if not cfg.get("linear_num_value_heads"):
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # transformers derives them from the interval: every Nth layer is full attention
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise CheckpointError(f"{source}: layer_types must list {layers} entries, each {LINEAR!r} or {FULL!r} "
                              f"(got {types})")
    rope = cfg.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    out = {"layer_types": tuple(types), "lin_k_heads": int(cfg["linear_num_key_heads"]),
           "lin_v_heads": int(cfg["linear_num_value_heads"]), "lin_k_dim": int(cfg["linear_key_head_dim"]),
           "lin_v_dim": int(cfg["linear_value_head_dim"]), "conv_kernel": int(cfg.get("linear_conv_kernel_dim", 4)),
           "rotary_dim": int(head_dim * factor),
           "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 1e4)))}
    if out["lin_v_heads"] % out["lin_k_heads"]:
        raise CheckpointError(f"{source}: linear_num_value_heads={out['lin_v_heads']} is not a multiple of "
                              f"linear_num_key_heads={out['lin_k_heads']}")
    return out


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
            f"{p}.self_attn.q_proj.weight": (2 * q if arch.hybrid else q, d.hidden),
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
        wrapper_architectures=("Qwen3_5ForConditionalGeneration",), hybrid=True, builtin="tiny-qwen3-5",
        recipe="qwen3",
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
