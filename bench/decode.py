#!/usr/bin/env python3
"""Decode benchmark: qwen2om (ONNX Runtime, fp32) against transformers on the same checkpoint.

What it does, in order:

1. writes a random-weight bf16 checkpoint with real Qwen3 shapes (`qwen2om.fixtures.synthetic`),
   cached in the work directory, in a child process (its peak RSS is reported when it runs);
2. converts it with `qwen2om.convert.convert` in a child process, so the export wall time and
   the peak RSS of the conversion are the child's own (`os.wait4` rusage of that child only);
3. runs the same deterministic prompt (`--prompt-tokens` ids of the real Qwen tokenizer) through
   - the qwen2om `Engine`: time to first token (prefill) and greedy decode tokens/s,
   - transformers `AutoModelForCausalLM` in float32 with `attn_implementation` "eager" and "sdpa":
     TTFT = wall time of `generate(max_new_tokens=1)`, decode tok/s = (N - 1) / (t_N - t_1),
   each with one warm-up run and the median of `--runs` runs;
4. computes a memory-bandwidth upper bound on decode speed: the bytes one decode step must read
   (every linear weight, the LM head matrix, and the whole K/V cache at the compiled capacity, all
   fp32) divided by the measured copy bandwidth of this machine;
5. prints a markdown table and the facts needed to compare runs.

Random weights make the text meaningless but the arithmetic identical to the real model's; EOS
is ignored on both sides so every run decodes exactly `--new-tokens` tokens.

    .venv/bin/python bench/decode.py --preset qwen3-0.6b --layers 4 --new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
from tokenizers import Tokenizer

from qwen2om.fixtures.synthetic import DENSE_PRESETS, SyntheticPreset, resolve_preset
from qwen2om.runtime.standalone import Engine, Sampling

REPO = Path(__file__).resolve().parents[1]
# Prose, code and numbers, so the prompt exercises ordinary merges rather than one repeated token.
PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong stepped onto the surface at 02:56 UTC. def fib(n): return n if n < 2 else "
    "fib(n - 1) + fib(n - 2)  # a slow Fibonacci. Large language models predict the next token "
    "from the previous ones, caching keys and values so each step reads the weights once. "
)
COPY_BYTES = 1 << 30  # the bandwidth probe's buffer: 1 GiB of float32
FP32 = 4

# The conversion, run as `python -c` in a child so its peak RSS is measured alone.
CONVERT_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from qwen2om.convert import convert
t1 = time.perf_counter()
r = convert(sys.argv[1], sys.argv[2], overrides=json.loads(sys.argv[3]), force=True)
t2 = time.perf_counter()
with open(sys.argv[4], "w") as fh:
    json.dump({"import_s": t1 - t0, "convert_s": t2 - t1,
               "stages": [[s.name, s.seconds] for s in r.steps]}, fh)
"""


# -- child processes ------------------------------------------------------------------------
@dataclasses.dataclass
class ChildRun:
    """A finished child process: exit code, wall time, and the child's own peak RSS."""

    returncode: int
    wall_s: float
    peak_rss_bytes: int


def run_child(cmd: Sequence[str]) -> ChildRun:
    """Run `cmd` with inherited stdout/stderr; peak RSS from `wait4`, i.e. this child (and its
    waited-for descendants) only, not this process nor earlier children."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # wait4 reaped it; tell Popen
    return ChildRun(proc.returncode, wall, usage.ru_maxrss * 1024)  # Linux: ru_maxrss in KiB


def ensure_checkpoint(workdir: Path, preset: str, layers: int, seed: int) -> tuple[Path, ChildRun | None]:
    """The cached synthetic checkpoint, written (in a child) when absent. It is renamed into place
    only once complete, so its config.json and index mean it is whole."""
    dest = workdir / f"ckpt-{preset}-L{layers}-s{seed}"
    if (dest / "config.json").is_file() and (dest / "model.safetensors.index.json").is_file():
        return dest, None
    run = run_child([sys.executable, "-m", "qwen2om.fixtures.synthetic", preset, str(dest),
                     "--layers", str(layers), "--seed", str(seed)])
    if run.returncode:
        raise SystemExit(f"writing the synthetic checkpoint failed (exit {run.returncode})")
    return dest, run


def convert_in_child(ckpt: Path, out: Path, overrides: list[str]) -> tuple[ChildRun, dict[str, Any]]:
    """Convert in a fresh interpreter; return its run facts and the timings it measured itself."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "convert.json"
        run = run_child([sys.executable, "-c", CONVERT_CHILD, str(ckpt), str(out), json.dumps(overrides),
                         str(report)])
        if run.returncode:
            raise SystemExit(f"conversion failed (exit {run.returncode})")
        return run, json.loads(report.read_text())


