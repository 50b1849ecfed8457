"""Measure collectives on the links of the running torch.distributed world, into a ``LinkProfile``.

Role: produce the alpha-beta fits ``collective_cost`` prefers to its analytic link model. Run by
``mplan profile`` under torchrun (every rank calls ``profile_links`` together).
Input: ``profile_links(group_shapes, sizes)``: the group shapes to time (default: every shape the
world can make: all ranks of one node, one rank per node, and the whole world when it is both) and
the message sizes in bytes (nccl-tests' "size" of each collective, see ``collectives.py``).
Output: ``LinkProfile``: every timing (the slowest rank's median) and one ``AlphaBetaFit`` per
(collective, level) for the levels ``intra_node`` and ``inter_node``, fitted on bus bytes
(``alpha_beta.py``). Hierarchical shapes are timed and kept as data to check the composed model.
Method: the world is laid out node-major (rank = node * ranks_per_node + local rank, as torchrun
numbers ranks). A shape ``(size, g)`` partitions it into groups of ``g`` consecutive local ranks on
``size / g`` consecutive nodes; all groups run at once, as the mesh axes of a plan do. Each
collective gets warm-up calls, then ``iters`` timed samples; a sample is a burst of back-to-back
calls (``burst_calls``: 64 for small messages, 4 from 64 MiB) between two device
synchronisations, divided by its length, as nccl-tests times them: training queues collectives on a
stream, so the host's synchronisation (tens of microseconds on NCCL) is not part of a call. Every
rank's median is reduced with MAX over the world once at the end.
``send_recv`` pairs members 2j -> 2j+1 of each group. Backends lacking a collective are skipped.
Invariants: collective over all ranks; every rank returns the same profile; torch is imported lazily.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from mplan.cost_models.alpha_beta import LEVELS, AlphaBetaFit, fit_segments
from mplan.cost_models.collective_cost import GroupShape
from mplan.cost_models.collectives import bus_factor
from mplan.cost_models.profile import CollectiveTiming, LinkProfile

MEASURED_COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DEFAULT_SIZES: tuple[int, ...] = tuple(1 << p for p in range(10, 29))
"""1 KiB to 256 MiB in steps of 2x: latency-bound to bandwidth-bound, dense enough for each of
the fit's size segments to hold several points (steps of 4x left five sizes above 1 MiB)."""
BURST_BYTES = 256 << 20
"""A timed burst moves at least this many bytes, in MIN_BURST to MAX_BURST calls."""
MIN_BURST, MAX_BURST = 4, 64
"""At least 4 calls, so that no size pays a whole synchronisation (~30 us on NCCL) on one call."""


