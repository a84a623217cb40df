"""Parameters for the static model: meta placeholders at export, real values bound when written.

The static model is built with `Weights.param(...)` instead of tensors. In lazy mode (what
`convert` uses) every parameter is a meta tensor: the exporter traces the graph structure
without a byte of weights in memory, and `write_onnx` later asks `Weights.materialize` for each
initializer, one at a time, straight from the memory-mapped checkpoint. In eager mode the same
code builds a real torch model (used to check the static model itself against transformers).
"""

from __future__ import annotations

import dataclasses
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

    def __init__(self, read: Callable[[str], torch.Tensor], shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, *, lazy: bool) -> None:
        self.read, self.shapes, self.dtype, self.lazy = read, shapes, dtype, lazy
        self._refs: dict[int, WeightRef] = {}
        self.constants: dict[str, torch.Tensor] = {}

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

    def blocks(self, ref: WeightRef, block_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """The converted tensor as consecutive row blocks of at most ~`block_bytes`: a transposed
        [vocab, hidden] LM head never exists whole in the compute dtype."""
        src = self.read(ref.source)
        out = src.T if ref.transpose else src
        rows = out.shape[0] if out.dim() else 1
        row_bytes = max(1, out[0].numel() * torch.finfo(self.dtype).bits // 8) if out.dim() else 1
        step = max(1, block_bytes // row_bytes)
        if out.dim() == 0 or step >= rows:
            yield out.to(self.dtype).contiguous()
            return
        for i in range(0, rows, step):
            yield out[i:i + step].to(self.dtype).contiguous()

    def materialize(self, ref: WeightRef) -> torch.Tensor:
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
