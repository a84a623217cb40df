#!/usr/bin/env python3
"""int4 decode benchmark: qwen2om's W4A16 ONNX models against its fp32 one and ONNX Runtime GenAI's int4.

What it does, in order (every artefact is cached under `--workdir`/int4, `--rebuild` redoes them):

1. the synthetic bf16 checkpoint CKPT (`decode.ensure_checkpoint`: random weights, real Qwen3 shapes);
2. `qwen2om calibrate CKPT -o W4 --method rtn --group-size G`: a data-free compressed-tensors W4A16
   checkpoint (lm_head stays float: it is tied to the embedding);
3. three `qwen2om convert` outputs, all fp32 compute, `--set max_seq_len=P --set prefill_chunk=T`:
   - `fp32`: CKPT with the default recipe;
   - `w4-acc0`: W4 with the default recipe, whose `lower_int4` pass writes `com.microsoft::MatMulNBits`
     with accuracy_level 0 (float compute against the dequantised weights);
   - `w4-acc4`: W4 with a copy of `recipes/ort.yaml` whose pipeline says
     `- lower_int4: {accuracy_level: 4}` (activations quantised to int8 per block, as ORT GenAI does);
   (and the variants `--only` names: `w4-acc4-qhead` with an int4 LM head, `w4-acc4-qhead-gears` the same
   converted with `--gears 16,32,64,T`, so a short prompt's prefill runs at its smallest gear,
   `w4-acc4-g256-qhead-gears` the same at group 256);
4. `python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p int4 -e cpu -c CACHE` (HF_HUB_OFFLINE=1);
5. for each model, in a fresh child process (its own peak RSS, nothing shared between runtimes):
   the same `--prompt-tokens` ids, `--new-tokens` greedy tokens with EOS ignored, one warm-up and
   the median of `--runs` runs of prefill time and decode tok/s = (N - 1) / decode wall time:
   - qwen2om: `Engine(out, threads=…).generate(…)`, its own `Stats` (as `decode.bench_qwen2om`);
   - ORT GenAI: `og.Generator.append_tokens(prompt)` is the prefill; the N `generate_next_token`
     calls that follow are the decode (the first only picks the token from the prefill logits, as
     the first pick does in `Engine.generate`);
   before each, it waits for the 1-minute load average to fall under `--quiet-load` (at most
   `--max-wait-s` of waiting over the whole run, then it measures anyway), and records the load
   average when the timing starts and the CPU other processes used meanwhile;
6. with `--unpacked-rows`, the int4 models once more with ONNX Runtime's weight prepacking forced
   off (`session.disable_prepacking`, what the Engine did for every model before f4c0002; it still
   does for float ones): unpacked, MatMulNBits is 3-10x slower than with prepacking and ignores
   accuracy_level (levels 0 and 4 verify identically), consistent with dequantising all of B to
   float on every call before a float GEMM — ~1 tok/s here, so off by default;
7. `qwen2om verify OUT --reference W4 --tokens K` for both int4 models: max |Δlogits| against
   transformers on the exactly dequantised W4 weights (so accuracy_level 4's int8 error shows);
8. prints a markdown table and the facts behind it (`--json PATH` writes everything).

    .venv/bin/python bench/int4_decode.py --json .cache/bench/int4/result.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from decode import REPO, ChildRun, ForeignLoad, ensure_checkpoint, make_prompt, run_child

from qwen2om.fixtures.synthetic import DENSE_PRESETS, SyntheticPreset, resolve_preset

TARGET_SPEEDUP = 1.5  # the issue: qwen2om int4 decode >= 1.5x ORT GenAI int4
KEYS = ("fp32", "w4-acc0", "w4-acc4-unfused", "w4-acc4", "w4-acc4-qhead", "w4-acc4-g32-qhead",
        "w4-acc4-qhead-gears", "w4-acc4-g256-qhead-gears", "ort-genai", "w4-acc0-unpacked", "w4-acc4-unpacked")
# The int4 conversions: key → (calibration, recipe). Calibrations: "g" = --group-size G (LM head float, tied
# to the embedding), "g-qhead" = the same with --quantize-lm-head, "g32-qhead" / "g256-qhead" = group 32 / 256
# with it (256: fewer scales per weight, which ONNX Runtime's int4 kernel streams faster; a quality cost).
INT4 = {"w4-acc0": ("g", "default"), "w4-acc4-unfused": ("g", "acc4-unfused"), "w4-acc4": ("g", "acc4"),
        "w4-acc4-qhead": ("g-qhead", "acc4"), "w4-acc4-g32-qhead": ("g32-qhead", "acc4"),
        "w4-acc4-qhead-gears": ("g-qhead", "acc4"), "w4-acc4-g256-qhead-gears": ("g256-qhead", "acc4")}
# Converted with --gears 16,32,64,...,prefill_chunk (a short prompt's prefill).
GEARED = ("w4-acc4-qhead-gears", "w4-acc4-g256-qhead-gears")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model to time: which runtime runs it, where it lives, and how its sessions are set up."""

    key: str
    label: str
    runtime: str  # "qwen2om" or "ort-genai"
    path: Path
    unpacked: bool = False  # qwen2om only: force ONNX Runtime's `session.disable_prepacking` on


