"""Lazy, validated access to a Hugging Face checkpoint directory.

Tensors are read one at a time, or in row slices, with positioned reads from safetensors shards
(single file or sharded with an index), so opening a checkpoint costs its headers, not its
weights, and resident memory never holds more than the tensors in hand (see safetensors_io).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from qwen2om.arch import ArchSpec, ModelDims, expected_tensors, resolve_arch, text_config
from qwen2om.confine import confined
from qwen2om.errors import CheckpointError
from qwen2om.quant.formats import read_quantization
from qwen2om.quantized import DESCRIPTION, Fp8Weight, QuantWeight
from qwen2om.safetensors_io import DTYPE_NAMES, DuplicateKey, Shard, TensorInfo, strict_json

SCAN_BLOCK = 16 << 20

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Every tokenizer and chat-template file a published checkpoint may carry: copied into OUT (package) and
# beside calibrated weights, and hashed in the manifest as files the conversion read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
SIDE_FILES = (INDEX_FILE, "generation_config.json", *TOKENIZER_FILES)
# Parts of a checkpoint that are never converted, whatever the architecture: multi-token-prediction
# heads (Qwen3-Next and Qwen3.5 publish them as `mtp.*`).
NOT_CONVERTED = ("mtp.",)
# Quantisation storage of a quantised `X.weight`, by suffix of `X.weight` (qwen2om.quantized): int4
# compressed-tensors (g_idx: llm-compressor's act-order permutation), msModelSlim, FP8 scales.
QUANT_STORAGE = ("_packed", "_scale", "_shape", "_zero_point", "_g_idx", "_offset", "_scale_inv")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
FUSED_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def check_tokenizer_sources(source: Path) -> None:
    """A tokenizer.json, or the vocab.json + merges.txt the package pass builds one from (fast_tokenizer)."""
    missing = [n for n in ("vocab.json", "merges.txt") if not (source / n).is_file()]
    if missing and not (source / "tokenizer.json").is_file():
        raise CheckpointError(f"{source}: no tokenizer.json, and no {' and '.join(missing)} to build one from: "
                              "the output could not encode a prompt")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file and the problem (a key given
    twice included: which value was meant is a guess)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found")
    try:
        data = strict_json(path.read_text(encoding="utf-8"))
    except DuplicateKey as e:
        raise CheckpointError(f"{path}: cannot read {what}: key {e.key!r} appears twice in one object") from None
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read {what}: nested too deeply") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's config.json and what it resolves to, read once: `convert` chooses the recipe
    from it, checks it before any work, and opens the Checkpoint with it."""

    root: Path
    config: dict[str, Any]
    arch: ArchSpec
    dims: ModelDims

    @classmethod
    def read(cls, root: Path) -> ModelConfig:
        path = Path(root) / "config.json"
        config = read_json(path, "config.json")
        return cls(Path(root), config, resolve_arch(config, str(path)), ModelDims.from_config(config, str(path)))


