"""Lazy, validated access to a Hugging Face checkpoint directory.

Tensors are read one at a time, or in row slices, with positioned reads from safetensors shards
(single file or sharded with an index), so opening a checkpoint costs its headers, not its
weights, and resident memory never holds more than the tensors in hand (see safetensors_io).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from qwen2om.arch import ArchSpec, ModelDims, expected_tensors, resolve_arch
from qwen2om.errors import CheckpointError
from qwen2om.quantized import QuantWeight, read_quantization
from qwen2om.safetensors_io import Shard, TensorInfo

SCAN_BLOCK = 16 << 20

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file and the problem."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


class Checkpoint:
    """A checkpoint directory: config, architecture, and a lazy tensor table."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")
        self.config = read_json(self.root / "config.json", "config.json")
        self.arch: ArchSpec = resolve_arch(self.config, str(self.root / "config.json"))
        self.dims = ModelDims.from_config(self.config, str(self.root / "config.json"))
        self._handles: dict[Path, Shard] = {}
        # Text-model name → the name it is stored under, where they differ (the published wrapper).
        self._stored: dict[str, str] = {}
        # Parts of a published checkpoint that are not converted: name prefix → tensor count.
        self.ignored: dict[str, int] = {}
        stored = self._locate_tensors()
        self._where = self._unwrap(stored)
        # Quantisation is read from the files' own names, then addressed by text-model names too.
        found = read_quantization(self.config, stored, str(self.root))
        self.quantized: dict[str, QuantWeight] = {self.text_name(n): self._renamed(q) for n, q in found.items()}

    # -- discovery -------------------------------------------------------------------------
    def _locate_tensors(self) -> dict[str, Path]:
        index = self.root / INDEX_FILE
        if index.exists():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no 'weight_map' in the index")
            where = {name: self.root / shard for name, shard in weight_map.items()}
            for shard in sorted(set(where.values())):
                if not shard.is_file():
                    raise CheckpointError(f"{index} names shard {shard.name}, which does not exist")
        else:
            single = self.root / SINGLE_FILE
            shards = [single] if single.is_file() else sorted(self.root.glob("*.safetensors"))
            if not shards:
                if (self.root / "manifest.json").is_file():
                    raise CheckpointError(f"{self.root} is a qwen2om output directory (manifest.json, ONNX graphs), "
                                          "not a checkpoint: give the checkpoint it was converted from, or "
                                          f"`qwen2om run {self.root}` to use it")
                raise CheckpointError(f"{self.root}: no *.safetensors weights and no {INDEX_FILE}")
            where = {}
            for shard in shards:
                for name in self._open(shard).tensors:
                    where[name] = shard
        # Open every shard now so a truncated or corrupt file fails before any work.
        for shard in sorted(set(where.values())):
            present = set(self._open(shard).tensors)
            for name, path in where.items():
                if path == shard and name not in present:
                    raise CheckpointError(f"{shard}: the index says it holds {name!r}, but it does not")
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
            if self.arch.wrapper_architectures and name.startswith(("model.visual.", "mtp.")):
                part = "mtp" if name.startswith("mtp.") else "model.visual"
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
        """Every file the conversion reads (config, index, shards, tokenizer files present)."""
        found = {self.root / "config.json", *self._where.values()}
        for extra in (INDEX_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (self.root / extra).is_file():
                found.add(self.root / extra)
        return sorted(found)

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

    def validate_layout(self) -> dict[str, tuple[int, ...]]:
        """Check every tensor the architecture needs is present with the config's shape."""
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
        return want

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
             progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, str]:
        """Read every shard once, start to end: its sha256, and a NaN/Inf check of the float tensors
        in `names`. Shards are independent, so `workers` of them are read at the same time.
        Raises naming the tensor; returns {shard path relative to the checkpoint: sha256}."""
        total = sum(p.stat().st_size for p in self.shards)
        done = 0

        def bytes_read(n: int) -> None:
            nonlocal done
            done += n  # += on an int under the GIL is safe enough for a progress bar
            progress(done, total)

        names = {self.stored_name(n) for n in names}
        with ThreadPoolExecutor(max(1, workers)) as pool:
            hashes = list(pool.map(lambda p: self._scan_shard(p, names, bytes_read), self.shards))
        return {str(p.relative_to(self.root)): h for p, h in zip(self.shards, hashes, strict=True)}

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
