"""Tests for ``qwen2om.fixtures.synthetic``: real-shape random checkpoints that transformers loads.

The write test uses the qwen3-0.6b preset cut to one layer (the real 151,936-row vocabulary is
kept: ~190M parameters, ~370 MB on disk, a few seconds to write and load).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qwen2om.fixtures.synthetic import (
    PRESETS,
    TensorSpec,
    generate_tensor,
    plan_shards,
    resolve_preset,
    tensor_specs,
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
    transformers = pytest.importorskip("transformers")
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
