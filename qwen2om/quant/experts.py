"""Calibrating MoE experts: each expert from the tokens routed to it, RTN when it sees too few.

An expert's linears see only the tokens the router sends to it, so its GPTQ Hessians are built
from exactly those: during the layer's statistics pass a pre-hook on the MoE block routes the
block's input the way the block itself does (softmax, top-k) and, per expert, accumulates
`2·XᵀX` of its tokens for gate/up and of `silu(X·Wg)·(X·Wu)` for down. Experts that receive fewer
than `min_tokens` calibration tokens — with skewed routers some receive none — are quantised by
round-to-nearest instead, which needs no data; the report names each one with its token count.
The router itself is never quantised (architecture data).

Checkpoints that store the experts fused 3-D (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]: the published Qwen3.5 MoE files, and what transformers 5 saves) are quantised expert by
expert all the same: `unfused_experts` names each expert's projection as the per-expert layout does
(`experts.E.gate_proj.weight`, [out, in]) and reads it as one slice of its stack, so the calibrated
checkpoint holds per-expert compressed-tensors weights (as published int4 MoE checkpoints do) and no
fused float stack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from qwen2om.arch import ArchSpec
from qwen2om.families import TensorNames, family_of
from qwen2om.quant.tree import Stats
from qwen2om.static_model import SparseMoE

MIN_TOKENS = 16
MIN_FRACTION = 0.005  # and at least this share of the layer's tokens (as GPTQModel)


class Reader(Protocol):
    arch: ArchSpec

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str, dtype: torch.dtype | None = None, rows: tuple[int, int] | None = None,
            ) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """One expert's projection inside a fused stack: `gate_up_proj` [E, 2I, H] is gate ‖ up along
    dim 1, `down_proj` [E, H, I]; the slice is [out, in], like the per-expert tensor."""

    source: str  # the fused tensor
    expert: int
    part: str  # "gate", "up" or "down"

    def shape(self, ckpt: Reader) -> tuple[int, ...]:
        out, k = ckpt.shape(self.source)[1:]
        return (out, k) if self.part == "down" else (out // 2, k)

    def read(self, ckpt: Reader, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = ckpt.get(self.source, dtype, rows=(self.expert, self.expert + 1))[0]
        if self.part == "down":
            return t
        half = t.shape[0] // 2
        return (t[:half] if self.part == "gate" else t[half:]).clone()


def unfused_experts(ckpt: Reader) -> dict[str, ExpertSlice]:
    """Per-expert names (`...experts.E.{gate,up,down}_proj.weight`) of every fused expert stack in `ckpt`."""
    names = family_of(ckpt.arch).names
    out: dict[str, ExpertSlice] = {}
    for name in ckpt.names():
        if names.parse_fused(name):
            for e in range(ckpt.shape(name)[0]):
                out |= {expert: ExpertSlice(name, e, part) for part, expert in names.unfused(name, e).items()}
    return out


def expanded_shape(ckpt: Reader, slices: dict[str, ExpertSlice], name: str) -> tuple[int, ...]:
    """The shape of `name`, a checkpoint tensor or one expert's slice of a fused stack."""
    return tuple(slices[name].shape(ckpt) if name in slices else ckpt.shape(name))


def expand_names(names: Iterable[str], slices: dict[str, ExpertSlice]) -> list[str]:
    """`names` with each fused stack replaced, in place, by the per-expert names of its slices."""
    by_source: dict[str, list[str]] = {}
    for n, s in slices.items():
        by_source.setdefault(s.source, []).append(n)
    return [x for n in names for x in by_source.get(n, [n])]


