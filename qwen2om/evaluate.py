"""`qwen2om eval`: perplexity, and agreement of a (quantised) model with its float original.

Both work on a Hugging Face checkpoint (through transformers; a quantised one with its exact
dequantisation) and on a converted output directory (through the runtime, the model a user
ships). The text is cut into non-overlapping windows of `window` tokens (qwen2om/datasets.py);
each window is scored from an empty cache, position t predicting token t+1:

    ppl = exp(Σ NLL / scored tokens),  scored tokens = windows · (window − 1).

An output directory is scored token by token with its decode graph (the prefill graph returns
only the last position's logits), so it is slower than transformers on the same text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qwen2om.builtin import resolve_model
from qwen2om.datasets import check_source, windows
from qwen2om.errors import Qwen2omError
from qwen2om.output import MANIFEST


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


class Scorer:
    """Log-probabilities [T, V] for every position of a window of token ids."""

    def __init__(self, path: str | Path, **engine: Any) -> None:
        """`engine`: the runtime Engine's arguments for an output directory (distributed, address)."""
        self.path = resolve_model(path)
        self.engine: Any = None
        self.model: Any = None
        if (self.path / MANIFEST).is_file():
            from qwen2om.kernels.ascend import cpu_engine

            self.engine = cpu_engine(self.path, **engine)  # Ascend-target outputs run through the reference kernels
        elif (self.path / "config.json").is_file():
            from qwen2om.verify import load_reference

            self.model = load_reference(self.path)
        else:
            raise Qwen2omError(f"{path}: neither a qwen2om output directory nor a checkpoint directory")

    @property
    def tokenizer_dir(self) -> Path:
        return self.path

    def window_note(self, name: str, window: int) -> list[str]:
        """A window longer than a checkpoint's trained positions scores RoPE extrapolation, not the model
        (an output directory refuses one longer than its cache instead)."""
        if self.model is None:
            return []
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if limit is None or window <= limit:
            return []
        return [f"{name}: a window of {window} tokens exceeds its max_position_embeddings {limit}; positions past "
                "it are extrapolated, so lower --window to measure the model as configured"]

    def __call__(self, ids: list[int]) -> np.ndarray:
        if self.model is not None:
            import torch

            with torch.no_grad():
                return log_softmax(self.model(torch.tensor([ids])).logits[0].float().numpy())
        e = self.engine
        if len(ids) > e.capacity:
            raise Qwen2omError(f"{self.path}: a window of {len(ids)} tokens exceeds the cache capacity {e.capacity}; "
                               "lower --window")
        e.reset()
        rows = [e.prefill([ids[:1]] * e.batch)[0]]
        for tok in ids[1:]:
            rows.append(e.step([tok] * e.batch)[0])
        return log_softmax(np.stack(rows))

    def close(self) -> None:
        """Release an output directory's engine (with --distributed ray: its actors)."""
        if self.engine is not None:
            self.engine.close()


@dataclasses.dataclass
class PplReport:
    model: str
    dataset: str
    window: int
    windows: int
    tokens: int
    ppl: float
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AgreeReport:
    model: str
    reference: str
    dataset: str
    window: int
    windows: int
    tokens: int
    top1_agreement: float
    mean_kl: float
    ppl: float
    reference_ppl: float
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nll(logp: np.ndarray, ids: list[int]) -> float:
    return float(-sum(logp[t, ids[t + 1]] for t in range(len(ids) - 1)))


def window_agreement(fa: np.ndarray, fb: np.ndarray) -> tuple[float, float]:
    """One window's log-probabilities of a model (fa) and its reference (fb): (positions whose top-1
    tokens agree, Σ KL(reference ‖ model)). The last position predicts past the window: left out."""
    la, lb = fa[:-1], fb[:-1]
    return float((la.argmax(-1) == lb.argmax(-1)).sum()), float((np.exp(lb) * (lb - la)).sum())


def perplexity(model: str, dataset: str, *, window: int = 256, max_windows: int = 16,
               progress: Callable[[int, int], None] = lambda d, t: None,
               log: Callable[[str], None] = lambda m: None, distributed: str | None = None,
               address: str | None = None) -> PplReport:
    """`distributed`/`address`: an output directory's stages as Ray actors (the runtime Engine's arguments)."""
    check_source(dataset)  # a bad --dataset fails before the model loads, not after
    scorer = Scorer(model, distributed=distributed, address=address)
    try:
        return score_ppl(scorer, model, dataset, window, max_windows, progress, log)
    finally:
        scorer.close()


def score_ppl(scorer: Scorer, model: str, dataset: str, window: int, max_windows: int,
              progress: Callable[[int, int], None], log: Callable[[str], None]) -> PplReport:
    data = windows(dataset, scorer.tokenizer_dir, num_samples=max_windows, seq_len=window)
    notes = [*data.notes, *scorer.window_note(model, window)]
    for n in notes:
        log(n)
    total, count = 0.0, 0
    for i, ids in enumerate(data.samples):
        total += nll(scorer(ids), ids)
        count += len(ids) - 1
        progress(i + 1, len(data.samples))
    return PplReport(model, dataset, window, len(data.samples), count, math.exp(total / count), notes)


def agreement(model: str, reference: str, dataset: str, *, window: int = 256, max_windows: int = 16,
              progress: Callable[[int, int], None] = lambda d, t: None,
              log: Callable[[str], None] = lambda m: None, distributed: str | None = None,
              address: str | None = None) -> AgreeReport:
    """`distributed`/`address`: output directories' stages as Ray actors (the runtime Engine's arguments)."""
    check_source(dataset)
    a = Scorer(model, distributed=distributed, address=address)
    try:
        b = Scorer(reference, distributed=distributed, address=address)
        try:
            return score_agreement(a, b, model, reference, dataset, window, max_windows, progress, log)
        finally:
            b.close()
    finally:
        a.close()


def score_agreement(a: Scorer, b: Scorer, model: str, reference: str, dataset: str, window: int, max_windows: int,
                    progress: Callable[[int, int], None], log: Callable[[str], None]) -> AgreeReport:
    from qwen2om.verify import check_same_vocabulary

    check_same_vocabulary(a.path, b.path, (model, reference))
    data = windows(dataset, b.tokenizer_dir, num_samples=max_windows, seq_len=window)
    notes = [*data.notes, *a.window_note(model, window), *b.window_note(reference, window)]
    for n in notes:
        log(n)
    agree = kl = nll_a = nll_b = 0.0
    count = 0
    for i, ids in enumerate(data.samples):
        fa, fb = a(ids), b(ids)
        same, div = window_agreement(fa, fb)
        agree, kl = agree + same, kl + div
        nll_a, nll_b = nll_a + nll(fa, ids), nll_b + nll(fb, ids)
        count += len(ids) - 1
        progress(i + 1, len(data.samples))
    return AgreeReport(model, reference, dataset, window, len(data.samples), count, agree / count, kl / count,
                       math.exp(nll_a / count), math.exp(nll_b / count), notes)
