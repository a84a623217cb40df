"""`qwen2om plan`: what a conversion would need on each device, from config.json and the safetensors
headers alone, and the pipeline stages (qwen2om/stages.py) it would split the model into.

Bytes are counted as the conversion stores them (the recipe's passes decide, see `Storage`):

- float tensors in the compute dtype (fp16 / fp32), the RoPE tables in float32;
- int4 (W4A16) weights as the target's lowering writes them: ONNX Runtime's MatMulNBits (uint8
  nibbles, scales in the compute dtype, uint8 zero points), Ascend 910B/910_93's
  WeightQuantBatchMatmulV2 (int32 words of eight, fp16 scales and offsets), Ascend 310P/310B's W8A16
  (one int8 per value); MoE experts int4 only where a pass keeps them so (ONNX Runtime's QMoE or
  `lower_int4: {experts: true}`), else dequantised into compute-dtype stacks at conversion;
- FP8 weights as e4m3fn bytes plus their float32 block scales where `lower_fp8` runs, experts only
  with `lower_fp8: {experts: true}` (else compute-dtype stacks).

Per decoder layer the device also holds its cache at capacity P × B: K and V for a full-attention
layer (2 × B × kv_heads × P × head_dim, compute dtype), the conv state (B × (K−1) × conv_dim, compute
dtype) and recurrent state (B × Hv × dk × dv, float32) for a linear-attention one.

Workspace (per stage, the same for every stage) is the peak working set of one prefill call of
T = prefill_chunk tokens, taken layer by layer (a layer's buffers are free before the next runs):
four [B, T, hidden] buffers (residual, normed input, attention output, MLP output) + the larger of
the attention step (projections + fp32 scores and compute-dtype probabilities [B, heads, T, P+T];
linear attention: projections + the chunked delta rule's fp32 [B, Hv, T, T+dk+dv]) and the MLP step
(dense: gate, up and product [B, T, intermediate]; MoE: every expert on every token in the portable
form [E, B·T, 3·I + hidden], or the decode gather of the top-k experts' weights, whichever is larger;
with ONNX Runtime's fused MoE top-k × B·T × 3·I), + the logits [B, T or 1, vocab] in the compute dtype
and float32, + the mask [B, 1, T, P+T], + the RoPE tables, + the float32 dequantisation of the largest
weight dequantised in the graph. It is an estimate of activations, not a measurement: the runtime's
own reserve (driver, ACL context, ATC's fused kernels' scratch) is not in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwen2om.arch import EMBED, ArchSpec, ModelDims, expected_tensors, quantizable
from qwen2om.errors import Qwen2omError, RecipeError
from qwen2om.families import QWEN_NAMES
from qwen2om.quant.schemes import SCHEMES, W4A16
from qwen2om.quantized import Fp8Weight, Int4Weight, QuantWeight
from qwen2om.stages import fewest_stages, gib, split_layers, stage_totals
from qwen2om.targets import TARGETS

if TYPE_CHECKING:
    from qwen2om.checkpoint import Checkpoint, ModelConfig
    from qwen2om.recipe import Recipe

GIB = 1 << 30
COMPUTE = {"fp16": ("float16", 2), "fp32": ("float32", 4)}
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# `--scheme`: what `calibrate` would write from a float checkpoint (qwen2om/quant/schemes.py defaults).
SCHEME_GROUP = 128  # w4a16: symmetric int4, groups of 128 along K
FP8_BLOCK = (128, 128)  # fp8-block: e4m3fn in 128×128 tiles


@dataclasses.dataclass(frozen=True)
class StageCosts:
    layers: list[int]  # bytes per decoder layer on the device: weights + KV cache / state at P × B
    first: int  # bytes only the first stage holds (embedding)
    last: int  # bytes only the last stage holds (final norm + LM head)
    workspace: int  # per-stage working memory estimate


# -- storage: how the recipe's passes store each weight ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Storage:
    """How the passes of one resolved recipe store weights on the device."""

    compute: str  # numpy name of the compute dtype
    itemsize: int
    int4: str  # nbits (ONNX Runtime MatMulNBits), wqbmm (Ascend 910B/910_93), w8a16 (Ascend 310P/310B), float
    int4_experts: str  # qmoe (ORT fuse_moe), stack (lower_int4 experts: true), float; "target": as `int4`
    # ("target" is no pass's: what-if figures for a lowering that does not exist, bench/plan_seed.py)
    fp8: str  # float8_e4m3fn or uint8 (lower_fp8's storage), float (no lower_fp8)
    fp8_experts: bool  # lower_fp8 {experts: true}
    fused_moe: bool  # ORT fuse_moe: routed experts grouped by expert (workspace ∝ top-k)

    @classmethod
    def of(cls, r: Recipe) -> Storage:
        compute, size = COMPUTE[r.dtype]
        args = {name: a for name, a in r.pipeline}
        int4 = "float"
        if "lower_int4" in args:
            int4 = "nbits"
        elif "lower_int4_ascend" in args:
            from qwen2om.ascend import soc_info

            int4 = "wqbmm" if soc_info(r.soc_version).w4a16 else "w8a16"
        experts = "float"
        if args.get("lower_int4", {}).get("experts"):
            experts = "stack"
        elif "fuse_moe" in args and args["fuse_moe"].get("quantized", True):
            experts = "qmoe"
        fp8 = "float"
        if "lower_fp8" in args:
            fp8 = "uint8" if args["lower_fp8"].get("storage", "float8") == "bytes" else "float8_e4m3fn"
        return cls(compute, size, int4, experts, fp8, bool(args.get("lower_fp8", {}).get("experts")),
                   "fuse_moe" in args)


def _add(into: Counter[str], dtype: str, n: int) -> None:
    if n:
        into[dtype] += int(n)


def stored_bytes(shape: tuple[int, ...], q: QuantWeight | None, expert: bool, s: Storage,
                 qmoe: bool = False) -> Counter[str]:
    """Bytes by dtype of one checkpoint tensor (a quantised one: all its storage) as converted.
    `qmoe`: its layer's experts qualify for ONNX Runtime's QMoE (fuse_moe.int4_experts)."""
    out: Counter[str] = Counter()
    numel = math.prod(shape)
    if isinstance(q, Int4Weight):
        n, k, groups = q.n, q.k, q.k // q.group
        form = (s.int4 if s.int4_experts == "target" else
                "qmoe" if s.int4_experts == "qmoe" and qmoe else
                "stack" if s.int4_experts == "stack" and q.symmetric and q.layout.packs_int32 else
                "float") if expert else s.int4
        if form == "nbits":  # MatMulNBits: B [N, K/g, g/2] uint8, scales [N·K/g] compute, zero points uint8
            _add(out, "uint8", n * k // 2)
            _add(out, s.compute, n * groups * s.itemsize)
            if q.has_zero_point:
                _add(out, "uint8", n * math.ceil(groups / 2))
            return out
        if form in ("qmoe", "stack"):  # packed nibbles [N, K/2]; scales compute (QMoE) or float32 (stack)
            _add(out, "uint8", n * k // 2)
            _add(out, s.compute if form == "qmoe" else "float32", n * groups * (s.itemsize if form == "qmoe" else 4))
            return out
        if form in ("wqbmm", "w8a16"):  # int32 [K, ⌈N/8⌉] or int8 [K, N]; fp16 scale [N, K/g] (+ offset)
            if form == "wqbmm":
                _add(out, "int32", k * math.ceil(n / 8) * 4)
            else:
                _add(out, "int8", k * n)
            _add(out, "float16", n * groups * 2 * (2 if q.has_zero_point else 1))
            return out
        _add(out, s.compute, n * k * s.itemsize)  # dequantised at conversion
        return out
    if isinstance(q, Fp8Weight):
        if s.fp8 != "float" and (not expert or s.fp8_experts):  # e4m3fn bytes + float32 block scales
            _add(out, s.fp8, q.n * q.k)
            _add(out, "float32", math.prod(q.scale_shape) * 4)
        else:
            _add(out, s.compute, q.n * q.k * s.itemsize)
        return out
    _add(out, s.compute, numel * s.itemsize)
    return out


# -- the model's bytes, part by part --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Every byte a conversion puts on the devices, by decoder layer and by what only the first / last
    stage holds, each by dtype; the caches per layer; the per-stage workspace and what it is made of."""

    layer_weights: list[dict[str, int]]
    layer_cache: list[int]
    cache_kind: list[str]  # "kv" (full attention) or "state" (linear attention), per layer
    first: dict[str, int]
    last: dict[str, int]
    workspace: dict[str, int]
    notes: list[str]
    shared: int = 0  # bytes in both `first` and `last` (a tied embedding): held once where one stage has both

    def costs(self) -> StageCosts:
        layers = [sum(w.values()) + c for w, c in zip(self.layer_weights, self.layer_cache, strict=True)]
        return StageCosts(layers=layers, first=sum(self.first.values()), last=sum(self.last.values()),
                          workspace=sum(self.workspace.values()))


