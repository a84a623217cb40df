"""Run a checkpoint one decoder layer at a time over a set of samples (what calibration needs).

Calibration (GPTQ, AWQ) looks at each layer's inputs over hundreds of samples. Loading the
model to do that is what makes today's tools need the model's size in RAM. Here only one
layer's weights are resident: the samples' hidden states are carried from layer to layer in an
`ActivationStore`, which keeps them in memory up to a byte budget and spills the rest to
files on disk, so peak memory is one layer plus the budget, whatever the number of layers.

The layer code is the static model's own (`qwen2om/static_model.py`), with an empty KV cache
and a causal mask (hybrids' linear-attention layers: zero conv and recurrent states): the same
numerics the exported graph has, except that attention runs through PyTorch's fused causal kernel
(`CausalAttention`: equal within float rounding, and a calibration pass 25 % faster).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import platform
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qwen2om.arch import ArchSpec, ModelDims
from qwen2om.checkpoint import Checkpoint
from qwen2om.families import Layer, family_of
from qwen2om.weights import Weights


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system, on glibc (elsewhere nothing).

    PyTorch frees each layer's activations and gradients to glibc's heap, which keeps the pages and,
    with sizes that differ from step to step, fragments them, so the resident size creeps up layer after
    layer without a byte leaking. Measured with `calibrate --hessian fisher` at Qwen3-0.6B shapes: RssAnon
    rose ~10 MB a layer through the backward pass (0.47 → 0.77 GiB over 28 layers; 0.37 GiB and flat after
    a trim) and peak RSS was 0.14 GiB higher at 28 layers than at 7. A trim after each layer's step keeps
    memory independent of depth, for a few milliseconds.
    """
    if (trim := _malloc_trim()) is not None:
        trim(0)


class ActivationStore:
    """Per-sample arrays between two layers: in memory up to `budget` bytes, then on disk.

    Spilled samples live in one file per sample (np.save / np.load with mmap), in a private
    temporary directory removed by `close()`.
    """

    def __init__(self, budget: int, spill_dir: Path | None = None) -> None:
        self.budget, self.used = budget, 0
        self._spill_root = spill_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._mem: dict[int, np.ndarray] = {}
        self._disk: dict[int, Path] = {}

    def _dir(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="qwen2om-acts-", dir=self._spill_root)
        return Path(self._tmp.name)

    def put(self, i: int, a: np.ndarray) -> None:
        self.drop(i)
        if self.used + a.nbytes <= self.budget:
            self._mem[i], self.used = a, self.used + a.nbytes
        else:
            path = self._dir() / f"{i}.npy"
            np.save(path, a)
            self._disk[i] = path

    def get(self, i: int) -> np.ndarray:
        if i in self._mem:
            return self._mem[i]
        return np.load(self._disk[i], mmap_mode="r")

    def drop(self, i: int) -> None:
        if i in self._mem:
            self.used -= self._mem.pop(i).nbytes
        if i in self._disk:
            self._disk.pop(i).unlink(missing_ok=True)

    @property
    def spilled(self) -> int:
        return len(self._disk)

    def __len__(self) -> int:
        return len(self._mem) + len(self._disk)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._mem, *self._disk}))

    def close(self) -> None:
        self._mem.clear()
        self._disk.clear()
        self.used = 0
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@dataclasses.dataclass
class LayerTensors:
    """What a LayerRunner reads, without the checkpoint's files: the model's config and the tensors of
    the layer being run (a calibration worker gets them through Ray's object store, on any host)."""

    config: dict
    arch: ArchSpec
    dims: ModelDims
    fused_experts: bool
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def header(cls, ckpt: Checkpoint) -> LayerTensors:
        return cls(ckpt.config, ckpt.arch, ckpt.dims, ckpt.fused_experts)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str, dtype: torch.dtype | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        t = self.tensors[name] if rows is None else self.tensors[name][rows[0]:rows[1]]
        return t if dtype is None else t.to(dtype)


@dataclasses.dataclass
class LayerInputs:
    """What a hook sees for one sample entering a layer."""

    sample: int
    hidden: torch.Tensor  # [1, T, hidden]


