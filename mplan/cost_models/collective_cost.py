"""Seconds a collective takes on a cluster: ring alpha-beta model, hierarchical across nodes.

Role: ``collective_time(cluster, kind, nbytes, group)`` for all_reduce, all_gather, reduce_scatter,
all_to_all, send_recv and broadcast; the planner calls it for every collective a sharding implies.
Input: a ``ClusterSpec``, the collective, ``nbytes`` (nccl-tests' "size", see ``collectives.py``)
and a ``GroupShape`` (how many ranks, how many of them per node).
Output: seconds for one call, all ranks of the group (and every other group of the same mesh axis)
running concurrently.

Model, per link level (one node's NVLink/NVSwitch, or the per-GPU NIC share of the network)::

    t_level(kind, n, S) = steps(kind, n) * hop_latency + bus_factor(kind, n) * S / (bandwidth * efficiency)

(ring algorithm; bus factors all-reduce 2(n-1)/n, all-gather/reduce-scatter/all-to-all (n-1)/n;
``efficiency`` is the NCCL-achievable fraction of line rate, per link, sourced in presets.py) plus
one per-call launch latency ``NCCL_BASE_LATENCY_S``. A measured ``AlphaBetaFit`` for (kind, level)
in the cluster's profile replaces ``t_level`` (and the base latency, which its alpha includes).

A group of ``n`` ranks with ``g`` per node on ``k = n / g`` nodes:
  * ``k == 1``: one ring inside the node.  ``g == 1``: one ring over the network.
  * both > 1, hierarchical (the two-level scheme NCCL's rings and Megatron's DP both amount to):
      all_reduce     = intra reduce_scatter(S) + inter all_reduce(S/g) + intra all_gather(S)
      reduce_scatter = intra reduce_scatter(S) + inter reduce_scatter(S/g)
      all_gather     = inter all_gather(S/g)   + intra all_gather(S)
      broadcast      = inter broadcast(S/g)    + intra all_gather(S)   (scatter + all-gather)
      all_to_all     = intra share S(g-1)/n over NVLink, inter share S(n-g)/n over the NICs
    The inter-node phases move 1/g of the data per GPU over that GPU's own NIC, so all g NICs of a
    node work at once. The intra- and inter-node phases are pipelined chunk by chunk (as NCCL's
    rings are), so the collective takes as long as its slower level: ``max(sum of intra phases,
    inter phase)``. Check against measurement: with many DGX A100 nodes this gives an all-reduce
    bus bandwidth of 8 NICs x 24 GB/s = 192 GB/s, what NVIDIA measures (nccl#812); summing the
    phases instead would predict ~125 GB/s on 4 nodes, far below it.
  * send_recv: one message between neighbouring ranks; across nodes when the group spans nodes
    (the slowest hop, which paces a pipeline).
Invariants: a group of one rank or zero bytes costs 0; per-GPU bandwidths assume every group of the
mesh axis communicates at once, so no GPU borrows another's NIC (PXN and NVLink SHARP not modelled:
conservative).
"""
from __future__ import annotations


from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collectives import bus_factor, check_collective, ring_steps
from mplan.ir.mesh import GroupShape

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Gradient bucket of the DP reductions, bytes: 25 MiB, torch DDP's default `bucket_cap_mb`, large
enough to amortize collective latency. The runtime's buckets (runtime/data_parallel.py) take this
size, so the planner prices the collectives the runtime issues."""

NCCL_BASE_LATENCY_S = 10.0e-6
"""Per-call latency, seconds: NCCL's tuning model baseLat for Ring/LL128 (src/graph/tuning.cc, 01afd20)."""


def check_group_fits(cluster: ClusterSpec, group: GroupShape) -> None:
    """Refuse a group the cluster cannot hold. A group spread unevenly over nodes is priced on more,
    smaller nodes than it spans (`GroupShape.from_mesh_axis`), so only its ranks, its ranks per
    node and whether it crosses nodes at all are checked against the cluster, not its node count."""
    crosses_nodes = group.num_nodes > 1
    if (group.ranks_per_node > cluster.gpus_per_node or group.size > cluster.world_size
            or (crosses_nodes and cluster.num_nodes == 1)):
        raise ValueError(f"group of {group.size} ranks ({group.ranks_per_node} per node on {group.num_nodes} nodes) "
                         f"does not fit cluster {cluster.name}: {cluster.num_nodes} nodes x "
                         f"{cluster.gpus_per_node} GPUs")


class _Phases:
    """Accumulates level phases; adds the base latency once unless every phase came from a fit."""

    __slots__ = ("cluster", "kind", "analytic")

    def __init__(self, cluster: ClusterSpec, kind: str) -> None:
        self.cluster, self.kind, self.analytic = cluster, kind, False

    def time(self, level: str, kind: str, n: int, nbytes: float) -> float:
        return self.bus_time(level, kind, bus_factor(kind, n) * nbytes, ring_steps(kind, n))

    def bus_time(self, level: str, kind: str, bus_bytes: float, steps: int) -> float:
        if steps == 0:
            return 0.0
        fit = self.cluster.link_fit(kind, level, bus_bytes)
        if fit is not None:
            return fit.time(bus_bytes)
        self.analytic = True
        link = self.cluster.links.intra_node if level == "intra_node" else self.cluster.links.inter_node
        return steps * link.latency_s + bus_bytes / link.effective_bandwidth_Bps

    def total(self, seconds: float) -> float:
        return seconds + (NCCL_BASE_LATENCY_S if self.analytic else 0.0)


def collective_time(cluster: ClusterSpec, kind: str, nbytes: float, group: GroupShape) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` over ``group`` on ``cluster``."""
    check_collective(kind)
    check_group_fits(cluster, group)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    n, g, k = group.size, group.ranks_per_node, group.num_nodes
    if n == 1 or nbytes == 0:
        return 0.0
    phases = _Phases(cluster, kind)
    if kind == "send_recv":
        return phases.total(phases.time("intra_node" if k == 1 else "inter_node", kind, 2, nbytes))
    if k == 1 or g == 1:
        return phases.total(phases.time("intra_node" if k == 1 else "inter_node", kind, n, nbytes))
    if kind == "all_reduce":
        intra = phases.time("intra_node", "reduce_scatter", g, nbytes) + phases.time("intra_node", "all_gather", g, nbytes)
        inter = phases.time("inter_node", "all_reduce", k, nbytes / g)
    elif kind == "reduce_scatter":
        intra = phases.time("intra_node", "reduce_scatter", g, nbytes)
        inter = phases.time("inter_node", "reduce_scatter", k, nbytes / g)
    elif kind == "all_gather":
        intra = phases.time("intra_node", "all_gather", g, nbytes)
        inter = phases.time("inter_node", "all_gather", k, nbytes / g)
    elif kind == "broadcast":
        intra = phases.time("intra_node", "all_gather", g, nbytes)
        inter = phases.time("inter_node", "broadcast", k, nbytes / g)
    else:
        intra = phases.bus_time("intra_node", kind, nbytes * (g - 1) / n, 1)
        inter = phases.bus_time("inter_node", kind, nbytes * (n - g) / n, 1)
    seconds = max(intra, inter)  # the levels are pipelined: the slower one paces the collective
    return phases.total(seconds)
