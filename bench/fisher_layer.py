"""GPTQ on a Hessian weighted by how much each token's output matters: the measured next step of issue 28.

GPTQ minimises a linear's output error on the calibration tokens, every token counting alike:
H = Σ 2·xxᵀ. The model's loss does not weigh tokens alike. Weighting each token's xxᵀ by the squared
gradient of the loss at the linear's output (a diagonal-per-token Fisher approximation, as in
GuidedQuant-style methods) makes GPTQ minimise an estimate of the loss increase instead:

    H_fisher = Σ_t ‖g_t‖² · x_t x_tᵀ,          g_t = ∂ loss / ∂ (linear's output at token t)

and, for q/k/v_proj, one such Hessian per attention head (‖g_t,head‖², the head's rows quantised
against their own Hessian: GPTQ's rows are independent given H, so a row block may have its own).
The gradient is either the empirical Fisher's (the calibration text's own next token) or the true
Fisher's (a next token sampled from the model's own distribution).

This script quantises the linears `--linears` of the layers `--layers`, the rest staying float (by
default layer 0's q/k/v, which isolates them: on the trained builtins they hold ~93 % of the whole
model's KL, see docs/benchmarks.md), with each Hessian variant in turn, and prints the held-out
KL(float ‖ quantised) per position and Δppl against RTN and plain GPTQ. With `--layers all --linears all`
it quantises the whole model; every Hessian, plain or weighted, then comes from the float model's
forward (not sequentially from the already-quantised layers, as `calibrate` does), so the plain-H row is
the control. Calibration windows are set `--set` of bench/quant_models.py's sets (the text both tools
were given there), packed into full windows as `qwen2om calibrate` does, or with `--samples records`
one sample per paragraph truncated to --seq-len, as llm-compressor's `oneshot` makes them from a
dataset's records (fewer, shorter samples: the same GPTQ on what such a run sees); held-out windows are
the model's held-out text.

    QWEN2OM_CACHE=.cache/qwen2om .venv/bin/python bench/fisher_layer.py --model builtin:tiny-qwen3-code
    # the whole model, one calibration set each, then mean ± sd over the sets
    for k in 0 1 2 3; do .venv/bin/python bench/fisher_layer.py --layers all --linears all --windows 256 \\
        --set $k --json set-$k.json; done; .venv/bin/python bench/fisher_layer.py --summarise set-*.json

With `--calibration-step ALPHAS` it measures something else: how far the held-out perplexity moves when the
float weights take a small step that lowers the *calibration* text's loss — training, not quantising. Per
row r of each linear the step is the calibration loss's Newton step under an output-Fisher approximation,
δ_r = −ĝ_r H⁻¹ / c_r (ĝ_r: the gradient of the mean next-token NLL on the calibration windows for row r;
H: the mean xxᵀ, dampened 1 % as GPTQ's; c_r: the mean squared gradient at row r's output). It ignores every
interaction between rows, linears and layers and so overshoots by orders of magnitude; α scales it. Rows:
the float weights W + α·δ alone, and GPTQ of W + α·δ (the plain H), each judged against the float model.

It is an experiment, not a calibrate option: the gradients need a backward pass through the whole model
(memory that grows with model size, against `calibrate`'s layer-by-layer contract); docs/benchmarks.md
says what a product version would need.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gptq_layer import LINEARS
from quant_models import calibration_text, heldout_text, read_json, split_sets, write_set

GROUP = 128
DAMP = 0.01
HEAD_WISE = ("q_proj", "k_proj", "v_proj")


def record_samples(blocks: list[str], model_dir: Path, num_samples: int, seq_len: int) -> list[list[int]]:
    """The set's paragraphs (its blocks cut at blank lines) as llm-compressor's `oneshot` makes samples of a
    dataset's records: one record, one sample, truncated to `seq_len`, never packed — so short records
    give short samples and fewer tokens than `num_samples` × `seq_len`."""
    from qwen2om.datasets import Encoder

    enc = Encoder(model_dir)
    paragraphs = [p for block in blocks for p in block.split("\n\n") if p.strip()]
    return [enc.encode(p)[:seq_len] for p in paragraphs[:num_samples]]


def targets(model: torch.nn.Module, layers: list[int], names: list[str]) -> dict[str, torch.nn.Linear]:
    """The linears `names` of every layer in `layers`, keyed 'LAYER.NAME'."""
    out: dict[str, torch.nn.Linear] = {}
    for layer in layers:
        found = {n.rsplit(".", 1)[-1]: m for n, m in model.model.layers[layer].named_modules()
                 if isinstance(m, torch.nn.Linear)}
        missing = [n for n in names if n not in found]
        if missing:
            raise SystemExit(f"layer {layer} has no {missing} (it has {sorted(found)})")
        out.update({f"{layer}.{n}": found[n] for n in names})
    return out


def head_wise(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in HEAD_WISE


def backward(model: torch.nn.Module, t: torch.Tensor, labels: str, gen: torch.Generator | None = None) -> None:
    """One window's summed next-token NLL, back-propagated to the activations: against the text's own next
    tokens (labels 'empirical') or ones drawn from the model's distribution ('true', with `gen`)."""
    # The weights need no gradient; the embeddings' output does, so that one flows to every linear.
    emb = model.get_input_embeddings()(t).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, use_cache=False).logits[0, :-1].float()
    if labels == "empirical":
        target = t[0, 1:]
    else:  # the true Fisher: a next token drawn from the model's own distribution
        target = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)[:, 0]
    torch.nn.functional.cross_entropy(logits, target, reduction="sum").backward()