class Checkpoint:
    """A checkpoint directory: config, architecture, and a lazy tensor table."""

    def __init__(self, root: Path, model: ModelConfig | None = None) -> None:
        """`model`: its config.json as already read (ModelConfig.read), not read again."""
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")
        self._present("config.json")
        model = model or ModelConfig.read(self.root)
        self.config = model.config
        self.arch: ArchSpec = model.arch
        self.dims = model.dims
        self._handles: dict[Path, Shard] = {}
        # Text-model name → the name it is stored under, where they differ (the published wrapper).
        self._stored: dict[str, str] = {}
        # Parts of a published checkpoint that are not converted: name prefix → tensor count.
        self.ignored: dict[str, int] = {}
        # Tensors an indexed shard holds that its index does not list: nothing reads them.
        self._unlisted: list[str] = []
        stored = self._locate_tensors()
        self._where = self._unwrap(stored)
        self._check_sizes()
        self._side_files = [p for name in SIDE_FILES if (p := self._present(name))]
        self._present(DESCRIPTION)
        # Quantisation is read from the files' own names, then addressed by text-model names too.
        found = read_quantization(self.config, stored, str(self.root))
        self.quantized: dict[str, QuantWeight] = {self.text_name(n): self._renamed(q) for n, q in found.items()}

    # -- discovery -------------------------------------------------------------------------
    def _present(self, name: str) -> Path | None:
        """`root / name` when something is there (a dangling link included), checked by `confined`:
        a regular file inside the checkpoint, so a link to a key file or a FIFO is refused before
        anything opens it. None when nothing is there."""
        path = self.root / name
        if not (path.exists() or path.is_symlink()):
            return None
        confined(self.root, name)
        return path

    def _locate_tensors(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if self._present(INDEX_FILE):
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no 'weight_map' in the index")
            for name, shard in weight_map.items():
                if not isinstance(shard, str) or not shard:
                    raise CheckpointError(f"{index}: weight_map[{name!r}] is {shard!r}, not a shard file name")
            for shard in sorted(set(weight_map.values())):
                if not self._present(shard):
                    raise CheckpointError(f"{index} names shard {shard}, which does not exist")
            where = {name: self.root / shard for name, shard in weight_map.items()}
        else:
            single = self.root / SINGLE_FILE
            shards = [single] if self._present(SINGLE_FILE) else sorted(self.root.glob("*.safetensors"))
            if not shards:
                if (self.root / "manifest.json").is_file():
                    raise CheckpointError(f"{self.root} is a qwen2om output directory (manifest.json, ONNX graphs), "
                                          "not a checkpoint: give the checkpoint it was converted from, or "
                                          f"`qwen2om run {self.root}` to use it")
                raise CheckpointError(f"{self.root}: no *.safetensors weights and no {INDEX_FILE}")
            where = {}
            for shard in shards:
                self._present(shard.name)
                for name in self._open(shard).tensors:
                    # Without an index nothing says which copy is meant; transformers keeps the last.
                    if name in where:
                        raise CheckpointError(f"{where[name]} and {shard} both hold tensor {name!r}; without "
                                              f"{INDEX_FILE} nothing says which one is meant")
                    where[name] = shard
        # Open every shard now so a truncated or corrupt file fails before any work.
        for shard in sorted(set(where.values())):
            present = set(self._open(shard).tensors)
            listed = {name for name, path in where.items() if path == shard}
            if missing := sorted(listed - present):
                raise CheckpointError(f"{shard}: the index says it holds {missing[0]!r}, but it does not")
            self._unlisted += sorted(present - listed)
        return where

    def _unwrap(self, where: dict[str, Path]) -> dict[str, Path]:
        """The published Qwen3.5 wrapper holds the text model under `model.language_model.*` (and
        vision / MTP weights beside it): address the text tensors by their text-model names."""
        inner = "model.language_model."
        out: dict[str, Path] = {}
        for name, path in where.items():
            if name.startswith(inner):
                self._stored["model." + name[len(inner):]] = name
                out["model." + name[len(inner):]] = path
                continue
            if name.startswith(NOT_CONVERTED) or (self.arch.wrapper_architectures
                                                  and name.startswith("model.visual.")):
                part = name.split(".")[0] if name.startswith(NOT_CONVERTED) else "model.visual"
                self.ignored[part] = self.ignored.get(part, 0) + 1
            out[name] = path
        if self.ignored.get("model.visual") and not any(n.startswith("model.layers.") for n in out):
            raise CheckpointError(f"{self.root}: holds only vision weights (model.visual.*), no text model "
                                  f"(model.language_model.*); qwen2om converts the text model")
        return out

    def text_name(self, stored: str) -> str:
        """The text-model name of a tensor stored as `stored` (itself outside the wrapper)."""
        inner = "model.language_model."
        return "model." + stored[len(inner):] if self._stored and stored.startswith(inner) else stored

    def _renamed(self, q: QuantWeight) -> QuantWeight:
        """`q` with every tensor name it holds given as a text-model name."""
        names = {f.name: self.text_name(v) for f in dataclasses.fields(q)  # type: ignore[arg-type]
                 if isinstance(v := getattr(q, f.name), str)}
        return dataclasses.replace(q, **names)  # type: ignore[type-var]

    def stored_name(self, name: str) -> str:
        """The name `name` has in the safetensors files."""
        return self._stored.get(name, name)

    def layout_name(self, name: str) -> str:
        """The name a tensor or module of the text model gets in a checkpoint laid out like this one:
        inside `model.language_model.*` when this one is the published wrapper (whose config and
        loaders expect that), as it is otherwise."""
        if self._stored and name.startswith("model.") and not name.startswith("model.visual."):
            return "model.language_model." + name[len("model."):]
        return name

    def _open(self, shard: Path) -> Shard:
        if shard not in self._handles:
            self._handles[shard] = Shard(shard)
        return self._handles[shard]

    @cached_property
    def files(self) -> list[Path]:
        """Every file the conversion reads (config, index, shards, tokenizer files present), each
        checked by `confined` when the checkpoint was opened."""
        return sorted({self.root / "config.json", *self._where.values(), *self._side_files})

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    @property
    def shards(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def info(self, name: str) -> TensorInfo:
        return self._open(self._shard(name)).tensors[self.stored_name(name)]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape; for a quantised `X.weight`, its logical float shape [N, K]."""
        if name in self.quantized:
            q = self.quantized[name]
            return (q.n, q.k)
        return self.info(name).shape

    def _shard(self, name: str) -> Path:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: tensor {name!r} is missing from the checkpoint") from None

    # -- access ----------------------------------------------------------------------------
    def get(self, name: str, dtype: torch.dtype | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or rows [r0, r1) of it), converted to `dtype` when one is given. A quantised
        `X.weight` reads as its exact dequantisation, `(q - zp) · scale` or `q · scale`, in float32."""
        if name in self.quantized:
            t = self.quantized[name].dequantize(self, rows)
            return t if dtype is None else t.to(dtype)
        t = self._open(self._shard(name)).read(self.stored_name(name), rows)
        return t if dtype is None else t.to(dtype)

    def raw(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A tensor (or rows of it) exactly as stored: a quantised weight's int/fp8 storage, not its value."""
        return self._open(self._shard(name)).read(self.stored_name(name), rows)

    @cached_property
    def fused_experts(self) -> bool:
        """MoE experts stored 3-D (`experts.gate_up_proj`, as transformers 5 holds them) rather than
        one tensor per expert (as published)."""
        return any(n.endswith(".mlp.experts.gate_up_proj") for n in self._where)

    def _check_sizes(self) -> None:
        """Config sizes that multiply work (the expected-tensor list, the layers built) must not exceed
        what the checkpoint holds: `num_hidden_layers: 1e9` grew that list by ~100 MB/s before any
        check could say a tensor is missing."""
        cfg = self.root / "config.json"
        layers = [int(m.group(1)) for n in self._where if (m := LAYER.match(n))]
        if self.dims.layers > 1 + max(layers, default=-1):
            held = f"layers 0–{max(layers)}" if layers else "no layers (model.layers.*)"
            raise CheckpointError(f"{cfg}: num_hidden_layers={self.dims.layers} but the checkpoint holds {held}")
        if not self.dims.sparse:  # no MoE layer: no expert is read, however many the config names
            return
        experts = [int(m.group(1)) for n in self._where if (m := EXPERT.match(n))]
        experts += [self.info(n).shape[0] - 1 for n in self._where if FUSED_EXPERTS.match(n) and self.info(n).shape]
        if self.dims.experts > 1 + max(experts, default=-1):
            text = text_config(self.config)
            key = next((k for k in ("num_experts", "num_local_experts") if text.get(k)), "num_experts")
            held = f"experts 0–{max(experts)}" if experts else "no experts (model.layers.N.mlp.experts.*)"
            raise CheckpointError(f"{cfg}: {key}={self.dims.experts} but the checkpoint holds {held}")

    def validate_layout(self) -> dict[str, tuple[int, ...]]:
        """Check every tensor the architecture needs is present with the config's shape, and, unless
        a quantisation format says otherwise, holds floats."""
        want = expected_tensors(self.arch, self.dims, fused=self.fused_experts)
        if self.dims.layer_types:
            self._check_layer_types()
        for q in self.quantized.values():
            q.validate(self)
        for name, shape in want.items():
            got = self.shape(name)
            if got != shape:
                raise CheckpointError(
                    f"{self._where.get(name, self.root)}: tensor {name!r} has shape {list(got)}, "
                    f"but config.json implies {list(shape)}"
                )
            # An I16 k_proj would be widened to float as integers: garbage with the right shape.
            if name not in self.quantized and not (info := self.info(name)).dtype.is_floating_point:
                raise CheckpointError(
                    f"{self._where[name]}: tensor {name!r} is {DTYPE_NAMES[info.dtype]}, but it holds float "
                    "weights (integer storage is read only as part of a quantisation format config.json names)"
                )
        return want

    def unused(self) -> list[str]:
        """Tensors nothing converts: not expected by the config, not the storage of an expected quantised
        weight, not a part of the checkpoint qwen2om knowingly leaves out (`ignored`), not a known
        harmless buffer. Stored names, sorted; e.g. layers 2–3 of a config lowered to 2 layers."""
        want = set(expected_tensors(self.arch, self.dims, fused=self.fused_experts))
        storage = {n for q in self.quantized.values() if q.name in want for n in quant_storage(q)}
        skip = tuple(f"{part}." for part in self.ignored)

        def harmless(name: str) -> bool:
            # Old checkpoints saved RoPE's inverse frequencies (recomputed from rope_theta); a tied
            # head saved anyway is replaced by the embedding, by transformers as by qwen2om.
            return name.endswith(".rotary_emb.inv_freq") or (name == "lm_head.weight" and self.dims.tied)

        left = [self.stored_name(n) for n in self._where
                if n not in want and n not in storage and not n.startswith(skip) and not harmless(n)]
        return sorted([*left, *self._unlisted], key=natural)

    def check_unused(self, warn: Callable[[str], None] | None = None) -> list[str]:
        """Refuse tensors the config does not account for (`unused`), naming them; with `warn`, say
        so through it instead and go on. Returns them."""
        names = self.unused()
        if names:
            listed = f"{summarize(names, self._stored_names())} ({len(names)} tensor{'s' * (len(names) != 1)})"
            if warn is None:
                raise CheckpointError(f"{self.root}: holds tensors config.json does not account for: {listed}; "
                                      "check num_hidden_layers and the other sizes, or convert with "
                                      "--allow-unused to leave them out")
            warn(f"leaving out tensors config.json does not account for (--allow-unused): {listed}")
        return names

    def _stored_names(self) -> list[str]:
        return [*map(self.stored_name, self._where), *self._unlisted]

    def _check_layer_types(self) -> None:
        """Hybrids: each layer's tensors are of the kind `layer_types` says; the conv kernel is the config's."""
        d, cfg = self.dims, self.root / "config.json"
        for i, kind in enumerate(d.layer_types):
            p = f"model.layers.{i}"
            has_linear = f"{p}.linear_attn.out_proj.weight" in self._where
            has_full = f"{p}.self_attn.o_proj.weight" in self._where
            if kind == "linear_attention" and has_full and not has_linear:
                raise CheckpointError(f"{cfg}: layer_types[{i}] is 'linear_attention', but the checkpoint holds a "
                                      f"full-attention layer there ({p}.self_attn.*)")
            if kind == "full_attention" and has_linear and not has_full:
                raise CheckpointError(f"{cfg}: layer_types[{i}] is 'full_attention', but the checkpoint holds a "
                                      f"linear-attention layer there ({p}.linear_attn.*)")
            conv = f"{p}.linear_attn.conv1d.weight"
            if kind == "linear_attention" and conv in self._where and self.shape(conv)[-1:] != (d.conv_kernel,):
                raise CheckpointError(f"{self._where[conv]}: tensor {conv!r} has conv kernel size "
                                      f"{self.shape(conv)[-1]}, but config.json says linear_conv_kernel_dim="
                                      f"{d.conv_kernel}")

    def scan(self, names: set[str], *, workers: int = 1,
             progress: Callable[[int, int], None] = lambda done, total: None, only: bool = False) -> dict[str, str]:
        """Read every shard once, start to end: its sha256, and a NaN/Inf check of the float tensors
        in `names`. Shards are independent, so `workers` of them are read at the same time. With `only`,
        just the shards that hold `names` (a pipeline stage reads its own layers' shards).
        Raises naming the tensor; returns {shard path relative to the checkpoint: sha256}."""
        shards = sorted({self._shard(n) for n in names if n in self._where}) if only else self.shards
        total = sum(p.stat().st_size for p in shards)
        done = 0

        def bytes_read(n: int) -> None:
            nonlocal done
            done += n  # += on an int under the GIL is safe enough for a progress bar
            progress(done, total)

        names = {self.stored_name(n) for n in names}
        with ThreadPoolExecutor(max(1, workers)) as pool:
            hashes = list(pool.map(lambda p: self._scan_shard(p, names, bytes_read), shards))
        return {str(p.relative_to(self.root)): h for p, h in zip(shards, hashes, strict=True)}

    def _scan_shard(self, path: Path, names: set[str], bytes_read: Callable[[int], None]) -> str:
        shard = self._open(path)
        h = hashlib.sha256()
        h.update(shard.read_bytes(0, shard.data_start))
        pos = shard.data_start
        for info in sorted(shard.tensors.values(), key=lambda t: t.begin):
            if info.begin > pos:  # bytes between tensors still belong to the file's hash
                h.update(shard.read_bytes(pos, info.begin - pos))
            rows = info.shape[0] if info.shape else 1
            step = max(1, SCAN_BLOCK // max(1, info.row_bytes))
            check = info.name in names and info.dtype.is_floating_point
            bad = 0
            for r0 in range(0, rows, step):
                block = shard.read(info.name, (r0, min(rows, r0 + step))) if info.shape else shard.read(info.name)
                h.update(memoryview(block.reshape(-1).view(torch.uint8).numpy()))
                if check:  # torch has no isfinite for fp8: widen (e4m3fn's NaN survives; it has no Inf)
                    finite = torch.isfinite(block if block.element_size() > 1 else block.float())
                    bad += 0 if bool(finite.all()) else int((~finite).sum())
                bytes_read(block.numel() * info.dtype.itemsize)
            if bad:
                raise CheckpointError(f"{path}: tensor {info.name!r} has {bad} non-finite values (NaN/Inf) "
                                      f"of {info.nbytes // info.dtype.itemsize}")
            pos = max(pos, info.end)
        if pos < shard.size:
            h.update(shard.read_bytes(pos, shard.size - pos))
        return h.hexdigest()

    def close(self) -> None:
        for shard in self._handles.values():
            shard.close()
        self._handles.clear()


def quant_storage(q: QuantWeight) -> list[str]:
    """The names a quantised weight may be stored under: `X.weight` itself (FP8, msModelSlim int8)
    and its scale, zero point, packing and shape tensors."""
    extra = [q.scale_name] if isinstance(q, Fp8Weight) else []
    return [q.name, *extra, *(q.name + suffix for suffix in QUANT_STORAGE)]


def natural(name: str) -> list[int | str]:
    """Sort key: `model.layers.10` after `model.layers.9`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def summarize(names: list[str], everything: Iterable[str], *, limit: int = 8) -> str:
    """`names`, compactly: where they are every tensor under a numbered prefix (a layer, an expert),
    that prefix once as `model.layers.2.*`; the rest by name; at most `limit` items."""
    prefixes = Counter(p for n in everything for p in numbered_prefixes(n))
    chosen = Counter(p for n in names for p in numbered_prefixes(n))
    items: list[str] = []
    for name in names:
        whole = next((p for p in numbered_prefixes(name) if chosen[p] == prefixes[p] > 1), None)
        item = f"{whole}.*" if whole else name
        if item not in items:
            items.append(item)
    more = f", and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def numbered_prefixes(name: str) -> list[str]:
    """The prefixes of `name` that end in a number, shortest first: model.layers.2, ….experts.5."""
    parts = name.split(".")
    return [".".join(parts[:i + 1]) for i, part in enumerate(parts[:-1]) if part.isdigit()]