# -- the prompt -----------------------------------------------------------------------------
def make_prompt(tokenizer_json: Path, n: int) -> list[int]:
    """`n` token ids of the real Qwen tokenizer: PROMPT_TEXT repeated and cut (deterministic)."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT_TEXT, add_special_tokens=False).ids
    return ids[:n]


# -- measurements ---------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One table row: decode tokens/s and time to first token (ms); None where not measured."""

    name: str
    decode_tps: float | None
    ttft_ms: float | None
    note: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)


class ForeignLoad:
    """CPU time other processes used while we measured, from the system-wide counters minus ours:
    on a shared machine this says whether the numbers can be trusted (0 % is a quiet machine)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.t0, self.sys0, self.me0 = time.perf_counter(), self._busy(), self._mine()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def _mine(self) -> float:
        t = self.me.cpu_times()
        return t.user + t.system

    def percent_of_a_core(self) -> float:
        wall = time.perf_counter() - self.t0
        other = (self._busy() - self.sys0) - (self._mine() - self.me0)
        return max(other, 0.0) / wall * 100 if wall > 0 else 0.0


def median_of(runs: int, fn: Callable[[], float]) -> float:
    """One warm-up call, then the median of `runs` calls."""
    fn()
    return statistics.median(fn() for _ in range(runs))


def bench_qwen2om(out: Path, ids: list[int], new_tokens: int, threads: int, runs: int) -> tuple[Row, int]:
    """Engine TTFT (prefill wall time) and decode tok/s ((N-1) steps / decode wall time), greedy."""
    engine = Engine(out, threads=threads)
    rss = psutil.Process().memory_info().rss
    results = []
    for i in range(runs + 1):  # run 0 is the warm-up
        # ignore_eos: decode exactly N tokens, as min_new_tokens does for transformers
        tokens, stats = engine.generate(ids, max_new_tokens=new_tokens, sampling=Sampling(0.0), ignore_eos=True)
        if stats.new_tokens != new_tokens:
            raise SystemExit(f"qwen2om decoded {stats.new_tokens} tokens, expected {new_tokens} ({stats.stop})")
        if i:
            results.append(stats)
    ttft = statistics.median(s.prefill_s for s in results) * 1000
    tps = statistics.median(s.decode_tps for s in results)
    del engine
    gc.collect()
    return Row("qwen2om ORT fp32", tps, ttft, tokens=tokens), rss


def bench_transformers(ckpt: Path, ids: list[int], new_tokens: int, runs: int, attn: str) -> Row:
    """transformers generate in float32: TTFT = generate(1 token); decode = (N-1)/(t_N - t_1)."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation=attn).eval()
    # A plain generation config: the checkpoint's sampling defaults would only produce warnings.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id)
    input_ids = torch.tensor([ids], dtype=torch.long)
    mask = torch.ones_like(input_ids)
    last: list[int] = []

    def timed(n: int) -> float:
        nonlocal last
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n)
        dt = time.perf_counter() - t0
        if out.shape[1] != len(ids) + n:
            raise SystemExit(f"transformers ({attn}) generated {out.shape[1] - len(ids)} tokens, expected {n}")
        last = out[0, len(ids):].tolist()
        return dt

    t1 = median_of(runs, lambda: timed(1))
    tn = median_of(runs, lambda: timed(new_tokens))
    tokens = last
    tps = (new_tokens - 1) / (tn - t1) if tn > t1 else float("nan")
    return Row(f"transformers {attn}", tps, t1 * 1000, tokens=tokens)


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5, threads: int = 1) -> float:
    """Bytes/s moved by `np.copyto` of an `nbytes` float32 buffer, best of `repeats`; each copy
    counts read + write, 2 × nbytes. With `threads` > 1 the buffer is split into that many slices
    copied by Python threads at once (numpy releases the GIL while it copies). Pages are faulted in
    beforehand, so only the copy is timed."""
    src = np.ones(nbytes // FP32, dtype=np.float32)
    dst = np.zeros_like(src)
    edges = np.linspace(0, src.size, threads + 1, dtype=np.int64)
    slices = [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]

    def copy() -> None:
        if threads == 1:
            np.copyto(dst, src)
            return
        workers = [threading.Thread(target=np.copyto, args=(dst[lo:hi], src[lo:hi])) for lo, hi in slices]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best  # the buffers go with this frame


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step of the static graph must read from memory, fp32."""

    linear: int  # q/k/v/o and gate/up/down of every layer
    lm_head: int  # the [hidden, vocab] head matrix (the tied embedding table when tied)
    kv_cache: int  # past K and V of every layer at the full compiled capacity

    @property
    def total(self) -> int:
        return self.linear + self.lm_head + self.kv_cache


def decode_bytes(p: SyntheticPreset, capacity: int) -> DecodeBytes:
    """Weights plus the full static cache (the graph reads all `capacity` slots every step, masked
    or not). Not counted: norms, the embedding row Gather, RoPE rows, activations, the K/V writes."""
    q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
    per_layer = p.hidden * q * 2 + p.hidden * kv * 2 + 3 * p.hidden * p.intermediate
    return DecodeBytes(
        linear=p.layers * per_layer * FP32,
        lm_head=p.vocab * p.hidden * FP32,
        kv_cache=2 * p.layers * p.kv_heads * capacity * p.head_dim * FP32,
    )


# -- report ---------------------------------------------------------------------------------
def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    base = next((r.decode_tps for r in rows if r.name == "transformers eager" and r.decode_tps), None)
    lines = ["| | decode tok/s | TTFT ms | speed-up vs transformers eager |", "|---|---:|---:|---:|"]
    for r in rows:
        speed = r.decode_tps / base if (base and r.decode_tps is not None) else None
        name = f"{r.name} ({r.note})" if r.note else r.name
        lines.append(f"| {name} | {fmt(r.decode_tps, '.2f')} | {fmt(r.ttft_ms, '.1f')} | "
                     f"{fmt(speed, '.2f') + '×' if speed is not None else '—'} |")
    return "\n".join(lines)


def agreement(a: list[int], b: list[int]) -> str:
    """How far two greedy continuations agree (random weights give near-ties, so fp32 paths that
    sum in different orders may part after a while)."""
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{same}/{min(len(a), len(b))} leading tokens identical"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Decode speed of qwen2om (ONNX Runtime fp32) vs transformers on a synthetic Qwen3 checkpoint.")
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(DENSE_PRESETS))  # the convertible ones
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512, help="compiled KV cache capacity P")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="T of the prefill graph")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch and ONNX Runtime intra-op threads (0 = the cores this process may use)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the synthetic checkpoint")
    ap.add_argument("--skip-transformers", action="store_true", help="measure qwen2om and the bound only")
    ap.add_argument("--reuse-conversion", action="store_true",
                    help="use an existing conversion in the work directory instead of converting again")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench",
                    help="checkpoints and conversions are kept here (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    a = ap.parse_args(argv)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (decode speed is measured over N - 1 steps)")
    if a.prompt_tokens < 1 or a.prompt_tokens + a.new_tokens > a.max_seq_len:
        ap.error(f"--prompt-tokens + --new-tokens ({a.prompt_tokens + a.new_tokens}) must fit --max-seq-len "
                 f"({a.max_seq_len})")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    p = resolve_preset(a.preset, a.layers)
    assert isinstance(p, SyntheticPreset)  # --preset admits only dense presets
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = a.threads or cores
    a.workdir.mkdir(parents=True, exist_ok=True)

    ckpt, writer = ensure_checkpoint(a.workdir, a.preset, p.layers, a.seed)
    out = a.workdir / f"onnx-{a.preset}-L{p.layers}-s{a.seed}-P{a.max_seq_len}-T{a.prefill_chunk}"
    overrides = [f"max_seq_len={a.max_seq_len}", f"prefill_chunk={a.prefill_chunk}", "dtype=fp32"]
    conv: ChildRun | None = None
    conv_report: dict[str, Any] = {}
    if not (a.reuse_conversion and (out / "manifest.json").is_file()):
        print(f"converting {ckpt.name} -> {out.name} ...", file=sys.stderr, flush=True)
        conv, conv_report = convert_in_child(ckpt, out, overrides)

    ids = make_prompt(ckpt / "tokenizer.json", a.prompt_tokens)
    rows: list[Row] = []
    foreign = ForeignLoad()
    print("measuring qwen2om ...", file=sys.stderr, flush=True)
    ours, engine_rss = bench_qwen2om(out, ids, a.new_tokens, threads, a.runs)
    rows.append(ours)

    import torch  # after ORT: nothing of torch's runs while the Engine is measured

    torch.set_num_threads(threads)
    if a.skip_transformers:
        rows += [Row("transformers eager", None, None, "skipped"), Row("transformers sdpa", None, None, "skipped")]
    else:
        for attn in ("eager", "sdpa"):
            print(f"measuring transformers {attn} ...", file=sys.stderr, flush=True)
            rows.append(bench_transformers(ckpt, ids, a.new_tokens, a.runs, attn))
            gc.collect()  # the model goes before the next one loads

    print("measuring copy bandwidth ...", file=sys.stderr, flush=True)
    bw = copy_bandwidth()
    bw_threads = copy_bandwidth(threads=threads) if threads > 1 else bw
    need = decode_bytes(p, a.max_seq_len)
    others = foreign.percent_of_a_core()
    rows.append(Row("bandwidth bound", bw / need.total, None, "1-thread copy"))
    if threads > 1:
        rows.append(Row("bandwidth bound", bw_threads / need.total, None, f"{threads}-thread copy"))

    print(f"\n## qwen2om decode benchmark: {p.name}, {p.layers} layers, prompt {a.prompt_tokens} tokens, "
          f"{a.new_tokens} new tokens, capacity {a.max_seq_len}\n")
    print(table(rows))
    print()
    facts = [
        f"conversion (fp32, P={a.max_seq_len}, T={a.prefill_chunk}): "
        + (f"convert() {conv_report['convert_s']:.1f} s wall, child process {conv.wall_s:.1f} s incl. imports, "
           f"peak RSS {gib(conv.peak_rss_bytes)}" if conv else "reused (not timed)"),
    ]
    if conv_report.get("stages"):
        facts.append("conversion stages: " + ", ".join(f"{n} {s:.1f} s" for n, s in conv_report["stages"]))
    if writer:
        facts.append(f"synthetic checkpoint written in {writer.wall_s:.1f} s, writer peak RSS "
                     f"{gib(writer.peak_rss_bytes)}")
    facts += [
        f"qwen2om process RSS with the Engine loaded: {gib(engine_rss)}",
        f"decode bytes per token (fp32): linear weights {gib(need.linear)} + lm_head {gib(need.lm_head)} "
        f"+ K/V cache at capacity {a.max_seq_len} {gib(need.kv_cache)} = {gib(need.total)}; "
        "not counted: norms, embedding Gather, RoPE rows, activations, K/V writes",
        f"copy bandwidth: {bw / 1e9:.1f} GB/s with one np.copyto of a 1 GiB float32 buffer"
        + (f", {bw_threads / 1e9:.1f} GB/s with {threads} threads copying slices at once" if threads > 1 else "")
        + " (best of 5, read + write counted); bound = bandwidth / bytes per token, an estimate from DRAM "
        "bandwidth: weights that stay in the last-level cache between steps can beat it",
    ]
    if not a.skip_transformers:
        facts.append("greedy agreement qwen2om vs transformers eager: " + agreement(rows[0].tokens, rows[1].tokens))
    facts += [
        f"onnxruntime {ort.__version__} (intra-op threads {threads}), torch {torch.__version__} "
        f"(threads {torch.get_num_threads()}), cores available {cores} "
        f"(logical {psutil.cpu_count()}, physical {psutil.cpu_count(logical=False)}), "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        f"timings: one warm-up, then the median of {a.runs} runs; other processes used {others:.0f} % of one "
        "core meanwhile (near 0 on a quiet machine)",
    ]
    print("\n".join(f"- {f}" for f in facts))
    if a.json:
        a.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "preset": dataclasses.asdict(p),
            "rows": [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in rows],
            "conversion": {**conv_report, **(dataclasses.asdict(conv) if conv else {})},
            "writer": dataclasses.asdict(writer) if writer else None,
            "engine_rss_bytes": engine_rss,
            "decode_bytes": {**dataclasses.asdict(need), "total": need.total},
            "copy_bandwidth_bytes_per_s": bw,
            "copy_bandwidth_threads_bytes_per_s": bw_threads,
            "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__},
            "threads": threads, "cores": cores, "foreign_cpu_percent_of_a_core": others,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
