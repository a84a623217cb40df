#!/usr/bin/env python3
"""Run a qwen2om output directory with numpy, onnxruntime and tokenizers only.

This file is both `qwen2om.runtime.standalone` and, copied verbatim, `OUT/run.py`: it must not
import torch, transformers or qwen2om. It reads `manifest.json` beside the graphs for the
I/O signature, owns one preallocated KV cache per layer, and after each call writes only the
new tokens' K/V into it (no concatenation, no copy of the whole cache per step). Long prompts
are prefilled chunk by chunk; the first chunk is left-padded so every chunk's last row is a
real token and the prefill graph may return the last position's logits only.

    python OUT/run.py --prompt "Hello" --max-new-tokens 32 --greedy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

CHATML_USER = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
CHATML_SYSTEM = "<|im_start|>system\n{system}<|im_end|>\n"


class RuntimeInputError(ValueError):
    """A prompt, token ids or buffers the compiled model cannot take."""


@dataclasses.dataclass
class Sampling:
    """Greedy when temperature is 0; otherwise temperature / top-k / top-p sampling, seeded."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
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
        return (f"prefill {self.prompt_tokens} tok in {self.prefill_s * 1000:.0f} ms "
                f"({self.prefill_tps:.1f} tok/s, time to first token {self.prefill_s * 1000:.0f} ms) | "
                f"decode {self.new_tokens} tok at {self.decode_tps:.1f} tok/s | stop: {self.stop}")


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
    """One ONNX Runtime session with every input and output bound to a persistent numpy buffer."""

    def __init__(self, path: Path, spec: dict, caches: dict[str, np.ndarray], options: ort.SessionOptions,
                 providers: Sequence[str]) -> None:
        self.tokens = int(spec["tokens"])
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        self.binding = self.session.io_binding()
        self.buffers: dict[str, np.ndarray] = {}
        self._keep: list[ort.OrtValue] = []
        for io in spec["inputs"]:
            buf = caches[io["name"]] if io["name"] in caches else np.zeros(io["shape"], dtype=io["dtype"])
            self._bind(io["name"], buf, self.binding.bind_ortvalue_input)
        for io in spec["outputs"]:
            self._bind(io["name"], np.zeros(io["shape"], dtype=io["dtype"]), self.binding.bind_ortvalue_output)
        self.presents = [(io["name"], io["role"], io["layer"]) for io in spec["outputs"]
                         if io["role"] in ("present_key", "present_value")]

    def _bind(self, name: str, buf: np.ndarray, bind: Callable[[str, ort.OrtValue], None]) -> None:
        value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares the numpy memory: no copies per call
        self._keep.append(value)
        self.buffers[name] = buf
        bind(name, value)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


