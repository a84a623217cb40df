"""qwen2om's GPTQ against llm-compressor 0.14's GPTQ on one decoder layer, the same weights and inputs.

Where the two tools' quantised checkpoints differ, this says which step makes the difference. For
every linear of layer `--layer` (q/k/v/o/gate/up/down_proj) it measures:

- scales eq: fraction of groups whose scale (bf16, as stored) is the same in both tools;
- codes eq: fraction of int4 codes round(ŵ / scale) that agree, (a) with both tools given the same
  Hessian H (the float32 forward's), (b) both given the bf16 forward's H;
- the relative output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ), always under the float32 forward's H, of: RTN,
  qwen2om GPTQ, llm-compressor GPTQ on the bf16 H (as it really runs: bench/llmcompressor_w4a16.py
  loads the model in bfloat16), llm-compressor GPTQ on the float32 H, and qwen2om GPTQ with its clip
  search (`CLIP_RATIOS`);
- ‖H_bf16 − H_f32‖_F / ‖H_f32‖_F, how far the bf16 forward moves the Hessian;
- diagnostics: rows whose codes all agree, the act-order column where a differing row first differs,
  the codes again with llm-compressor handed float32 copies of the same scale values (isolating its
  bf16 dequantisation), Hessian columns that are zero.

Both Hessians are Σ 2·xxᵀ / tokens in float32 (llm-compressor divides by the number of sequences instead:
a uniform factor GPTQ is invariant to, the dampening being relative to the mean diagonal), from forwards
of the unquantised transformers model that stop after layer `--layer`. For layer 0 that is exactly what
both tools see. For later layers it is NOT how sequential calibration runs (each tool feeds a layer the
outputs of its own already-quantised layers); here both get the float model's inputs, which isolates
the algorithm.

llm-compressor pins an older transformers, so it lives in .venv-llmc: the main process saves W and both
H to a temporary .pt and runs this same file with .venv-llmc/bin/python in `--llmc-side IN OUT` mode,
which computes llm-compressor's observer scales and GPTQ result through its own API and saves them.

    QWEN2OM_CACHE=.cache/qwen2om .venv/bin/python bench/gptq_layer.py --model builtin:tiny-qwen3-trained \\
        --dataset .cache/bench/quant-models/tiny-qwen3-trained/set-0.jsonl --num-samples 128 --seq-len 512 \\
        --layer 0 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
DAMP = 0.01
LLMC_PYTHON = Path(__file__).resolve().parent.parent / ".venv-llmc" / "bin" / "python"
# Variants of llm-compressor's GPTQ run by the child: which H, and whether its scales keep their dtype.
LLMC_VARIANTS = {"f32": ("h_f32", False), "bf16": ("h_bf16", False), "f32_scalef32": ("h_f32", True)}


class _Collected(Exception):
    """Raised from the last linear's hook: nothing after layer L is needed."""