@dataclasses.dataclass
class Timing:
    """What a measuring child reports."""

    prefill_ms: float
    decode_tps: float
    decode_tps_runs: list[float]
    prefill_ms_runs: list[float]
    load_at_start: float
    foreign_cpu_percent: float
    tokens: list[int]
    load_s: float


# -- building the models ----------------------------------------------------------------------
def qwen2om_cli() -> list[str]:
    """The installed `qwen2om` console script next to this interpreter (`python -m qwen2om` from the
    repository root would import the local folder, which lacks `qwen2om.passes`)."""
    script = Path(sys.executable).with_name("qwen2om")
    return [str(script)] if script.is_file() else [shutil.which("qwen2om") or "qwen2om"]


def acc4_recipe(base: Path, dest: Path, *, fuse: bool = True) -> Path:
    """`base` with its pipeline entry `- lower_int4` made `- lower_int4: {accuracy_level: 4}`; without
    `fuse`, also without its `- fuse_int4` entry (q/k/v and gate/up stay separate MatMulNBits)."""
    text, n = re.subn(r"(?m)^(\s*)- lower_int4\b.*$", r"\1- lower_int4: {accuracy_level: 4}", base.read_text())
    if n != 1:
        raise SystemExit(f"{base}: expected one '- lower_int4' pipeline entry, found {n}")
    if not fuse:
        text, n = re.subn(r"(?m)^\s*- fuse_int4\b.*\n", "", text)
        if n != 1:
            raise SystemExit(f"{base}: expected one '- fuse_int4' pipeline entry, found {n}")
    dest.write_text(text)
    return dest