class Engine:
    """A compiled qwen2om model with its KV cache, tokenizer and generation loop."""

    def __init__(self, model_dir: str | Path, *, threads: int = 0, providers: Sequence[str] = ()) -> None:
        self.dir = Path(model_dir)
        manifest_path = self.dir / "manifest.json"
        if not manifest_path.is_file():
            raise RuntimeInputError(f"{self.dir}: no manifest.json (is this a qwen2om output directory?)")
        self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        rt = self.manifest["runtime"]
        self.capacity, self.batch, self.vocab = int(rt["capacity"]), int(rt["batch"]), int(rt["vocab"])
        self.dtype = np.dtype(rt["dtype"])
        self.eos = set(rt.get("eos_token_ids", []))
        self.pad_id = int(rt.get("pad_token_id", 0))
        self.mask_min = float(np.finfo(self.dtype).min)
        options = ort.SessionOptions()
        # Without prepacking, ONNX Runtime reads MatMul weights from the memory-mapped data file:
        # both sessions share one copy, and decode (bandwidth-bound) got 9-14 % faster here.
        if not rt.get("prepack_weights"):  # int4 models need prepacking: MatMulNBits is slow without it
            options.add_session_config_entry("session.disable_prepacking", "1")
        if threads:
            options.intra_op_num_threads = threads
        specs = self.manifest["graphs"]
        first = next(iter(specs.values()))
        self.caches = {io["name"]: np.zeros(io["shape"], dtype=io["dtype"]) for io in first["inputs"]
                       if io["role"] in ("past_key", "past_value")}
        # Scale inputs (`scales: inputs`): loaded once, bound to every call of every graph.
        self.caches.update(load_scales(self.dir, first["inputs"]))
        self.cache_of = {(io["role"].replace("past_", ""), io["layer"]): io["name"] for io in first["inputs"]
                         if io["role"] in ("past_key", "past_value")}
        prov = list(providers) or ["CPUExecutionProvider"]
        self.graphs = {kind: _Graph(self.dir / s["file"], s, self.caches, options, prov) for kind, s in specs.items()}
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self.tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))

    # -- the model call ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation: lengths to zero (stale cache slots are masked, never read)."""
        self.lengths[:] = 0

    def _call(self, kind: str, rows: list[list[int]]) -> np.ndarray:
        """Feed each row's tokens (≤ T, left-padded) at its current length; return logits [B, Tl, V]."""
        g = self.graphs[kind]
        t, p = g.tokens, self.capacity
        ids, pos = g.buffers["input_ids"], g.buffers["position_ids"]
        mask = g.buffers["attention_mask"]
        ids.fill(self.pad_id)
        pos.fill(0)
        mask.fill(self.mask_min)
        pads = []
        for b, toks in enumerate(rows):
            n, length = len(toks), int(self.lengths[b])
            if length + n > p:
                raise RuntimeInputError(f"row {b}: {length} cached + {n} new tokens exceed the capacity {p}")
            pad = t - n
            pads.append(pad)
            ids[b, pad:] = toks
            pos[b, pad:] = np.arange(length, length + n)
            mask[b, 0, pad:, :length] = 0  # the cached tokens
            causal = np.tril(np.ones((n, n), dtype=bool))
            mask[b, 0, pad:, p + pad:][causal] = 0  # the new tokens, causally
            for i in range(pad):  # pad rows see only themselves: a defined softmax, output discarded
                mask[b, 0, i, p + i] = 0
        g.run()
        for name, role, layer in g.presents:
            cache = self.caches[self.cache_of[(role.replace("present_", ""), layer)]]
            new = g.buffers[name]
            for b, toks in enumerate(rows):
                length = int(self.lengths[b])
                cache[b, :, length:length + len(toks), :] = new[b, :, pads[b]:, :]
        for b, toks in enumerate(rows):
            self.lengths[b] += len(toks)
        return g.buffers["logits"]

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
        kind = "prefill" if "prefill" in self.graphs else "decode"
        c = self.graphs[kind].tokens
        longest = max(len(t) for t in prompts)
        chunks = -(-longest // c)
        last = np.zeros((self.batch, self.vocab), dtype=np.float32)
        for k in range(chunks):
            # Chunk k covers positions [end - (chunks - k) * c, ...) counted back from each row's end.
            rows = []
            for toks in prompts:
                hi = len(toks) - (chunks - 1 - k) * c
                rows.append(toks[max(hi - c, 0):max(hi, 0)])
            active = [b for b, r in enumerate(rows) if r]
            logits = self._call(kind, rows)
            for b in active:
                last[b] = logits[b, -1]
        return last

    def step(self, tokens: list[int]) -> np.ndarray:
        """One decode step: one token per row; returns logits [B, V]."""
        return self._call("decode", [[t] for t in tokens])[:, -1].copy()

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab]
        if bad:
            raise RuntimeInputError(f"token ids outside the vocabulary [0, {self.vocab}): {bad[:8]}")

    # -- text -------------------------------------------------------------------------------
    def encode(self, prompt: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            prompt = (CHATML_SYSTEM.format(system=system) if system else "") + CHATML_USER.format(prompt=prompt)
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


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Hello", help="text to continue (default: %(default)s)")
    p.add_argument("--ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML chat format")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--greedy", action="store_true", help="deterministic greedy decoding (= --temperature 0)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truncate", action="store_true", help="drop the oldest prompt tokens when it does not fit")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def main(argv: Sequence[str] | None = None, model_dir: Path | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate text with a qwen2om-compiled model (ONNX Runtime).")
    if model_dir is None:
        p.add_argument("--model-dir", type=Path, default=Path(__file__).resolve().parent,
                       help="the output directory (default: the folder holding this script)")
    add_generation_args(p)
    a = p.parse_args(argv)
    try:
        engine = Engine(model_dir or a.model_dir, threads=a.threads)
        ids = [int(x) for x in a.ids.split(",")] if a.ids else engine.encode(a.prompt, chat=a.chat, system=a.system)
        ids = engine.fit(ids, a.max_new_tokens, a.truncate)
        sampling = Sampling(0.0 if a.greedy else a.temperature, a.top_k, a.top_p, a.seed)
        stream = TextStream(engine.tokenizer, lambda s: print(s, end="", flush=True))
        out, stats = engine.generate(ids, max_new_tokens=a.max_new_tokens, sampling=sampling,
                                     on_token=(lambda t: None) if a.json else stream,
                                     ignore_eos=a.ignore_eos)
    except (RuntimeInputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"prompt_ids": ids, "tokens": out, "text": engine.tokenizer.decode(out),
                          "stats": dataclasses.asdict(stats)}))
    else:
        print(f"\n[{stats.line()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
