"""RoPE tables are computed on one torch thread, so every run gets the same bits.

float64 cos/sin of a [512, 128] table over two threads came out different in the last bits in about 1 process
in 15 on an AVX-512 Xeon, which now and then changed `calibrate`'s checkpoint bytes (qwen2om/rope.py's
one_thread). The variation is per process and rare, so a test cannot wait for it; it checks the mechanism.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen2om.rope import one_thread, rope_tables

ROOT = Path(__file__).resolve().parent.parent


def config() -> dict[str, Any]:  # a published-shape Qwen3 config (head_dim 64, rope_theta 1e6)
    return json.loads((ROOT / "fixtures" / "data" / "tiny-qwen3-trained" / "config.json").read_text())


@pytest.mark.parametrize("threads", [1, 2])
def test_cos_and_sin_run_on_one_thread_and_the_count_is_restored(monkeypatch, threads: int) -> None:
    seen: list[int] = []
    for name in ("cos", "sin"):
        real = getattr(torch.Tensor, name)

        def traced(self: torch.Tensor, real=real) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return real(self)

        monkeypatch.setattr(torch.Tensor, name, traced)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cos, sin = rope_tables(config(), 512)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1]
    assert cos.shape == sin.shape and cos.dtype == torch.float32 and cos.shape[0] == 512


def test_the_tables_equal_a_one_thread_float64_computation() -> None:
    cfg = config()
    cos, sin = rope_tables(cfg, 300)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = torch.outer(torch.arange(300, dtype=torch.float64), inv.double()).repeat(1, 2)
    with one_thread():
        assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
