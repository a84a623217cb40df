"""Hostile checkpoints (issue 21): headers, shards, dtypes and sizes the config does not match are
refused by name, as the safetensors library refuses them and beyond, before any work."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from edits import INDEX, convert_fails, edit_tensor, shard_of
from safetensors.torch import load_file, save_file

from qwen2om.checkpoint import Checkpoint, summarize
from qwen2om.errors import CheckpointError
from qwen2om.safetensors_io import Shard

K, V = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"


@pytest.fixture
def ckpt(checkpoint, tmp_path: Path) -> Path:
    """A private, mutable copy of tiny-qwen3 (sharded, with an index)."""
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), dest)
    return dest


def read_raw(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file as (header, data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict[str, Any] | bytes, data: bytes) -> None:
    """A safetensors file from a header (a dict, or its JSON text as given) and data bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def f32(begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}


def unindex(ckpt: Path) -> list[Path]:
    """Drop the index: the shards are then globbed. Returns them."""
    (ckpt / INDEX).unlink()
    return sorted(ckpt.glob("*.safetensors"))


def set_config(ckpt: Path, **values: Any) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **values}))


def set_layers(ckpt: Path, n: float) -> None:
    """config.json says `n` layers, its layer_types consistent with that (the schema checks them; a
    dense model's are all full attention), while the weights keep theirs."""
    cfg = json.loads((ckpt / "config.json").read_text())
    types = {"layer_types": ["full_attention"] * int(n)} if "layer_types" in cfg and n < 1e4 else {}
    set_config(ckpt, num_hidden_layers=n, **types)


# -- 1. one shard's header --------------------------------------------------------------------------
def test_a_key_twice_in_one_header_is_refused(cli, ckpt, tmp_path) -> None:
    """json.loads kept the last of two `k_proj` entries (here pointing at v_proj's bytes)."""
    path = shard_of(ckpt, K)
    header, data = read_raw(path)
    assert shard_of(ckpt, V) == path
    text = json.dumps(header)[:-1] + f', "{K}": {json.dumps(header[V])}}}'
    write_raw(path, text.encode(), data)
    convert_fails(cli, ckpt, tmp_path, path.name, "not a readable safetensors file", K, "twice")


def test_a_tensor_pointing_at_another_ones_bytes_is_refused(cli, ckpt, tmp_path) -> None:
    """k_proj given v_proj's data_offsets converted with exit 0; the safetensors library refuses it."""
    path = shard_of(ckpt, K)
    header, data = read_raw(path)
    header[K] = {**header[K], "data_offsets": header[V]["data_offsets"]}
    write_raw(path, header, data)
    convert_fails(cli, ckpt, tmp_path, path.name, "not a readable safetensors file")


@pytest.mark.parametrize(("entries", "size", "named"), [
    ({"a": f32(0, 8), "b": f32(4, 12)}, 12, ["tensors 'a' and 'b' overlap", "bytes 4–8"]),
    ({"a": f32(0, 8), "b": f32(12, 20)}, 20, ["4 bytes between 'a' and 'b' belong to no tensor", "contiguous"]),
    ({"a": f32(4, 12)}, 12, ["4 bytes before 'a' belong to no tensor"]),
    ({"a": f32(0, 8)}, 12, ["4 bytes after the last tensor 'a' belong to no tensor"]),
    ({}, 4, ["4 bytes of data, but the header lists no tensor"]),
], ids=["overlap", "gap", "gap-first", "trailing", "no-tensor"])
def test_tensors_must_tile_the_data_exactly(tmp_path, entries: dict[str, Any], size: int, named: list[str]) -> None:
    path = tmp_path / "x.safetensors"
    write_raw(path, {"__metadata__": {"format": "pt"}, **entries}, bytes(size))
    with pytest.raises(CheckpointError) as e:
        Shard(path)
    for needle in (str(path), *named):
        assert needle in str(e.value), e.value


def test_zero_sized_tensors_and_exact_tiling_are_fine(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}
    write_raw(path, {"a": f32(0, 8), "e": empty, "b": f32(8, 12)}, bytes(12))
    assert sorted(Shard(path).tensors) == ["a", "b", "e"]


def test_deeply_nested_json_is_an_error_not_a_recursion_error(cli, ckpt, tmp_path) -> None:
    path = tmp_path / "deep.safetensors"
    write_raw(path, b"[" * 200_000, b"")
    with pytest.raises(CheckpointError, match="nests too deeply"):
        Shard(path)
    (ckpt / "config.json").write_text("[" * 200_000)
    convert_fails(cli, ckpt, tmp_path, "config.json", "nested too deeply")


def test_a_key_twice_in_the_index_is_refused(cli, ckpt, tmp_path) -> None:
    text = (ckpt / INDEX).read_text()
    twice = text.replace('"weight_map": {', f'"weight_map": {{"{K}": "model.safetensors",', 1)
    (ckpt / INDEX).write_text(twice)
    convert_fails(cli, ckpt, tmp_path, INDEX, K, "twice")


