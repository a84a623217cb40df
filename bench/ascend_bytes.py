#!/usr/bin/env python3
"""What CANN's fused NPU ops buy, on paper: nodes per decoder layer and bytes read per decode step and
per prefill chunk, counted from the Ascend graphs themselves. No speed is measured or claimed.

For each SoC — Ascend910B3 (every fusion in the recipe), Ascend310P3 (the ones its kernels allow),
Ascend310B1 (no kernels: all portable) — each model shape and each cache capacity P, the Ascend
conversion is driven in-process (`qwen2om.pipeline.run_pipeline`, as `qwen2om.convert` drives it) up
to the last pass before `write_onnx`, in three variants of the recipe:

- portable: recipes/ascend.yaml without fuse_moe_ascend, fuse_attention_ascend, fuse_norm_ascend and
  fuse_rope_ascend (a temporary recipe file, loaded as `convert --recipe FILE` loads it);
- fused: the bundled recipe as it ships (`--target ascend`); its decode attention stays portable;
- fused + decode attention: the bundled recipe with `fuse_attention_ascend: {decode: true}` (temporary file).

The SoC is the same within a row; a fusion whose kernel the SoC lacks leaves its region portable (the
passes log why; --json keeps those lines).

No weights are written or read. The graphs' nodes and shapes follow from config.json and the tensor
table alone: static_model builds on meta tensors and export_onnx traces without data. So each model is
a header-only checkpoint under WORKDIR: the synthetic writer's config files, tokenizer and shard plan
(qwen2om.fixtures.synthetic), each shard a real safetensors header followed by a hole the size of its
data (a sparse file: the real checkpoint's apparent size, a few MB on disk; copy it only with a
sparse-aware tool). check_weights, the one pass that reads tensor data (hashes, NaN scan), is left
out. The counts are therefore of every layer of the full published shapes, not extrapolated.
Exporting (the passes up to export_onnx, none of which reads the SoC) runs once per model and P; the
passes after it run on clones of those graphs for every SoC and variant.

Models: Qwen3-Coder-30B-A3B (the `qwen3-30b-a3b` preset: Qwen3-30B-A3B's config, whose shapes are the
Coder's; rope_theta and the position limit differ, which changes no graph shape here), Qwen3.5-35B-A3B
(the hybrid, 3 Gated DeltaNet : 1 full-attention layer), Qwen3-8B (dense, untied). fp16, batch 1,
prefill chunk T = 128.

Counting rules — bytes a node reads is the sum over its inputs of numel × element size from static
shapes (an input named twice counts twice), except:
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.resources
import json
import math
import os
import platform
import re
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import yaml

import qwen2om.passes  # noqa: F401  (registers the passes)
from qwen2om.checkpoint import INDEX_FILE, Checkpoint, ModelConfig
from qwen2om.convert import choose_recipe, preflight, read_config
from qwen2om.fixtures.synthetic import write_synthetic_checkpoint
from qwen2om.kernels.npu_attention import PFA
from qwen2om.npu_kernels import NPU_DOMAIN
from qwen2om.pipeline import PASSES, RunContext, StepReport, run_pipeline
from qwen2om.recipe import Recipe
from qwen2om.replicate import layer_kinds
from qwen2om.state import ConvertState

REPO = Path(__file__).resolve().parent.parent
GIB, MIB = 2**30, 2**20

MODELS = {  # key → (name in the tables, synthetic preset)
    "qwen3-coder-30b-a3b": ("Qwen3-Coder-30B-A3B", "qwen3-30b-a3b"),
    "qwen3.5-35b-a3b": ("Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
    "qwen3-8b": ("Qwen3-8B", "qwen3-8b"),
}
SOCS = ("Ascend910B3", "Ascend310P3", "Ascend310B1")
CAPACITIES = (4096, 32768)
CHUNK = 128
FUSIONS = ("fuse_moe_ascend", "fuse_attention_ascend", "fuse_norm_ascend", "fuse_rope_ascend")
VARIANTS = ("portable", "fused", "decode_attention")
VARIANT_NAMES = {"portable": "portable", "fused": "fused", "decode_attention": "fused + decode attn"}
STOP = "write_onnx"  # it and every pass after it write files; the graphs are final before it
SKIP = {"check_weights": "reads every shard's data (hashes, NaN scan); the header-only checkpoint has none"}
SHARED = ("weights", "bindings")  # not copied per variant: asserted unchanged (no int4 / FP8 weights here)

# -- counting rules ------------------------------------------------------------------------------------
VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size", "Constant"})
GATHERS = frozenset({"Gather", "GatherND", "GatherElements", "Slice"})
# Ops whose output shape is their inputs' broadcast: what a fusion pass may leave without a static shape.
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Greater", "GreaterOrEqual", "Less",
                         "LessOrEqual", "And", "Or", "Not", "Neg", "Cast", "Sigmoid", "Exp", "Sqrt", "Relu"})
RULES = (
    "Reshape, Squeeze, Unsqueeze, Flatten, Identity, Shape, Size, Constant read 0 bytes (views or metadata).",
    "Gather, GatherND, GatherElements, Slice read their output's bytes from the data input (only the rows "
    "taken: the embedding row, the routed experts' weights in the portable MoE) plus their index inputs "
    "(Slice: starts, ends, axes, steps).",
    "npu::NPUPromptFlashAttention reads query, atten_mask and both length inputs in full, and of key and value "
    "only the L + T slots of the S = T + P they hold (L = filled cache slots). L = P/2 (mid-conversation) "
    "unless a column says L = P − T (a full cache).",
    "Every other node, fused npu ops and unknown ops included, reads all of its inputs: "
    "Σ numel × element size (an input named twice counts twice).",
    "Shapes are the graph's static shapes (initializers: their declared shapes); the few a fusion pass leaves "
    "open (the attention mask's reordered columns) are inferred locally (Concat adds up its axis, elementwise "
    "ops broadcast).",
    "Per layer: the nodes named /model/layers.{i}/…, in a representative layer of each kind (the middle one "
    "of that kind; the notes list the layers that count otherwise). Per step / chunk: every node of the "
    "graph (embedding, layers, final norm, LM head, the shared RoPE table gathers and attention lengths).",
)
__doc__ = (__doc__ or "") + "".join(f"\n{i}. {rule}" for i, rule in enumerate(RULES, 1)) + """

