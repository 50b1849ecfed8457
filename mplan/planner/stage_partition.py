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
A search runs it for thousands of configs, so the bisection skips the greedy runs whose outcome it
already knows, exactly: below total / k no k chunks hold the units, and from the bottleneck a
greedy run reached up to the limit it ran at, it makes the same cuts again; the units' memory on
each chunk is asked for once per partition.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import reduce
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
_ORDER_OF_SUMS = 1e-9
"""Relative margin of `partition`'s bound total / k: the chunks' running sums and `sum(times)`
add the same times in other orders, which moves them by far less (n * 2**-53, plus `_ROUNDING`)."""


def _greedy(times: Sequence[float], k: int, limit: float, memory: UnitMemory | None,
            known: list[list[float | None]] | None, cap: float) -> list[tuple[int, int]] | None:
    """The cuts of the greedy fill at `limit`, or None; `known[chunk][unit]` caches `memory`."""
    limit *= 1 + _ROUNDING
    bounds: list[tuple[int, int]] = []
    chunk = start = 0
    t = mem = 0.0
    n = len(times)
    row = None if known is None else known[0]
    for u in range(n):
        time_u = times[u]
        if row is None:
            add_mem = 0.0
        else:
            add_mem = row[u]
            if add_mem is None:
                add_mem = row[u] = memory(u, chunk)  # type: ignore[misc]
        if add_mem > cap or time_u > limit:
            return None
        # past unit n - k + chunk the units left must fill the chunks left: a cut at every unit
        if u > start and (u > n - k + chunk or t + time_u > limit or mem + add_mem > cap):
            bounds.append((start, u))
            chunk += 1
            if chunk >= k:
                return None
            start, t, mem = u, 0.0, 0.0
            if row is not None:
                row = known[chunk]  # type: ignore[index]
                add_mem = row[u]
                if add_mem is None:
                    add_mem = row[u] = memory(u, chunk)  # type: ignore[misc]
                if add_mem > cap:
                    return None
        t += time_u
        mem += add_mem
    bounds.append((start, n))
    return bounds if chunk + 1 == k else None


def partition(times: Sequence[float], k: int, *, memory: UnitMemory | None = None,
              cap: float = float("inf"), rel_tol: float = 1e-4) -> Partition | None:
    """The min-bottleneck contiguous split of `times` into exactly k chunks; None if infeasible."""
    if k < 1 or k > len(times):
        return None
    known: list[list[float | None]] | None = None if memory is None else [[None] * len(times) for _ in range(k)]
    lo, hi = max(times), sum(times)
    total = hi
    best = _greedy(times, k, hi, memory, known, cap)
    if best is None:
        return None
    reached = _running_bottleneck(times, best)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if mid * k * (1 + _ORDER_OF_SUMS) < total:
            found = None  # k chunks of at most mid cannot hold every unit
        elif mid * (1 + _ROUNDING) >= reached:
            found = best  # no chunk's running sum lies between: the greedy would cut as it did
        else:
            found = _greedy(times, k, mid, memory, known, cap)
        if found is None:
            lo = mid
        else:
            if found is not best:
                best, reached = found, _running_bottleneck(times, found)
            hi = mid
    return _make(times, best)


def _running_bottleneck(times: Sequence[float], bounds: Sequence[tuple[int, int]]) -> float:
    """The largest chunk time as `_greedy` adds it up (left to right from 0.0, whatever `sum` does)."""
    return max(reduce(operator.add, times[a:b], 0.0) for a, b in bounds)


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
