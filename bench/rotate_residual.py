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

With `--first-order` it also takes each result's held-out Δnll apart. To first order a weight change ΔW
moves a text's mean next-token NLL by g·ΔW, g the gradient of that NLL at the float weights; the rest is
second order (≈ KL(float ‖ quantised)). For every (basis, set) it prints g·ΔW for the held-out text, for
the set GPTQ was calibrated on and for the other sets, and per basis the cosine between the held-out
text's gradient and each set's (over the quantised linears): whether anything a calibration could see
predicts the held-out first-order part.

An experiment, not a calibrate option; docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
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
    read_json,
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


def loss_gradient(model: torch.nn.Module, samples: list[list[int]], batch: int = 8) -> dict[str, torch.Tensor]:
    """∂(mean next-token NLL over `samples`)/∂W for every linear weight (`*_proj.weight`) of `model`."""
    model.zero_grad(set_to_none=True)
    tokens = sum(len(ids) - 1 for ids in samples)
    by_length: dict[int, list[list[int]]] = {}
    for ids in samples:  # batches of one length (the held-out text's last window may be short)
        by_length.setdefault(len(ids), []).append(ids)
    for same in by_length.values():
        for i in range(0, len(same), batch):
            ids = torch.tensor(same[i:i + batch])
            logits = model(ids).logits
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                    ids[:, 1:].reshape(-1), reduction="sum")
            (nll / tokens).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()
            if p.grad is not None and k.endswith("_proj.weight")}


