"""Parameters for the static model: meta placeholders at export, real values bound when written.

The static model is built with `Weights.param(...)` instead of tensors. In lazy mode (what
`convert` uses) every parameter is a meta tensor: the exporter traces the graph structure
without a byte of weights in memory, and `write_onnx` later asks `Weights.pieces` for each
initializer, one slice at a time, straight from the memory-mapped checkpoint. In eager mode the same
code builds a real torch model (used to check the static model itself against transformers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """Where a graph initializer comes from: a checkpoint tensor, possibly transposed."""

    source: str
    transpose: bool = False


class Weights:
    """Hands out parameters in the compute dtype and remembers where each came from."""

    def __init__(self, read: Callable[..., torch.Tensor], shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, *, lazy: bool, sliced: bool = False) -> None:
        """`read(name)` returns a source tensor; with `sliced`, `read(name, rows=(r0, r1))` returns
        rows of it without reading the rest (Checkpoint.get does)."""
        self.read, self.shapes, self.dtype, self.lazy, self.sliced = read, shapes, dtype, lazy, sliced
        self._refs: dict[int, WeightRef] = {}
        self.constants: dict[str, torch.Tensor] = {}
        # Initializers a later pass derives from the checkpoint (int4 storage, scales): name → producer.
        self.derived: dict[str, Callable[[], torch.Tensor]] = {}
        # Virtual [E, ...] tensors stacked from per-expert pieces (MoE), each produced on its own.
        self.stacks: dict[str, list[Callable[[], torch.Tensor]]] = {}
        self.stored: set[str] = set()  # stacks whose pieces are bytes as stored (no dtype conversion)

    def stacked(self, name: str, shape: tuple[int, ...], parts: list[Callable[[], torch.Tensor]]) -> nn.Parameter:
        """A parameter [len(parts), *shape] whose slice e is `parts[e]()`: written one piece at a
        time, so an expert stack never has to be in memory whole."""
        self.stack(name, shape, parts)
        return self.param(name)

    def stack(self, name: str, shape: tuple[int, ...], parts: list[Callable[[], torch.Tensor]]) -> None:
        """A later pass's [len(parts), *shape] initializer, converted to the compute dtype piece by piece."""
        self.shapes[name] = (len(parts), *shape)
        self.stacks[name] = parts

    def stored_stack(self, name: str, shape: tuple[int, ...], parts: list[Callable[[], torch.Tensor]]) -> None:
        """Like `stacked`, for a later pass's initializer whose pieces are already in their stored
        form (FP8 bytes): written as produced, never converted to the compute dtype."""
        self.stack(name, shape, parts)
        self.stored.add(name)

    def param(self, name: str, *, transpose: bool = False) -> nn.Parameter:
        ref = WeightRef(name, transpose)
        if self.lazy:
            shape = self.shapes[name][::-1] if transpose else self.shapes[name]
            tensor = torch.empty(shape, dtype=self.dtype, device="meta")
        else:
            tensor = self.materialize(ref)
        p = nn.Parameter(tensor, requires_grad=False)
        self._refs[id(p)] = ref
        return p

    def constant(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A computed constant (RoPE tables): kept here, a meta placeholder in lazy mode."""
        self.constants[name] = value
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if self.lazy else value

    def pieces(self, ref: WeightRef, block_bytes: int = 64 << 20) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The converted tensor in pieces of about `block_bytes`, as (axis, start, piece).

        axis 0: `piece` is rows [start, start+n) of the output, a contiguous byte range of it;
        axis 1: `piece` is columns [start, start+n) of a transposed weight too large to convert
        whole. Only row slices of the source are ever read, so neither the source nor the
        output (a [hidden, vocab] LM head in fp32) has to fit in memory at once."""
        if ref.source in self.derived:  # already in its stored form and dtype
            yield 0, 0, self.derived[ref.source]().contiguous()
            return
        if ref.source in self.stacks:  # one expert at a time: slice e of the output
            for e, part in enumerate(self.stacks[ref.source]):
                piece = part() if ref.source in self.stored else part().to(self.dtype)
                yield 0, e, piece.contiguous()
            return
        shape = self.shapes[ref.source]
        itemsize = torch.finfo(self.dtype).bits // 8
        rows = shape[0] if shape else 1
        row_bytes = max(1, (math.prod(shape[1:]) if shape else 1) * itemsize)
        step = max(1, block_bytes // row_bytes)
        if not shape or rows <= step:  # small enough to convert whole
            t = self.read(ref.source).to(self.dtype)
            yield 0, 0, (t.T if ref.transpose else t).contiguous()
            return
        for r0 in range(0, rows, step):
            t = self.read_rows(ref.source, r0, min(rows, r0 + step)).to(self.dtype)
            yield (1, r0, t.T.contiguous()) if ref.transpose else (0, r0, t.contiguous())

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        return self.read(name, rows=(r0, r1)) if self.sliced else self.read(name)[r0:r1]

    def materialize(self, ref: WeightRef) -> torch.Tensor:
        if ref.source in self.derived:
            return self.derived[ref.source]()
        if ref.source in self.stacks:
            convert = ref.source not in self.stored
            return torch.stack([part().to(self.dtype) if convert else part() for part in self.stacks[ref.source]])
        t = self.read(ref.source).to(self.dtype)
        return t.T.contiguous() if ref.transpose else t

    def bindings(self, model: nn.Module) -> dict[str, WeightRef]:
        """Parameter name in the exported graph → its source."""
        return {fqn: self._refs[id(p)] for fqn, p in model.named_parameters()}

    def value(self, model_bindings: dict[str, WeightRef], name: str) -> torch.Tensor:
        """The real value of an initializer named `name`."""
        if name in self.constants:
            return self.constants[name]
        return self.materialize(model_bindings[name])
