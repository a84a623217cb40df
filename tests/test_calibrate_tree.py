"""The fixed-order reduction behind distributed calibration (qwen2om/quant/tree.py): any split of the
chunks into worker ranges joins to the same bits as one process's sum, and the device check names
what is missing."""

from __future__ import annotations

import random

import pytest
import torch

from qwen2om.quant.calibrate import CalibrationConfig
from qwen2om.quant.device import torch_device
from qwen2om.quant.schemes import CalibrationError
from qwen2om.quant.tree import add, blocks, chunk_samples, join, range_sums, ranges, span


def chunk_stats(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Float sums whose order matters: values of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    return [{"h": torch.randn(8, 8, generator=g) * 10 ** float(torch.randint(-4, 5, (1,), generator=g)),
             "n": torch.tensor(c + 1, dtype=torch.int64)} for c in range(count)]


def fresh(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A chunk's stats as `range_sums` takes them: new tensors each call (it sums into them)."""
    return {k: v.clone() for k, v in stats.items()}


def tree(stats: list[dict[str, torch.Tensor]], lo: int, size: int) -> dict[str, torch.Tensor] | None:
    """The canonical tree written out directly: node (lo, size) = left half + right half."""
    if lo >= len(stats):
        return None
    if size == 1:
        return stats[lo]
    return add(tree(stats, lo, size // 2), tree(stats, lo + size // 2, size // 2))


def split(count: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, count), min(parts, count) - 1)) if count > 1 else []
    edges = [0, *cuts, count]
    return list(zip(edges, edges[1:], strict=False))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7, 8, 9, 16, 23])
def test_every_split_joins_to_the_canonical_trees_bits(count: int) -> None:
    stats = chunk_stats(count, count)
    want = tree(stats, 0, span(count))
    assert want is not None
    rng = random.Random(count)
    for parts in range(1, min(count, 5) + 1):
        for _ in range(4):
            nodes = {}
            for a, b in split(count, parts, rng):
                nodes |= range_sums(a, b, count, lambda c: fresh(stats[c]))
            got = join(nodes, count)
            assert got is not None and torch.equal(got["h"], want["h"]) and int(got["n"]) == count * (count + 1) // 2
    if count >= 8:  # the order matters at all (else this shows nothing): a left-to-right sum differs
        running = stats[0]["h"].clone()
        for s in stats[1:]:
            running += s["h"]
        assert not torch.equal(running, want["h"])


def test_blocks_tile_a_range_with_aligned_nodes() -> None:
    for count in range(1, 40):
        for a in range(count):
            for b in range(a + 1, count + 1):
                nodes = blocks(a, b, count)
                covered = [c for lo, size in nodes for c in range(lo, lo + size) if c < count]
                assert covered == list(range(a, b))
                assert all(lo % size == 0 and size & (size - 1) == 0 for lo, size in nodes)


def test_a_missing_chunk_is_named() -> None:
    stats = chunk_stats(0, 6)
    nodes = range_sums(0, 3, 6, lambda c: fresh(stats[c]))
    with pytest.raises(ValueError, match="chunk 3"):
        join(nodes, 6)


def test_chunks_hold_consecutive_samples_of_one_length() -> None:
    assert chunk_samples([4, 4, 4, 4, 4], 2) == [[0, 1], [2, 3], [4]]
    assert chunk_samples([4, 4, 3, 3, 4], 4) == [[0, 1], [2, 3], [4]]
    assert chunk_samples([], 3) == []
    assert ranges([5, 1, 2, 3, 7, 8]) == [(1, 4), (5, 6), (7, 9)]


def test_a_device_that_is_not_here_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CalibrationError, match="not one of cpu, cuda"):
        CalibrationConfig(device="gpu")
    with pytest.raises(CalibrationError, match="not one of cpu, cuda"):
        CalibrationConfig(device="cpu:1")
    assert torch_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CalibrationError, match="--device cuda:1: no CUDA GPU is usable here"):
        torch_device("cuda:1")
    import qwen2om.doctor as doctor

    monkeypatch.setattr(doctor, "dist_version", lambda dist: None)
    with pytest.raises(CalibrationError, match="--device npu: torch-npu is not installed"):
        torch_device("npu")


def test_a_device_is_checked_before_any_data_is_read(cli, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qwen2om.quant.calibrate as calibrate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calibrate, "windows", lambda *a, **k: pytest.fail("the dataset was read"))
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "q", "--group-size", "32",
                       "--device", "cuda")
    assert code != 0 and "--device cuda: no CUDA GPU is usable here" in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "q", "--group-size", "32",
                       "--workers", "3")
    assert code != 0 and "--address and --workers are for --distributed ray" in err
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "q", "--method", "rtn",
                       "--group-size", "32", "--resume")
    assert code != 0 and "needs neither" in err