def dot(g: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> float:
    return sum(float((g[k].double() * d.double()).sum()) for k, d in delta.items())


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return dot(a, b) / (dot(a, a) * dot(b, b)) ** 0.5


class FirstOrder:
    """The gradients of one float basis: the held-out text's and each calibration set's, computed once."""

    def __init__(self, ckpt: Path, heldout: list[list[int]], sets: list[list[list[int]]]) -> None:
        from qwen2om.verify import load_reference

        model = load_reference(ckpt)
        self.weights = {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith("_proj.weight")}
        self.heldout = loss_gradient(model, heldout)
        self.sets = [loss_gradient(model, s) for s in sets]
        self.cosines = [cosine(self.heldout, g) for g in self.sets]

    def __call__(self, quantised: Path, k: int) -> dict[str, Any]:
        """g·ΔW (nats per token) of `quantised` (calibrated on set k) for the held-out text and each set."""
        from qwen2om.verify import load_reference

        q = dict(load_reference(quantised).named_parameters())
        delta = {name: q[name].detach() - w for name, w in self.weights.items()}
        return {"heldout": dot(self.heldout, delta), "own_set": dot(self.sets[k], delta),
                "other_sets": [dot(g, delta) for j, g in enumerate(self.sets) if j != k]}


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
    datasets = [write_set(work / f"set-{k}.jsonl", blocks)
                for k, blocks in enumerate(split_sets(calibration_text(model), args.sets))]
    firsts: dict[str, FirstOrder] = {}
    if args.first_order:
        from qwen2om.datasets import windows

        set_windows = [windows(str(d), src, num_samples=args.num_samples, seq_len=args.seq_len).samples
                       for d in datasets]  # the windows calibrate cuts from each set
        for row, ckpt in ckpts.items():
            firsts[row] = FirstOrder(ckpt, judge.samples, set_windows)
            print(f"{model}: {row} gradient cosine, held-out text against each set: "
                  + " ".join(f"{c:+.3f}" for c in firsts[row].cosines), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ckpts}
    for k, dataset in enumerate(datasets[:args.use_sets]):
        for row, ckpt in ckpts.items():
            out = work / f"set-{k}-{row}"
            timing = qwen2om_calibrate("gptq", ckpt, out, dataset, args)
            r = {"set": k, **timing, **judge(out)}
            if row in firsts:
                r["first_order"] = f = firsts[row](out, k)
                print(f"  set {k} {row:10s}: g·ΔW e-4 nats: held-out {1e4 * f['heldout']:+.3f}, own set "
                      f"{1e4 * f['own_set']:+.3f}, other sets " + " ".join(f"{1e4 * o:+.3f}" for o in f["other_sets"]),
                      flush=True)
            runs[row].append(r)
            print(f"  set {k} {row:10s}: Δppl {dppl(r):+.4f}, top-1 {r['top1']:.2%}, KL {r['kl']:.3e}, "
                  f"calibration {timing['seconds']:.1f} s", flush=True)
    cosines = {row: f.cosines for row, f in firsts.items()}
    return {"model": model, "float_check": checks, "runs": runs, "gradient_cosines": cosines}


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


def correlation(points: list[tuple[float, float]]) -> str:
    return f"{statistics.correlation(*zip(*points, strict=True)):+.2f}" if len(points) > 2 else "–"


def first_order_table(results: list[dict[str, Any]]) -> None:
    """Per model and basis, means over the sets (nats per token, e-4): the measured held-out Δnll, its first-order
    part g·ΔW and the rest, and g·ΔW on the calibration texts; the correlation over the sets of the held-out g·ΔW
    with the own set's and with the other sets' mean; then the same correlations over every (basis, set) of the
    model, which mostly measure how far apart the bases are."""
    print("\n| model | GPTQ on | held-out Δnll | g·ΔW held-out | rest (≈ KL) | KL | g·ΔW own set | g·ΔW other sets |"
          " r with own set · other sets | gradient cosine held-out · set |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in results:
        pooled_own: list[tuple[float, float]] = []
        pooled_other: list[tuple[float, float]] = []
        for row, rs in m["runs"].items():
            rs = [r for r in rs if "first_order" in r]
            if not rs:
                continue
            dnll = [math.log(r["ppl"] / r["ref_ppl"]) for r in rs]
            held = [r["first_order"]["heldout"] for r in rs]
            own = list(zip(held, (r["first_order"]["own_set"] for r in rs), strict=True))
            other = list(zip(held, (statistics.fmean(r["first_order"]["other_sets"]) for r in rs), strict=True))
            pooled_own += own
            pooled_other += other
            cos = m["gradient_cosines"][row]
            d, h = statistics.fmean(dnll), statistics.fmean(held)
            g_own, g_other = statistics.fmean(o for _, o in own), statistics.fmean(o for _, o in other)
            print(f"| {m['model'] if row == 'plain' else ''} | {row} | {1e4 * d:+.3f} | {1e4 * h:+.3f} | "
                  f"{1e4 * (d - h):+.3f} | {1e4 * statistics.fmean(r['kl'] for r in rs):.3f} | "
                  f"{1e4 * g_own:+.3f} | {1e4 * g_other:+.3f} | "
                  f"{correlation(own)} · {correlation(other)} | {min(cos):.2f} – {max(cos):.2f} |")
        print(f"| | every basis and set ({len(pooled_own)}) | | | | | | | {correlation(pooled_own)} · "
              f"{correlation(pooled_other)} | |")


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
    ap.add_argument("--first-order", action="store_true",
                    help="also take each held-out Δnll apart into g·ΔW (first order) and the rest (module docstring)")
    ap.add_argument("--use-sets", type=int, default=None, help="calibrate on the first N of the --sets sets only")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "rotate-residual")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, metavar="RUN.json", help="print a recorded --json run's tables; run nothing")
    args = ap.parse_args()
    if args.report:
        results = read_json(args.report, "a --json file of bench/rotate_residual.py")
        if not isinstance(results, list) or not all(isinstance(m, dict) and "runs" in m for m in results):
            raise SystemExit(f"{args.report}: not a --json file of bench/rotate_residual.py (no runs)")
    else:
        results = [bench_model(m, args) for m in args.models.split(",")]
    table(results)
    if any(m.get("gradient_cosines") for m in results):  # a run with --first-order, or a report of one
        first_order_table(results)
    if args.json and not args.report:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