# -- 2. across shards, and what the index may name ---------------------------------------------------
def test_two_unindexed_shards_holding_one_tensor_are_refused(cli, ckpt, tmp_path) -> None:
    """The last shard silently won, and the other was not even in the manifest."""
    first = shard_of(ckpt, "model.norm.weight")
    unindex(ckpt)
    save_file({"model.norm.weight": torch.ones(64)}, ckpt / "zz-extra.safetensors")
    convert_fails(cli, ckpt, tmp_path, first.name, "zz-extra.safetensors", "model.norm.weight", "both hold")


@pytest.mark.parametrize("value", [3, None, ""])
def test_index_values_must_be_file_names(cli, ckpt, tmp_path, value: Any) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"][K] = value
    (ckpt / INDEX).write_text(json.dumps(index))
    convert_fails(cli, ckpt, tmp_path, INDEX, f"weight_map['{K}']", "not a shard file name")


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_index_entries_outside_the_checkpoint_are_refused(cli, ckpt, tmp_path, where: str) -> None:
    """`../other/model.safetensors` was read and recorded in the manifest."""
    other = tmp_path / "other"
    other.mkdir()
    victim = shard_of(ckpt, K)
    shutil.copyfile(victim, other / "model.safetensors")
    index = json.loads((ckpt / INDEX).read_text())
    moved = "../other/model.safetensors" if where == "relative" else str(other / "model.safetensors")
    index["weight_map"] = {k: moved if shard == victim.name else shard for k, shard in index["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(index))
    convert_fails(cli, ckpt, tmp_path, "model.safetensors", "points outside")


def test_a_shard_linked_inside_the_checkpoint_is_fine(ckpt) -> None:
    victim = shard_of(ckpt, K)
    real = ckpt / "blobs" / "shard-1"
    real.parent.mkdir()
    victim.rename(real)
    victim.symlink_to(Path("blobs") / "shard-1")
    ckpt_ = Checkpoint(ckpt)
    ckpt_.validate_layout()
    assert victim in ckpt_.files and not ckpt_.unused()


def test_the_hugging_face_cache_layout_is_inside(ckpt, tmp_path) -> None:
    """`hf download` without --local-dir: snapshots/<rev>/X links to ../../blobs/<hash> of the same repo."""
    repo = tmp_path / "hub" / "models--Qwen--Tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(ckpt.iterdir()):
        shutil.copyfile(f, blobs / f"sha-{f.name}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"sha-{f.name}")
    Checkpoint(snapshot).validate_layout()
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(ckpt / "tokenizer_config.json")  # not the repo's blobs
    with pytest.raises(CheckpointError, match="points outside"):
        Checkpoint(snapshot)


def open_within(root: Path, seconds: float = 20) -> BaseException | None:
    """Open `root` as a Checkpoint in a thread; what it raised, None when it opened. Fails the test
    if it is still blocked after `seconds` (then unblocks a reader of any FIFO under root)."""
    got: list[BaseException | None] = []

    def run() -> None:
        try:
            Checkpoint(root)
            got.append(None)
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            got.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in root.iterdir():
            if fifo.is_fifo():  # a writer end lets the blocked open() return
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"Checkpoint({root}) blocked for {seconds}s")
    return got[0]


@pytest.mark.parametrize("name", ["model.safetensors", "shard", "tokenizer_config.json",
                                  "generation_config.json"])
def test_a_fifo_is_refused_without_blocking(ckpt, name: str) -> None:
    if name == "model.safetensors":
        unindex(ckpt)
    elif name == "shard":
        name = shard_of(ckpt, K).name
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    e = open_within(ckpt)
    assert isinstance(e, CheckpointError) and f"{name}: not a regular file" in str(e), e


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "config.json"])
def test_side_files_linked_outside_are_refused(ckpt, tmp_path, name: str) -> None:
    """Every file in Checkpoint.files (copied, hashed, recorded) is confined like the shards."""
    outside = tmp_path / f"outside-{name}"
    shutil.copyfile(ckpt / name, outside)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"{name}: points outside"):
        Checkpoint(ckpt)


# -- 3. dtypes ----------------------------------------------------------------------------------------
def test_float_weights_stored_as_integers_are_refused(cli, ckpt, tmp_path) -> None:
    """An I16 k_proj converted with exit 0: integers widened to float, garbage of the right shape."""
    edit_tensor(ckpt, K, lambda t: (t * 1000).to(torch.int16))
    convert_fails(cli, ckpt, tmp_path, shard_of(ckpt, K).name, K, "I16", "float")


@pytest.mark.parametrize("name", ["tiny-qwen3-5", "tiny-qwen3-fp8", "tiny-qwen3-moe-fp8", "tiny-qwen3-next-fp8"])
def test_builtins_validate_with_nothing_unused(checkpoint, name: str) -> None:
    """The wrapper's vision tower is ignored by name, FP8 weights and their scales are accounted for."""
    ckpt = Checkpoint(checkpoint(name))
    ckpt.validate_layout()
    assert ckpt.check_unused() == []