class ExpertCollector:
    """A pre-hook on an MoE block: routes the block's input as the block does and sums, per expert, xᵀx of
    its tokens (gate/up) and of its activations (down). `sums` is one forward's; `reset` starts the next."""

    def __init__(self, moe: SparseMoE) -> None:
        self.moe = moe
        self.sums: Stats = {}
        self.reset()

    def reset(self) -> None:
        e, h, i = self.moe.d.experts, self.moe.d.hidden, self.moe.d.moe_intermediate
        device = self.moe.gate.weight.device
        self.sums = {"e.gate_up": torch.zeros(e, h, h, device=device), "e.down": torch.zeros(e, i, i, device=device),
                     "e.tokens": torch.zeros(e, dtype=torch.int64), "e.total": torch.zeros((), dtype=torch.int64)}

    def hook(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        moe, d, s = self.moe, self.moe.d, self.sums
        x = args[0].reshape(-1, d.hidden).float()
        s["e.total"] += x.shape[0]
        index = torch.topk(torch.softmax(moe.gate(x.to(moe.gate.weight.dtype)).float(), -1), d.top_k, -1).indices
        for e in range(d.experts):
            xe = x[(index == e).any(-1)]
            if not xe.shape[0]:
                continue
            gu = xe @ moe.experts.gate_up[e].float()
            act = torch.nn.functional.silu(gu[:, :d.moe_intermediate]) * gu[:, d.moe_intermediate:]
            s["e.gate_up"][e] += xe.T @ xe
            s["e.down"][e] += act.T @ act
            s["e.tokens"][e] += xe.shape[0]


class ExpertStats:
    """Per-expert input Hessians and token counts of one MoE block over all the calibration samples,
    from the sums the collectors' chunks add up to (qwen2om.quant.tree)."""

    def __init__(self, sums: Stats) -> None:
        self.sums = sums
        self.tokens = [int(t) for t in sums["e.tokens"]]
        self.total = int(sums["e.total"])

    def hessian(self, e: int, proj: str) -> torch.Tensor:
        """mean(2xxᵀ) over the tokens expert `e` received (its gate and up share one)."""
        h = self.sums["e.down" if proj == "down" else "e.gate_up"][e]
        return h * (2 / max(1, self.tokens[e]))

    def enough(self, e: int) -> bool:
        return self.tokens[e] >= max(MIN_TOKENS, math.ceil(MIN_FRACTION * self.total))


def expert_weight(moe: SparseMoE, e: int, proj: str) -> torch.Tensor:
    """Expert `e`'s `proj` weight as [out, in] (the stacks hold them transposed)."""
    i = moe.d.moe_intermediate
    if proj == "down":
        return moe.experts.down.data[e].T
    return moe.experts.gate_up.data[e][:, :i].T if proj == "gate" else moe.experts.gate_up.data[e][:, i:].T


def set_expert_weight(moe: SparseMoE, e: int, proj: str, w: torch.Tensor) -> None:
    i = moe.d.moe_intermediate
    if proj == "down":
        moe.experts.down.data[e] = w.T.to(moe.experts.down.dtype)
    elif proj == "gate":
        moe.experts.gate_up.data[e][:, :i] = w.T.to(moe.experts.gate_up.dtype)
    else:
        moe.experts.gate_up.data[e][:, i:] = w.T.to(moe.experts.gate_up.dtype)


def expert_jobs(moe: SparseMoE, stats: ExpertStats, names: list[str], naming: TensorNames,
                ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[tuple[str, str]], dict[str, Any]]:
    """The experts' weights in `names` split into GPTQ jobs (name, weight [out, in], Hessian) and RTN
    fallbacks (name, why: too few calibration tokens), with the report's entry."""
    jobs, rtn, fell_back = [], [], []
    for name in names:
        parsed = naming.parse_expert(name)
        assert parsed is not None
        _, e, proj = parsed
        if stats.enough(e):
            jobs.append((name, expert_weight(moe, e, proj).float(), stats.hessian(e, proj)))
        else:
            rtn.append((name, f"expert {e} received {stats.tokens[e]} of {stats.total} calibration tokens"))
            if proj == "gate":
                fell_back.append(e)
    return jobs, rtn, {"tokens": stats.tokens, "total": stats.total, "rtn_experts": fell_back}
