#!/usr/bin/env python3
"""Where an int4 decode step's time goes: the whole decode graph against its MatMulNBits nodes alone.

For each decode graph given (qwen2om's `model.decode.onnx`, ORT GenAI's `model.onnx`), at the same moment
and with the same `--threads`:

1. the whole graph, one decode step with `--past` tokens already in the cache (random cache contents, a
   mask / attention_mask that opens exactly those slots; inputs bound once, qwen2om's `cache_*` outputs
   bound to the past buffers as its runtime does), median of `--repeats` batches of `--steps` runs;
2. a graph holding only its `com.microsoft::MatMulNBits` nodes, with the same weights and attributes,
   each fed from a graph input of its width (so the nodes run back to back, as in the step): the time
   no graph surgery can remove while the int4 weights go through ONNX Runtime's kernel;
3. with `--sweep`, one `[1, K] x [K, N]` MatMulNBits shape over `--sweep-copies` distinct random weights
   (more than the L3 cache holds, and the caches evicted before each run, so weights stream from memory, as
   in decode) at each block size and accuracy level: the kernel's int4 throughput;
4. with `--by-shape`, each graph's MatMulNBits grouped by shape (K, N, block), each group timed alone: which
   shapes stream their weights slower (the caches evicted before each run);
5. with `--ceiling`, this machine's memory read bandwidth with `--threads` threads, and from it the least
   time any int4 kernel could take to stream each graph's MatMulNBits weights: the step that would be left
   with a perfect kernel and the rest of the graph as measured.

The table says how long the rest of the graph (attention, norms, reshapes, per-node cost) takes, and the
step a target speed-up over a reference graph would need.

    .venv/bin/python bench/int4_floor.py \\
        .cache/bench/int4/onnx-w4-acc4-qhead-qwen3-0.6b-L28-s0-P512-T128/model.decode.onnx \\
        .cache/bench/int4/ortgenai-int4-qwen3-0.6b-L28-s0/model.onnx --reference 2 --sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from decode import ForeignLoad
from onnx import external_data_helper, helper

CONTRIB = "com.microsoft"
ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}


def session(model: str | bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def step_feeds(s: ort.InferenceSession, graph: Path, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step's inputs with `past` tokens cached, for either signature: qwen2om's static one
    (`attention_mask` additive float over P + 1 columns, `past_key.i` [B, H, P, D]) or GenAI's dynamic one
    (`attention_mask` int64 ones over past + 1, `past_key_values.i.key` [B, H, past, D], D from the
    `genai_config.json` beside the graph)."""
    rng = np.random.default_rng(seed)
    genai = graph.parent / "genai_config.json"
    head_size = json.loads(genai.read_text())["model"]["decoder"]["head_size"] if genai.is_file() else None
    feeds = {}
    for i in s.get_inputs():
        dtype = ORT_TYPES[i.type]
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if i.name.startswith("past_key_values."):  # dynamic past length and head size
            if head_size is None:
                sys.exit(f"error: {graph}: {i.name} has a symbolic head size and there is no genai_config.json")
            shape[2], shape[3] = past, head_size
        if i.name == "attention_mask" and dtype == np.float32:
            mask = np.full(shape, np.finfo(np.float32).min, np.float32)
            mask[..., :past] = 0
            mask[..., -1] = 0
            feeds[i.name] = mask
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, past + 1), dtype)
        elif i.name == "position_ids":
            feeds[i.name] = np.full(shape, past, dtype)
        elif dtype in (np.float32, np.float16):
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[i.name] = np.full(shape, 100, dtype)  # token ids
    return feeds


