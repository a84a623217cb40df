"""Bad input: a clear message naming the culprit, a non-zero exit, nothing written at OUT."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from edits import INDEX, convert_fails, edit_tensor, shard_of


@pytest.fixture
def ckpt(checkpoint, tmp_path: Path) -> Path:
    """A private, mutable copy of tiny-qwen3 (sharded, with an index)."""
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), dest)
    return dest


def test_missing_config(cli, ckpt, tmp_path) -> None:
    (ckpt / "config.json").unlink()
    convert_fails(cli, ckpt, tmp_path, "config.json", "not found")


def test_unreadable_config(cli, ckpt, tmp_path) -> None:
    (ckpt / "config.json").write_text("{ not json")
    convert_fails(cli, ckpt, tmp_path, "config.json", "cannot read")


def test_unknown_model_type(cli, ckpt, tmp_path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen9"}))
    convert_fails(cli, ckpt, tmp_path, "qwen9", "supported", "qwen2", "qwen3")


def test_unknown_architectures(cli, ckpt, tmp_path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForTokenClassification"]}))
    convert_fails(cli, ckpt, tmp_path, "Qwen3ForTokenClassification", "Qwen3ForCausalLM")


def test_index_names_missing_shard(cli, ckpt, tmp_path) -> None:
    victim = shard_of(ckpt, "model.norm.weight")
    victim.unlink()
    convert_fails(cli, ckpt, tmp_path, victim.name, "does not exist")


def test_truncated_safetensors(cli, ckpt, tmp_path) -> None:
    victim = shard_of(ckpt, "model.norm.weight")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    convert_fails(cli, ckpt, tmp_path, victim.name, "not a readable safetensors file")


def test_corrupt_safetensors_header(cli, ckpt, tmp_path) -> None:
    victim = shard_of(ckpt, "model.norm.weight")
    data = bytearray(victim.read_bytes())
    data[8:40] = b"\xff" * 32  # clobber the JSON header
    victim.write_bytes(bytes(data))
    convert_fails(cli, ckpt, tmp_path, victim.name)


def test_shape_disagrees_with_config(cli, ckpt, tmp_path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    edit_tensor(ckpt, name, lambda t: t[:-1].clone())
    convert_fails(cli, ckpt, tmp_path, name, "[159, 64]", "[160, 64]")


def test_missing_tensor(cli, ckpt, tmp_path) -> None:
    name = "model.layers.0.self_attn.k_norm.weight"
    edit_tensor(ckpt, name, lambda t: None)
    index = json.loads((ckpt / INDEX).read_text())
    del index["weight_map"][name]
    (ckpt / INDEX).write_text(json.dumps(index))
    convert_fails(cli, ckpt, tmp_path, name, "missing")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight(cli, ckpt, tmp_path, bad: float) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 5] = bad
        return t

    edit_tensor(ckpt, name, poison)
    convert_fails(cli, ckpt, tmp_path, name, "non-finite")


def test_force_refuses_a_folder_that_is_not_an_output(cli, tmp_path) -> None:
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "64", "--force")
    assert code != 0 and "manifest.json" in err and "refusing" in err
    assert (out / "thesis.tex").read_text() == "precious"


def test_output_exists_needs_force(cli, converted, checkpoint, tmp_path) -> None:
    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)  # an earlier qwen2om output
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "64")
    assert code != 0 and "--force" in err and str(out) in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "64", "--prefill-chunk", "16",
                       "--force")
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["runtime"]["capacity"] == 64


def test_force_never_deletes_what_qwen2om_did_not_write(cli, converted, tmp_path) -> None:
    """Issue 21, finding 1: a folder with someone else's manifest.json (a browser extension), or a
    qwen2om output with the user's own file added, is not replaced by --force; the files are named."""
    ext = tmp_path / "myext"
    (ext / "src").mkdir(parents=True)
    (ext / "manifest.json").write_text('{"manifest_version": 3}')
    (ext / "src" / "important.js").write_text("x")
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", ext, "--max-seq-len", "64", "--force")
    assert code == 2 and "not a qwen2om manifest" in err, err
    assert (ext / "src" / "important.js").read_text() == "x"
    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    (out / "notes.md").write_text("mine")
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "64", "--force")
    assert code == 2 and "did not write ('notes.md')" in err, err
    assert (out / "notes.md").read_text() == "mine"
    assert not list(tmp_path.glob(".*.partial"))