class _Experts:
    """What fuse_moe.int4_experts reads of a checkpoint: its quantised weights and sizes."""

    def __init__(self, quantized: Mapping[str, QuantWeight], dims: ModelDims) -> None:
        self.quantized, self.dims = quantized, dims


def hypothetical(arch: ArchSpec, table: Mapping[str, tuple[int, ...]], scheme: str,
                 group: int = SCHEME_GROUP) -> dict[str, QuantWeight]:
    """The weights `calibrate --scheme` would quantise, as it would store them (w4a16: symmetric int4 in
    groups of `group`, compressed-tensors; fp8-block: e4m3fn in 128×128 tiles): every 2-D weight the
    architecture quantises (never embeddings, norms, routers, the LM head). A group that does not divide
    a weight's K is refused as calibrate refuses it."""
    if scheme not in SCHEMES.names():
        raise RecipeError(f"--scheme {scheme!r} is not one of {', '.join(SCHEMES.names())}")
    names = [n for n, shape in table.items() if len(shape) == 2 and quantizable(arch, n)]
    if SCHEMES.get(scheme) is W4A16:
        if bad := [(n, table[n][1]) for n in names if table[n][1] % group]:
            fits = [g for g in (16, 32, 64, 128, 256) if all(table[n][1] % g == 0 for n in names)]
            hint = f"plan with --group-size {max(fits)}" if fits else "no power-of-two group ≥ 16 fits every weight"
            raise RecipeError(f"--scheme w4a16: {bad[0][0]}: input width {bad[0][1]} is not a multiple of "
                              f"--group-size {group} ({len(bad)} weights are not), which calibrate refuses; {hint}")
        return {n: Int4Weight(n, *table[n], group, symmetric=True) for n in names}
    return {n: Fp8Weight(n, *table[n], FP8_BLOCK, n.removesuffix(".weight") + ".weight_scale_inv") for n in names}


