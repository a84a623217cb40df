"""Seeded fuzzing of every input issue 21 calls untrusted: a checkpoint's config, safetensors headers
and index, a recipe, an output directory's manifest and graphs, and a dataset.

Each case mutates one of them in a scratch copy and runs the command that reads it. Whatever the
mutation, the command must exit 0 or 2 (never a traceback), finish within TIME_LIMIT, read nothing
outside the scratch directory (a secret file planted beside it is the bait that mutations point
at), change nothing outside it, and leave no `.OUT.partial` behind. QWEN2OM_FUZZ_CASES sets how
many cases run (default 60: ten per kind); a failure prints the case's seed and mutation.
"""

from __future__ import annotations

import _thread
import hashlib
import json
import os
import random
import shutil
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("QWEN2OM_FUZZ_CASES", "60"))
TIME_LIMIT = 120.0  # seconds per case; a tiny conversion takes ~5 s, a refusal well under one
SECRET = "SECRET-7f3a9c-do-not-read"
KINDS = ("config", "header", "index", "recipe", "manifest", "dataset")
TINY = ("--max-seq-len", "64", "--prefill-chunk", "16")
INDEX = "model.safetensors.index.json"


def hostile_values(rng: random.Random, bait: Path) -> list[Any]:
    deep: Any = 0
    for _ in range(rng.choice((100, 900))):  # json.dumps itself recurses
        deep = [deep]
    return ["four", None, -1, 0, 1, 2, 10**9, 10**18, 4.7, -0.0, float("inf"), float("nan"), True, [], {},
            [1, 2], "x" * 10_000, str(bait), "../" + bait.parent.name + "/" + bait.name, "\x1b[2J", deep]


