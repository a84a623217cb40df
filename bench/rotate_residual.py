"""GPTQ on a rotated residual stream (QuaRot's R1, norms folded): does it beat plain GPTQ on the trained builtins?

Incoherence processing is the usual answer to "make 4-bit weights better": rotate the hidden state by an
orthogonal R so that no input channel of a weight stands out, and GPTQ's groups see evenly spread
values. For a Qwen3 checkpoint the rotation folds into the weights exactly (in float):

    fold each RMSNorm's weight γ into the linears that read it   W ← W·diag(γ),  γ ← 1
    embedding and LM head (untied)                               E ← E·R,  W_head ← W_head·diag(γ_final)·R
    linears reading the residual (q/k/v, gate/up)                W ← W·R
    linears writing it (o_proj, down_proj)                       W ← Rᵀ·W

(RMSNorm with γ = 1 commutes with an orthogonal R; Qwen3's per-head q/k norms act on q/k, not on the
residual, and stay). This script writes that checkpoint (a random-sign Hadamard R when the hidden size
is a power of two, else a seeded random orthogonal one; float64 arithmetic, stored in --dtype), checks it
against the original (held-out KL(float ‖ rotated float), which should be ~1e-12 in float32), then runs
`qwen2om calibrate --method gptq` on the original and on the rotated checkpoint with the same calibration
sets as bench/quant_models.py, and scores both against the original float model on the model's whole
held-out text (bench/quant_models.py's Judge): Δppl, top-1 and mean KL per set, mean ± sd over the sets,
and the paired rotated − plain difference.

    QWEN2OM_CACHE=.cache/qwen2om .venv/bin/python bench/rotate_residual.py --sets 4 --json rot.json

An experiment, not a calibrate option; docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from quant_models import (
    MODELS,
    Judge,
    calibration_text,
    heldout_text,
    paired,
    qwen2om_calibrate,
    split_sets,
    summarise,
    write_set,
)

ROOT = Path(__file__).resolve().parent.parent
READ = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # linears whose input is the normed residual
WRITE = ("o_proj", "down_proj")  # linears whose output is added to it


def rotation(n: int, seed: int | None = 0) -> torch.Tensor:
    """An orthogonal [n, n] float64 matrix: Hadamard with random signs when n is a power of two, else the Q of a
    Gaussian matrix's QR (signs fixed so the result does not depend on the QR routine); seed None: the identity
    (the norms folded, nothing rotated)."""
    if seed is None:
        return torch.eye(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        return signs[:, None] * h / n ** 0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotate(src: Path, dst: Path, dtype: torch.dtype, seed: int | None = 0) -> None:
    """`src`'s rotated, norm-folded, untied equivalent written to `dst` (dense Qwen3 layers only)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") not in ("qwen3", "qwen2"):
        raise SystemExit(f"{src}: model_type {cfg.get('model_type')!r}; this experiment folds dense Qwen2/Qwen3 only")
    if not (src / "model.safetensors").is_file():
        raise SystemExit(f"{src}: no single model.safetensors (this experiment reads unsharded checkpoints)")
    sd = {k: v.double() for k, v in load_file(src / "model.safetensors").items()}
    r = rotation(cfg["hidden_size"], seed)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"] @ r,
           "lm_head.weight": (head * sd["model.norm.weight"]) @ r,
           "model.norm.weight": torch.ones_like(sd["model.norm.weight"])}
    for k, v in sd.items():
        if k in out:
            continue
        module = k.rsplit(".", 2)[-2] if k.endswith(".weight") else ""
        layer = ".".join(k.split(".")[:3])
        if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            out[k] = torch.ones_like(v)
        elif module in READ:
            norm = "input_layernorm" if module in READ[:3] else "post_attention_layernorm"
            out[k] = (v * sd[f"{layer}.{norm}.weight"]) @ r
        elif module in WRITE:
            out[k] = r.T @ v
        else:
            out[k] = v
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    cfg["tie_word_embeddings"] = False
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.to(dtype).contiguous() for k, v in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def dppl(r: dict[str, Any]) -> float:
    return r["ppl"] - r["ref_ppl"]


def bench_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from qwen2om.builtin import resolve_model

    heldout = heldout_text(model)  # first: it refuses anything but a trained builtin, before a file is read
    src = resolve_model(model)
    work = args.workdir / model.removeprefix("builtin:")
    work.mkdir(parents=True, exist_ok=True)
    held = work / "heldout.txt"
    held.write_text(heldout)
    judge = Judge(src, held, args.window, args.windows)
    ckpts, checks = {"plain": src}, {}
    for seed in args.seeds:
        row = "folded" if seed is None else f"rotated-{seed}"
        ckpts[row] = work / f"{row}-{args.dtype}"
        rotate(src, ckpts[row], getattr(torch, args.dtype), seed)
        check = judge(ckpts[row])
        checks[row] = {"dppl": dppl(check), "kl": check["kl"]}
        print(f"{model}: {row} float model against the original: Δppl {dppl(check):+.6f}, KL {check['kl']:.2e}",
              flush=True)
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ckpts}
    for k, blocks in enumerate(split_sets(calibration_text(model), args.sets)[:args.use_sets]):
        dataset = write_set(work / f"set-{k}.jsonl", blocks)
        for row, ckpt in ckpts.items():
            out = work / f"set-{k}-{row}"
            timing = qwen2om_calibrate("gptq", ckpt, out, dataset, args)
            r = {"set": k, **timing, **judge(out)}
            runs[row].append(r)
            print(f"  set {k} {row:10s}: Δppl {dppl(r):+.4f}, top-1 {r['top1']:.2%}, KL {r['kl']:.3e}, "
                  f"calibration {timing['seconds']:.1f} s", flush=True)
    return {"model": model, "float_check": checks, "runs": runs}


def table(results: list[dict[str, Any]]) -> None:
    """Per model and checkpoint: bench/quant_models.py's summary over the sets, and its paired difference from
    GPTQ on the original weights (standard error from the held-out windows and from set to set)."""
    print("\n| model | GPTQ on | Δppl mean ± sd | mean KL | top-1 % | − plain, paired: Δppl ± SE | KL |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in results:
        plain = summarise(m["runs"]["plain"])
        for row, rs in m["runs"].items():
            s = summarise(rs)
            extra = "| |"
            if row != "plain" and (d := paired(rs, m["runs"]["plain"])):
                extra = f"| {d['mean']:+.4f} ± {d['se']:.4f} | {s['kl']['mean'] / plain['kl']['mean'] - 1:+.1%} |"
            name = m["model"] if row == "plain" else ""
            print(f"| {name} | {row} | {s['dppl']['mean']:+.4f} ± {s['dppl']['sd']:.4f} | {s['kl']['mean']:.3e} | "
                  f"{100 * s['top1']['mean']:.2f} {extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the rotated checkpoint's storage dtype (bfloat16 rounds the rotated weights)")
    ap.add_argument("--seeds", type=lambda v: [None if x == "fold" else int(x) for x in v.split(",")],
                    default=[0], help="comma-separated rotation seeds (random signs), one rotated checkpoint each; "
                                      "'fold': the norms folded and no rotation")
    ap.add_argument("--use-sets", type=int, default=None, help="calibrate on the first N of the --sets sets only")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "rotate-residual")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = [bench_model(m, args) for m in args.models.split(",")]
    table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