Bytes read is not HBM traffic: ATC fuses elementwise chains, keeps small tensors on chip and may fold
a Transpose into the MatMul after it. It is a graph-level count, the same rules for every column.

    .venv/bin/python bench/ascend_bytes.py --json .cache/bench/ascend_bytes/result.json   # 4-5 min, < 1 GiB
    .venv/bin/python bench/ascend_bytes.py --quick    # Qwen3-8B, P = 4096, Ascend910B3 only
"""


class Sizes:
    """Static dims and byte sizes of graph values, with the local inference rule 5 describes."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[int, ...] | None] = {}
        self.unknown: set[str] = set()

    def dims(self, v: ir.Value) -> tuple[int, ...] | None:
        key = id(v)
        if key not in self.known:
            self.known[key] = None  # a cycle cannot happen in a graph, but stay finite if it did
            self.known[key] = self._dims(v)
        return self.known[key]

    def _dims(self, v: ir.Value) -> tuple[int, ...] | None:
        if v.shape is not None and all(isinstance(d, int) for d in v.shape):
            return tuple(int(d) for d in v.shape)  # type: ignore[arg-type]
        node = v.producer()
        if node is None or node.domain not in ("", "ai.onnx") or any(i is None for i in node.inputs):
            return None
        parts = [self.dims(i) for i in node.inputs]  # type: ignore[arg-type]
        if any(p is None for p in parts):
            return None
        if node.op_type == "Concat" and len({len(p) for p in parts}) == 1:  # type: ignore[arg-type]
            axis = node.attributes.get_int("axis", 0) % len(parts[0])  # type: ignore[arg-type]
            out = list(parts[0])  # type: ignore[arg-type]
            out[axis] = sum(p[axis] for p in parts)  # type: ignore[index]
            return tuple(out)
        if node.op_type in ELEMENTWISE:
            return tuple(int(d) for d in np.broadcast_shapes(*parts))  # type: ignore[arg-type]
        return None

    def nbytes(self, v: ir.Value | None, where: str) -> int:
        """numel × element size; 0, and the value noted as unknown, without a static shape or type."""
        if v is None:
            return 0
        dims = self.dims(v)
        if dims is None or v.dtype is None:
            self.unknown.add(f"{where}: {v.name}")
            return 0
        return math.prod(dims) * v.dtype.itemsize


