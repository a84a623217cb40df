"""Tests for ``qwen2om.fixtures.synthetic``: real-shape random checkpoints that transformers loads.

The write test uses the qwen3-0.6b preset cut to one layer (the real 151,936-row vocabulary is
kept: ~190M parameters, ~370 MB on disk, a few seconds to write and load).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from qwen2om.fixtures.synthetic import (
    PRESETS,
    TensorSpec,
    generate_tensor,
    plan_shards,
    resolve_preset,
    tensor_specs,
    write_shards,
    write_synthetic_checkpoint,
)


def _params(specs: list[TensorSpec], *, skip_embeddings: bool = False) -> int:
    skip = {"model.embed_tokens.weight", "lm_head.weight"} if skip_embeddings else set()
    return sum(math.prod(s.shape) for s in specs if s.name not in skip)


@pytest.mark.parametrize(("preset", "total", "non_embedding"), [
    # The model cards' counts: 0.6B / 0.44B, 1.7B / 1.4B, 8.2B / 6.95B.
    ("qwen3-0.6b", 0.596e9, 0.4405e9),
    ("qwen3-1.7b", 1.721e9, 1.409e9),
    ("qwen3-8b", 8.191e9, 6.946e9),
])
def test_presets_match_published_parameter_counts(preset: str, total: float, non_embedding: float) -> None:
    specs = tensor_specs(PRESETS[preset])
    assert _params(specs) == pytest.approx(total, rel=1e-3)
    assert _params(specs, skip_embeddings=True) == pytest.approx(non_embedding, rel=1e-3)
    assert ("lm_head.weight" in {s.name for s in specs}) == (not PRESETS[preset].tied)


def test_layers_override_and_unknown_preset() -> None:
    assert resolve_preset("qwen3-8b", 3).layers == 3
    assert resolve_preset("qwen3-8b").layers == 36
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_preset("qwen3-7b")
    with pytest.raises(ValueError, match="at least 1"):
        resolve_preset("qwen3-0.6b", 0)


def test_plan_shards_caps_size_and_keeps_order() -> None:
    specs = tensor_specs(resolve_preset("qwen3-0.6b", 4))
    cap = 64 * 2**20
    shards = plan_shards(specs, cap)
    assert [s for shard in shards for s in shard] == specs
    for shard in shards:
        # Only a tensor larger than the cap (the 311 MB embedding) may exceed it, alone.
        assert sum(s.nbytes for s in shard) <= cap or len(shard) == 1


def test_values_are_seeded_per_name() -> None:
    spec = TensorSpec("model.layers.0.mlp.up_proj.weight", (64, 32), "matrix")
    a, b = generate_tensor(spec, 0), generate_tensor(spec, 0)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert not torch.equal(a, generate_tensor(spec, 1))
    assert not torch.equal(a, generate_tensor(TensorSpec("other", (64, 32), "matrix"), 0))
    norm = generate_tensor(TensorSpec("model.norm.weight", (4096,), "norm"), 0).float()
    assert abs(norm.mean().item() - 1.0) < 0.01 and 0.04 < norm.std().item() < 0.06


def test_one_layer_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    import transformers
    dest = write_synthetic_checkpoint("qwen3-0.6b", tmp_path / "ckpt", layers=1, seed=0,
                                      shard_bytes=128 * 2**20)
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["head_dim"]) == (1024, 1, 151936, 128)
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True

    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) == 2  # the 311 MB embedding alone, then the layer and the final norm
    assert index["metadata"]["total_size"] == _params(tensor_specs(resolve_preset("qwen3-0.6b", 1))) * 2

    model = transformers.AutoModelForCausalLM.from_pretrained(dest)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) - {"lm_head.weight"}  # tied: no lm_head tensor
    for name, shard in index["weight_map"].items():
        with safe_open(str(dest / shard), framework="pt") as fh:
            assert torch.equal(fh.get_tensor(name), state[name]), name
    with torch.no_grad():
        logits = model(torch.tensor([[9707, 1879]])).logits
    assert logits.shape == (1, 2, 151936) and torch.isfinite(logits).all()


# -- MoE / hybrid presets (tables from qwen2om.fixtures.layouts) ---------------------------------

LAYOUT_PRESETS = ["qwen3-30b-a3b", "qwen3.5-35b-a3b"]


def _meta_model(cls: type, config: object) -> torch.nn.Module:
    with torch.device("meta"):
        return cls(config)


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize(("preset", "parts", "tensors", "total", "non_embedding"), [
    # Model card: 30.5B total, 29.9B non-embedding; 48 x (6 attention + 2 norms + router + 128 x 3 experts) + 3.
    ("qwen3-30b-a3b", (), 18867, 30.532e9, 29.910e9),
    # The text model alone (what AutoModelForCausalLM loads): 30 x 18 + 10 x 15 + 3 tensors.
    ("qwen3.5-35b-a3b", (), 693, 34.661e9, 33.644e9),
    # The whole published file set: "1,811 tensors" and 66.96 GiB (sglang-jax#1251: "~67 GB"); card: 35B.
    ("qwen3.5-35b-a3b", ("mtp", "vision"), 1811, 35.952e9, 34.935e9),
])
def test_layout_presets_match_published_counts(preset: str, parts: tuple[str, ...], tensors: int, total: float,
                                               non_embedding: float) -> None:
    specs = tensor_specs(resolve_preset(preset, parts=parts))
    assert len(specs) == len({s.name for s in specs}) == tensors
    embeddings = {s.name for s in specs if s.name.endswith("embed_tokens.weight") or s.name == "lm_head.weight"}
    assert len(embeddings) == 2  # untied
    assert _params(specs) == pytest.approx(total, rel=1e-4)
    assert sum(math.prod(s.shape) for s in specs if s.name not in embeddings) == pytest.approx(non_embedding, rel=1e-4)


def test_layout_presets_layers_and_parts() -> None:
    assert resolve_preset("qwen3-30b-a3b").layers == 48 and resolve_preset("qwen3.5-35b-a3b").layers == 40
    p = resolve_preset("qwen3.5-35b-a3b", 2, ["vision", "mtp", "vision"])
    assert p.layers == 2 and p.parts == ("vision", "mtp")
    with pytest.raises(ValueError, match="no optional part"):
        resolve_preset("qwen3-30b-a3b", parts=["mtp"])
    with pytest.raises(ValueError, match="no optional part"):
        resolve_preset("qwen3-0.6b", parts=["vision"])
    with pytest.raises(ValueError, match="no optional part"):
        resolve_preset("qwen3.5-35b-a3b", parts=["audio"])


def test_qwen3_moe_table_is_what_transformers_saves() -> None:
    """Per-expert on disk: exactly transformers' own reversal of its qwen2_moe expert fusion."""
    from transformers.core_model_loading import revert_weight_conversion

    p = resolve_preset("qwen3-30b-a3b", 2)
    model = _meta_model(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig.from_dict(p.config_json()))
    state = model.state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (128, 1536, 2048)  # in memory: fused
    on_disk = _shapes(revert_weight_conversion(model, state))
    table = p.tensor_table()
    assert table == on_disk
    assert table["model.layers.1.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert table["model.layers.1.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert table["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert table["model.layers.0.self_attn.q_norm.weight"] == (128,)


def test_qwen3_5_table_is_the_published_fused_layout() -> None:
    """Fused 3-D experts under model.language_model.* = the ForConditionalGeneration state_dict; MTP per expert."""
    from transformers.core_model_loading import revert_weight_conversion

    p = resolve_preset("qwen3.5-35b-a3b", 4, ["mtp", "vision"])
    model = _meta_model(transformers.Qwen3_5MoeForConditionalGeneration,
                        transformers.Qwen3_5MoeConfig.from_dict(p.config_json()))
    state = _shapes(model.state_dict())
    table = p.tensor_table()
    mtp = {k: v for k, v in table.items() if k.startswith("mtp.")}
    assert {k: v for k, v in table.items() if not k.startswith("mtp.")} == state
    assert resolve_preset("qwen3.5-35b-a3b", 4).tensor_table() == {
        k: v for k, v in state.items() if not k.startswith("model.visual.")}

    lm = "model.language_model.layers"
    assert table[f"{lm}.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert table[f"{lm}.0.mlp.experts.down_proj"] == (256, 2048, 512)
    assert table[f"{lm}.0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)  # 2 x 16 x 128 keys + 32 x 128 values
    assert table[f"{lm}.0.linear_attn.in_proj_z.weight"] == (4096, 2048)
    assert table[f"{lm}.0.linear_attn.in_proj_b.weight"] == table[f"{lm}.0.linear_attn.in_proj_a.weight"] == (32, 2048)
    assert table[f"{lm}.0.linear_attn.conv1d.weight"] == (8192, 1, 4)
    assert table[f"{lm}.0.linear_attn.A_log"] == table[f"{lm}.0.linear_attn.dt_bias"] == (32,)
    assert table[f"{lm}.0.linear_attn.norm.weight"] == (128,)
    assert table[f"{lm}.3.self_attn.q_proj.weight"] == (8192, 2048)  # 16 heads x 256, doubled by the output gate
    assert not any("in_proj_qkvz" in k or "in_proj_ba" in k for k in table)  # Qwen3-Next's fused names

    # transformers would save per expert; the published files are not what it saves.
    reverted = _shapes(revert_weight_conversion(model, model.state_dict()))
    per_expert = f"{lm}.0.mlp.experts.0.gate_proj.weight"
    assert per_expert in reverted and per_expert not in table

    # The MTP layer is a full-attention layer of the same config, its experts per expert (as transformers saves).
    layer3 = {k.replace(f"{lm}.3.", "mtp.layers.0."): v for k, v in reverted.items() if k.startswith(f"{lm}.3.")}
    head = {"mtp.fc.weight": (2048, 4096), "mtp.pre_fc_norm_embedding.weight": (2048,),
            "mtp.pre_fc_norm_hidden.weight": (2048,), "mtp.norm.weight": (2048,)}
    assert mtp == layer3 | head


@pytest.mark.parametrize("preset", LAYOUT_PRESETS)
def test_layout_configs_are_the_published_ones(preset: str, tmp_path: Path) -> None:
    from qwen2om.arch import ModelDims, resolve_arch

    p = resolve_preset(preset, 2)
    p.write_configs(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    published = p.layout.config
    assert raw == p.layout.config_for(2) and p.layout.config_for() == published
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    text = cfg.get_text_config()
    assert text.num_hidden_layers == 2 and type(cfg).__name__ == {
        "qwen3-30b-a3b": "Qwen3MoeConfig", "qwen3.5-35b-a3b": "Qwen3_5MoeConfig"}[preset]
    if preset == "qwen3.5-35b-a3b":
        assert text.layer_types == ["linear_attention", "full_attention"]  # < 4 layers: the last one attends
        assert raw["text_config"]["full_attention_interval"] == 2
        assert resolve_preset(preset, 6).config_json()["text_config"]["layer_types"] == \
            published["text_config"]["layer_types"][:6]
        # transformers documents Qwen3_5MoeTextConfig's defaults as this checkpoint: the shapes agree.
        defaults = transformers.Qwen3_5MoeTextConfig()
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                    "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "num_experts_per_tok", "num_experts", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):
            assert published["text_config"].get(key, False) == getattr(defaults, key), key
        assert cfg.vision_config.out_hidden_size == text.hidden_size
    else:
        assert (raw["max_window_layers"], raw["num_experts"], raw["head_dim"]) == (2, 128, 128)
        assert text.num_experts == 128 and text.norm_topk_prob is True
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert raw.get("text_config", raw)["eos_token_id"] in gen["eos_token_id"]
    # Both supported now (qwen3_moe since the MoE issue, the Qwen3.5 wrapper since the hybrids issue),
    # with the published config's dimensions.
    assert resolve_arch(raw).name == {"qwen3-30b-a3b": "qwen3_moe", "qwen3.5-35b-a3b": "qwen3_5_moe"}[preset]
    if preset == "qwen3.5-35b-a3b":
        d = ModelDims.from_config(raw)
        assert d.layer_types == ("linear_attention", "full_attention") and d.rotary_dim == 64
        assert (d.experts, d.top_k, d.shared_intermediate, d.norm_topk_prob) == (256, 8, 512, True)


def _tiny(preset: str) -> dict[str, object]:
    """The published config with tiny widths, for loading through transformers' real loader."""
    p = resolve_preset(preset, 4)
    cfg = p.config_json()
    text = cfg.get("text_config", cfg)
    text.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=1000, bos_token_id=None, eos_token_id=None)
    if "vision_config" in cfg:
        text.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    shared_expert_intermediate_size=32)
        text["rope_parameters"]["mrope_section"] = [1, 1, 0]  # 16 x 0.25 / 2 rotary pairs
        cfg["vision_config"].update(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                                    num_position_embeddings=16)
    return cfg


@pytest.mark.parametrize(("preset", "parts", "model_class"), [
    ("qwen3-30b-a3b", (), "AutoModelForCausalLM"),
    ("qwen3.5-35b-a3b", (), "AutoModelForCausalLM"),
    ("qwen3.5-35b-a3b", ("mtp", "vision"), "Qwen3_5MoeForConditionalGeneration"),
])
def test_tiny_layout_checkpoints_load_with_nothing_missing(preset: str, parts: tuple[str, ...], model_class: str,
                                                           tmp_path: Path) -> None:
    """transformers' own loader (with its conversion mapping) takes the on-disk names: nothing missing or unexpected."""
    layout = resolve_preset(preset).layout
    cfg = _tiny(preset)
    specs = [TensorSpec(n, s, layout.value_kind(n)) for n, s in layout.tensors(cfg, parts).items()]
    index = write_shards(tmp_path, specs, 0, 2**20)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, info = getattr(transformers, model_class).from_pretrained(tmp_path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    state = model.state_dict()
    with safe_open(str(tmp_path / index["weight_map"]["lm_head.weight"]), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("lm_head.weight"), state["lm_head.weight"])
    if preset == "qwen3-30b-a3b":  # gate then up along dim 1 of the fused tensor
        name = "model.layers.0.mlp.experts.3.{}.weight"
        disk = {}
        for proj in ("gate_proj", "up_proj"):
            with safe_open(str(tmp_path / index["weight_map"][name.format(proj)]), framework="pt") as fh:
                disk[proj] = fh.get_tensor(name.format(proj))
        assert torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"][3], torch.cat([disk["gate_proj"],
                                                                                          disk["up_proj"]]))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, 1000) and torch.isfinite(logits).all()


