"""Seconds a collective takes on a cluster: NCCL's rings (and its two-node tree) in alpha-beta terms.

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
  * both > 1, all_reduce, reduce_scatter and all_gather: one flat ring through all ``n`` ranks, as
    NCCL runs large messages (src/graph/tuning.cc at v2.8.3, the version of Megatron-LM's SC'21
    container, and since: ring bus bandwidth = channels x per-channel speed, algorithm bandwidth
    = bus bandwidth x n / nsteps). Every rank pushes ``bus = bus_factor(kind, n) * S`` over
    NVLink; the ring enters and leaves each node once per channel, so a node's ``g`` GPUs send
    ``bus`` over the network between them, each through its own NIC::

        t_ring = (steps - inter_steps) * nvlink_latency + inter_steps * net_latency
                 + max(bus / nvlink_bandwidth, bus / (g * nic_bandwidth))

    The hops add up (a ring's steps follow one another: NCCL's latency model charges
    ``(nsteps - nInterSteps) intraLat + nInterSteps interLat``, ``nInterSteps`` = 2(k-1) for
    all-reduce, k-1 for the others); the two levels' transfers are pipelined chunk by chunk, so
    the slower one paces. On DGX A100 nodes this is NVIDIA's measured all-reduce bus bandwidth,
    192 GB/s = 8 NICs x 24 GB/s, at any node count (nccl#812; nccl-tests#196/#160: "on 3 nodes
    or more rings are used for large sizes and busbw reflects the total NIC bandwidth"). The
    two-level scheme this file priced before (intra reduce-scatter, inter all-reduce of S/g,
    intra all-gather) moves only 2(k-1)/k S per node where the ring moves 2(n-1)/n S: it gave
    248 GB/s on 4 DGX A100 nodes and 360 on 2, above what NCCL reaches, and priced a 32-way DP
    all-reduce over 4 nodes 23% short.
  * all_reduce on exactly two nodes: NCCL takes its double binary tree there when it is faster
    (nccl#812: "Tree performs better on two nodes as there are fewer inter-node data
    transmissions"): each node sends S over the network, not 2(n-1)/n S, and the chain through
    the node reduces S up and broadcasts S down over NVLink; the cheaper of ring and tree::

        t_tree = 2 ((g-1) nvlink_latency + net_latency) + max(2 S / nvlink_bandwidth, S / (g * nic_bandwidth))

    (NCCL's tree latency ``2 ((nRanks/nNodes - 1) intraLat + log2(nNodes) interLat)``.)
  * broadcast = inter broadcast(S/g) + intra all_gather(S) (scatter + all-gather), the levels
    pipelined (the slower paces); all_to_all: intra share S(g-1)/n over NVLink, inter share
    S(n-g)/n over the NICs, posted at once (the slower level paces, each with one hop).
  * send_recv: one message between neighbouring ranks; across nodes when the group spans nodes
    (the slowest hop, which paces a pipeline).
  * a ring across sites (``group.num_sites = s > 1``, a flat data-parallel ring on a cluster of
    several sites, or the 2-rank all-reduce between sites of hierarchical DP): the flat ring
    again, its hops now of three kinds, added (``site_steps`` long-haul hops, ``per_hop (k-s)``
    between nodes of a site, the rest inside nodes; ``per_hop`` 2 for all-reduce, 1 for the
    others), and a third transfer beside NVLink's and the NICs': the ring enters and leaves each
    site once, so a site's link carries ``bus`` for every group of the axis with ranks in it, all
    at once (``cluster.ranks_per_site / group.ranks_per_site`` of them), over the whole site's
    ``inter_site_gbps``::

        t_site = ... + site_steps site_latency
                 + max(bus / nvlink_bandwidth, bus / (g * nic_bandwidth), groups_per_site * bus / site_bandwidth)

    ``site_steps`` (`long_haul_steps`) is the long-haul hops on the ring's longest chain of
    dependent messages: a ring collective is ``ring_steps`` steps (2(n-1) for all-reduce: n-1
    reduce-scatter, n-1 all-gather), and a rank's step t+1 sends what it received at step t, so
    a chunk's path runs ``ring_steps`` consecutive hops around the ring and waits at each. The
    ring visits a site's ``m = n / s`` ranks in a row, so every m-th hop is long-haul and the
    worst chain crosses ``ceil(ring_steps / m)`` times: 2 for the 2-rank all-reduce between two
    sites, 3 for a 4-rank all-reduce over two sites of 2, 2s for an all-reduce over sites of 3
    ranks or more. Not every step waits a long-haul latency (a step's messages inside a site
    are not on the chain that crosses), nor only 2(s-1) of them as NCCL's per-node count would
    give: the chain a ring's data must follow is what waits. (Gloo's and NCCL's rings are flat
    rings in ring order: neither splits a group by site, `runtime/hierarchical_reduce.py` does.)

    The long-haul figures are the cluster's as given (no efficiency applied, no measured fit).
    Only rings cross sites (data parallelism): any other collective across sites is refused.
A measured ``AlphaBetaFit`` for (kind, level) stands in for that level's analytic line: its alpha
for the level's hops, its beta for the level's bandwidth (a network fit is measured one rank per
node, so it prices the ``bus / g`` bytes each NIC carries).
Invariants: a group of one rank or zero bytes costs 0; per-GPU bandwidths assume every group of the
mesh axis communicates at once, so no GPU borrows another's NIC (PXN and NVLink SHARP not modelled:
conservative).
"""
from __future__ import annotations

