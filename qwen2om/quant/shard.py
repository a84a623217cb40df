"""One calibration worker: a share of the samples' activations, carried from layer to layer.

The calibration driver (qwen2om/quant/calibrate.py) decides; workers compute. A worker holds the chunks
of samples it was given (qwen2om.quant.tree) in an ActivationStore, each at the layer whose input it
is, and per layer it

* `collect`s its chunks' statistics with the layer's float weights: every linear's Σxxᵀ, Σ|x| and
  token count, an MoE block's per-expert sums, summed along the canonical tree into the nodes its
  chunk ranges own;
* `solve`s the per-module quantisations it is handed (GPTQ, AWQ's clipped rounding);
* `advance`s its chunks through the layer once the driver sends the quantised result: the next layer's
  inputs come from the quantised weights, exactly as stored.

In one process the driver calls a ShardWorker directly; over Ray (qwen2om/quant/pool.py) each actor is
one. Everything it computes depends only on the chunk, the layer and the settings — never on which
worker, or how many, so any split of the chunks gives the same sums and the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

from qwen2om.families import Layer, family_of
from qwen2om.layerwise import ActivationStore, LayerRunner, LayerTensors, release_freed_memory
from qwen2om.quant.awq import clip_quantize
from qwen2om.quant.experts import ExpertCollector, set_expert_weight
from qwen2om.quant.fisher import HEAD_KEY, PLAIN, layer_backward, loss_gradient, weighted_gram
from qwen2om.quant.gptq import gptq, gram, output_error, output_errors
from qwen2om.quant.int4 import Int4Spec, dequantize, rtn
from qwen2om.quant.schemes import CalibrationError
from qwen2om.quant.tree import Node, Stats, range_sums, ranges
from qwen2om.static_model import Linear


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


class _Collected(Exception):
    """Raised by the last collecting hook: the rest of the layer's forward is not needed."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every worker computes with (the same everywhere, or the sums would differ)."""

    spec: Int4Spec
    searches_scales: bool  # AWQ: clipped rounding instead of GPTQ
    damp: float
    actorder: bool
    clip_ratios: tuple[float, ...]  # GPTQ's candidate clipping ratios ((1.0,): min-max only)
    dtype: str  # the layers' compute dtype
    device: str  # torch device: cpu, cuda:i, npu:i
    threads: int  # torch intra-op threads: float sums depend on how a product is split
    budget: int  # bytes of activations in memory before spilling
    spill_dir: str | None = None
    hessian: str = PLAIN  # or loss-weighted: fisher, fisher-heads (qwen2om/quant/fisher.py)


@dataclasses.dataclass
class Job:
    """One weight to quantise from its Hessian: [out, in] float32, and mean 2xxᵀ [in, in]."""

    name: str
    w: torch.Tensor
    h: torch.Tensor
    scale_dtype: torch.dtype
    rtn_error: float | None = None  # AWQ: the RTN error of the weight before its scaling


@dataclasses.dataclass
class Solved:
    name: str
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32, the stored dtype's values
    zp: torch.Tensor
    method: str
    note: str
    rtn_error: float | None
    error: float | None


def solve(job: Job, s: Settings, device: torch.device) -> Solved:
    """GPTQ (or AWQ's clipped rounding) of one weight, with the RTN error it is compared with."""
    if job.h.dim() == 3:
        return solve_heads(job, s, device)
    w, h = job.w.to(device), job.h.to(device)
    note, method = "", "awq" if s.searches_scales else "gptq"
    if s.searches_scales:
        q, scale, zp = clip_quantize(w, h, s.spec, scale_dtype=job.scale_dtype)
    else:
        try:
            r = gptq(w, h, s.spec, damp=s.damp, actorder=s.actorder, scale_dtype=job.scale_dtype, name=job.name,
                     clip_ratios=s.clip_ratios)
        except ValueError as e:
            raise CalibrationError(str(e)) from None
        q, scale, zp, method, note = r.q, r.scale, r.zp, r.method, r.note
    w_hat = dequantize(q, scale, zp if not s.spec.symmetric else None, s.spec.group)
    if job.rtn_error is None:
        q0, s0, z0 = rtn(w, s.spec, job.name)
        rtn_err, err = output_errors(w, h, [dequantize(q0, s0.to(job.scale_dtype).float(), z0, s.spec.group), w_hat])
    else:
        rtn_err, err = job.rtn_error, output_error(w, w_hat, h)
    return Solved(job.name, q.cpu(), scale.cpu(), zp.cpu(), method, note, rtn_err, err)