def collect(model_dir: Path, samples: list[list[int]], layer: int, dtype: torch.dtype
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights as float32 [N, K], H = Σ 2·xxᵀ / tokens in float32 [K, K]) per linear of `layer`, from a
    transformers forward in `dtype` of every window, one at a time."""
    from transformers import AutoModelForCausalLM

    from qwen2om.quant.gptq import gram

    # safetensors only: a checkpoint directory's pickle files are never loaded
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True).eval()
    block = model.model.layers[layer]
    mods = {name.rsplit(".", 1)[-1]: m for name, m in block.named_modules()
            if name.rsplit(".", 1)[-1] in LINEARS and isinstance(m, torch.nn.Linear)}
    missing = set(LINEARS) - set(mods)
    if missing:
        raise SystemExit(f"layer {layer} has no {sorted(missing)}")
    sums: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    tokens = {"n": 0}
    # q/k/v (and gate/up) are called with the very same tensor: its Gram matrix is computed once.
    last: dict[str, Any] = {"x": None, "key": ""}
    fired: set[str] = set()

    def hook(name: str) -> Any:
        def pre(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            if x is not last["x"]:
                flat = x.reshape(-1, x.shape[-1]).float()
                g = gram(flat)
                sums[name] = sums[name] + g if name in sums else g
                last["x"], last["key"] = x, name
                if name == "q_proj":
                    tokens["n"] += flat.shape[0]
            alias[name] = last["key"]
            fired.add(name)
            if len(fired) == len(mods):  # the rest of the model feeds nothing measured: skip it
                raise _Collected
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    try:
        with torch.inference_mode():
            for ids in samples:
                fired.clear()
                t = torch.tensor([ids])
                try:
                    model(input_ids=t, attention_mask=torch.ones_like(t), use_cache=False)
                except _Collected:
                    pass
                else:
                    raise RuntimeError(f"the forward finished without reaching layer {layer}'s linears")
    finally:
        for h in handles:
            h.remove()
    last["x"] = None
    # The stored weight is bf16; its float32 copy is what both tools quantise.
    weights = {n: m.weight.detach().to(torch.bfloat16).float().clone() for n, m in mods.items()}
    hess = {n: 2 * sums[alias[n]] / tokens["n"] for n in LINEARS}
    return weights, hess


def llmc_side(src: Path, dst: Path) -> None:
    """In .venv-llmc: llm-compressor's weight observer and `quantize_weight` for every linear in `src`."""
    import compressed_tensors
    import llmcompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.quantization.calibration import initialize_observer, observe

    data = torch.load(src, weights_only=True)
    if data["threads"]:
        torch.set_num_threads(int(data["threads"]))
    out: dict[str, Any] = {"versions": {"llmcompressor": llmcompressor.__version__,
                                        "compressed_tensors": compressed_tensors.__version__}}
    for name, w in data["weights"].items():
        # Args as bench/llmcompressor_w4a16.py gives them, actorder as GPTQModifier resolves it.
        qargs = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                 group_size=int(data["group"]), actorder="static")
        # A bf16 Linear carrying the scheme, observed the way GPTQModifier does at a sequential epoch's
        # end (observe → weight_observer.get_qparams), so the observer choice and dtype are its own.
        module = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        module.weight.data.copy_(w)
        module.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
        initialize_observer(module, "weight")
        observe(module, "weight")
        qp = module.weight_observer.get_qparams()
        scale, zp = qp["scale"], qp["zero_point"]
        res: dict[str, Any] = {"scale": scale.float(), "scale_dtype": str(scale.dtype),
                               "observer": type(module.weight_observer).__name__}
        for variant, (hkey, f32_scale) in LLMC_VARIANTS.items():
            s = scale.float() if f32_scale else scale
            w_hat, _losses, fallback = quantize_weight(
                weights=w.float()[None].clone(), hessians=data[hkey][name].float()[None].clone(),
                scale=s[None], zero_point=zp[None], global_scale=qp["global_scale"], quant_args=qargs,
                blocksize=GROUP, percdamp=DAMP)
            res[f"w_hat_{variant}"] = w_hat[0].float()
            res[f"fallback_{variant}"] = bool(fallback[0])
        out[name] = res
    torch.save(out, dst)


