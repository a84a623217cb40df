"""Statistics summed in a fixed order, whoever computes them.

Calibration statistics (GPTQ Hessians, AWQ activation means, expert token counts) are sums over the
calibration samples. Float addition is not associative, so a running sum's last bits depend on the
order of its terms, and so does every quantised value downstream. To make one process and N workers
write the same checkpoint, byte for byte:

* the samples are cut into **chunks** once, from the samples alone (`batch_size` consecutive samples of
  one length: one forward call each, so a chunk's own sums never depend on who runs it);
* chunk sums are combined along one **canonical tree**: the aligned binary tree over chunk indices
  (node `(lo, size)` covers chunks lo .. lo+size-1, size a power of two, lo a multiple of size; nodes
  past the last chunk are empty).

A worker holding the chunk range [a, b) sums the largest aligned nodes inside it (`blocks`) — each
exactly as the whole tree would — and the driver joins the nodes it receives upward (`join`). One
process is one range [0, C): it returns the root. Any split of the chunks gives the same root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

Stats = dict[str, torch.Tensor]
Node = tuple[int, int]  # (first chunk, size)


def chunk_samples(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Sample indices in chunks of up to `batch_size` consecutive samples of equal length."""
    chunks: list[list[int]] = []
    for i, n in enumerate(lengths):
        if chunks and len(chunks[-1]) < batch_size and lengths[chunks[-1][0]] == n:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def span(count: int) -> int:
    """The root's size: the smallest power of two ≥ `count` (1 for none)."""
    return 1 << max(0, (count - 1).bit_length())


def blocks(a: int, b: int, count: int) -> list[Node]:
    """The largest aligned tree nodes that tile chunks [a, b) of `count`, left to right (a range that
    ends at the last chunk also owns the empty nodes after it, so its nodes are whole tree nodes)."""
    end = span(count) if b >= count else b
    out: list[Node] = []
    while a < end:
        size = a & -a if a else span(count)
        while a + size > end:
            size //= 2
        out.append((a, size))
        a += size
    return out


def add(x: Stats | None, y: Stats | None) -> Stats | None:
    """x + y key by key (IEEE addition is commutative, so only the tree fixes the bits)."""
    if x is None or y is None:
        return x if y is None else y
    return {k: x[k] + y[k] if k in x and k in y else x.get(k, y.get(k)) for k in {*x, *y}}


def add_into(x: Stats | None, y: Stats | None) -> Stats | None:
    """`add(x, y)` written into x's tensors (the same bits: one IEEE addition each), so a join holds two
    sets of sums, not three. Only for sums nothing else holds: the partial sums of `node_sums`."""
    if x is None or y is None:
        return x if y is None else y
    for k, t in y.items():
        if k in x:
            x[k] += t
        else:
            x[k] = t
    return x


def node_sums(node: Node, count: int, chunk_stats: Iterator[Stats]) -> Stats | None:
    """The sum of one tree node from its chunks' stats, given in chunk order (a binary counter: at most
    log₂(size) partial sums held at once, each pair joined exactly where the tree joins it, in place: the
    chunk stats are made for this sum alone)."""
    lo, size = node
    stack: list[tuple[int, Stats]] = []  # (size, sum) of completed aligned sub-nodes, left to right
    for _ in range(max(0, min(lo + size, count) - lo)):
        s = next(chunk_stats)
        width = 1
        while stack and stack[-1][0] == width:
            s = add_into(stack.pop()[1], s)  # type: ignore[assignment]
            width *= 2
        stack.append((width, s))
    total: Stats | None = None
    while stack:  # a node cut short by the last chunk: its right parts are empty, joined from the right
        total = add_into(stack.pop()[1], total)
    return total


def range_sums(a: int, b: int, count: int, stats: Callable[[int], Stats]) -> dict[Node, Stats]:
    """Chunk range [a, b)'s tree nodes, each summed (`stats(chunk)` computes one chunk's, in new tensors:
    they are summed in place)."""
    out: dict[Node, Stats] = {}
    for node in blocks(a, b, count):
        lo, size = node
        total = node_sums(node, count, (stats(c) for c in range(lo, min(lo + size, count))))
        if total is not None:
            out[node] = total
    return out


def join(nodes: dict[Node, Stats], count: int) -> Stats | None:
    """The root from nodes that tile the chunks (from any split into ranges)."""

    def node(lo: int, size: int) -> Stats | None:
        if lo >= count:
            return None
        if (lo, size) in nodes:
            return nodes[(lo, size)]
        if size == 1:
            raise ValueError(f"chunk {lo}'s statistics are missing")
        return add(node(lo, size // 2), node(lo + size // 2, size // 2))

    return node(0, span(count))


def ranges(chunks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted chunk indices as maximal [a, b) runs."""
    out: list[tuple[int, int]] = []
    for c in sorted(chunks):
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out
