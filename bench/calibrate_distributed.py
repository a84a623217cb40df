#!/usr/bin/env python3
"""Distributed calibration benchmark: `qwen2om calibrate` in one process and on N Ray actors, same samples,
side by side; and an extrapolation of a Qwen3.5-397B-A17B W4A16 GPTQ calibration from measured pieces.

Part 1 (`--only compare`): one model, one set of calibration samples, calibrated (GPTQ W4A16) once per
mode — single process (`distributed=None`) and Ray with each of `--workers` actors (a local cluster the
driver starts; not a multi-machine cluster). Every mode runs in a fresh child process of its own, so its
peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, a high-water mark) is that mode's driver alone;
the workers' peaks come from the report (`execution.worker_peak_rss_bytes`: each actor's own ru_maxrss,
for the single process the process itself). Every mode uses the same `--threads` (default 1) for the
driver and each worker, which is both the fair comparison (one core per worker) and what the byte-identity
guarantee needs. The table: wall time of the `calibrate()` call (Ray start-up included) and the sum of the
per-layer times (the layers alone), driver and per-worker peak RSS, the activations each worker holds
(computed: its samples × seq_len × hidden × 4 bytes), bytes moved between driver and workers per layer
(the report's `layers[i].run.bytes_moved`, mean over layers), and whether the checkpoint's bytes (sha256
of every file but calibration_report.json) equal the single process's.

Part 2 (`--only extrapolate`): a whole Qwen3.5-397B-A17B MoE layer (512 experts) cannot be calibrated on a
24 GiB machine (see the printed memory notes), so the costs that scale are timed one at a time at the real
shapes, with torch on one thread (one worker's core), and multiplied out: a statistics pass over the
tokens, the per-expert and dense GPTQ solves (`qwen2om.quant.shard.solve`, GPTQ plus the report's error
figures, on a random SPD Hessian), and the next-input pass, per layer × 60 layers, ÷ workers.

    .venv/bin/python bench/calibrate_distributed.py                                   # both parts
    .venv/bin/python bench/calibrate_distributed.py --only compare --samples 512 --seq-len 256 --workers 2 4
    .venv/bin/python bench/calibrate_distributed.py --model synthetic:0.6b:2 --samples 32 --seq-len 256
    .venv/bin/python bench/calibrate_distributed.py --only extrapolate --json .cache/bench/extrapolate.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from convert_memory import REPO, Case, ensure_checkpoint

from qwen2om.output import sha256_file

MIB = 2**20
GB = 10**9
REPORT = "calibration_report.json"


# -- part 1: one mode, in its own process ------------------------------------------------------------------
def resolve(model: str, workdir: Path) -> str:
    """A model argument for `calibrate`: `builtin:NAME` or a path as given; `synthetic:PRESET:LAYERS` is a
    random-weight checkpoint with published Qwen3 shapes (bench/convert_memory.py's, cached in `workdir`)."""
    if model.startswith("synthetic:"):
        return str(ensure_checkpoint(workdir, Case.parse(model.removeprefix("synthetic:"))))
    return model


def checkpoint_digest(out: Path) -> tuple[str, dict[str, str]]:
    """sha256 of every output file but the report, and one digest over (name, sha256) in name order."""
    files = {}
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.name != REPORT):
        files[str(f.relative_to(out))] = sha256_file(f)
    total = hashlib.sha256("".join(f"{n}\0{d}\n" for n, d in files.items()).encode()).hexdigest()
    return total, files