# -- mutations: each edits the scratch copy and returns (what it did, the command to run) --------------
def mutate_config(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    path = s.ckpt / "config.json"
    cfg = json.loads(path.read_text())
    changed = {}
    for _ in range(rng.randint(1, 2)):
        key = rng.choice([*sorted(cfg), "hidden_act", "rope_scaling", "num_experts", "layer_types"])
        cfg[key] = changed[key] = rng.choice(hostile_values(rng, s.secret))
    path.write_text(json.dumps(cfg))
    shown = ", ".join(f"{k}={str(v)[:30]!r}" for k, v in changed.items())
    return f"config.json: {shown}", ["convert", str(s.ckpt), "-o", str(s.out), *TINY]


def mutate_header(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    shard = rng.choice(sorted(s.ckpt.glob("*.safetensors")))
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name, how = rng.choice(names), rng.choice(("dtype", "shape", "data_offsets", "duplicate", "length", "drop"))
    if how == "duplicate":  # the same key twice: json.loads keeps the last, safetensors refuses
        text = json.dumps(header)
        entry = json.dumps({name: header[rng.choice(names)]})[1:-1]
        blob = (text[:-1] + ", " + entry + "}").encode()
    elif how == "length":
        blob = raw[8:8 + n]
        raw = struct.pack("<Q", rng.choice((0, n - 1, n + 7, 2**40))) + raw[8:]
    else:
        if how == "drop":
            del header[name]
        else:
            value = rng.choice(hostile_values(rng, s.secret) + ["I16", "F8_E5M2", [0, 16], [16, 0]])
            header[name] = {**header[name], how: value}
        blob = json.dumps(header).encode()
    if how != "length":
        raw = struct.pack("<Q", len(blob)) + blob + raw[8 + n:]
    shard.write_bytes(raw)
    return f"{shard.name}: {how} of {name}", ["convert", str(s.ckpt), "-o", str(s.out), *TINY]


def mutate_index(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    path = s.ckpt / INDEX
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    name = rng.choice(sorted(wm))
    how = rng.choice(("value", "value", "drop", "extra", "map"))
    if how == "value":
        wm[name] = rng.choice([str(s.secret), f"../{s.secret.parent.name}/{s.secret.name}", 7, None,
                               "missing.safetensors", "config.json", "."])
    elif how == "drop":
        del wm[name]
    elif how == "extra":
        wm["model.layers.99.mlp.up_proj.weight"] = wm[name]
    else:
        index["weight_map"] = rng.choice(hostile_values(rng, s.secret))
    path.write_text(json.dumps(index))
    return f"{INDEX}: {how} {name!r}", ["convert", str(s.ckpt), "-o", str(s.out), *TINY]


def mutate_recipe(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    from qwen2om.recipe import load_recipe

    recipe = load_recipe("qwen3-fp32").to_dict()
    path = s.root / "recipe.yaml"
    how = rng.choice(("value", "value", "pipeline", "raw"))
    if how == "value":
        key = rng.choice(sorted(recipe) + ["unknown_key"])
        recipe[key] = rng.choice(hostile_values(rng, s.secret)[:17])
        path.write_text(yaml.safe_dump(recipe))
        what = f"{key} = {str(recipe[key])[:40]!r}"
    elif how == "pipeline":
        passes = list(recipe["pipeline"])
        rng.shuffle(passes) if rng.random() < 0.5 else passes.pop(rng.randrange(len(passes)))
        recipe["pipeline"] = passes
        path.write_text(yaml.safe_dump(recipe))
        what = f"pipeline {passes}"
    else:
        what = rng.choice(RAW_RECIPES)
        path.write_bytes(what.encode("utf-8", "surrogateescape") if isinstance(what, str) else what)
    return f"recipe {how}: {what}"[:200], ["convert", "builtin:tiny-qwen3", "--recipe", str(path),
                                           "-o", str(s.out), *TINY]


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "family: *i\n"
RAW_RECIPES: list[Any] = [
    ALIAS_BOMB, "family: qwen3\nfamily: qwen2\n", "!!python/object/apply:os.system ['true']\n",
    b"family: qwen3\xff\xfe\n", "[" * 50_000, "family: qwen3\ndtype: fp32\npipeline: [package]\n", "",
    "- just\n- a list\n", "family: {a: 1}\n"]


def mutate_manifest(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    path = s.out / "manifest.json"
    m = json.loads(path.read_text())
    how = rng.choice(("graph-file", "runtime", "files", "graphs", "external-data"))
    if how == "graph-file":
        kind = rng.choice(sorted(m["graphs"]))
        m["graphs"][kind]["file"] = rng.choice([str(s.secret), f"../{s.secret.parent.name}/{s.secret.name}",
                                                ".", "graphs", 5, None])
    elif how == "runtime":
        key = rng.choice(sorted(m["runtime"]) + ["whole"])
        if key == "whole":
            m.pop("runtime")
        else:
            m["runtime"][key] = rng.choice(hostile_values(rng, s.secret)[:17])
    elif how == "files":
        entry = rng.choice(m["files"])
        entry[rng.choice(("name", "bytes", "sha256"))] = rng.choice([str(s.secret), "../x", -1, None, 0])
    elif how == "graphs":
        m["graphs"] = rng.choice(hostile_values(rng, s.secret)[:17])
    else:
        external_data_to_bait(rng, s)
    path.write_text(json.dumps(m))
    command = rng.choice((["run", str(s.out), "--max-new-tokens", "2", "--greedy"],
                          ["inspect", str(s.out), "--checksums"]))
    return f"manifest {how}", command


def external_data_to_bait(rng: random.Random, s: Scratch) -> None:
    """Point one initializer of a graph at the secret file (absolute or ../), as finding 4 did."""
    import onnx

    graph = s.out / "model.decode.onnx"
    model = onnx.load(graph, load_external_data=False)
    inits = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    tensor = rng.choice(inits)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = rng.choice([str(s.secret), f"../{s.secret.parent.name}/{s.secret.name}"])
    onnx.save(model, graph)


def mutate_dataset(rng: random.Random, s: Scratch) -> tuple[str, list[str]]:
    path = s.root / rng.choice(("data.jsonl", "data.txt"))
    how = rng.choice(("bytes", "records", "deep", "long-line"))
    if how == "bytes":
        path.write_bytes(rng.randbytes(rng.randint(0, 4096)))
    elif how == "records":
        lines = [json.dumps(rng.choice([{"text": v} for v in hostile_values(rng, s.secret)[:17]]
                                       + [{"messages": [{"role": "user"}]}, {"messages": "hi"}, [1], "text"]))
                 for _ in range(rng.randint(1, 5))]
        path.write_text("\n".join(lines))
    elif how == "deep":
        path.write_text("[" * 200_000 + "\n")
    else:
        path.write_text("word " * 400_000)
    return f"dataset {path.name} {how}", ["eval", "ppl", str(s.out), "--dataset", str(path), "--window", "16",
                                          "--max-windows", "1"]


MUTATIONS: dict[str, Callable[[random.Random, Scratch], tuple[str, list[str]]]] = {
    "config": mutate_config, "header": mutate_header, "index": mutate_index, "recipe": mutate_recipe,
    "manifest": mutate_manifest, "dataset": mutate_dataset}


# -- the scratch world and its fences ------------------------------------------------------------------
class Scratch:
    def __init__(self, root: Path, outside: Path, ckpt: Path, out: Path) -> None:
        self.root, self.outside = root, outside
        self.secret = outside / "secret.txt"
        self.ckpt, self.out = ckpt, out


class OpenWatch:
    """Records every file Python opens (an audit hook: it cannot be removed, so it checks a flag)."""

    def __init__(self) -> None:
        self.watching: Path | None = None
        self.seen: list[str] = []
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.watching is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            try:
                path = Path(os.fsdecode(args[0])).resolve()
            except (OSError, ValueError):
                return
            if path.is_relative_to(self.watching):
                self.seen.append(str(path))


WATCH = OpenWatch()


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, checkpoint) -> tuple[Path, Path]:
    """tiny-qwen3 (sharded, indexed) and its conversion, copied into each case's scratch directory."""
    from qwen2om.convert import convert

    root = tmp_path_factory.mktemp("fuzz-base")
    out = root / "out"
    convert("builtin:tiny-qwen3", out, overrides=["max_seq_len=64", "prefill_chunk=16"])
    return Path(checkpoint("tiny-qwen3")), out


@pytest.mark.parametrize("case", range(CASES))
def test_fuzz(case: int, base: tuple[Path, Path], cli, tmp_path: Path) -> None:
    kind = KINDS[case % len(KINDS)]
    rng = random.Random(f"qwen2om-fuzz-{case}")
    outside, root = tmp_path / "outside", tmp_path / "scratch"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (outside / "keep").mkdir()
    (outside / "keep" / "notes.md").write_text("the user's own")
    root.mkdir()
    shutil.copytree(base[0], root / "ckpt", symlinks=True)
    s = Scratch(root, outside, root / "ckpt", root / "out")
    if kind in ("manifest", "dataset"):
        shutil.copytree(base[1], s.out)
    what, command = MUTATIONS[kind](rng, s)
    if kind not in ("manifest", "dataset"):
        shutil.rmtree(s.out, ignore_errors=True)
    before = tree_digest(outside)

    expired = threading.Event()

    def watchdog() -> None:
        expired.set()
        _thread.interrupt_main()  # a Ctrl-C: the command exits 130, and the flag says why

    timer = threading.Timer(TIME_LIMIT, watchdog)
    WATCH.seen, WATCH.watching = [], outside.resolve()
    timer.start()
    try:
        code, stdout, stderr = cli(*command)
    except BaseException as e:  # the cli fixture returns exit codes: anything else escaped main()
        raise AssertionError(f"case {case} ({what}): {type(e).__name__} escaped: {e}") from e
    finally:
        timer.cancel()
        WATCH.watching = None
    where = f"case {case} [{kind}] {what}\n$ qwen2om {' '.join(command)[:300]}\n{stderr[-2000:]}"
    print(f"fuzz {case} [{kind}] {what[:80]!r}: exit {code}, {(stderr.strip().splitlines() or [''])[-1][:160]}")
    assert not expired.is_set(), f"hung past {TIME_LIMIT:.0f} s: {where}"
    assert code in (0, 2), f"exit {code}: {where}"
    assert "Traceback" not in stderr, where
    assert not WATCH.seen, f"read outside the scratch directory ({WATCH.seen}): {where}"
    assert SECRET not in stdout + stderr, where
    assert tree_digest(outside) == before, f"changed outside the scratch directory: {where}"
    assert not list(root.glob(".*.partial")), f"left a staging folder: {where}"
    if code == 2:
        assert stderr.strip(), f"refused without saying why: {where}"
