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
from collections.abc import Callable, Iterator
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
from qwen2om.layerwise import ActivationStore, LayerRunner
from qwen2om.output import check_output, mark_written, staged_output
from qwen2om.quant.awq import clip_quantize, search_scale
from qwen2om.quant.config import CalibrationConfig
from qwen2om.quant.config import calibration_config as calibration_config  # the CLI's and tests' import
from qwen2om.quant.experts import (
    ExpertStats,
    expand_names,
    expanded_shape,
    quantize_experts,
    unfused_experts,
)
from qwen2om.quant.formats import FORMATS
from qwen2om.quant.gptq import GPTQResult, gptq, gram, output_error, output_errors
from qwen2om.quant.int4 import Int4Spec, dequantize, quantize, rtn
from qwen2om.quant.schemes import FP8_BLOCK, RTN, W4A16, CalibrationError
from qwen2om.quant.writer import ShardWriter, copy_tensor
from qwen2om.quantized import DESCRIPTION
from qwen2om.static_hybrid import ZeroCentredRMSNorm
from qwen2om.static_model import Linear

REPORT = "calibration_report.json"
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
        "qwen2om": {"method": cfg.method, "dataset": cfg.dataset if method.needs_data else None},
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


def _finite_or_raise(y: torch.Tensor, layer: int, samples: list[int], what: str) -> None:
    """`y` holds the batch `samples` in order, [B, T, H] or flattened to [B·T, H] (a shared expert's
    input): a non-finite value names the layer and the sample it came from."""
    if torch.isfinite(y).all():
        return
    where = ""
    if samples and y.numel() % len(samples) == 0:
        bad = int((~torch.isfinite(y.reshape(len(samples), -1)).all(1)).nonzero()[0])
        where = f" on calibration sample {samples[bad]}"
    raise CalibrationError(f"layer {layer}: {what}{where} is not finite (NaN/Inf); nothing was written")


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


class _Collected(Exception):
    """Raised by the last collecting hook: the rest of the layer's forward is not needed."""


