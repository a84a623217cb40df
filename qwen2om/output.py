"""Atomic output directories and the manifest that describes them."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from qwen2om.errors import OutputExistsError, Qwen2omError
from qwen2om.runtime.standalone import sha256_of as sha256_file  # one hasher: run.py checks what this wrote

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOOLS = ("qwen2om", "torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "safetensors",
         "tokenizers", "numpy")


def graph_file(kind: str) -> str:
    """The file name of one graph kind (decode, prefill) in an output directory."""
    return f"model.{kind}.onnx"


def partial_dir(out: Path) -> Path:
    """Where a conversion into `out` is staged: a hidden sibling with a fixed name, so that an
    interrupted run can be found and continued (`--resume`)."""
    return out.parent / f".{out.name}.partial"


def lock_dir(path: Path) -> int | None:
    """An exclusive lock on the directory `path` (its descriptor; close it to release), or None
    when another process holds it: how a running conversion marks its staging folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


REPORT_FILES = "files"  # a calibrated checkpoint's report lists what calibrate wrote, as a manifest does


def owned_files(out: Path, marker: str) -> set[str] | None:
    """The files qwen2om says it wrote into `out`, from its marker file (a conversion's manifest, a
    calibration's report), or None when the marker is not one qwen2om wrote: a browser extension or
    web app has a manifest.json too."""
    try:
        data = json.loads((out / marker).read_text(encoding="utf-8"))
        if marker == MANIFEST:
            ours = "format_version" in data and "qwen2om" in data["tools"]
            listed = {f["name"] for f in data["files"]}
            for stage in data.get("split", {}).get("stages", []):  # a staged OUT: each stage lists its own
                own = owned_files(out / stage["dir"], marker) if (out / stage["dir"] / marker).is_file() else set()
                if own is None:
                    return None
                listed |= {f"{stage['dir']}/{name}" for name in own}
        else:
            ours = data.get("written_by") == "qwen2om"
            listed = set(data[REPORT_FILES])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {*listed, marker} if ours and all(isinstance(n, str) for n in listed) else None