def nbits_only(graph: Path) -> tuple[bytes, dict[str, np.ndarray], int, int]:
    """A model of `graph`'s MatMulNBits nodes alone (same weights and attributes), its feeds, the node
    count and the bytes of their quantised weights and scales."""
    model = onnx.load(str(graph), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == CONTRIB]
    needed = {x for n in nodes for x in n.input[1:] if x}
    inits = [t for t in model.graph.initializer if t.name in needed]
    for t in inits:
        if external_data_helper.uses_external_data(t):
            external_data_helper.load_external_data_for_tensor(t, str(graph.parent))
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    widths = sorted({int(next(a.i for a in n.attribute if a.name == "K")) for n in nodes})
    copies = []
    for k, n in enumerate(nodes):
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[0] = f"x{next(a.i for a in n.attribute if a.name == 'K')}"
        del c.output[:]
        c.output.append(f"y{k}")
        copies.append(c)
    g = helper.make_graph(copies, "nbits_only",
                          [helper.make_tensor_value_info(f"x{w}", onnx.TensorProto.FLOAT, [1, 1, w]) for w in widths],
                          [helper.make_tensor_value_info(f"y{k}", onnx.TensorProto.FLOAT, None)
                           for k in range(len(copies))], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)]
    rng = np.random.default_rng(0)
    feeds = {f"x{w}": rng.standard_normal((1, 1, w)).astype(np.float32) for w in widths}
    nbytes = sum(onnx.numpy_helper.to_array(t).nbytes for t in inits)
    return helper.make_model(g, opset_imports=opsets).SerializeToString(), feeds, len(nodes), nbytes