def model_bytes(model: ModelConfig, r: Recipe, ckpt: Checkpoint | None = None, *,
                scheme: str | None = None, group: int = SCHEME_GROUP, storage: Storage | None = None) -> ModelBytes:
    """The bytes of `model` converted with the resolved recipe `r`, from its tensor table: `ckpt`'s
    (quantisation read from its headers) or, without one, the table its config implies, all float.
    `scheme`: count a float checkpoint's weights as `calibrate --scheme` would quantise them (calibrate
    writes MoE experts one tensor per expert, whatever the float layout). `storage`: in place of the one
    the recipe's passes imply (what-if figures)."""
    d, arch, s = model.dims, model.arch, storage or Storage.of(r)
    fused = ckpt.fused_experts if ckpt is not None and not scheme else False
    table = expected_tensors(arch, d, fused=fused)
    quantized: dict[str, QuantWeight] = dict(ckpt.quantized) if ckpt is not None else {}
    notes: list[str] = []
    if scheme:
        if quantized:
            kinds = sorted({q.kind for q in quantized.values()})
            raise RecipeError(f"--scheme {scheme}: this checkpoint is already quantised ({', '.join(kinds)}); "
                              "plan it as it is, without --scheme")
        quantized = hypothetical(arch, table, scheme, group)
        what = (f"symmetric int4 in groups of {group}, scales as the target stores them"
                if SCHEMES.get(scheme) is W4A16 else "e4m3fn in 128×128 tiles with float32 scales")
        notes.append(f"--scheme {scheme}: bytes estimated as if calibrated ({len(quantized)} weights {what}); "
                     "the checkpoint itself is float")
    qmoe = {i for i in d.sparse if s.int4_experts == "qmoe" and _qmoe_layer(quantized, d, i)}
    layers: list[Counter[str]] = [Counter() for _ in range(d.layers)]
    first: Counter[str] = Counter()
    last: Counter[str] = Counter()
    largest_dequant = 0
    for name, shape in table.items():
        q = quantized.get(name)
        m = LAYER.match(name)
        expert = QWEN_NAMES.is_expert_tensor(name)
        b = stored_bytes(shape, q, expert, s, qmoe=bool(m) and int(m.group(1)) in qmoe)
        if q is not None and not expert and (q.kind == "fp8" and s.fp8 != "float" or s.int4 == "w8a16"):
            largest_dequant = max(largest_dequant, q.n * q.k)
        if m:
            layers[int(m.group(1))].update(b)
        elif name == EMBED:
            first.update(b)
            if d.tied:  # one table: the embedding's Gather on the first stage, the LM head's MatMul on the last
                last.update(b)
        else:  # the final norm, the LM head
            last.update(b)
    kinds = ["state" if d.is_linear(i) else "kv" for i in range(d.layers)]
    cache = [cache_bytes(d, r, i) for i in range(d.layers)]
    if any(q.kind == "int4" for q in quantized.values()):
        if s.int4 == "w8a16":
            notes.append(f"{r.soc_version} has no int4 matmul an ONNX graph reaches: int4 weights are counted as "
                         "W8A16 (int8 storage, twice int4's bytes), which convert writes with "
                         "--set weight_storage=int8")
        if d.sparse and (s.int4_experts == "float" or (s.int4_experts == "qmoe" and len(qmoe) < len(d.sparse))):
            why = ("lower_int4_ascend lowers linears, not expert stacks" if TARGETS.get(r.target).socs else
                   "the recipe has neither fuse_moe's QMoE nor lower_int4 {experts: true}"
                   if s.int4_experts == "float" else "not QMoE-eligible: asymmetric, msModelSlim or mixed groups")
            notes.append(f"int4 MoE experts are dequantised into {s.compute} stacks at conversion ({why}): counted so")
    if any(q.kind == "fp8" for q in quantized.values()) and d.sparse and not s.fp8_experts:
        notes.append(f"MoE experts of FP8 weights are dequantised into {s.compute} stacks at conversion (the "
                     "recipe's lower_fp8 has no `experts: true`): counted so")
    shared = sum(first.values()) if d.tied else 0
    return ModelBytes([dict(c) for c in layers], cache, kinds, dict(first), dict(last),
                      workspace_bytes(d, r, s, largest_dequant), notes, shared)