def hessians(model: torch.nn.Module, mods: dict[str, torch.nn.Linear], samples: list[list[int]],
             head_dim: int, labels: str | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per linear (key 'LAYER.NAME'): the plain H (labels None), or the Fisher-weighted one ('empirical' or
    'true'), [K, K] for the whole output and, for q/k/v, [heads, K, K] under 'LAYER.NAME/head'. Each is
    divided by its weights' sum (GPTQ and its relative dampening ignore a uniform factor; this keeps the
    numbers readable)."""
    sums: dict[str, torch.Tensor] = {}
    norm: dict[str, float] = {}
    head_norm: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)

    def forward_hook(name: str) -> Any:
        def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if labels is None:
                add(name, x.T @ x, float(x.shape[0]))
                return
            inputs[name] = x
            out.register_hook(grad_hook(name))
        return hook

    def grad_hook(name: str) -> Any:
        def hook(g: torch.Tensor) -> None:
            x = inputs.pop(name)
            g = g.detach().reshape(-1, g.shape[-1]).float()
            w = (g * g).sum(1)
            add(name, (x * w[:, None]).T @ x, float(w.sum()))
            if head_wise(name):
                wh = (g * g).reshape(g.shape[0], -1, head_dim).sum(2)  # [T, heads]
                per = torch.stack([(x * wh[:, h, None]).T @ x for h in range(wh.shape[1])])
                key = name + "/head"
                sums[key] = sums[key] + per if key in sums else per
                head_norm[key] = head_norm[key] + wh.sum(0) if key in head_norm else wh.sum(0)
        return hook

    def add(name: str, hx: torch.Tensor, weight: float) -> None:
        sums[name] = sums[name] + hx if name in sums else hx
        norm[name] = norm.get(name, 0.0) + weight

    handles = [m.register_forward_hook(forward_hook(n)) for n, m in mods.items()]
    try:
        for ids in samples:
            t = torch.tensor([ids])
            if labels is None:
                with torch.no_grad():
                    model(input_ids=t, use_cache=False)
                continue
            backward(model, t, labels, gen)
    finally:
        for h in handles:
            h.remove()
    out = {k: 2 * v / norm[k] for k, v in sums.items() if k in norm}
    out.update({k: 2 * sums[k] / n[:, None, None] for k, n in head_norm.items()})
    return out


def calibration_steps(model: torch.nn.Module, mods: dict[str, torch.nn.Linear], samples: list[list[int]],
                      h_plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per linear, δ = −ĝ H⁻¹ / c row by row (module docstring): the calibration loss's per-row Newton step."""
    grads: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}

    def forward_hook(name: str) -> Any:
        def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1]).float()

            def grad_hook(g: torch.Tensor) -> None:
                g = g.detach().reshape(-1, g.shape[-1]).float()
                x = inputs.pop(name)
                grads[name] = grads[name] + g.T @ x if name in grads else g.T @ x
                squares[name] = squares[name] + (g * g).sum(0) if name in squares else (g * g).sum(0)
            out.register_hook(grad_hook)
        return hook

    handles = [m.register_forward_hook(forward_hook(n)) for n, m in mods.items()]
    tokens = sum(len(ids) - 1 for ids in samples)
    try:
        for ids in samples:
            backward(model, torch.tensor([ids]), "empirical")
    finally:
        for h in handles:
            h.remove()
    steps = {}
    for name, g in grads.items():
        h = h_plain[name] / 2  # hessians' plain H is 2 · mean xxᵀ
        h = h + DAMP * h.diagonal().mean() * torch.eye(h.shape[0])
        steps[name] = -torch.linalg.solve(h, g.T / tokens).T / (squares[name] / tokens)[:, None]
    return steps