def build(what: str, done: Path, cmd: list[str], rebuild: bool, env: dict[str, str] | None = None,
          ) -> ChildRun | None:
    """Run `cmd` unless `done` exists (cached) and no rebuild was asked; its output goes to a log."""
    if done.exists() and not rebuild:
        return None
    print(f"{what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    log = done.parent.parent / f"{done.parent.name}.log"
    with log.open("w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        run = ChildRun(proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024)
    if run.returncode or not done.exists():
        raise SystemExit(f"{what} failed (exit {run.returncode}); see {log}")
    stamp(done.parent).write_text(git_commit() + "\n")
    return run


def stamp(out: Path) -> Path:
    """`OUT.commit` beside an output: the qwen2om commit that built it (a cached output outlives it)."""
    return out.with_name(out.name + ".commit")


def built_at(out: Path) -> str | None:
    return stamp(out).read_text().strip() if stamp(out).is_file() else None


# -- facts about an output --------------------------------------------------------------------
def decode_graph(v: Variant) -> Path:
    return v.path / ("model.onnx" if v.runtime == "ort-genai" else "model.decode.onnx")


def op_counts(graph: Path) -> tuple[dict[str, int], list[int], list[int]]:
    """Op counts of the graph (`domain::op` for non-default domains), and the MatMulNBits
    accuracy levels and block sizes it uses (the same counts as qwen2om's graphs/summary.txt)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    counts = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                                 for n in model.graph.node)
    levels, blocks = set(), set()
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in n.attribute}
            levels.add(attrs.get("accuracy_level", 0))
            blocks.add(attrs["block_size"])
    return dict(counts), sorted(levels), sorted(blocks)


def weight_bytes(out: Path) -> int:
    """Bytes on disk of the ONNX graphs and their external data (tokenizer and configs not counted)."""
    return sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".onnx" or f.name.endswith(".onnx.data"))


# -- measuring (in a child) -------------------------------------------------------------------
class _Unpacked:
    """Context manager: while active, `Engine` sessions have ONNX Runtime's weight prepacking off,
    whatever the manifest's `runtime.prepack_weights` says. Diagnostic only."""

    def __enter__(self) -> None:
        from unittest import mock

        import onnxruntime as ort

        from qwen2om.runtime import standalone

        class UnpackedOptions(ort.SessionOptions):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                super().add_session_config_entry("session.disable_prepacking", "1")

            def add_session_config_entry(self, key: str, value: str) -> None:
                if key != "session.disable_prepacking":  # already set
                    super().add_session_config_entry(key, value)

        self.patch = mock.patch.object(standalone.ort, "SessionOptions", UnpackedOptions)
        self.patch.start()

    def __exit__(self, *exc: object) -> None:
        self.patch.stop()


def time_qwen2om(v: Variant, ids: list[int], new_tokens: int, threads: int, runs: int) -> Timing:
    from qwen2om.runtime.standalone import Engine, Sampling

    t0 = time.perf_counter()
    if v.unpacked:
        with _Unpacked():
            engine = Engine(v.path, threads=threads)
    else:
        engine = Engine(v.path, threads=threads)
    load_s = time.perf_counter() - t0
    load, foreign = os.getloadavg()[0], ForeignLoad()
    stats, tokens = [], []
    for i in range(runs + 1):  # run 0 is the warm-up
        tokens, s = engine.generate(ids, max_new_tokens=new_tokens, sampling=Sampling(0.0), ignore_eos=True)
        if s.new_tokens != new_tokens:
            raise SystemExit(f"{v.key}: decoded {s.new_tokens} tokens, expected {new_tokens} ({s.stop})")
        if i:
            stats.append(s)
    prefill = [s.prefill_s * 1000 for s in stats]
    tps = [s.decode_tps for s in stats]
    return Timing(statistics.median(prefill), statistics.median(tps), tps, prefill, load,
                  foreign.percent_of_a_core(), tokens, load_s)


def time_genai(v: Variant, ids: list[int], new_tokens: int, threads: int, runs: int) -> Timing:
    import numpy as np
    import onnxruntime_genai as og

    t0 = time.perf_counter()
    config = og.Config(str(v.path))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - t0
    prompt = np.asarray(ids, dtype=np.int32)
    load, foreign = os.getloadavg()[0], ForeignLoad()
    prefill, tps, tokens = [], [], []
    for i in range(runs + 1):
        params = og.GeneratorParams(model)
        # min_length = max_length: EOS is masked until the end, so exactly new_tokens tokens
        params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens,
                                  min_length=len(ids) + new_tokens)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)  # runs the prompt through the model: the prefill
        t1 = time.perf_counter()
        for _ in range(new_tokens):  # the first picks from the prefill logits; N - 1 decode steps
            gen.generate_next_token()
        t2 = time.perf_counter()
        seq = [int(t) for t in gen.get_sequence(0)]
        if len(seq) != len(ids) + new_tokens:
            raise SystemExit(f"{v.key}: ORT GenAI produced {len(seq) - len(ids)} tokens, expected {new_tokens}")
        if i:
            prefill.append((t1 - t0) * 1000)
            tps.append((new_tokens - 1) / (t2 - t1))
            tokens = seq[len(ids):]
    return Timing(statistics.median(prefill), statistics.median(tps), tps, prefill, load,
                  foreign.percent_of_a_core(), tokens, load_s)


