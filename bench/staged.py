#!/usr/bin/env python3
"""Staged-runtime benchmark: one model and prompt, unstaged, in pipeline stages run in one process, and
in stages run as Ray actors (`--distributed ray`, a local cluster), side by side.

What it does, in order:

1. writes a random-weight checkpoint with real Qwen3 shapes (`qwen2om.fixtures.synthetic`, cached in the
   work directory; bench/decode.py's helper) and converts it fp32 three times: unstaged, `--stages 2`
   and `--stages 4` (each cached too);
2. measures each configuration in a child process of its own: greedy generation of `--new-tokens` tokens
   after a `--prompt-tokens` prompt (EOS ignored), one warm-up and the median of `--runs` runs: decode
   tokens/s, decode ms/token and prefill (time to first token) ms; the greedy tokens of every
   configuration must be the unstaged ones. The configurations take turns, `--rounds` times, and each
   figure is the median over the rounds: load from other processes drifts, and falls on all of them;
3. peak RSS: the measuring process's own (`wait4` of the child: with Ray, only the driver, since the
   actors are the raylet's children), and each actor's (VmHWM from /proc, read before the engine closes);
4. overheads: staged in-process against unstaged (decode ms/token, and in % of the unstaged decode time:
   the target is at most 5 %), and Ray against in-process with the same stages (ms per token);
5. prints a markdown table and the facts needed to compare runs.

    .venv/bin/python bench/staged.py                       # Qwen3-0.6B shape, 28 layers
    .venv/bin/python bench/staged.py --layers 8 --runs 1   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort
import psutil
from decode import REPO, ensure_checkpoint, make_prompt, run_child

from qwen2om.fixtures.synthetic import DENSE_PRESETS, SyntheticPreset, resolve_preset
from qwen2om.runtime.standalone import Engine, Sampling

# The conversion, as `python -c` in a child (memory and imports of its own).
CONVERT_CHILD = """
import json, sys
from qwen2om.convert import ConvertOptions, convert
stages = int(sys.argv[3]) or None
convert(sys.argv[1], sys.argv[2], ConvertOptions.from_overrides(json.loads(sys.argv[4]), stages=stages, force=True))
"""


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    stages: int  # 0: unstaged
    distributed: str | None = None


CONFIGS = (Config("unstaged", 0), Config("2 stages, in-process", 2), Config("4 stages, in-process", 4),
           Config("2 stages, Ray (2 actors)", 2, "ray"), Config("4 stages, Ray (4 actors)", 4, "ray"))


# -- one configuration, in its own process ---------------------------------------------------------------
def peak_rss(pid: int) -> int | None:
    """A process's peak resident set (VmHWM), from /proc (Linux; None elsewhere or once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(out: Path, distributed: str | None, ids: list[int], new_tokens: int, runs: int,
            threads: int) -> dict[str, Any]:
    """Median prefill and decode of `runs` greedy generations (after one warm-up), the stage actors'
    peak RSS, and the CPU other processes used meanwhile (this process and the actors not counted)."""
    engine = Engine(out, threads=threads, distributed=distributed)
    try:
        actors = [p.pid for p in engine.graphs["decode"].stages.places] if distributed else []  # type: ignore[attr-defined]
        t0, busy0, mine0 = time.perf_counter(), busy_seconds(), cpu_seconds([os.getpid(), *actors])
        results, tokens = [], []
        for i in range(runs + 1):  # run 0 is the warm-up
            tokens, stats = engine.generate(ids, max_new_tokens=new_tokens, sampling=Sampling(0.0), ignore_eos=True)
            if stats.new_tokens != new_tokens:
                raise SystemExit(f"decoded {stats.new_tokens} tokens, expected {new_tokens} ({stats.stop})")
            if i:
                results.append(stats)
        wall = time.perf_counter() - t0
        others = max(busy_seconds() - busy0 - (cpu_seconds([os.getpid(), *actors]) - mine0), 0.0) / wall * 100
        stage_rss = [peak_rss(pid) for pid in actors]
    finally:
        engine.close()
    decode_s = [s.decode_s / (s.new_tokens - 1) for s in results]
    return {"decode_tps": statistics.median(s.decode_tps for s in results),
            "decode_ms": statistics.median(decode_s) * 1000,
            "prefill_ms": statistics.median(s.prefill_s for s in results) * 1000,
            "stage_rss": stage_rss, "tokens": tokens, "foreign_percent": others}