def test_qwen3_5_norms_are_drawn_around_their_identity() -> None:
    p = resolve_preset("qwen3.5-35b-a3b", 4, ["mtp", "vision"])
    kinds = {s.name: s.kind for s in tensor_specs(p)}
    lm = "model.language_model"
    assert kinds[f"{lm}.layers.0.input_layernorm.weight"] == kinds[f"{lm}.norm.weight"] == "centred_norm"
    assert kinds[f"{lm}.layers.3.self_attn.q_norm.weight"] == kinds["mtp.pre_fc_norm_hidden.weight"] == "centred_norm"
    assert kinds[f"{lm}.layers.0.linear_attn.norm.weight"] == kinds[f"{lm}.layers.0.linear_attn.dt_bias"] == "norm"
    assert kinds["model.visual.blocks.0.norm1.weight"] == kinds["model.visual.merger.norm.weight"] == "norm"
    assert kinds["model.visual.blocks.0.norm1.bias"] == kinds[f"{lm}.layers.0.mlp.experts.gate_up_proj"] == "matrix"
    w = generate_tensor(TensorSpec("n", (2048,), "centred_norm"), 0).float()
    assert abs(w.mean().item()) < 0.01 and 0.04 < w.std().item() < 0.06


def test_cli_help_lists_every_preset() -> None:
    run = subprocess.run([sys.executable, "-m", "qwen2om.fixtures.synthetic", "--help"], capture_output=True,
                         text=True, check=True)
    for name in PRESETS:
        assert name in run.stdout
    assert "--with" in run.stdout and "mtp" in run.stdout