def reads_nothing(node: ir.Node, sizes: Sizes, filled: int) -> int:
    """Rule 1: a view or a metadata op moves no tensor data."""
    return 0


def reads_gathered(node: ir.Node, sizes: Sizes, filled: int) -> int:
    """Rule 2: a gather or slice touches only what it returns (plus its indices), not the whole table."""
    indices = node.inputs[1:] if node.op_type == "Slice" else node.inputs[1:2]
    return sizes.nbytes(node.outputs[0], node.name or "") + sum(sizes.nbytes(v, node.name or "") for v in indices)


def reads_filled_cache(node: ir.Node, sizes: Sizes, filled: int) -> int:
    """Rule 3: PromptFlashAttention reads key/value slots below actual_seq_lengths_kv = L + T only (the T new
    tokens first, then the L filled cache slots; kernels/npu_attention.py); the rest of its inputs in full."""
    where = node.name or ""
    query, key, value = node.inputs[0], node.inputs[1], node.inputs[2]
    total = sum(sizes.nbytes(v, where) for i, v in enumerate(node.inputs) if i not in (1, 2))
    q_dims = sizes.dims(query) if query is not None else None
    tokens = q_dims[2] if q_dims is not None and len(q_dims) == 4 else 0
    for kv in (key, value):
        dims = sizes.dims(kv) if kv is not None else None
        if dims is None or len(dims) != 4:
            total += sizes.nbytes(kv, where)  # an unexpected layout: counted whole, as rule 4
            continue
        slots = min(dims[2], filled + tokens)
        total += sizes.nbytes(kv, where) // dims[2] * slots
    return total


def reads_inputs(node: ir.Node, sizes: Sizes, filled: int) -> int:
    """Rule 4: everything else, the NPU's fused ops included, reads each of its inputs once."""
    return sum(sizes.nbytes(v, node.name or "") for v in node.inputs)


def rule_for(node: ir.Node) -> Callable[[ir.Node, Sizes, int], int]:
    standard = node.domain in ("", "ai.onnx")
    if standard and node.op_type in VIEWS:
        return reads_nothing
    if standard and node.op_type in GATHERS:
        return reads_gathered
    if node.domain == NPU_DOMAIN and node.op_type == PFA:
        return reads_filled_cache
    return reads_inputs


# -- counting a graph ------------------------------------------------------------------------------------
LAYER = re.compile(r"^/model/layers\.(\d+)/")