def refuse_foreign_files(out: Path, marker: str = MANIFEST) -> None:
    """--force replaces an output only when qwen2om wrote all of it: its marker is qwen2om's, and no
    file lies beside it that the marker does not list (a user's own notes may sit in OUT)."""
    listed = owned_files(out, marker)
    if listed is None:
        kind = "manifest" if marker == MANIFEST else "file"
        raise OutputExistsError(f"{out}/{marker} is not a qwen2om {kind}: refusing to replace {out}, even with --force")
    foreign = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                     if not p.is_dir() and str(p.relative_to(out)) not in listed)
    if foreign:
        shown = ", ".join(repr(f) for f in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(f"{out} holds files qwen2om did not write ({shown}): refusing to replace it, even "
                                "with --force; move them out first")


def refuse_working_directory(out: Path) -> None:
    """OUT is replaced by a rename at the end: the current directory (`-o .`) or a folder above it
    cannot be, and finding that out after the whole conversion would throw the work away."""
    here, target = Path.cwd().resolve(), out.resolve()
    if here.is_relative_to(target):
        what = "the current directory" if here == target else f"a folder above the current directory ({here})"
        raise OutputExistsError(f"-o {out} is {what}: qwen2om builds OUT beside it and moves it into place, so "
                                "name a new directory, e.g. -o ./out")


def check_output(out: Path, *, force: bool, resume: bool = False, marker: str = MANIFEST,
                 resumable: bool = True) -> None:
    """Refuse `out` as staged_output would, without touching anything: for commands that read data
    for minutes before they stage (calibrate), so an existing OUT is named before that work."""
    out = Path(out)
    refuse_working_directory(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")
    if out.exists() and any(out.iterdir()):
        if not (out / marker).is_file():  # never an arbitrary folder (think `-o ~ --force`)
            raise OutputExistsError(
                f"{out} is not empty and holds no {marker}: refusing to replace it, even with --force")
        refuse_foreign_files(out, marker)
    stage = partial_dir(out)
    if stage.exists():
        held = lock_dir(stage)
        if held is None:
            raise OutputExistsError(f"another qwen2om is writing {stage} right now: wait for it to finish "
                                    "(nothing was touched)")
        os.close(held)
    if stage.exists() and not resume and not force:
        if not resumable:
            raise OutputExistsError(f"an interrupted run into {out} left {stage}: rerun with --force to start over")
        raise OutputExistsError(f"an interrupted conversion into {out} is kept in {stage}: rerun with --resume "
                                "to continue it, or with --force to start over")


@contextlib.contextmanager
def staged_output(out: Path, *, force: bool, resume: bool = False, marker: str = MANIFEST,
                  resumable: bool = True, log: Callable[[str], None] = lambda m: None) -> Iterator[Path]:
    """A staging sibling of `out` that becomes `out` only if the block succeeds.

    `out` is never half-written: it appears whole, by one rename, or not at all; with --force a
    failed run leaves the previous `out` in place. The staging directory is kept only after a
    failure `--resume` can continue (an interrupt, a full disk: `keep_partial`) and removed after
    any other (bad input, a bug); a command that cannot resume (`resumable=False`: calibrate)
    removes it after any failure.
    """
    out = Path(out)
    check_output(out, force=force, resume=resume, marker=marker, resumable=resumable)
    stage = partial_dir(out)
    if stage.exists() and resume:
        log(f"resuming the interrupted conversion kept in {stage}")
    elif resume:
        log(f"nothing to resume ({stage} does not exist): starting from the beginning")
    try:
        if stage.exists() and not resume:
            # Locked before it is deleted: a --force run never removes the folder of a run in progress.
            held = lock_dir(stage)
            if held is None:
                raise OutputExistsError(f"another qwen2om is writing {stage} right now: wait for it to finish")
            try:
                shutil.rmtree(stage)
            finally:
                os.close(held)
        stage.mkdir(parents=True, exist_ok=True)
        lock = lock_dir(stage)
    except OSError as e:
        raise Qwen2omError(f"cannot create the staging directory {stage}: {e.strerror or e}") from None
    if lock is None:
        raise OutputExistsError(f"another qwen2om is writing {stage}; wait for it to finish")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        yield stage
        try:
            if out.exists():
                out.rename(old)
            stage.rename(out)
        except OSError as e:
            raise Qwen2omError(f"cannot move the finished output into place at {out}: {e.strerror or e}") from None
    except BaseException as e:
        # Kept only for what --resume can continue (an interrupt, a full disk): after bad input or a
        # bug, a kept folder would only have the next plain run advise a --resume that cannot succeed.
        if not resumable or not (isinstance(e, Qwen2omError) and e.keep_partial):
            shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            old.rename(out)  # put the previous output back: a failed --force run changes nothing
        raise
    finally:
        os.close(lock)
    shutil.rmtree(old, ignore_errors=True)


def file_entries(root: Path, paths: list[Path], workers: int = 1) -> list[dict[str, Any]]:
    paths = sorted(paths)
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL on large reads
        hashes = list(pool.map(sha256_file, paths))
    return [{"name": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": h}
            for p, h in zip(paths, hashes, strict=True)]


def tool_versions() -> dict[str, str]:
    out = {}
    for name in TOOLS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def mark_written(stage: Path, report: dict[str, Any], marker: str) -> Path:
    """Write a command's report as `stage/marker`, listing every file it wrote (so that --force can
    tell later that all of OUT is qwen2om's own; see owned_files)."""
    report["written_by"] = "qwen2om"
    report[REPORT_FILES] = sorted(str(p.relative_to(stage)) for p in stage.rglob("*")
                                  if p.is_file() and p.name != marker)
    path = stage / marker
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


def write_manifest(stage: Path, manifest: dict[str, Any], workers: int = 1) -> Path:
    """List every file in `stage` with its hash, then write manifest.json (not listed in itself)."""
    written = [p for p in stage.rglob("*") if p.is_file() and p.name != MANIFEST]
    manifest["files"] = file_entries(stage, written, workers)
    path = stage / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_manifest(out: Path) -> dict[str, Any]:
    """OUT's manifest, read and checked by the runtime's own rules (one definition of a well-formed,
    confined manifest for run.py and qwen2om alike)."""
    from qwen2om.runtime.standalone import RuntimeInputError, check_confined, check_manifest, load_manifest

    try:
        manifest = load_manifest(Path(out))
        check_manifest(Path(out), manifest)
        check_confined(Path(out), manifest)
    except RuntimeInputError as e:
        raise Qwen2omError(str(e)) from None
    return manifest


def manifest_graphs(root: Path, manifest: dict[str, Any]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every graph of an output directory: kind → (file, its manifest entry). A staged OUT (convert
    --stages) lists each stage's graphs as `stage<k>/<kind>`, from that stage's own manifest; a stage
    not converted here (--only-stage elsewhere) is left out."""
    if "split" not in manifest:
        return {kind: (root / spec["file"], spec) for kind, spec in manifest["graphs"].items()}
    out = {}
    for stage in manifest["split"]["stages"]:
        folder = root / stage["dir"]
        if not (folder / MANIFEST).is_file():
            continue
        own = read_manifest(folder)
        for kind, spec in own["graphs"].items():
            out[f"stage{stage['index']}/{kind}"] = (folder / spec["file"], spec)
    return out