@pytest.mark.parametrize("fmt", ["compressed-tensors", "ascendv1"])
def test_int4_checkpoints_validate_with_nothing_unused(cli, checkpoint, tmp_path, fmt: str) -> None:
    """int4 storage (packed int32, int8 in [-8, 7], zero points, shapes) is quantisation, not float weights."""
    out = tmp_path / "w4"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--method", "rtn", "--format", fmt,
                       "--group-size", "32", "--asym")
    assert code == 0, err
    ckpt = Checkpoint(out)
    assert ckpt.quantized
    ckpt.validate_layout()
    assert ckpt.check_unused() == []


# -- 4. unused tensors ----------------------------------------------------------------------------------
def test_tensors_the_config_leaves_out_are_refused(cli, ckpt, tmp_path) -> None:
    """num_hidden_layers lowered from 4 to 2: layers 2-3 were never mentioned."""
    set_layers(ckpt, 2)
    convert_fails(cli, ckpt, tmp_path, "model.layers.2.*, model.layers.3.* (22 tensors)", "--allow-unused")


def test_a_tensor_the_index_does_not_list_is_unused(ckpt) -> None:
    path = shard_of(ckpt, "model.norm.weight")
    save_file({**load_file(path), "model.extra.weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=r"does not account for: model\.extra\.weight \(1 tensor\)"):
        Checkpoint(ckpt).check_unused()


def test_harmless_buffers_are_not_unused(ckpt) -> None:
    """RoPE's inv_freq (old checkpoints saved it) and a tied head saved anyway are replaced, not used."""
    path = shard_of(ckpt, "model.norm.weight")
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"]
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "lm_head.weight": torch.zeros(2)}
    save_file({**load_file(path), **extra}, path)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"] |= dict.fromkeys(extra, path.name)
    (ckpt / INDEX).write_text(json.dumps(index))
    assert Checkpoint(ckpt).check_unused() == []


def test_summaries_name_whole_prefixes_only() -> None:
    everything = [f"model.layers.{i}.{p}" for i in range(12) for p in ("a.weight", "b.weight")]
    # all of layers 2-10, half of layer 11
    names = [n for n in everything if not n.startswith(("model.layers.0.", "model.layers.1.", "model.layers.11.b"))]
    assert summarize(names, everything) == ("model.layers.2.*, model.layers.3.*, model.layers.4.*, model.layers.5.*, "
                                            "model.layers.6.*, model.layers.7.*, model.layers.8.*, model.layers.9.*, "
                                            "and 2 more")
    assert summarize(["model.layers.1.a.weight"], everything) == "model.layers.1.a.weight"


@pytest.mark.slow
def test_allow_unused_warns_and_converts(cli, ckpt, tmp_path) -> None:
    set_layers(ckpt, 2)
    out = tmp_path / "out"
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64", "--prefill-chunk", "16", "--allow-unused")
    assert code == 0, err
    flat = " ".join(err.split())
    assert "--allow-unused" in flat and "model.layers.2.*, model.layers.3.* (22 tensors)" in flat, err
    assert json.loads((out / "manifest.json").read_text())["runtime"]["layers"] == 2


# -- 5. sizes bounded by the checkpoint, before allocation -------------------------------------------
@pytest.mark.parametrize("value", [1000, 1e9])
def test_num_hidden_layers_beyond_the_checkpoint_is_refused_at_once(cli, ckpt, tmp_path, value: float) -> None:
    """`num_hidden_layers: 1e9` grew the expected-tensor list by ~100 MB/s. The config schema caps it
    (qwen2om.arch); below the cap, the checkpoint's own layers bound it."""
    set_layers(ckpt, value)
    with pytest.raises(CheckpointError, match="config.json: num_hidden_layers") as e:
        Checkpoint(ckpt)
    if value == 1000:
        assert "num_hidden_layers=1000 but the checkpoint holds layers 0–3" in str(e.value)
    convert_fails(cli, ckpt, tmp_path, "config.json", "num_hidden_layers")


def fuse_experts(ckpt: Path) -> None:
    """Experts stored 3-D (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) in one file."""
    tensors = {k: v for shard in unindex(ckpt) for k, v in load_file(shard).items()}
    for shard in ckpt.glob("*.safetensors"):
        shard.unlink()
    cfg = json.loads((ckpt / "config.json").read_text())
    n = cfg.get("num_experts") or cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in tensors:  # a dense layer
            continue
        gate_up = [torch.cat((tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")))
                   for e in range(n)]
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(n)])
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_num_experts_beyond_the_checkpoint_is_refused_at_once(checkpoint, tmp_path, layout: str) -> None:
    ckpt = tmp_path / "moe"
    shutil.copytree(checkpoint("tiny-qwen3-moe"), ckpt)
    if layout == "fused":
        fuse_experts(ckpt)
        assert Checkpoint(ckpt).fused_experts
    key = "num_local_experts" if "num_local_experts" in json.loads((ckpt / "config.json").read_text()) \
        else "num_experts"
    set_config(ckpt, **{key: 1000})  # below the config schema's cap (qwen2om.arch), above the 8 experts stored
    with pytest.raises(CheckpointError, match=f"{key}=1000 but the checkpoint holds experts 0–7"):
        Checkpoint(ckpt)