def op_key(node: ir.Node) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def count_graph(model: ir.Model, layers: int, fills: dict[str, int]) -> dict[str, Any]:
    """Nodes and bytes read, per layer and for the whole graph, at each cache fill L in `fills` (label → L)."""
    sizes = Sizes()
    layer_nodes = [0] * layers
    layer_ops: list[Counter[str]] = [Counter() for _ in range(layers)]
    layer_op_bytes: list[Counter[str]] = [Counter() for _ in range(layers)]  # at the first fill
    layer_bytes = {label: [0] * layers for label in fills}
    total = dict.fromkeys(fills, 0)
    outside: dict[str, int] = {}  # scope → bytes, at the first fill (none of it depends on L)
    first = next(iter(fills))
    nodes = 0
    for node in model.graph:
        nodes += 1
        rule = rule_for(node)
        m = LAYER.match(node.name or "")
        for label, filled in fills.items():
            n = rule(node, sizes, filled)
            total[label] += n
            if m:
                layer_bytes[label][int(m.group(1))] += n
                if label == first:
                    layer_op_bytes[int(m.group(1))][op_key(node)] += n
            elif label == first:
                scope = "/".join((node.name or "/?").split("/")[:3]) if (node.name or "").startswith("/model/") \
                    else "/" + ((node.name or "/?").split("/")[1] or "?")
                outside[scope] = outside.get(scope, 0) + n
        if m:
            layer_nodes[int(m.group(1))] += 1
            layer_ops[int(m.group(1))][op_key(node)] += 1
    return {"nodes": nodes, "layer_nodes": layer_nodes, "layer_ops": [dict(sorted(c.items())) for c in layer_ops],
            "layer_op_bytes": [dict(sorted(c.items())) for c in layer_op_bytes],
            "layer_bytes": layer_bytes, "bytes": total, "outside_layers": dict(sorted(outside.items())),
            "unknown_inputs": sorted(sizes.unknown)}


# -- the header-only checkpoint ----------------------------------------------------------------------
def header_only_checkpoint(workdir: Path, preset: str) -> Path:
    """The preset's checkpoint (all layers) with headers and config files but no tensor data, cached."""
    dest = workdir / f"ckpt-{preset}-headers"
    if (dest / INDEX_FILE).is_file():  # written last: present means complete
        return dest
    return write_synthetic_checkpoint(preset, dest, header_only=True)


# -- recipes -------------------------------------------------------------------------------------------
def step_name(step: str | dict[str, Any]) -> str:
    return step if isinstance(step, str) else next(iter(step))


def variant_recipes(dest: Path) -> tuple[dict[str, str | None], list[str]]:
    """Variant → recipe for convert's `recipe` argument (None: the target's bundled one), and the fusion
    passes the bundled recipe has (those missing are absent from every variant alike)."""
    text = (importlib.resources.files("qwen2om.recipes") / "ascend.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    steps: list[str | dict[str, Any]] = data["pipeline"]
    present = [s for s in FUSIONS if any(step_name(x) == s for x in steps)]

    def with_decode(step: str | dict[str, Any]) -> str | dict[str, Any]:
        if step_name(step) != "fuse_attention_ascend":
            return step
        args = step.get("fuse_attention_ascend") if isinstance(step, dict) else None
        return {"fuse_attention_ascend": {**(args or {}), "decode": True}}

    dest.mkdir(parents=True, exist_ok=True)
    recipes: dict[str, str | None] = {"fused": None}
    for variant, pipeline in (("portable", [s for s in steps if step_name(s) not in FUSIONS]),
                              ("decode_attention", [with_decode(s) for s in steps])):
        path = dest / f"ascend-{variant.replace('_', '-')}.yaml"
        path.write_text(f"# bench/ascend_bytes.py: recipes/ascend.yaml, {VARIANT_NAMES[variant]}\n"
                        + yaml.safe_dump({**data, "pipeline": pipeline}, sort_keys=False))
        recipes[variant] = str(path)
    return recipes, present


def graph_steps(r: Recipe) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, dict[str, Any]]], list[str]]:
    """The recipe's passes up to the graphs' final form: (through export_onnx, after it, left out with why)."""
    names = [n for n, _ in r.pipeline]
    kept, left = [], []
    for name, args in r.pipeline[:names.index(STOP) if STOP in names else len(names)]:
        if name in SKIP:
            left.append(f"{name}: {SKIP[name]}")
        elif name not in PASSES.names():  # a pass a colleague is still writing: absent from every variant
            left.append(f"{name}: not registered in this tree")
        else:
            kept.append((name, args))
    cut = [n for n, _ in kept].index("export_onnx") + 1
    return kept[:cut], kept[cut:], left


