#!/usr/bin/env python3
"""MoE decode benchmark: qwen2om (ONNX Runtime) against transformers on Qwen3-30B-A3B or Qwen3.5-35B-A3B shapes.

What it does (artefacts cached under `--workdir`):

1. a synthetic bf16 checkpoint of the `--preset` (`decode.ensure_checkpoint`: random weights, the
   published shapes) with its layer count cut to `--layers`:
   - `qwen3-30b-a3b` (default): hidden 2048, 32 query / 4 K/V heads, 128 experts, top-8, expert
     intermediate 768, vocabulary 151,936, untied LM head; default 2 of 48 layers (one fp32 copy of
     the 48-layer model is ~114 GiB; 2 layers are 7.0 GiB);
   - `qwen3.5-35b-a3b` (qwen3_5_moe hybrid): hidden 2048, 3 Gated DeltaNet layers : 1 gated
     full-attention layer (16 query / 2 K/V heads of 256), 256 experts, top-8, expert intermediate
     512, a shared expert of 512, vocabulary 248,320, untied LM head; default 4 of 40 layers (one
     3:1 block: 16.3 GiB in fp32);
2. `qwen2om convert CKPT -o OUT --set max_seq_len=P --set prefill_chunk=T` in a child process:
   its wall time and peak RSS (`wait4`, that child only);
3. each runtime timed in a fresh child process on the same prompt ids, greedy, EOS ignored, one
   warm-up and the median of `--runs`, with the child's peak RSS:
   - qwen2om `Engine(out, threads=N).generate(...)`: prefill ms (time to first token) and decode
     tok/s = (N − 1) / decode wall time (`decode.bench_qwen2om`);
   - transformers `AutoModelForCausalLM` float32, `attn_implementation="eager"` and
     `experts_implementation="eager"` (the per-expert loop of the modelling file; for the hybrid the
     gated delta rule is whatever transformers resolves, the torch fallback without `fla`): prefill ms =
     `generate(max_new_tokens=1)`, decode tok/s = (N − 1) / (t_N − t_1); optionally also the
     library defaults (`--transformers eager,default`: sdpa attention, `grouped_mm` experts);
4. the greedy tokens of every runtime compared with qwen2om's; the 1-minute load average at the
   start of every timing (the machine is shared);
5. a markdown table and the facts (`--json PATH` for every number).

With `--int4`: `qwen2om calibrate CKPT --method rtn` (data-free, group 128; every expert on its own),
converted with the bundled recipe (attention linears MatMulNBits; each layer's experts int4 in one
`com.microsoft::QMoE`, the checkpoint's bytes as stored), and timed the same way. By default the
fp32 model is also converted without `fuse_moe` (`--no-portable` skips it): the standard-op form.

    .venv/bin/python bench/moe_decode.py --layers 2 --json .cache/bench/moe/result.json
    .venv/bin/python bench/moe_decode.py --preset qwen3.5-35b-a3b --int4 --no-portable \
        --workdir .cache/bench/hybrid --json .cache/bench/hybrid/result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from decode import REPO, agreement, bench_qwen2om, ensure_checkpoint, gib, make_prompt, median_of, run_child

# preset -> default layer count (what fits ~23 GiB next to transformers' fp32 copy)
PRESETS = {"qwen3-30b-a3b": 2, "qwen3.5-35b-a3b": 4}
FP32 = 4
INT4_NOTE = "not timed (--int4 times it: RTN-calibrated, experts int4 in QMoE)"
# transformers configurations by name: (attn_implementation, experts_implementation); None = library default
TRANSFORMERS = {"eager": ("eager", "eager"), "default": (None, None)}


@dataclasses.dataclass
class Timing:
    """One runtime's numbers; `error` is set (and the numbers are None) when its child failed."""

    name: str
    decode_tps: float | None = None
    prefill_ms: float | None = None
    load_s: float | None = None
    peak_rss_bytes: int = 0
    loadavg_1m: float = 0.0
    wall_s: float = 0.0
    note: str = ""
    error: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    # Memory in use after a generation, model still loaded: RSS counts a page mapped twice twice (ORT
    # maps the data file per initializer and per session), PSS once; anonymous = not file-backed.
    pss_bytes: int = 0
    anon_bytes: int = 0


def memory_now() -> tuple[int, int]:
    """(Pss, Anonymous) bytes of this process from /proc/self/smaps_rollup; (0, 0) where there is none."""
    try:
        rows = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    except OSError:
        return 0, 0
    return (int(rows["Pss"].split()[0]) * 1024, int(rows["Anonymous"].split()[0]) * 1024)