# -- the report ------------------------------------------------------------------------------------------
def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds: median speeds, the largest peak RSS, the tokens of the first round."""
    med = {k: statistics.median(r[k] for r in rounds) for k in ("decode_tps", "decode_ms", "prefill_ms",
                                                                "foreign_percent")}
    stage_rss = [max((x for x in xs if x is not None), default=None) for xs in zip(*(r["stage_rss"] for r in rounds),
                                                                                   strict=True)]
    same = all(r["tokens"] == rounds[0]["tokens"] for r in rounds)
    return {**med, "stage_rss": stage_rss, "process_rss": max(r["process_rss"] for r in rounds),
            "tokens": rounds[0]["tokens"] if same else [], "rounds": rounds}


def mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f} MiB"


def table(rows: list[tuple[Config, dict[str, Any]]]) -> str:
    by = {c.name: r for c, r in rows}
    base = by["unstaged"]["decode_ms"]
    lines = ["| configuration | decode tok/s | decode ms/token | prefill ms | peak RSS: process | "
             "peak RSS: per stage (actor) | overhead per token |",
             "|---|---:|---:|---:|---:|---|---|"]
    for c, r in rows:
        if not c.stages:
            over = "(reference)"
        elif c.distributed is None:
            d = r["decode_ms"] - base
            over = f"{d:+.2f} ms ({d / base * 100:+.1f} % of unstaged decode)"
        else:
            ref = by[f"{c.stages} stages, in-process"]["decode_ms"]
            over = f"{r['decode_ms'] - ref:+.2f} ms vs in-process"
        stages = " / ".join(mib(x) for x in r["stage_rss"]) if r["stage_rss"] else "— (one process)"
        lines.append(f"| {c.name} | {r['decode_tps']:.2f} | {r['decode_ms']:.1f} | {r['prefill_ms']:.0f} | "
                     f"{mib(r['process_rss'])} | {stages} | {over} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Unstaged vs staged in-process vs staged over Ray, on a synthetic "
                                             "Qwen3 checkpoint (fp32, ONNX Runtime).")
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(DENSE_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=512, help="compiled KV cache capacity P")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="T of the prefill graph")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads per session (0: all cores)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    ap.add_argument("--rounds", type=int, default=2, help="every configuration measured this many times, in turns")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the synthetic checkpoint")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench",
                    help="checkpoints and conversions are kept here (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    ap.add_argument("--measure", nargs=3, metavar=("OUT", "DISTRIBUTED", "RESULT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (decode speed is measured over N - 1 steps)")
    if a.prompt_tokens + a.new_tokens > a.max_seq_len:
        ap.error(f"--prompt-tokens + --new-tokens must fit --max-seq-len ({a.max_seq_len})")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    p = resolve_preset(a.preset, a.layers)
    assert isinstance(p, SyntheticPreset)
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt, _ = ensure_checkpoint(a.workdir, a.preset, p.layers, a.seed)
    ids = make_prompt(ckpt / "tokenizer.json", a.prompt_tokens)
    if a.measure:  # a child: one configuration
        out, distributed, result = a.measure
        r = measure(Path(out), None if distributed == "-" else distributed, ids, a.new_tokens, a.runs, a.threads)
        Path(result).write_text(json.dumps(r))
        return 0

    overrides = [f"max_seq_len={a.max_seq_len}", f"prefill_chunk={a.prefill_chunk}", "dtype=fp32"]
    outs = {}
    for k in sorted({c.stages for c in CONFIGS}):
        out = a.workdir / f"staged-{a.preset}-L{p.layers}-s{a.seed}-P{a.max_seq_len}-T{a.prefill_chunk}-K{k}"
        if not (out / "manifest.json").is_file():
            print(f"converting {ckpt.name} -> {out.name} ...", file=sys.stderr, flush=True)
            if run_child([sys.executable, "-c", CONVERT_CHILD, str(ckpt), str(out), str(k),
                          json.dumps(overrides)]).returncode:
                raise SystemExit(f"converting with --stages {k} failed")
        outs[k] = out

    measured: dict[Config, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, c in enumerate(CONFIGS):
                print(f"measuring {c.name} (round {r + 1} of {a.rounds}) ...", file=sys.stderr, flush=True)
                result = Path(tmp) / f"{r}-{i}.json"
                child = run_child([sys.executable, __file__, "--preset", a.preset, "--layers", str(p.layers),
                                   "--seed", str(a.seed), "--workdir", str(a.workdir), "--prompt-tokens",
                                   str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--runs", str(a.runs),
                                   "--threads", str(a.threads), "--max-seq-len", str(a.max_seq_len),
                                   "--measure", str(outs[c.stages]), c.distributed or "-", str(result)])
                if child.returncode:
                    raise SystemExit(f"measuring {c.name} failed (exit {child.returncode})")
                measured[c].append({**json.loads(result.read_text()), "process_rss": child.peak_rss_bytes})
    rows = [(c, combined(m)) for c, m in measured.items()]

    base = rows[0][1]["tokens"]
    differ = [c.name for c, r in rows if r["tokens"] != base]
    print(f"\n## Staged runtime: {p.name} shape, {p.layers} layers, fp32, prompt {a.prompt_tokens} tokens, "
          f"{a.new_tokens} new tokens, capacity {a.max_seq_len}\n")
    print(table(rows))
    print()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    import ray

    facts = [
        "greedy tokens: " + ("identical in every configuration" if not differ else f"DIFFER in {', '.join(differ)}"),
        "peak RSS: process = the measuring process (wait4; with Ray the driver only); per stage = each actor's "
        "VmHWM (resident pages include the memory-mapped weights it read)",
        f"Ray {ray.__version__}: a local cluster started by the engine (not timed), one actor per stage (1 CPU "
        "each, fewer when the cluster has fewer CPUs than stages); decode ships each step's ids/mask/positions "
        "in the tasks, hidden states and the last stage's logits through Ray's object store",
        f"onnxruntime {ort.__version__}, intra-op threads {a.threads or 'all cores'} per session; cores available "
        f"{cores}; {platform.processor() or platform.machine()}, Python {platform.python_version()}",
        f"timings: per configuration, one warm-up and the median of {a.runs} runs, in {a.rounds} rounds taken in "
        "turns (the median of the rounds is shown); other processes' CPU meanwhile (Ray's own daemons included), "
        "in % of one core: " + ", ".join(f"{c.name} {r['foreign_percent']:.0f}" for c, r in rows),
    ]
    print("\n".join(f"- {f}" for f in facts))
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                                      "preset": dataclasses.asdict(p),
                                      "rows": [{"config": dataclasses.asdict(c), **r} for c, r in rows]},
                                     indent=2) + "\n")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