# -- conversion ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Exported:
    """One export (model, P), shared by every SoC and variant."""

    config: ModelConfig
    recipe: Recipe
    head: list[tuple[str, dict[str, Any]]]
    state: ConvertState
    opened: Checkpoint | None
    seconds: float


def settings(soc: str, p: int, t: int) -> dict[str, Any]:
    return {"target": "ascend", "soc_version": soc, "max_seq_len": p, "prefill_chunk": t}


def export(ckpt: Path, model: str, recipe: str | None, soc: str, p: int, t: int, stage: Path) -> Exported:
    t0 = time.perf_counter()
    config = read_config(ckpt)
    r = choose_recipe(config, recipe, settings(soc, p, t))
    head, _, _ = graph_steps(r)
    opened = preflight(config, r)
    state = ConvertState()
    ctx = RunContext(recipe=r, stage_dir=stage, source=ckpt, model=model, workers=1, opened_checkpoint=opened)
    run_pipeline(head, state, ctx)
    return Exported(config, r, head, state, opened, time.perf_counter() - t0)


def fork(state: ConvertState, tail: Sequence[str]) -> ConvertState:
    """A state for one variant: the graphs cloned, the other fields its passes change copied."""
    changed = {f for name in tail for f in PASSES.get(name).changes()} - {"graphs", *SHARED}
    copied = dataclasses.replace(state, facts=set(state.facts))
    copied.graphs = {kind: m.clone() for kind, m in (state.graphs or {}).items()}
    for field in changed:
        setattr(copied, field, copy.deepcopy(getattr(state, field)))
    return copied


def run_variant(base: Exported, ckpt: Path, model: str, recipe: str | None, soc: str, p: int, t: int,
                stage: Path) -> tuple[ConvertState, list[StepReport], list[str], Recipe]:
    r = choose_recipe(base.config, recipe, settings(soc, p, t))
    head, tail, _ = graph_steps(r)
    if head != base.head:  # the export is shared only where every variant's recipe exports alike
        raise SystemExit(f"{r.name}: its passes up to export_onnx differ from the shared export's ({head} vs "
                         f"{base.head})")
    logs: list[str] = []
    state = fork(base.state, [n for n, _ in tail])
    ctx = RunContext(recipe=r, stage_dir=stage, source=ckpt, model=model, workers=1, log=logs.append,
                     opened_checkpoint=base.opened)
    reports = run_pipeline(tail, state, ctx)
    if bad := [s.name for s in reports if s.modified and set(PASSES.get(s.name).changes()) & set(SHARED)]:
        raise SystemExit(f"{bad} changed the weights the variants share: this script assumes unquantised checkpoints")
    return state, reports, logs, r