# -- children ---------------------------------------------------------------------------------
def child_qwen2om(spec: dict[str, Any]) -> Timing:
    t0 = time.perf_counter()
    from qwen2om.runtime.standalone import Engine, Sampling

    Engine(Path(spec["out"]), threads=spec["threads"])  # session load alone, timed once
    load = time.perf_counter() - t0
    row, _ = bench_qwen2om(Path(spec["out"]), spec["ids"], spec["new_tokens"], spec["threads"], spec["runs"])
    engine = Engine(Path(spec["out"]), threads=spec["threads"])  # once more, untimed: its memory after a generation
    engine.generate(spec["ids"], max_new_tokens=spec["new_tokens"], sampling=Sampling(0.0), ignore_eos=True)
    pss, anon = memory_now()
    return Timing(spec["name"], row.decode_tps, row.ttft_ms, load, tokens=row.tokens, pss_bytes=pss, anon_bytes=anon)


def child_transformers(spec: dict[str, Any]) -> Timing:
    """`decode.bench_transformers` with the experts implementation chosen too (transformers 5
    defaults to `grouped_mm` experts and sdpa attention)."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    attn, experts = TRANSFORMERS[spec["config"]]
    kw = {k: v for k, v in (("attn_implementation", attn), ("experts_implementation", experts)) if v}
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32, **kw).eval()
    load = time.perf_counter() - t0
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id)
    ids, n = spec["ids"], spec["new_tokens"]
    input_ids = torch.tensor([ids], dtype=torch.long)
    mask = torch.ones_like(input_ids)
    last: list[int] = []
    rates: list[float] = []

    class Stamps(transformers.generation.streamers.BaseStreamer):  # type: ignore[misc]
        """generate() hands the streamer the prompt, then each new token as it is chosen."""

        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: Any) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    def timed(k: int) -> float:
        nonlocal last
        stamps = Stamps()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                                 min_new_tokens=k, streamer=stamps)
        dt = time.perf_counter() - t
        if out.shape[1] != len(ids) + k:
            raise SystemExit(f"transformers generated {out.shape[1] - len(ids)} tokens, expected {k}")
        last = out[0, len(ids):].tolist()
        if k > 1:  # first new token to last: the k - 1 decode steps of this very run
            rates.append((k - 1) / (stamps.t[-1] - stamps.t[1]))
        return dt

    t1 = median_of(spec["runs"], lambda: timed(1))
    median_of(spec["runs"], lambda: timed(n))  # fills `rates`
    # Decode steps timed inside each run (as qwen2om's), not (N-1)/(t_N - t_1) of two medians: with a
    # prefill that varies by seconds on a busy machine, that difference swung 1.3-9 tok/s here.
    tps = statistics.median(rates[-spec["runs"]:])
    impl = (f"attention {model.config._attn_implementation}, experts "
            f"{model.config._experts_implementation}")
    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        impl += f", gated delta rule {gated_delta_rule_impl()}"
    pss, anon = memory_now()
    return Timing(f"transformers {spec['config']}", tps, t1 * 1000, load, note=impl, tokens=last, pss_bytes=pss,
                  anon_bytes=anon)


def gated_delta_rule_impl() -> str:
    """What transformers' hybrid modelling files run for the gated delta rule: `fla`'s kernels when
    that package imports (and causal-conv1d's for the convolution), else their pure-torch fallback."""
    import importlib.util

    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    return ("fla" if fla else "torch fallback") + (", causal-conv1d" if conv else "")


def child_main(spec_json: str) -> int:
    """`--child SPEC`: time one runtime; the Timing (or the error) goes to spec["result"]."""
    spec = json.loads(spec_json)
    try:
        t = child_qwen2om(spec) if spec["kind"] == "qwen2om" else child_transformers(spec)
    except Exception as exc:  # recorded in the table; the other runtimes still get measured
        t = Timing(spec["name"], error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(t)))
    return 0


def time_in_child(spec: dict[str, Any]) -> Timing:
    loadavg = os.getloadavg()[0]
    print(f"timing {spec['name']} (1-min load average {loadavg:.2f}) ...", file=sys.stderr, flush=True)
    child = run_child([sys.executable, __file__, "--child", json.dumps(spec)])
    result = Path(spec["result"])
    if child.returncode or not result.is_file():
        t = Timing(spec["name"], error=f"child exited {child.returncode}")
    else:
        t = Timing(**json.loads(result.read_text()))
    t.peak_rss_bytes, t.loadavg_1m, t.wall_s = child.peak_rss_bytes, loadavg, child.wall_s
    return t