def child_main(spec_json: str) -> int:
    """`--child SPEC`: time one variant; the Timing goes to spec["result"] as JSON."""
    spec = json.loads(spec_json)
    v = Variant(**{**spec["variant"], "path": Path(spec["variant"]["path"])})
    fn = time_genai if v.runtime == "ort-genai" else time_qwen2om
    t = fn(v, spec["ids"], spec["new_tokens"], spec["threads"], spec["runs"])
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(t)))
    return 0


def wait_quiet(threshold: float, max_wait_s: float, poll_s: float = 10.0) -> tuple[float, float, bool]:
    """Poll the 1-minute load average until it is under `threshold`, at most `max_wait_s`.
    Returns (load average now, seconds waited, whether it got quiet)."""
    t0 = time.perf_counter()
    while (load := os.getloadavg()[0]) >= threshold and time.perf_counter() - t0 < max_wait_s:
        time.sleep(poll_s)
    return load, time.perf_counter() - t0, load < threshold


@dataclasses.dataclass
class Row:
    """One measured model, with the facts the table shows."""

    variant: Variant
    timing: Timing
    child: ChildRun
    weight_bytes: int
    ops: dict[str, int]
    nbits_levels: list[int]
    nbits_blocks: list[int]
    waited_s: float
    quiet: bool
    prepacked: str  # whether ONNX Runtime prepacked the weights, and why


def prepacking(v: Variant) -> str:
    """The Engine prepacks when the manifest's `runtime.prepack_weights` says so (int4 outputs since
    f4c0002); ORT GenAI keeps ONNX Runtime's default (on)."""
    if v.runtime == "ort-genai":
        return "on (ORT default)"
    if v.unpacked:
        return "off (forced)"
    runtime = json.loads((v.path / "manifest.json").read_text())["runtime"]
    return "on (manifest)" if runtime.get("prepack_weights") else "off (manifest)"


def measure(v: Variant, ids: list[int], a: argparse.Namespace, threads: int, budget: list[float]) -> Row:
    """Wait for a quiet machine (spending from `budget`, the seconds of waiting left for the whole
    run), then time `v` in a child process."""
    load, waited, quiet = wait_quiet(a.quiet_load, budget[0])
    budget[0] = max(budget[0] - waited, 0.0)
    print(f"measuring {v.label} (load {load:.2f} after waiting {waited:.0f} s) ...", file=sys.stderr, flush=True)
    result = a.workdir / "int4" / f"timing-{v.key}-t{threads}.json"
    spec = {"variant": {**dataclasses.asdict(v), "path": str(v.path)}, "ids": ids,
            "new_tokens": a.new_tokens, "threads": threads, "runs": a.runs, "result": str(result)}
    child = run_child([sys.executable, __file__, "--child", json.dumps(spec)])
    if child.returncode:
        raise SystemExit(f"timing {v.key} failed (exit {child.returncode})")
    timing = Timing(**json.loads(result.read_text()))
    ops, levels, blocks = op_counts(decode_graph(v))
    return Row(v, timing, child, weight_bytes(v.path), ops, levels, blocks, waited, quiet, prepacking(v))