def solve_heads(job: Job, s: Settings, device: torch.device) -> Solved:
    """GPTQ of a weight whose row blocks (attention heads) each have their own Hessian h [heads, K, K]:
    each block solved alone; the errors are the blocks' summed, relative to the whole weight's."""
    heads = job.h.shape[0]
    rows = job.w.shape[0] // heads
    parts = [solve(dataclasses.replace(job, name=f"{job.name} head {i}", w=job.w[i * rows:(i + 1) * rows],
                                       h=job.h[i]), s, device) for i in range(heads)]
    dens = [float(((w @ h.float()) * w).sum(dtype=torch.float64))
            for w, h in ((job.w[i * rows:(i + 1) * rows].float(), job.h[i]) for i in range(heads))]
    total = sum(dens)

    def joined(errors: list[float | None]) -> float | None:
        if None in errors:
            return None
        return sum(e * d for e, d in zip(errors, dens, strict=True) if e is not None) / total if total > 0 else 0.0
    notes = [f"head {i}: {p.note}" for i, p in enumerate(parts) if p.note]
    method = next((p.method for p in parts if p.note), parts[0].method)  # a head that fell back says so
    return Solved(job.name, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                  torch.cat([p.zp for p in parts]), method, "; ".join(notes), joined([p.rtn_error for p in parts]),
                  joined([p.error for p in parts]))


@dataclasses.dataclass
class LayerResult:
    """A calibrated layer, as every worker applies it and the journal keeps it: int4 weights as
    (q, scale, zero point) in the order they are written, and the float tensors AWQ changed."""

    index: int
    int4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    floats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # as stored
    order: list[str] = dataclasses.field(default_factory=list)  # write order of both
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # reports, experts, seconds, workers


def layer_linears(layer: torch.nn.Module, prefix: str) -> dict[str, Linear]:
    """The layer's Linear modules by weight name (`model.layers.3.mlp.up_proj.weight`)."""
    return {f"{prefix}{n}.weight": m for n, m in layer.named_modules() if isinstance(m, Linear)}


def apply_result(layer: torch.nn.Module, prefix: str, result: LayerResult, spec: Int4Spec,
                 parse_expert: Callable[[str], tuple[int, int, str] | None]) -> None:
    """Put the result's quantised values (dequantised, exactly as stored) and AWQ's floats into `layer`."""
    linears = layer_linears(layer, prefix)
    modules = dict(layer.named_modules())
    for name, t in result.floats.items():
        module, attr = name.removeprefix(prefix).rsplit(".", 1)
        param = getattr(modules[module], attr)
        if attr == "weight" and isinstance(modules[module], Linear):  # stored [out, in], held [in, out]
            t = t.T.contiguous()
        param.data = t.to(param.device, param.dtype)
    for name, (q, scale, zp) in result.int4.items():
        w_hat = dequantize(q, scale, zp if not spec.symmetric else None, spec.group)
        parsed = parse_expert(name)
        if parsed is not None:
            _, e, proj = parsed
            set_expert_weight(layer.mlp, e, proj, w_hat.to(layer.mlp.experts.down.device))
        else:
            m = linears[name]
            m.weight.data = w_hat.T.contiguous().to(m.weight.device, m.weight.dtype)


def fetch(box: list[Any]) -> Any:
    """A value passed in a one-element list: inline, or a Ray ObjectRef fetched only when needed (Ray
    resolves a bare ObjectRef argument before the call, a nested one is left to the callee)."""
    value = box[0]
    if isinstance(value, (dict, LayerResult)) or value is None:
        return value
    import ray

    return ray.get(value)