def layer_groups(kinds: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault(k, []).append(i)
    return groups


def kind_label(kind: Hashable) -> str:
    attention, sparse = kind  # type: ignore[misc]
    what = {"linear_attention": "linear-attention", "full_attention": "full-attention"}.get(attention, "attention")
    return f"{what} + {'MoE' if sparse else 'dense MLP'}"


def measure(state: ConvertState, p: int, t: int) -> dict[str, Any]:
    """Both graphs counted; per layer kind: its representative layer and whether every layer of it agrees."""
    dims = state.checkpoint.dims  # type: ignore[union-attr]
    groups = layer_groups(layer_kinds(dims))
    out: dict[str, Any] = {}
    for kind, model in (state.graphs or {}).items():
        tokens = 1 if kind == "decode" else t
        counted = count_graph(model, dims.layers, {"L=P/2": p // 2, "L=P-T": p - tokens})
        by_kind = {}
        first = next(iter(counted["layer_bytes"].values()))
        for k, members in groups.items():
            rep = members[len(members) // 2]
            same = {(counted["layer_nodes"][i], *(counted["layer_bytes"][lb][i] for lb in counted["layer_bytes"]))
                    for i in members}
            by_kind[kind_label(k)] = {
                "layers": members, "representative": rep, "nodes": counted["layer_nodes"][rep],
                "bytes": {lb: v[rep] for lb, v in counted["layer_bytes"].items()},
                "ops": counted["layer_ops"][rep], "op_bytes": counted["layer_op_bytes"][rep],
                "uniform": len(same) == 1,
                # layer → (Δ nodes, Δ bytes at the first fill) for the layers that count unlike `rep`
                "differ": {i: [counted["layer_nodes"][i] - counted["layer_nodes"][rep],
                               first[i] - first[rep]]
                           for i in members if (counted["layer_nodes"][i], first[i]) != (counted["layer_nodes"][rep],
                                                                                         first[rep])},
            }
        out[kind] = {"tokens": tokens, "nodes": counted["nodes"], "bytes": counted["bytes"],
                     "outside_layers": counted["outside_layers"], "layer_kinds": by_kind,
                     "layer_nodes": counted["layer_nodes"], "layer_bytes": counted["layer_bytes"],
                     "unknown_inputs": counted["unknown_inputs"]}
    return out


# -- rendering ------------------------------------------------------------------------------------------------
def size(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.1f} MiB"


def change(n: int, base: int) -> str:
    if n == base:
        return f"{size(n)} (=)"
    rel = (n - base) / base
    shown = f"{rel:+.2%}" if abs(rel) < 0.001 else f"{rel:+.1%}"  # −0.03%, not a −0.0% that reads as nothing
    return f"{size(n)} ({shown.replace('-', '−')})"


def rows_for(run: dict[str, Any], kind: str) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """(scope label, variant → {nodes, bytes}) for each layer kind, then the whole graph."""
    variants = run["variants"]
    first = variants["portable"]["graphs"][kind]
    rows = []
    for label, info in first["layer_kinds"].items():
        scope = f"{label} layer (×{len(info['layers'])})"
        rows.append((scope, {v: {"nodes": variants[v]["graphs"][kind]["layer_kinds"][label]["nodes"],
                                 "bytes": variants[v]["graphs"][kind]["layer_kinds"][label]["bytes"]}
                             for v in variants}))
    whole = "decode step" if kind == "decode" else f"prefill chunk (T = {first['tokens']})"
    layers = len(first["layer_nodes"])
    rows.append((f"**{whole}** ({layers} layers + embedding, final norm, LM head)",
                 {v: {"nodes": variants[v]["graphs"][kind]["nodes"], "bytes": variants[v]["graphs"][kind]["bytes"]}
                  for v in variants}))
    return rows


def render(result: dict[str, Any]) -> str:
    runs = result["runs"]
    out = ["### Bytes read per decode step (T = 1), and nodes", "",
           "| Model | P | SoC | Scope | Nodes portable | Nodes fused | Nodes fused + decode attn | Read portable "
           "| Read fused | Read fused + decode attn, L = P/2 | Read fused + decode attn, L = P − 1 |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for scope, v in rows_for(run, "decode"):
            base = v["portable"]["bytes"]["L=P/2"]
            dec = v["decode_attention"]
            out.append(f"| {run['model']} | {run['P']} | {run['soc']} | {scope} | {v['portable']['nodes']} "
                       f"| {v['fused']['nodes']} | {dec['nodes']} | {size(base)} "
                       f"| {change(v['fused']['bytes']['L=P/2'], base)} | {change(dec['bytes']['L=P/2'], base)} "
                       f"| {change(dec['bytes']['L=P-T'], base)} |")
    out += ["", f"### Bytes read per prefill chunk (T = {result['chunk']}), and nodes", "",
            "| Model | P | SoC | Scope | Nodes portable | Nodes fused | Read portable | Read fused, L = P/2 "
            "| Read fused, L = P − T |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        for scope, v in rows_for(run, "prefill"):
            base = v["portable"]["bytes"]["L=P/2"]
            out.append(f"| {run['model']} | {run['P']} | {run['soc']} | {scope} | {v['portable']['nodes']} "
                       f"| {v['fused']['nodes']} | {size(base)} | {change(v['fused']['bytes']['L=P/2'], base)} "
                       f"| {change(v['fused']['bytes']['L=P-T'], base)} |")
    out += ["", "### What each fusion pass fused (fused + decode attn variant, first P): fused / regions found",
            "", "| Model | SoC | " + " | ".join(result["fusions"]) + " |",
            "|---|---|" + "---|" * len(result["fusions"])]
    seen = set()
    for run in runs:
        if (run["model"], run["soc"]) in seen:
            continue
        seen.add((run["model"], run["soc"]))
        stats = run["variants"]["decode_attention"]["passes"]
        out.append(f"| {run['model']} | {run['soc']} | "
                   + " | ".join(fusion_cell(stats.get(name, {})) for name in result["fusions"]) + " |")
    out += ["", footer(result)]
    return "\n".join(out)


def fusion_cell(stats: dict[str, Any]) -> str:
    """'decode a/b, prefill c/d' from a fusion pass's `<kind>_fused_<what>` / `<kind>_kept_<what>` stats."""
    parts = []
    for kind in ("decode", "prefill"):
        fused = sum(v for k, v in stats.items() if k.startswith(f"{kind}_fused_") and isinstance(v, int))
        kept = sum(v for k, v in stats.items() if k.startswith(f"{kind}_kept_") and isinstance(v, int))
        parts.append(f"{kind} {fused}/{fused + kept}" if fused + kept else f"{kind} —")
    return ", ".join(parts)


def edge_layers(runs: list[dict[str, Any]]) -> str:
    """Which layers count unlike their kind's representative (the step and chunk rows include them as they are)."""
    per_model: dict[str, dict[int, float]] = {}
    for run in runs:
        for var in run["variants"].values():
            for g in var["graphs"].values():
                for info in g["layer_kinds"].values():
                    rep = next(iter(info["bytes"].values()))
                    for layer, (_, d_bytes) in info["differ"].items():
                        worst = per_model.setdefault(run["model"], {})
                        worst[int(layer)] = max(worst.get(int(layer), 0.0), abs(d_bytes) / rep)
    if not per_model:
        return "every layer of a kind counts the same as its representative"
    return "layers that count unlike their kind's representative (layer 0 holds the RoPE tables' shared ops, and " \
        "its input norm has no residual Add to fuse; in prefill the last layer's residual Add stays, the final norm " \
        "reading the last position only): " + "; ".join(
            f"{model}: layer{'s' if len(w) > 1 else ''} {', '.join(map(str, sorted(w)))} (at most "
            f"{max(w.values()):.2%} of a layer's bytes)" for model, w in per_model.items())


def footer(result: dict[str, Any]) -> str:
    lines = ["Counted from the graphs the Ascend recipe produces (every layer of the published shapes, exported "
             "from header-only checkpoints: no weights), fp16, batch 1. Portable = recipes/ascend.yaml without "
             f"{', '.join(FUSIONS)}; fused = the bundled recipe; fused + decode attn = the bundled recipe with "
             "`fuse_attention_ascend: {decode: true}`. Same SoC within a row. Percentages: change against "
             "portable. Bytes read are not HBM traffic and no speed is claimed: nothing here ran on an NPU.", "",
             "Rules:"]
    lines += [f"{i}. {rule}" for i, rule in enumerate(RULES, 1)]
    notes = []
    if missing := [f for f in FUSIONS if f not in result["fusions"]]:
        notes.append(f"not in recipes/ascend.yaml when this ran (absent from every variant): {', '.join(missing)}")
    notes += sorted(set(result["left_out"]))
    unknown = sum(len(g["unknown_inputs"]) for run in result["runs"] for v in run["variants"].values()
                  for g in v["graphs"].values())
    notes.append(f"inputs without a static shape or type (counted as 0 bytes): {unknown}")
    problems = [v["passes"]["check_ascend"].get("problems") for run in result["runs"] for v in run["variants"].values()
                if "check_ascend" in v["passes"]]
    if problems:
        notes.append(f"every graph counted went through check_ascend (the ATC legality checker): "
                     f"{sum(p or 0 for p in problems)} problems in {len(problems)} runs")
    notes.append(edge_layers(result["runs"]))
    lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    lines += ["", f"Run: {result['seconds']:.0f} s, peak RSS {result['peak_rss_bytes'] / GIB:.2f} GiB, "
              f"{result['machine']}; `{result['command']}`."]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)), help="cache capacities P")
    ap.add_argument("--socs", default=",".join(SOCS))
    ap.add_argument("--prefill-chunk", type=int, default=CHUNK)
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B, P = 4096, Ascend910B3 only")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench" / "ascend_bytes")
    ap.add_argument("--json", type=Path, help="write every number here")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.capacities, a.socs = "qwen3-8b", "4096", SOCS[0]
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    if unknown := [m for m in a.models if m not in MODELS]:
        ap.error(f"unknown model(s) {unknown} (known: {', '.join(MODELS)})")
    a.capacities = [int(p) for p in a.capacities.split(",")]
    a.socs = [s.strip() for s in a.socs.split(",") if s.strip()]
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    runs: list[dict[str, Any]] = []
    left_out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ascend-bytes-") as tmp:
        recipes, present = variant_recipes(Path(tmp) / "recipes")
        for key in a.models:
            name, preset = MODELS[key]
            t0 = time.perf_counter()
            ckpt = header_only_checkpoint(a.workdir, preset)
            say(f"{name}: header-only checkpoint {ckpt} ({time.perf_counter() - t0:.1f} s)")
            for p in a.capacities:
                stage = Path(tmp) / "stage"
                stage.mkdir(exist_ok=True)
                base = export(ckpt, preset, recipes["fused"], a.socs[0], p, a.prefill_chunk, stage)
                left_out += graph_steps(base.recipe)[2]
                say(f"  P={p}: exported in {base.seconds:.1f} s")
                try:
                    for soc in a.socs:
                        run: dict[str, Any] = {"model": name, "preset": preset, "P": p, "T": a.prefill_chunk,
                                               "soc": soc, "export_seconds": round(base.seconds, 1), "variants": {}}
                        for variant in VARIANTS:
                            t1 = time.perf_counter()
                            state, reports, logs, r = run_variant(base, ckpt, preset, recipes[variant], soc, p,
                                                                  a.prefill_chunk, stage)
                            run["variants"][variant] = {
                                "recipe": recipes[variant] and Path(recipes[variant]).name or r.name,
                                "pipeline": [n for n, _ in base.head] + [s.name for s in reports],
                                "passes": {s.name: s.stats for s in reports}, "log": sorted(set(logs)),
                                "graphs": measure(state, p, a.prefill_chunk),
                                "seconds": round(time.perf_counter() - t1, 1)}
                            del state
                            say(f"    {soc} {VARIANT_NAMES[variant]}: {time.perf_counter() - t1:.1f} s")
                        runs.append(run)
                finally:
                    if base.opened is not None:
                        base.opened.close()
                del base
    result = {
        "chunk": a.prefill_chunk, "fusions": present, "left_out": left_out, "rules": list(RULES), "runs": runs,
        "seconds": time.perf_counter() - t_start,
        # Linux reports ru_maxrss in KiB
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "python bench/ascend_bytes.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(render(result))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