def run_mode(a: argparse.Namespace, mode: str, result: Path) -> int:
    """The child: calibrate once in `mode` ("single" or "ray-N"), write what was measured to `result`."""
    from qwen2om.builtin import resolve_model
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    model = resolve(a.model, a.workdir)
    hidden = Checkpoint(resolve_model(model)).dims.hidden
    workers = 1 if mode == "single" else int(mode.removeprefix("ray-"))
    out = a.workdir / "calibrate-distributed" / mode
    cfg = CalibrationConfig(method=a.method, group_size=a.group_size, num_samples=a.samples, seq_len=a.seq_len,
                            dataset=a.dataset, threads=a.threads)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # imports and the model header
    t0 = time.perf_counter()
    r = calibrate(model, out, cfg, force=True, distributed=None if mode == "single" else "ray", workers=workers)
    wall = time.perf_counter() - t0
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    digest, files = checkpoint_digest(out)
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    rep = r.report
    ex = rep["execution"]
    layers = rep["layers"]
    runs = [ly.get("run", {}) for ly in layers]
    result.write_text(json.dumps({
        "mode": mode, "model": model, "hidden": hidden, "wall_s": wall, "report_seconds": rep["seconds"],
        "layer_seconds": [ly["seconds"] for ly in layers], "driver_peak_rss_bytes": driver,
        "driver_rss_before_bytes": before, "worker_peak_rss_bytes": ex["worker_peak_rss_bytes"],
        "workers": ex["workers"], "threads": ex["threads"], "device": ex["device"], "chunks": ex["chunks"],
        "workers_lost": ex["workers_lost"], "samples": rep["dataset"]["samples"],
        "seq_len": rep["dataset"]["seq_len"], "dataset_sha256": rep["dataset"]["sha256"],
        "samples_per_worker": runs[0].get("samples_per_worker", []) if runs else [],
        "bytes_moved": [x.get("bytes_moved", 0) for x in runs], "mean_error": rep["mean_error"],
        "checkpoint_sha256": digest, "files": files}, indent=2))
    return 0