class Calibrator:
    def __init__(self, ckpt: Checkpoint, cfg: CalibrationConfig, writer: ShardWriter,
                 progress: Callable[..., None], log: Callable[[str], None]) -> None:
        self.ckpt, self.cfg, self.writer, self.progress, self.log = ckpt, cfg, writer, progress, log
        self.family = family_of(ckpt.arch)
        self.spec = cfg.int4
        self.method = cfg.method_entry
        self.reports: list[LinearReport] = []
        self.rtn_before: dict[str, float] = {}
        self.experts: dict[int, dict[str, Any]] = {}  # MoE layer → tokens per expert, RTN fallbacks
        self.layer_seconds: list[float] = []
        self.slices = unfused_experts(ckpt)  # per-expert name → its slice of a fused expert stack
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

    def quantize_rtn(self, name: str, note: str = "") -> torch.Tensor:
        """Round-to-nearest one weight (data-free); returns its dequantised value."""
        src = self.source(name)
        dtype = self.dtype(src)
        w = self.finite(src, self.read(src, torch.float32))
        _, scale, zp = rtn(w, self.spec, name)
        scale = scale.to(dtype).float()  # quantise with the scale exactly as it will be stored
        q = quantize(w, scale, zp, self.spec.group)
        for k, v in packed(name, q, scale, zp, self.spec, dtype, str(self.cfg.fmt)).items():
            self.writer.add(k, v)
        self.reports.append(LinearReport(name, RTN.name, None, None, note))
        if note:
            self.log(f"{name}: RTN: {note}")
        return dequantize(q, scale, None if self.spec.symmetric else zp, self.spec.group)

    def quantize_hessian(self, name: str, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """GPTQ one weight [N, K]; returns its dequantised value (what the next layers see)."""
        dtype = self.dtype(self.source(name))
        if self.method.searches_scales:
            q, scale, zp = clip_quantize(w, h, self.spec, scale_dtype=dtype)
            r = GPTQResult(q, scale, zp, self.method.name)
        else:
            try:
                r = gptq(w, h, self.spec, damp=self.cfg.damp, actorder=self.cfg.actorder, scale_dtype=dtype,
                         name=name)
            except ValueError as e:
                raise CalibrationError(str(e)) from None
        if r.note:
            self.log(f"{name}: GPTQ fell back to RTN: {r.note}")
        w_hat = dequantize(r.q, r.scale, r.zp if not self.spec.symmetric else None, self.spec.group)
        q0, s0, z0 = rtn(w, self.spec, name)
        rtn_err = self.rtn_before.pop(name, None)  # AWQ: RTN of the weight before its scaling
        if rtn_err is None:
            rtn_err, err = output_errors(w, h, [dequantize(q0, s0.to(dtype).float(), z0, self.spec.group), w_hat])
        else:
            err = output_error(w, w_hat, h)
        self.reports.append(LinearReport(name, r.method, rtn_err, err, r.note))
        for k, v in packed(name, r.q, r.scale, r.zp, self.spec, dtype, str(self.cfg.fmt)).items():
            self.writer.add(k, v)
        return w_hat

    def copy(self, names: list[str]) -> None:
        """Float tensors as stored, in blocks of rows (an embedding can be gigabytes)."""
        for n in names:
            if n in self.slices:  # one expert's slice of a fused stack
                self.writer.add(n, self.read(n))
            else:
                copy_tensor(self.writer, self.ckpt, n)

    def run(self, samples: list[list[int]]) -> None:
        ckpt, d = self.ckpt, self.ckpt.dims
        targets = set(self.targets())
        self.check_groups(sorted(targets))
        per_layer: dict[int, list[str]] = {i: [] for i in range(d.layers)}
        for n in self.names:
            parts = n.split(".")
            if n.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < d.layers:
                per_layer[int(parts[2])].append(n)
        self.copy([n for n in self.names if not n.startswith("model.layers.") and n not in targets])
        if not self.method.needs_data:
            for i in range(d.layers):
                t0 = time.perf_counter()
                for n in per_layer[i]:
                    self.quantize_rtn(n) if n in targets else self.copy([n])
                self.layer_seconds.append(time.perf_counter() - t0)
                self.progress("quantising layers", i + 1, d.layers)
            if LM_HEAD in targets:
                self.quantize_rtn(LM_HEAD)
            return
        runner = LayerRunner(ckpt, budget=self.cfg.activation_budget, dtype=compute_dtype(self.cfg, ckpt))
        store = runner.embed(samples)
        try:
            for i in range(d.layers):
                t0 = time.perf_counter()
                outputs = i + 1 < d.layers or LM_HEAD in targets  # the last layer's feed only the head's GPTQ
                store, changed = self.calibrate_layer(runner, i, store, [n for n in per_layer[i] if n in targets],
                                                      outputs)
                self.copy([n for n in per_layer[i] if n not in targets and n not in changed])
                self.layer_seconds.append(time.perf_counter() - t0)
                self.progress("calibrating layers", i + 1, d.layers)
            if LM_HEAD in targets:
                self.gptq_lm_head(runner, store)
        finally:
            store.close()

    def calibrate_layer(self, runner: LayerRunner, index: int, store: ActivationStore,
                        names: list[str], outputs: bool = True) -> tuple[ActivationStore, list[str]]:
        """Quantise layer `index`'s linears `names` from its inputs in `store`; returns the next layer's
        inputs (computed by the quantised layer; none without `outputs`) and the float tensors AWQ
        changed, already written."""
        layer = runner.layer(index)
        prefix = f"{self.family.names.layer(index)}."
        experts = [n for n in names if self.family.names.parse_expert(n)]
        names = [n for n in names if n not in experts]
        linears = {f"{prefix}{n}.weight": m for n, m in layer.named_modules() if isinstance(m, Linear)}
        missing = [n for n in names if n not in linears]
        if missing:
            raise CalibrationError(f"cannot place {missing[:3]} in layer {index}'s modules")
        for n in names:
            self.finite(n, linears[n].weight.data)
        stats = ExpertStats(layer.mlp) if experts else None
        # Without an output pass the collecting pass runs to the layer's end, so its output is checked.
        hess, x_abs = self.collect(runner, layer, index, store, {n: linears[n] for n in names}, stats,
                                   whole=not outputs)
        if stats is not None:
            self.experts[index] = quantize_experts(layer.mlp, stats, experts, self.family.names,
                                                   self.quantize_hessian, self.quantize_rtn)
        changed: list[str] = []
        if self.method.searches_scales:
            changed = self.awq_scale(layer, index, linears, names, hess, x_abs)
        for n in names:
            w = linears[n].weight.data.T.contiguous()  # stored [in, out]; the algorithms work on [out, in]
            w_hat = self.quantize_hessian(n, w, hess.pop(n))
            linears[n].weight.data = w_hat.T.contiguous().to(linears[n].weight.dtype)
        out = ActivationStore(self.cfg.activation_budget)
        with torch.no_grad():
            for ids, x in self.batches(store) if outputs else ():
                y = runner.forward(layer, x)
                _finite_or_raise(y, index, ids, "its output with the quantised weights")
                y = y.float().numpy()  # the store holds float32 whatever the compute
                for j, i in enumerate(ids):
                    out.put(i, y[j:j + 1])
                    store.drop(i)
        store.close()
        return out, changed

    def batches(self, store: ActivationStore) -> Iterator[tuple[list[int], torch.Tensor]]:
        """`batch_size` samples at a time, stacked (windows have one length; unequal ones go alone)."""
        group: list[int] = []
        for i in store:
            if group and (len(group) == self.cfg.batch_size or store.get(i).shape != store.get(group[0]).shape):
                yield group, torch.from_numpy(np.concatenate([np.asarray(store.get(j)) for j in group]))
                group = []
            group.append(i)
        if group:
            yield group, torch.from_numpy(np.concatenate([np.asarray(store.get(j)) for j in group]))

    def collect(self, runner: LayerRunner, layer: torch.nn.Module, index: int, store: ActivationStore,
                linears: dict[str, Linear], experts: ExpertStats | None = None, whole: bool = False,
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One pass over the samples: each linear's input Hessian mean(2xxᵀ) and mean |x| per channel
        (and, for an MoE layer, each expert's from the tokens routed to it). With `whole`, every forward
        runs to the layer's output, which must be finite."""
        hess = {n: torch.zeros(m.weight.shape[0], m.weight.shape[0]) for n, m in linears.items()}
        x_abs = {n: torch.zeros(m.weight.shape[0]) for n, m in linears.items()}
        seen = dict.fromkeys(linears, 0)

        # q/k/v (and gate/up) are called with the same input tensor: its xᵀx is computed once.
        last: list[Any] = [None, None]
        batch: list[int] = []  # the sample ids in the current forward
        fired: set[str] = set()
        # A dense layer's forward stops once every linear has seen its input: the rest (down_proj's
        # product, the residual) feeds nothing collected, and is a fifth of the pass.
        stop_early = experts is None and bool(linears) and not whole

        def hook(name: str) -> Callable[..., None]:
            def accumulate(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                if last[0] is not args[0]:
                    short = name.removeprefix(f"{self.family.names.layer(index)}.").removesuffix(".weight")
                    _finite_or_raise(args[0], index, batch, f"the input of {short}")
                    x = args[0].reshape(-1, args[0].shape[-1]).float()
                    last[0], last[1] = args[0], (gram(x), x.abs().sum(0), x.shape[0])
                xtx, abs_sum, rows = last[1]
                total = seen[name] + rows
                hess[name].mul_(seen[name] / total).add_(xtx, alpha=2 / total)
                x_abs[name].mul_(seen[name] / total).add_(abs_sum, alpha=1 / total)
                seen[name] = total
                fired.add(name)
                if stop_early and len(fired) == len(linears):
                    raise _Collected
            return accumulate

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
        if experts is not None:
            handles.append(experts.moe.register_forward_pre_hook(experts.hook))
        try:
            with torch.no_grad():
                for ids, x in self.batches(store):
                    batch[:], last[:] = ids, [None, None]
                    fired.clear()
                    try:
                        _finite_or_raise(runner.forward(layer, x), index, ids, "its output")
                    except _Collected:
                        pass
        finally:
            for h in handles:
                h.remove()
        return hess, x_abs

    def awq_scale(self, layer: torch.nn.Module, index: int, linears: dict[str, Linear], names: list[str],
                  hess: dict[str, torch.Tensor], x_abs: dict[str, torch.Tensor]) -> list[str]:
        """Search and apply AWQ's input-channel scales in place; returns the float tensors changed."""
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
            changed += [f"{prefix}{producer}.{attr}" for attr in shrink_outputs(prev, s)]
            for g in group:
                linears[g].weight.data = (linears[g].weight.data.float() * s[:, None]).to(linears[g].weight.dtype)
                hess[g] = hess[g] / (s[:, None] * s[None, :])
        dtype = self.ckpt.info(self.family.names.input_norm(index)).dtype
        for name in changed:  # written as stored, and the layer keeps exactly the stored value
            module, attr = name.removeprefix(prefix).rsplit(".", 1)
            param = getattr(modules[module], attr)
            stored = param.data.to(dtype)
            param.data = stored.to(param.dtype)
            self.writer.add(name, stored)
        return changed

    def gptq_lm_head(self, runner: LayerRunner, store: ActivationStore) -> None:
        k = self.ckpt.dims.hidden
        h, seen = torch.zeros(k, k), 0
        for x in runner.final_norm(store):
            x = x.reshape(-1, k).float()
            total = seen + x.shape[0]
            h = h * (seen / total) + (2 / total) * x.T @ x
            seen = total
        self.quantize_hessian(LM_HEAD, self.ckpt.get(self.source(LM_HEAD), torch.float32), h)


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
              log: Callable[[str], None] = lambda m: None) -> CalibrationResult:
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
    return RUNS[cfg.scheme](model, source, ckpt, out, cfg, force=force, progress=progress, log=log)


def calibrate_int4(model: str | Path, source: Path, ckpt: Checkpoint, out: Path, cfg: CalibrationConfig, *,
                   force: bool, progress: Callable[..., None], log: Callable[[str], None]) -> CalibrationResult:
    """`--scheme w4a16`: int4 groups by RTN, GPTQ or AWQ, layer by layer."""
    # Before any data or weight is read: a group that does not fit, or an OUT that is there already,
    # used to stop calibration only after the dataset was read and tokenised.
    check_group_size(quantized_widths(ckpt, cfg), cfg.int4.group)
    check_output(Path(out), force=force, marker=REPORT, resumable=False)
    t0 = time.perf_counter()
    data = None
    if cfg.method_entry.needs_data:
        seq_len = cfg.seq_len or min(2048, ckpt.dims.max_positions)
        data = windows(str(cfg.dataset), source, num_samples=cfg.num_samples, seq_len=seq_len)
        for note in data.notes:
            log(note)
    with staged_output(Path(out), force=force, marker=REPORT, resumable=False) as stage:
        writer = ShardWriter(stage, rename=ckpt.layout_name)
        cal = Calibrator(ckpt, cfg, writer, progress, log)
        cal.run(data.samples if data else [])
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
            "compute_dtype": str(compute_dtype(cfg, ckpt)).removeprefix("torch.") if data else None,
            "seconds": round(time.perf_counter() - t0, 2), "quantized": len(cal.reports),
            "fell_back_to_rtn": [r.name for r in cal.reports if r.method == RTN.name and cal.method.needs_data],
            "mean_rtn_error": float(np.mean([e[0] for e in errs])) if errs else None,
            "mean_error": float(np.mean([e[1] for e in errs])) if errs else None,
            "layers": [{"layer": i, "seconds": round(s, 3),
                        "linears": [dataclasses.asdict(r) for r in cal.reports if f"layers.{i}." in r.name],
                        **({"experts": cal.experts[i]} if i in cal.experts else {})}
                       for i, s in enumerate(cal.layer_seconds)],
        }
        mark_written(stage, report, REPORT)
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