def test_config_refusals_come_before_any_work(cli, ckpt, tmp_path, monkeypatch) -> None:
    """What config.json alone rules out is refused before anything is staged or any pass runs:
    max_seq_len beyond the model's limit, and a RoPE with no static table (which static_model used
    to find only after check_weights had read every shard)."""
    import qwen2om.convert

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("convert started work before refusing")

    monkeypatch.setattr(qwen2om.convert, "staged_output", untouchable)
    out = tmp_path / "out"
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "100000")
    assert code != 0 and "max_seq_len=100000 exceeds the model's max_position_embeddings=4096" in err, err
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64")
    assert code != 0 and "rope_type 'dynamic' has no static-shape equivalent" in err and "completed" not in err, err
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


def test_unknown_builtin_lists_known(cli, tmp_path) -> None:
    code, _, err = cli("convert", "builtin:tiny-qwen9", "-o", tmp_path / "o")
    assert code != 0 and "tiny-qwen9" in err and "tiny-qwen3" in err


@pytest.mark.parametrize("command", [("convert", "{model}", "-o", "o"), ("calibrate", "{model}", "-o", "o"),
                                     ("inspect", "{model}"), ("eval", "ppl", "{model}"),
                                     ("eval", "agree", "{out}", "--reference", "{model}"),
                                     ("verify", "{out}", "--reference", "{model}")])