def _qmoe_layer(quantized: Mapping[str, QuantWeight], d: ModelDims, layer: int) -> bool:
    from qwen2om.passes.fuse_moe import int4_experts

    return int4_experts(_Experts(quantized, d), layer) is not None


def cache_bytes(d: ModelDims, r: Recipe, layer: int) -> int:
    """Layer `layer`'s cache at capacity P × B: K and V (full attention), or conv + recurrent state."""
    b, p, c = r.batch_size, int(r.max_seq_len), COMPUTE[r.dtype][1]
    if d.is_linear(layer):
        return b * (d.conv_kernel - 1) * d.conv_dim * c + b * d.lin_v_heads * d.lin_k_dim * d.lin_v_dim * 4
    return 2 * b * d.kv_heads * p * d.head_dim * c


def workspace_bytes(d: ModelDims, r: Recipe, s: Storage, largest_dequant: int = 0) -> dict[str, int]:
    """The per-stage working set of one prefill call (module docstring), by part."""
    b, t, p, c = r.batch_size, int(r.prefill_chunk), int(r.max_seq_len), s.itemsize
    n = b * t
    full = [i for i in range(d.layers) if not d.is_linear(i)]
    linear = [i for i in range(d.layers) if d.is_linear(i)]
    attention = 0
    if full:
        gate = 2 if d.layer_types else 1  # hybrids' q_proj also gives the output gate
        proj = n * (gate * d.heads * d.head_dim + 2 * d.kv_heads * d.head_dim) * c
        attention = proj + b * d.heads * t * (p + t) * (4 + c)
    if linear:
        vd = d.lin_v_heads * d.lin_v_dim
        proj = n * (d.conv_dim + vd + 2 * d.lin_v_heads) * c
        attention = max(attention, proj + b * d.lin_v_heads * t * (t + d.lin_k_dim + d.lin_v_dim) * 4)
    mlp = 3 * n * d.intermediate * c if len(d.sparse) < d.layers else 0
    if d.sparse:
        i = d.moe_intermediate
        if s.fused_moe:
            moe = d.top_k * n * 3 * i * c
        else:  # portable form: prefill runs every expert on every token; decode gathers k experts' weights
            moe = max(d.experts * n * (3 * i + d.hidden) * c, b * d.top_k * 3 * d.hidden * i * c)
        mlp = max(mlp, moe + 3 * n * d.shared_intermediate * c)
    rows = 1 if r.logits == "last" else t
    return {
        "hidden": 4 * n * d.hidden * c,
        "layer": max(attention, mlp),
        "logits": b * rows * d.vocab * (c + 4),
        "mask": b * t * (p + t) * c,
        "rope": 2 * p * (d.rotary_dim or d.head_dim) * 4,
        "dequant": largest_dequant * (4 + c),
    }