# -- arithmetic -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoeFacts:
    """Sizes and work of the MoE layers, from config.json (fp32 bytes)."""

    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    layers: int
    vocab: int
    mixer_params: int  # attention (q, k, v, o) or Gated DeltaNet projections, all layers
    shared_params: int = 0  # shared expert (gate, up, down), all layers
    linear_layers: int = 0  # Gated DeltaNet layers among `layers`

    @property
    def expert_bytes(self) -> int:  # gate + up + down of one expert
        return 3 * self.hidden * self.moe_intermediate * FP32

    @property
    def gate_up_stack_bytes(self) -> int:  # [E, H, 2I]
        return self.experts * self.hidden * 2 * self.moe_intermediate * FP32

    @property
    def down_stack_bytes(self) -> int:  # [E, I, H]
        return self.experts * self.moe_intermediate * self.hidden * FP32

    def decode_bytes(self) -> dict[str, int]:
        """Weights one decode step reads (not counted: K/V cache, norms, router, embedding row)."""
        mixer = "attention + linear attention" if self.linear_layers else "attention"
        shared = {"shared experts": self.shared_params * FP32} if self.shared_params else {}
        return {"routed experts": self.layers * self.top_k * self.expert_bytes,
                mixer: self.mixer_params * FP32, **shared,
                "lm_head": self.vocab * self.hidden * FP32}

    def prefill_gflop(self, t: int) -> tuple[float, float]:
        """(dense formulation, routed work) GFLOP of the experts for one chunk of `t` tokens, all layers."""
        per_expert_token = 2 * 3 * self.hidden * self.moe_intermediate
        return (self.layers * self.experts * t * per_expert_token / 1e9,
                self.layers * self.top_k * t * per_expert_token / 1e9)


