#!/usr/bin/env python3
"""Run a qwen2om output directory with numpy, onnxruntime and tokenizers only.

This file is both `qwen2om.runtime.standalone` and, copied verbatim, `OUT/run.py`: it must not
import torch, transformers or qwen2om. It reads `manifest.json` beside the graphs for the
I/O signature, owns one preallocated KV cache per layer, and after each call writes only the
new tokens' K/V into it (no concatenation, no copy of the whole cache per step); a Qwen3.5 /
Qwen3-Next hybrid's linear-attention layers instead take their conv and recurrent states whole and
return them updated, and the engine copies back the rows a call fed. Long prompts
are prefilled chunk by chunk; the first chunk is left-padded so every chunk's last row is a
real token and the prefill graph may return the last position's logits only.

Two backends run the graphs behind one small interface (`gears`, `inputs`, `run`, `append`), so
the generation logic is shared: ONNX Runtime on the ONNX files (default), or pyACL on an Ascend
NPU (`--backend acl`) with the ATC-compiled `OUT/ascend/model.<kind>.om`, the KV cache and the
scale inputs kept in device memory and the new K/V appended device to device. pyACL (`acl`,
from CANN) is imported only when that backend is chosen.

A staged OUT (`convert --stages K`) runs its stages in order in this process, or with
`--distributed ray` one Ray actor per stage, on this host or across a cluster (`--address`), each
keeping its stage's caches; Ray is imported only then.

`--chat` renders the conversation with the checkpoint's own chat template (OUT/chat_template.jinja or
tokenizer_config.json's), as transformers' apply_chat_template does, in a Jinja sandbox (jinja2 is
imported only then); a directory without one gets ChatML.

    python OUT/run.py --prompt "Hello" --max-new-tokens 32 --greedy
    python OUT/run.py --prompt "Hello" --backend acl --device 0
    python OUT/run.py --prompt "Hello" --distributed ray --address HEAD:6379
    python OUT/run.py --messages chat.json --tools tools.json --no-thinking --print-prompt
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

# The chat format of a directory without a chat template (Qwen's own, ChatML): one turn per message.
CHATML_TURN = "<|im_start|>{role}\n{content}<|im_end|>\n"
CHATML_ASSISTANT = "<|im_start|>assistant\n"


class RuntimeInputError(ValueError):
    """A prompt, token ids or buffers the compiled model cannot take."""


class BackendError(RuntimeInputError):
    """The chosen backend cannot run here (pyACL missing), or its compiled model does not fit manifest.json."""


PAST_ROLES, PRESENT_ROLES = ("past_key", "past_value"), ("present_key", "present_value")
# ONNX Runtime decode graphs: the attention kernel's whole cache, bound to the past input's own buffer.
CACHE_ROLES = ("cache_key", "cache_value")
# Hybrids' linear-attention layers: whole states in, whole updated states out, copied back per row.
STATE_ROLES = ("conv_state", "recurrent_state")
PRESENT_STATE_ROLES = ("present_conv_state", "present_recurrent_state")
# Pipeline stages (convert --stages): hidden states [B, T, hidden] in from the stage before, out to the next.
HIDDEN_ROLES = ("hidden_in", "hidden_out")


# C0/C1 controls (ESC starts terminal sequences) and the bidirectional overrides ("Trojan Source"):
# names from a checkpoint or output directory are printed with these made visible, never obeyed.
_HIDDEN = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}
_HIDDEN.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: str) -> str:
    """`text` with terminal control characters escaped, so a printed name shows what it is."""
    return text.translate(_HIDDEN)


RUNTIME_KEYS = ("capacity", "batch", "vocab", "dtype")


def load_manifest(model_dir: Path) -> dict:
    """OUT/manifest.json as JSON, from a regular file (a FIFO would block the read), named when it is
    missing or unreadable. Its structure is check_manifest's; what it names, check_confined's."""
    path = Path(model_dir) / "manifest.json"
    if not path.is_file():  # False for a FIFO or device too: nothing is opened
        raise RuntimeInputError(f"{model_dir}: no manifest.json (is this a qwen2om output directory?)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RuntimeInputError(f"{path}: cannot read the manifest ({printable(str(e))[:200]})") from None


def check_manifest(model_dir: Path, manifest: object) -> None:
    """The parts of manifest.json the engine reads, by name: a damaged or foreign manifest is reported
    here, not as a KeyError from deep inside the engine."""
    where = f"{model_dir}/manifest.json"
    if not isinstance(manifest, dict):
        raise RuntimeInputError(f"{where} is not a JSON object")
    rt, graphs = manifest.get("runtime"), manifest.get("graphs")
    if not isinstance(rt, dict) or any(k not in rt for k in RUNTIME_KEYS):
        raise RuntimeInputError(f"{where}: no 'runtime' section with {', '.join(RUNTIME_KEYS)} (not written by "
                                "qwen2om, or damaged: convert again)")

    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    bad = [k for k in ("capacity", "batch", "vocab", "pad_token_id", "layers") if k in rt and not count(rt[k])]
    bad += ["dtype"] * (rt["dtype"] not in ("float32", "float16"))
    ids = rt.get("eos_token_ids", [])
    bad += ["eos_token_ids"] * (not isinstance(ids, list) or not all(count(i) for i in ids))
    if bad or not rt["batch"] or not rt["capacity"]:
        raise RuntimeInputError(f"{where}: runtime {', '.join(bad) or 'capacity/batch'} damaged (convert again)")
    if "split" in manifest:  # a staged OUT (convert --stages): each stage's folder has its own graphs
        check_split(where, manifest["split"])
    elif not isinstance(graphs, dict) or not graphs or not all(
            isinstance(g, dict) and isinstance(g.get("file"), str) and isinstance(g.get("inputs"), list)
            and isinstance(g.get("outputs"), list) for g in graphs.values()):
        raise RuntimeInputError(f"{where}: 'graphs' must name at least one graph, each with its file, inputs and "
                                "outputs (damaged: convert again)")
    files = manifest.get("files", [])
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("bytes"), int) for f in files):
        raise RuntimeInputError(f"{where}: 'files' must list each file's name and bytes (damaged: convert again)")


def check_split(where: str, split: object) -> None:
    """A staged OUT's `split`: its id and the stages, each a layer range and a folder, in order."""
    ok = isinstance(split, dict) and isinstance(split.get("id"), str) and isinstance(split.get("stages"), list)
    stages = split.get("stages") if isinstance(split, dict) else None
    ok = ok and bool(stages) and all(
        isinstance(s, dict) and s.get("index") == i and isinstance(s.get("dir"), str)
        and isinstance(s.get("layers"), list) for i, s in enumerate(stages or []))
    if not ok:
        raise RuntimeInputError(f"{where}: 'split' must give the conversion's id and its stages in order, each with "
                                "its folder and layers (damaged: convert again)")


def check_confined(model_dir: Path, manifest: dict) -> None:
    """Every graph and file a (check_manifest-checked) manifest names lies inside `model_dir`: an absolute
    or ../ entry would have the runtime run, or qwen2om read, a file from elsewhere."""
    root = Path(model_dir).resolve()
    names = {spec["file"] for spec in manifest.get("graphs", {}).values()}
    names |= {f["name"] for f in manifest.get("files", [])}
    names |= {s["dir"] for s in manifest.get("split", {}).get("stages", [])}
    for name in sorted(names):
        if not (root / name).resolve().is_relative_to(root):
            raise RuntimeInputError(f"{model_dir}/manifest.json names {printable(repr(name))}, outside {model_dir}: "
                                    "refusing to read it")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_files(model_dir: Path, manifest: dict, *, hashes: bool = False) -> None:
    """The files ONNX Runtime will read (graphs, their external data, the tokenizer) are regular files
    inside `model_dir` at the sizes manifest.json recorded (with `hashes`, every listed file also at its
    sha256: a file changed at the same size is found too): a damaged directory is named here, instead of
    failing inside ONNX Runtime or tokenizers with a message that names no file. Sizes skip
    scales.safetensors: scales are inputs so that they can be replaced, and `load_scales` names what a
    replaced file lacks; `hashes` checks it like any other file."""
    check_manifest(model_dir, manifest)
    check_confined(model_dir, manifest)
    graphs = {spec["file"] for spec in manifest.get("graphs", {}).values()}
    for name in sorted(graphs):
        path = model_dir / name
        if not path.exists():
            raise RuntimeInputError(f"{path} is missing: {model_dir} is incomplete (convert again)")
        if not stat.S_ISREG(path.stat().st_mode):
            raise RuntimeInputError(f"{path} is not a regular file (a directory, FIFO or device): {model_dir} is "
                                    "damaged (convert again)")
    wanted = [f for f in manifest.get("files", []) if hashes or f["name"] in graphs
              or f["name"].endswith(".onnx.data") or f["name"] == "tokenizer.json"]
    for f in wanted:
        path = model_dir / f["name"]
        if not path.is_file():
            raise RuntimeInputError(f"{path} is missing: {model_dir} is incomplete (convert again)")
        if path.stat().st_size != f["bytes"]:
            raise RuntimeInputError(f"{path} is {path.stat().st_size:,} bytes, manifest.json says {f['bytes']:,}: "
                                    f"{model_dir} is damaged (convert again)")
        if hashes and sha256_of(path) != f.get("sha256"):
            raise RuntimeInputError(f"{path} does not have the sha256 manifest.json records: it changed after the "
                                    f"conversion ({model_dir} is damaged or was edited; convert again)")


def cache_targets(spec: dict) -> list[tuple[dict, str]]:
    """Each present output of a graph, with the name of the past input its new tokens are appended to."""
    past = {(io["role"], io.get("layer")): io["name"] for io in spec["inputs"] if io["role"] in PAST_ROLES}
    return [(io, past[(io["role"].replace("present_", "past_"), io.get("layer"))])
            for io in spec["outputs"] if io["role"] in PRESENT_ROLES]


def shared_caches(spec: dict) -> dict[str, str]:
    """Each cache output (`cache_key/value.{i}`) → the past input whose buffer it is bound to: ONNX Runtime's
    attention kernel then sees one buffer as past and present, reads it in place and writes only the new
    token's slot (the slot the runtime writes too, from the present output, after the call)."""
    past = {(io["role"], io.get("layer")): io["name"] for io in spec["inputs"] if io["role"] in PAST_ROLES}
    return {io["name"]: past[(io["role"].replace("cache_", "past_"), io.get("layer"))]
            for io in spec["outputs"] if io["role"] in CACHE_ROLES}


def state_targets(spec: dict) -> list[tuple[dict, str]]:
    """Each updated-state output of a graph, with the name of the state input it replaces."""
    state = {(io["role"], io.get("layer")): io["name"] for io in spec["inputs"] if io["role"] in STATE_ROLES}
    return [(io, state[(io["role"].replace("present_", ""), io.get("layer"))])
            for io in spec["outputs"] if io["role"] in PRESENT_STATE_ROLES]


def pick_gear(gears: Sequence[int], n: int, kind: str) -> int:
    """The smallest compiled token count that holds `n` new tokens (the call is left-padded to it)."""
    for t in sorted(gears):
        if t >= n:
            return t
    raise RuntimeInputError(f"a {kind} call of {n} tokens is outside the compiled range: the {kind} model takes "
                            f"{', '.join(map(str, sorted(gears)))} tokens per call")


class GraphCall(Protocol):
    """What the engine needs from one compiled graph, whatever runs it (ONNX Runtime or pyACL)."""

    tokens: int  # the signature's T: the most new tokens one call takes
    gears: tuple[int, ...]  # the token counts a call can have (static graphs: only `tokens`)

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        """Host arrays input_ids, position_ids, attention_mask shaped for `t` tokens, to fill before `run`."""
        ...

    def run(self, t: int) -> np.ndarray:
        """One call on the filled inputs; the logits [B, Tl, V] on the host."""
        ...

    def append(self, writes: Sequence[tuple[int, int, int, int]]) -> None:
        """Append the last call's new K/V to the cache: (row, first real token, cache position, count);
        hybrids: replace those rows' linear-attention states by the call's updated ones."""
        ...

    def clear_states(self) -> None:
        """Zero the linear-attention states (hybrids; nothing otherwise)."""
        ...

    def write_state(self, name: str, value: np.ndarray) -> None:
        """Overwrite the linear-attention state `name` (already checked against the signature)."""
        ...