class CausalAttention(nn.Module):
    """`CacheAttention` for calls from an empty cache with the plain causal mask, which is every
    call a LayerRunner makes: scaled_dot_product_attention skips the masked half of the scores."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.width = heads * head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        if past_k.shape[2]:
            raise ValueError("CausalAttention runs from an empty cache only")
        b, _, t, _ = q.shape
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, self.width)


NO_MASK = torch.empty(0)  # what the layers' mask argument gets here: CausalAttention never reads it


class LayerRunner:
    """Embedding, then each decoder layer over every sample, one layer's weights at a time."""

    def __init__(self, ckpt: Checkpoint | LayerTensors, *, dtype: torch.dtype = torch.float32, budget: int = 1 << 30,
                 spill_dir: Path | None = None, device: torch.device | str = "cpu") -> None:
        self.ckpt, self.dtype, self.d = ckpt, dtype, ckpt.dims
        self.device = torch.device(device)
        self.family = family_of(ckpt.arch)
        self.budget, self.spill_dir = budget, spill_dir
        # A checkpoint's table is fixed; a LayerTensors holds one layer at a time, so it is asked each time.
        self.shapes = None if isinstance(ckpt, LayerTensors) else {n: ckpt.shape(n) for n in ckpt.names()}
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def weights(self) -> Weights:
        shapes = self.shapes if self.shapes is not None else {n: self.ckpt.shape(n) for n in self.ckpt.names()}
        return Weights(self.ckpt.get, shapes, self.dtype, lazy=False, sliced=True)

    def embed(self, samples: list[list[int]]) -> ActivationStore:
        """Hidden states entering layer 0, read row by row from the embedding table."""
        store = ActivationStore(self.budget, self.spill_dir)
        name = self.family.names.embed
        for i, ids in enumerate(samples):
            unique, where = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)  # each row read once
            rows = torch.cat([self.ckpt.get(name, self.dtype, rows=(int(t), int(t) + 1)) for t in unique])
            store.put(i, rows[torch.from_numpy(where.reshape(-1))][None].float().numpy())
        return store

    def layer(self, index: int) -> Layer:
        """Decoder layer `index` with its real weights (and only its weights) loaded."""
        layer = self.family.layer(self.ckpt.arch, self.d, self.weights(), self.family.names.layer(index), index,
                                  fused=self.ckpt.fused_experts).eval().to(self.device)
        for m in layer.modules():
            if hasattr(m, "cache_attention"):
                m.cache_attention = CausalAttention(self.d.heads, self.d.head_dim)
        return layer

    def run_layer(self, index: int, store: ActivationStore,
                  hook: Callable[[Layer, LayerInputs], None] | None = None) -> ActivationStore:
        """Every sample through layer `index`; returns the store of its outputs (the input store is closed)."""
        layer = self.layer(index)
        out = ActivationStore(self.budget, self.spill_dir)
        with torch.no_grad():
            for i in store:
                x = torch.from_numpy(np.array(store.get(i)))
                if hook is not None:
                    hook(layer, LayerInputs(i, x))
                out.put(i, self.forward(layer, x).float().numpy())
                store.drop(i)
        store.close()
        return out

    def run(self, samples: list[list[int]], hook: Callable[[int, Layer, LayerInputs], None] | None = None,
            progress: Callable[[int, int], None] = lambda done, total: None) -> ActivationStore:
        """All layers; `hook(layer_index, layer, inputs)` sees each sample before each layer."""
        store = self.embed(samples)
        for index in range(self.d.layers):
            bound = None if hook is None else (lambda layer, x, index=index: hook(index, layer, x))
            store = self.run_layer(index, store, bound)
            progress(index + 1, self.d.layers)
        return store

    def final_norm(self, store: ActivationStore) -> list[torch.Tensor]:
        norm = self.family.norm(self.weights(), self.family.names.final_norm, self.d.rms_eps).to(self.device)
        with torch.no_grad():
            return [norm(torch.from_numpy(np.array(store.get(i))).to(self.device)) for i in store]

    def forward(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """One sample [1, T, hidden] through `layer`, causal, from an empty cache (the family's first call)."""
        cos, sin = self._tables(x.shape[1])
        mask = NO_MASK  # CausalAttention is causal by construction; linear attention takes no mask
        return self.family.first_call(layer, x.to(self.device, self.dtype), cos, sin, mask, self.d)

    def _tables(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[2] < t:
            cos, sin = self.family.rope_tables(self.ckpt.config, self.d, max(t, 256))
            self._rope = (cos.to(self.device, self.dtype)[None, None], sin.to(self.device, self.dtype)[None, None])
        cos, sin = self._rope
        return cos[:, :, :t], sin[:, :, :t]