def ms_per_step(s: ort.InferenceSession, feeds: dict[str, np.ndarray], steps: int, repeats: int,
                evict: np.ndarray | None = None) -> float:
    """Median over `repeats` of the mean wall time of `steps` runs, after 3 warm-up runs. Inputs are bound
    once; a qwen2om decode graph's `cache_key/value.i` outputs are bound to their past inputs' buffers, as
    its runtime does (the kernel then reads the cache in place); other outputs ONNX Runtime allocates.
    With `evict`, the median of single runs, each after a read of `evict`: weights that would stay in the
    last-level cache between back-to-back runs (part of a set a few times its size does, on this machine's
    EPYC) are read from memory, as in a whole decode step."""
    binding, keep = s.io_binding(), []
    for name, value in feeds.items():
        keep.append(ort.OrtValue.ortvalue_from_numpy(value))
        binding.bind_ortvalue_input(name, keep[-1])
    for o in s.get_outputs():
        past = o.name.replace("cache_", "past_", 1)
        if o.name.startswith("cache_") and past in feeds:
            keep.append(ort.OrtValue.ortvalue_from_numpy(feeds[past]))
            binding.bind_ortvalue_output(o.name, keep[-1])
        else:
            binding.bind_output(o.name)
    for _ in range(3):
        s.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        if evict is not None:  # each run timed alone, after reading `evict` pushed its weights out of the caches
            for _ in range(steps):
                np.max(evict)
                t0 = time.perf_counter()
                s.run_with_iobinding(binding)
                times.append((time.perf_counter() - t0) * 1e3)
            continue
        t0 = time.perf_counter()
        for _ in range(steps):
            s.run_with_iobinding(binding)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def sweep_model(k: int, n: int, block: int, level: int, copies: int) -> bytes:
    """`copies` MatMulNBits of [1, k] x [k, n], random symmetric int4 weights, all fed the same input."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for c in range(copies):
        inits += [onnx.numpy_helper.from_array(rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8),
                                               f"w{c}"),
                  onnx.numpy_helper.from_array((rng.random(n * k // block) * 0.01).astype(np.float32), f"s{c}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"w{c}", f"s{c}"], [f"y{c}"], domain=CONTRIB,
                                      K=k, N=n, bits=4, block_size=block, accuracy_level=level))
    g = helper.make_graph(nodes, "sweep", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info(f"y{c}", onnx.TensorProto.FLOAT, [1, n])
                           for c in range(copies)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)]
                             ).SerializeToString()


def last_level_cache() -> int | None:
    """Bytes of the largest CPU cache Linux reports (sysfs), or None."""
    sizes, units = [], {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=None)


def eviction_buffer() -> np.ndarray:
    """A buffer whose read pushes everything else out of the caches: 8 x the last-level cache (256 MiB if
    Linux does not say)."""
    return np.ones(8 * (last_level_cache() or 32 << 20), dtype=np.uint8)


def by_shape(nbits_model: bytes, threads: int, steps: int, repeats: int) -> list[str]:
    """Table rows: the MatMulNBits of `nbits_model` (`nbits_only`'s) grouped by (K, N, block_size), each group
    run alone, its caches evicted before each run (28 layers of one shape are 30-90 MiB, a few times the
    last-level cache: timed back to back, part of them is read from the cache and the group streams faster
    than it does in a decode step)."""
    model = onnx.load_from_string(nbits_model)
    groups: dict[tuple[int, int, int], list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        a = {x.name: x.i for x in n.attribute}
        groups.setdefault((a["K"], a["N"], a["block_size"]), []).append(n)
    rows, evict = [], eviction_buffer()
    for (k, n, block), nodes in sorted(groups.items()):
        needed = {x for node in nodes for x in node.input[1:] if x}
        inits = [t for t in model.graph.initializer if t.name in needed]
        g = helper.make_graph(nodes, "shape", [helper.make_tensor_value_info(f"x{k}", onnx.TensorProto.FLOAT,
                                                                             [1, 1, k])],
                              [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
                               for node in nodes], inits)
        s = session(helper.make_model(g, opset_imports=model.opset_import).SerializeToString(), threads)
        x = {f"x{k}": np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)}
        ms = ms_per_step(s, x, steps, repeats, evict)
        nbytes = sum(onnx.numpy_helper.to_array(t).nbytes for t in inits)
        rows.append(f"| {k} | {n} | {block} | {len(nodes)} | {nbytes / 2**20:,.1f} | {ms:.2f} | "
                    f"{ms * 1e3 / len(nodes):.0f} | {nbytes / ms / 1e6:.1f} |")
    return rows


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 4) -> float:
    """Bytes/s read by `threads` Python threads each reducing its slice of an `nbytes` buffer (numpy releases
    the GIL while it reduces), the best of `repeats` runs of `np.max` and of `np.count_nonzero`, the two
    fastest of numpy's reductions here (an XOR reduce measured 30 % less: it is bound by its own loop). Reading
    only, as a GEMV streams its weights: a lower bound on what a kernel could stream, the weights being far
    larger than the caches."""
    buf = np.ones(nbytes, dtype=np.uint8)
    slices = np.array_split(buf, threads)
    best = 0.0
    for reduce in (np.max, np.count_nonzero):
        for _ in range(repeats):
            workers = [threading.Thread(target=reduce, args=(part,)) for part in slices]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("graphs", nargs="+", type=Path, help="decode graphs (.onnx, external data beside them)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--past", type=int, default=64, help="tokens already in the cache (default 64)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reference", type=int, default=0,
                   help="1-based index of the graph the speed-up target is against (0: none)")
    p.add_argument("--target", type=float, default=1.5, help="speed-up over the reference (default 1.5)")
    p.add_argument("--sweep", action="store_true", help="also time one MatMulNBits shape per block size and level")
    p.add_argument("--sweep-shape", default="1024x6144", help="K x N of the sweep (default 1024x6144)")
    p.add_argument("--sweep-copies", type=int, default=40)
    p.add_argument("--by-shape", action="store_true", help="also time each graph's MatMulNBits shape by shape")
    p.add_argument("--ceiling", action="store_true",
                   help="also measure read bandwidth and the step a kernel streaming at that speed would leave")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    for g in a.graphs:
        if not g.is_file():
            sys.exit(f"error: {g}: no such graph")
    load = ForeignLoad()
    print(f"threads {a.threads}, {a.past} tokens cached, median of {a.repeats} x {a.steps} steps, "
          f"load average {os.getloadavg()[0]:.2f}, onnxruntime {ort.__version__}\n")
    print("| decode graph | MatMulNBits nodes | their weights MiB | whole step ms | MatMulNBits only ms "
          "| the rest ms | tok/s | tok/s with MatMulNBits only |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    steps, shape_rows = [], {}
    for g in a.graphs:
        whole = session(str(g), a.threads)
        full_ms = ms_per_step(whole, step_feeds(whole, g, a.past), a.steps, a.repeats)
        del whole  # one model's weights in memory at a time
        model, nb_feeds, count, nbytes = nbits_only(g)
        nb_ms = ms_per_step(session(model, a.threads), nb_feeds, a.steps, a.repeats)
        if a.by_shape:  # while this graph's weights are loaded (one graph's at a time)
            shape_rows[g] = by_shape(model, a.threads, a.steps, a.repeats)
        steps.append((g, full_ms, nb_ms, nbytes))
        name = f"{g.parent.name}/{g.name}"
        print(f"| {name} | {count} | {nbytes / 2**20:,.0f} | {full_ms:.2f} | {nb_ms:.2f} | {full_ms - nb_ms:.2f} "
              f"| {1e3 / full_ms:.1f} | {1e3 / nb_ms:.1f} |")
    if a.reference:
        ref = steps[a.reference - 1]
        need = ref[1] / a.target
        print(f"\n{a.target}x {ref[0].parent.name} ({ref[1]:.2f} ms/step) needs a step of {need:.2f} ms.")
        for g, full_ms, nb_ms, _ in steps:
            if g != ref[0]:
                print(f"{g.parent.name}: now {full_ms:.2f} ms ({ref[1] / full_ms:.2f}x); its MatMulNBits alone "
                      f"take {nb_ms:.2f} ms, so the rest of the step would have to fit in {need - nb_ms:.2f} ms "
                      f"(it takes {full_ms - nb_ms:.2f}).")
    for g, rows in shape_rows.items():
        print(f"\n{g.parent.name}: MatMulNBits by shape, each shape's nodes alone, {a.threads} threads\n")
        print("| K | N | block | nodes | weights MiB | ms | µs per node | GB/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        print("\n".join(rows))
    if a.ceiling:
        bw = read_bandwidth(a.threads)
        print(f"\nmemory read bandwidth, {a.threads} threads (best of 8 reductions of 1 GiB): {bw / 1e9:.1f} GB/s\n")
        print("| decode graph | MatMulNBits now: ms, GB/s | at the read bandwidth: ms | step left ms | tok/s |")
        print("|---|---:|---:|---:|---:|")
        for g, full_ms, nb_ms, nbytes in steps:
            floor_ms = nbytes / bw * 1e3
            best = full_ms - nb_ms + floor_ms
            print(f"| {g.parent.name} | {nb_ms:.2f}, {nbytes / nb_ms / 1e6:.1f} | {floor_ms:.2f} | {best:.2f} "
                  f"| {1e3 / best:.1f} |")
    if a.sweep:
        k, n = (int(x) for x in a.sweep_shape.lower().split("x"))
        print(f"\nMatMulNBits [1, {k}] x [{k}, {n}], {a.sweep_copies} distinct weights per run "
              f"({a.sweep_copies * k * n / 2 / 2**20:,.0f} MiB of int4), {a.threads} threads:\n")
        print("| accuracy_level | block 32 | block 64 | block 128 | block 256 |")
        print("|---|---:|---:|---:|---:|")
        x = {"x": np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)}
        evict = eviction_buffer()
        for level in (4, 0):
            cells = []
            for block in (32, 64, 128, 256):
                s = session(sweep_model(k, n, block, level, a.sweep_copies), a.threads)
                us = ms_per_step(s, x, a.steps, a.repeats, evict) * 1e3 / a.sweep_copies
                cells.append(f"{us:.0f} µs, {k * n / 2 / us / 1e3:.1f} GB/s")
            print(f"| {level} | " + " | ".join(cells) + " |")
    print(f"\nother processes used {load.percent_of_a_core():.0f} % of a core meanwhile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