def moe_facts(ckpt: Path) -> MoeFacts:
    """From config.json (the text model's, for the Qwen3.5 wrapper); hybrids count each layer's mixer
    by its kind: gated attention's q_proj is twice as wide (query ‖ gate)."""
    c = json.loads((ckpt / "config.json").read_text())
    c = c.get("text_config", c)
    h, n = c["hidden_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    full = h * q * (2 if c.get("attn_output_gate") else 1) + 2 * h * kv + q * h
    kinds = c.get("layer_types") or ["full_attention"] * n
    linear = kinds.count("linear_attention")
    if linear:
        k_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        v_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
        # in_proj_qkv, in_proj_z, in_proj_a + in_proj_b, out_proj
        per_linear = h * (2 * k_dim + v_dim) + h * v_dim + 2 * h * c["linear_num_value_heads"] + v_dim * h
    else:
        per_linear = 0
    shared = 3 * h * c.get("shared_expert_intermediate_size", 0) * n
    return MoeFacts(c["num_experts"], c["num_experts_per_tok"], h, c["moe_intermediate_size"], n, c["vocab_size"],
                    (n - linear) * full + linear * per_linear, shared, linear)


# -- report -----------------------------------------------------------------------------------
def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[Timing], ref: list[int]) -> str:
    base = next((r.decode_tps for r in rows if r.name == "transformers eager" and r.decode_tps), None)
    lines = ["| | decode tok/s | prefill ms | vs transformers eager | peak RSS GiB | load avg (1 min) "
             "| greedy tokens = qwen2om |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = f"{r.name} ({r.note})" if r.note and not r.error else r.name
        if r.error or r.decode_tps is None:
            rss = r.peak_rss_bytes / 2**30 if r.peak_rss_bytes else None
            load = fmt(r.loadavg_1m or None, ".2f")
            lines.append(f"| {r.name} | {r.error or r.note} | | | {fmt(rss, '.2f')} | {load} | |")
            continue
        vs = f"{r.decode_tps / base:.2f}×" if base else "—"
        same = "—" if r.name.startswith("qwen2om") else \
            f"{sum(a == b for a, b in zip(r.tokens, ref, strict=False))}/{len(ref)}"
        lines.append(f"| {name} | {r.decode_tps:.2f} | {fmt(r.prefill_ms, ',.0f')} | {vs} | "
                     f"{r.peak_rss_bytes / 2**30:.2f} | {r.loadavg_1m:.2f} | {same} |")
    return "\n".join(lines)


def bundled_recipe(work: Path, name: str, edit: dict[str, str | None]) -> Path:
    """recipes/ort.yaml with pipeline steps replaced by name, or dropped (None)."""
    lines = []
    for line in (REPO / "recipes" / "ort.yaml").read_text().splitlines(True):
        step = line.strip().removeprefix("- ").split(":")[0].split()[0] if line.strip().startswith("- ") else None
        if step in edit:
            if edit[step] is not None:
                lines.append(f"  - {edit[step]}\n")
            continue
        lines.append(line)
    path = work / f"{name}.yaml"
    path.write_text("".join(lines))
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b",
                    help="synthetic checkpoint shapes (qwen2om.fixtures.synthetic)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 for qwen3-30b-a3b of "
                    "48 published, 4 for qwen3.5-35b-a3b of 40: one 3 linear : 1 full attention block)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (128 = one prefill chunk)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=512, help="compiled KV cache capacity P")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="T of the prefill graph")
    ap.add_argument("--threads", type=int, default=0, help="ORT and torch intra-op threads (0: all cores)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    ap.add_argument("--transformers", default="eager",
                    help="comma-separated transformers configurations: eager, default (empty: none)")
    ap.add_argument("--reuse-conversion", action="store_true", help="keep an existing conversion (not timed)")
    ap.add_argument("--portable", action=argparse.BooleanOptionalAction, default=True,
                    help="also convert and time the recipe without fuse_moe (experts in standard ONNX ops)")
    ap.add_argument("--int4", action="store_true", help="also calibrate (RTN, data-free) and time a W4A16 model "
                    "whose experts stay int4 in the graph")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.layers = a.layers or PRESETS[a.preset]
    if a.child is None:
        if a.new_tokens < 2:
            ap.error("--new-tokens must be at least 2 (decode speed is measured over N - 1 steps)")
        if a.prompt_tokens + a.new_tokens > a.max_seq_len:
            ap.error("--prompt-tokens + --new-tokens must fit --max-seq-len")
        if unknown := [c for c in a.transformers.split(",") if c and c not in TRANSFORMERS]:
            ap.error(f"unknown transformers configuration {unknown} (known: {', '.join(TRANSFORMERS)})")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a.child)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = a.threads or cores
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt, writer = ensure_checkpoint(a.workdir, a.preset, a.layers, a.seed)
    work = a.workdir / "moe"
    work.mkdir(exist_ok=True)
    out = work / f"onnx-{ckpt.name}-P{a.max_seq_len}-T{a.prefill_chunk}"

    shape = ["--set", f"max_seq_len={a.max_seq_len}", "--set", f"prefill_chunk={a.prefill_chunk}", "--force"]

    def qwen2om(*cmd: str) -> Any:
        print(f"$ qwen2om {' '.join(cmd)} (1-min load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        run = run_child([sys.executable, "-m", "qwen2om", *cmd])
        if run.returncode:
            raise SystemExit(f"{cmd[0]} failed (exit {run.returncode})")
        print(f"  {cmd[0]}: {run.wall_s:.1f} s, peak RSS {gib(run.peak_rss_bytes)}", file=sys.stderr)
        return run

    def reuse(path: Path) -> bool:
        return a.reuse_conversion and (path / "manifest.json").is_file()

    conv = None if reuse(out) else qwen2om("convert", str(ckpt), "-o", str(out), *shape)
    onnx_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())

    ids = make_prompt(ckpt / "tokenizer.json", a.prompt_tokens)
    common = {"ids": ids, "new_tokens": a.new_tokens, "runs": a.runs, "threads": threads}
    rows = [time_in_child({**common, "kind": "qwen2om", "name": "qwen2om ORT fp32 (experts: com.microsoft MoE)",
                           "out": str(out), "result": str(work / "timing-qwen2om.json")})]
    if a.portable:
        out_p = work / f"onnx-portable-{ckpt.name}-P{a.max_seq_len}-T{a.prefill_chunk}"
        if not reuse(out_p):
            qwen2om("convert", str(ckpt), "-o", str(out_p), "--recipe",
                    str(bundled_recipe(work, "qwen3-fp32-portable", {"fuse_moe": None})), *shape)
        rows.append(time_in_child({**common, "kind": "qwen2om", "out": str(out_p),
                                   "name": "qwen2om ORT fp32 (experts: portable standard ops)",
                                   "result": str(work / "timing-qwen2om-portable.json")}))
    if a.int4:
        w4, out4 = work / f"w4-rtn-{ckpt.name}", work / f"onnx-w4-{ckpt.name}-P{a.max_seq_len}-T{a.prefill_chunk}"
        if not reuse(out4):  # the bundled recipe: attention MatMulNBits, experts int4 in com.microsoft::QMoE
            if not (w4 / "config.json").is_file():
                qwen2om("calibrate", str(ckpt), "-o", str(w4), "--method", "rtn", "--force")
            qwen2om("convert", str(w4), "-o", str(out4), *shape)
        rows.append(time_in_child({**common, "kind": "qwen2om", "name": "qwen2om ORT int4 (RTN g128; experts: "
                                   "com.microsoft QMoE)", "out": str(out4),
                                   "result": str(work / "timing-qwen2om-w4.json")}))
    else:
        rows.append(Timing("qwen2om ORT int4", note=INT4_NOTE))
    for cfg in filter(None, a.transformers.split(",")):
        rows.append(time_in_child({**common, "kind": "transformers", "name": f"transformers {cfg}", "config": cfg,
                                   "ckpt": str(ckpt), "result": str(work / f"timing-transformers-{cfg}.json")}))
    ref = rows[0].tokens

    f = moe_facts(ckpt)
    from qwen2om.fixtures.synthetic import resolve_preset

    published = resolve_preset(a.preset).layers
    kinds = json.loads((ckpt / "config.json").read_text())
    kinds = kinds.get("text_config", kinds).get("layer_types")
    dense, routed = f.prefill_gflop(a.prefill_chunk)
    need = f.decode_bytes()
    import onnxruntime as ort
    import torch
    import transformers

    pattern = f" ({', '.join(k.removesuffix('_attention') for k in kinds)})" if kinds else ""
    print(f"\n## {a.preset} shapes, {f.layers} of {published} layers{pattern}, prompt {a.prompt_tokens} tokens, "
          f"{a.new_tokens} new tokens, P={a.max_seq_len}, T={a.prefill_chunk}, {threads} threads, median of {a.runs}\n")
    print(table(rows, ref))
    print()
    facts = [
        "conversion (`qwen2om convert`, fp32): "
        + (f"{conv.wall_s:.1f} s wall incl. imports, peak RSS {gib(conv.peak_rss_bytes)}"
           if conv else "reused (not timed)")
        + f"; output {gib(onnx_bytes)} on disk",
        f"checkpoint: {ckpt.name}, {gib(sum(p.stat().st_size for p in ckpt.glob('*.safetensors')))} bf16"
        + (f", written in {writer.wall_s:.1f} s (writer peak RSS {gib(writer.peak_rss_bytes)})" if writer else ""),
        f"expert stacks per layer (fp32): gate_up [{f.experts}, {f.hidden}, {2 * f.moe_intermediate}] "
        f"{gib(f.gate_up_stack_bytes)} + down [{f.experts}, {f.moe_intermediate}, {f.hidden}] "
        f"{gib(f.down_stack_bytes)} = {gib(f.gate_up_stack_bytes + f.down_stack_bytes)}; one expert "
        f"{f.expert_bytes / 2**20:.1f} MiB; {published} layers: "
        f"{gib(published * (f.gate_up_stack_bytes + f.down_stack_bytes))}",
        "weights one decode step reads (fp32): " + ", ".join(f"{k} {gib(v)}" for k, v in need.items())
        + f" = {gib(sum(need.values()))} (K/V cache, recurrent states, router, norms not counted)",
        f"prefill, experts of one {a.prefill_chunk}-token chunk: dense formulation {dense:.1f} GFLOP vs routed "
        f"work {routed:.1f} GFLOP = E/k = {f.experts}/{f.top_k} = {dense / routed:.0f}x",
    ]
    for r in rows[1:]:
        if r.tokens:
            facts.append(f"greedy agreement qwen2om vs {r.name}: {agreement(ref, r.tokens)}, "
                         f"{sum(x == y for x, y in zip(ref, r.tokens, strict=False))}/{len(ref)} positions equal")
    facts += [
        "memory after a generation, model loaded (PSS, of which anonymous; peak RSS counts file pages "
        "mapped twice twice): " + ", ".join(f"{r.name} {gib(r.pss_bytes)} ({gib(r.anon_bytes)})"
                                            for r in rows if r.pss_bytes),
        "session / model load s: " + ", ".join(f"{r.name} {r.load_s:.1f}" for r in rows if r.load_s is not None),
        f"onnxruntime {ort.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{cores} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
        "shared machine: the load average column is the 1-minute average when each timing started",
    ]
    print("\n".join(f"- {x}" for x in facts))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "rows": [dataclasses.asdict(r) for r in rows],
            "conversion": dataclasses.asdict(conv) if conv else None,
            "onnx_bytes": onnx_bytes,
            "facts": {**dataclasses.asdict(f), "decode_bytes": need, "prefill_gflop_dense": dense,
                      "prefill_gflop_routed": routed},
            "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "threads": threads, "cores": cores,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