# When neither the command line nor the checkpoint's generation_config.json says (Qwen's model cards
# recommend about these for non-thinking chat).
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}


def sampling_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling settings the checkpoint publishes (manifest `runtime.sampling`, from its
    generation_config.json), over qwen2om's own defaults; a damaged entry is left to Engine to name."""
    try:
        published = load_manifest(model_dir)["runtime"]["sampling"]
    except (RuntimeInputError, KeyError, TypeError):
        published = {}
    if not isinstance(published, dict):
        published = {}
    return {k: v for k, v in {**SAMPLING_DEFAULTS, **published}.items()
            if k in SAMPLING_DEFAULTS and isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclasses.dataclass
class Sampling:
    """Greedy when temperature is 0; otherwise temperature / top-k / top-p sampling, seeded."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Each of these used to sample something: a negative temperature inverts the distribution.
        if not self.temperature >= 0:
            raise RuntimeInputError(f"temperature {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise RuntimeInputError(f"top-k {self.top_k} must be >= 0 (0: no top-k cut)")
        if not 0 <= self.top_p <= 1:  # 0 keeps only the most likely token
            raise RuntimeInputError(f"top-p {self.top_p} must be in [0, 1] (1: no nucleus cut)")
        self.rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < len(z):
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < self.top_p
            keep[0] = True  # the most likely token always stays, whatever top_p is
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(len(p), p=p))


@dataclasses.dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first new token comes from the prefill logits; decode steps produce the rest.
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def line(self) -> str:
        """Speeds for the work done only: none when nothing ran (--max-new-tokens 0), no decode speed
        when the one new token came from the prefill."""
        if not self.new_tokens:
            return f"prompt {self.prompt_tokens} tok, nothing generated (no graph run) | stop: {self.stop}"
        prefill = (f"prefill {self.prompt_tokens} tok in {self.prefill_s * 1000:.0f} ms "
                   f"({self.prefill_tps:.1f} tok/s, time to first token {self.prefill_s * 1000:.0f} ms)")
        decode = (f"decode {self.new_tokens} tok at {self.decode_tps:.1f} tok/s" if self.new_tokens > 1
                  else "1 tok, from the prefill (no decode step)")
        return f"{prefill} | {decode} | stop: {self.stop}"


# Prompts of at most (smallest prefill chunk // SHORT_PROMPT) tokens are fed through the decode graph.
SHORT_PROMPT = 16

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as numpy arrays (the format is a JSON header and raw little-endian data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, spec in header.items():
        begin, end = spec["data_offsets"]
        dtype = SAFETENSORS_DTYPES[spec["dtype"]]
        out[name] = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=dtype).reshape(spec["shape"]).copy()
    return out


def load_scales(model_dir: Path, inputs: list[dict]) -> dict[str, np.ndarray]:
    """The scale inputs' values from scales.safetensors, checked against the graph before any call."""
    wanted = [io for io in inputs if io["role"] == "scale"]
    if not wanted:
        return {}
    path = model_dir / "scales.safetensors"
    if not path.is_file():
        raise RuntimeInputError(f"{path}: missing; the graphs take {len(wanted)} scale inputs from it")
    values = read_safetensors(path)
    out = {}
    for io in wanted:
        v = values.get(io["name"])
        if v is None:
            raise RuntimeInputError(f"{path} has no {io['name']!r}, a scale input the graph needs")
        if list(v.shape) != list(io["shape"]) or v.dtype != np.dtype(io["dtype"]):
            raise RuntimeInputError(f"{path}: {io['name']!r} is {v.dtype}{list(v.shape)}, the graph takes "
                                    f"{io['dtype']}{list(io['shape'])}")
        out[io["name"]] = v
    return out


class _Graph:
    """One ONNX Runtime session with every input and output bound to a persistent numpy buffer.

    A graph converted with prefill gears (manifest `gears`) has a symbolic token axis: it is bound once
    per gear, its token-sized buffers viewed at that gear's shape over one allocation of the largest, so
    a short chunk runs at the smallest gear that holds it, as on the NPU."""

    def __init__(self, path: Path, spec: dict, caches: dict[str, np.ndarray], options: ort.SessionOptions,
                 providers: Sequence[str]) -> None:
        self.tokens = int(spec["tokens"])
        # Static shapes: every call carries exactly `tokens`, left-padded; with gears, the smallest that holds it.
        self.gears = tuple(sorted(int(g) for g in spec.get("gears") or [self.tokens]))
        try:
            self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        except Exception as e:
            if any(op in str(e) for op in ("npu:", "WeightQuantBatchMatmulV2", "AscendAntiQuant")):  # --target ascend
                raise RuntimeInputError(
                    f"{path.name} holds Ascend ops (converted with --target ascend), which ONNX Runtime cannot run "
                    "by itself: use `qwen2om run DIR` (it runs them on CPU through qwen2om's reference kernels), "
                    "or --backend acl on the Ascend host") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeInputError(f"ONNX Runtime cannot load {path}: {first}") from None
        self._keep: list[ort.OrtValue] = []
        shared = shared_caches(spec)
        # Every buffer but the caches is one allocation of the largest call, viewed at each gear's shape.
        flat = {io["name"]: np.zeros(int(np.prod(io["shape"])), dtype=io["dtype"])
                for io in spec["inputs"] + spec["outputs"] if io["name"] not in caches and io["name"] not in shared}
        inputs = {io["name"] for io in spec["inputs"]}
        self.views: dict[int, dict[str, np.ndarray]] = {}
        self.bindings: dict[int, ort.IOBinding] = {}
        for t in self.gears:
            binding, views = self.session.io_binding(), {}
            for io in spec["inputs"] + spec["outputs"]:
                name, shape = io["name"], shape_at(io, t, self.tokens)
                cache = shared.get(name, name)
                buf = caches[cache] if cache in caches else flat[name][:int(np.prod(shape))].reshape(shape)
                value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares the numpy memory: no copies per call
                self._keep.append(value)
                views[name] = buf
                (binding.bind_ortvalue_input if name in inputs else binding.bind_ortvalue_output)(name, value)
            self.views[t], self.bindings[t] = views, binding
        self.buffers = self.views[self.gears[-1]]
        self.head = spec["outputs"][0]["name"]  # logits; a pipeline stage before the last: its hidden states
        # A shared cache already holds the new token: the kernel wrote it into its slot, the one `append`
        # would copy the present output to (tests/test_fuse_attention.py checks that slot), so skip it.
        self.presents = [(io["name"], caches[past]) for io, past in cache_targets(spec)
                         if past not in shared.values()]
        self.states = {name: (io["name"], caches[name]) for io, name in state_targets(spec)}
        self.t = self.gears[-1]

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        return self.views[t]

    def run(self, t: int) -> np.ndarray:
        if t not in self.bindings:
            raise RuntimeInputError(f"{t} tokens is not a gear of this graph ({', '.join(map(str, self.gears))})")
        self.session.run_with_iobinding(self.bindings[t])
        self.t = t
        return self.views[t][self.head]

    def append(self, writes: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy each write's new K/V `(row, first real token, cache position, count)` into the caches."""
        views = self.views[self.t]
        for name, cache in self.presents:
            new = views[name]
            for b, pad, start, n in writes:
                cache[b, :, start:start + n, :] = new[b, :, pad:pad + n, :]
        # Linear-attention states: the whole updated state, only for rows that fed real tokens (a row
        # with nothing in this call ran on pads only, and its old state must stay).
        for name, state in self.states.values():
            new = views[name]
            for b, _, _, _ in writes:
                state[b] = new[b]

    def clear_states(self) -> None:
        for _, state in self.states.values():
            state.fill(0)

    def write_state(self, name: str, value: np.ndarray) -> None:
        self.states[name][1][...] = value


# -- pyACL (Ascend NPU) backend ------------------------------------------------------------------
# Constants from CANN's acl.h: memory policy, memcpy kinds, "already initialised", and the input
# ATC adds to a model compiled with --dynamic_dims (ACL_DYNAMIC_TENSOR_NAME).
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE = 1, 2, 3
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"
STAGED_ROLES = ("ids", "positions", "mask", HIDDEN_ROLES[0])  # written by the host before every call
HEAD_ROLES = ("logits", HIDDEN_ROLES[1])  # what a call returns to the host: logits, or a stage's hidden states


def fill_call(buffers: dict[str, np.ndarray], rows: list[list[int]], lengths: np.ndarray, t: int, capacity: int,
              pad_id: int, mask_min: float) -> list[tuple[int, int, int, int]]:
    """Write one call's ids, positions and mask into `buffers` (a graph's inputs at `t` tokens): each row's
    tokens left-padded to `t`, at its current length; returns each row's write (row, first real token,
    cache position, count) for the append after the call."""
    ids, pos, mask = buffers["input_ids"], buffers["position_ids"], buffers["attention_mask"]
    p = capacity
    ids.fill(pad_id)
    pos.fill(0)
    mask.fill(mask_min)
    writes = []
    for b, toks in enumerate(rows):
        n, length = len(toks), int(lengths[b])
        if length + n > p:
            raise RuntimeInputError(f"row {b}: {length} cached + {n} new tokens exceed the capacity {p}")
        pad = t - n
        writes.append((b, pad, length, n))
        ids[b, pad:] = toks
        pos[b, pad:] = np.arange(length, length + n)
        mask[b, 0, pad:, :length] = 0  # the cached tokens
        causal = np.tril(np.ones((n, n), dtype=bool))
        mask[b, 0, pad:, p + pad:][causal] = 0  # the new tokens, causally
        for i in range(pad):  # pad rows see only themselves: a defined softmax, output discarded
            mask[b, 0, i, p + i] = 0
    return writes


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def shape_at(io: dict, t: int, tokens: int) -> list[int]:
    """An input's or output's shape in a call of `t` new tokens, from its signature shape at `tokens`."""
    s = list(io["shape"])
    if io["role"] in ("ids", "positions"):
        s[-1] = t
    elif io["role"] in HIDDEN_ROLES:  # a pipeline stage's hidden states [B, T, hidden]
        s[1] = t
    elif io["role"] == "mask":  # [B, 1, T, P + T]
        s[-2], s[-1] = t, s[-1] - tokens + t
    elif io["role"] in PRESENT_ROLES:  # [B, H, T, D]
        s[-2] = t
    elif io["role"] == "logits" and s[1] == tokens:  # all positions' logits, not only the last
        s[1] = t
    return s


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        raise BackendError(f"{what} failed with ACL error {ret}")


def _value(result: tuple[Any, int], what: str) -> Any:
    """pyACL returns `(value, ret)`: the value, once ret says it succeeded."""
    value, ret = result
    _ok(ret, what)
    return value


_CURRENT_CONTEXT: dict[int, int] = {}  # thread → the ACL context current on it (set by qwen2om)


class _AclDevice:
    """acl.init and one NPU, the device memory both graphs share, and a teardown stack that releases
    everything in reverse order (also when loading fails half-way)."""

    def __init__(self, acl: Any) -> None:
        self.acl = acl
        self._undo: list[Callable[[], object]] = []

    def open(self, device: int) -> None:
        acl = self.acl
        ret = acl.init()
        if ret != ACL_ERROR_REPEAT_INITIALIZE:  # already initialised (by torch-npu, say): not ours to finalize
            _ok(ret, "acl.init")
            self.defer(acl.finalize)
        _ok(acl.rt.set_device(device), f"acl.rt.set_device({device})")
        self.defer(lambda: acl.rt.reset_device(device))
        context = _value(acl.rt.create_context(device), "acl.rt.create_context")
        self.defer(lambda: (acl.rt.destroy_context(context), _CURRENT_CONTEXT.pop(threading.get_ident(), None)))
        self.context = _CURRENT_CONTEXT[threading.get_ident()] = context  # a new context is the current one

    def use(self) -> None:
        """Make this device's context the thread's current one (if it is not): a staged model drives one
        NPU per stage from one thread, and ACL runs each call on the current context's device."""
        if _CURRENT_CONTEXT.get(threading.get_ident()) != self.context:
            _ok(self.acl.rt.set_context(self.context), "acl.rt.set_context")
            _CURRENT_CONTEXT[threading.get_ident()] = self.context

    def defer(self, undo: Callable[[], object]) -> None:
        self._undo.append(undo)

    def close(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:  # keep releasing: an error here must not hide the one that got us here
                pass

    def malloc(self, size: int) -> int:
        ptr = _value(self.acl.rt.malloc(size, ACL_MEM_MALLOC_HUGE_FIRST), f"acl.rt.malloc({size})")
        self.defer(lambda: self.acl.rt.free(ptr))
        return ptr

    def copy(self, dst: int, dst_size: int, src: int, count: int, kind: int) -> None:
        _ok(self.acl.rt.memcpy(dst, dst_size, src, count, kind), "acl.rt.memcpy")

    def dataset(self, buffers: Sequence[tuple[int, int]]) -> int:
        """An aclmdlDataset over (device pointer, size) pairs, in model input/output order."""
        acl = self.acl
        ds = acl.mdl.create_dataset()
        self.defer(lambda: acl.mdl.destroy_dataset(ds))
        for ptr, size in buffers:
            buf = acl.create_data_buffer(ptr, size)
            self.defer(lambda buf=buf: acl.destroy_data_buffer(buf))
            _value(acl.mdl.add_dataset_buffer(ds, buf), "acl.mdl.add_dataset_buffer")
        return ds


class _AclGraph:
    """One ATC-compiled .om: input and output datasets built once over device buffers (the KV cache and
    scales shared with the other graph), host staging for ids/positions/mask, logits read back."""

    def __init__(self, dev: _AclDevice, path: Path, kind: str, spec: dict, shared: dict[str, int]) -> None:
        acl, self.dev, self.kind = dev.acl, dev, kind
        self.tokens = int(spec["tokens"])
        self.model = _value(acl.mdl.load_from_file(str(path)), f"acl.mdl.load_from_file({path})")
        dev.defer(lambda: acl.mdl.unload(self.model))
        desc = acl.mdl.create_desc()
        dev.defer(lambda: acl.mdl.destroy_desc(desc))
        _ok(acl.mdl.get_desc(desc, self.model), "acl.mdl.get_desc")
        index, ret = acl.mdl.get_input_index_by_name(desc, ACL_DYNAMIC_TENSOR_NAME)
        self.dynamic = index if ret == 0 else None
        om_in = [(acl.mdl.get_input_name_by_index(desc, i), acl.mdl.get_input_size_by_index(desc, i))
                 for i in range(acl.mdl.get_num_inputs(desc))]
        om_out = [acl.mdl.get_output_size_by_index(desc, i) for i in range(acl.mdl.get_num_outputs(desc))]
        data_in = [x for i, x in enumerate(om_in) if i != self.dynamic]
        check_om(path, kind, spec, data_in, om_out)
        self.gear_dims = self._gears(acl, desc, path, spec) if self.dynamic is not None else {}
        self.gears = tuple(sorted(self.gear_dims)) or (self.tokens,)
        self.specs = {io["name"]: io for io in spec["inputs"] + spec["outputs"]}
        self.staged = {io["name"]: np.zeros(int(np.prod(io["shape"])), dtype=io["dtype"])  # flat: views per gear
                       for io in spec["inputs"] if io["role"] in STAGED_ROLES}
        self.ptr: dict[str, int] = {}
        ins, names = [], iter(spec["inputs"])
        for i, (_, size) in enumerate(om_in):
            if i == self.dynamic:  # ATC's gear input: filled by acl.mdl.set_input_dynamic_dims
                ins.append((dev.malloc(size), size))
                continue
            name = next(names)["name"]
            self.ptr[name] = shared[name] if name in shared else dev.malloc(size)
            ins.append((self.ptr[name], size))
        outs = []
        for io, size in zip(spec["outputs"], om_out, strict=True):  # ATC renames outputs: matched by position
            self.ptr[io["name"]] = dev.malloc(size)
            outs.append((self.ptr[io["name"]], size))
        self.inputs_ds, self.outputs_ds = dev.dataset(ins), dev.dataset(outs)
        self.logits_io = next(io for io in spec["outputs"] if io["role"] in HEAD_ROLES)
        self.logits = np.zeros(self.logits_io["shape"], dtype=self.logits_io["dtype"]).reshape(-1)
        self.presents = [(io, self.ptr[io["name"]], shared[past], self.specs[past]) for io, past in cache_targets(spec)]
        # Hybrids: each updated state output, the shared device state it replaces, its bytes and batch.
        self.states = {name: (self.ptr[io["name"]], shared[name], _nbytes(io["shape"], io["dtype"]), io["shape"][0])
                       for io, name in state_targets(spec)}
        self.t = self.tokens

    def _gears(self, acl: Any, desc: int, path: Path, spec: dict) -> dict[int, dict]:
        """The compiled --dynamic_dims gears, by token count. ACL lists a gear as the concatenated shapes
        of the inputs (all of them, or only the dynamic ones: both forms are recognised)."""
        count = _value(acl.mdl.get_input_dynamic_gear_count(desc, -1), "acl.mdl.get_input_dynamic_gear_count")
        listed = _value(acl.mdl.get_input_dynamic_dims(desc, -1, count), "acl.mdl.get_input_dynamic_dims")
        known = {}
        for t in range(1, self.tokens + 1):
            for inputs in (spec["inputs"], [io for io in spec["inputs"] if io["role"] in STAGED_ROLES]):
                known[tuple(d for io in inputs for d in shape_at(io, t, self.tokens))] = t
        gears = {}
        for g in listed:
            dims = tuple(int(d) for d in g["dims"][:g.get("dimCount", len(g["dims"]))])
            if dims not in known:
                raise BackendError(f"{path}: compiled gear {list(dims)} matches no call of 1..{self.tokens} tokens "
                                   f"of manifest.json's {self.kind} graph; recompile with the ATC command in "
                                   f"{path.parent}")
            gears[known[dims]] = {"name": "", "dimCount": len(dims), "dims": list(dims)}
        return gears

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        """Host views of the staged inputs at `t` tokens, packed as the device expects them."""
        return {name: buf[:int(np.prod(s := shape_at(self.specs[name], t, self.tokens)))].reshape(s)
                for name, buf in self.staged.items()}

    def run(self, t: int) -> np.ndarray:
        acl, dev = self.dev.acl, self.dev
        if t not in self.gears:
            raise RuntimeInputError(f"{t} tokens is not a compiled gear of the {self.kind} model "
                                    f"({', '.join(map(str, self.gears))})")
        dev.use()
        for name, host in self.inputs(t).items():
            dev.copy(self.ptr[name], host.nbytes, host.ctypes.data, host.nbytes, ACL_MEMCPY_HOST_TO_DEVICE)
        if self.dynamic is not None:
            _ok(acl.mdl.set_input_dynamic_dims(self.model, self.inputs_ds, self.dynamic, self.gear_dims[t]),
                "acl.mdl.set_input_dynamic_dims")
        _ok(acl.mdl.execute(self.model, self.inputs_ds, self.outputs_ds), f"acl.mdl.execute ({self.kind})")
        self.t = t
        s = shape_at(self.logits_io, t, self.tokens)
        logits = self.logits[:int(np.prod(s))].reshape(s)
        dev.copy(logits.ctypes.data, logits.nbytes, self.ptr[self.logits_io["name"]], logits.nbytes,
                 ACL_MEMCPY_DEVICE_TO_HOST)
        return logits

    def append(self, writes: Sequence[tuple[int, int, int, int]]) -> None:
        """Append the last call's new K/V to the device caches, device to device: per row and head, a
        contiguous run of n·D values from present [B, H, t, D] into past [B, H, P, D]."""
        t = self.t
        self.dev.use()
        for io, src, dst, past in self.presents:
            _, heads, capacity, d = past["shape"]
            row = d * np.dtype(io["dtype"]).itemsize
            end = dst + _nbytes(past["shape"], past["dtype"])
            for b, pad, start, n in writes:
                for h in range(heads):
                    to = dst + ((b * heads + h) * capacity + start) * row
                    self.dev.copy(to, end - to, src + ((b * heads + h) * t + pad) * row, n * row,
                                  ACL_MEMCPY_DEVICE_TO_DEVICE)
        for src, dst, size, batch in self.states.values():  # whole rows, device to device
            row = size // batch
            for b, _, _, _ in writes:
                self.dev.copy(dst + b * row, size - b * row, src + b * row, row, ACL_MEMCPY_DEVICE_TO_DEVICE)

    def clear_states(self) -> None:
        self.dev.use()
        for _, dst, size, _ in self.states.values():
            _ok(self.dev.acl.rt.memset(dst, size, 0, size), "acl.rt.memset")

    def write_state(self, name: str, value: np.ndarray) -> None:
        self.dev.use()
        host = np.ascontiguousarray(value)
        _, dst, size, _ = self.states[name]
        self.dev.copy(dst, size, host.ctypes.data, size, ACL_MEMCPY_HOST_TO_DEVICE)


def check_om(path: Path, kind: str, spec: dict, inputs: list[tuple[str, int]], outputs: list[int]) -> None:
    """The .om takes what manifest.json says the graph takes: count, names and byte sizes of the inputs
    (the largest gear's), count and sizes of the outputs. Names the first mismatch."""
    where = f"{path} does not match manifest.json's {kind} graph"
    fix = "; recompile it with the ATC command in OUT/ascend/ from this conversion"
    if len(inputs) != len(spec["inputs"]):
        extra = [n for n, _ in inputs if n not in {io["name"] for io in spec["inputs"]}]
        lost = [io["name"] for io in spec["inputs"] if io["name"] not in {n for n, _ in inputs}]
        raise BackendError(f"{where}: it has {len(inputs)} inputs, the manifest {len(spec['inputs'])} "
                           f"(missing: {lost[:3]}, unexpected: {extra[:3]}){fix}")
    for i, ((name, size), io) in enumerate(zip(inputs, spec["inputs"], strict=True)):
        want = _nbytes(io["shape"], io["dtype"])
        if name != io["name"] or size != want:
            raise BackendError(f"{where}: input {i} is {name!r} of {size} bytes in the .om, {io['name']!r} "
                               f"{io['dtype']}{list(io['shape'])} ({want} bytes) in the manifest{fix}")
    if len(outputs) != len(spec["outputs"]):
        raise BackendError(f"{where}: it has {len(outputs)} outputs, the manifest {len(spec['outputs'])}{fix}")
    for i, (size, io) in enumerate(zip(outputs, spec["outputs"], strict=True)):
        if size != (want := _nbytes(io["shape"], io["dtype"])):
            raise BackendError(f"{where}: output {i} ({io['name']!r}, {io['dtype']}{list(io['shape'])}) is "
                               f"{size} bytes in the .om, {want} in the manifest{fix}")


def import_acl() -> Any:
    try:
        import acl  # CANN's pyACL: on PYTHONPATH once CANN's set_env.sh is sourced
    except ImportError as e:
        raise BackendError(f"pyACL (the `acl` module from CANN) is not installed: {e}. Use the ORT backend "
                           "(--backend ort), or install CANN and source its set_env.sh on the Ascend host") from None
    return acl


def open_acl(model_dir: Path, specs: dict, scales: dict[str, np.ndarray],
             device: int) -> tuple[dict[str, GraphCall], Callable[[], None]]:
    """Load OUT/ascend/model.<kind>.om for every graph on NPU `device`, with one device KV cache (zeroed:
    uninitialised memory may hold NaN, and 0·NaN in a masked slot would still poison attention) and the
    scale inputs copied up once. Returns the graphs and the teardown."""
    acl = import_acl()
    paths = {kind: model_dir / "ascend" / f"model.{kind}.om" for kind in specs}
    for kind, path in paths.items():
        if not path.is_file():
            raise BackendError(f"{path}: missing; compile the {kind} graph with the ATC command in {path.parent} "
                               "on a machine with CANN")
    dev = _AclDevice(acl)
    try:
        dev.open(device)
        shared = {}
        for io in next(iter(specs.values()))["inputs"]:
            if io["role"] in PAST_ROLES or io["role"] in STATE_ROLES or io["role"] == "scale":
                size = _nbytes(io["shape"], io["dtype"])
                shared[io["name"]] = ptr = dev.malloc(size)
                if io["role"] == "scale":
                    host = np.ascontiguousarray(scales[io["name"]])
                    dev.copy(ptr, size, host.ctypes.data, size, ACL_MEMCPY_HOST_TO_DEVICE)
                else:
                    _ok(acl.rt.memset(ptr, size, 0, size), "acl.rt.memset")
        graphs: dict[str, GraphCall] = {kind: _AclGraph(dev, paths[kind], kind, spec, shared)
                                        for kind, spec in specs.items()}
    except BaseException:
        dev.close()
        raise
    return graphs, dev.close


# -- chat templates ------------------------------------------------------------------------------
# A checkpoint's chat template is rendered as transformers' apply_chat_template renders it (same
# sandbox, filters, globals and message preparation), so `--chat` feeds the model the text it was
# trained on. It is untrusted code: sandboxed, and cut off after TEMPLATE_SECONDS.
TEMPLATE_SECONDS = 10.0  # the most one conversation may take to render
# The named special tokens transformers passes to every template (those that are set).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning comes under; transformers copies the first set one to `reasoning_content`
# (what Qwen templates read) and `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Jinja before 3.1.6 has known sandbox escapes; transformers refuses it for the same reason.
JINJA_MIN = (3, 1, 6)


class ChatTemplateError(RuntimeInputError):
    """A chat template that cannot be read, does not parse, raises or runs too long (its file named)."""


class TemplateTimeout(BaseException):
    """Raised by the alarm inside a template's render. A BaseException, so that no `except Exception`
    in jinja2 on the way out turns it into something else."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TemplateTimeout in the block after `seconds` of wall time (main thread only).

    Jinja compiles a template to Python loops whose bodies may call nothing (`{% for %}x{% endfor %}`),
    so the sandbox's call/attribute hooks cannot be relied on to see a runaway loop; a SIGALRM
    handler runs between any two bytecodes of it. Signals reach only the main thread (where the CLI
    renders), so elsewhere, and where there is no setitimer (Windows), the render runs unlimited.
    An outer alarm (pytest-timeout's, say) is put back afterwards with what was left of it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TemplateTimeout

    old_handler = signal.signal(signal.SIGALRM, expire) or signal.SIG_DFL  # None: set outside Python
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    began = time.monotonic()
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # still restored if the alarm fires on the line above (it fires once)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay:
                signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - began), 1e-3),
                                 old_interval)


def one_line(text: str, limit: int = 200) -> str:
    """A template's own message on one line, without terminal escapes, cut to `limit` characters."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("…" if len(text) > limit else "")


@functools.lru_cache(maxsize=1)
def chat_sandbox() -> Any:
    """The Jinja environment transformers renders chat templates in: immutable sandbox, trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, its own `tojson`, `dict` and
    `namespace`, and `{% generation %}` blocks (rendered as their body). jinja2 is imported only here:
    run.py without --chat, or on a directory without a template, does not need it."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise RuntimeInputError("rendering the model's chat template needs jinja2: pip install 'jinja2>=3.1.6'"
                                ) from None
    have = tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit())
    if have < JINJA_MIN:
        raise RuntimeInputError(f"jinja2 {jinja2.__version__} has known sandbox escapes and a chat template is "
                                "untrusted code: pip install 'jinja2>=3.1.6'")

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` tag marks assistant text for its masks; the text is its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Not jinja2's own tojson, which escapes <, >, & and ' for HTML: templates are written against this.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """`dict(...)` for templates without the type itself (no attribute route to its internals)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore names, as transformers' does (no route to dunders)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


def plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, as transformers hands a template its inputs: subclasses of
    str/int/float lose their extra methods, anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) would otherwise be a truthy placeholder
        return plain(value.item())
    return f"<{type(value).__name__}>"


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as transformers gives them to a template: keys whose value is None dropped (an API's
    `content: null` beside tool_calls), plain data, and the reasoning copied to `reasoning_content`
    and `thinking` from whichever of REASONING_FIELDS is set."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RuntimeInputError(f"message {i} is {type(m).__name__}, not an object with a role and content")
        m = plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def content_text(content: Any) -> str:
    """A message's content as text for ChatML: a string as it is, text parts joined, nothing as ''."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def read_template_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ChatTemplateError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({one_line(str(e))})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: not a JSON object")
    return data


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def named_templates(path: Path, value: Any) -> str | dict[str, str]:
    """A `chat_template` entry: one template, or several as [{name, template}] (or a {name: template} map)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ChatTemplateError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


@dataclasses.dataclass
class ChatTemplate:
    """A model directory's chat template (`source`, read from `file`) and the special tokens it is rendered
    with; `file` None: the directory has none, and conversations are formatted as ChatML."""

    file: Path | None
    source: str | dict[str, str] | None
    special_tokens: dict[str, str]
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate:
        """Where transformers' AutoTokenizer takes the template from: chat_template.jinja, else
        tokenizer_config.json's `chat_template`; then (a processor's file, e.g. Qwen2-VL's)
        chat_template.json. Special tokens from tokenizer_config.json, and from special_tokens_map.json
        where transformers still reads that legacy file (a config without added_tokens_decoder)."""
        root = Path(model_dir)
        config_path = root / "tokenizer_config.json"
        config = read_template_json(config_path) if config_path.is_file() else {}
        sources = [config]
        legacy = root / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and legacy.is_file():
            sources.append(read_template_json(legacy))
        special = {k: t for src in sources for k in SPECIAL_TOKEN_NAMES if (t := token_text(src.get(k))) is not None}
        jinja = root / "chat_template.jinja"
        if jinja.is_file():
            try:
                return cls(jinja, jinja.read_text(encoding="utf-8"), special)
            except (OSError, UnicodeDecodeError) as e:
                raise ChatTemplateError(f"{jinja}: cannot read the chat template ({one_line(str(e))})") from None
        if config.get("chat_template") is not None:
            return cls(config_path, named_templates(config_path, config["chat_template"]), special)
        processor = root / "chat_template.json"
        if processor.is_file():
            data = read_template_json(processor)
            if data.get("chat_template") is not None:
                return cls(processor, named_templates(processor, data["chat_template"]), special)
        return cls(None, None, special)

    def pick(self, tools: Any) -> tuple[str, str]:
        """(name, text) of the template to render: with several, `tool_use` when tools are given and it
        exists, else `default` (transformers' choice)."""
        assert self.source is not None
        if isinstance(self.source, str):
            return "", self.source
        for name in (("tool_use",) if tools is not None else ()) + ("default",):
            if name in self.source:
                return name, self.source[name]
        raise ChatTemplateError(f"{self.file}: several chat templates ({', '.join(sorted(self.source))}) and none "
                                "named 'default'")

    def render(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, seconds: float = TEMPLATE_SECONDS) -> str:
        """The conversation as the model reads it. `enable_thinking` None leaves the template's default;
        any failure of the template (syntax, raise_exception, a runaway loop, a Python error inside it)
        is a ChatTemplateError naming the template file."""
        chat = template_messages(messages)
        if self.source is None:
            return "".join(CHATML_TURN.format(role=m.get("role", ""), content=content_text(m.get("content")))
                           for m in chat) + (CHATML_ASSISTANT if add_generation_prompt else "")
        name, text = self.pick(tools)
        where = f"{self.file}" + (f" (template {name!r})" if name else "")
        env = chat_sandbox()
        import jinja2  # chat_sandbox found it

        extra: dict[str, Any] = {**self.special_tokens}
        if enable_thinking is not None:  # unset, a template's `enable_thinking is defined` test stays false
            extra["enable_thinking"] = enable_thinking
        try:
            with time_limit(seconds):
                if name not in self.compiled:
                    self.compiled[name] = env.from_string(text)
                return str(self.compiled[name].render(messages=chat, tools=plain(tools), documents=None,
                                                      add_generation_prompt=add_generation_prompt, **extra))
        except TemplateTimeout:
            raise ChatTemplateError(f"{where}: the chat template did not finish rendering one conversation in "
                                    f"{seconds:g} s") from None
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: the chat template has a syntax error (template line {e.lineno}: "
                                    f"{one_line(e.message or '')})") from None
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, undefined names, sandbox refusals
            raise ChatTemplateError(f"{where}: the chat template failed: {one_line(str(e))}") from None
        except Exception as e:  # anything else the template's own code raised (1/0, recursion, memory)
            raise ChatTemplateError(f"{where}: the chat template failed ({type(e).__name__}: "
                                    f"{one_line(str(e))})") from None


def ort_options(runtime: dict, threads: int = 0, spin: bool = True) -> ort.SessionOptions:
    """ONNX Runtime session options for a model with manifest `runtime` section; `threads` 0: $QWEN2OM_THREADS,
    else ONNX Runtime's default (all cores). `spin` False: idle intra-op threads sleep at once (see
    open_ort_graphs)."""
    options = ort.SessionOptions()
    # Errors only: ONNX Runtime's load-time notes (e.g. "could not find a CPU kernel and hence can't
    # constant fold" for each layer of an int8-weight graph) are not the user's to act on.
    options.log_severity_level = 3
    # Without prepacking, ONNX Runtime reads MatMul weights from the memory-mapped data file:
    # both sessions share one copy, and decode (bandwidth-bound) got 9-14 % faster here.
    if not runtime.get("prepack_weights"):  # int4 models need prepacking: MatMulNBits is slow without it
        options.add_session_config_entry("session.disable_prepacking", "1")
    # QWEN2OM_THREADS sets the default for every engine at once (CI runs the numerics tests on 1 thread).
    threads = threads or int(os.environ.get("QWEN2OM_THREADS") or 0)
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def open_ort_graphs(folder: Path, manifest: dict, threads: int = 0, providers: Sequence[str] = (),
                    scales: dict[str, np.ndarray] | None = None, spin: bool = True,
                    ) -> tuple[dict[str, GraphCall], dict[str, np.ndarray]]:
    """One ONNX Runtime session per graph of the (checked) output directory or stage `folder`, all bound
    to one set of host buffers: the KV caches and linear-attention states (zeroed) and the scale inputs
    (`scales`, else read from its scales.safetensors). Returns the graphs and those buffers, by name.

    `spin` False for pipeline stages that share cores: each session has its own intra-op threads, which
    spin for a while after a call; the next stage's call then competed with them for the cores (Qwen3-0.6B
    shape, fp32, 2 cores: 112 ms/token unstaged, 177 in 2 stages spinning, 124 without)."""
    first = next(iter(manifest["graphs"].values()))
    caches = {io["name"]: np.zeros(io["shape"], dtype=io["dtype"]) for io in first["inputs"]
              if io["role"] in PAST_ROLES or io["role"] in STATE_ROLES}
    caches.update(load_scales(folder, first["inputs"]) if scales is None else scales)
    options = ort_options(manifest["runtime"], threads, spin)
    prov = list(providers) or ["CPUExecutionProvider"]
    graphs: dict[str, GraphCall] = {kind: _Graph(folder / s["file"], s, caches, options, prov)
                                    for kind, s in manifest["graphs"].items()}
    return graphs, caches


# -- pipeline stages (convert --stages) ------------------------------------------------------------
SHARED_INPUTS = ("attention_mask", "position_ids")  # every stage takes the call's own mask and positions


def open_stages(model_dir: Path, manifest: dict, *, check: bool = True, hashes: bool = False,
                ) -> list[tuple[Path, dict]]:
    """Each stage's folder and manifest, in order: [(OUT, manifest)] for an unstaged OUT. A stage that is
    missing, damaged (its files checked as check_files does, when `check`), or from another conversion
    (its split id or layers differ from OUT's) is named."""
    split = manifest.get("split")
    if split is None:
        return [(model_dir, manifest)]
    out = []
    for entry in split["stages"]:
        folder = model_dir / entry["dir"]
        a, b = entry["layers"]
        what = f"stage {entry['index']} (layers {a}-{b - 1}, {folder})"
        if not (folder / "manifest.json").is_file():
            raise RuntimeInputError(f"{what} is missing: convert it (`convert ... --stages {split['count']} "
                                    f"--only-stage {entry['index']}`) or copy its folder from the host that did")
        m = load_manifest(folder)
        if check:
            check_files(folder, m, hashes=hashes)
        else:
            check_manifest(folder, m)
        theirs = m.get("stage") if isinstance(m.get("stage"), dict) else {}
        if theirs.get("id") != split["id"] or theirs.get("layers") != entry["layers"]:
            raise RuntimeInputError(f"{what} is from another conversion: its split id is {theirs.get('id')!r} "
                                    f"(layers {theirs.get('layers')}), {model_dir}'s is {split['id']!r}; convert "
                                    "every stage with the same command and --stages")
        out.append((folder, m))
    return out


class _Chain:
    """A staged model's graphs of one kind, run stage after stage in this process: the first stage's
    inputs are the call's; each later stage gets the same mask and positions and the hidden states the
    stage before it returned; the last returns the logits."""

    def __init__(self, stages: Sequence[GraphCall]) -> None:
        self.stages = list(stages)
        self.tokens, self.gears = self.stages[0].tokens, self.stages[0].gears

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        return self.stages[0].inputs(t)

    def run(self, t: int) -> np.ndarray:
        first = self.stages[0].inputs(t)
        out = self.stages[0].run(t)
        for g in self.stages[1:]:
            ins = g.inputs(t)
            for name in SHARED_INPUTS:
                np.copyto(ins[name], first[name])
            np.copyto(ins["hidden_in"], out)
            out = g.run(t)
        return out

    def append(self, writes: Sequence[tuple[int, int, int, int]]) -> None:
        for g in self.stages:
            g.append(writes)

    def clear_states(self) -> None:
        for g in self.stages:
            g.clear_states()

    def write_state(self, name: str, value: np.ndarray) -> None:
        for g in self.stages:
            if name in getattr(g, "states", {}):
                g.write_state(name, value)


def chained(stages: Sequence[dict[str, GraphCall]]) -> dict[str, GraphCall]:
    """Each graph kind across the stages: the graph itself for one stage, else a _Chain of them."""
    if len(stages) == 1:
        return dict(stages[0])
    for k, graphs in enumerate(stages[1:], 1):
        for kind, g in graphs.items():
            if g.gears != stages[0][kind].gears:
                raise RuntimeInputError(f"stage {k}'s {kind} graph takes gears {g.gears}, stage 0's "
                                        f"{stages[0][kind].gears}: its stages are from different conversions")
    return {kind: _Chain([graphs[kind] for graphs in stages]) for kind in stages[0]}


def open_distributed(how: str, engine: Engine, **kwargs: Any) -> tuple[dict[str, GraphCall], Callable[[], None]]:
    """The graphs of a staged OUT run by one worker per stage (`how`: "ray")."""
    if how != "ray":
        raise BackendError(f"unknown --distributed {how!r} (known: ray)")
    return open_ray(engine, **kwargs)


# -- Ray (--distributed ray): one actor per stage ------------------------------------------------
# ray.init retries for ever against an address where nothing answers as Ray (a wrong port, a cluster
# with token authentication and no token here), so it runs in a thread that is given up on after this
# many seconds ($QWEN2OM_RAY_CONNECT_TIMEOUT).
RAY_CONNECT_SECONDS = 30.0
# Seconds the actors may take to load their stages, and one call to pass every stage, before the stage
# that has not answered is reported ($QWEN2OM_RAY_CALL_TIMEOUT). A dead actor is reported at once.
RAY_CALL_SECONDS = 600.0
RAY_EXTRA = "pip install 'qwen2om[ray]'"
# A call's mask and positions up to this size go inside each stage's task (a decode step's: ~1 KB); larger
# ones (a prefill chunk's mask) are put in Ray's object store once for all stages. ray.put costs about as
# much as a task round trip (~1.3 ms on 2 cores), so a small mask is cheaper copied than stored.
RAY_INLINE_BYTES = 64 * 1024
# This process's use of Ray: whether an engine started it (a local cluster, shut down by the last engine
# to close), and how many open engines have actors in it.
_ray_use = {"started": False, "engines": 0}


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise BackendError(f"--distributed ray needs Ray, which is not installed here ({e}): {RAY_EXTRA} "
                           "(beside OUT/run.py alone: pip install ray)") from None
    return ray


def seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise RuntimeInputError(f"${name}={printable(raw)!r}: give a number of seconds > 0")
    return value


def check_reachable(address: str, seconds: float) -> None:
    """Fail at once when nothing listens at `address` (HOST:PORT, or ray://HOST:PORT): ray.init would
    keep retrying. "auto" (the cluster `ray start` left on this host) is left to Ray to find."""
    if address == "auto":
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BackendError(f"--address {printable(address)!r}: give the head node's HOST:PORT (the --port of "
                           "`ray start --head`, 6379 by default), or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(seconds, 10.0)).close()
    except OSError as e:
        raise BackendError(f"--address {printable(address)}: no Ray cluster answers there ({e.strerror or e}); start "
                           f"its head with `ray start --head --port {port}`, or check the host and port") from None


def ray_connect(ray: Any, address: str | None, cpus: int, seconds: float) -> bool:
    """Connect this process to Ray: the cluster at `address`, else a quiet local one with `cpus` CPUs.
    Returns whether it started Ray (then it is ours to shut down); an initialised Ray is used as it is."""
    if ray.is_initialized():
        return False
    import logging

    if address is None:
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        except Exception as e:
            raise BackendError(f"cannot start a local Ray cluster: {one_line(str(e) or type(e).__name__)}") from None
        return True
    check_reachable(address, seconds)
    outcome: dict[str, BaseException] = {}

    def connect() -> None:
        # A thread: it never returns when the address does not answer as Ray. Only a connection is made
        # here, no process started (Ray's processes die with the thread that started them).
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=connect, name="qwen2om-ray-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise BackendError(f"--address {printable(address)}: no Ray cluster answered within {seconds:g} s "
                           "($QWEN2OM_RAY_CONNECT_TIMEOUT). Is it the port of `ray start --head` (its GCS port)? "
                           "A cluster with token authentication also needs RAY_AUTH_MODE=token and its token here")
    if "error" in outcome:
        e = outcome["error"]
        raise BackendError(f"--address {printable(address)}: cannot connect to the Ray cluster "
                           f"({one_line(str(e) or type(e).__name__)})") from None
    return False


class StageActor:
    """One stage of a staged OUT in a Ray actor (`ray.remote(StageActor)`): its graphs, KV caches,
    linear-attention states and scale inputs are loaded here and stay here. Each task first applies the
    appends of the call before it (`pending`), so a decode step costs one task per stage. A failure to
    load is kept and raised by `describe`, so the driver reports that error, not a dead actor."""

    def __init__(self, folder: str, threads: int, providers: Sequence[str], backend: str, device: int,
                 spin: bool) -> None:
        self.graphs: dict[str, GraphCall] = {}
        self.release: Callable[[], None] = lambda: None
        self.error: Exception | None = None
        self.entry = "input_ids"
        # Micro-batches (Engine.generate_many): slot 0 is `graphs`; each further slot, one more sequence in
        # flight, gets its own sessions and caches when first used (ORT: the mapped weights are shared).
        self.slots: dict[int, dict[str, GraphCall]] = {}
        self.opened = (folder, threads, tuple(providers), backend, spin)
        try:
            path = Path(folder)
            manifest = load_manifest(path)
            check_manifest(path, manifest)
            if backend == "acl":
                first = next(iter(manifest["graphs"].values()))
                scales = load_scales(path, first["inputs"])
                self.graphs, self.release = open_acl(path, manifest["graphs"], scales, device)
            else:
                check_files(path, manifest)  # this host's copy of the stage, as the driver checked its own
                self.graphs, _ = open_ort_graphs(path, manifest, threads, providers, spin=spin)
            g = next(iter(self.graphs.values()))
            self.entry = "hidden_in" if "hidden_in" in g.inputs(g.gears[-1]) else "input_ids"
        except Exception as e:
            self.error = e

    def describe(self) -> dict[str, Any]:
        """Where this actor runs, and its graphs' token counts and gears."""
        if self.error is not None:
            raise self.error
        import ray

        return {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "graphs": {kind: [g.tokens, list(g.gears)] for kind, g in self.graphs.items()}}

    def slot(self, slot: int) -> dict[str, GraphCall]:
        if slot == 0:
            return self.graphs
        if slot not in self.slots:
            folder, threads, providers, backend, spin = self.opened
            if backend != "ort":
                raise BackendError("micro-batches (several sequences in flight) need the ORT backend: on an NPU "
                                   "each would load the stage's .om again, weights included")
            path = Path(folder)
            self.slots[slot], _ = open_ort_graphs(path, load_manifest(path), threads, providers, spin=spin)
        return self.slots[slot]

    def apply(self, pending: tuple[str, list] | None, slot: int = 0) -> None:
        if pending is not None:
            kind, writes = pending
            self.slot(slot)[kind].append(writes)

    def call(self, pending: tuple[str, list] | None, kind: str, t: int, shared: dict[str, np.ndarray],
             x: np.ndarray, slot: int = 0) -> np.ndarray:
        """This stage's part of one call: `x` is the token ids (stage 0) or the hidden states of the stage
        before; returns its hidden states, or (last stage) the logits. `slot`: which sequence in flight."""
        self.apply(pending, slot)
        g = self.slot(slot)[kind]
        ins = g.inputs(t)
        for name, value in shared.items():
            np.copyto(ins[name], value)
        np.copyto(ins[self.entry], x)
        return g.run(t)  # a view of the output buffer: Ray serialises it as the task returns

    def append(self, pending: tuple[str, list] | None) -> None:
        self.apply(pending)

    def clear_slot(self, slot: int) -> None:
        """A new sequence in `slot`: its linear-attention states zeroed (its caches' stale slots are masked)."""
        for g in self.slot(slot).values():
            g.clear_states()

    def clear_states(self, pending: tuple[str, list] | None) -> None:
        self.apply(pending)
        for g in self.graphs.values():
            g.clear_states()

    def write_state(self, pending: tuple[str, list] | None, name: str, value: np.ndarray) -> None:
        self.apply(pending)
        owner = next((g for g in self.graphs.values() if name in getattr(g, "states", {})), None)
        if owner is not None:  # the graphs of a stage share its states: one write is enough
            owner.write_state(name, value)

    def close(self) -> None:
        release, self.release = self.release, lambda: None
        release()


@dataclasses.dataclass
class StagePlace:
    """One stage's actor, as messages name it: its layers, and the host it runs on once known."""

    index: int
    layers: tuple[int, int]
    host: str = ""
    ip: str = ""
    pid: int = 0
    node: str = ""

    def __str__(self) -> str:
        a, b = self.layers
        where = f" on host {self.host} ({self.ip}, pid {self.pid})" if self.host else ""
        return f"stage {self.index} (layers {a}-{b - 1}){where}"


def ray_reason(e: BaseException) -> str:
    """Ray's account of a failure, on one line: a task's own exception, or why an actor died."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return one_line(str(cause) or type(cause).__name__, 400)
    lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith("\t")
             and ln != getattr(type(e), "BASE_ERROR_MSG", None)]
    return one_line(" ".join(lines) or type(e).__name__, 400)


class _RayStages:
    """The driver's side of the stage actors: each call sent down the pipeline (stage k's output, an
    ObjectRef, is stage k+1's input: Ray's object store carries the hidden states), appends, resets and
    state writes to every actor. Ray runs one caller's tasks on an actor in the order they were sent, so
    appends ride with the next task; errors of tasks nobody waits for are reported by the next call."""

    def __init__(self, ray: Any, actors: list[Any], places: list[StagePlace], seconds: float) -> None:
        self.ray, self.actors, self.places, self.seconds = ray, actors, places, seconds
        self.pending: tuple[str, list] | None = None  # the last call's appends, sent with the next task
        self.unchecked: list[tuple[int, Any]] = []  # (stage, ObjectRef) of tasks not waited for yet
        self.closed = False

    def call(self, kind: str, t: int, inputs: dict[str, np.ndarray]) -> np.ndarray:
        pending, self.pending = self.pending, None
        refs = self.submit(kind, t, inputs, pending)
        unchecked, self.unchecked = self.unchecked, []
        return self.get([*unchecked, *refs], "answer")[-1]

    def submit(self, kind: str, t: int, inputs: dict[str, np.ndarray], pending: tuple[str, list] | None,
               slot: int = 0) -> list[tuple[int, Any]]:
        """Send one call down the stages without waiting: (stage, ObjectRef) of each stage's task."""
        shared: Any = {name: inputs[name] for name in SHARED_INPUTS}
        if sum(v.nbytes for v in shared.values()) > RAY_INLINE_BYTES:  # a prefill's mask: stored once for all stages
            shared = self.ray.put(shared)
        x, refs = inputs["input_ids"], []
        with self.submitting():
            for k, actor in enumerate(self.actors):
                x = actor.call.remote(pending, kind, t, shared, x, slot)
                refs.append((k, x))
        return refs

    def broadcast(self, method: str, *args: Any) -> None:
        pending, self.pending = self.pending, None
        with self.submitting():
            self.unchecked += [(k, getattr(a, method).remote(pending, *args)) for k, a in enumerate(self.actors)]

    @contextlib.contextmanager
    def submitting(self) -> Iterator[None]:
        """Ray refusing a task (shut down, object store full) as a BackendError."""
        try:
            yield
        except self.ray.exceptions.RayError as e:
            raise BackendError(f"Ray refused a task for the stages' actors: {ray_reason(e)}") from None

    def get(self, refs: list[tuple[int, Any]], what: str) -> list[Any]:
        """The tasks' results; a failure or a stage that does not answer in time is named."""
        ray = self.ray
        try:
            return ray.get([r for _, r in refs], timeout=self.seconds)
        except ray.exceptions.GetTimeoutError:
            late = next((k for k, r in refs if not ray.wait([r], timeout=0)[0]), refs[-1][0])
            raise BackendError(f"{self.places[late]} did not {what} within {self.seconds:g} s "
                               "($QWEN2OM_RAY_CALL_TIMEOUT): its host may be down or overloaded") from None
        except ray.exceptions.RayError as e:
            raise self.failure(refs, e) from None

    def failure(self, refs: list[tuple[int, Any]], error: BaseException) -> BackendError:
        """The first stage whose task failed, in pipeline order (a stage after it fails with its error)."""
        ray = self.ray
        for k, ref in refs:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError as e:
                dead = next((j for j, a in enumerate(self.actors) if a._actor_id.hex() == e.actor_id), k)
                return BackendError(f"{self.places[dead]}: its Ray actor died ({ray_reason(e)}); close the engine "
                                    "and start again")
            except ray.exceptions.RayTaskError as e:
                place = self.places[k]
                # Ray's header names the process: "ray::StageActor.describe() (pid=123, ip=10.0.0.2, ...)"
                if not place.host and (where := re.search(r"\(pid=(\d+), ip=([^,)\s]+)", str(e))):
                    place = dataclasses.replace(place, host=where[2], ip=where[2], pid=int(where[1]))
                return BackendError(f"{place}: {ray_reason(e)}")
            except ray.exceptions.RayError as e:
                return BackendError(f"{self.places[k]}: {ray_reason(e)}")
        return BackendError(f"the stages' Ray actors failed: {ray_reason(error)}")

    def close(self) -> None:
        """Release every actor's stage (its NPU, with the ACL backend) and end the actors; the last engine to
        close shuts down the Ray it started. Idempotent."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        try:
            done = [a.close.remote() for a in self.actors]
            ray.wait(done, num_returns=len(done), timeout=10)
        except Exception:  # a dead actor, or Ray already down: nothing more to release there
            pass
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        _ray_use["engines"] -= 1
        if _ray_use["started"] and not _ray_use["engines"]:
            _ray_use["started"] = False
            with contextlib.suppress(Exception):
                ray.shutdown()


class _RayChain:
    """One graph kind of a staged OUT whose stages are Ray actors (a GraphCall): host buffers for the ids,
    positions and mask the engine fills, sent down the actors by `run`; appends and state writes go to
    the actors, which hold the caches."""

    def __init__(self, stages: _RayStages, kind: str, spec: dict, tokens: int, gears: Sequence[int]) -> None:
        self.stages, self.kind, self.tokens, self.gears = stages, kind, tokens, tuple(gears)
        ios = [io for io in spec["inputs"] if io["role"] in ("ids", "positions", "mask")]
        flat = {io["name"]: np.zeros(int(np.prod(io["shape"])), dtype=io["dtype"]) for io in ios}
        self.views = {t: {io["name"]: flat[io["name"]][:int(np.prod(s := shape_at(io, t, tokens)))].reshape(s)
                          for io in ios} for t in self.gears}

    def inputs(self, t: int) -> dict[str, np.ndarray]:
        return self.views[t]

    def run(self, t: int) -> np.ndarray:
        if t not in self.views:
            raise RuntimeInputError(f"{t} tokens is not a gear of this graph ({', '.join(map(str, self.gears))})")
        return self.stages.call(self.kind, t, self.views[t])

    def append(self, writes: Sequence[tuple[int, int, int, int]]) -> None:
        if self.stages.pending is not None:  # two appends without a call between: the first goes now
            self.stages.broadcast("append")
        self.stages.pending = (self.kind, [tuple(int(v) for v in w) for w in writes])

    def clear_states(self) -> None:
        self.stages.broadcast("clear_states")

    def write_state(self, name: str, value: np.ndarray) -> None:
        self.stages.broadcast("write_state", name, np.ascontiguousarray(value))


@dataclasses.dataclass
class _Sequence:
    """One prompt in flight through the stage actors (Engine.generate_many): its calls still to make
    (prefill chunks), its cache length, the appends its last call owes the actors, what it generated."""

    index: int
    calls: list[tuple[str, list[int]]]
    sampling: Sampling
    length: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    pending: tuple[str, list] | None = None
    out: list[int] = dataclasses.field(default_factory=list)


def pipelined(engine: Engine, prompts: list[list[int]], *, max_new_tokens: int,
              sampling: Callable[[int], Sampling], ignore_eos: bool) -> list[list[int]]:
    """Greedy or sampled continuations of `prompts` through a staged OUT's Ray actors, up to one prompt
    per stage in flight (micro-batches): each round sends every sequence's next call down the stages
    before waiting for any, and Ray runs each actor's tasks in the order sent, so stage 1 works on one
    sequence while stage 0 works on the next. Each sequence has its own caches in every actor (slots)."""
    chains = {kind: g for kind, g in engine.graphs.items() if isinstance(g, _RayChain)}
    stages = next(iter(chains.values())).stages
    slots = min(len(prompts), len(stages.actors))
    specs = engine.stages[0][1]["graphs"]
    # each slot its own host buffers for ids, positions and mask (a call's are read when it is sent)
    buffers = {slot: {kind: _RayChain(stages, kind, specs[kind], g.tokens, g.gears) for kind, g in chains.items()}
               for slot in range(slots)}
    stages.pending = None  # the engine was reset: appends owed by its last call are void
    results: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))
    flight: dict[int, _Sequence] = {}

    def start(slot: int) -> None:
        i = queue.pop(0)
        kind, chunks = engine.prefill_calls([prompts[i]])
        flight[slot] = _Sequence(i, [(kind, rows[0]) for rows in chunks], sampling(i))
        stages.unchecked += [(k, a.clear_slot.remote(slot)) for k, a in enumerate(stages.actors)]

    for slot in range(slots):
        start(slot)
    while flight:
        sent = []
        for slot, seq in flight.items():
            kind, toks = seq.calls.pop(0)
            g = buffers[slot][kind]
            t = pick_gear(g.gears, len(toks), kind)
            writes = fill_call(g.inputs(t), [toks], seq.length, t, engine.capacity, engine.pad_id, engine.mask_min)
            sent.append((slot, stages.submit(kind, t, g.inputs(t), seq.pending, slot)))
            seq.pending = (kind, [tuple(int(v) for v in w) for w in writes if w[3]])
            seq.length += len(toks)
        unchecked, stages.unchecked = stages.unchecked, []
        stages.get(unchecked, "answer")
        for slot, refs in sent:
            seq = flight[slot]
            logits = stages.get(refs, "answer")[-1]
            if seq.calls:  # more prefill chunks to go
                continue
            tok = seq.sampling.pick(logits[0, -1])
            seq.out.append(tok)
            if (tok in engine.eos and not ignore_eos) or len(seq.out) >= max_new_tokens \
                    or seq.length[0] >= engine.capacity:
                results[seq.index] = seq.out
                del flight[slot]
                if queue:
                    start(slot)
                continue
            seq.calls.append(("decode", [tok]))
    return results


def open_ray(engine: Engine, *, address: str | None = None, threads: int = 0, providers: Sequence[str] = (),
             backend: str = "ort", devices: Sequence[int] = (0,)) -> tuple[dict[str, GraphCall], Callable[[], None]]:
    """One Ray actor per stage of `engine`'s OUT, each loading its stage from the same path on its own host
    (ONNX Runtime, or with backend "acl" its .om files on NPU `devices[k]`; one device d: d, d+1, ... on a
    one-node cluster, as in-process, else d on every actor's host), spread over the cluster's nodes.
    Returns a _RayChain per graph kind and the teardown."""
    ray = import_ray()
    stages, devices = engine.stages, list(devices)
    if backend == "acl" and len(devices) not in (1, len(stages)):
        raise BackendError(f"--devices names {len(devices)} NPUs for {len(stages)} stages: give one per stage, in "
                           "stage order (or one, used on every stage's host)")
    connect_s = seconds_from_env("QWEN2OM_RAY_CONNECT_TIMEOUT", RAY_CONNECT_SECONDS)
    call_s = seconds_from_env("QWEN2OM_RAY_CALL_TIMEOUT", RAY_CALL_SECONDS)
    if ray_connect(ray, address, max(len(stages), os.cpu_count() or 1), connect_s):
        _ray_use["started"] = True
    _ray_use["engines"] += 1
    places = [StagePlace(k, tuple(m.get("stage", {}).get("layers") or (0, m["runtime"].get("layers", 0))))
              for k, (_, m) in enumerate(stages)]
    pipeline = _RayStages(ray, [], places, call_s)
    try:
        if __name__ != "__main__":  # workers need numpy and onnxruntime, not qwen2om (run.py is __main__: by value)
            with contextlib.suppress(Exception):
                ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        cpus = float(ray.cluster_resources().get("CPU", 0))
        if not cpus:
            raise BackendError("the Ray cluster has no CPUs for the stages' actors")
        actor = ray.remote(StageActor).options(num_cpus=min(1.0, cpus / len(stages)), scheduling_strategy="SPREAD",
                                               max_restarts=0, max_task_retries=0)
        threads = threads or int(os.environ.get("QWEN2OM_THREADS") or 0)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        spin = nodes >= len(stages)  # intra-op threads spin only where each stage can have a node to itself
        if len(devices) == 1 and nodes == 1:
            devices = [devices[0] + k for k in range(len(stages))]
        for k, (folder, _) in enumerate(stages):
            device = devices[k] if len(devices) > 1 else devices[0]
            pipeline.actors.append(actor.remote(str(Path(folder).resolve()), threads, list(providers), backend, device,
                                                spin))
        infos = pipeline.get([(k, a.describe.remote()) for k, a in enumerate(pipeline.actors)], "load its graphs")
        for place, info in zip(places, infos, strict=True):
            place.host, place.ip, place.pid, place.node = info["host"], info["ip"], info["pid"], info["node"]
        kinds = infos[0]["graphs"]
        for place, info in zip(places[1:], infos[1:], strict=True):
            if info["graphs"] != kinds:
                raise RuntimeInputError(f"{place} has graphs {info['graphs']}, stage 0 {kinds}: its stages are "
                                        "from different conversions")
        specs = stages[0][1]["graphs"]
        graphs: dict[str, GraphCall] = {kind: _RayChain(pipeline, kind, specs[kind], tokens, gears)
                                        for kind, (tokens, gears) in kinds.items()}
    except BaseException:
        pipeline.close()
        raise
    return graphs, pipeline.close


class Engine:
    """A compiled qwen2om model with its KV cache, tokenizer and generation loop.

    `backend` runs the graphs: "ort" (ONNX Runtime) or "acl" (pyACL on Ascend NPU `device`, with the
    .om files in OUT/ascend/). Close the engine, or use it as a context manager, to free the NPU."""

    def __init__(self, model_dir: str | Path, *, threads: int = 0, providers: Sequence[str] = (),
                 backend: str = "ort", device: int = 0, check_hashes: bool = False,
                 devices: Sequence[int] | None = None, distributed: str | None = None,
                 address: str | None = None) -> None:
        """`devices`: a staged OUT's NPU per stage (--backend acl; default `device`, `device`+1, …).
        `distributed="ray"`: one Ray actor per stage (`address`: a running cluster; default a local one)."""
        self.dir = Path(model_dir)
        if backend not in ("ort", "acl"):
            raise BackendError(f"unknown backend {backend!r} (known: ort, acl)")
        self.manifest = load_manifest(self.dir)
        if backend == "ort" or check_hashes:
            check_files(self.dir, self.manifest, hashes=check_hashes)
        else:
            check_manifest(self.dir, self.manifest)
        rt = self.manifest["runtime"]
        self.capacity, self.batch, self.vocab = int(rt["capacity"]), int(rt["batch"]), int(rt["vocab"])
        self.dtype = np.dtype(rt["dtype"])
        self.eos = set(rt.get("eos_token_ids", []))
        self.pad_id = int(rt.get("pad_token_id", 0))
        self.mask_min = float(np.finfo(self.dtype).min)
        if not (self.dir / "tokenizer.json").is_file():
            raise RuntimeInputError(f"{self.dir / 'tokenizer.json'} is missing: {self.dir} is incomplete "
                                    "(convert again)")
        try:
            self.tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise RuntimeInputError(f"{self.dir / 'tokenizer.json'}: not a tokenizer the tokenizers library can "
                                    f"read ({printable(str(e))})") from None
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        # A staged OUT (convert --stages) runs its stages in order, each from its own folder; an unstaged
        # one is a single stage, OUT itself.
        self.stages = open_stages(self.dir, self.manifest, check=backend == "ort" or check_hashes,
                                  hashes=check_hashes)
        firsts = [next(iter(m["graphs"].values())) for _, m in self.stages]
        # Scale inputs (`scales: inputs`): loaded once, fed to every call of every graph.
        scales = [load_scales(d, first["inputs"]) for (d, _), first in zip(self.stages, firsts, strict=True)]
        self._release: Callable[[], None] = lambda: None
        # The host KV cache of the ONNX Runtime backend; the ACL backend keeps its cache on the NPU.
        self.caches: dict[str, np.ndarray] = {}
        self.graphs: dict[str, GraphCall]
        # Linear-attention state inputs (hybrids), by name: zeroed and copied back by the graphs.
        self.state_specs: dict[str, dict] = {io["name"]: io for first in firsts for io in first["inputs"]
                                             if io["role"] in STATE_ROLES}
        if distributed is not None:
            self.graphs, self._release = open_distributed(distributed, self, address=address, threads=threads,
                                                          providers=providers, backend=backend,
                                                          devices=devices or [device])
            return
        if backend == "acl":
            devices = list(devices or [device + k for k in range(len(self.stages))])
            if len(devices) != len(self.stages):
                raise BackendError(f"--devices names {len(devices)} NPUs for {len(self.stages)} stages: give one per "
                                   "stage, in stage order")
            opened = []
            try:
                for (d, m), sc, dev_id in zip(self.stages, scales, devices, strict=True):
                    opened.append(open_acl(d, m["graphs"], sc, dev_id))
            except BaseException:
                for _, release in reversed(opened):
                    release()
                raise
            self.graphs = chained([g for g, _ in opened])

            def release_all() -> None:
                for _, release in reversed(opened):
                    release()

            self._release = release_all
            return
        opened = [open_ort_graphs(d, m, threads, providers, sc, spin=len(self.stages) == 1)
                  for (d, m), sc in zip(self.stages, scales, strict=True)]
        for _, caches in opened:
            self.caches.update(caches)
        self.graphs = chained([g for g, _ in opened])

    def close(self) -> None:
        """Release the backend's resources (the NPU's buffers, models and device); idempotent."""
        release, self._release = self._release, lambda: None
        release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the model call ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation: lengths to zero (stale cache slots are masked, never read) and
        linear-attention states to zero (a state is read whole, so it must be cleared)."""
        self.lengths[:] = 0
        for g in self.graphs.values():  # the graphs share the state buffers; each clears its view
            g.clear_states()

    def set_state(self, name: str, value: np.ndarray) -> None:
        """Replace the linear-attention state `name` (e.g. one saved after a shared prompt prefix) in
        place; it must have the graph's exact shape and dtype."""
        io = self.state_specs.get(name)
        if io is None:
            raise RuntimeInputError(f"{name!r} is not a state input of this model "
                                    f"(states: {', '.join(self.state_specs) or 'none'})")
        value = np.asarray(value)
        if list(value.shape) != list(io["shape"]) or value.dtype != np.dtype(io["dtype"]):
            raise RuntimeInputError(f"state {name!r} is {value.dtype}{list(value.shape)}, the graph takes "
                                    f"{io['dtype']}{list(io['shape'])}")
        next(iter(self.graphs.values())).write_state(name, value)  # the graphs share the state buffers

    def _call(self, kind: str, rows: list[list[int]]) -> np.ndarray:
        """Feed each row's tokens (left-padded to the smallest gear that holds the longest row) at its
        current length; return logits [B, Tl, V]."""
        g = self.graphs[kind]
        t = pick_gear(g.gears, max(len(r) for r in rows), kind)
        writes = fill_call(g.inputs(t), rows, self.lengths, t, self.capacity, self.pad_id, self.mask_min)
        logits = g.run(t)
        g.append([w for w in writes if w[3]])
        for b, toks in enumerate(rows):
            self.lengths[b] += len(toks)
        return logits

    def prefill(self, prompts: list[list[int]]) -> np.ndarray:
        """Run whole prompts through the cache; return each row's last-token logits [B, V]."""
        if len(prompts) != self.batch:
            raise RuntimeInputError(f"the model was compiled for batch {self.batch}, got {len(prompts)} prompts")
        for b, toks in enumerate(prompts):
            if not toks:
                raise RuntimeInputError("the prompt is empty: there is nothing to continue")
            self.check_ids(toks)
            if self.lengths[b] + len(toks) > self.capacity:
                raise RuntimeInputError(
                    f"prompt of {len(toks)} tokens does not fit the cache capacity {self.capacity} "
                    "(convert with a larger --max-seq-len, or pass --truncate)")
        last = np.zeros((self.batch, self.vocab), dtype=np.float32)
        kind, chunks = self.prefill_calls(prompts)
        for rows in chunks:
            active = [b for b, r in enumerate(rows) if r]
            logits = self._call(kind, rows)
            for b in active:
                last[b] = logits[b, -1]
        return last

    def prefill_calls(self, prompts: list[list[int]]) -> tuple[str, list[list[list[int]]]]:
        """The graph kind and the calls (each a row per prompt) that prefill `prompts`: chunks of the
        largest gear, the first the remainder, so every chunk's last row is a real token."""
        kind = "prefill" if "prefill" in self.graphs else "decode"
        longest = max(len(t) for t in prompts)
        # A prefill call costs its whole (smallest) chunk whatever the prompt: a 2-token prompt took
        # 0.7 s through Qwen3-0.6B's 128-row chunk against ~20 ms per decode step. Prompts of a few
        # tokens go through the decode graph instead, one token per call (same numbers).
        if kind == "prefill" and longest <= min(self.graphs["prefill"].gears) // SHORT_PROMPT:
            kind = "decode"
        c = max(self.graphs[kind].gears)
        chunks = -(-longest // c)
        calls = []
        for k in range(chunks):
            # Chunk k covers positions [end - (chunks - k) * c, ...) counted back from each row's end.
            rows = []
            for toks in prompts:
                hi = len(toks) - (chunks - 1 - k) * c
                rows.append(toks[max(hi - c, 0):max(hi, 0)])
            calls.append(rows)
        return kind, calls

    def step(self, tokens: list[int]) -> np.ndarray:
        """One decode step: one token per row; returns logits [B, V]."""
        self.check_ids(tokens)
        return self._call("decode", [[t] for t in tokens])[:, -1].copy()

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab]
        if bad:
            raise RuntimeInputError(f"token ids outside the vocabulary [0, {self.vocab}): {bad[:8]}")

    # -- text -------------------------------------------------------------------------------
    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        """The directory's chat template, read on first use: a run without --chat never parses it."""
        return ChatTemplate.load(self.dir)

    def encode(self, prompt: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """`prompt`'s ids; with `chat`, a one-turn conversation (after `system`, if given) rendered with
        the model's chat template, ready for the assistant's answer."""
        if chat:
            messages = [{"role": "system", "content": system}] * (system is not None)
            prompt = self.chat_template.render([*messages, {"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def fit(self, ids: list[int], max_new_tokens: int, truncate: bool) -> list[int]:
        """With `truncate`, drop the oldest prompt tokens so the prompt and the new tokens fit the cache
        (the prompt keeps at least half of it); without, return `ids` unchanged."""
        room = max(1, self.capacity - min(max(max_new_tokens, 1), self.capacity // 2))
        return ids[-room:] if truncate and len(ids) + max_new_tokens > self.capacity else ids

    def generate(self, ids: list[int], *, max_new_tokens: int, sampling: Sampling,
                 on_token: Callable[[int], None] = lambda t: None, ignore_eos: bool = False,
                 ) -> tuple[list[int], Stats]:
        """Greedy or sampled continuation of one prompt (batch-1 models; rows >0 mirror row 0)."""
        self.reset()
        stats = Stats(prompt_tokens=len(ids))
        if max_new_tokens < 1:
            stats.stop = "max_new_tokens"
            return [], stats
        t0 = time.perf_counter()
        logits = self.prefill([ids] * self.batch)[0]
        stats.prefill_s = time.perf_counter() - t0
        out: list[int] = []
        t1 = time.perf_counter()
        while True:
            tok = sampling.pick(logits)
            out.append(tok)
            on_token(tok)
            if tok in self.eos and not ignore_eos:
                stats.stop = "eos"
                break
            if len(out) >= max_new_tokens:
                stats.stop = "max_new_tokens"
                break
            if self.lengths[0] >= self.capacity:
                stats.stop = "cache full"
                break
            logits = self.step([tok] * self.batch)[0]
        stats.decode_s = time.perf_counter() - t1
        stats.new_tokens = len(out)
        return out, stats


    def generate_many(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: Callable[[int], Sampling],
                      ignore_eos: bool = False) -> list[list[int]]:
        """Each prompt's continuation, as `generate` gives it (`sampling(i)`: prompt i's sampler). A staged
        OUT run with --distributed ray keeps up to one prompt per stage in flight (micro-batches), so its
        stages work at the same time; otherwise the prompts run one after another."""
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        staged = isinstance(self.graphs.get("decode"), _RayChain) and len(self.stages) > 1 and self.batch == 1
        if not staged or len(prompts) < 2:
            return [self.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling(i), ignore_eos=ignore_eos)[0]
                    for i, ids in enumerate(prompts)]
        for ids in prompts:
            if not ids:
                raise RuntimeInputError("a prompt is empty: there is nothing to continue")
            self.check_ids(ids)
            if len(ids) > self.capacity:
                raise RuntimeInputError(f"prompt of {len(ids)} tokens does not fit the cache capacity {self.capacity}")
        self.reset()
        return pipelined(self, prompts, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)


class TextStream:
    """Print decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, out: Callable[[str], None]) -> None:
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out(text[self.printed:])
        self.printed = len(text)


def read_json_list(path: Path, flag: str) -> list[dict[str, Any]]:
    """The JSON list of objects in `path` (--messages, --tools), or a RuntimeInputError naming the flag and file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise RuntimeInputError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RuntimeInputError(f"{flag} {path}: not valid JSON ({one_line(str(e))})") from None
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise RuntimeInputError(f"{flag} {path}: give a JSON list of objects")
    return data


def conversation(prompt: str | None, system: str | None, history: list[dict[str, Any]] | None,
                 where: str = "--messages") -> list[dict[str, Any]]:
    """The messages to render: `system` first, then `history`, then `prompt` as a user turn (given, or
    "Hello" when there is no history)."""
    messages = list(history or [])
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise RuntimeInputError(f"{where}: message {i} has no \"role\" string")
    if system is not None:
        if messages and messages[0]["role"] == "system":
            raise RuntimeInputError(f"--system and a system message first in {where}: give one of them")
        messages.insert(0, {"role": "system", "content": system})
    if prompt is not None or history is None:
        messages.append({"role": "user", "content": "Hello" if prompt is None else prompt})
    if not messages:
        raise RuntimeInputError(f"{where} holds no messages: give at least one, or a --prompt")
    return messages


def chat_prompt(model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                enable_thinking: bool | None, note: Callable[[str], None]) -> str:
    """The conversation rendered with `model_dir`'s chat template; without one, ChatML, and `note` says so."""
    template = ChatTemplate.load(model_dir)
    if template.file is None:
        unused = " (--tools and --enable-thinking/--no-thinking need a template: not applied)" * (
            tools is not None or enable_thinking is not None)
        note(f"note: {model_dir} has no chat template (chat_template.jinja or tokenizer_config.json's "
             f"chat_template): formatting the conversation as ChatML{unused}")
    return template.render(messages, tools=tools, enable_thinking=enable_thinking)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    # None, not "Hello": with --messages, a --prompt given is one more user turn, and none is added otherwise.
    p.add_argument("--prompt", default=None, help="text to continue (default: Hello)")
    p.add_argument("--ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a text file, one prompt per line, each continued on its own (prompt i sampled with seed "
                        "--seed + i); a staged OUT run with --distributed ray keeps up to one prompt per stage in "
                        "flight, so the stages work at the same time")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true",
                   help="format the prompt as a user turn with the model's chat template (ChatML if it has none)")
    p.add_argument("--system", default=None, help="system message (implies --chat)")
    p.add_argument("--messages", type=Path, default=None,
                   help="a JSON file: the conversation so far, a list of {role, content, ...} (tool_calls, role "
                        "tool, reasoning_content as the template reads them); --prompt, if given, is one more user "
                        "turn (implies --chat)")
    p.add_argument("--tools", type=Path, default=None,
                   help="a JSON file: a list of OpenAI-style tool schemas for the chat template (implies --chat)")
    thinking = p.add_mutually_exclusive_group()
    thinking.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=None,
                          help="pass enable_thinking=true to the chat template (implies --chat)")
    thinking.add_argument("--no-thinking", dest="enable_thinking", action="store_false", default=None,
                          help="pass enable_thinking=false: Qwen3 templates then open an empty think block "
                               "(implies --chat); neither flag: the template's default")
    p.add_argument("--print-prompt", action="store_true",
                   help="print the prompt text as the model would read it (the rendered chat template) and exit "
                        "without loading the model")
    p.add_argument("--greedy", action="store_true", help="deterministic greedy decoding (= --temperature 0)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0 = greedy; default: the checkpoint's generation_config.json, else "
                        f"{SAMPLING_DEFAULTS['temperature']})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample from the k most likely tokens (default: the checkpoint's, else "
                        f"{SAMPLING_DEFAULTS['top_k']})")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass (default: the checkpoint's, else {SAMPLING_DEFAULTS['top_p']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truncate", action="store_true", help="drop the oldest prompt tokens when it does not fit")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads (0 = $QWEN2OM_THREADS, else all cores)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--backend", choices=("ort", "acl"), default="ort",
                   help="ort: ONNX Runtime on the .onnx graphs; acl: pyACL on an Ascend NPU with ascend/*.om")
    p.add_argument("--device", type=int, default=0, help="NPU device id for --backend acl")
    p.add_argument("--devices", default=None,
                   help="a staged OUT's NPU per stage, comma-separated, e.g. 0,1 (--backend acl; default: --device, "
                        "--device+1, ...; with --distributed ray on several hosts, --device on each stage's host)")
    p.add_argument("--distributed", choices=("ray",), default=None,
                   help="run each stage of a staged OUT in its own Ray actor (its caches stay there), on this host or "
                        f"across a cluster's ({RAY_EXTRA})")
    p.add_argument("--address", default=None,
                   help="with --distributed ray: the Ray head's HOST:PORT (its `ray start --head --port`), or auto "
                        "($RAY_ADDRESS, or the cluster `ray start` left on this host); default: a local cluster for "
                        "this run")
    p.add_argument("--check-hashes", action="store_true",
                   help="check every file's sha256 against manifest.json before loading (sizes are always checked)")


def read_prompts(path: Path) -> list[str]:
    """--prompts-file: its non-empty lines, each a prompt (\\n in a line stands for a line break)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeInputError(f"--prompts-file {path}: cannot read it ({printable(str(e))[:200]})") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise RuntimeInputError(f"--prompts-file {path}: no prompts (one per line)")
    return prompts


def run_prompts(engine: Engine, texts: list[str], a: argparse.Namespace, sampling: Sampling) -> int:
    """--prompts-file: every prompt continued (Engine.generate_many), printed in order."""
    ids = [engine.fit(engine.encode(t), a.max_new_tokens, a.truncate) for t in texts]
    t0 = time.perf_counter()
    outs = engine.generate_many(ids, max_new_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos,
                                sampling=lambda i: dataclasses.replace(sampling, seed=sampling.seed + i))
    seconds = time.perf_counter() - t0
    for i, (text, out) in enumerate(zip(texts, outs, strict=True)):
        if a.json:
            print(json.dumps({"prompt": text, "prompt_ids": ids[i], "tokens": out,
                              "text": engine.tokenizer.decode(out)}))
        else:
            print(f"--- prompt {i + 1}: {printable(one_line(text, 80))}\n{engine.tokenizer.decode(out)}")
    total = sum(map(len, outs))
    print(f"[{len(texts)} prompts, {total} new tokens in {seconds:.2f} s ({total / max(seconds, 1e-9):.1f} tok/s)]",
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, model_dir: Path | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate text with a qwen2om-compiled model (ONNX Runtime or pyACL).")
    if model_dir is None:
        p.add_argument("--model-dir", type=Path, default=Path(__file__).resolve().parent,
                       help="the output directory (default: the folder holding this script)")
    add_generation_args(p)
    a = p.parse_args(argv)
    if a.max_new_tokens < 0:
        p.error(f"--max-new-tokens {a.max_new_tokens} must be >= 0")
    if a.threads < 0:
        p.error(f"--threads {a.threads} must be >= 0 (0: all cores)")
    if a.address is not None and a.distributed is None:
        print("error: --address is the Ray cluster of --distributed ray: give both", file=sys.stderr)
        return 2
    try:
        devices = None if a.devices is None else [int(x) for x in a.devices.split(",")]
        if devices is not None and min(devices) < 0:
            raise ValueError
    except ValueError:
        print(f"error: --devices {a.devices!r}: give comma-separated NPU ids, one per stage, e.g. --devices 0,1",
              file=sys.stderr)
        return 2
    try:
        ids = None if a.ids is None else [int(x) for x in a.ids.split(",")]
    except ValueError:
        print(f"error: --ids {a.ids!r}: give comma-separated integer token ids, e.g. --ids 9707,11", file=sys.stderr)
        return 2
    if a.print_prompt and ids is not None:
        print("error: --print-prompt shows the prompt text; --ids gives token ids, not text", file=sys.stderr)
        return 2
    if a.prompts_file is not None and (a.prompt is not None or ids is not None or a.messages is not None
                                       or a.print_prompt):
        print("error: --prompts-file gives the prompts: leave out --prompt, --ids, --messages and --print-prompt",
              file=sys.stderr)
        return 2
    # A system message, tools, a history or a thinking switch exist only in the chat format: each implies --chat.
    chat = a.chat or any(v is not None for v in (a.system, a.messages, a.tools, a.enable_thinking))
    directory = Path(model_dir or a.model_dir)
    engine, text = None, None
    try:
        given = {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
        chosen = {**sampling_defaults(directory), **{k: v for k, v in given.items() if v is not None}}
        sampling = Sampling(0.0 if a.greedy else float(chosen["temperature"]), int(chosen["top_k"]),
                            float(chosen["top_p"]), a.seed)  # checked before a slow load
        if ids is None:  # rendered before the model loads: a bad --messages file or template fails in a second
            if chat:
                history = None if a.messages is None else read_json_list(a.messages, "--messages")
                tools = None if a.tools is None else read_json_list(a.tools, "--tools")
                messages = conversation(a.prompt, a.system, history, f"--messages {a.messages}")
                text = chat_prompt(directory, messages, tools, a.enable_thinking,
                                   lambda s: print(s, file=sys.stderr))
            else:
                text = "Hello" if a.prompt is None else a.prompt
        if a.print_prompt:
            sys.stdout.write(text or "")
            sys.stdout.flush()
            return 0
        if a.prompts_file is not None:
            texts = read_prompts(a.prompts_file)
            if chat:
                tools = None if a.tools is None else read_json_list(a.tools, "--tools")
                texts = [chat_prompt(directory, conversation(t, a.system, None, ""), tools, a.enable_thinking,
                                     lambda s: print(s, file=sys.stderr)) for t in texts]
        engine = Engine(directory, threads=a.threads, backend=a.backend, device=a.device,
                        check_hashes=a.check_hashes, devices=devices, distributed=a.distributed, address=a.address)
        if a.prompts_file is not None:
            return run_prompts(engine, texts, a, sampling)
        ids = ids if ids is not None else engine.encode(text or "")
        ids = engine.fit(ids, a.max_new_tokens, a.truncate)
        stream = TextStream(engine.tokenizer, lambda s: print(s, end="", flush=True))
        out, stats = engine.generate(ids, max_new_tokens=a.max_new_tokens, sampling=sampling,
                                     on_token=(lambda t: None) if a.json else stream,
                                     ignore_eos=a.ignore_eos)
    except (RuntimeInputError, ValueError) as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.close()
    if a.json:
        print(json.dumps({"prompt": text, "prompt_ids": ids, "tokens": out, "text": engine.tokenizer.decode(out),
                          "sampling": dataclasses.asdict(sampling), "stats": dataclasses.asdict(stats)}))
    else:
        print(f"\n[{stats.line()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
