#!/usr/bin/env python3
"""Headline figures: one run of the existing benchmarks, each figure beside what it is compared against.

It drives the bench scripts one after another, each in its own process with its own JSON and log
(under WORKDIR/headline/), then reads their JSON back and prints one markdown table:

1. `bench/decode.py` — fp32 decode tok/s and time to first token of qwen2om (ONNX Runtime) beside
   transformers on the same weights (sdpa, its default for Qwen3, and eager), Qwen3-0.6B shapes, 28 layers;
2. `bench/int4_decode.py --only w4-acc4-qhead-gears,ort-genai` — qwen2om int4 (RTN group 128, int4 LM
   head, accuracy_level 4, prefill gears) beside ONNX Runtime GenAI's int4 build of the same checkpoint;
   when `onnxruntime_genai` does not import (it is looked for in the venv and in `--genai-site`), beside
   qwen2om's own fp32 conversion instead;
3. `bench/moe_decode.py --transformers default --no-portable` — fp32 decode on Qwen3-30B-A3B shapes
   (2 of 48 layers) beside transformers with the implementations it picks when given none;
4. `bench/calibrate_memory.py --cases 0.6b:28` — peak RSS of `qwen2om calibrate --method gptq` beside the
   checkpoint's size;
5. `bench/convert_memory.py --qwen2om --cases qwen3-1.7b:28 --dtypes fp32` — peak RSS of `qwen2om convert`
   beside the checkpoint's size.

The header gives the date, `git rev-parse --short HEAD` (with "-dirty" when qwen2om/, passes/, kernels/,
fixtures/ or recipes/ have local changes, tracked or not), the CPU and the load average before each
step; WORKDIR/headline.json holds the table and every number behind it. Synthetic random-weight
checkpoints with real shapes; nothing is downloaded (HF_HUB_OFFLINE=1). About 12 minutes on 2 cores.

    .venv/bin/python bench/headline.py            # the real run (needs a quiet machine)
    .venv/bin/python bench/headline.py --quick    # smoke run: 1-2 layers, a few tokens; numbers mean nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GIB = 2**30
CODE = ("qwen2om", "passes", "kernels", "fixtures", "recipes")  # what the measured code is
INT4_KEY = "w4-acc4-qhead-gears"


@dataclasses.dataclass(frozen=True)
class Step:
    """One bench script run: the arguments of every run, then those of the real run or of `--quick`."""

    key: str
    script: str
    common: tuple[str, ...]
    full: tuple[str, ...]
    quick: tuple[str, ...]

    def args(self, quick: bool) -> list[str]:
        return [*self.common, *(self.quick if quick else self.full)]


@dataclasses.dataclass(frozen=True)
class Figure:
    """One table row: what qwen2om measured, beside what, and how."""

    what: str
    ours: str
    anchor: str
    ratio: str
    how: str


@dataclasses.dataclass
class StepRun:
    """What running a step left: exit code, wall time, the load average when it started, its files."""

    key: str
    cmd: list[str]
    returncode: int
    wall_s: float
    load_at_start: float
    json: str
    log: str


def plan(genai: bool) -> list[Step]:
    """The five runs, speed first (timed while the machine is freshest), memory (load-independent) last."""
    small = ("--prompt-tokens", "16", "--max-seq-len", "64", "--prefill-chunk", "32", "--runs", "1")
    int4 = (f"{INT4_KEY},ort-genai",) if genai else (f"{INT4_KEY},fp32", "--skip-ort-genai")
    return [
        Step("decode", "decode.py", ("--preset", "qwen3-0.6b"),
             ("--prompt-tokens", "128", "--new-tokens", "64", "--max-seq-len", "512"),
             ("--layers", "2", *small, "--new-tokens", "8")),
        Step("int4", "int4_decode.py", ("--only", *int4, "--rebuild"),
             ("--runs", "5", "--verify-tokens", "16", "--max-wait-s", "180"),
             ("--layers", "2", *small, "--new-tokens", "8", "--verify-tokens", "2", "--max-wait-s", "0")),
        Step("moe", "moe_decode.py", ("--preset", "qwen3-30b-a3b", "--transformers", "default", "--no-portable"),
             (), ("--layers", "1", *small, "--new-tokens", "4")),
        Step("calibrate", "calibrate_memory.py", ("--method", "gptq"), ("--cases", "0.6b:28"),
             ("--cases", "0.6b:2", "--num-samples", "2", "--seq-len", "32")),
        Step("convert", "convert_memory.py", ("--qwen2om", "--dtypes", "fp32", "--no-int4"),
             ("--cases", "qwen3-1.7b:28"), ("--cases", "qwen3-1.7b:2")),
    ]


# -- facts about the run ------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()


def commit() -> tuple[str, list[str]]:
    """Short HEAD, "-dirty" when the code has local changes (untracked files included), and those files."""
    changed = [ln[3:] for ln in git("status", "--porcelain", "--", *CODE).splitlines()]
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if changed else ""), changed


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def mem_gib() -> float:
    with open("/proc/meminfo") as fh:
        return int(next(ln for ln in fh if ln.startswith("MemTotal:")).split()[1]) * 1024 / GIB


def genai_imports(env: dict[str, str]) -> bool:
    return subprocess.run([sys.executable, "-c", "import onnxruntime_genai"], env=env, cwd=REPO,
                          capture_output=True, check=False).returncode == 0


# -- running ------------------------------------------------------------------------------------
def run_step(step: Step, quick: bool, out: Path, env: dict[str, str]) -> StepRun:
    """The script with `--workdir` and `--json` set, its output to a log; never raises on failure."""
    workdir, result, log = out.parent, out / f"{step.key}.json", out / f"{step.key}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(BENCH / step.script), *step.args(quick),
           "--workdir", str(workdir), "--json", str(result)]
    load = os.getloadavg()[0]
    print(f"[{time.strftime('%H:%M:%S')}] {step.key}: {' '.join(cmd[1:])} (load {load:.2f}) ...", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - t0
    print(f"    exit {rc}, {wall:.0f} s; log {log}", flush=True)
    return StepRun(step.key, cmd, rc, wall, load, str(result), str(log))


# -- the figures, from each script's JSON -------------------------------------------------------
def shapes(preset: str, layers: int) -> str:
    """`qwen3-0.6b`, 28 -> "Qwen3-0.6B shapes, 28 layers"."""
    return f"{preset.replace('qwen', 'Qwen').upper().replace('QWEN', 'Qwen')} shapes, {layers} layers"


def faster(ours: float, anchor: float) -> str:
    """Throughput ratio in words (higher is better)."""
    r = ours / anchor
    return f"{r:.2f}× ({'faster' if r >= 1 else f'{1 / r:.2f}× slower'})"


def quicker(ours_ms: float, anchor_ms: float) -> str:
    """Latency ratio in words (lower is better)."""
    r = ours_ms / anchor_ms
    return f"{r:.2f}× the time ({'faster' if r <= 1 else 'slower'})"


def from_decode(d: dict[str, Any], log: str) -> list[Figure]:
    rows = {r["name"]: r for r in d["rows"] if r["name"] != "bandwidth bound"}
    q, sdpa, eager = rows["qwen2om ORT fp32"], rows["transformers sdpa"], rows["transformers eager"]
    p, a = d["preset"], d["args"]
    shape = shapes(p["name"], p["layers"])
    m = re.search(r"greedy agreement qwen2om vs transformers eager: (\d+/\d+)", Path(log).read_text())
    how = (f"`bench/decode.py`: fp32 conversion (P={a['max_seq_len']}, T={a['prefill_chunk']}), then in one "
           f"process the Engine and transformers float32 (sdpa, eager) on the same {a['prompt_tokens']} prompt ids, "
           f"{a['new_tokens']} greedy tokens (EOS ignored), one warm-up + median of {a['runs']}, {d['threads']} "
           f"threads; decode tok/s = {a['new_tokens'] - 1} steps ÷ decode time (transformers: "
           f"{a['new_tokens'] - 1} ÷ (t{a['new_tokens']} − t1)); TTFT = the prefill (transformers: generate of 1 "
           f"token); greedy tokens equal to eager's: {m[1] if m else '?'}; other processes used "
           f"{d['foreign_cpu_percent_of_a_core']:.0f} % of a core meanwhile")
    return [
        Figure(f"fp32 decode, batch 1 ({shape})", f"{q['decode_tps']:.2f} tok/s",
               f"transformers sdpa {sdpa['decode_tps']:.2f} tok/s (eager {eager['decode_tps']:.2f})",
               faster(q["decode_tps"], sdpa["decode_tps"]), how),
        Figure(f"time to first token, {a['prompt_tokens']}-token prompt (same model)", f"{q['ttft_ms']:,.0f} ms",
               f"transformers sdpa {sdpa['ttft_ms']:,.0f} ms (eager {eager['ttft_ms']:,.0f})",
               quicker(q["ttft_ms"], sdpa["ttft_ms"]), "the same run as the row above"),
    ]


def from_int4(d: dict[str, Any], log: str) -> list[Figure]:
    rows = {r["variant"]["key"]: r for r in d["rows"]}
    q = rows[INT4_KEY]
    base_key = "ort-genai" if "ort-genai" in rows else "fp32"
    b = rows[base_key]
    base = "ONNX Runtime GenAI int4" if base_key == "ort-genai" else "qwen2om fp32 (GenAI not installed)"
    p, a = d["preset"], d["args"]
    qt, bt = q["timing"], b["timing"]
    ver = d.get("verify", {}).get(INT4_KEY)
    check = (f"; `qwen2om verify` against its W4 checkpoint ({a['verify_tokens']} tokens × 3 prompts): max |Δlogits| "
             f"{ver['max_abs_logits']:.3g}, top-1 {ver['top1_agreement']:.1%}") if ver else ""
    how = (f"`bench/int4_decode.py`: `calibrate --method rtn --group-size {a['group_size']} --quantize-lm-head`, "
           f"converted with `lower_int4: {{accuracy_level: 4}}` and prefill gears"
           + (", beside `onnxruntime_genai.models.builder -p int4 -e cpu` of the same bf16 checkpoint" if
              base_key == "ort-genai" else "")
           + f"; each model timed in a fresh child, {a['prompt_tokens']}-token prompt, {a['new_tokens']} greedy "
           f"tokens, one warm-up + median of {a['runs']}, {d['threads']} threads; prefill {qt['prefill_ms']:.0f} ms "
           f"vs {bt['prefill_ms']:.0f} ms; runs {min(qt['decode_tps_runs']):.2f}–{max(qt['decode_tps_runs']):.2f} vs "
           f"{min(bt['decode_tps_runs']):.2f}–{max(bt['decode_tps_runs']):.2f}; load {qt['load_at_start']:.2f} / "
           f"{bt['load_at_start']:.2f} at the starts, others' CPU {qt['foreign_cpu_percent']:.0f} / "
           f"{bt['foreign_cpu_percent']:.0f} % of a core{check}")
    return [Figure(f"int4 decode, batch 1 ({shapes(p['name'], p['layers'])})",
                   f"{qt['decode_tps']:.2f} tok/s", f"{base} {bt['decode_tps']:.2f} tok/s",
                   faster(qt["decode_tps"], bt["decode_tps"]), how)]


def from_moe(d: dict[str, Any], log: str) -> list[Figure]:
    q = d["rows"][0]
    t = next(r for r in d["rows"] if r["name"].startswith("transformers"))
    if q.get("error") or t.get("error"):
        raise ValueError(q.get("error") or t.get("error"))
    a, f = d["args"], d["facts"]
    same = sum(x == y for x, y in zip(q["tokens"], t["tokens"], strict=False))
    how = (f"`bench/moe_decode.py`: fp32 conversion (experts in `com.microsoft::MoE`), each runtime in a fresh "
           f"child on the same {a['prompt_tokens']} prompt ids, {a['new_tokens']} greedy tokens, one warm-up + "
           f"median of {a['runs']}, {d['threads']} threads; transformers float32 with its defaults ({t['note']}), "
           f"decode timed per token inside each run; prefill {q['prefill_ms']:,.0f} vs {t['prefill_ms']:,.0f} ms; "
           f"peak RSS {q['peak_rss_bytes'] / GIB:.2f} vs {t['peak_rss_bytes'] / GIB:.2f} GiB; greedy tokens equal "
           f"{same}/{len(q['tokens'])}; load {q['loadavg_1m']:.2f} / {t['loadavg_1m']:.2f} at the starts")
    return [Figure(f"MoE fp32 decode, batch 1 (Qwen3-30B-A3B shapes, {f['layers']} of 48 layers, "
                   f"{f['experts']} experts top-{f['top_k']})", f"{q['decode_tps']:.2f} tok/s",
                   f"transformers default {t['decode_tps']:.2f} tok/s", faster(q["decode_tps"], t["decode_tps"]), how)]


def memory_figure(label: str, peak: int, anon: int, checkpoint: int, note: str, how: str) -> Figure:
    """A peak-RSS row, beside the bf16 checkpoint it was measured on."""
    return Figure(label, f"{peak / GIB:.2f} GiB (anonymous {anon / GIB:.2f})",
                  f"checkpoint {checkpoint / GIB:.2f} GiB bf16 ({note})", f"{peak / checkpoint:.2f}× the checkpoint",
                  how)


def from_calibrate(d: list[dict[str, Any]], log: str) -> list[Figure]:
    r = d[0]
    if r["exit_code"]:
        raise ValueError(r["error"])
    ck = r["checkpoint_bytes"]
    how = (f"`bench/calibrate_memory.py`: `qwen2om calibrate --method {r['method']} --num-samples "
           f"{r['num_samples']} --seq-len {r['seq_len']}` (builtin:prose) in a fresh child; peak RSS = its "
           f"`ru_maxrss`, RssAnon polled every 0.05 s; {r['wall_s']:.0f} s wall")
    case = shapes(*r["case"].rsplit("-L", 1))
    return [memory_figure(f"calibration peak RSS, {r['method'].upper()} ({case}, {r['num_samples']} × "
                          f"{r['seq_len']} tokens)", r["peak_rss_bytes"], r["peak_rss_anon_bytes"], ck,
                          f"{2 * ck / GIB:.2f} GiB as fp32", how)]


def from_convert(d: dict[str, Any], log: str) -> list[Figure]:
    r = d["results"][0]
    if r["status"] != "ok":
        raise ValueError(r["error"] or r["status"])
    ck = r["checkpoint_bytes"]
    how = (f"`bench/convert_memory.py`: `qwen2om convert CKPT --dtype {r['dtype']} --max-seq-len "
           f"{d['meta']['max_seq_len']} --prefill-chunk {d['meta']['seq_len']}` in a fresh child; peak RSS = its "
           f"`ru_maxrss`, RssAnon polled every 0.2 s; {r['wall_s']:.0f} s wall, output "
           f"{r['output_bytes'] / GIB:.2f} GiB")
    case = shapes(*r["case"].rsplit("-L", 1))
    return [memory_figure(f"conversion peak RSS, {r['dtype']} ({case}, {r['params'] / 1e9:.2f}B parameters)",
                          r["peak_rss_bytes"], r["peak_anon_polled_bytes"], ck,
                          f"output {r['output_bytes'] / GIB:.2f} GiB {r['dtype']}", how)]


FIGURES: dict[str, Callable[[Any, str], list[Figure]]] = {
    "decode": from_decode, "int4": from_int4, "moe": from_moe, "calibrate": from_calibrate, "convert": from_convert}


def figures_of(run: StepRun) -> list[Figure]:
    """The step's figures, or one row saying why there are none (a failed step does not stop the others)."""
    try:
        if run.returncode:
            raise ValueError(f"exit {run.returncode}")
        return FIGURES[run.key](json.loads(Path(run.json).read_text()), run.log)
    except Exception as exc:  # any failure becomes a row that says so
        return [Figure(run.key, "failed", f"{type(exc).__name__}: {exc}"[:200], "—", f"see `{run.log}`")]