def stage_costs(model: ModelConfig, r: Recipe, ckpt: Checkpoint | None = None) -> StageCosts:
    """What `convert --stages` balances: bytes per decoder layer (weights as converted + its cache or
    state at P × B), what only the first stage (embedding) and only the last (final norm, LM head;
    with tied embeddings the one table counts in both) hold, and the per-stage workspace. `r` is a
    resolved recipe; without `ckpt` the checkpoint at `model.root` is opened (headers only) for its
    quantisation, or, where there is none, the config's tensor table is counted as float."""
    with _opened(model, ckpt) as c:
        return model_bytes(model, r, c).costs()


@contextlib.contextmanager
def _opened(model: ModelConfig, ckpt: Checkpoint | None) -> Iterator[Checkpoint | None]:
    """`ckpt`, or the checkpoint at `model.root` opened lazily (headers) and closed after; None where
    there is none to open (a config.json alone)."""
    if ckpt is not None:
        yield ckpt
        return
    from qwen2om.checkpoint import Checkpoint

    try:
        opened = Checkpoint(model.root, model)
    except Qwen2omError:
        yield None
        return
    try:
        yield opened
    finally:
        opened.close()


# -- devices -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    """One device's memory and where the figure comes from."""

    name: str
    memory: int
    source: str  # short: where the figure comes from
    note: str = ""
    citation: str = ""  # the published source of a SoC's figure

    @property
    def label(self) -> str:
        """`one Ascend910B3`, `one device`, `this machine`: how messages name one of them."""
        return self.name if self.name == "this machine" else f"one {self.name}"


def soc_table() -> list[dict[str, Any]]:
    """qwen2om/data/soc_memory.json's entries."""
    text = (importlib.resources.files("qwen2om") / "data" / "soc_memory.json").read_text(encoding="utf-8")
    return list(json.loads(text)["socs"])


def soc_memory(soc_version: str) -> Device:
    """The memory of one `soc_version` device, from the table (a RecipeError for a SoC it lacks)."""
    for entry in soc_table():
        if re.fullmatch(rf"Ascend{entry['pattern']}", soc_version):
            return Device(soc_version, int(entry["memory_gib"] * GIB), f"soc_memory.json: {entry['product']}",
                          entry.get("note", ""), entry["source"])
    known = ", ".join(f"Ascend{e['pattern']}" for e in soc_table())
    raise RecipeError(f"no memory size for --soc-version {soc_version} (known: {known}); give --device-memory GiB")


def device_of(r: Recipe, memory_gib: float | None) -> Device:
    """The device a stage runs on: --device-memory, else the SoC's memory, else (no SoC: ONNX Runtime
    on this machine) this machine's RAM."""
    if memory_gib is not None:
        if not memory_gib > 0 or not math.isfinite(memory_gib):
            raise RecipeError(f"--device-memory {memory_gib}: must be a positive number of GiB")
        return Device(r.soc_version or "device", int(memory_gib * GIB), "--device-memory")
    if r.soc_version:
        return soc_memory(r.soc_version)
    from qwen2om.recipe import physical_memory

    have = physical_memory()
    if have is None:
        raise RecipeError(f"target {r.target} names no device and this OS does not say how much memory it has: "
                          "give --device-memory GiB")
    return Device("this machine", have, "this machine's RAM (no --device-memory; target ort has no SoC)",
                  "one device = this machine's RAM: give --device-memory GiB to plan for other machines")


