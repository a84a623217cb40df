#!/usr/bin/env python3
"""Calibration memory benchmark: peak memory of `qwen2om calibrate` as the model gets deeper.

`calibrate` runs layer by layer: one decoder layer's weights resident at a time, the activations of
every calibration sample carried between layers (in memory up to 2 GiB, then spilled to disk), the
output written shard by shard. So its peak memory should not grow with the number of layers. This
script measures it: the same synthetic checkpoint shapes (random bf16 weights with a published
Qwen3 config, `qwen2om.fixtures.synthetic`, cached under `--workdir`) at several depths, each
calibrated in a fresh child process with

    qwen2om calibrate CKPT -o OUT --method M --num-samples N --seq-len S --force

and the child's peak RSS (the kernel's `ru_maxrss`, exact) and peak anonymous memory (`RssAnon`,
polled every `--poll-s`, a lower bound) — `bench/convert_memory.py`'s measurement, whose docstring says
how to read the two. calibrate reads the checkpoint with positioned reads (no memory map), so the gap
between RSS and RssAnon is mostly file-backed pages of the shared libraries (torch's among them);
RssAnon is what has to fit.

    .venv/bin/python bench/calibrate_memory.py                       # qwen3-0.6b at 7, 14 and 28 layers
    .venv/bin/python bench/calibrate_memory.py --cases 1.7b:7 1.7b:28 --method rtn
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from convert_memory import GIB, REPO, Case, Job, checkpoint_bytes, ensure_checkpoint, error_line, run_measured


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--cases", type=Case.parse, nargs="+",
                    default=[Case.parse(c) for c in ("0.6b:7", "0.6b:14", "0.6b:28")],
                    help="PRESET:LAYERS synthetic checkpoints (default 0.6b:7 0.6b:14 0.6b:28)")
    ap.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    ap.add_argument("--hessian", default="plain", choices=("plain", "fisher", "fisher-heads"),
                    help="gptq's Hessians (calibrate --hessian): fisher* add the loss gradients' pass")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dataset", default="builtin:prose")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--poll-s", type=float, default=0.05, help="RssAnon polling interval (default 0.05 s)")
    ap.add_argument("--min-free-gib", type=float, default=2.0, help="kill a child when MemAvailable drops below")
    ap.add_argument("--max-rss-gib", type=float, default=16.0, help="kill a child whose RSS passes this")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap.parse_args(argv)


def measure(case: Case, a: argparse.Namespace) -> dict[str, object]:
    ckpt = ensure_checkpoint(a.workdir, case)
    label = a.method if a.hessian == "plain" else f"{a.method}-{a.hessian}"
    out = a.workdir / "calibrate-memory" / f"{case.key}-{label}"
    out.parent.mkdir(parents=True, exist_ok=True)
    qwen2om = Path(sys.executable).with_name("qwen2om")
    cmd = [str(qwen2om), "calibrate", str(ckpt), "-o", str(out), "--method", a.method,
           "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--dataset", a.dataset, "--force",
           *(["--hessian", a.hessian] if a.hessian != "plain" else [])]
    log = out.parent / f"{case.key}-{label}.log"
    job = Job("qwen2om", case, a.method, cmd, out, dict(os.environ), out.parent)
    print(f"calibrating {case.key} ({label}) ...", flush=True)
    code, wall, rss, anon, abort = run_measured(job, log, a)
    result: dict[str, object] = {
        "case": case.key, "layers": case.layers, "checkpoint_bytes": checkpoint_bytes(ckpt), "method": a.method,
        "hessian": a.hessian, "num_samples": a.num_samples, "seq_len": a.seq_len, "exit_code": code,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": rss, "peak_rss_anon_bytes": anon, "error": abort or (error_line(log) if code else "")}
    report = out / "calibration_report.json"
    if report.is_file():
        result["calibration_seconds"] = json.loads(report.read_text()).get("seconds")
    shutil.rmtree(out, ignore_errors=True)
    return result


def render(results: list[dict[str, object]]) -> str:
    rows = ["| case | layers | checkpoint GiB | peak RSS GiB | peak RssAnon GiB | wall s |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["exit_code"]:
            rows.append(f"| {r['case']} | {r['layers']} | {r['checkpoint_bytes'] / GIB:.2f} | "
                        f"failed: {r['error']} | | |")
            continue
        rows.append(f"| {r['case']} | {r['layers']} | {r['checkpoint_bytes'] / GIB:.2f} | "
                    f"{r['peak_rss_bytes'] / GIB:.2f} | {r['peak_rss_anon_bytes'] / GIB:.2f} | {r['wall_s']} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    results = [measure(case, a) for case in a.cases]
    first = results[0]
    print(f"\nqwen2om calibrate --method {a.method} --hessian {a.hessian}, {first['num_samples']} samples × "
          f"{first['seq_len']} tokens of {a.dataset}\n")
    print(render(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(not r["exit_code"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
