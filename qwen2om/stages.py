"""Pipeline stages: a model cut into K contiguous runs of decoder layers, each a complete static model.

Stage k takes the hidden states `[B, T, hidden]` that stage k-1 returns (the first stage takes the
token ids and embeds them), the same mask and positions as an unstaged graph, and the caches and
states of its own layers; the last stage applies the final norm and the LM head. Each stage is
converted by the whole pipeline into `OUT/stages/NN/`, so each is compiled (ATC) for its own device.

Layers are split so that the largest stage is as small as it can be: the embedding counts to the
first stage and the final norm and LM head to the last, as their bytes do on the device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from qwen2om.arch import EMBED
from qwen2om.errors import RecipeError

STAGES_DIR = "stages"
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`: decoder layers [start, stop)."""

    index: int
    count: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def dirname(self) -> str:
        """Where the stage lives inside OUT."""
        return f"{STAGES_DIR}/{self.index:02d}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "layers": [self.start, self.stop], "dir": self.dirname}

    def holds(self, name: str, tied: bool) -> bool:
        """Whether checkpoint tensor `name` (canonical: model.layers.N.…) is read by this stage: its
        layers' tensors, the embedding in the first (and in the last when tied), the rest in the last."""
        if m := LAYER.match(name):
            return int(m.group(1)) in self.layers
        if name == EMBED:
            return self.first or (tied and self.last)
        return self.last

    @classmethod
    def whole(cls, layers: int) -> Stage:
        """The unstaged model as one stage."""
        return cls(0, 1, 0, layers)


def stages_of(bounds: Sequence[tuple[int, int]]) -> list[Stage]:
    return [Stage(i, len(bounds), a, b) for i, (a, b) in enumerate(bounds)]


def _weighted(layer_bytes: Sequence[int], first: int, last: int) -> list[int]:
    """Per-layer costs with the first stage's extra on layer 0 and the last stage's on the last layer:
    those layers are always in those stages, so the split problem stays one of contiguous sums."""
    costs = [int(b) for b in layer_bytes]
    costs[0] += first
    costs[-1] += last
    return costs


def _greedy(costs: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """Left-to-right runs, each as long as it fits `cap` (every cost ≤ cap)."""
    runs, start, total = [], 0, 0
    for i, c in enumerate(costs):
        if total + c > cap and i > start:
            runs.append((start, i))
            start, total = i, 0
        total += c
    runs.append((start, len(costs)))
    return runs


def split_layers(layer_bytes: Sequence[int], k: int, *, first: int = 0, last: int = 0) -> list[tuple[int, int]]:
    """`k` contiguous non-empty runs of layers whose largest total (with `first` on the first run and
    `last` on the last) is the smallest possible; among those, the earliest cut points. Deterministic."""
    n = len(layer_bytes)
    if k < 1:
        raise RecipeError(f"--stages must be at least 1 (got {k})")
    if k > n:
        raise RecipeError(f"--stages {k} is more than the model's {n} decoder layers: each stage holds at least one")
    costs = _weighted(layer_bytes, first, last)
    lo, hi = max(costs), sum(costs)
    while lo < hi:  # the smallest cap that `k` runs can meet
        mid = (lo + hi) // 2
        if len(_greedy(costs, mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    runs = _greedy(costs, lo)
    while len(runs) < k:  # fewer runs than asked fit the cap: split the longest (never raises the maximum)
        i = max(range(len(runs)), key=lambda j: (runs[j][1] - runs[j][0], -j))
        a, b = runs[i]
        mid = (a + b) // 2
        runs[i:i + 1] = [(a, mid), (mid, b)]
    return runs


def stage_totals(layer_bytes: Sequence[int], runs: Sequence[tuple[int, int]], *, first: int = 0,
                 last: int = 0) -> list[int]:
    costs = _weighted(layer_bytes, first, last)
    return [sum(costs[a:b]) for a, b in runs]


def fewest_stages(layer_bytes: Sequence[int], capacity: int, *, first: int = 0, last: int = 0,
                  what: str = "a device") -> list[tuple[int, int]]:
    """The fewest contiguous runs that each fit `capacity` bytes, balanced as `split_layers` balances
    them; refused, naming the stage and its bytes, when one layer (with the embedding or the head it
    must share a stage with) cannot fit however the layers are split."""
    costs = _weighted(layer_bytes, first, last)
    over = [i for i, c in enumerate(costs) if c > capacity]
    if over:
        i = over[0]
        where = ("the first stage (layer 0 with the embedding)" if i == 0 and first else
                 f"the last stage (layer {i} with the final norm and LM head)" if i == len(costs) - 1 and last else
                 f"a stage holding layer {i} alone")
        raise RecipeError(f"{where} needs {gib(costs[i])} but {what} has {gib(capacity)}: it cannot fit however "
                          "the layers are split (quantise the weights, shorten --max-seq-len, or use a larger device)")
    return split_layers(layer_bytes, len(_greedy(costs, capacity)), first=first, last=last)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def split_id(key: dict[str, Any]) -> str:
    """The id every stage of one conversion records: a hash of what decides the stages' graphs and
    weights (the checkpoint's config and files, the recipe, the split), the same on every host."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