def verify(out: Path, reference: Path, tokens: int, dest: Path, rebuild: bool) -> dict[str, Any]:
    """`qwen2om verify OUT --reference W4 --tokens K --json DEST` (cached in DEST)."""
    if rebuild or not dest.is_file():
        print(f"verifying {out.name} against {reference.name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([*qwen2om_cli(), "verify", str(out), "--reference", str(reference),
                               "--tokens", str(tokens), "--json", str(dest)], cwd=REPO,
                              capture_output=True, text=True, check=False)
        if not dest.is_file():  # verify exits non-zero when a tolerance is missed; the JSON says by how much
            raise SystemExit(f"verify {out} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(dest.read_text())
    return report


# -- report -----------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def matmul_cell(r: Row) -> str:
    nbits = r.ops.get("com.microsoft::MatMulNBits", 0)
    cell = f"{nbits} NBits" + (f" (acc {'/'.join(map(str, r.nbits_levels))}, block "
                               f"{'/'.join(map(str, r.nbits_blocks))})" if nbits else "")
    return f"{cell} + {r.ops.get('MatMul', 0)} MatMul"


def table(rows: list[Row]) -> str:
    genai = next((r.timing.decode_tps for r in rows if r.variant.runtime == "ort-genai"), None)
    lines = ["| model | decode graph: MatMulNBits + MatMul | ORT prepacking | weights on disk MiB | prefill ms "
             "| decode tok/s | runs (min–max) | vs ORT GenAI int4 (this run) | load avg at start "
             "| others' CPU % |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r.timing
        rel = f"{t.decode_tps / genai:.2f}×" if genai else "—"
        lines.append(f"| {r.variant.label} | {matmul_cell(r)} | {r.prepacked} | {mib(r.weight_bytes)} | "
                     f"{t.prefill_ms:.0f} | "
                     f"**{t.decode_tps:.2f}** | {min(t.decode_tps_runs):.2f}–{max(t.decode_tps_runs):.2f} | {rel} | "
                     f"{t.load_at_start:.2f} | "
                     f"{t.foreign_cpu_percent:.0f} |")
    return "\n".join(lines)


CODE = ("qwen2om", "passes", "kernels", "recipes")  # what a conversion depends on


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)


def git_commit() -> str:
    """HEAD, with "-dirty" when the code (not docs or benchmarks) has local changes."""
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *CODE).stdout.strip()
    return git("rev-parse", "HEAD").stdout.strip() + ("-dirty" if dirty else "")