def codes_of(w_hat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Int codes of a (fake-)quantised weight: ŵ is q·s (maybe rounded to bf16, ≤ 2⁻⁹ relative), so the
    rounding recovers q exactly."""
    return torch.round(w_hat / scale.float().repeat_interleave(GROUP, dim=1)).to(torch.int8)


def divergence(a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor) -> tuple[float, float | None]:
    """(fraction of rows whose codes all agree, median over the other rows of the first act-order
    column where they differ, as a fraction of K): early means a different start (scales, order),
    late means drift from the error feedback."""
    diff = (a != b)[:, perm]
    rows = diff.any(1)
    if not rows.any():
        return 1.0, None
    first = diff[rows].float().argmax(1).float()
    return 1.0 - float(rows.float().mean()), float(first.median()) / a.shape[1]


def compare(w: torch.Tensor, h32: torch.Tensor, h16: torch.Tensor, llmc: dict[str, Any], clip_ratios: tuple[float, ...]
            ) -> dict[str, Any]:
    from qwen2om.quant.gptq import gptq, output_errors
    from qwen2om.quant.int4 import Int4Spec, dequantize, qparams, quantize

    spec = Int4Spec(group=GROUP, symmetric=True)

    def run(h: torch.Tensor, ratios: tuple[float, ...]) -> Any:
        return gptq(w, h, spec, damp=DAMP, actorder=True, scale_dtype=torch.bfloat16, clip_ratios=ratios)

    q32, q16, qclip = run(h32, (1.0,)), run(h16, (1.0,)), run(h32, clip_ratios)
    # RTN with the scales rounded to bf16, as a checkpoint stores them.
    s_rtn = qparams(w, spec)[0].to(torch.bfloat16).float()
    rtn_hat = dequantize(quantize(w, s_rtn, torch.zeros_like(s_rtn), GROUP), s_rtn, None, GROUP)
    hat = {k: dequantize(r.q, r.scale, None, GROUP) for k, r in (("q32", q32), ("q16", q16), ("qclip", qclip))}
    ls = llmc["scale"]
    lcodes = {v: codes_of(llmc[f"w_hat_{v}"], ls) for v in LLMC_VARIANTS}
    qcodes32, qcodes16 = codes_of(hat["q32"], q32.scale), codes_of(hat["q16"], q16.scale)
    perm32 = torch.argsort(torch.diag(h32), descending=True)
    perm16 = torch.argsort(torch.diag(h16), descending=True)
    errs = output_errors(w, h32, [rtn_hat, hat["q32"], llmc["w_hat_bf16"], llmc["w_hat_f32"], hat["qclip"],
                                  hat["q16"], llmc["w_hat_f32_scalef32"]])
    same_rows_32, first_32 = divergence(qcodes32, lcodes["f32"], perm32)
    same_rows_16, first_16 = divergence(qcodes16, lcodes["bf16"], perm16)
    return {
        "shape": list(w.shape),
        "scales_equal": float((q32.scale == ls).float().mean()),
        "codes_equal_f32H": float((qcodes32 == lcodes["f32"]).float().mean()),
        "codes_equal_bf16H": float((qcodes16 == lcodes["bf16"]).float().mean()),
        "codes_equal_f32H_llmc_f32scale": float((qcodes32 == lcodes["f32_scalef32"]).float().mean()),
        "codes_equal_llmc_bf16H_vs_f32H": float((lcodes["bf16"] == lcodes["f32"]).float().mean()),
        "rows_identical_f32H": same_rows_32, "first_diff_col_f32H": first_32,
        "rows_identical_bf16H": same_rows_16, "first_diff_col_bf16H": first_16,
        "err_rtn": errs[0], "err_qwen2om_f32H": errs[1], "err_llmc_bf16H": errs[2], "err_llmc_f32H": errs[3],
        "err_qwen2om_clip_f32H": errs[4], "err_qwen2om_bf16H": errs[5], "err_llmc_f32H_f32scale": errs[6],
        "h_rel_diff": float(torch.linalg.norm(h16 - h32) / torch.linalg.norm(h32)),
        "dead_cols_f32H": int((torch.diag(h32) == 0).sum()), "dead_cols_bf16H": int((torch.diag(h16) == 0).sum()),
        "perm_equal": bool(torch.equal(perm32, perm16)),
        "qwen2om_methods": sorted({q32.method, q16.method, qclip.method}),
        "llmc_rtn_fallback": sorted(v for v in LLMC_VARIANTS if llmc[f"fallback_{v}"]),
    }


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


def tables(rows: dict[str, dict[str, Any]]) -> str:
    main = ["| linear | N×K | scales eq | codes eq (a) same f32 H | codes eq (b) same bf16 H | RTN "
            "| qwen2om GPTQ (f32 H) | llm-c GPTQ (bf16 H, as run) | llm-c GPTQ (f32 H) | qwen2om GPTQ+clip (f32 H) "
            "| ‖H_bf16−H_f32‖/‖H_f32‖ |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    diag = ["| linear | rows identical (a) | first diff col (a), median/K | rows identical (b) "
            "| first diff col (b), median/K | codes eq (a) with llm-c on f32 scale dtype | err llm-c f32-scale "
            "| err qwen2om (bf16 H) | llm-c bf16 H vs f32 H codes eq | act order equal | dead cols f32/bf16 "
            "| fallbacks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in rows.items():
        main.append(f"| {n} | {r['shape'][0]}×{r['shape'][1]} | {pct(r['scales_equal'])} | "
                    f"{pct(r['codes_equal_f32H'])} | {pct(r['codes_equal_bf16H'])} | {r['err_rtn']:.3e} | "
                    f"{r['err_qwen2om_f32H']:.3e} | {r['err_llmc_bf16H']:.3e} | {r['err_llmc_f32H']:.3e} | "
                    f"{r['err_qwen2om_clip_f32H']:.3e} | {r['h_rel_diff']:.2e} |")
        fb = [f"qwen2om {m}" for m in r["qwen2om_methods"] if m != "gptq"] + \
             [f"llm-c RTN ({v})" for v in r["llmc_rtn_fallback"]]
        diag.append(f"| {n} | {pct(r['rows_identical_f32H'])} | {pct(r['first_diff_col_f32H'])} | "
                    f"{pct(r['rows_identical_bf16H'])} | {pct(r['first_diff_col_bf16H'])} | "
                    f"{pct(r['codes_equal_f32H_llmc_f32scale'])} | {r['err_llmc_f32H_f32scale']:.3e} | "
                    f"{r['err_qwen2om_bf16H']:.3e} | {pct(r['codes_equal_llmc_bf16H_vs_f32H'])} | "
                    f"{'yes' if r['perm_equal'] else 'no'} | {r['dead_cols_f32H']}/{r['dead_cols_bf16H']} | "
                    f"{', '.join(fb) or 'none'} |")
    return "\n".join(main) + "\n\nDiagnostics:\n\n" + "\n".join(diag)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-qwen3-trained")
    ap.add_argument("--dataset", type=Path)
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in both processes (0: torch's default)")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--llmc-side", nargs=2, type=Path, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llmc_side:
        llmc_side(*args.llmc_side)
        return
    if args.dataset is None:
        ap.error("--dataset is required")
    if not args.dataset.is_file():
        raise SystemExit(f"dataset {args.dataset} does not exist: nothing measured")
    if not LLMC_PYTHON.is_file():
        raise SystemExit(f"{LLMC_PYTHON} does not exist: see bench/llmcompressor_w4a16.py for the venv")
    if args.threads:
        torch.set_num_threads(args.threads)

    from qwen2om.builtin import resolve_model
    from qwen2om.datasets import windows
    from qwen2om.quant.gptq import CLIP_RATIOS

    t_start = time.perf_counter()
    times: dict[str, float] = {}
    model_dir = resolve_model(args.model)
    layers = json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers", 0)
    if not 0 <= args.layer < layers:
        raise SystemExit(f"--layer {args.layer}: {args.model} has layers 0 … {layers - 1}")
    samples = windows(str(args.dataset), model_dir, num_samples=args.num_samples, seq_len=args.seq_len).samples
    t = time.perf_counter()
    weights, h32 = collect(model_dir, samples, args.layer, torch.float32)
    times["forward_f32"] = time.perf_counter() - t
    t = time.perf_counter()
    _, h16 = collect(model_dir, samples, args.layer, torch.bfloat16)
    times["forward_bf16"] = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="gptq_layer-") as tmp:
        src, dst = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save({"weights": weights, "h_f32": h32, "h_bf16": h16, "group": GROUP, "threads": args.threads}, src)
        t = time.perf_counter()
        subprocess.run([str(LLMC_PYTHON), str(Path(__file__).resolve()), "--llmc-side", str(src), str(dst)],
                       check=True)
        times["llmc_child"] = time.perf_counter() - t
        llmc = torch.load(dst, weights_only=True)
    t = time.perf_counter()
    rows = {n: compare(weights[n], h32[n], h16[n], llmc[n], CLIP_RATIOS) for n in LINEARS}
    times["qwen2om_and_metrics"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t_start

    n_tok = sum(map(len, samples))
    print(f"# GPTQ, one layer: {args.model} layer {args.layer}, {len(samples)} windows × {args.seq_len} "
          f"({n_tok} tokens), int4 symmetric, group {GROUP}, damp {DAMP}, static act-order")
    print(f"llm-compressor {llmc['versions']['llmcompressor']}, compressed-tensors "
          f"{llmc['versions']['compressed_tensors']}; observer {llmc[LINEARS[0]]['observer']}, "
          f"scale dtype {llmc[LINEARS[0]]['scale_dtype']}")
    if args.layer > 0:
        print(f"NOTE: layer {args.layer}'s inputs come from the unquantised model for both tools. That is NOT how "
              "sequential calibration runs (each tool feeds it the outputs of its own quantised layers "
              f"0..{args.layer - 1}); it isolates the algorithm.")
    print("Errors: relative output error tr(ΔW H ΔWᵀ)/tr(W H Wᵀ) under the float32 forward's H. "
          "(a): both tools on the float32 forward's H; (b): both on the bf16 forward's H.\n")
    print(tables(rows))
    print("\nfirst diff col: where, in act order, a row whose codes differ first differs (median over such rows). "
          "llm-c f32-scale: llm-compressor's quantize_weight handed float32 copies of its own bf16 scale values.")
    print("times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "model_dir": str(model_dir), "dataset": str(args.dataset), "layer": args.layer,
            "num_samples": len(samples), "seq_len": args.seq_len, "tokens": n_tok, "group": GROUP, "damp": DAMP,
            "clip_ratios": list(CLIP_RATIOS), "versions": llmc["versions"], "inputs_from_float_model": True,
            "sequential_like": args.layer == 0, "times_s": times, "linears": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
