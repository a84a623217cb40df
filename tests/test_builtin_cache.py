"""Two processes resolving one builtin on a fresh cache build it once: the second waits for the first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen2om import builtin
from qwen2om.errors import Qwen2omError
from qwen2om.fixtures.trained import copy_trained_checkpoint

NAME = "tiny-qwen3-trained"  # a copy of committed files: milliseconds once the lock is free
# What resolving imports (torch, transformers: seconds) is imported before it says it is ready.
RESOLVE = ("import qwen2om.fixtures.tiny, qwen2om.fixtures.trained; from qwen2om.builtin import resolve_model; "
           f"print('ready', flush=True); print(resolve_model('builtin:{NAME}'))")


def test_a_second_process_waits_for_the_build_and_keeps_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QWEN2OM_CACHE", str(tmp_path / "cache"))
    dest = builtin.builtin_dir(NAME)
    with builtin._building(dest):  # this process is building it
        other = subprocess.Popen([sys.executable, "-c", RESOLVE], stdout=subprocess.PIPE, text=True)
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # without the lock the other process copies the files in well under this
        assert other.poll() is None and not dest.exists(), "the other process built while this one held the lock"
        copy_trained_checkpoint(dest)
        built = (dest / "config.json").stat().st_ino
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0
    assert Path(out.strip()) == dest
    assert (dest / "config.json").stat().st_ino == built, "the waiting process rebuilt what it waited for"


def test_a_built_builtin_is_used_without_the_lock(tmp_path: Path, monkeypatch) -> None:
    """A complete cache is read as it is (it may be read-only: no lock file is made)."""
    monkeypatch.setenv("QWEN2OM_CACHE", str(tmp_path / "cache"))
    dest = builtin.resolve_model(f"builtin:{NAME}")
    lock = dest.parent / f".{dest.name}.lock"
    lock.unlink()
    dest.parent.chmod(0o555)
    try:
        assert builtin.resolve_model(f"builtin:{NAME}") == dest
        assert not lock.exists()
    finally:
        dest.parent.chmod(0o755)


def test_a_lock_path_that_is_not_a_plain_file_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    """A symlink there is not followed (its target is not truncated), a FIFO does not block the open."""
    monkeypatch.setenv("QWEN2OM_CACHE", str(tmp_path / "cache"))
    dest = builtin.builtin_dir(NAME)
    dest.parent.mkdir(parents=True)
    lock = dest.parent / f".{dest.name}.lock"
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    lock.symlink_to(outside)
    with pytest.raises(Qwen2omError, match=re.escape(str(lock))):
        builtin.resolve_model(f"builtin:{NAME}")
    assert outside.read_text() == "keep me" and not dest.exists()
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(Qwen2omError, match="not a regular file|cannot take"):
        builtin.resolve_model(f"builtin:{NAME}")
    assert not dest.exists()
