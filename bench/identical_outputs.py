#!/usr/bin/env python3
"""Byte-identical outputs: every built-in model × bundled recipe, hashed file by file.

A restructuring of the converter must not change what any bundled recipe produces. This script
converts each case with the command line a user types, and records the sha256 of every file in
each OUT:

    python bench/identical_outputs.py record before.json      # on the old code
    python bench/identical_outputs.py check before.json       # on the new code: exit 1 on any change

Cases: every builtin (float and FP8) and four W4A16 checkpoints that `qwen2om calibrate` writes
(RTN, group 32 for the tiny widths, so deterministic: dense, MoE, hybrid, and dense in the
ascendv1 format) × the bundled recipes a user reaches with flags: ort fp32 and fp16, ascend fp16
for Ascend910B3 (int4 kernel) and Ascend310P3 (refused for int4; with `weight_storage=int8`, W8A16),
ascend fp32 for Ascend910B3. A refusal is recorded (its message) and compared like a file.

manifest.json is compared without what is not the converter's output: each pass's wall time
(`stages[].seconds`) and the installed versions (`tools`). Everything else, graph bytes, external
data, scale maps, ATC commands, run.py, tokenizer files, manifest signature and hashes, must match.
On a mismatch the differing files are listed; copy the old OUT aside first and `qwen2om inspect
OLD NEW --diff` says what changed in a graph.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLOAT = ["tiny-qwen2", "tiny-qwen2-untied", "tiny-qwen3", "tiny-qwen3-untied", "tiny-qwen3-moe",
         "tiny-qwen2-moe", "tiny-qwen3-moe-skewed", "tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-next",
         "tiny-qwen3-trained"]
FP8 = ["tiny-qwen3-fp8", "tiny-qwen3-trained-fp8", "tiny-qwen3-moe-fp8", "tiny-qwen3-5-fp8", "tiny-qwen3-next-fp8"]
# name → (builtin it is calibrated from, extra calibrate flags)
W4A16 = {"w4-qwen3": ("tiny-qwen3", []), "w4-qwen3-moe": ("tiny-qwen3-moe", []),
         "w4-qwen3-5": ("tiny-qwen3-5", []), "w4-qwen3-ascendv1": ("tiny-qwen3", ["--format", "ascendv1"])}
TARGETS = {
    "ort-fp32": ["--dtype", "fp32"],
    "ort-fp16": ["--dtype", "fp16"],
    "ascend-fp16-910b3": ["--target", "ascend", "--dtype", "fp16", "--soc-version", "Ascend910B3"],
    "ascend-fp16-310p3": ["--target", "ascend", "--dtype", "fp16", "--soc-version", "Ascend310P3"],
    "ascend-fp32-910b3": ["--target", "ascend", "--dtype", "fp32", "--soc-version", "Ascend910B3"],
    # 310P has no int4 kernel: int4 weights go as int8, dequantised by Cast + Mul (W8A16)
    "ascend-fp16-310p3-w8": ["--target", "ascend", "--dtype", "fp16", "--soc-version", "Ascend310P3",
                             "--set", "weight_storage=int8"],
}
# Small graphs, so the whole matrix takes minutes; capacity and chunk still differ (P ≠ T).
SHAPE = ["--max-seq-len", "64", "--prefill-chunk", "16"]


def qwen2om() -> list[str]:
    return [sys.executable, "-m", "qwen2om"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_digest(path: Path) -> str:
    m = json.loads(path.read_text())
    m.pop("tools", None)
    for stage in m.get("stages", []):
        stage.pop("seconds", None)
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()


def tree_hashes(out: Path) -> dict[str, str]:
    hashes = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(out))
            hashes[rel] = manifest_digest(p) if rel == "manifest.json" else sha256(p)
    return hashes


def models(work: Path) -> dict[str, str]:
    """Case name → model argument; the W4A16 checkpoints are calibrated once into `work`."""
    found = {name: f"builtin:{name}" for name in FLOAT + FP8}
    for name, (base, extra) in W4A16.items():
        ckpt = work / "checkpoints" / name
        if not (ckpt / "config.json").is_file():
            cmd = [*qwen2om(), "calibrate", f"builtin:{base}", "-o", str(ckpt), "--scheme", "w4a16",
                   "--method", "rtn", "--group-size", "32", "--force", *extra]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        found[name] = str(ckpt)
    return found


def run_case(work: Path, name: str, model: str, target: str) -> tuple[str, dict[str, str]]:
    case, out, t0 = f"{name}/{target}", work / "out" / name / target, time.perf_counter()
    proc = subprocess.run([*qwen2om(), "convert", model, "-o", str(out), "--force", *SHAPE, *TARGETS[target]],
                          capture_output=True, text=True)
    if proc.returncode:
        # A refusal is an outcome too (e.g. a SoC without a kernel): recorded, and compared.
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        hashes = {"<refused>": hashlib.sha256(last.encode()).hexdigest()[:16] + " " + last[:200]}
    else:
        hashes = tree_hashes(out)
    print(f"{case:45s} {len(hashes):3d} files  {time.perf_counter() - t0:6.1f} s", flush=True)
    return case, hashes


def run_cases(work: Path, only: str | None, jobs: int) -> dict[str, dict[str, str]]:
    cases = [(name, model, target) for name, model in models(work).items() for target in TARGETS
             if not only or only in f"{name}/{target}"]
    with ThreadPoolExecutor(jobs) as pool:  # each case is its own process; threads only wait on them
        return dict(pool.map(lambda c: run_case(work, *c), cases))


def compare(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> int:
    changed = 0
    for case in sorted(set(before) | set(after)):
        a, b = before.get(case), after.get(case)
        if a == b:
            continue
        changed += 1
        if a is None or b is None:
            print(f"{case}: only in {'after' if a is None else 'before'}")
            continue
        for f in sorted(set(a) | set(b)):
            if a.get(f) != b.get(f):
                print(f"{case}: {f}: {a.get(f, '<missing>')[:16]} → {b.get(f, '<missing>')[:16]}")
    print(f"{len(set(before) | set(after))} cases, {changed} changed")
    return 1 if changed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["record", "check"])
    ap.add_argument("hashes", type=Path, help="JSON file: written by record, read by check")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qwen2om-identical",
                    help="where checkpoints and OUTs go (the same path both times: paths appear in the outputs)")
    ap.add_argument("--only", help="cases whose name contains this text")
    ap.add_argument("--jobs", type=int, default=1, help="conversions at once (each a process)")
    args = ap.parse_args()
    if args.mode == "record":
        results = run_cases(args.work, args.only, args.jobs)
        args.hashes.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{len(results)} cases recorded in {args.hashes}")
        return 0
    before = json.loads(args.hashes.read_text())
    if args.only:
        before = {k: v for k, v in before.items() if args.only in k}
    after = run_cases(args.work, args.only, args.jobs)
    return compare(before, after)


if __name__ == "__main__":
    sys.exit(main())