def measure_mode(a: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One mode in a fresh child (its own peak RSS, imports and Ray cluster); its log next to the outputs."""
    logs = a.workdir / "calibrate-distributed"
    logs.mkdir(parents=True, exist_ok=True)
    result, log = logs / f"{mode}.json", logs / f"{mode}.log"
    result.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--model", a.model, "--samples", str(a.samples),
            "--seq-len", str(a.seq_len), "--dataset", a.dataset, "--method", a.method, "--group-size",
            str(a.group_size), "--threads", str(a.threads), "--workdir", str(a.workdir),
            *(["--keep"] if a.keep else []), "--child", mode, str(result)]
    print(f"calibrating {a.model} ({mode}) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        foreign = foreign_cpu(proc)
        code = proc.returncode
    if code or not result.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"{mode} failed (exit {code}); {log}:\n" + "\n".join(tail))
    r = json.loads(result.read_text())
    r["child_wall_s"] = time.perf_counter() - t0
    r["loadavg_1min_after"] = os.getloadavg()[0]  # other work on the cores skews the times (not the bytes)
    r["foreign_cpu_percent"] = foreign
    return r


def foreign_cpu(proc: subprocess.Popen[bytes], every: float = 0.5) -> float:
    """Wait for `proc`; the CPU that processes outside its tree (the Ray actors and daemons it starts are in
    it) used meanwhile, in % of one core: the machine's busy time less the tree's, polled every `every` s."""
    import psutil

    def busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    mine: dict[int, float] = {}
    b0, t0 = busy(), time.perf_counter()
    while proc.poll() is None:
        try:
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    c = p.cpu_times()
                    mine[p.pid] = c.user + c.system
        except psutil.Error:
            pass
        time.sleep(every)
    wall = time.perf_counter() - t0
    return max(0.0, busy() - b0 - sum(mine.values())) / wall * 100


def mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


def compare_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = ["| mode | workers | wall s (calibrate call) | layers s (sum) | driver peak RSS MiB | "
             "worker peak RSS MiB (each) | activations held per worker MiB | bytes moved / layer (mean) | "
             "checkpoint = single process |",
             "|---|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        tokens = [n * r["seq_len"] for n in r["samples_per_worker"]]
        acts = " / ".join(f"{t * r['hidden'] * 4 / MIB:,.1f}" for t in tokens)
        moved = statistics.mean(r["bytes_moved"]) if r["bytes_moved"] else 0
        same = "yes" if r["checkpoint_sha256"] == base["checkpoint_sha256"] else "**NO**"
        if r is base:
            same = f"(reference) {base['checkpoint_sha256'][:12]}"
        else:
            same += f" {r['checkpoint_sha256'][:12]}"
        lines.append(f"| {r['mode']} | {r['workers']} | {r['wall_s']:.1f} | {sum(r['layer_seconds']):.1f} | "
                     f"{mib(r['driver_peak_rss_bytes'])} | "
                     f"{' / '.join(mib(x) for x in r['worker_peak_rss_bytes'])} | {acts} | "
                     f"{moved / MIB:,.2f} MiB | {same} |")
    return "\n".join(lines)


def compare(a: argparse.Namespace) -> dict[str, Any]:
    modes = ["single", *(f"ray-{n}" for n in a.workers)]
    rows = [measure_mode(a, m) for m in modes]
    r0 = rows[0]
    import ray
    import torch

    print(f"\n## calibrate {a.method} W4A16 g{a.group_size}: {a.model}, {r0['samples']} samples × {r0['seq_len']} "
          f"tokens of {a.dataset}, {r0['chunks']} chunks, threads {a.threads} everywhere\n")
    print(compare_table(rows))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    foreign = " / ".join(f"{r['foreign_cpu_percent']:.0f}" for r in rows)
    notes = [
        "wall s: the calibrate() call, Ray's local cluster start and the actors' start included; layers s: the "
        "report's per-layer seconds summed (collect, solve, advance and the driver's share, no start-up)",
        "driver peak RSS: ru_maxrss of the child process that ran calibrate() (with Ray: the driver only; "
        f"before calibrate() it was {' / '.join(mib(r['driver_rss_before_bytes']) for r in rows)} MiB: "
        "imports); worker peak RSS: each worker's own ru_maxrss (single process: the process itself)",
        "activations held: computed, samples dealt to the worker × seq_len × hidden × 4 bytes (float32)",
        "bytes moved: tensors sent to and returned by the workers per layer (the report's run.bytes_moved; "
        "0 in one process)",
        f"same samples in every mode: dataset sha256 {r0['dataset_sha256'][:12]}…; "
        + ("identical" if len({r['dataset_sha256'] for r in rows}) == 1 else "DIFFERENT") + " across modes",
        f"torch {torch.__version__}, Ray {ray.__version__}, Python {platform.python_version()}, {cores} cores "
        f"({cpu_name()}); workers lost: {sum(len(r['workers_lost']) for r in rows)}",
        f"CPU used by other processes while each mode ran, in % of one core (times are only comparable "
        f"when these are near 0): {foreign}. Ray runs its workers at nice 15 by default, so another busy "
        "process on the same cores slows them more than the single process (nice 0)",
    ]
    print("\n".join(f"- {n}" for n in notes))
    return {"rows": rows}


# -- part 2: Qwen3.5-397B-A17B extrapolation ---------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn: Callable[[], Any], reps: int = 1, warm: bool = False) -> float:
    """Median seconds of `reps` calls (after one untimed call with `warm`)."""
    if warm:
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@dataclasses.dataclass(frozen=True)
class Big:
    """The published sizes used (qwen2om.fixtures.layouts.QWEN3_5_397B_A17B_CONFIG's text_config)."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    layer_types: tuple[str, ...]
    shapes: dict[str, dict[str, tuple[int, int]]]  # layer kind → quantised dense weight → [out, in]


def big_model() -> Big:
    from qwen2om.arch import quantizable, resolve_arch
    from qwen2om.fixtures.layouts import QWEN3_5_397B_A17B, QWEN3_5_397B_A17B_CONFIG

    t = QWEN3_5_397B_A17B_CONFIG["text_config"]
    cfg = QWEN3_5_397B_A17B.config_for(4)  # layers 0-2 linear attention, 3 full attention
    table = QWEN3_5_397B_A17B.tensors(cfg, ())
    arch = resolve_arch(cfg)
    shapes: dict[str, dict[str, tuple[int, int]]] = {}
    for kind, i in (("linear_attention", 0), ("full_attention", 3)):
        p = f".layers.{i}."
        shapes[kind] = {n.split(p, 1)[1]: tuple(s) for n, s in table.items()  # type: ignore[misc]
                        if p in n and len(s) == 2 and ".experts." not in n
                        and quantizable(arch, n.replace("model.language_model.", "model."))}
    return Big(t["hidden_size"], t["num_hidden_layers"], t["num_experts"], t["num_experts_per_tok"],
               t["moe_intermediate_size"], t["shared_expert_intermediate_size"], tuple(t["layer_types"]), shapes)


def spd(k: int, torch: Any) -> Any:
    """A random symmetric positive definite [k, k] Hessian, mean 2xxᵀ of 2,048 random rows plus a ridge."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2048, k, generator=g)
    return (x.T @ x) * (2 / 2048) + 0.1 * torch.eye(k)


def extrapolate(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from qwen2om.quant.gptq import gptq, gram
    from qwen2om.quant.int4 import Int4Spec
    from qwen2om.quant.shard import Job, Settings, solve
    from qwen2om.quant.tree import add

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = big_model()
    h, e, k, inter = m.hidden, m.experts, m.top_k, m.moe_inter
    tokens = a.big_samples * a.big_seq_len
    chunks = a.big_samples  # batch_size 1: one chunk per sample (calibrate's default)
    per_expert_tokens = tokens * k / e
    spec = Int4Spec(a.big_group_size, True)
    settings = Settings(spec, False, 0.01, True, (1.0,), "float32", "cpu", 1, 2 << 30)
    measured: dict[str, float] = {}
    t_all = time.perf_counter()
    print("timing the pieces (torch, 1 thread) ...", file=sys.stderr, flush=True)

    # statistics pass: Σxxᵀ (+ Σ|x|) of one distinct input, per 1,024 tokens, as the linears' hooks do
    for width in sorted({h, inter, *(s[1] for d in m.shapes.values() for s in d.values())}):
        x = torch.randn(1024, width)
        measured[f"gram {width} per 1k tokens"] = timed(lambda x=x: (gram(x), x.abs().sum(0)), reps=3, warm=True)
    # the expert collector's work per expert per 1,024 routed tokens (qwen2om/quant/experts.py's hook)
    xe, wgu = torch.randn(1024, h), torch.randn(h, 2 * inter) * 0.02
    acc_gu, acc_d = torch.zeros(h, h), torch.zeros(inter, inter)

    def expert_stats() -> None:
        gu = xe @ wgu
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        acc_gu.add_(xe.T @ xe)
        acc_d.add_(act.T @ act)
    measured["expert stats per 1k routed tokens"] = timed(expert_stats, reps=3, warm=True)
    # routing one chunk of seq_len tokens, and the per-expert token selection loop over all E experts
    xc = torch.randn(a.big_seq_len, h)
    router = torch.randn(e, h) * 0.02

    def route() -> None:
        index = torch.topk(torch.softmax(xc @ router.T, -1), k, -1).indices
        for j in range(e):
            xc[(index == j).any(-1)]
    measured["routing + expert selection per chunk"] = timed(route, reps=3, warm=True)
    # per chunk, whatever its tokens: the collector's fresh E·H² + E·I² float32 sums, and one tree add of
    # two such sums — timed for `probe` experts and scaled to E (both are linear in E)
    probe = a.probe_experts

    def fresh() -> dict[str, Any]:
        return {"e.gate_up": torch.zeros(probe, h, h), "e.down": torch.zeros(probe, inter, inter)}
    pair = [fresh(), fresh()]
    measured[f"zeroed expert sums per chunk ({probe} experts)"] = timed(fresh, reps=3, warm=True)
    measured[f"tree add of expert sums ({probe} experts)"] = timed(lambda: add(pair[0], pair[1]), reps=3, warm=True)
    pair.clear()
    # forward passes in calibrate's default compute dtype (float32; faster than bfloat16 on this CPU): one expert's
    # MLP on 1,024 tokens, and the attention projections of each layer kind (the attention core is not timed)
    bf = torch.float32  # calibrate's default compute_dtype
    x16 = torch.randn(1024, h, dtype=bf)
    wgu16, wd16 = (torch.randn(h, 2 * inter) * 0.02).to(bf), (torch.randn(inter, h) * 0.02).to(bf)

    def expert_mlp() -> None:
        gu = x16 @ wgu16
        (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd16
    measured["expert MLP forward per 1k tokens (fp32)"] = timed(expert_mlp, reps=3, warm=True)
    for kind, shapes in m.shapes.items():
        ws = {n: (torch.randn(s[1], s[0]) * 0.02).to(bf) for n, s in shapes.items() if "shared_expert" not in n}
        xs = {w: torch.randn(1024, w, dtype=bf) for w in {t.shape[0] for t in ws.values()}}
        measured[f"{kind} projections forward per 1k tokens (fp32)"] = timed(
            lambda ws=ws, xs=xs: [xs[t.shape[0]] @ t for t in ws.values()], reps=3, warm=True)
        del ws, xs
    # GPTQ solves at the real shapes: the worker's solve() (GPTQ, then RTN and GPTQ output errors for the
    # report) on a random SPD Hessian; and GPTQ alone for the expert shapes
    hess: dict[int, Any] = {}
    unique = {(inter, h): "expert gate/up", (h, inter): "expert down"}
    for kind, shapes in m.shapes.items():
        for n, s in shapes.items():
            unique.setdefault(tuple(s), f"{kind}: {n}")
    for (n_out, k_in), what in sorted(unique.items(), key=lambda kv: kv[0][0] * kv[0][1]):
        print(f"  solve [{n_out}, {k_in}] ({what}) ...", file=sys.stderr, flush=True)
        hk = hess.setdefault(k_in, spd(k_in, torch))
        w = torch.randn(n_out, k_in) * 0.02
        job = Job("w", w, hk, torch.bfloat16)  # scales stored bf16, as the checkpoint's dtype
        measured[f"solve [{n_out}, {k_in}]"] = timed(lambda job=job: solve(job, settings, torch.device("cpu")))
        if what.startswith("expert"):
            measured[f"gptq only [{n_out}, {k_in}]"] = timed(lambda w=w, hk=hk: gptq(w, hk, spec, actorder=True,
                                                                                      scale_dtype=torch.bfloat16))
    for kk in list(hess):
        del hess[kk]
    measure_s = time.perf_counter() - t_all

    # -- the model ------------------------------------------------------------------------------------
    per1k = tokens / 1024
    kinds = {kind: m.layer_types.count(kind) for kind in m.shapes}

    def dense_inputs(kind: str) -> list[int]:
        """Distinct inputs whose Σxxᵀ the statistics pass sums (q/k/v, gate/up share theirs)."""
        seen: dict[str, int] = {}
        for n, s in m.shapes[kind].items():
            module = n.rsplit(".", 2)[0]  # linear_attn / self_attn / mlp.shared_expert
            key = f"{module}:{s[1]}" if n.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) \
                else f"{module}:in"
            seen[key] = s[1]
        return list(seen.values())

    def solve_s(shape: tuple[int, int]) -> float:
        return measured[f"solve [{shape[0]}, {shape[1]}]"]

    scale = e / probe
    per_layer: dict[str, dict[str, float]] = {}
    for kind in m.shapes:
        stats_dense = per1k * sum(measured[f"gram {w} per 1k tokens"] for w in dense_inputs(kind))
        stats_expert = tokens * k / 1024 * measured["expert stats per 1k routed tokens"]
        stats_chunk = chunks * (measured["routing + expert selection per chunk"]
                                + scale * (measured[f"zeroed expert sums per chunk ({probe} experts)"]
                                           + measured[f"tree add of expert sums ({probe} experts)"]))
        proj = per1k * measured[f"{kind} projections forward per 1k tokens (fp32)"]
        shared = per1k * measured["expert MLP forward per 1k tokens (fp32)"]
        fwd_coded = proj + shared + per1k * e * measured["expert MLP forward per 1k tokens (fp32)"]
        fwd_routed = proj + shared + per1k * k * measured["expert MLP forward per 1k tokens (fp32)"]
        solves = e * (2 * solve_s((inter, h)) + solve_s((h, inter))) + sum(solve_s(s) for s in m.shapes[kind].values())
        per_layer[kind] = {"stats: dense Σxxᵀ": stats_dense, "stats: expert Σxxᵀ (routed tokens)": stats_expert,
                           "stats: per-chunk expert sums (zero + tree add) and routing": stats_chunk,
                           "forward as coded (all E experts per token), ×2 passes": 2 * fwd_coded,
                           "forward routed (top-k experts per token), ×2 passes": 2 * fwd_routed,
                           "solves (E × gate/up/down + dense)": solves}
    # serial on the driver whatever N: joining the workers' expert sums (N - 1 adds of E·H² + E·I² at least)
    # and scaling each expert's Hessian by 2/tokens when its jobs are made (one pass over E·H² + E·I²)
    add_full = scale * measured[f"tree add of expert sums ({probe} experts)"]
    expert_bytes = e * (h * h + inter * inter) * 4

    def total(n: int, coded: bool) -> tuple[float, float]:
        par = ser = 0.0
        for kind, c in per_layer.items():
            fwd = c["forward as coded (all E experts per token), ×2 passes" if coded
                    else "forward routed (top-k experts per token), ×2 passes"]
            par += kinds[kind] * (c["stats: dense Σxxᵀ"] + c["stats: expert Σxxᵀ (routed tokens)"]
                                  + c["stats: per-chunk expert sums (zero + tree add) and routing"]
                                  + fwd + c["solves (E × gate/up/down + dense)"])
            ser += kinds[kind] * (max(0, n - 1) * add_full + add_full)  # join + Hessian scaling (≈ one add)
        return par / n, ser

    rows = []
    for n in a.big_workers:
        for coded in (True, False):
            p, s = total(n, coded)
            rows.append({"workers": n, "forward": "as coded (E experts)" if coded else "routed (top-k)",
                         "parallel_s": p, "serial_s": s, "total_s": p + s})
    out = {"model": dataclasses.asdict(m), "samples": a.big_samples, "seq_len": a.big_seq_len, "tokens": tokens,
           "tokens_per_expert": per_expert_tokens, "measured_s": measured, "per_layer_s": per_layer,
           "layer_kinds": kinds, "rows": rows, "measure_wall_s": measure_s, "expert_sum_bytes": expert_bytes}
    print_extrapolation(out, a)
    return out


def hours(s: float) -> str:
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s / 60:,.1f} min" if s >= 60 else f"{s:,.2f} s"


def print_extrapolation(x: dict[str, Any], a: argparse.Namespace) -> None:
    m = x["model"]
    print(f"\n## Extrapolation: Qwen3.5-397B-A17B W4A16 GPTQ g{a.big_group_size}, {x['samples']} samples × "
          f"{x['seq_len']} tokens ({x['tokens']:,} tokens), CPU, one thread per worker\n")
    print("Measured pieces (this machine, torch on 1 thread; median of 3 unless one run):\n")
    print("| piece | seconds |\n|---|---:|")
    for name, s in x["measured_s"].items():
        print(f"| {name} | {s:.4f} |")
    print(f"\nPer layer, one worker (layer kinds: {', '.join(f'{n} × {k}' for k, n in x['layer_kinds'].items())}):\n")
    kinds = list(x["per_layer_s"])
    print("| cost | " + " | ".join(kinds) + " |\n|---|" + "---:|" * len(kinds))
    for cost in x["per_layer_s"][kinds[0]]:
        print(f"| {cost} | " + " | ".join(hours(x["per_layer_s"][k][cost]) for k in kinds) + " |")
    print(f"\nWhole model ({m['layers']} layers), total = parallel ÷ N + serial (driver):\n")
    print("| workers N | forward | parallel part ÷ N | serial (driver) | total |\n|---:|---|---:|---:|---:|")
    for r in x["rows"]:
        print(f"| {r['workers']} | {r['forward']} | {hours(r['parallel_s'])} | {hours(r['serial_s'])} | "
              f"{hours(r['total_s'])} |")
    gb = x["expert_sum_bytes"] / GB
    notes = [
        f"routing: top-{m['top_k']} of {m['experts']} experts, assumed uniform: each expert sees "
        f"{x['tokens']:,} × {m['top_k']} / {m['experts']} ≈ {x['tokens_per_expert']:,.0f} tokens (so every "
        "expert gets GPTQ, none falls back to RTN)",
        f"statistics pass: the dense inputs' Σxxᵀ per token; per routed token one expert's gate_up product, "
        f"its Σxxᵀ [{m['hidden']}²] and its activations' Σxxᵀ [{m['moe_inter']}²] (the collector's code); per "
        f"chunk (batch_size 1: one chunk per sample, {x['samples']} chunks) routing, fresh zeroed per-expert "
        f"sums and one tree add of them, timed for {a.probe_experts} experts and scaled "
        f"×{m['experts'] // a.probe_experts}",
        "forward (each layer runs twice: statistics pass and next-input pass): attention projections "
        "and expert MLPs in float32 (calibrate's default --compute-dtype); the attention core (Gated "
        "DeltaNet recurrence, softmax attention over the 2,048 positions), norms and the router are NOT timed: "
        "a lower bound. 'as coded': the static model's prefill path runs every token through all "
        f"{m['experts']} experts ([E, N, H] matmuls, qwen2om/static_model.py RoutedExperts); 'routed': "
        f"only the top-{m['top_k']} (+ the shared expert), what a grouped-expert forward would cost",
        "solves: qwen2om.quant.shard.solve (GPTQ with act-order, damp 0.01, then the RTN and GPTQ output "
        "errors the report gives) on a random SPD Hessian, at each real shape, one run each; per layer "
        f"{m['experts']} × (gate + up + down) + the layer kind's quantised dense weights",
        "÷ N: statistics, forwards and solves all divide over the workers (perfect balance assumed; the Ray "
        "transfer time is not included); serial: the driver joins the workers' expert sums (N − 1 tree adds "
        "of E·H² + E·I² float32) and scales each expert's Hessian once (≈ one more add)",
        f"per-core speed: this machine's ({cpu_name()}); float32 matmul ~140 GFLOP/s on one core measured "
        "separately; no GPU; memory bandwidth of the per-chunk sums is this VM's",
        f"MEMORY (the finding): the expert collector keeps one dense float32 Hessian per expert per input: "
        f"{m['experts']} × ({m['hidden']}² + {m['moe_inter']}²) × 4 B = {gb:.1f} GB per layer, allocated afresh "
        f"for every chunk, and the canonical tree holds up to log₂(chunks) partial sums of that size at once "
        f"per worker, while the driver holds every worker's returned node(s) before joining ("
        f"≥ N × {gb:.1f} GB) and each worker returns ≥ {gb:.1f} GB per layer over Ray. A 512-expert layer "
        "cannot be calibrated on this 24 GiB machine at all; these times assume machines that can hold it",
        f"MEMORY of the forward as coded: one sample of {x['seq_len']} tokens through an MoE block materialises "
        f"[E, N, 2I] and [E, N, H] in float32: {m['experts'] * x['seq_len'] * 2 * m['moe_inter'] * 4 / GB:.1f} GB + "
        f"{m['experts'] * x['seq_len'] * m['hidden'] * 4 / GB:.1f} GB (and the weighted product of the latter again)",
        f"bytes to move per layer (computed, not timed): the solve jobs carry each expert's Hessian, gate's and "
        f"up's separately: {m['experts'] * (2 * m['hidden'] ** 2 + m['moe_inter'] ** 2) * 4 / GB:.0f} GB to the "
        f"workers, plus ≥ {gb:.1f} GB of expert sums from each worker",
        f"pieces measured in {x['measure_wall_s']:.0f} s; the result is an estimate from them, not a measured run",
    ]
    print("\n" + "\n".join(f"- {n}" for n in notes))


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Single-process vs Ray calibration, and a Qwen3.5-397B-A17B "
                                             "extrapolation.")
    ap.add_argument("--model", default="builtin:tiny-qwen3-trained",
                    help="builtin:NAME, a checkpoint path, or synthetic:PRESET:LAYERS (e.g. synthetic:0.6b:2)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dataset", default="builtin:prose+code")
    ap.add_argument("--method", default="gptq", choices=("gptq", "awq"))
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the driver and every worker")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="Ray worker counts to compare")
    ap.add_argument("--only", choices=("compare", "extrapolate"), help="run one part only")
    ap.add_argument("--big-samples", type=int, default=500)
    ap.add_argument("--big-seq-len", type=int, default=2048)
    ap.add_argument("--big-group-size", type=int, default=128)
    ap.add_argument("--big-workers", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--probe-experts", type=int, default=4, help="experts in the timed per-chunk sums")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--keep", action="store_true", help="keep the calibrated checkpoints")
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "RESULT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return run_mode(a, a.child[0], Path(a.child[1]))
    out: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}}
    if a.only in (None, "compare"):
        out["compare"] = compare(a)
    if a.only in (None, "extrapolate"):
        out["extrapolate"] = extrapolate(a)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    rows = out.get("compare", {}).get("rows", [])
    return 0 if all(r["checkpoint_sha256"] == rows[0]["checkpoint_sha256"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
