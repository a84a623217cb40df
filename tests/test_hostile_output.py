"""Hostile inputs, issue 21: output directories and what qwen2om prints and replaces.

Each test names the finding it holds; each failed before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

TINY = ("--max-seq-len", "64", "--prefill-chunk", "16")


@pytest.fixture
def out(converted, tmp_path: Path) -> Path:
    """A private, mutable copy of a converted tiny-qwen3."""
    dest = tmp_path / "out"
    shutil.copytree(converted("tiny-qwen3", "fp32"), dest)
    return dest


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def rewrite_manifest(out: Path, change) -> None:
    m = manifest_of(out)
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))


# -- --force and calibrate's outputs -------------------------------------------------------------
def test_calibrate_force_replaces_only_its_own_outputs(cli, tmp_path: Path) -> None:
    """A folder with someone else's calibration_report.json, or a calibration with the user's notes
    added, is not replaced by `calibrate --force` (it used to be: the report's name was the only check)."""
    args = ("calibrate", "builtin:tiny-qwen3", "--method", "rtn", "--group-size", "32")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "calibration_report.json").write_text('{"loss": 0.1}')
    (foreign / "weights.bin").write_text("precious")
    code, _, err = cli(*args, "-o", foreign, "--force")
    assert code == 2 and "not a qwen2om file" in err, err
    assert (foreign / "weights.bin").read_text() == "precious"

    out = tmp_path / "cal"
    code, _, err = cli(*args, "-o", out)
    assert code == 0, err
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["written_by"] == "qwen2om" and "config.json" in report["files"]
    (out / "notes.md").write_text("mine")
    code, _, err = cli(*args, "-o", out, "--force")
    assert code == 2 and "did not write ('notes.md')" in err, err
    (out / "notes.md").unlink()
    code, _, err = cli(*args, "-o", out, "--force")  # all of it qwen2om's own: replaced
    assert code == 0, err
    assert not list(tmp_path.glob(".*.partial"))


def test_calibrate_never_copies_a_file_from_outside_the_checkpoint(cli, checkpoint, tmp_path: Path) -> None:
    """calibrate copies tokenizer files into OUT as package does: a vocab.json symlinked to a key file
    is refused before any work, by name."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), ckpt)
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    (ckpt / "vocab.json").unlink(missing_ok=True)
    (ckpt / "vocab.json").symlink_to(secret)
    out = tmp_path / "cal"
    code, _, err = cli("calibrate", ckpt, "-o", out, "--method", "rtn", "--group-size", "32")
    assert code == 2 and "vocab.json" in err and "outside" in err, err
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))


def test_output_cannot_be_the_working_directory(cli, tmp_path: Path, monkeypatch) -> None:
    """`-o .` used to run the whole conversion, fail to move it into place and delete the work."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for target in (".", ".."):
        code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", target, *TINY, "--force")
        assert code == 2 and "current directory" in err and "name a new directory" in err, err
    assert not list(tmp_path.glob(".*partial")) and not list(here.iterdir())


def test_a_failure_that_cannot_resume_leaves_no_staging_folder(tmp_path: Path, monkeypatch) -> None:
    """Only an interrupt or a full disk keeps `.OUT.partial` (for --resume): after any other failure
    the next plain run used to advise a --resume that could not succeed."""
    import qwen2om.convert
    from qwen2om.convert import convert

    def broken(*a, **k):
        raise TypeError("a bug in a pass")

    monkeypatch.setattr(qwen2om.convert, "build_manifest", broken)  # after every pass wrote its files
    with pytest.raises(TypeError, match="a bug in a pass"):
        convert("builtin:tiny-qwen3", tmp_path / "out", overrides=["max_seq_len=64", "prefill_chunk=16"])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*.partial"))


# -- what run, verify and inspect read ---------------------------------------------------------
def test_check_hashes_finds_a_file_changed_at_the_same_size(cli, out: Path) -> None:
    """`run` and `inspect` checked sizes only: weights edited in place at the same size ran. `run
    --check-hashes` and `verify` (on by default) name the file; without the flag `run` checks sizes."""
    data = next(out.glob("*.onnx.data"))
    with open(data, "r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0x40]))
    code, _, err = cli("run", out, "--max-new-tokens", "2", "--greedy")
    assert code == 0, err  # sizes match: without the flag nothing is hashed
    code, _, err = cli("run", out, "--max-new-tokens", "2", "--greedy", "--check-hashes")
    assert code == 2 and data.name in err and "sha256" in err, err
    code, _, err = cli("verify", out, "--tokens", "1")
    assert code == 2 and data.name in err and "sha256" in err, err
    code, _, err = cli("inspect", out, "--checksums")
    assert code == 2 and data.name in err and "sha256" in err, err


@pytest.mark.parametrize(("change", "needle"), [
    (lambda m: m.pop("runtime"), "'runtime'"),
    (lambda m: m.update(graphs={}), "'graphs'"),
    (lambda m: m["graphs"]["decode"].pop("inputs"), "'graphs'"),
    (lambda m: m.update(files=[{"name": 3}]), "'files'"),
])
def test_a_damaged_manifest_is_named(cli, out: Path, change, needle: str) -> None:
    """A manifest missing `runtime`, with `graphs: {}` and the like used to raise KeyError/StopIteration."""
    rewrite_manifest(out, change)
    code, _, err = cli("run", out, "--max-new-tokens", "1")
    assert code == 2 and "manifest.json" in err and needle in err and "Traceback" not in err, err


def test_a_graph_that_is_not_one_is_named(cli, out: Path) -> None:
    """A garbage or truncated .onnx, or a directory in its place: `qwen2om run` raised from protobuf."""
    graph = out / manifest_of(out)["graphs"]["decode"]["file"]
    graph.write_bytes(b"\x08\xff\xff garbage")
    code, _, err = cli("run", out, "--max-new-tokens", "1")
    assert code == 2 and graph.name in err, err
    graph.unlink()
    graph.mkdir()
    code, _, err = cli("run", out, "--max-new-tokens", "1")
    assert code == 2 and graph.name in err and "not a regular file" in err, err


# -- what qwen2om prints ------------------------------------------------------------------------
def test_printed_names_are_escaped_and_never_markup(cli, checkpoint, tmp_path: Path) -> None:
    """A name from a checkpoint is printed with its control characters visible (a terminal would obey
    ESC sequences), and a message's `[lo, hi]` is not eaten as rich markup."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen\x1b]0;pwned\x07\x1b[2J"}))
    code, _, err = cli("convert", ckpt, "-o", tmp_path / "out", *TINY)
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b" in err, repr(err)
    code, _, err = cli("convert", "builtin:tiny-qwen3-fp8", "-o", tmp_path / "out", *TINY,
                       "--set", "scale_range=0.5,0.1")
    assert code == 2 and "[lo, hi]" in err, err
