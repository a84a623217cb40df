"""Interrupted conversions: nothing corrupt is left, --resume finishes them, output is deterministic."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qwen2om.output import partial_dir

SMALL = ["max_seq_len=256", "prefill_chunk=32"]  # as conftest.SMALL

ARGS = ["--set", SMALL[0], "--set", SMALL[1]]


def tree(out: Path) -> dict[str, bytes]:
    """Every file's bytes, the manifest without its timings."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    for stage in manifest["stages"]:
        stage.pop("seconds")
    files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """An uninterrupted conversion of builtin:tiny-qwen3 (fp16, so the data file has several regions)."""
    from qwen2om.convert import convert

    out = tmp_path_factory.mktemp("ref") / "out"
    convert("builtin:tiny-qwen3", out, overrides=[*SMALL, "dtype=fp16"])
    return tree(out)


def test_two_runs_are_byte_identical_apart_from_timings(reference, tmp_path) -> None:
    from qwen2om.convert import convert

    out = tmp_path / "again"
    convert("builtin:tiny-qwen3", out, overrides=[*SMALL, "dtype=fp16"], workers=1)
    again = tree(out)
    assert sorted(again) == sorted(reference)
    for name in reference:
        assert again[name] == reference[name], name


KILLER = """
import os, signal, sys
from qwen2om.passes import write_onnx
real, calls = write_onnx.DataWriter.write, [0]
def write(self, region):
    calls[0] += 1
    if calls[0] > int(os.environ["KILL_AFTER"]):
        self.sync()  # let the journal have recorded the earlier regions, then die without cleanup
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, region)
write_onnx.DataWriter.write = write
from qwen2om.cli import main
sys.argv = ["qwen2om", *sys.argv[1:]]
main()
"""


def run_cli(*args: str, env: dict[str, str] | None = None, killer: bool = False) -> subprocess.CompletedProcess:
    code = KILLER if killer else "from qwen2om.cli import main; import sys; sys.argv[0] = 'qwen2om'; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=Path(__file__).parent.parent, timeout=600)


def test_sigkill_mid_write_then_resume_is_byte_identical(reference, tmp_path) -> None:
    """SIGKILL in the middle of writing weights, in a real process; --resume keeps what was written."""
    out = tmp_path / "out"
    args = ["convert", "builtin:tiny-qwen3", "-o", str(out), "--dtype", "fp16", "--workers", "1", *ARGS]
    killed = run_cli(*args, env={"KILL_AFTER": "12"}, killer=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    journal = json.loads((partial_dir(out) / "journal.json").read_text())
    assert len(journal["data"]["done"]) >= 1  # some tensors were finished before the kill
    refused = run_cli(*args)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "already written, re-hashed and kept" in resumed.stderr
    assert not partial_dir(out).exists()
    assert tree(out) == reference


def test_damaged_finished_tensor_is_rewritten_on_resume(reference, tmp_path, cli, monkeypatch) -> None:
    """The journal is not trusted blindly: a finished tensor whose bytes changed is written again."""
    from qwen2om.passes import write_onnx

    out = tmp_path / "out"
    args = ["convert", "builtin:tiny-qwen3", "-o", out, "--dtype", "fp16", "--workers", "1", *ARGS]
    real, calls = write_onnx.DataWriter.write, [0]

    def write(self, region):
        calls[0] += 1
        if calls[0] > 12:
            raise KeyboardInterrupt
        return real(self, region)

    monkeypatch.setattr(write_onnx.DataWriter, "write", write)
    code, _, err = cli(*args)
    assert code == 130 and "interrupted:" in err and "--resume" in err
    assert len(err.strip().splitlines()[-1]) > 0 and "Traceback" not in err
    monkeypatch.setattr(write_onnx.DataWriter, "write", real)
    journal = json.loads((partial_dir(out) / "journal.json").read_text())
    data = partial_dir(out) / "model.onnx.data"
    with open(data, "r+b") as fh:  # scribble over the first finished region
        fh.write(b"\xff" * 64)
    assert journal["data"]["done"]
    code, _, err = cli(*args, "--resume")
    assert code == 0, err
    assert tree(out) == reference


def test_disk_full_keeps_work_and_resume_finishes(reference, tmp_path, cli, monkeypatch) -> None:
    out = tmp_path / "out"
    args = ["convert", "builtin:tiny-qwen3", "-o", out, "--dtype", "fp16", "--workers", "2", *ARGS]
    real, calls = os.pwrite, [0]

    def pwrite(fd, buf, offset):  # the system call fails the way a full disk makes it fail
        calls[0] += 1
        if calls[0] > 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    code, _, err = cli(*args)
    assert code == 2 and "no space left while writing" in err and "model.onnx.data" in err and "--resume" in err
    assert not out.exists() and partial_dir(out).is_dir()
    assert calls[0] > 10  # it did fail in the middle of writing weights
    monkeypatch.setattr(os, "pwrite", real)
    code, _, err = cli(*args, "--resume")
    assert code == 0, err
    assert tree(out) == reference


def test_full_disk_is_found_before_writing(tmp_path, cli, monkeypatch) -> None:
    """The data file is allocated whole first, so a disk too small fails at once."""
    def fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    out = tmp_path / "out"
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS)
    assert code == 2 and "no space left while writing" in err
    assert not out.exists()


