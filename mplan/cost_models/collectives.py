"""What each collective moves: names, bus factors and ring step counts.

Role: the vocabulary shared by the collective cost model, the link profiler and the alpha-beta
fits. ``nbytes`` of a collective is always the size nccl-tests calls "size": the all-reduce buffer,
the all-gather *output*, the reduce-scatter *input*, the all-to-all per-rank send buffer, the
broadcast buffer, the point-to-point message.
Output: ``bus_factor(kind, n)``: bus bytes = factor * nbytes, the bytes each rank must push
through its link in a bandwidth-optimal ring (nccl-tests' PERFORMANCE.md convention:
all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n, broadcast and
send/recv 1). ``ring_steps(kind, n)``: sequential hops, each paying one link latency.
Invariants: a group of one rank moves nothing (factor 0, steps 0).
"""
from __future__ import annotations

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def check_collective(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")


def bus_factor(kind: str, n: int) -> float:
    """Bus bytes per byte of ``nbytes`` for ``kind`` over ``n`` ranks."""
    check_collective(kind)
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: str, n: int) -> int:
    """Sequential latency-bearing steps of ``kind`` over ``n`` ranks (ring algorithm).

    All-reduce is reduce-scatter then all-gather (2(n-1)); broadcast is pipelined along the ring and
    all-to-all and send/recv post all their transfers at once, so each pays one hop (as NCCL's
    tuning model charges broadcast a single hop latency, src/graph/tuning.cc).
    """
    check_collective(kind)
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1
    return 1