def quantise(w: torch.Tensor, h: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """GPTQ (qwen2om's, plain min-max scales) of w against h: [K, K], or [heads, K, K] per row block."""
    from qwen2om.quant.gptq import gptq
    from qwen2om.quant.int4 import Int4Spec, dequantize

    spec = Int4Spec(group=GROUP, symmetric=True)
    if h.dim() == 2:
        r = gptq(w, h, spec, damp=DAMP, actorder=True, scale_dtype=torch.bfloat16)
        return dequantize(r.q, r.scale, None, GROUP)
    assert head_dim is not None
    blocks = [quantise(w[i * head_dim:(i + 1) * head_dim], h[i], None) for i in range(h.shape[0])]
    return torch.cat(blocks)


def rtn(w: torch.Tensor) -> torch.Tensor:
    from qwen2om.quant.int4 import Int4Spec, dequantize, qparams, quantize

    spec = Int4Spec(group=GROUP, symmetric=True)
    s = qparams(w, spec)[0].to(torch.bfloat16).float()
    return dequantize(quantize(w, s, torch.zeros_like(s), GROUP), s, None, GROUP)


class Heldout:
    """KL(float ‖ model) per position and Δppl on fixed held-out windows, the float side computed once; the
    measures are `qwen2om eval agree`'s (qwen2om.evaluate: window_agreement, nll)."""

    def __init__(self, model: torch.nn.Module, samples: list[list[int]]) -> None:
        from qwen2om.evaluate import nll

        self.model, self.samples = model, samples
        self.ref = [self._logp(ids) for ids in samples]
        self.tokens = sum(len(ids) - 1 for ids in samples)
        self.ref_nll = sum(nll(lp, ids) for lp, ids in zip(self.ref, samples, strict=True))

    def _logp(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits, -1).numpy()

    def __call__(self) -> dict[str, float]:
        from qwen2om.evaluate import nll, window_agreement

        kl = total = 0.0
        for ids, ref in zip(self.samples, self.ref, strict=True):
            lp = self._logp(ids)
            kl += window_agreement(lp, ref)[1]
            total += nll(lp, ids)
        ppl, ref_ppl = math.exp(total / self.tokens), math.exp(self.ref_nll / self.tokens)
        return {"kl": kl / self.tokens, "dppl": ppl - ref_ppl, "ref_ppl": ref_ppl}


def summarise(paths: list[Path]) -> int:
    """Mean ± sd over several runs' --json files (e.g. one per calibration set), per model and row."""
    import statistics

    def sd(values: list[float]) -> float:
        return statistics.stdev(values) if len(values) > 1 else 0.0

    runs: dict[str, list[dict[str, Any]]] = {}
    for p in paths:
        r = read_json(p, "a --json file of bench/fisher_layer.py")
        if not isinstance(r, dict) or not {"model", "set", "rows"} <= r.keys():
            raise SystemExit(f"{p}: not a --json file of bench/fisher_layer.py (no model, set or rows)")
        runs.setdefault(r["model"], []).append(r)
    for model, rs in runs.items():
        print(f"\n# {model}: {len(rs)} runs (sets {', '.join(str(r['set']) for r in rs)}), "
              f"layers {rs[0]['layers']}, {', '.join(rs[0]['linears'])}; calibration "
              f"{rs[0].get('samples', 'packed')}, {statistics.fmean(r['calibration_tokens'] for r in rs):.0f} tokens "
              "a run on average\n")
        print("| Hessian | held-out KL, mean ± sd | vs plain GPTQ, mean over runs | Δppl, mean ± sd |")
        print("|---|---:|---:|---:|")
        for row in rs[0]["rows"]:
            if row == "float":
                continue
            kl = [r["rows"][row]["kl"] for r in rs]
            rel = [r["rows"][row]["kl"] / r["rows"]["GPTQ (plain H)"]["kl"] - 1 for r in rs]
            dp = [r["rows"][row]["dppl"] for r in rs]
            print(f"| {row} | {statistics.fmean(kl):.3e} ± {sd(kl):.1e} | {100 * statistics.fmean(rel):+.1f} % | "
                  f"{statistics.fmean(dp):+.4f} ± {sd(dp):.4f} |")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--summarise"]:
        return summarise([Path(a) for a in sys.argv[2:]])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="bench/fisher_layer.py --summarise RUN.json ...: mean ± sd over recorded runs")
    ap.add_argument("--model", default="builtin:tiny-qwen3-trained")
    ap.add_argument("--layers", default="0", help="comma-separated layer indices, or 'all'")
    ap.add_argument("--linears", default="q_proj,k_proj,v_proj",
                    help="comma-separated linears of each of --layers, or 'all' (the seven of a dense layer)")
    ap.add_argument("--sets", type=int, default=4, help="bench/quant_models.py's --sets (decides set 0's blocks)")
    ap.add_argument("--set", type=int, default=0, help="which calibration set")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--samples", choices=("packed", "records"), default="packed",
                    help="packed: the set's records joined by end-of-text and cut into full windows, as `qwen2om "
                    "calibrate` does; records: each paragraph one sample truncated to --seq-len, as "
                    "llm-compressor's oneshot does with a dataset")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--window", type=int, default=256, help="held-out window (tokens)")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows at most")
    ap.add_argument("--calibration-step", metavar="ALPHAS", type=lambda v: [float(a) for a in v.split(",")],
                    help="comma-separated step sizes: instead of the Fisher rows, the float weights moved by α × the "
                    "calibration loss's per-row Newton step, alone and under GPTQ (module docstring)")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args()
    if not 0 <= args.set < args.sets:
        ap.error(f"--set {args.set}: there are sets 0 … {args.sets - 1}")

    from transformers import AutoModelForCausalLM

    from qwen2om.builtin import resolve_model
    from qwen2om.datasets import windows

    # First the texts: they refuse anything but a trained builtin, so no other path is resolved or read.
    train, heldout = calibration_text(args.model), heldout_text(args.model)
    torch.manual_seed(0)
    src = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, use_safetensors=True).eval()
    for p in model.parameters():
        p.requires_grad_(False)  # gradients flow to activations only: the hooks read them there
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_layers = cfg.num_hidden_layers
    layers = list(range(n_layers)) if args.layers == "all" else [int(i) for i in args.layers.split(",")]
    if any(not 0 <= i < n_layers for i in layers):
        raise SystemExit(f"--layers {args.layers}: {args.model} has layers 0 … {n_layers - 1}")
    linears = list(LINEARS) if args.linears == "all" else args.linears.split(",")
    mods = targets(model, layers, linears)
    with tempfile.TemporaryDirectory(prefix="fisher_layer-") as tmp:
        # The set exactly as bench/quant_models.py cuts and writes it.
        blocks = split_sets(train, args.sets)[args.set]
        if args.samples == "packed":
            cal = write_set(Path(tmp) / "set.jsonl", blocks)
            samples = windows(str(cal), src, num_samples=args.num_samples, seq_len=args.seq_len).samples
        else:
            samples = record_samples(blocks, src, args.num_samples, args.seq_len)
        held = Path(tmp) / "heldout.txt"
        held.write_text(heldout)
        held_samples = windows(str(held), src, num_samples=args.windows, seq_len=args.window).samples
    judge = Heldout(model, held_samples)
    original = {n: m.weight.detach().clone() for n, m in mods.items()}

    times: dict[str, float] = {}
    t = time.perf_counter()
    hs: dict[str, dict[str, torch.Tensor]] = {"plain": hessians(model, mods, samples, head_dim, None)}
    times["plain H"] = time.perf_counter() - t
    fisher = () if args.calibration_step else ("empirical", "true")
    for labels in fisher:
        t = time.perf_counter()
        hs[labels] = hessians(model, mods, samples, head_dim, labels)
        times[f"{labels} Fisher H (forward + backward)"] = time.perf_counter() - t
    if args.calibration_step:
        t = time.perf_counter()
        steps = calibration_steps(model, mods, samples, hs["plain"])
        times["calibration step (forward + backward)"] = time.perf_counter() - t

    def score(name: str, weight_of: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        for n, m in mods.items():
            m.weight.data.copy_(weight_of(n))
        r = judge()
        for n, m in mods.items():
            m.weight.data.copy_(original[n])
        r["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"  {name}: KL {r['kl']:.3e}, Δppl {r['dppl']:+.4f}", file=sys.stderr, flush=True)
        return r

    rows: dict[str, dict[str, float]] = {"float": judge(), "RTN": score("RTN", lambda n: rtn(original[n])),
                                         "GPTQ (plain H)": score("GPTQ", lambda n: quantise(original[n],
                                                                                             hs["plain"][n], None))}
    for alpha in args.calibration_step or []:
        rows[f"float, W + {alpha:g}·δ"] = score(f"float step {alpha:g}", lambda n, a=alpha: original[n] + a * steps[n])
        rows[f"GPTQ of W + {alpha:g}·δ"] = score(
            f"GPTQ step {alpha:g}", lambda n, a=alpha: quantise(original[n] + a * steps[n], hs["plain"][n], None))
    for labels in fisher:
        h = hs[labels]
        rows[f"GPTQ, {labels} Fisher, whole output"] = score(
            f"{labels} whole", lambda n, h=h: quantise(original[n], h[n], None))
        rows[f"GPTQ, {labels} Fisher, per head (q/k/v)"] = score(
            f"{labels} head", lambda n, h=h: quantise(original[n], h.get(n + "/head", h[n]), head_dim))

    base = rows["GPTQ (plain H)"]["kl"]
    n_tok = sum(map(len, samples))
    print(f"# {args.model}: layers {args.layers}, {', '.join(linears)} quantised (int4, group {GROUP}, symmetric), "
          f"the rest float; calibration set {args.set} of {args.sets}, {args.samples}: {len(samples)} samples "
          f"of ≤ {args.seq_len} ({n_tok} tokens); held-out {len(held_samples)} windows × {args.window} "
          f"({judge.tokens} scored positions), float ppl {rows['float']['ref_ppl']:.2f}\n")
    print("| Hessian | held-out KL | vs plain GPTQ | Δppl |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        if name == "float":
            continue
        print(f"| {name} | {r['kl']:.3e} | {100 * (r['kl'] / base - 1):+.1f} % | {r['dppl']:+.4f} |")
    print("\ntimes (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "layers": layers, "linears": linears,
                                         "set": args.set, "sets": args.sets, "samples": args.samples,
                                         "num_samples": len(samples), "calibration_tokens": n_tok,
                                         "heldout_positions": judge.tokens, "times_s": times, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
