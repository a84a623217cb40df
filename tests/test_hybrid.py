"""Qwen3.5 / Qwen3-Next hybrids: registry, published and text-only layouts, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from edits import INDEX, convert_fails, edit_tensor, shard_of
from safetensors.torch import load_file, save_file

from qwen2om.arch import ARCHS, FULL, LINEAR, ModelDims, expected_tensors, resolve_arch
from qwen2om.checkpoint import Checkpoint

HYBRIDS = ["tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-next"]


def private_copy(checkpoint, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint(name), dest)
    return dest


def drop_tensors(ckpt: Path, prefix: str) -> int:
    """Delete every tensor whose name starts with `prefix` (shards and index)."""
    index = json.loads((ckpt / INDEX).read_text())
    gone = [n for n in index["weight_map"] if n.startswith(prefix)]
    for shard in {index["weight_map"][n] for n in gone}:
        tensors = load_file(ckpt / shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, ckpt / shard,
                  metadata={"format": "pt"})
    for n in gone:
        del index["weight_map"][n]
    (ckpt / INDEX).write_text(json.dumps(index))
    return len(gone)


@pytest.mark.slow
@pytest.mark.parametrize("name", HYBRIDS)
def test_builtin_hybrids_load(checkpoint, name: str) -> None:
    ckpt = Checkpoint(checkpoint(name))
    want = ckpt.validate_layout()
    d = ckpt.dims
    assert ckpt.arch.builtin == name and ckpt.arch.family == "hybrid"
    assert d.layer_types == (LINEAR, LINEAR, LINEAR, FULL) and d.rotary_dim == d.head_dim // 4
    assert "model.layers.0.linear_attn.conv1d.weight" in want and "model.layers.3.self_attn.q_norm.weight" in want
    assert want["model.layers.3.self_attn.q_proj.weight"] == (2 * d.heads * d.head_dim, d.hidden)  # query + gate
    assert set(want) <= set(ckpt.names())
    ckpt.close()


def test_published_layout_reads_the_text_model(checkpoint) -> None:
    """tiny-qwen3-5 is the vision-language wrapper: text tensors by their text-model names, vision ignored."""
    root = checkpoint("tiny-qwen3-5")
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in cfg
    ckpt = Checkpoint(root)
    assert ckpt.arch.name == "qwen3_5" and ckpt.ignored.get("model.visual", 0) > 0
    assert ckpt.stored_name("model.norm.weight") == "model.language_model.norm.weight"
    raw = load_file(shard_of(root, "model.language_model.norm.weight"))
    assert torch.equal(ckpt.get("model.norm.weight"), raw["model.language_model.norm.weight"])
    ckpt.close()


def test_text_only_layout_and_interval(checkpoint) -> None:
    cfg = json.loads((checkpoint("tiny-qwen3-5") / "config.json").read_text())
    text = {**cfg["text_config"], "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    assert resolve_arch(text).name == "qwen3_5"
    # Without layer_types transformers derives them from full_attention_interval; so do we.
    del text["layer_types"]
    d = ModelDims.from_config({**text, "num_hidden_layers": 8, "full_attention_interval": 4})
    assert d.layer_types == (LINEAR,) * 3 + (FULL,) + (LINEAR,) * 3 + (FULL,)
    assert expected_tensors(ARCHS.get("qwen3_5"), d)["model.layers.7.self_attn.o_proj.weight"]


def test_layer_types_disagree_with_tensors(cli, checkpoint, tmp_path) -> None:
    ckpt = private_copy(checkpoint, tmp_path, "tiny-qwen3-5-moe")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["layer_types"] = [FULL, LINEAR, LINEAR, FULL]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    convert_fails(cli, ckpt, tmp_path, "layer_types[0]", "'full_attention'", "model.layers.0.linear_attn")


def test_conv_kernel_mismatch(cli, checkpoint, tmp_path) -> None:
    ckpt = private_copy(checkpoint, tmp_path, "tiny-qwen3-next")
    name = "model.layers.1.linear_attn.conv1d.weight"
    edit_tensor(ckpt, name, lambda t: t[..., 1:].clone())
    convert_fails(cli, ckpt, tmp_path, name, "conv kernel size 3", "linear_conv_kernel_dim=4")


def test_vision_only_checkpoint(cli, checkpoint, tmp_path) -> None:
    ckpt = private_copy(checkpoint, tmp_path, "tiny-qwen3-5")
    assert drop_tensors(ckpt, "model.language_model.") > 0
    drop_tensors(ckpt, "lm_head.")
    convert_fails(cli, ckpt, tmp_path, "only vision weights", "model.language_model")


def test_published_qwen3_5_moe_table_is_what_we_expect() -> None:
    """Qwen3.5-35B-A3B's published tensor table (fixtures/layouts.py, 4 layers, text part: fused 3-D experts
    under model.language_model.*) is exactly the table the registry expects, name for name and shape for shape."""
    from qwen2om.fixtures.synthetic import resolve_preset

    p = resolve_preset("qwen3.5-35b-a3b", 4)
    cfg = p.layout.config_for(4)
    inner = "model.language_model."
    published = {("model." + n[len(inner):] if n.startswith(inner) else n): tuple(s)
                 for n, s in p.layout.tensors(cfg).items()}
    arch = resolve_arch(cfg)
    assert arch.name == "qwen3_5_moe"
    assert published == expected_tensors(arch, ModelDims.from_config(cfg), fused=True)
