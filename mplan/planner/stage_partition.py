"""Pipeline stage cuts: split the model's units (embeddings, blocks, head) into contiguous chunks.

Problem: units u_1..u_U with per-micro-batch times t_u must go to k = pp * vpp contiguous chunks
(chunk c runs on pipeline rank c mod pp). In 1F1B and its interleaved form the steady state
runs at the pace of the slowest chunk, so we minimize the bottleneck max_c sum_{u in c} t_u,
subject to each chunk's memory (its parameters, plus its activations times the micro-batches
that chunk's rank holds in flight) staying under the device capacity. Uneven chunks come out
naturally: the first and last ranks carry the embedding and the LM head, so they get fewer blocks.

Method: the bottleneck is found by bisection on T with a greedy feasibility check (fill each
chunk while it stays under T and its memory cap, cutting when the units left equal the chunks
left). For contiguous min-max partitioning the greedy check is exact, so bisection converges to
the optimum within the tolerance; `partition_exhaustive` (used in tests) enumerates every cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Sequence

UnitMemory = Callable[[int, int], float]  # (unit index, chunk index) -> bytes on that chunk's rank


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    bounds: tuple[tuple[int, int], ...]  # [start, end) unit ranges, one per chunk
    bottleneck_s: float
    chunk_times: tuple[float, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)


_ROUNDING = 1e-12
"""Relative slack on the time limit: a chunk's running sum may round above `sum(times)` (which
Python 3.12 computes compensated), and the whole model must still fit one chunk of that limit."""


def _greedy(times: Sequence[float], k: int, limit: float, memory: UnitMemory | None,
            cap: float) -> list[tuple[int, int]] | None:
    limit *= 1 + _ROUNDING
    bounds: list[tuple[int, int]] = []
    start, t, mem = 0, 0.0, 0.0
    n = len(times)
    for u in range(n):
        chunk = len(bounds)
        add_mem = memory(u, chunk) if memory else 0.0
        if add_mem > cap or times[u] > limit:
            return None
        must_cut = u > start and n - u < k - chunk  # the units left must fill the chunks left
        if u > start and (must_cut or t + times[u] > limit or mem + add_mem > cap):
            bounds.append((start, u))
            if len(bounds) >= k:
                return None
            start, t, mem = u, 0.0, 0.0
            add_mem = memory(u, len(bounds)) if memory else 0.0
            if add_mem > cap:
                return None
        t += times[u]
        mem += add_mem
    bounds.append((start, n))
    return bounds if len(bounds) == k else None


def partition(times: Sequence[float], k: int, *, memory: UnitMemory | None = None,
              cap: float = float("inf"), rel_tol: float = 1e-4) -> Partition | None:
    """The min-bottleneck contiguous split of `times` into exactly k chunks; None if infeasible."""
    if k < 1 or k > len(times):
        return None
    lo, hi = max(times), sum(times)
    best = _greedy(times, k, hi, memory, cap)
    if best is None:
        return None
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        found = _greedy(times, k, mid, memory, cap)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    return _make(times, best)


def _make(times: Sequence[float], bounds: Sequence[tuple[int, int]]) -> Partition:
    chunk_times = tuple(sum(times[a:b]) for a, b in bounds)
    return Partition(bounds=tuple(bounds), bottleneck_s=max(chunk_times), chunk_times=chunk_times)


def partition_exhaustive(times: Sequence[float], k: int, *, memory: UnitMemory | None = None,
                         cap: float = float("inf")) -> Partition | None:
    """Every placement of k-1 cuts; the reference the bisection is tested against."""
    n = len(times)
    best: Partition | None = None
    for cuts in combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        bounds = list(zip(edges[:-1], edges[1:]))
        if memory is not None and any(sum(memory(u, c) for u in range(a, b)) > cap
                                      for c, (a, b) in enumerate(bounds)):
            continue
        candidate = _make(times, bounds)
        if best is None or candidate.bottleneck_s < best.bottleneck_s:
            best = candidate
    return best


def even_partition(num_units: int, k: int) -> tuple[tuple[int, int], ...]:
    """Equal unit counts per chunk (the remainder to the first chunks): the hand-written baseline."""
    size, extra = divmod(num_units, k)
    bounds, start = [], 0
    for c in range(k):
        end = start + size + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)