def test_a_hub_id_or_a_bare_builtin_name_says_what_to_do(converted, cli, tmp_path, monkeypatch, command) -> None:
    """`convert Qwen/Qwen3-0.6B` said ".../config.json not found": a hub id is named as one (qwen2om never
    downloads) with how to get the directory; a builtin's name without its prefix gets the prefix."""
    out = converted("tiny-qwen3", "fp32")
    monkeypatch.chdir(tmp_path)
    for model, needles in (("Qwen/Qwen3-0.6B", ["Qwen/Qwen3-0.6B: no such directory", "hub id",
                                                "qwen2om never downloads",
                                                "`hf download Qwen/Qwen3-0.6B --local-dir DIR`",
                                                "https://huggingface.co/Qwen/Qwen3-0.6B", "then pass DIR"]),
                           ("tiny-qwen3", ["tiny-qwen3: no such directory; did you mean builtin:tiny-qwen3?"])):
        code, _, err = cli(*(a.format(model=model, out=out) for a in command))
        text = " ".join(err.split())
        assert code == 2 and all(n in text for n in needles) and "Traceback" not in err, text
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_mistyped_path_is_not_taken_for_a_hub_id(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    code, _, err = cli("convert", "ckpt/q06-w4a16", "-o", "o")
    assert code == 2 and "ckpt/q06-w4a16" in err and "hub id" not in err and not (tmp_path / "o").exists()


def test_prompt_longer_than_capacity(converted, cli) -> None:
    out = converted("tiny-qwen3", "fp32")  # capacity 256
    long = "word " * 400
    code, _, err = cli("run", out, "--prompt", long, "--greedy", "--max-new-tokens", "4")
    assert code != 0 and "capacity 256" in err and "--truncate" in err
    code, stdout, err = cli("run", out, "--prompt", long, "--greedy", "--max-new-tokens", "4", "--truncate",
                            "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert len(result["prompt_ids"]) == 256 - 4 and len(result["tokens"]) == 4


def test_token_ids_outside_vocabulary(converted, cli) -> None:
    out = converted("tiny-qwen3", "fp32")
    code, _, err = cli("run", out, "--ids", "1,2,151936", "--greedy", "--max-new-tokens", "2")
    assert code != 0 and "151936" in err and "vocabulary" in err
    code, _, err = cli("run", out, "--ids", "-1", "--greedy", "--max-new-tokens", "2")
    assert code != 0 and "-1" in err


def test_empty_prompt_is_an_error(converted, cli) -> None:
    code, _, err = cli("run", converted("tiny-qwen3", "fp32"), "--prompt", "", "--greedy")
    assert code != 0 and "empty" in err and "Traceback" not in err


def test_verify_with_a_missing_reference(converted, cli, tmp_path) -> None:
    code, _, err = cli("verify", converted("tiny-qwen3", "fp32"), "--reference", tmp_path / "nope")
    assert code == 2 and "nope" in err and "Traceback" not in err


def test_verify_without_reference_when_the_source_moved(converted, cli, tmp_path) -> None:
    import json
    import shutil

    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"].update(model=str(tmp_path / "ckpt"), path=str(tmp_path / "ckpt"))
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli("verify", out)
    assert code == 2 and f"converted from {tmp_path / 'ckpt'}, which is not at" in err and "--reference" in err


def test_verify_without_reference_when_the_source_changed(converted, cli, tmp_path) -> None:
    """A checkpoint calibrated again into the same directory is another model: verify names the file
    that changed instead of reporting the new model's differences as conversion errors."""
    import json
    import shutil

    from qwen2om.builtin import resolve_model
    from qwen2om.output import file_entries
    from qwen2om.verify import default_reference

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(resolve_model("builtin:tiny-qwen3"), ckpt)
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    manifest["source"].update(model=str(ckpt), path=str(ckpt), files=file_entries(ckpt, files))
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert default_reference(out) == str(ckpt)  # unchanged: the recorded checkpoint is the reference

    config = json.loads((ckpt / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # same size as before, another sha256
    text = json.dumps(config)
    (ckpt / "config.json").write_text(text + " " * (next(f["bytes"] for f in manifest["source"]["files"]
                                                        if f["name"] == "config.json") - len(text)))
    code, _, err = cli("verify", out)
    assert code == 2 and "Traceback" not in err
    assert f"{ckpt} has changed since" in err and "config.json has another sha256" in err and "--reference" in err
    (ckpt / "generation_config.json").unlink()
    code, _, err = cli("verify", out)
    assert code == 2 and "generation_config.json is gone" in err


@pytest.mark.parametrize("command", [("verify",), ("eval", "agree")])
def test_a_reference_with_another_vocabulary_is_named(converted, cli, command) -> None:
    # tiny-qwen3 has Qwen's 151,936-token vocabulary, tiny-qwen3-trained its own 3,072 tokens: this
    # was a numpy broadcast traceback (verify) and an ONNX Runtime Gather error (eval agree).
    extra = ("--dataset", "builtin:prose") if command[0] == "eval" else ()
    code, _, err = cli(*command, converted("tiny-qwen3", "fp32"), "--reference", "builtin:tiny-qwen3-trained", *extra)
    assert code == 2 and "Traceback" not in err
    assert "151,936-token vocabulary" in err and "builtin:tiny-qwen3-trained has 3,072" in err


def test_a_decode_step_names_a_token_outside_the_vocabulary(converted) -> None:
    from qwen2om.runtime.standalone import Engine, RuntimeInputError

    engine = Engine(converted("tiny-qwen3", "fp32"))
    engine.prefill([[1, 2, 3]] * engine.batch)
    with pytest.raises(RuntimeInputError, match=r"outside the vocabulary \[0, 151936\): \[151936\]"):
        engine.step([engine.vocab] * engine.batch)


def test_bad_pass_argument_fails_before_any_work(cli, tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("family: qwen3\nmax_seq_len: 64\npipeline: [load_checkpoint, static_model, export_onnx, "
                      "legalize_ort, {write_onnx: {inline_limt: 10}}]\n")
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--recipe", recipe)
    assert code != 0 and "inline_limt" in err and "write_onnx" in err
    assert "completed" not in err  # nothing ran


def test_bad_recipe_override(cli, tmp_path) -> None:
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--set", "max_seq=12")
    assert code != 0 and "max_seq" in err and "max_seq_len" in err
    assert not (tmp_path / "o").exists()


def test_ctrl_c_in_a_command_says_interrupted(cli, tmp_path, monkeypatch) -> None:
    """typer turns a Ctrl-C inside a command into a bare exit 130; the user saw the last progress line
    and nothing else. Nothing is written."""
    from qwen2om.quant import calibrate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate.Calibrator, "calibrate_layer", interrupted)
    out = tmp_path / "q"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--method", "gptq", "--num-samples", "2",
                       "--seq-len", "32", "--group-size", "32")
    assert code == 130 and err.rstrip().endswith("interrupted") and "Traceback" not in err
    assert not out.exists()  # (the staging directory stays for --resume, as convert's does)


@pytest.mark.parametrize("damage", ["truncated data", "missing graph", "missing tokenizer", "corrupt manifest"])
def test_a_damaged_output_is_named_not_a_traceback(converted, cli, tmp_path, damage: str) -> None:
    """run / verify / eval read a damaged output directory through ONNX Runtime and tokenizers, whose
    errors were tracebacks naming no file; each command now names the file and exits 2."""
    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    if damage == "truncated data":
        with open(out / "model.onnx.data", "r+b") as f:
            f.truncate(100_000)
        named = f"{out / 'model.onnx.data'} is 100,000 bytes, manifest.json says"
    elif damage == "missing graph":
        (out / "model.prefill.onnx").unlink()
        named = f"{out / 'model.prefill.onnx'} is missing"
    elif damage == "missing tokenizer":
        (out / "tokenizer.json").unlink()
        named = f"{out / 'tokenizer.json'} is missing"
    else:
        (out / "manifest.json").write_text("{")
        named = f"{out / 'manifest.json'}: cannot read"
    commands = [("run", out, "--prompt", "hi", "--max-new-tokens", "2"), ("verify", out, "--tokens", "2"),
                ("eval", "ppl", out, "--dataset", "builtin:prose")]
    if damage == "corrupt manifest":
        commands.append(("inspect", out))
    for command in commands:
        code, _, err = cli(*command)
        assert code == 2 and named in err and "Traceback" not in err, (command, err)


@pytest.mark.parametrize(("args", "named"), [
    (("calibrate", "builtin:tiny-qwen3", "-o", "{tmp}/q", "--ignore", "["), "ignore pattern '[' is not a regular"),
    (("calibrate", "builtin:tiny-qwen3", "-o", "{tmp}/q", "--seq-len", "0"), "--seq-len"),
    (("eval", "ppl", "{out}", "--window", "0"), "--window"),
    (("eval", "ppl", "{out}", "--max-windows", "0"), "--max-windows"),
    (("verify", "{out}", "--tokens", "0"), "--tokens"),
    (("verify", "{out}", "--json", "{tmp}/no/such/dir/r.json"), "no directory"),
    (("run", "{out}", "--threads", "-2"), "--threads"),
    (("run", "{out}", "--max-new-tokens", "-3"), "--max-new-tokens"),
    (("run", "{out}", "--ids", ""), "give comma-separated integer token ids"),
    (("run", "{out}", "--ids", "1,2,abc"), "'1,2,abc'"),
])
def test_out_of_range_numbers_and_bad_values_are_refused(converted, cli, tmp_path, args, named) -> None:
    """Each was a traceback (--window 0, a bad --ignore regex, --json into a missing directory after the
    whole comparison), silently accepted (--seq-len 0, --threads -2, --ids "") or a misleading message."""
    out = converted("tiny-qwen3", "fp32")
    code, _, err = cli(*(a.format(tmp=tmp_path, out=out) for a in args))
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "q").exists()


def test_a_system_message_implies_chat(converted, cli) -> None:
    code, stdout, err = cli("run", converted("tiny-qwen3", "fp32"), "--system", "be brief", "--prompt", "hi",
                            "--json", "--greedy", "--max-new-tokens", "1")
    assert code == 0, err
    assert json.loads(stdout)["prompt_ids"][:1] == [151644]  # <|im_start|>: the ChatML system turn


def test_paths_of_the_wrong_kind_say_what_they_are(converted, cli, tmp_path) -> None:
    out = converted("tiny-qwen3", "fp32")
    code, _, err = cli("convert", out / "config.json", "-o", tmp_path / "a")
    assert code == 2 and "config.json is a file: give its directory" in err  # was ".../config.json/config.json"
    code, _, err = cli("convert", out, "-o", tmp_path / "a")
    assert code == 2 and "is a qwen2om output directory" in err and f"qwen2om run {out}" in err
    code, _, err = cli("eval", "ppl", out, "--dataset", tmp_path)
    assert code == 2 and f"{tmp_path} is a directory" in err
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_a_flag_overriding_a_set_says_so(cli, tmp_path) -> None:
    code, stdout, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--set", "dtype=fp16", "--dtype",
                            "fp32", "--set", "max_seq_len=64", "--set", "prefill_chunk=16")
    assert code == 0, err
    assert "--dtype fp32 overrides --set dtype=fp16" in " ".join(err.split())
    assert "manifest.json" in stdout  # the files-written table lists it too (the manifest omits itself)
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["recipe"]["dtype"] == "fp32"


@pytest.mark.slow
def test_checkpoint_files_outside_it_or_not_regular_are_refused(cli, ckpt, tmp_path) -> None:
    """Issue 21, finding 3: a `vocab.json` symlinked to a file outside the checkpoint was copied into
    OUT and hashed in its manifest. Links inside the checkpoint are fine; FIFOs never block the run."""
    import os

    secret = tmp_path / "secret.key"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    (ckpt / "vocab.json").symlink_to(secret)
    out = tmp_path / "out"
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64")
    assert code == 2 and "vocab.json: points outside" in err, err
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))
    (ckpt / "vocab.json").unlink()
    os.mkfifo(ckpt / "merges.txt")
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64")
    assert code == 2 and "merges.txt: not a regular file" in err, err
    assert not out.exists()
    (ckpt / "merges.txt").unlink()
    (ckpt / "tokenizer_config.json").rename(ckpt / "tokenizer_config.real.json")
    (ckpt / "tokenizer_config.json").symlink_to("tokenizer_config.real.json")  # inside: fine
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "64", "--prefill-chunk", "16")
    assert code == 0, err
    assert not (out / "tokenizer_config.json").is_symlink()


