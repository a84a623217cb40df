"""`qwen2om calibrate`: W4A16 post-training quantisation of a checkpoint, layer by layer
(`--scheme fp8-block`, data-free FP8, is qwen2om/quant/fp8_block.py).

Only one decoder layer's weights are in memory at a time (qwen2om/layerwise.py). For GPTQ, each
layer runs twice over the calibration samples: once with its float weights to accumulate every
linear's input Hessian, then, once its linears are quantised, again to produce the inputs of the
next layer — so each layer is calibrated on what the quantised model before it really computes.
RTN needs no data and reads each weight once.

What is quantised is architecture data (`ArchSpec.quant_targets`, never `keep_float`: norms,
embeddings, RoPE, router gates), plus the LM head only with `quantize_lm_head`, minus a recipe's
`ignore` regexes. The result is a compressed-tensors `pack-quantized` checkpoint (the format
llm-compressor writes and transformers / vLLM read). MoE experts stored fused 3-D are read and
written expert by expert (qwen2om/quant/experts.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwen2om.arch import EMBED, LM_HEAD, float_linears, quantizable
from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import TOKENIZER_FILES, Checkpoint
from qwen2om.confine import confined
from qwen2om.datasets import check_source, windows
from qwen2om.families import family_of
from qwen2om.layerwise import ActivationStore, LayerRunner, LayerTensors
from qwen2om.output import check_output, mark_written, staged_output
from qwen2om.quant.awq import search_scale
from qwen2om.quant.config import CalibrationConfig
from qwen2om.quant.config import calibration_config as calibration_config  # the CLI's and tests' import
from qwen2om.quant.device import torch_device
from qwen2om.quant.experts import ExpertStats, expand_names, expanded_shape, expert_jobs, unfused_experts
from qwen2om.quant.fisher import HEAD_KEY, PLAIN
from qwen2om.quant.fisher import columns as fisher_columns
from qwen2om.quant.formats import FORMATS
from qwen2om.quant.gptq import CLIP_RATIOS, output_error
from qwen2om.quant.int4 import Int4Spec, dequantize, quantize, rtn
from qwen2om.quant.pool import Pool, open_pool
from qwen2om.quant.resume import CalibrationJournal
from qwen2om.quant.resume import key as journal_key
from qwen2om.quant.schemes import FP8_BLOCK, RTN, W4A16, CalibrationError
from qwen2om.quant.shard import Job, LayerResult, Settings, layer_linears
from qwen2om.quant.shard import _finite_or_raise as _finite_or_raise  # tests' import
from qwen2om.quant.tree import chunk_samples, join
from qwen2om.quant.writer import ShardWriter, copy_tensor
from qwen2om.quantized import DESCRIPTION
from qwen2om.static_hybrid import ZeroCentredRMSNorm
from qwen2om.static_model import Linear

REPORT = "calibration_report.json"
# How the statistics are summed, for the report: the order fixes their bits (qwen2om/quant/tree.py).
REDUCTION = ("canonical binary tree over sample chunks (batch_size consecutive samples of one length): "
             "node (lo, size) = node (lo, size/2) + node (lo + size/2, size/2), float32, left + right")
COPY_FILES = (*TOKENIZER_FILES, "generation_config.json")


@dataclasses.dataclass
class LinearReport:
    name: str
    method: str
    rtn_error: float | None
    error: float | None
    note: str = ""


def compute_dtype(cfg: CalibrationConfig, ckpt: Checkpoint) -> torch.dtype:
    if cfg.compute_dtype != "auto":
        return getattr(torch, cfg.compute_dtype)
    name = next((n for n in ckpt.names() if n.endswith("layernorm.weight")), None)
    dtype = ckpt.info(name).dtype if name else torch.float32
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def clip_ratios(cfg: CalibrationConfig) -> tuple[float, ...]:
    """GPTQ's candidate clipping ratios: the search's, or min-max alone."""
    return CLIP_RATIOS if cfg.clip_search and "clip_search" in cfg.method_entry.reads else (1.0,)


def quantization_config(cfg: CalibrationConfig, ignore: list[str]) -> dict[str, Any]:
    import importlib.metadata

    method = cfg.method_entry
    try:
        version = importlib.metadata.version("compressed-tensors")
    except importlib.metadata.PackageNotFoundError:
        version = "0.20.1"
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": cfg.symmetric, "strategy": "group",
                        "group_size": cfg.group_size, "dynamic": False, "observer": "minmax",
                        "actorder": "static" if method.orders_columns and cfg.actorder else None},
        }},
        "ignore": ignore, "kv_cache_scheme": None, "version": version,
        "qwen2om": {"method": cfg.method, "dataset": cfg.dataset if method.needs_data else None,
                    **({"clip_ratios": list(clip_ratios(cfg))} if "clip_search" in method.reads else {}),
                    **({"hessian": cfg.hessian} if "hessian" in method.reads else {})},
    }


def packed(name: str, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: Int4Spec,
           dtype: torch.dtype, fmt: str = "compressed-tensors") -> dict[str, torch.Tensor]:
    """The stored tensors of one quantised weight `...X.weight`, in `fmt` (its FORMATS entry's writer)."""
    write = FORMATS.get(fmt).write
    assert write is not None, f"{fmt} stores no int4 weights"
    return write(name, q, scale, zp, spec, dtype)


def shrink_outputs(prev: torch.nn.Module, s: torch.Tensor) -> list[str]:
    """Divide `prev`'s output channels by AWQ's scales `s` (its consumers' input columns are multiplied
    by them); returns the float parameters changed ("bias" of a Linear with one; "weight" of a norm)."""
    if isinstance(prev, Linear):  # stored [in, out]: output channels are columns
        prev.weight.data = (prev.weight.data.float() / s).to(prev.weight.dtype)
        if prev.bias is None:
            return []
        prev.bias.data = (prev.bias.data.float() / s).to(prev.bias.dtype)
        return ["bias"]
    if isinstance(prev, ZeroCentredRMSNorm):  # scales by (1 + w): (1 + w') = (1 + w) / s
        prev.weight.data = ((1.0 + prev.weight.data.float()) / s - 1.0).to(prev.weight.dtype)
    else:  # RMSNorm scales by w after normalising
        prev.weight.data = (prev.weight.data.float() / s).to(prev.weight.dtype)
    return ["weight"]


def quant_targets(ckpt: Checkpoint, names: list[str], cfg: CalibrationConfig) -> list[str]:
    """The weights among `names` that calibration quantises (architecture data, `ignore`, the LM head)."""
    out = [n for n in names if quantizable(ckpt.arch, n, ignore=cfg.ignore, lm_head=cfg.quantize_lm_head)]
    if cfg.quantize_lm_head and LM_HEAD not in out:  # tied: the head is quantised from the embedding
        out.append(LM_HEAD)
    return out


def quantized_widths(ckpt: Checkpoint, cfg: CalibrationConfig) -> dict[str, int]:
    """Each weight calibration quantises → its input width K (its groups run along K), from the
    config and the tensor table alone: no weight is read."""
    slices = unfused_experts(ckpt)
    targets = quant_targets(ckpt, expand_names(ckpt.names(), slices), cfg)
    return {n: ckpt.dims.hidden if n == LM_HEAD else expanded_shape(ckpt, slices, n)[1] for n in targets}


def check_group_size(widths: dict[str, int], group: int) -> None:
    """Refuse a group size that does not divide every quantised weight's input width, naming the
    first such weight and the group size to use instead."""
    bad = [(n, k) for n, k in widths.items() if k % group]
    if not bad:
        return
    name, k = bad[0]
    more = (f", nor are {len(bad) - 1} more weights' (input widths "
            f"{', '.join(map(str, sorted({w for _, w in bad})))})") if len(bad) > 1 else ""
    common = math.gcd(*widths.values())
    fits = [g for g in (16, 32, 64, 128, 256) if common % g == 0]
    best = max((g for g in fits if g <= group), default=max(fits, default=0))
    hint = (f"use --group-size {best}, the largest power of two{f' ≤ {group}' if best <= group else ''} that "
            f"divides every quantised weight's input width (group sizes that fit every layer: "
            f"{', '.join(map(str, fits))}), or leave the odd weights float with --ignore REGEX") if fits else \
        "no power-of-two group ≥ 16 fits every layer; --ignore the odd ones"
    raise CalibrationError(f"{name}: input width {k} is not a multiple of --group-size {group}{more}; {hint}; "
                           "nothing was written")


class Calibrator:
    """The driver of one calibration: reads each layer, has the workers (qwen2om/quant/pool.py) collect
    its statistics and solve its modules, writes the result, and sends it back for the next layer."""

    def __init__(self, ckpt: Checkpoint, cfg: CalibrationConfig, writer: ShardWriter,
                 progress: Callable[..., None], log: Callable[[str], None],
                 journal: CalibrationJournal | None = None) -> None:
        self.ckpt, self.cfg, self.writer, self.progress, self.log = ckpt, cfg, writer, progress, log
        self.journal = journal
        self.family = family_of(ckpt.arch)
        self.spec = cfg.int4
        self.method = cfg.method_entry
        self.reports: list[LinearReport] = []
        self.rtn_before: dict[str, float] = {}
        self.experts: dict[int, dict[str, Any]] = {}  # MoE layer → tokens per expert, RTN fallbacks
        self.layer_seconds: list[float] = []
        self.layer_runs: list[dict[str, Any]] = []  # per layer: workers, samples per worker, bytes moved
        self.resumed = 0  # layers a resumed run took from the journal
        self.chunk_count = 0
        self.slices = unfused_experts(ckpt)  # per-expert name → its slice of a fused expert stack
        self.weights: ActivationStore | None = None  # --hessian fisher: token weights per (layer, chunk)
        self.weight_layout: dict[int, list[tuple[str, int]]] = {}  # per layer: (linear, columns) in order
        self.fisher_seconds: float | None = None
        self.names = expand_names(ckpt.names(), self.slices)  # what the output checkpoint holds

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        s = self.slices.get(name)
        return self.ckpt.get(name, dtype) if s is None else s.read(self.ckpt, dtype)

    def dtype(self, name: str) -> torch.dtype:
        s = self.slices.get(name)
        return self.ckpt.info(name if s is None else s.source).dtype

    def targets(self) -> list[str]:
        return quant_targets(self.ckpt, self.names, self.cfg)

    def ignored(self) -> list[str]:
        """Linear modules left float, for the config's `ignore` list."""
        return float_linears(self.names, lambda n: len(self.shape(n)), set(self.targets()))

    def shape(self, name: str) -> tuple[int, ...]:
        return expanded_shape(self.ckpt, self.slices, name)

    def check_groups(self, names: list[str]) -> None:
        check_group_size({n: self.ckpt.dims.hidden if n == LM_HEAD else self.shape(n)[1] for n in names},
                         self.spec.group)

    def source(self, name: str) -> str:
        return EMBED if name == LM_HEAD and LM_HEAD not in self.ckpt else name

    def finite(self, name: str, w: torch.Tensor) -> torch.Tensor:
        return self.finite_weight(name, w)

    @staticmethod
    def finite_weight(name: str, w: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(w).all():
            bad = int((~torch.isfinite(w)).sum())
            raise CalibrationError(f"{name}: {bad} non-finite values (NaN/Inf) in the weight; nothing was written")
        return w

    def rtn_result(self, name: str, note: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Round-to-nearest one weight (data-free): (q, scale as stored, zero point), reported."""
        src = self.source(name)
        w = self.finite(src, self.read(src, torch.float32))
        _, scale, zp = rtn(w, self.spec, name)
        scale = scale.to(self.dtype(src)).float()  # quantise with the scale exactly as it will be stored
        self.reports.append(LinearReport(name, RTN.name, None, None, note))
        if note:
            self.log(f"{name}: RTN: {note}")
        return quantize(w, scale, zp, self.spec.group), scale, zp

    def write_int4(self, name: str, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> None:
        for k, v in packed(name, q, scale, zp, self.spec, self.dtype(self.source(name)), str(self.cfg.fmt)).items():
            self.writer.add(k, v)

    def write_result(self, result: LayerResult) -> None:
        for name in result.order:
            if name in result.int4:
                self.write_int4(name, *result.int4[name])
            else:
                self.writer.add(name, result.floats[name])

    def copy(self, names: list[str]) -> None:
        """Float tensors as stored, in blocks of rows (an embedding can be gigabytes)."""
        for n in names:
            if n in self.slices:  # one expert's slice of a fused stack
                self.writer.add(n, self.read(n))
            else:
                copy_tensor(self.writer, self.ckpt, n)

    def per_layer(self) -> dict[int, list[str]]:
        d = self.ckpt.dims
        out: dict[int, list[str]] = {i: [] for i in range(d.layers)}
        for n in self.names:
            parts = n.split(".")
            if n.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < d.layers:
                out[int(parts[2])].append(n)
        return out

    def run(self, samples: list[list[int]], pool: Pool | None = None) -> None:
        targets = set(self.targets())
        self.check_groups(sorted(targets))
        per_layer = self.per_layer()
        self.copy([n for n in self.names if not n.startswith("model.layers.") and n not in targets])
        if not self.method.needs_data:
            for i in range(self.ckpt.dims.layers):
                t0 = time.perf_counter()
                for n in per_layer[i]:
                    if n in targets:
                        self.write_int4(n, *self.rtn_result(n))
                    else:
                        self.copy([n])
                self.layer_seconds.append(time.perf_counter() - t0)
                self.progress("quantising layers", i + 1, self.ckpt.dims.layers)
            if LM_HEAD in targets:
                self.write_int4(LM_HEAD, *self.rtn_result(LM_HEAD))
            return
        assert pool is not None, "a calibration with data runs on a pool of workers"
        chunks = chunk_samples([len(s) for s in samples], self.cfg.batch_size)
        self.chunk_count = len(chunks)
        pool.start(len(chunks), lambda cs: self.embedding(samples, chunks, cs), self.history)
        layers = self.ckpt.dims.layers
        if self.cfg.hessian != PLAIN:
            self.fisher_pass(pool, per_layer, targets)
        done = self.resume(pool, per_layer)
        steps = [0]

        def tick(step: str) -> None:  # collect, solve and advance answered by each worker
            steps[0] += 1
            self.progress("this layer on the workers (statistics, solves, next inputs)", steps[0], 3 * len(pool.live))
        for i in range(len(done), layers):
            pool.tick, steps[0] = tick, 0
            t0, moved, lost = time.perf_counter(), pool.moved, len(pool.lost)
            outputs = i + 1 < layers or LM_HEAD in targets  # the last layer's feed only the head's GPTQ
            result = self.calibrate_layer(pool, i, [n for n in per_layer[i] if n in targets], outputs)
            result.meta["seconds"] = round(time.perf_counter() - t0, 3)
            result.meta["run"] = {"workers": len(pool.live), "bytes_moved": pool.moved - moved,
                                  "samples_per_worker": [sum(len(chunks[c]) for c in pool.chunks_of(k))
                                                         for k in pool.live],
                                  **({"workers_lost": pool.lost[lost:]} if len(pool.lost) > lost else {})}
            if self.journal:
                self.journal.save(result)
            self.replay(result, per_layer[i])
            self.progress("calibrating layers", i + 1, layers)
        if self.weights is not None:
            self.weights.close()
        if LM_HEAD in targets:
            self.gptq_lm_head(pool)

    def resume(self, pool: Pool, per_layer: dict[int, list[str]]) -> list[int]:
        """A resumed run: the journaled layers written again, in order, and the workers' samples brought
        through them to the first layer not done. Returns the layers done."""
        done = list(self.journal.done) if self.journal else []
        self.resumed = len(done)
        for i in done:
            self.replay(self.journal.load(i), per_layer[i])  # type: ignore[union-attr]
        for i in done:
            tensors, result = self.history(i)
            boxes = (i, pool.share(tensors), pool.share(result))
            pool.each("advance", lambda k, boxes=boxes: boxes)
            pool.level = i + 1
        if done:
            self.progress("calibrating layers", len(done), self.ckpt.dims.layers)
            self.log(f"resumed: layers 0-{len(done) - 1} were calibrated by the interrupted run")
        return done

    def replay(self, result: LayerResult, names: list[str]) -> None:
        """Write a calibrated layer (and its tensors left as stored) and take in its report."""
        targets = set(self.targets())
        self.write_result(result)
        self.copy([n for n in names if n not in targets and n not in result.floats])
        self.reports += [LinearReport(**r) for r in result.meta.get("reports", [])]
        if "experts" in result.meta:
            self.experts[result.index] = result.meta["experts"]
        self.layer_seconds.append(result.meta.get("seconds", 0.0))
        self.layer_runs.append(result.meta.get("run", {}))

    def embedding(self, samples: list[list[int]], chunks: list[list[int]], which: list[int],
                  ) -> tuple[dict[int, tuple[list[int], np.ndarray]], np.ndarray, torch.Tensor]:
        """Chunks `which`: their samples' token ids, and the embedding rows of those tokens, each read once."""
        data = {c: (chunks[c], np.asarray([samples[i] for i in chunks[c]], dtype=np.int64)) for c in which}
        unique = np.unique(np.concatenate([t.reshape(-1) for _, t in data.values()])) if data else \
            np.zeros(0, dtype=np.int64)
        name = self.family.names.embed
        rows = torch.cat([self.ckpt.get(name, rows=(int(t), int(t) + 1)) for t in unique]) if len(unique) else \
            torch.zeros(0, self.ckpt.dims.hidden)
        return data, unique, rows

    def layer_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s float tensors as stored (what every worker builds the layer from)."""
        prefix = f"{self.family.names.layer(index)}."
        return {n: self.ckpt.get(n) for n in self.ckpt.names() if n.startswith(prefix)}

    def history(self, index: int) -> tuple[dict[str, torch.Tensor], LayerResult]:
        assert self.journal is not None, "a lost worker is recovered from the journal"
        return self.layer_tensors(index), self.journal.load(index)

    def calibrate_layer(self, pool: Pool, index: int, names: list[str], outputs: bool = True) -> LayerResult:
        """Quantise layer `index`'s linears `names`; the result is sent to the workers, which then hold the
        next layer's inputs (unless not `outputs`)."""
        tensors = self.layer_tensors(index)
        box = pool.share(tensors)
        prefix = f"{self.family.names.layer(index)}."
        experts = [n for n in names if self.family.names.parse_expert(n)]
        names = [n for n in names if n not in experts]
        for n in names:
            self.finite(n, tensors[n] if n in tensors else self.read(n))
        # Without an output pass the collecting pass runs to the layer's end, so its output is checked.
        wbox = self.token_weights(pool, index)
        answers = pool.each("collect", lambda k: (index, box, names, bool(experts), not outputs, wbox))
        sums = join({node: s for nodes, _ in answers.values() for node, s in nodes.items()}, pool.count) or {}
        aliases: dict[str, str] = next(iter(answers.values()))[1]
        # The driver's copy of the layer (AWQ's search, the weights to solve): the worker's own in one CPU
        # process, else built from the same tensors the workers got, as they build it.
        layer = pool.layer()
        if layer is not None:  # the worker in this process holds the layer: its stored tensors can go
            box[0] = tensors = None
        else:
            layer = LayerRunner(dataclasses.replace(LayerTensors.header(self.ckpt), tensors=tensors),
                                dtype=compute_dtype(self.cfg, self.ckpt)).layer(index)
        linears = layer_linears(layer, prefix)
        hess, x_abs = {}, {}
        for n in names:
            key = aliases[n]
            if wbox is None:
                rows = max(1, int(sums[f"n:{key}"]))
                hess[n], x_abs[n] = sums[f"h:{key}"] * (2 / rows), sums[f"a:{key}"] / rows
            else:  # Σ w·xxᵀ over Σ w (per head: [heads, K, K] over [heads]); a uniform factor GPTQ ignores
                total = sums[f"n:{key}"].clamp_min(torch.finfo(torch.float32).tiny).float()
                h = sums[f"h:{key}"] * 2
                hess[n] = (h / total[:, None, None] if h.dim() == 3 else h / total)
                x_abs[n] = sums[f"a:{key}"]
        result = LayerResult(index)
        jobs: list[Job] = []
        rtn_notes: dict[str, str] = {}
        if experts:
            expert_list, rtn_list, self.experts[index] = expert_jobs(layer.mlp, ExpertStats(sums), experts,
                                                                       self.family.names)
            jobs += [Job(n, w, h, self.dtype(n)) for n, w, h in expert_list]
            rtn_notes = dict(rtn_list)
            result.meta["experts"] = self.experts[index]
        if self.method.searches_scales:
            result.floats = self.awq_scale(layer, index, linears, names, hess, x_abs)
        jobs += [Job(n, linears[n].weight.data.T.contiguous().float(), hess.pop(n), self.dtype(n),
                     self.rtn_before.pop(n, None)) for n in names]
        solved = {s.name: s for s in pool.solve(jobs)}
        before = len(self.reports)
        for n in experts:
            if n in rtn_notes:
                result.int4[n] = self.rtn_result(n, rtn_notes[n])
                continue
            s = solved[n]
            result.int4[n] = (s.q, s.scale, s.zp)
            self.reports.append(LinearReport(n, s.method, s.rtn_error, s.error, s.note))
            if s.note:
                self.log(f"{n}: GPTQ fell back to RTN: {s.note}")
        for n in names:
            s = solved[n]
            result.int4[n] = (s.q, s.scale, s.zp)
            self.reports.append(LinearReport(n, s.method, s.rtn_error, s.error, s.note))
            if s.note:
                self.log(f"{n}: GPTQ fell back to RTN: {s.note}")
        result.order = [*experts, *result.floats, *names]
        result.meta["reports"] = [dataclasses.asdict(r) for r in self.reports[before:]]
        del self.reports[before:]  # replay() takes them in, as a resumed run does from the journal
        if outputs:
            rbox = pool.share(result)
            pool.each("advance", lambda k: (index, box, rbox))
            pool.level = index + 1
        return result

    def fisher_pass(self, pool: Pool, per_layer: dict[int, list[str]], targets: set[str]) -> None:
        """--hessian fisher: the float model forward over the samples, the loss's gradient at its end, and
        back layer by layer (qwen2om/quant/fisher.py), keeping each quantised linear's token weights
        (in a store: memory up to the activation budget, then disk). The workers end at layer 0."""
        layers = self.ckpt.dims.layers
        total = 2 * layers + 1
        t0 = time.perf_counter()
        for i in range(layers):
            box = pool.share(self.layer_tensors(i))
            pool.each("fisher_forward", lambda k, box=box, i=i: (i, box), recover=False)
            self.progress("loss gradients (--hessian fisher): forward, head, backward", i + 1, total)
        norm = self.family.names.final_norm
        head = {n: self.ckpt.get(n) for n in self.ckpt.names() if n.startswith(norm)}
        head[HEAD_KEY] = self.ckpt.get(self.source(LM_HEAD))
        hbox = pool.share(head)
        pool.each("fisher_head", lambda k: (hbox,), recover=False)
        del head, hbox[0]  # the head can be vocabulary × hidden: not held through the calibration
        self.progress("loss gradients (--hessian fisher): forward, head, backward", layers + 1, total)
        self.weights = ActivationStore(self.cfg.activation_budget)
        for i in reversed(range(layers)):
            names = [n for n in per_layer[i] if n in targets and not self.family.names.parse_expert(n)]
            cols = {n: fisher_columns(n, self.shape(n)[0], self.ckpt.dims, self.cfg.hessian, self.family.names)
                    for n in names}
            box = pool.share(self.layer_tensors(i))
            answers = pool.each("fisher_backward", lambda k, box=box, i=i, cols=cols: (i, box, cols),
                                recover=False)
            self.weight_layout[i] = list(cols.items())
            for per_chunk in answers.values():
                for c, w in per_chunk.items():
                    arr = torch.cat([w[n] for n in cols], 1) if cols else torch.zeros(0, 0)
                    self.weights.put(i * self.chunk_count + c, arr.numpy())
            self.progress("loss gradients (--hessian fisher): forward, head, backward", total - i, total)
        self.fisher_seconds = round(time.perf_counter() - t0, 3)
        self.log(f"--hessian {self.cfg.hessian}: the loss gradients' pass took {self.fisher_seconds:.1f} s")

    def token_weights(self, pool: Pool, index: int) -> list[Any] | None:
        """--hessian fisher: layer `index`'s token weights of every chunk, for `collect`, shared once."""
        if self.cfg.hessian == PLAIN or index not in self.weight_layout:
            return None
        layout = self.weight_layout[index]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for c in range(self.chunk_count):
            arr = torch.from_numpy(np.array(self.weights.get(index * self.chunk_count + c)))
            out[c] = dict(zip([n for n, _ in layout], arr.split([k for _, k in layout], 1), strict=True))
            self.weights.drop(index * self.chunk_count + c)
        return pool.share(out)

    def awq_scale(self, layer: torch.nn.Module, index: int, linears: dict[str, Linear], names: list[str],
                  hess: dict[str, torch.Tensor], x_abs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Search and apply AWQ's input-channel scales in place; returns the float tensors changed, as stored."""
        modules = dict(layer.named_modules())
        prefix = f"{self.family.names.layer(index)}."
        changed: list[str] = []
        for producer, consumers in self.family.awq_groups:
            group = [f"{prefix}{c}.weight" for c in consumers]
            if not all(g in names for g in group):
                continue
            prev = modules[producer]
            width = prev.weight.shape[-1] if isinstance(prev, Linear) else prev.weight.shape[0]
            if width != linears[group[0]].weight.shape[0]:
                continue  # e.g. v_proj → o_proj under GQA: v's outputs are not o's inputs one to one
            ws = [linears[g].weight.data.T.float() for g in group]
            for g, w in zip(group, ws, strict=True):
                q0, s0, z0 = rtn(w, self.spec, g)
                self.rtn_before[g] = output_error(w, dequantize(q0, s0, z0, self.spec.group), hess[g])
            s, base, best = search_scale(ws, [hess[g] for g in group], x_abs[group[0]], self.spec)
            if best >= base:
                continue  # s = 1 is best: leave the group alone
            attrs = shrink_outputs(prev, s)
            if isinstance(prev, Linear) and f"{prefix}{producer}.weight" not in names:
                attrs.append("weight")  # a producer kept float is stored shrunk too
            changed += [f"{prefix}{producer}.{attr}" for attr in attrs]
            for g in group:
                linears[g].weight.data = (linears[g].weight.data.float() * s[:, None]).to(linears[g].weight.dtype)
                hess[g] = hess[g] / (s[:, None] * s[None, :])
        dtype = self.ckpt.info(self.family.names.input_norm(index)).dtype
        out: dict[str, torch.Tensor] = {}
        for name in dict.fromkeys(changed):  # written as stored, and the layer keeps exactly the stored value
            module, attr = name.removeprefix(prefix).rsplit(".", 1)
            param = getattr(modules[module], attr)
            if attr == "weight" and isinstance(modules[module], Linear):  # held [in, out], stored [out, in]
                out[name] = param.data.T.contiguous().to(self.dtype(name))
                param.data = out[name].T.contiguous().to(param.dtype)
            else:
                out[name] = param.data.to(dtype)
                param.data = out[name].to(param.dtype)
        return out

    def gptq_lm_head(self, pool: Pool) -> None:
        norm = self.family.names.final_norm
        box = pool.share({n: self.ckpt.get(n) for n in self.ckpt.names() if n.startswith(norm)})
        answers = pool.each("head", lambda k: (box,))
        sums = join({node: s for nodes in answers.values() for node, s in nodes.items()}, pool.count) or {}
        h = sums["h"] * (2 / max(1, int(sums["n"])))
        w = self.ckpt.get(self.source(LM_HEAD), torch.float32)
        (s,) = pool.solve([Job(LM_HEAD, w, h, self.dtype(self.source(LM_HEAD)))])
        self.reports.append(LinearReport(LM_HEAD, s.method, s.rtn_error, s.error, s.note))
        self.write_int4(LM_HEAD, s.q, s.scale, s.zp)


def description(ckpt: Checkpoint, cal: Calibrator) -> dict[str, Any]:
    """msModelSlim's quant_model_description.json: every stored tensor → "W4A16" or "FLOAT"."""
    quantized = {r.name for r in cal.reports}
    out: dict[str, Any] = {"model_quant_type": "W4A16", "group_size": cal.spec.group}
    for name in sorted(n for shard in cal.writer.shards for n in shard):
        base = name.removesuffix("_scale").removesuffix("_offset")
        out[ckpt.layout_name(name)] = "W4A16" if base in quantized or name in quantized else "FLOAT"
    return out


def tokenizer_files(source: Path) -> dict[str, Path]:
    """The tokenizer and generation files calibrate copies beside the quantised weights, each a regular
    file inside the checkpoint (qwen2om.confine): a symlink to a key file is not published with OUT."""
    return {name: confined(source, name) for name in COPY_FILES
            if (source / name).exists() or (source / name).is_symlink()}


def copy_tokenizer_files(source: Path, stage: Path) -> None:
    for name, path in tokenizer_files(source).items():
        shutil.copyfile(path, stage / name)


@dataclasses.dataclass
class CalibrationResult:
    out: Path
    report: dict[str, Any]


def calibrate(model: str | Path, out: Path, cfg: CalibrationConfig, *, force: bool = False,
              progress: Callable[..., None] = lambda *a, **k: None,
              log: Callable[[str], None] = lambda m: None, resume: bool = False, distributed: str | None = None,
              workers: int = 2, address: str | None = None,
              pool_hook: Callable[[Pool], None] = lambda pool: None) -> CalibrationResult:
    """Quantise `model` into `out` as `cfg` says; `cfg` is checked again first (it may have been changed
    since it was made), exactly as the CLI checks it."""
    cfg.check()
    if cfg.method_entry.needs_data:
        check_source(str(cfg.dataset))  # a missing or special file is named before the model is opened
    source = resolve_model(model)
    ckpt = Checkpoint(source)
    if ckpt.quantized or ckpt.config.get("quantization_config"):
        qm = (ckpt.config.get("quantization_config") or {}).get("quant_method", DESCRIPTION)
        raise CalibrationError(f"{source} is already quantised ({qm}); calibrate its float original")
    ckpt.validate_layout()
    tokenizer_files(source)  # refused now, not after the calibration
    if (resume or distributed) and not cfg.method_entry.needs_data:
        raise CalibrationError(f"--resume and --distributed are for calibrations with data (gptq, awq); "
                               f"{cfg.scheme} {cfg.method} reads each weight once and needs neither")
    return RUNS[cfg.scheme](model, source, ckpt, out, cfg, force=force, progress=progress, log=log,
                            **({"resume": resume, "distributed": distributed, "workers": workers, "address": address,
                                "pool_hook": pool_hook} if cfg.method_entry.needs_data else {}))


def calibrate_int4(model: str | Path, source: Path, ckpt: Checkpoint, out: Path, cfg: CalibrationConfig, *,
                   force: bool, progress: Callable[..., None], log: Callable[[str], None], resume: bool = False,
                   distributed: str | None = None, workers: int = 2, address: str | None = None,
                   pool_hook: Callable[[Pool], None] = lambda pool: None) -> CalibrationResult:
    """`--scheme w4a16`: int4 groups by RTN, GPTQ or AWQ, layer by layer; with data, on a pool of workers
    (this process, or `workers` Ray actors with `distributed="ray"`), resumable from the last finished layer."""
    # Before any data or weight is read: a group that does not fit, or an OUT that is there already,
    # used to stop calibration only after the dataset was read and tokenised.
    check_group_size(quantized_widths(ckpt, cfg), cfg.int4.group)
    resumable = cfg.method_entry.needs_data  # RTN reads each weight once: nothing to resume
    check_output(Path(out), force=force, resume=resume, marker=REPORT, resumable=resumable)
    device = torch_device(cfg.device)
    t0 = time.perf_counter()
    data = None
    if cfg.method_entry.needs_data:
        seq_len = cfg.seq_len or min(2048, ckpt.dims.max_positions)
        data = windows(str(cfg.dataset), source, num_samples=cfg.num_samples, seq_len=seq_len)
        for note in data.notes:
            log(note)
    threads = cfg.threads or torch.get_num_threads()
    samples = data.samples if data else []
    settings = Settings(cfg.int4, cfg.method_entry.searches_scales, cfg.damp, cfg.actorder, clip_ratios(cfg),
                        str(compute_dtype(cfg, ckpt)).removeprefix("torch."), str(device), threads,
                        cfg.activation_budget, hessian=cfg.hessian if cfg.method_entry.needs_data else PLAIN)
    # Everything that decides the checkpoint's bytes (not the workers: any number gives the same).
    key = journal_key(source, ckpt.config, {**dataclasses.asdict(cfg), "device": device.type, "threads": threads},
                      samples)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the driver's own arithmetic (AWQ's search) as the workers'
    pool: Pool | None = None
    try:
        with staged_output(Path(out), force=force, resume=resume, marker=REPORT, resumable=resumable,
                           log=log) as stage:
            journal = CalibrationJournal(stage, key, resume=resume)
            writer = ShardWriter(stage, rename=ckpt.layout_name)
            cal = Calibrator(ckpt, cfg, writer, progress, log, journal)
            if data:
                pool = open_pool(LayerTensors.header(ckpt), settings, distributed=distributed, workers=workers,
                                 address=address)
                pool_hook(pool)
            cal.run(samples, pool)
            peaks = pool.peaks() if pool else []
            places = [dataclasses.asdict(p) for p in pool.places] if pool else []
            lost = list(pool.lost) if pool else []
            if pool:
                pool.close()
                pool = None
            journal.finish()
            writer.close()
            config = dict(ckpt.config)
            if cfg.quantize_lm_head and config.get("tie_word_embeddings"):
                config["tie_word_embeddings"] = False  # the head is now its own (quantised) tensor
            marker = FORMATS.get(str(cfg.fmt)).marker
            if marker:  # msModelSlim's: the description file, not config.json, says what is quantised
                (stage / marker).write_text(json.dumps(description(ckpt, cal), indent=2) + "\n")
            else:
                config["quantization_config"] = quantization_config(cfg, [ckpt.layout_name(m) for m in cal.ignored()])
            (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            copy_tokenizer_files(source, stage)
            errs = [(r.rtn_error, r.error) for r in cal.reports if r.error is not None and r.rtn_error is not None]
            report = {
                "model": str(model), "scheme": W4A16.name, "method": cfg.method, "group_size": cfg.group_size,
                "symmetric": cfg.symmetric, "dataset": data.report() if data else None,
                "compute_dtype": settings.dtype if data else None, "hessian": settings.hessian if data else None,
                **({"hessian_pass_seconds": cal.fisher_seconds} if cal.fisher_seconds is not None else {}),
                "seconds": round(time.perf_counter() - t0, 2), "quantized": len(cal.reports),
                "fell_back_to_rtn": [r.name for r in cal.reports if r.method == RTN.name and cal.method.needs_data],
                "mean_rtn_error": float(np.mean([e[0] for e in errs])) if errs else None,
                "mean_error": float(np.mean([e[1] for e in errs])) if errs else None,
                **({"execution": {
                    "distributed": distributed, "workers": len(places), "device": str(device), "threads": threads,
                    "resumed_layers": cal.resumed,
                    "reduction": REDUCTION, "chunks": cal.chunk_count, "workers_lost": lost,
                    "worker_peak_rss_bytes": peaks, "places": places}} if data else {}),
                "layers": [{"layer": i, "seconds": round(s, 3),
                            "linears": [dataclasses.asdict(r) for r in cal.reports if f"layers.{i}." in r.name],
                            **({"experts": cal.experts[i]} if i in cal.experts else {}),
                            **({"run": cal.layer_runs[i]} if i < len(cal.layer_runs) and cal.layer_runs[i] else {})}
                           for i, s in enumerate(cal.layer_seconds)],
            }
            mark_written(stage, report, REPORT)
    finally:
        if pool is not None:
            pool.close()
        torch.set_num_threads(previous)
    ckpt.close()
    return CalibrationResult(Path(out), report)


def calibrate_fp8(model: str | Path, source: Path, ckpt: Checkpoint, out: Path, cfg: CalibrationConfig, *,
                  force: bool, progress: Callable[..., None], log: Callable[[str], None]) -> CalibrationResult:
    """`--scheme fp8-block`: Hugging Face fine-grained FP8, 128×128 tiles, no data."""
    from qwen2om.quant.fp8_block import BLOCK, hf_quantization_config, quantize_checkpoint

    t0 = time.perf_counter()
    with staged_output(Path(out), force=force, marker=REPORT, resumable=False) as stage:
        writer = ShardWriter(stage, rename=ckpt.layout_name)
        reports, seconds, left_float = quantize_checkpoint(
            ckpt, writer, ignore=cfg.ignore, lm_head=cfg.quantize_lm_head, finite=Calibrator.finite_weight,
            progress=progress)
        writer.close()
        config = dict(ckpt.config)
        if cfg.quantize_lm_head and config.get("tie_word_embeddings"):
            config["tie_word_embeddings"] = False  # the head is now its own (FP8) tensor
        config["quantization_config"] = hf_quantization_config([ckpt.layout_name(m) for m in left_float])
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer_files(source, stage)
        errors = [r.relative_error for r in reports]
        report = {
            "model": str(model), "scheme": FP8_BLOCK.name, "method": RTN.name, "block_size": list(BLOCK),
            "format": "e4m3fn", "dataset": None, "seconds": round(time.perf_counter() - t0, 2),
            "quantized": len(reports), "left_float": left_float,
            "mean_relative_error": float(np.mean(errors)) if errors else None,
            "layers": [{"layer": i, "seconds": round(s, 3),
                        "linears": [dataclasses.asdict(r) for r in reports if f"layers.{i}." in r.name]}
                       for i, s in enumerate(seconds)],
            "other": [dataclasses.asdict(r) for r in reports if ".layers." not in r.name],
        }
        mark_written(stage, report, REPORT)
    ckpt.close()
    return CalibrationResult(Path(out), report)


# scheme → how it calibrates (each entry in qwen2om/quant/schemes.py has one)
RUNS: dict[str, Callable[..., CalibrationResult]] = {W4A16.name: calibrate_int4, FP8_BLOCK.name: calibrate_fp8}