# -- the plan ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StagePlan:
    index: int
    start: int
    stop: int
    weights: dict[str, int]
    kv_cache: int
    linear_state: int
    workspace: int

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv_cache + self.linear_state + self.workspace

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "layers": [self.start, self.stop], "weights": dict(sorted(self.weights.items())),
                "weight_bytes": sum(self.weights.values()), "kv_cache": self.kv_cache,
                "linear_state": self.linear_state, "workspace": self.workspace, "total": self.total}


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    architecture: str
    recipe: Recipe
    device: Device
    stages: list[StagePlan]
    costs: StageCosts
    workspace: dict[str, int]
    notes: list[str]
    scheme: str | None = None

    @property
    def fits(self) -> bool:
        return all(st.total <= self.device.memory for st in self.stages)

    def to_dict(self) -> dict[str, Any]:
        r = self.recipe
        return {
            "model": self.model, "architecture": self.architecture, "scheme": self.scheme,
            "settings": {"target": r.target, "soc_version": r.soc_version or None, "dtype": r.dtype,
                         "max_seq_len": r.max_seq_len, "prefill_chunk": r.prefill_chunk, "batch_size": r.batch_size,
                         "logits": r.logits},
            "device": {"name": self.device.name, "memory": self.device.memory, "source": self.device.source,
                       "citation": self.device.citation or None, "note": self.device.note or None},
            "workspace": {"per_stage": sum(self.workspace.values()), "parts": self.workspace,
                          "how": WORKSPACE_HOW},
            "costs": dataclasses.asdict(self.costs),
            "stages": [st.to_dict() for st in self.stages],
            "total": sum(st.total for st in self.stages),
            "fits": self.fits,
            "notes": self.notes,
        }


WORKSPACE_HOW = ("peak of one prefill call of prefill_chunk tokens, layer by layer: 4 [B,T,hidden] buffers + the "
                 "larger of attention (projections, fp32 scores and probabilities [B,heads,T,P+T]) and MLP (dense "
                 "3 [B,T,intermediate]; MoE portable: all experts on every token [E,B·T,3I+hidden]) + logits + mask + "
                 "RoPE tables + the largest in-graph dequantisation; the runtime's own reserve is not included")


def split(costs: StageCosts, device: Device, devices: int | None, shared: int = 0) -> list[tuple[int, int]]:
    """The stage split: `devices` balanced runs (stages.split_layers), refused naming the stage and its
    bytes when one does not fit; without `devices`, the fewest that fit (stages.fewest_stages). `shared`:
    bytes counted in both costs.first and costs.last (a tied embedding), held once by a single stage."""
    n = len(costs.layers)
    room = device.memory - costs.workspace
    if room <= 0:
        raise RecipeError(f"the per-stage workspace alone ({gib(costs.workspace)}) exceeds the "
                          f"{gib(device.memory)} of {device.label}: lower --prefill-chunk, --max-seq-len or "
                          "--batch-size")
    whole = sum(costs.layers) + costs.first + costs.last - shared  # one stage: the tied table once
    if devices is None:
        if whole <= room:
            return [(0, n)]
        return fewest_stages(costs.layers, room, first=costs.first, last=costs.last,
                             what=f"{device.label} ({gib(device.memory)} less {gib(costs.workspace)} workspace)")
    if devices < 1:
        raise RecipeError(f"--devices must be at least 1 (got {devices})")
    if devices > n:
        raise RecipeError(f"--devices {devices} is more than the model's {n} decoder layers: each device (stage) "
                          "holds at least one")
    runs = split_layers(costs.layers, devices, first=costs.first, last=costs.last)
    totals = [whole] if devices == 1 else stage_totals(costs.layers, runs, first=costs.first, last=costs.last)
    for k, ((a, b), t) in enumerate(zip(runs, totals, strict=True)):
        if t + costs.workspace > device.memory:
            try:
                need = len(fewest_stages(costs.layers, room, first=costs.first, last=costs.last,
                                         what=f"{device.label} less its workspace"))
                hint = f"the fewest that fit are {need}"
            except RecipeError as e:
                hint = f"no split fits: {e}"
            need = t + costs.workspace
            raise RecipeError(f"stage {k} of {devices} (layers {a}–{b - 1}) needs {gib(need)} ({need:,} bytes: "
                              f"{gib(t)} weights and caches + {gib(costs.workspace)} workspace) but {device.label} "
                              f"has {gib(device.memory)} ({device.memory:,} bytes): the model cannot fit {devices} "
                              f"device{'s' * (devices != 1)} ({hint})")
    return runs