@pytest.mark.slow
def test_one_layer_qwen3_30b_a3b_checkpoint_on_disk(tmp_path: Path) -> None:
    """The real widths, 1 of 48 layers: 128 experts x 3 tensors + the 311 MB embedding and head (2.5 GB)."""
    dest = write_synthetic_checkpoint("qwen3-30b-a3b", tmp_path / "ckpt", layers=1, seed=0)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= {p.name for p in dest.iterdir()}
    cfg = json.loads((dest / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["architectures"]) == ("qwen3_moe", 1,
                                                                                   ["Qwen3MoeForCausalLM"])
    specs = tensor_specs(resolve_preset("qwen3-30b-a3b", 1))
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    assert list(index["weight_map"]) == sorted(s.name for s in specs)
    seen: dict[str, tuple[int, ...]] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(dest / shard), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert index["weight_map"][name] == shard
                sl = fh.get_slice(name)
                assert sl.get_dtype() == "BF16"
                seen[name] = tuple(sl.get_shape())
    assert seen == {s.name: s.shape for s in specs}
    spec = next(s for s in specs if s.name == "model.layers.0.mlp.experts.77.up_proj.weight")
    with safe_open(str(dest / index["weight_map"][spec.name]), framework="pt") as fh:
        assert torch.equal(fh.get_tensor(spec.name), generate_tensor(spec, 0))