P = ParamSpec("P")
R = TypeVar("R")


def _trimmed(step: Callable[P, R]) -> Callable[P, R]:
    """A worker's layer step, after which the heap's freed pages go back to the system: without it a
    worker's resident memory creeps up with the number of layers (qwen2om.layerwise.release_freed_memory)."""
    @functools.wraps(step)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return step(*args, **kwargs)
        finally:
            release_freed_memory()
    return run


class ShardWorker:
    """A worker's chunks and the layer it is on. Chunk c holds samples `self.samples[c]` as one
    [B, T, H] float32 array, at layer `self.level[c]` (the layer whose input it is)."""

    def __init__(self, header: LayerTensors, settings: Settings) -> None:
        torch.set_num_threads(settings.threads)
        self.s = settings
        self.device = torch.device(settings.device)
        self.runner = LayerRunner(dataclasses.replace(header, tensors={}), dtype=getattr(torch, settings.dtype),
                                  budget=settings.budget, device=self.device,
                                  spill_dir=None if settings.spill_dir is None else Path(settings.spill_dir))
        self.family = family_of(header.arch)
        self.store = ActivationStore(settings.budget, self.runner.spill_dir)
        self.samples: dict[int, list[int]] = {}
        self.tokens: dict[int, np.ndarray] = {}  # token ids [B, T] per chunk: the loss of --hessian fisher
        self.level: dict[int, int] = {}
        # --hessian fisher: every layer's input, kept for the backward pass on disk (budget 0): in memory they
        # would grow with the model's depth
        self.saved = ActivationStore(0, self.runner.spill_dir)
        self.grads = ActivationStore(settings.budget, self.runner.spill_dir)  # and the loss gradient at one
        self.count = 0  # chunks in the whole calibration
        self.layer: Layer | None = None
        self.at: tuple[int, int] = (-1, -1)  # (layer index, result applied: 1) of self.layer

    # -- bookkeeping ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        host = socket.gethostname()
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            ip = ""
        return {"host": host, "ip": ip, "pid": os.getpid(), "device": str(self.device),
                "threads": torch.get_num_threads()}

    def peak_rss(self) -> int:
        """This process's peak resident memory in bytes (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def chunks(self) -> list[int]:
        return sorted(self.samples)

    def close(self) -> None:
        for store in (self.store, self.saved, self.grads):
            store.close()
        self.layer = None

    # -- work -----------------------------------------------------------------------------------
    def embed(self, count: int, chunks: dict[int, tuple[list[int], np.ndarray]], unique: np.ndarray,
              rows: torch.Tensor) -> None:
        """Chunks' hidden states entering layer 0: `chunks[c]` = (sample ids, token ids [B, T]); `rows` are
        the embedding rows of `unique`, the sorted distinct token ids, as stored."""
        self.count = count
        rows = rows.to(self.runner.dtype).float()
        for c, (ids, tokens) in chunks.items():
            where = np.searchsorted(unique, tokens)
            self.store.put(c, rows[torch.from_numpy(where)].numpy())
            self.samples[c], self.level[c] = list(ids), 0
            if self.s.hessian != PLAIN:
                self.tokens[c] = tokens

    def _layer(self, index: int, box: list[Any], float_weights: bool = False) -> Layer:
        """Layer `index` (its float weights with `float_weights`), built from the tensors in `box` unless held."""
        if self.layer is None or self.at[0] != index or (float_weights and self.at[1]):
            tensors = fetch(box)
            if tensors is None:
                raise RuntimeError(f"layer {index}'s weights were not sent to a worker that does not hold them")
            self.layer = None
            self.runner.ckpt.tensors = tensors
            self.layer = self.runner.layer(index)
            self.runner.ckpt.tensors = {}
            self.at = (index, 0)
        return self.layer

    def _final_norm(self, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The final norm built from its tensors, on this worker's device."""
        self.runner.ckpt.tensors = tensors
        norm = self.family.norm(self.runner.weights(), self.family.names.final_norm, self.runner.d.rms_eps)
        self.runner.ckpt.tensors = {}
        return norm.to(self.device)

    def _input(self, c: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.store.get(c)))

    @_trimmed
    def collect(self, index: int, box: list[Any], names: list[str], experts: bool, whole: bool,
                weights_box: list[Any] | None = None) -> tuple[dict[Node, Stats], dict[str, str]]:
        """Layer `index`'s statistics over this worker's chunks, as tree nodes; and which linears share
        an input (name → the name its sums are kept under). With `weights_box` (--hessian fisher: per
        chunk, each linear's token weights, `fisher_backward`'s), every linear's Σ w·xxᵀ and Σ w instead,
        none shared."""
        weighted = fetch(weights_box) if weights_box is not None else None
        layer = self._layer(index, box, float_weights=True)
        prefix = f"{self.family.names.layer(index)}."
        linears = {n: m for n, m in layer_linears(layer, prefix).items() if n in names}
        if missing := [n for n in names if n not in linears]:
            raise CalibrationError(f"cannot place {missing[:3]} in layer {index}'s modules")
        collector = ExpertCollector(layer.mlp) if experts else None
        aliases: dict[str, str] = {}
        # A dense layer's forward stops once every linear has seen its input: the rest (down_proj's
        # product, the residual) feeds nothing collected, and is a fifth of the pass.
        stop_early = collector is None and bool(linears) and not whole
        bad = [c for c in self.chunks() if self.level[c] != index]
        if bad:
            raise RuntimeError(f"chunks {bad[:4]} are at layer {self.level[bad[0]]}, not {index}")

        def chunk(c: int) -> Stats:
            sums: Stats = {}
            last: list[Any] = [None, ""]  # q/k/v (and gate/up) are called with one input: summed once
            fired: set[str] = set()

            def hook(name: str) -> Callable[..., None]:
                def accumulate(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                    if last[0] is not args[0] or weighted is not None:
                        short = name.removeprefix(prefix).removesuffix(".weight")
                        _finite_or_raise(args[0], index, self.samples[c], f"the input of {short}")
                        x = args[0].reshape(-1, args[0].shape[-1]).float()
                        last[0], last[1] = args[0], name
                        if weighted is None:
                            sums[f"h:{name}"] = gram(x)
                            sums[f"n:{name}"] = torch.tensor(x.shape[0], dtype=torch.int64)
                        else:
                            w = weighted[c][name].to(x.device)
                            sums[f"h:{name}"] = weighted_gram(x, w)
                            sums[f"n:{name}"] = w.sum(0, dtype=torch.float64)
                        sums[f"a:{name}"] = x.abs().sum(0)
                    aliases[name] = last[1]
                    fired.add(name)
                    if stop_early and len(fired) == len(linears):
                        raise _Collected
                return accumulate

            handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
            if collector is not None:
                handles.append(collector.moe.register_forward_pre_hook(collector.hook))
            try:
                with torch.no_grad():
                    try:
                        _finite_or_raise(self.runner.forward(layer, self._input(c)), index, self.samples[c],
                                         "its output")
                    except _Collected:
                        pass
            finally:
                for h in handles:
                    h.remove()
            if collector is not None:
                sums |= collector.sums
                collector.reset()
            return sums

        nodes: dict[Node, Stats] = {}
        for a, b in ranges(self.chunks()):
            nodes |= range_sums(a, b, self.count, chunk)
        return {k: {n: t.cpu() for n, t in v.items()} for k, v in nodes.items()}, aliases

    @_trimmed
    def solve(self, jobs: list[Job]) -> list[Solved]:
        return [solve(j, self.s, self.device) for j in jobs]

    @_trimmed
    def advance(self, index: int, box: list[Any], result_box: list[Any]) -> int:
        """The chunks at layer `index` through it with the result applied; returns how many moved."""
        layer = self._layer(index, box)
        if not self.at[1]:
            result: LayerResult = fetch(result_box)
            apply_result(layer, f"{self.family.names.layer(index)}.", result, self.s.spec,
                         self.family.names.parse_expert)
            self.at = (index, 1)
        moved = 0
        with torch.no_grad():
            for c in self.chunks():
                if self.level[c] != index:
                    continue
                y = self.runner.forward(layer, self._input(c))
                _finite_or_raise(y, index, self.samples[c], "its output with the quantised weights")
                self.store.put(c, y.float().cpu().numpy())  # the store holds float32 whatever the compute
                self.level[c] = index + 1
                moved += 1
        return moved

    @_trimmed
    def head(self, box: list[Any]) -> dict[Node, Stats]:
        """The final norm's outputs' Σxxᵀ and token count (the LM head's GPTQ Hessian), as tree nodes."""
        norm = self._final_norm(fetch(box))

        def chunk(c: int) -> Stats:
            with torch.no_grad():
                x = norm(self._input(c).to(self.device)).reshape(-1, self.runner.d.hidden).float()
            return {"h": x.T @ x, "n": torch.tensor(x.shape[0], dtype=torch.int64)}

        nodes: dict[Node, Stats] = {}
        for a, b in ranges(self.chunks()):
            nodes |= range_sums(a, b, self.count, chunk)
        return {k: {n: t.cpu() for n, t in v.items()} for k, v in nodes.items()}

    # -- --hessian fisher: the loss gradients' pass (qwen2om/quant/fisher.py) ----------------------
    @_trimmed
    def fisher_forward(self, index: int, box: list[Any]) -> int:
        """The chunks at layer `index` through its float weights, each input kept for the backward pass."""
        layer = self._layer(index, box, float_weights=True)
        moved = 0
        with torch.no_grad():
            for c in self.chunks():
                if self.level[c] != index:
                    continue
                x = self._input(c)
                self.saved.put(index * self.count + c, x.numpy())
                y = self.runner.forward(layer, x)
                _finite_or_raise(y, index, self.samples[c], "its output")
                self.store.put(c, y.float().cpu().numpy())
                self.level[c] = index + 1
                moved += 1
        return moved

    @_trimmed
    def fisher_head(self, box: list[Any]) -> int:
        """The summed next-token loss's gradient at every chunk's last hidden state (the final norm and the
        head, `HEAD_KEY` in `box`'s tensors)."""
        tensors = dict(fetch(box))
        head = tensors.pop(HEAD_KEY).to(self.device)  # as stored: cast a block of rows at a time
        norm = self._final_norm(tensors)
        for p in norm.parameters():
            p.requires_grad_(False)
        for c in self.chunks():
            self.grads.put(c, loss_gradient(self._input(c), self.tokens[c], norm, head, self.runner.dtype).numpy())
        return len(self.chunks())

    @_trimmed
    def fisher_backward(self, index: int, box: list[Any], cols: dict[str, int],
                        ) -> dict[int, dict[str, torch.Tensor]]:
        """Layer `index` backward over every chunk from its saved input: the gradient handed down to the
        layer before, and each linear `cols` names its token weights [B·T, cols]. At layer 0 the chunks'
        inputs are put back, for the calibration to start from."""
        layer = self._layer(index, box, float_weights=True)
        prefix = f"{self.family.names.layer(index)}."
        linears = {n: m for n, m in layer_linears(layer, prefix).items() if n in cols}
        if missing := [n for n in cols if n not in linears]:
            raise CalibrationError(f"cannot place {missing[:3]} in layer {index}'s modules")
        out: dict[int, dict[str, torch.Tensor]] = {}
        for c in self.chunks():
            key = index * self.count + c
            x = torch.from_numpy(np.array(self.saved.get(key)))
            grad = torch.from_numpy(np.array(self.grads.get(c)))
            g, out[c] = layer_backward(lambda t: self.runner.forward(layer, t), layer, x, grad, linears, cols)
            _finite_or_raise(g, index, self.samples[c], "the loss gradient at its input")
            self.grads.put(c, g.numpy())
            if index == 0:
                self.store.put(c, x.numpy())
                self.level[c] = 0
            self.saved.drop(key)
        if index == 0:
            self.grads.close()
        return out