def plan(model: ModelConfig, r: Recipe, ckpt: Checkpoint | None = None, *, devices: int | None = None,
         device_memory: float | None = None, scheme: str | None = None, group: int = SCHEME_GROUP,
         name: str = "", storage: Storage | None = None) -> Plan:
    """The plan for `model` converted with the resolved recipe `r` on devices of `device_memory` GiB
    (default: the SoC's, or this machine's RAM): per stage, weights by dtype, caches, workspace."""
    with _opened(model, ckpt) as c:
        mb = model_bytes(model, r, c, scheme=scheme, group=group, storage=storage)
    costs = mb.costs()
    device = device_of(r, device_memory)
    runs = split(costs, device, devices, mb.shared)
    stages = []
    for k, (a, b) in enumerate(runs):
        weights: Counter[str] = Counter()
        for i in range(a, b):
            weights.update(mb.layer_weights[i])
        if k == 0:
            weights.update(mb.first)
        if k == len(runs) - 1:
            weights.update(mb.last)
            if k == 0 and mb.shared:  # one stage holds the tied table once
                weights.subtract({dt: n for dt, n in mb.first.items()})
                weights = +weights
        kv = sum(mb.layer_cache[i] for i in range(a, b) if mb.cache_kind[i] == "kv")
        state = sum(mb.layer_cache[i] for i in range(a, b) if mb.cache_kind[i] == "state")
        stages.append(StagePlan(k, a, b, dict(weights), kv, state, costs.workspace))
    notes = list(mb.notes)
    if device.note:
        notes.append(device.note)
    if TARGETS.get(r.target).device_backend:
        notes.append("the ACL runtime loads the decode and prefill .om files separately, each with its weights "
                     "(qwen2om/runtime/standalone.py, open_acl): until they share one copy, a device holds the "
                     "weights twice; the plan counts them once")
    return Plan(name or str(model.root), model.arch.name, r, device, stages, costs, mb.workspace, notes, scheme)


def plan_model(model: str | Path, settings: Mapping[str, Any], *, recipe: str | None = None,
               devices: int | None = None, device_memory: float | None = None,
               scheme: str | None = None, group: int = SCHEME_GROUP) -> Plan:
    """`qwen2om plan`: MODEL (a directory or builtin:NAME) with recipe `settings` (recipe field → typed
    value, as convert takes them), its headers read, nothing else."""
    from qwen2om.builtin import resolve_model
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.convert import choose_recipe, read_config

    source = resolve_model(model)
    cfg = read_config(source)
    r = choose_recipe(cfg, recipe, settings)
    ckpt = Checkpoint(source, cfg)  # lazy: headers and quantisation metadata, no tensor data
    try:
        ckpt.validate_layout()  # headers only: every tensor the config implies, with its shape and dtype
        return plan(cfg, r, ckpt, devices=devices, device_memory=device_memory, scheme=scheme, group=group,
                    name=str(model))
    finally:
        ckpt.close()


def dtype_summary(weights: Mapping[str, int], fmt: Any = gib) -> str:
    """`float16 12.00 GiB, int32 3.00 GiB`, largest first."""
    return ", ".join(f"{k} {fmt(v)}" for k, v in sorted(weights.items(), key=lambda kv: -kv[1]))


def totals_by_dtype(stages: Iterable[StagePlan]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for st in stages:
        out.update(st.weights)
    return dict(out)
