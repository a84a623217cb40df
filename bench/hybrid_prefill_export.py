#!/usr/bin/env python3
"""Prefill graph of a Qwen3.5 hybrid: qwen2om's chunked delta rule vs transformers' export fallback.

For a tiny hybrid builtin (default tiny-qwen3-5, fp32) and each prefill length T:

- `qwen2om`: the static model (`qwen2om/static_hybrid.py`) with the static signature (KV cache of
  capacity P for the full-attention layer, conv/recurrent state inputs and outputs for the linear
  ones, logits of all T positions), exported as `convert` does (torch.onnx dynamo, opset 18,
  onnxscript's optimizer);
- `transformers`: `AutoModelForCausalLM` (the same weights) exported the way users do today,
  `torch.onnx.export(model, (input_ids,), kwargs={"use_cache": False}, dynamo=True)` with its
  default optimisation. Under export, transformers replaces its triangular solve by a per-row
  forward substitution (`torch_chunk_gated_delta_rule`), which unrolls into Scatter-heavy code.

Printed per graph: export wall time, node count, Scatter nodes, and ONNX Runtime CPU time of one
prefill call (median of --runs, after one warm-up), with real weights in both graphs.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
import transformers


def timed_runs(path: Path, feeds: dict[str, np.ndarray], runs: int) -> float:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def describe(model: ir.Model) -> tuple[int, int]:
    ops = collections.Counter(n.op_type for n in model.graph.all_nodes())
    return sum(ops.values()), sum(v for k, v in ops.items() if k.startswith("Scatter"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-5")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    from qwen2om.builtin import resolve_model
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.passes.export_onnx import export
    from qwen2om.signature import graph_io
    from qwen2om.static_hybrid import StaticHybrid, hybrid_rope_tables
    from qwen2om.weights import Weights

    transformers.utils.logging.set_verbosity_error()
    root = resolve_model(f"builtin:{args.model}")
    ckpt = Checkpoint(root)
    d = ckpt.dims
    shapes = {n: ckpt.shape(n) for n in ckpt.names()}
    cos, sin = hybrid_rope_tables(ckpt.config, d, args.capacity)
    weights = Weights(ckpt.get, shapes, torch.float32, lazy=False)
    # Logits of every position, as transformers' graph returns them (convert's default returns the last only).
    ours = StaticHybrid(ckpt.arch, d, weights, cos, sin, logits_last=False, fused_experts=ckpt.fused_experts).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in args.tokens:
            inputs, outputs = graph_io(d, batch=1, t=t, capacity=args.capacity, dtype="float32", logits_t=t)
            t0 = time.perf_counter()
            graph = export(ours, inputs, outputs, 18)
            secs = time.perf_counter() - t0
            nodes, scatters = describe(graph)
            path = Path(tmp) / f"ours{t}.onnx"
            ir.save(graph, path, external_data=path.name + ".data")
            ids = np.random.default_rng(0).integers(0, 1000, (1, t))
            feeds = {s.name: np.zeros(s.shape, s.dtype) for s in inputs}
            feeds["input_ids"] = ids
            feeds["position_ids"] = np.arange(t)[None]
            mask = np.full((1, 1, t, args.capacity + t), np.finfo(np.float32).min, np.float32)
            mask[0, 0, :, args.capacity:] = np.where(np.tril(np.ones((t, t), bool)), 0, np.finfo(np.float32).min)
            feeds["attention_mask"] = mask
            rows.append(("qwen2om", t, secs, nodes, scatters, timed_runs(path, feeds, args.runs)))
            t0 = time.perf_counter()
            with torch.no_grad():
                prog = torch.onnx.export(hf, (torch.tensor(ids),), kwargs={"use_cache": False}, dynamo=True,
                                         opset_version=18, verify=False)
            secs = time.perf_counter() - t0
            nodes, scatters = describe(prog.model)
            path = Path(tmp) / f"hf{t}.onnx"
            prog.save(str(path), external_data=True)
            name = prog.model.graph.inputs[0].name
            rows.append(("transformers", t, secs, nodes, scatters, timed_runs(path, {name: ids}, args.runs)))
    print(f"{args.model}: {d.layers} layers ({d.layer_types.count('linear_attention')} linear), hidden {d.hidden}, "
          f"capacity {args.capacity}, fp32, ORT CPU 1 thread, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"{'export':<13}{'T':>5}{'export s':>10}{'nodes':>8}{'Scatter':>9}{'ORT ms':>9}")
    for r in rows:
        print(f"{r[0]:<13}{r[1]:>5}{r[2]:>10.1f}{r[3]:>8}{r[4]:>9}{r[5]:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