@pytest.mark.slow
def test_changed_shard_is_refused_on_resume(tmp_path, cli, checkpoint, monkeypatch) -> None:
    from qwen2om.passes import write_onnx

    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), src)
    out = tmp_path / "out"
    args = ["convert", src, "-o", out, *ARGS]

    def interrupted(self, region):
        raise KeyboardInterrupt

    monkeypatch.setattr(write_onnx.DataWriter, "write", interrupted)
    code, _, _ = cli(*args)
    assert code == 130
    monkeypatch.undo()
    shard = sorted(src.glob("*.safetensors"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # the lowest mantissa bit of the last bf16 value: still finite, different bytes
    shard.write_bytes(bytes(raw))
    code, _, err = cli(*args, "--resume")
    assert code == 2 and shard.name in err and "changed since the interrupted run" in err
    assert partial_dir(out).is_dir() and not out.exists()  # nothing lost: restore the shard, or --force


@pytest.mark.slow
def test_resume_with_another_recipe_is_refused(tmp_path, cli, monkeypatch) -> None:
    from qwen2om.passes import write_onnx

    out = tmp_path / "out"
    monkeypatch.setattr(write_onnx.DataWriter, "write", lambda self, r: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS)[0] == 130
    monkeypatch.undo()
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS, "--dtype", "fp16", "--resume")
    assert code == 2 and "different recipe" in err and "--force" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS, "--dtype", "fp16", "--force")
    assert code == 0, err


@pytest.mark.slow
def test_workers_above_the_core_count_are_capped(tmp_path, cli) -> None:
    from qwen2om.convert import available_cores

    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "out", *ARGS, "--workers", "4096")
    assert code == 0
    assert f"--workers 4096 is more than the {available_cores()} cores available here; using" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o2", *ARGS, "--workers", "0")
    assert code == 2 and "--workers must be at least 1" in err


@pytest.mark.slow
def test_ctrl_c_inside_the_exporter_is_an_interrupt(tmp_path, cli, monkeypatch) -> None:
    """torch.export wraps whatever its tracing raised, a Ctrl-C included, in its own error: that was
    reported as "torch.onnx.export failed" (exit 2) and the staging directory deleted."""
    from qwen2om.passes import export_onnx

    def export(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Failed to export the model with torch.export.") from e

    monkeypatch.setattr(export_onnx, "export", export)
    out = tmp_path / "out"
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS)
    assert code == 130 and "interrupted" in err and "export failed" not in err
    assert partial_dir(out).is_dir() and not out.exists()
    monkeypatch.undo()
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, *ARGS, "--resume")
    assert code == 0, err
