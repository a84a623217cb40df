"""W4A16 quality and calibration time: qwen2om RTN / GPTQ / AWQ against llm-compressor GPTQ and
ONNX Runtime's own blockwise quantizer, on one model, the same calibration windows and the same
held-out text; plus qwen2om's data-free FP8 (`calibrate --scheme fp8-block`, then `convert`: the
row measures the converted ONNX model, FP8 weights with scale inputs).

    .venv/bin/python bench/quant_quality.py --model builtin:tiny-qwen3-trained --group-size 128

Each calibration runs in a child process and is timed there (its own report, or wall time).
Quality is measured by `qwen2om eval` against the float model on held-out text: perplexity
(non-overlapping windows), top-1 agreement and mean KL(float ‖ quantised) per position.
llm-compressor needs its own environment (it pins an older transformers): `.venv-llmc`, see
bench/llmcompressor_w4a16.py; without it that row says so. ONNX Runtime's quantizer is
`MatMulNBitsQuantizer` with `DefaultWeightOnlyQuantConfig` (its built-in round-to-nearest; the
`rtn` method needs Intel Neural Compressor), applied to qwen2om's fp32 graphs, lm_head excluded.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLMC_PY = ROOT / ".venv-llmc" / "bin" / "python"


def run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])}…: exit {p.returncode}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0, p.stdout


def quality(model: str, reference: str, heldout: Path, window: int, windows: int) -> dict[str, Any]:
    from qwen2om.evaluate import agreement

    r = agreement(model, reference, str(heldout), window=window, max_windows=windows)
    return {"ppl": r.ppl, "ref_ppl": r.reference_ppl, "top1": r.top1_agreement, "kl": r.mean_kl, "tokens": r.tokens}


def ort_quantize(float_out: Path, dest: Path, group: int) -> float:
    """Quantise both graphs of a qwen2om fp32 output with ONNX Runtime's MatMulNBits quantizer."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(float_out, dest, ignore=shutil.ignore_patterns("model.*"))
    t0 = time.perf_counter()
    for kind in ("decode", "prefill"):
        src = float_out / f"model.{kind}.onnx"
        if not src.exists():
            continue
        q = MatMulNBitsQuantizer(onnx.load(src), nodes_to_exclude=["/lm_head/MatMul"],
                                 algo_config=DefaultWeightOnlyQuantConfig(block_size=group, is_symmetric=True,
                                                                          accuracy_level=0))
        q.process()
        q.model.save_model_to_file(str(dest / f"model.{kind}.onnx"), use_external_data_format=True)
        # each graph gets its own data file name, so the two do not overwrite each other
        data = dest / "model.onnx.data"
        if data.exists():
            data.rename(dest / f"{kind}.onnx.data")
            m = onnx.load(dest / f"model.{kind}.onnx", load_external_data=False)
            for t in m.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = f"{kind}.onnx.data"
            onnx.save(m, dest / f"model.{kind}.onnx")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-qwen3-trained")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--dataset", default="builtin:prose", help="calibration text")
    ap.add_argument("--heldout", type=Path, help="held-out text file (default: the trained fixture's held-out split)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "quant")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", default="rtn,gptq,awq,llmc,ort,fp8",
                    help="comma-separated subset of rtn, gptq, awq, llmc, ort, fp8, and gptq-bf16 (qwen2om GPTQ with "
                         "--compute-dtype bfloat16)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="calibrate qwen2om's methods and llm-compressor this many times, in alternating rounds, "
                         "and report the median time (the 2-core VM's timings vary ±30 %% between runs)")
    args = ap.parse_args(argv)
    wanted = set(args.rows.split(","))
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    from qwen2om.builtin import resolve_model
    from qwen2om.datasets import windows

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = resolve_model(args.model)
    heldout = args.heldout
    if heldout is None:
        from qwen2om.fixtures import trained

        heldout = work / "heldout.txt"
        heldout.write_text(trained.heldout_text())
    samples = windows(args.dataset, src, num_samples=args.num_samples, seq_len=args.seq_len)
    ids = work / "calibration_ids.json"
    ids.write_text(json.dumps(samples.samples))
    qwen2om = [sys.executable, "-m", "qwen2om"]
    common = ["--group-size", str(args.group_size), "--dataset", args.dataset, "--num-samples",
              str(args.num_samples), "--seq-len", str(args.seq_len), "--force"]
    rows: list[dict[str, Any]] = []
    float_out = work / "float-onnx"
    if "ort" in wanted:  # ONNX Runtime's quantizer works on the float graphs
        run([*qwen2om, "convert", str(src), "-o", str(float_out), "--force", "--set", "max_seq_len=512",
             "--set", "prefill_chunk=64"])
    # Each tool's calibration, as (seconds as the tool reports it, wall seconds of its process).
    jobs: dict[str, tuple[Path, Callable[[], tuple[float, float]]]] = {}
    for row in [m for m in ("rtn", "gptq", "awq", "gptq-bf16") if m in wanted]:
        out, method = work / f"qwen2om-{row}", row.removesuffix("-bf16")
        extra = ["--compute-dtype", "bfloat16"] if row.endswith("-bf16") else []

        def calibrate(out: Path = out, method: str = method, extra: list[str] = extra) -> tuple[float, float]:
            wall, _ = run([*qwen2om, "calibrate", str(src), "-o", str(out), "--method", method, *extra, *common])
            return json.loads((out / "calibration_report.json").read_text())["seconds"], wall
        jobs[f"qwen2om {method}" + (" (bf16 forwards)" if extra else "")] = (out, calibrate)
    if "llmc" in wanted and LLMC_PY.exists():
        out = work / "llmcompressor-gptq"

        def llmc(out: Path = out) -> tuple[float, float]:
            wall, stdout = run([str(LLMC_PY), "bench/llmcompressor_w4a16.py", "--model", str(src), "--samples",
                                str(ids), "--out", str(out), "--group-size", str(args.group_size)])
            return json.loads(stdout.strip().splitlines()[-1])["seconds"], wall
        jobs["llm-compressor gptq"] = (out, llmc)
    times: dict[str, list[tuple[float, float]]] = {tool: [] for tool in jobs}
    for _ in range(args.repeats):  # rounds, so that a slow spell of the machine hits every tool alike
        for tool, (_, job) in jobs.items():
            times[tool].append(job())
    for tool, (out, _) in jobs.items():
        secs = sorted(t[0] for t in times[tool])
        rows.append({"tool": tool, "seconds": statistics.median(secs), "seconds_all": secs,
                     "wall": statistics.median(t[1] for t in times[tool]),
                     **quality(str(out), str(src), heldout, args.window, args.windows)})
    if "llmc" in wanted and not LLMC_PY.exists():
        rows.append({"tool": "llm-compressor gptq", "error": f"{LLMC_PY} not found (see bench/llmcompressor_w4a16.py)"})
    if "ort" in wanted:
        ort_out = work / "ort-default"
        seconds = ort_quantize(float_out, ort_out, args.group_size)
        rows.append({"tool": "onnxruntime MatMulNBits default (RTN)", "seconds": seconds, "wall": seconds,
                     **quality(str(ort_out), str(src), heldout, args.window, args.windows)})
    if "fp8" in wanted:
        ckpt, out = work / "qwen2om-fp8-block", work / "qwen2om-fp8-block-onnx"
        wall, _ = run([*qwen2om, "calibrate", str(src), "-o", str(ckpt), "--scheme", "fp8-block", "--force"])
        report = json.loads((ckpt / "calibration_report.json").read_text())
        run([*qwen2om, "convert", str(ckpt), "-o", str(out), "--force", "--set", "max_seq_len=512",
             "--set", "prefill_chunk=64"])
        rows.append({"tool": "qwen2om fp8-block (data-free; converted ONNX, scale inputs)",
                     "seconds": report["seconds"], "wall": wall,
                     **quality(str(out), str(src), heldout, args.window, args.windows)})

    base = next((r["ref_ppl"] for r in rows if "ref_ppl" in r), float("nan"))
    print(f"model {args.model}, group {args.group_size} symmetric, {len(samples.samples)} calibration windows × "
          f"{args.seq_len} tokens of {args.dataset}; held-out: {rows[0].get('tokens', '?')} tokens in windows of "
          f"{args.window}; float perplexity {base:.3f}\n")
    print(f"| tool | calibration s (median of {args.repeats}) | runs (min–max) | perplexity | Δ ppl vs float | "
          "top-1 agreement | mean KL (nats) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tool']} | {r['error']} | | | | | |")
            continue
        spread = f"{r['seconds_all'][0]:.1f}–{r['seconds_all'][-1]:.1f}" if len(r.get("seconds_all", [])) > 1 else ""
        print(f"| {r['tool']} | {r['seconds']:.1f} | {spread} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} | "
              f"{r['top1']:.2%} | {r['kl']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
