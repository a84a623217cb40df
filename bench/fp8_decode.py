#!/usr/bin/env python3
"""FP8 decode benchmark: the forms an FP8 checkpoint can take in ONNX Runtime, against fp32.

What it does (artefacts cached under `--workdir`/fp8; `--rebuild` redoes them):

1. the synthetic bf16 checkpoint CKPT (`decode.ensure_checkpoint`: random weights, real Qwen3 shapes);
2. `qwen2om calibrate CKPT -o FP8 --scheme fp8-block`: e4m3fn weights, 128×128 tiles, float32 scales
   (the Hugging Face fine-grained layout of Qwen3-*-FP8);
3. `qwen2om convert … --set max_seq_len=P --set prefill_chunk=T`, fp32 compute, one output per form:
   - `fp32`: CKPT, the float model;
   - `fp8-inputs`: FP8 with the default recipe: e4m3fn initializers, each scale a graph input
     (`scales: auto`), dequantised in the graph on every call;
   - `fp8-constants`: the same graph with `--scales constants`: every input of the dequantisation is
     a constant, so ONNX Runtime folds it once when the session loads (fp32 weights in memory);
   - `fp8-bytes`: `lower_fp8: {storage: bytes}` (uint8 + a 256-entry table, opset 18), scales as inputs;
   - `fp8-upcast`: a recipe without `lower_fp8`: the weights dequantised once at conversion and
     written as fp32 (4× the bytes on disk, a plain float model);
4. each model timed in a fresh child process: session load, prefill of `--prompt-tokens`, then
   `--new-tokens` greedy tokens (EOS ignored), one warm-up and the median of `--runs`;
   decode tok/s = (N − 1) / decode wall time; peak RSS of the child;
5. a markdown table (and `--json PATH`).

    .venv/bin/python bench/fp8_decode.py --json .cache/bench/fp8/result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from decode import REPO, ensure_checkpoint, make_prompt, run_child

FORMS = ("fp32", "fp8-inputs", "fp8-constants", "fp8-bytes", "fp8-upcast")


@dataclasses.dataclass
class Timing:
    form: str
    load_s: float
    prefill_ms: float
    decode_tps: float
    runs: list[float]
    peak_rss_gib: float = 0.0
    disk_mib: float = 0.0
    scale_inputs: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)


def qwen2om(*args: str) -> None:
    cmd = [sys.executable, "-m", "qwen2om", *args]
    print("$ qwen2om " + " ".join(args), flush=True)
    if subprocess.run(cmd, cwd=REPO).returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}")


def recipe_variant(work: Path, name: str, fp8_line: str | None) -> Path:
    """recipes/ort.yaml with its lower_fp8 line replaced (None: removed)."""
    lines = (REPO / "recipes" / "ort.yaml").read_text().splitlines()
    out = [(fp8_line if line.strip().startswith("- lower_fp8") else line) for line in lines]
    path = work / f"qwen3-fp32-{name}.yaml"
    path.write_text("\n".join(x for x in out if x is not None) + "\n")
    return path


def build(work: Path, ckpt: Path, fp8: Path, form: str, p: int, t: int) -> Path:
    out = work / f"onnx-{form}-P{p}-T{t}"
    if (out / "manifest.json").is_file():
        return out
    sets = ["--set", f"max_seq_len={p}", "--set", f"prefill_chunk={t}", "--force"]
    if form == "fp32":
        qwen2om("convert", str(ckpt), "-o", str(out), *sets)
    elif form == "fp8-inputs":
        qwen2om("convert", str(fp8), "-o", str(out), *sets)
    elif form == "fp8-constants":
        qwen2om("convert", str(fp8), "-o", str(out), "--scales", "constants", *sets)
    elif form == "fp8-bytes":
        recipe = recipe_variant(work, "bytes", "  - lower_fp8: {storage: bytes}")
        qwen2om("convert", str(fp8), "-o", str(out), "--recipe", str(recipe), *sets)
    else:
        recipe = recipe_variant(work, "upcast", None)
        qwen2om("convert", str(fp8), "-o", str(out), "--recipe", str(recipe), "--scales", "constants", *sets)
    return out


def child_main(spec_json: str) -> int:
    """`--child SPEC`: time one output directory; the Timing goes to spec["result"]."""
    from qwen2om.runtime.standalone import Engine, Sampling

    spec = json.loads(spec_json)
    t0 = time.perf_counter()
    engine = Engine(Path(spec["out"]), threads=spec["threads"])
    load = time.perf_counter() - t0
    stats = []
    tokens: list[int] = []
    for i in range(spec["runs"] + 1):  # run 0 warms up
        tokens, s = engine.generate(spec["ids"], max_new_tokens=spec["new_tokens"], sampling=Sampling(0.0),
                                    ignore_eos=True)
        if i:
            stats.append(s)
    scale_inputs = sum(io["role"] == "scale" for io in engine.manifest["graphs"]["decode"]["inputs"])
    timing = Timing(spec["form"], load, statistics.median(s.prefill_s for s in stats) * 1000,
                    statistics.median(s.decode_tps for s in stats), [s.decode_tps for s in stats],
                    scale_inputs=scale_inputs, tokens=tokens)
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(timing)))
    return 0


def disk_mib(out: Path) -> float:
    return sum(p.stat().st_size for p in out.glob("model.*")) / 2**20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated subset of {', '.join(FORMS)}")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--rebuild", action="store_true", help="redo calibration and conversions")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    from qwen2om.fixtures.synthetic import resolve_preset

    preset = resolve_preset(args.preset, args.layers)
    layers = args.layers or preset.layers  # type: ignore[attr-defined]
    ckpt, _ = ensure_checkpoint(args.workdir, args.preset, layers, args.seed)
    work = args.workdir / "fp8" / ckpt.name
    if args.rebuild and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    fp8 = work / "fp8-block"
    if not (fp8 / "config.json").is_file():
        t0 = time.perf_counter()
        qwen2om("calibrate", str(ckpt), "-o", str(fp8), "--scheme", "fp8-block", "--force")
        print(f"calibrate --scheme fp8-block: {time.perf_counter() - t0:.1f} s", flush=True)
    ids = make_prompt(ckpt / "tokenizer.json", args.prompt_tokens)
    timings: list[Timing] = []
    for form in args.forms.split(","):
        out = build(work, ckpt, fp8, form, args.max_seq_len, args.prefill_chunk)
        result = work / f"timing-{form}.json"
        spec = {"out": str(out), "form": form, "ids": ids, "new_tokens": args.new_tokens, "runs": args.runs,
                "threads": args.threads, "result": str(result)}
        print(f"timing {form} (load avg {os.getloadavg()[0]:.2f})", flush=True)
        child = run_child([sys.executable, __file__, "--child", json.dumps(spec)])
        if child.returncode:
            raise SystemExit(f"timing {form} failed (exit {child.returncode})")
        t = Timing(**json.loads(result.read_text()))
        t.peak_rss_gib, t.disk_mib = child.peak_rss_bytes / 2**30, disk_mib(out)
        timings.append(t)
    base = next((t for t in timings if t.form == "fp32"), None)
    print(f"\n{args.preset}, {layers} layers, P={args.max_seq_len}, prompt {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens, median of {args.runs}\n")
    print("| form | scale inputs | weights on disk MiB | session load s | prefill ms | decode tok/s | vs fp32 "
          "| peak RSS GiB | same tokens as fp8-inputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ref = next((t.tokens for t in timings if t.form == "fp8-inputs"), None)
    for t in timings:
        vs = f"{t.decode_tps / base.decode_tps:.2f}×" if base else "-"
        agree = sum(a == b for a, b in zip(t.tokens, ref or [], strict=False))
        same = "-" if ref is None or t.form == "fp32" else f"{agree}/{len(ref)}"
        print(f"| {t.form} | {t.scale_inputs} | {t.disk_mib:,.0f} | {t.load_s:.1f} | {t.prefill_ms:,.0f} | "
              f"{t.decode_tps:.2f} | {vs} | {t.peak_rss_gib:.2f} | {same} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "timings": [dataclasses.asdict(t) for t in timings]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