@pytest.mark.slow
def test_output_directories_are_confined(cli, converted, tmp_path) -> None:
    """Issue 21, finding 4: external-data locations and manifest graph entries outside OUT were read
    (`inspect --checksums` printed sha256s of one-byte slices of a secret file) or run (`run`)."""
    import onnx

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 4096)
    out = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), out)
    graph = onnx.load(str(out / "model.decode.onnx"), load_external_data=False)
    init = next(i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = "../secret.bin"
    onnx.save(graph, str(out / "model.decode.onnx"))
    # An attacker edits the manifest too, so that its sizes and hashes (checked first) match the graph.
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["name"] == "model.decode.onnx")
    entry["bytes"] = (out / "model.decode.onnx").stat().st_size
    entry["sha256"] = hashlib.sha256((out / "model.decode.onnx").read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    for args in (("inspect", out, "--checksums"), ("inspect", out / "model.decode.onnx")):
        code, stdout, err = cli(*args)
        assert code == 2 and "outside its directory" in err and "'../secret.bin'" in err, (args, err)
    shutil.copyfile(converted("tiny-qwen3", "fp32") / "model.decode.onnx", out / "model.decode.onnx")
    manifest = json.loads((converted("tiny-qwen3", "fp32") / "manifest.json").read_text())
    manifest["graphs"]["decode"]["file"] = str(secret)
    (out / "manifest.json").write_text(json.dumps(manifest))
    for args in (("inspect", out), ("run", out, "--prompt", "Hi", "--max-new-tokens", "1")):
        code, stdout, err = cli(*args)
        assert code == 2 and "outside" in err and str(secret) in err, (args, err)


@pytest.mark.slow
def test_verify_loads_the_files_convert_read(ckpt, tmp_path) -> None:
    """Issue 21, finding 5: with safetensors shards under other names and a pytorch_model.bin beside
    them, transformers' from_pretrained loaded the pickle, so verify compared against other weights
    than convert read and the manifest hashed. The reference is now read by qwen2om's own reader."""
    from safetensors.torch import load_file

    from qwen2om.convert import convert
    from qwen2om.verify import verify

    (ckpt / "model.safetensors.index.json").unlink()
    state = {}
    for i, shard in enumerate(sorted(ckpt.glob("model-*.safetensors"))):
        state |= load_file(shard)
        shard.rename(ckpt / f"weights-{i}.safetensors")
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, ckpt / "pytorch_model.bin")  # other weights
    out = tmp_path / "out"
    convert(ckpt, out, overrides=["max_seq_len=64", "prefill_chunk=16"])
    report = verify(out, tokens=4)
    assert report.passed and report.max_abs <= 1e-4, report.to_dict()