def burst_calls(nbytes: int) -> int:
    """Back-to-back calls per timed sample: the same on every rank (it depends on the size alone)."""
    return max(MIN_BURST, min(MAX_BURST, -(-BURST_BYTES // max(nbytes, 1))))


def default_group_shapes(world_size: int, ranks_per_node: int) -> list[GroupShape]:
    """Every kind of group the world can make: one node, one rank per node, and both."""
    nodes = world_size // ranks_per_node
    shapes = []
    if ranks_per_node > 1:
        shapes.append(GroupShape(size=ranks_per_node, ranks_per_node=ranks_per_node))
    if nodes > 1:
        shapes.append(GroupShape(size=nodes, ranks_per_node=1))
    if nodes > 1 and ranks_per_node > 1:
        shapes.append(GroupShape(size=world_size, ranks_per_node=ranks_per_node))
    return shapes


def group_ranks(shape: GroupShape, world_size: int, ranks_per_node: int) -> list[list[int]]:
    """The concrete rank lists of ``shape``, partitioning a node-major world."""
    nodes = world_size // ranks_per_node
    g, k = shape.ranks_per_node, shape.num_nodes
    if ranks_per_node % g or nodes % k:
        raise ValueError(f"group shape {shape} does not tile a world of {nodes} nodes x {ranks_per_node} ranks")
    return [[node * ranks_per_node + local for node in range(node0, node0 + k) for local in range(local0, local0 + g)]
            for node0 in range(0, nodes, k) for local0 in range(0, ranks_per_node, g)]


def _run_collective(dist: Any, torch: Any, kind: str, buffers: dict[str, Any], group: Any, members: list[int],
                    me: int) -> None:
    if kind == "all_reduce":
        dist.all_reduce(buffers["full"], group=group)
    elif kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(buffers["full"], buffers["shard"], group=group)
    elif kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(buffers["shard"], buffers["full"], group=group)
    elif kind == "all_to_all":
        dist.all_to_all_single(buffers["out"], buffers["full"], group=group)
    else:  # send_recv: member 2j sends to member 2j+1
        index = members.index(me)
        if index % 2 == 0 and index + 1 < len(members):
            dist.send(buffers["full"], dst=members[index + 1])
        elif index % 2 == 1:
            dist.recv(buffers["full"], src=members[index - 1])


def profile_links(group_shapes: Sequence[GroupShape] | None = None, sizes: Sequence[int] | None = None, *,
                  collectives: Sequence[str] = MEASURED_COLLECTIVES, iters: int = 5, warmup: int = 2) -> LinkProfile:
    """Time ``collectives`` over ``group_shapes`` and ``sizes`` on the current world; fit alpha-beta per level."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("profile_links needs an initialised torch.distributed process group (run under torchrun)")
    world, me = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    shapes = list(group_shapes) if group_shapes is not None else default_group_shapes(world, per_node)
    sizes = list(sizes or DEFAULT_SIZES)
    keys: list[tuple[str, GroupShape, int]] = []
    medians: list[float] = []
    for shape in shapes:
        lists = group_ranks(shape, world, per_node)
        groups = [dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD for ranks in lists]
        members = next(ranks for ranks in lists if me in ranks)
        group = groups[lists.index(members)]
        for kind in collectives:
            for nbytes in sizes:
                elements = max(nbytes // 4 // shape.size, 1) * shape.size  # fp32, divisible by the group
                fp32 = torch.float32
                buffers = {"full": torch.ones(elements, device=device, dtype=fp32),
                           "out": torch.empty(elements, device=device, dtype=fp32),
                           "shard": torch.ones(elements // shape.size, device=device, dtype=fp32)}
                try:
                    seconds = _time(dist, torch, kind, buffers, group, members, me, iters, warmup, device)
                except (RuntimeError, NotImplementedError, ValueError):
                    seconds = float("nan")  # the backend lacks it; every rank agrees since all raise alike
                keys.append((kind, shape, elements * 4))
                medians.append(seconds)
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    timings = tuple(CollectiveTiming(collective=kind, level=shape.level,
                                     group_size=2 if kind == "send_recv" else shape.size,
                                     ranks_per_node=min(shape.ranks_per_node, 2) if kind == "send_recv"
                                     else shape.ranks_per_node, nbytes=nbytes, seconds=float(t))
                    for (kind, shape, nbytes), t in zip(keys, slowest.tolist()) if t == t and t > 0)
    return LinkProfile(backend=backend, world_size=world, ranks_per_node=per_node,
                       measured_on=datetime.date.today().isoformat(), timings=timings, fits=fit_levels(timings))


def _time(dist: Any, torch: Any, kind: str, buffers: dict[str, Any], group: Any, members: list[int], me: int,
          iters: int, warmup: int, device: Any) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        _run_collective(dist, torch, kind, buffers, group, members, me)
    sync()
    dist.barrier(group=group)
    calls = burst_calls(buffers["full"].numel() * buffers["full"].element_size())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            _run_collective(dist, torch, kind, buffers, group, members, me)
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def fit_levels(timings: Sequence[CollectiveTiming]) -> tuple[AlphaBetaFit, ...]:
    """Alpha-beta fits per (collective, level) with at least two sizes, on bus bytes: one per
    size segment (``fit_segments``)."""
    fits = []
    for kind in dict.fromkeys(t.collective for t in timings):
        for level in LEVELS:
            rows = [t for t in timings if t.collective == kind and t.level == level]
            if len({t.nbytes for t in rows}) < 2:
                continue
            bus = [bus_factor(kind, t.group_size) * t.nbytes for t in rows]
            seconds = [t.seconds for t in rows]
            segments = fit_segments(bus, seconds)
            bounds = [start for start, *_ in segments[1:]] + [float("inf")]
            for (start, alpha, beta, error), end in zip(segments, bounds):
                fits.append(AlphaBetaFit(collective=kind, level=level, alpha_s=alpha, beta_Bps=beta,
                                         group_size=max(t.group_size for t in rows),
                                         num_points=sum(start <= x < end for x in bus), max_rel_error=error,
                                         min_bus_bytes=start))
    return tuple(fits)