# -- report -------------------------------------------------------------------------------------
def markdown(meta: dict[str, Any], figures: list[Figure]) -> str:
    loads = ", ".join(f"{r['key']} {r['load_at_start']:.2f}" for r in meta["steps"])
    lines = [f"Measured {meta['date']} at qwen2om `{meta['commit']}`, in one run of `{meta['command']}` "
             f"({meta['total_s'] / 60:.1f} min). Machine: {meta['cpu']}, {meta['cores']} cores, "
             f"{meta['mem_gib']:.0f} GiB; 1-minute load average {meta['load_before']:.2f} before the run, "
             f"at each step's start: {loads}." + (" **Smoke run (`--quick`): the numbers mean nothing.**"
                                                   if meta["quick"] else ""),
             "", "| figure | qwen2om | beside | qwen2om ÷ beside |", "|---|---:|---|---|"]
    lines += [f"| {f.what} | **{f.ours}** | {f.anchor} | {f.ratio} |" for f in figures]
    lines += ["", "How each was measured:", ""]
    lines += [f"- *{f.what}*: {f.how}." for f in figures]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]) if __doc__ else None)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run (1-2 layers, a few tokens, one timed run; minutes, numbers meaningless)")
    ap.add_argument("--only", default=None,
                    help="comma-separated steps to run, of: decode, int4, moe, calibrate, convert (default all)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="checkpoints, conversions and results (default .cache/bench, .cache/bench/quick with --quick)")
    ap.add_argument("--genai-site", type=Path, default=REPO / ".cache" / "genai-site",
                    help="a `pip install --target` folder with onnxruntime-genai, put on PYTHONPATH when it exists "
                         "(default %(default)s)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="only print the table of a saved headline.json")
    a = ap.parse_args(argv)
    known = [s.key for s in plan(True)]
    if a.only and (bad := set(a.only.split(",")) - set(known)):
        ap.error(f"--only: unknown {sorted(bad)} (known: {', '.join(known)})")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render:
        saved = json.loads(a.render.read_text())
        print(markdown(saved["meta"], [Figure(**f) for f in saved["figures"]]))
        return 0
    workdir = (a.workdir or REPO / ".cache" / "bench" / ("quick" if a.quick else "")).resolve()
    out = workdir / "headline"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if a.genai_site.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(a.genai_site.resolve()), env.get("PYTHONPATH")]))
    genai = genai_imports(env)
    rev, changed = commit()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": rev, "changed": changed,
        "command": " ".join([".venv/bin/python", "bench/headline.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": a.quick, "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "mem_gib": mem_gib(),
        "load_before": os.getloadavg()[0], "genai": genai, "steps": []}
    print(f"qwen2om {rev}; ORT GenAI {'found' if genai else 'not found: int4 beside qwen2om fp32'}; "
          f"load {meta['load_before']:.2f}; results in {out}", flush=True)
    t0 = time.perf_counter()
    runs = [run_step(s, a.quick, out, env) for s in plan(genai) if not a.only or s.key in a.only.split(",")]
    meta["total_s"] = time.perf_counter() - t0
    meta["load_after"] = os.getloadavg()[0]
    meta["steps"] = [dataclasses.asdict(r) for r in runs]
    figures = [f for r in runs for f in figures_of(r)]
    text = markdown(meta, figures)
    (workdir / "headline.json").write_text(json.dumps(
        {"meta": meta, "figures": [dataclasses.asdict(f) for f in figures], "markdown": text}, indent=2) + "\n")
    print("\n" + text)
    return 1 if any(r.returncode for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
