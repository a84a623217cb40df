"""The output directory contract: files, manifest, signature, legality, determinism, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from qwen2om.convert import convert
from qwen2om.errors import CheckpointError, Interrupted, OutputExistsError
from qwen2om.output import sha256_file


def test_manifest_lists_every_file_with_hashes(converted) -> None:
    out = converted("tiny-qwen3", "fp32")
    m = json.loads((out / "manifest.json").read_text())
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert {f["name"] for f in m["files"]} == on_disk
    for f in m["files"]:
        assert sha256_file(out / f["name"]) == f["sha256"]
    assert {"model.decode.onnx", "model.prefill.onnx", "model.onnx.data", "run.py", "tokenizer.json",
            "tokenizer_config.json", "config.json", "generation_config.json"} <= on_disk
    assert m["format_version"] == 1
    assert m["source"]["files"] and all(len(f["sha256"]) == 64 for f in m["source"]["files"])
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(m["tools"])
    assert m["recipe"]["max_seq_len"] == 256 and m["recipe"]["pipeline"][0] == "load_checkpoint"
    assert [s["pass"] for s in m["stages"]] == m["recipe"]["pipeline"]


def test_signature_follows_the_design(converted) -> None:
    out = converted("tiny-qwen2", "fp16")
    m = json.loads((out / "manifest.json").read_text())
    decode, prefill = m["graphs"]["decode"], m["graphs"]["prefill"]
    assert (decode["tokens"], prefill["tokens"]) == (1, 32)
    ins = {i["name"]: i for i in prefill["inputs"]}
    assert ins["input_ids"] == {"name": "input_ids", "dtype": "int64", "shape": [1, 32], "role": "ids"}
    assert ins["attention_mask"]["dtype"] == "float16" and ins["attention_mask"]["shape"] == [1, 1, 32, 256 + 32]
    assert ins["position_ids"]["dtype"] == "int64"
    assert ins["past_key.1"] == {"name": "past_key.1", "dtype": "float16", "shape": [1, 2, 256, 16],
                                 "role": "past_key", "layer": 1}
    outs = {o["name"]: o for o in prefill["outputs"]}
    assert outs["logits"]["shape"] == [1, 1, 151936] and outs["logits"]["dtype"] == "float32"
    assert outs["present_value.0"]["shape"] == [1, 2, 32, 16]  # the new tokens only


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_graphs_are_legal_and_float_kept(converted, dtype: str) -> None:
    out = converted("tiny-qwen3", dtype)
    for kind in ("decode", "prefill"):
        model = onnx.load(out / f"model.{kind}.onnx", load_external_data=False)
        assert model.ir_version == 8
        assert {(o.domain, o.version) for o in model.opset_import} == {("", 18), ("com.microsoft", 1)}
        # ONNX Runtime's own kernels only where the fuse_* passes put them (fuse_norm: fp32 only).
        contrib = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
        assert contrib == {"GroupQueryAttention", "RotaryEmbedding"} | (
            {"SkipSimplifiedLayerNormalization"} if dtype == "fp32" else set()), contrib
        onnx.checker.check_model(str(out / f"model.{kind}.onnx"))
        inits = {t.name: t for t in model.graph.initializer}
        assert not [n for n, t in inits.items() if t.data_type == onnx.TensorProto.BFLOAT16]
        # RoPE tables stay float32 even in an fp16 graph; there is no inv_freq at all.
        assert inits["rope_cos"].data_type == onnx.TensorProto.FLOAT
        assert inits["rope_sin"].data_type == onnx.TensorProto.FLOAT
        assert not any("inv_freq" in n for n in inits)
        assert not {n.op_type for n in model.graph.node} & {"Trilu", "NonZero", "Loop", "If"}
        names = [n.name for n in model.graph.node]
        assert len(set(names)) == len(names)
        assert "/model/layers.1/self_attn/q_proj/MatMul" in names
        # Weights live once in the shared data file.
        locs = {e.value for t in inits.values() for e in t.external_data if e.key == "location"}
        assert locs == {"model.onnx.data"}


def test_rope_tables_are_accurate_at_theta_1e6(converted) -> None:
    """cos/sin tables equal a float64 computation to fp32 rounding at every position."""
    from onnx.numpy_helper import to_array

    out = converted("tiny-qwen3", "fp32")
    model = onnx.load(out / "model.decode.onnx")
    inits = {t.name: to_array(t) for t in model.graph.initializer if t.name.startswith("rope")}
    d = 32
    inv = 1.0 / (1e6 ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    ang = np.arange(256, dtype=np.float64)[:, None] * inv.astype(np.float64)[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    assert np.abs(inits["rope_cos"] - np.cos(ang)).max() < 1e-6
    assert np.abs(inits["rope_sin"] - np.sin(ang)).max() < 1e-6


def test_conversion_is_deterministic(converted, tmp_path) -> None:
    first = converted("tiny-qwen2", "fp32")
    again = tmp_path / "again"
    convert("builtin:tiny-qwen2", again, overrides=["max_seq_len=256", "prefill_chunk=32", "dtype=fp32"])
    for name in ("model.decode.onnx", "model.prefill.onnx", "model.onnx.data", "run.py", "graphs/summary.txt"):
        assert sha256_file(first / name) == sha256_file(again / name), name


@pytest.mark.slow
def test_interrupted_conversion_writes_no_output_and_resumes(tmp_path, checkpoint) -> None:
    """Ctrl-C at the very last step: no OUT, the finished work kept in the hidden staging sibling;
    the same call with resume=True completes it and leaves nothing else behind."""
    import qwen2om.convert as conv
    from qwen2om.errors import Interrupted
    from qwen2om.output import partial_dir

    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("family: qwen3\nmax_seq_len: 64\nprefill_chunk: 16\n"
                      "pipeline: [load_checkpoint, static_model, export_onnx, legalize_ort, write_onnx, package]\n")
    original = conv.build_manifest

    def explode(*a, **k):  # the manifest is the very last step
        raise KeyboardInterrupt

    conv.build_manifest = explode
    try:
        with pytest.raises(Interrupted, match="--resume"):
            convert("builtin:tiny-qwen3", out, recipe=str(recipe))
    finally:
        conv.build_manifest = original
    assert sorted(tmp_path.iterdir()) == sorted([recipe, partial_dir(out)])
    with pytest.raises(OutputExistsError, match="--resume"):
        convert("builtin:tiny-qwen3", out, recipe=str(recipe))
    result = convert("builtin:tiny-qwen3", out, recipe=str(recipe), resume=True)
    assert result.manifest["stages"][-1]["pass"] == "package"
    assert sorted(tmp_path.iterdir()) == sorted([recipe, out])
    assert not (out / "journal.json").exists()


@pytest.mark.slow
def test_bad_input_leaves_nothing(tmp_path, checkpoint) -> None:
    """An error in the input (here a pass argument that fails late) removes the staging directory."""
    import qwen2om.convert as conv

    out = tmp_path / "out"
    original = conv.build_manifest

    def bad(*a, **k):
        raise CheckpointError("simulated bad input")

    conv.build_manifest = bad
    try:
        with pytest.raises(CheckpointError):
            convert("builtin:tiny-qwen3", out, overrides=["max_seq_len=64", "prefill_chunk=16"])
    finally:
        conv.build_manifest = original
    assert list(tmp_path.iterdir()) == []


def test_data_file_is_aligned_and_shared(converted) -> None:
    out = converted("tiny-qwen3-untied", "fp32")
    offsets = {}
    for kind in ("decode", "prefill"):
        model = onnx.load(out / f"model.{kind}.onnx", load_external_data=False)
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if ext:
                assert int(ext["offset"]) % 4096 == 0
                offsets.setdefault(t.name, set()).add(ext["offset"])
    assert offsets and all(len(v) == 1 for v in offsets.values())
    weight_bytes = (out / "model.onnx.data").stat().st_size
    # untied: embed + lm_head (2 × 151936 × 64 × 4 bytes) dominate; each stored once.
    assert weight_bytes < 2.2 * 151936 * 64 * 4


def test_legalize_is_idempotent(converted) -> None:
    """STYLE.md: a second run of an idempotent pass reports modified=False."""
    import onnx_ir as ir

    from qwen2om.passes.legalize_ort import LegalizeOrt
    from qwen2om.pipeline import RunContext
    from qwen2om.recipe import load_recipe
    from qwen2om.state import ConvertState

    out = converted("tiny-qwen3", "fp32")
    model = ir.load(out / "model.decode.onnx")
    ws = ConvertState(graphs={"decode": model})
    ctx = RunContext(recipe=load_recipe("qwen3-fp32"), stage_dir=out, source=out, tool_version="x")
    LegalizeOrt()(ws, ctx)  # the saved graph already is legal but carries another producer string
    again = LegalizeOrt()(ws, ctx)
    assert again.modified is False and again.stats["nodes_renamed"] == 0


def test_failed_force_keeps_the_previous_output(converted, tmp_path) -> None:
    import shutil

    import qwen2om.convert as conv

    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    before = sha256_file(out / "manifest.json")
    original = conv.build_manifest
    conv.build_manifest = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    try:
        with pytest.raises(Interrupted):
            convert("builtin:tiny-qwen3", out, overrides=["max_seq_len=64", "prefill_chunk=16"], force=True)
    finally:
        conv.build_manifest = original
    assert sha256_file(out / "manifest.json") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "out"]  # kept for --resume


def test_failed_final_rename_restores_the_previous_output(tmp_path, monkeypatch) -> None:
    """The window between moving the old OUT aside and moving the new one in is covered too."""
    from qwen2om.errors import Qwen2omError
    from qwen2om.output import staged_output

    out = tmp_path / "out"
    out.mkdir()
    old = '{"format_version": 1, "tools": {"qwen2om": "0"}, "files": []}'  # a (bare) earlier output
    (out / "manifest.json").write_text(old)
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if Path(target) == out and self.name.endswith(".partial"):
            raise OSError(18, "Invalid cross-device link")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(Qwen2omError, match="cannot move the finished output"):
        with staged_output(out, force=True) as stage:
            (stage / "manifest.json").write_text("new")
    assert (out / "manifest.json").read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_next_hints_spell_commands_as_they_can_be_typed(tmp_path, monkeypatch) -> None:
    """`next:` names qwen2om as this shell finds it: `.venv/bin/qwen2om` when the virtual environment is
    not activated (a bare `qwen2om` is "command not found", or another install), the bare name when PATH
    finds this very file; run.py through the interpreter running qwen2om, which has its packages."""
    import sys

    from qwen2om.cli import as_typed, next_commands, qwen2om_command

    tmp_path = tmp_path.resolve()
    ours, namesake = tmp_path / ".venv" / "bin" / "qwen2om", tmp_path / "elsewhere" / "qwen2om"
    for exe in (ours, namesake):
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(namesake.parent))
    assert qwen2om_command(str(ours)) == qwen2om_command(".venv/bin/qwen2om") == ".venv/bin/qwen2om"
    monkeypatch.setenv("PATH", str(ours.parent))
    assert qwen2om_command(str(ours)) == qwen2om_command("qwen2om") == "qwen2om"
    monkeypatch.setenv("PATH", "")
    monkeypatch.chdir(namesake.parent)
    assert qwen2om_command(str(ours)) == str(ours)  # not under the working directory: absolute

    python = as_typed(sys.executable)
    ort = next_commands(Path("my out"), {"recipe": {"target": "ort"}, "stages": []})
    assert ort[-1] == f"{python} 'my out/run.py' --prompt 'Hello'" and "'my out'" in ort[0]
    compiled = {"recipe": {"target": "ascend"}, "stages": [{"pass": "compile_ascend", "stats": {"compiled": 2}}]}
    assert next_commands(Path("o"), compiled)[-1] == f"{python} o/run.py --backend acl --prompt 'Hello'"


def test_force_never_deletes_the_staging_folder_of_a_run_in_progress(cli, tmp_path) -> None:
    """Issue 21, finding 2: the staging folder was deleted before the lock was taken, and a plain rerun
    called the running conversion "interrupted" and advised --force. Now both are refused, truthfully."""
    import fcntl
    import os

    from qwen2om.output import partial_dir

    out = tmp_path / "out"
    stage = partial_dir(out)
    stage.mkdir()
    (stage / "journal.json").write_text("{}")
    fd = os.open(stage, os.O_RDONLY)  # what a running conversion holds
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        for extra in ((), ("--force",), ("--resume",)):
            code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "64", *extra)
            assert code == 2 and "writing" in err and "right now" in err and "interrupted" not in err, (extra, err)
            assert (stage / "journal.json").is_file()
    finally:
        os.close(fd)