import math

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
            or (crosses_nodes and cluster.num_nodes == 1) or group.num_sites > cluster.num_sites):
        raise ValueError(f"group of {group.size} ranks ({group.ranks_per_node} per node on {group.num_nodes} nodes, "
                         f"{group.num_sites} site(s)) does not fit cluster {cluster.name}: {cluster.num_nodes} nodes "
                         f"x {cluster.gpus_per_node} GPUs on {cluster.num_sites} site(s)")


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
        latency, transfer = self.split(level, kind, bus_bytes, steps)
        return latency + transfer

    def split(self, level: str, kind: str, bus_bytes: float, steps: int) -> tuple[float, float]:
        """(latency, transfer) seconds of ``bus_bytes`` over ``steps`` hops of ``level``: a fit's
        alpha and bytes over its beta, else the link's hop latency and effective bandwidth."""
        fit = self.cluster.link_fit(kind, level, bus_bytes)
        if fit is not None:
            return fit.alpha_s, bus_bytes / fit.beta_Bps
        self.analytic = True
        link = self.cluster.links.intra_node if level == "intra_node" else self.cluster.links.inter_node
        return steps * link.latency_s, bus_bytes / link.effective_bandwidth_Bps

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
    if group.crosses_sites:
        return phases.total(_site_ring(phases, kind, group, nbytes))
    if kind == "send_recv":
        return phases.total(phases.time("intra_node" if k == 1 else "inter_node", kind, 2, nbytes))
    if k == 1 or g == 1:
        return phases.total(phases.time("intra_node" if k == 1 else "inter_node", kind, n, nbytes))
    if kind in ("all_reduce", "reduce_scatter", "all_gather"):
        seconds = _flat_ring(phases, kind, n, g, k, nbytes)
        if kind == "all_reduce" and k == 2:
            seconds = min(seconds, _two_node_tree(phases, g, nbytes))
        return phases.total(seconds)
    if kind == "broadcast":
        intra = phases.time("intra_node", "all_gather", g, nbytes)
        inter = phases.time("inter_node", "broadcast", k, nbytes / g)
    else:
        intra = phases.bus_time("intra_node", kind, nbytes * (g - 1) / n, 1)
        inter = phases.bus_time("inter_node", kind, nbytes * (n - g) / n, 1)
    seconds = max(intra, inter)  # the levels are pipelined: the slower one paces the collective
    return phases.total(seconds)


def _flat_ring(phases: _Phases, kind: str, n: int, g: int, k: int, nbytes: float) -> float:
    """One ring through all n ranks on k nodes (module docstring): hops add, transfers pipeline."""
    bus = bus_factor(kind, n) * nbytes
    inter_steps = (2 if kind == "all_reduce" else 1) * (k - 1)
    intra_latency, intra = phases.split("intra_node", kind, bus, ring_steps(kind, n) - inter_steps)
    inter_latency, inter = phases.split("inter_node", kind, bus / g, inter_steps)
    return intra_latency + inter_latency + max(intra, inter)


def _site_ring(phases: _Phases, kind: str, group: GroupShape, nbytes: float) -> float:
    """One ring through all ranks of a group that spans sites (module docstring)."""
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"{kind} across sites is not priced: only data parallelism's rings cross sites")
    cluster, n, g, k, s = phases.cluster, group.size, group.ranks_per_node, group.num_nodes, group.num_sites
    bus = bus_factor(kind, n) * nbytes
    per_hop = 2 if kind == "all_reduce" else 1
    site_steps, node_steps = long_haul_steps(kind, group), per_hop * (k - s)
    intra_steps = max(0, ring_steps(kind, n) - site_steps - node_steps)
    intra_latency, intra = phases.split("intra_node", kind, bus, intra_steps) if g > 1 else (0.0, 0.0)
    inter_latency, inter = phases.split("inter_node", kind, bus / g, node_steps)
    phases.analytic = True
    groups_per_site = cluster.ranks_per_site // group.ranks_per_site
    site = groups_per_site * bus / cluster.sites.bandwidth_Bps
    return intra_latency + inter_latency + site_steps * cluster.sites.latency_s + max(intra, inter, site)


def long_haul_steps(kind: str, group: GroupShape) -> int:
    """Long-haul hops on the longest chain of dependent messages of a ring ``kind`` over ``group``,
    its ranks in a row site by site (module docstring); 0 for a group inside one site."""
    if not group.crosses_sites:
        return 0
    return math.ceil(ring_steps(kind, group.size) / (group.size // group.num_sites))


def long_haul_latency_s(cluster: ClusterSpec, kind: str, group: GroupShape) -> float:
    """The long-haul latency one ring ``kind`` over ``group`` waits (``long_haul_steps`` one-way delays)."""
    return long_haul_steps(kind, group) * cluster.sites.latency_s if group.crosses_sites else 0.0


def _two_node_tree(phases: _Phases, g: int, nbytes: float) -> float:
    """NCCL's tree all-reduce over two nodes of g ranks (module docstring)."""
    chain_latency, chain = phases.split("intra_node", "all_reduce", 2 * nbytes, 2 * (g - 1))
    net_latency, net = phases.split("inter_node", "all_reduce", nbytes / g, 2)
    return chain_latency + net_latency + max(chain, net)