def same_code(a: str, b: str) -> bool:
    """Whether two commits have the same qwen2om code (a "-dirty" one never does)."""
    if a.endswith("-dirty") or b.endswith("-dirty"):
        return a == b
    return git("diff", "--quiet", a, b, "--", *CODE).returncode == 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="int4 decode speed: qwen2om W4A16 vs fp32 vs ORT GenAI int4.")
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(DENSE_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the synthetic checkpoint")
    ap.add_argument("--group-size", type=int, default=128, help="calibrate --group-size")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512, help="compiled KV cache capacity P")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="T of the prefill graph")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = the cores this process may use)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    ap.add_argument("--quiet-load", type=float, default=1.2, help="wait for a 1-minute load average below this")
    ap.add_argument("--max-wait-s", type=float, default=600,
                    help="seconds of waiting for a quiet machine, for the whole run (then it measures anyway)")
    ap.add_argument("--unpacked-rows", action="store_true",
                    help="also time the int4 models with ONNX Runtime prepacking forced off (slow)")
    ap.add_argument("--skip-ort-genai", action="store_true")
    ap.add_argument("--only", default=None, help=f"comma-separated models to time, of: {', '.join(KEYS)}")
    ap.add_argument("--verify-tokens", type=int, default=16, help="qwen2om verify --tokens (0: skip verify)")
    ap.add_argument("--rebuild", action="store_true", help="redo calibration, conversions, the GenAI build, verify")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.only and (bad := set(a.only.split(",")) - set(KEYS)):
        ap.error(f"--only: unknown {sorted(bad)} (known: {', '.join(KEYS)})")
    if a.child is None and (a.new_tokens < 2 or a.prompt_tokens + a.new_tokens > a.max_seq_len):
        ap.error("need --new-tokens >= 2 and --prompt-tokens + --new-tokens <= --max-seq-len")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        return child_main(a.child)
    p = resolve_preset(a.preset, a.layers)
    assert isinstance(p, SyntheticPreset)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = a.threads or cores
    work = a.workdir / "int4"
    work.mkdir(parents=True, exist_ok=True)
    ckpt, _ = ensure_checkpoint(a.workdir, a.preset, p.layers, a.seed)
    tag = f"{a.preset}-L{p.layers}-s{a.seed}"
    groups = {"g": (a.group_size, False), "g-qhead": (a.group_size, True), "g32-qhead": (32, True),
              "g256-qhead": (256, True)}
    w4 = {c: work / f"w4-rtn-g{g}{'-qhead' if head else ''}-{tag}" for c, (g, head) in groups.items()}
    sets = ["--set", f"max_seq_len={a.max_seq_len}", "--set", f"prefill_chunk={a.prefill_chunk}"]
    shape = f"P{a.max_seq_len}-T{a.prefill_chunk}"
    out = {k: work / f"onnx-{k}-{tag}-{shape}" for k in ("fp32", *INT4)}
    genai = work / f"ortgenai-int4-{tag}"
    base = REPO / "recipes" / "ort.yaml"
    recipes = {"acc4": acc4_recipe(base, work / "qwen3-fp32-int4-acc4.yaml"),
               "acc4-unfused": acc4_recipe(base, work / "qwen3-fp32-int4-acc4-unfused.yaml", fuse=False)}
    force = ["--force"] if a.rebuild else []
    q = qwen2om_cli()
    commands = {f"calibrate {c}": [*q, "calibrate", str(ckpt), "-o", str(w4[c]), "--method", "rtn", "--group-size",
                                   str(g), *(["--quantize-lm-head"] if head else []), *force]
                for c, (g, head) in groups.items()}
    commands["fp32"] = [*q, "convert", str(ckpt), "-o", str(out["fp32"]), *sets, *force]
    gears = ",".join(map(str, [g for g in (16, 32, 64) if g < a.prefill_chunk] + [a.prefill_chunk]))
    for k, (c, r) in INT4.items():
        commands[k] = [*q, "convert", str(w4[c]), "-o", str(out[k]),
                       *([] if r == "default" else ["--recipe", str(recipes[r])]), *sets, *force,
                       *(["--gears", gears] if k in GEARED else [])]
    commands["ort-genai"] = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o",
                             str(genai), "-p", "int4", "-e", "cpu", "-c", str(work / "ortgenai-cache")]

    variants = [Variant("fp32", "qwen2om fp32", "qwen2om", out["fp32"]),
                Variant("w4-acc0", f"qwen2om int4 g{a.group_size}, accuracy_level 0", "qwen2om", out["w4-acc0"]),
                Variant("w4-acc4-unfused", f"qwen2om int4 g{a.group_size}, accuracy_level 4, unfused", "qwen2om",
                        out["w4-acc4-unfused"]),
                Variant("w4-acc4", f"qwen2om int4 g{a.group_size}, accuracy_level 4", "qwen2om", out["w4-acc4"]),
                Variant("w4-acc4-qhead", f"qwen2om int4 g{a.group_size}, accuracy_level 4, int4 LM head", "qwen2om",
                        out["w4-acc4-qhead"]),
                Variant("w4-acc4-g32-qhead", "qwen2om int4 g32, accuracy_level 4, int4 LM head", "qwen2om",
                        out["w4-acc4-g32-qhead"]),
                Variant("w4-acc4-qhead-gears", f"qwen2om int4 g{a.group_size}, accuracy_level 4, int4 LM head, "
                        f"prefill gears {gears}", "qwen2om", out["w4-acc4-qhead-gears"]),
                Variant("w4-acc4-g256-qhead-gears", "qwen2om int4 g256, accuracy_level 4, int4 LM head, "
                        f"prefill gears {gears}", "qwen2om", out["w4-acc4-g256-qhead-gears"])]
    if not a.skip_ort_genai:
        variants.append(Variant("ort-genai", "ORT GenAI int4 (accuracy_level 4)", "ort-genai", genai))
    if a.unpacked_rows or a.only:
        variants += [Variant(f"{k}-unpacked", f"diagnostic: qwen2om int4, accuracy_level {k[-1]}, prepacking off",
                             "qwen2om", out[k], unpacked=True) for k in ("w4-acc0", "w4-acc4")]
    if a.only:
        variants = [v for v in variants if v.key in a.only.split(",")]
    verified = [k for k in INT4 if a.verify_tokens and (not a.only or k in a.only.split(","))]
    wanted = {v.key.removesuffix("-unpacked") for v in variants} | set(verified)

    builds: dict[str, ChildRun | None] = {}
    for c in groups:
        if any(INT4[k][0] == c for k in wanted if k in INT4):
            builds[f"calibrate {c}"] = build(f"calibrate {c}", w4[c] / "config.json", commands[f"calibrate {c}"],
                                             a.rebuild)
    for k in ("fp32", *INT4):
        if k in wanted:
            builds[k] = build(f"convert {k}", out[k] / "manifest.json", commands[k], a.rebuild)
    if "ort-genai" in wanted:
        if a.rebuild and genai.exists():
            shutil.rmtree(genai)
        builds["ort-genai"] = build("ORT GenAI builder", genai / "genai_config.json", commands["ort-genai"],
                                    a.rebuild, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    ids = make_prompt(ckpt / "tokenizer.json", a.prompt_tokens)
    budget = [a.max_wait_s]
    rows = [measure(v, ids, a, threads, budget) for v in variants]
    checks = {k: verify(out[k], w4[INT4[k][0]], a.verify_tokens, work / f"verify-{k}-{tag}-{shape}.json",
                        a.rebuild) for k in verified}

    import onnxruntime as ort
    import onnxruntime_genai as og

    commit = git_commit()
    print(f"\n## int4 decode: {p.name}, {p.layers} layers, prompt {a.prompt_tokens} tokens, {a.new_tokens} new "
          f"tokens, P={a.max_seq_len}, T={a.prefill_chunk}, {threads} threads, qwen2om {commit[:12]}\n")
    print(table(rows))
    print()
    by = {r.variant.key: r for r in rows}
    facts = []
    for x, y in (("w4-acc0", "w4-acc4"), ("fp32", "w4-acc0"), ("w4-acc0-unpacked", "w4-acc0"),
                 ("w4-acc4-unfused", "w4-acc4"), ("w4-acc4", "w4-acc4-qhead")):
        if x in by and y in by:
            same = agreement(by[x].timing.tokens, by[y].timing.tokens)
            facts.append(f"greedy tokens {y} vs {x}: the first {same} of {a.new_tokens} identical")
    for k, rep in checks.items():
        facts.append(f"qwen2om verify {k} --reference W4 --tokens {a.verify_tokens}: max |Δlogits| "
                     f"{rep['max_abs_logits']:.4g}, top-1 agreement {rep['top1_agreement']:.3f}")
    for k in ("fp32", *INT4):
        if k not in wanted:
            continue
        built = built_at(out[k])
        if built is None or not same_code(built, commit):
            facts.append(f"{k} was converted at qwen2om {built or 'an unrecorded commit'}, not {commit} "
                         "(--rebuild to convert again)")
    for k, b in builds.items():
        if b:
            facts.append(f"build {k}: {b.wall_s:.0f} s, peak RSS {b.peak_rss_bytes / 2**30:.2f} GiB")
    facts += [f"{r.variant.key}: session load {r.timing.load_s:.1f} s, measuring child peak RSS "
              f"{r.child.peak_rss_bytes / 2**30:.2f} GiB, waited {r.waited_s:.0f} s for quiet"
              f"{'' if r.quiet else ' (gave up: still loaded)'}" for r in rows]
    facts.append(f"onnxruntime {ort.__version__}, onnxruntime-genai {og.__version__}, {threads} intra-op threads, "
                 f"{cores} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("\n".join(f"- {f}" for f in facts))
    if a.json:
        a.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "commit": commit, "preset": dataclasses.asdict(p), "prompt_ids": ids,
            "commands": commands, "recipes": {r: path.read_text() for r, path in recipes.items()},
            "builds": {k: dataclasses.asdict(b) if b else None for k, b in builds.items()},
            "rows": [{"variant": {**dataclasses.asdict(r.variant), "path": str(r.variant.path)},
                      "timing": dataclasses.asdict(r.timing), "child": dataclasses.asdict(r.child),
                      "weight_bytes": r.weight_bytes, "decode_graph_ops": r.ops, "nbits_accuracy_levels":
                      r.nbits_levels, "nbits_block_sizes": r.nbits_blocks, "waited_s": r.waited_s,
                      "quiet": r.quiet} for r in rows],
            "verify": checks, "built_at": {k: built_at(out[k]) for k in out},
            "versions": {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__,
                         "python": platform.python_version()},
            "threads": threads, "cores": cores,
            "target_speedup": TARGET_SPEEDUP,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
