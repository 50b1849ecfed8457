"""Data parallelism's gradient and parameter collectives over the links they really use.

Role: price one data-parallel collective of a step (a gradient reduction, the parameters' gather
after a ZeRO step, the shards' exchange between sites) on a cluster that may span sites, and say
what it moved over each link: NVLink inside a node, the NICs between nodes of a site, and the
long-haul link between sites. `evaluate.py` prices the step with it; `explain` shows the traffic.
Input: the cluster, the plan's mesh, the axis (`dp`, or `expert_dp` for experts' replicas), the
collective and its bytes per rank (nccl-tests' size). Output: a `SyncPrice`.

Three layouts (`ir/mesh.py`):
- one site, or a flat plan whose groups stay in a site: one collective over the whole group, as
  before sites (`collective_time`), whatever the bucketing (its latency is microseconds);
- flat across sites (`sites=1` on a cluster of several): the ring crosses the long haul
  (`collective_cost`, "a ring across sites"), bucket by bucket (`DEFAULT_BUCKET_BYTES`, the
  runtime's buckets); each bucket's ring waits the long-haul latency of its chain of dependent
  messages (`long_haul_steps` one-way delays: 4 for an all-reduce over two sites of 3 ranks or
  more, 3 over two sites of 2);
- hierarchical (`sites = S > 1`), as `runtime/hierarchical_reduce.py` runs it, per bucket:

      1. reduce-scatter over the site's dp_local ranks      site links, the whole bucket
      2. all-reduce of the 1/dp_local shard over the sites   long haul, one rank a site
      3. all-gather over the site's ranks                   site links (zero=0 only: ZeRO keeps
                                                            the shard and gathers parameters)

  Bucket i's phase 2 runs while bucket i+1's phase 1 does (different links): the two-stage
  pipeline takes max(sum of phase 1, sum of phase 2) plus the shorter phase of one bucket; each
  bucket's phase 2 waits the long haul's latency (2 one-way delays for the 2-rank all-reduce
  between two sites), shared by the buckets in flight together (below). Phase 3 runs at the step. A reduce-scatter for
  ZeRO is phases 1 and 2; a gather of parameters is phase 3 alone (the sites hold the same
  shards after phase 2); zero 2/3's reduce-scatters run per unit inside a site, and the shards'
  all-reduce between sites (`cross_site_all_reduce`) once a step.
Buckets in flight: the runtime posts each bucket's cross-site collective as soon as the bucket
is ready (`data_parallel._start_all_reduce`, `hierarchical_reduce.SiteReductions`: phase 2 of
bucket i when bucket i+1's phase 1 is issued) and waits for none of them before posting the next;
how many of a group's rings then wait their long-haul latency at the same time is the backend's
(`collectives_in_flight`): NCCL runs a communicator's collectives in its stream's order, each
ring starting once the one before it finished on the rank (1: every bucket waits its own chain
latency, serially); gloo runs posted work on ProcessGroupGloo's worker threads, 2 by default,
each collective under its own tag (2 at once). The link's transfers follow one another either
way (`_in_flight`). `last_bucket_s` (what follows the last bucket under overlap with backward)
is one whole bucket, its latency included.
Traffic (`LinkUse`): bytes one rank pushes through NVLink and through its NIC (bus bytes,
`collectives.bus_factor`), and bytes one site sends over the long haul in each direction (all
its groups together), with each level's transfer seconds at its bandwidth.
Invariants: zero bytes or a group of one rank cost nothing; only data parallelism crosses sites.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES, collective_time, long_haul_latency_s
from mplan.cost_models.collectives import bus_factor
from mplan.ir.mesh import GroupShape, MeshShape

LINK_LEVELS = ("intra_node", "inter_node", "inter_site")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkUse:
    """What collectives moved over each link level, and the seconds of those transfers."""

    intra_node_bytes: float = 0.0  # bytes one rank pushes over NVLink
    inter_node_bytes: float = 0.0  # bytes one rank's NIC carries to other nodes
    inter_site_bytes: float = 0.0  # bytes one site sends over the long haul, per direction (all its ranks)
    intra_node_s: float = 0.0  # seconds of those transfers at each level's bandwidth (latency not included)
    inter_node_s: float = 0.0
    inter_site_s: float = 0.0

    # field by field rather than over `__slots__`: a search adds these a few hundred thousand times
    def __add__(self, other: LinkUse) -> LinkUse:
        return LinkUse(intra_node_bytes=self.intra_node_bytes + other.intra_node_bytes,
                       inter_node_bytes=self.inter_node_bytes + other.inter_node_bytes,
                       inter_site_bytes=self.inter_site_bytes + other.inter_site_bytes,
                       intra_node_s=self.intra_node_s + other.intra_node_s,
                       inter_node_s=self.inter_node_s + other.inter_node_s,
                       inter_site_s=self.inter_site_s + other.inter_site_s)

    def times(self, factor: float) -> LinkUse:
        return LinkUse(intra_node_bytes=self.intra_node_bytes * factor, inter_node_bytes=self.inter_node_bytes * factor,
                       inter_site_bytes=self.inter_site_bytes * factor, intra_node_s=self.intra_node_s * factor,
                       inter_node_s=self.inter_node_s * factor, inter_site_s=self.inter_site_s * factor)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncPrice:
    seconds: float  # the whole collective (all buckets, all phases)
    last_bucket_s: float  # what runs after the last bucket is ready: left exposed under any overlap
    links: LinkUse


NOTHING = SyncPrice(seconds=0.0, last_bucket_s=0.0, links=LinkUse())


NCCL_IN_FLIGHT = 1
"""Rings of one NCCL communicator waiting their latency at once: its collectives run in stream order."""
GLOO_IN_FLIGHT = 2
"""Rings of one gloo group waiting their latency at once: ProcessGroupGloo's default worker threads."""


def collectives_in_flight(cluster: ClusterSpec) -> int:
    """How many of one group's posted collectives wait their long-haul latency together (module
    docstring): gloo's on CPU ranks, NCCL's on GPUs."""
    return GLOO_IN_FLIGHT if cluster.device.name == "cpu" else NCCL_IN_FLIGHT


def link_use(cluster: ClusterSpec, kind: str, nbytes: float, group: GroupShape) -> LinkUse:
    """The traffic of one ring collective (module docstring), without its latency."""
    if group.size == 1 or nbytes == 0:
        return LinkUse()
    bus = bus_factor(kind, group.size) * nbytes
    g, k = group.ranks_per_node, group.num_nodes
    intra = bus if g > 1 else 0.0
    inter = bus / g if k > 1 else 0.0
    site = bus * (cluster.ranks_per_site // group.ranks_per_site) if group.crosses_sites else 0.0
    links = cluster.links
    return LinkUse(intra_node_bytes=intra, inter_node_bytes=inter, inter_site_bytes=site,
                   intra_node_s=intra / links.intra_node.effective_bandwidth_Bps,
                   inter_node_s=inter / links.inter_node.effective_bandwidth_Bps if inter else 0.0,
                   inter_site_s=site / cluster.sites.bandwidth_Bps if site else 0.0)


def dp_collective(cluster: ClusterSpec, kind: str, nbytes: float, mesh: MeshShape, axis: str = "dp") -> SyncPrice:
    """One data-parallel `kind` ("all_reduce", "reduce_scatter" or "all_gather") of `nbytes` per
    rank over `axis` ("dp" or "expert_dp") of `mesh` on `cluster` (module docstring)."""
    if nbytes == 0 or mesh.degree(axis) == 1:
        return NOTHING
    gpn = cluster.gpus_per_node
    if mesh.sites == 1:
        group = mesh.group_shape(axis, gpn, cluster.num_sites)
        links = link_use(cluster, kind, nbytes, group)
        if not group.crosses_sites:
            return SyncPrice(seconds=collective_time(cluster, kind, nbytes, group),
                             last_bucket_s=collective_time(cluster, kind, min(nbytes, DEFAULT_BUCKET_BYTES), group),
                             links=links)
        return _in_flight(cluster, kind, nbytes, DEFAULT_BUCKET_BYTES, group, links)
    site = mesh.site_group_shape(axis, gpn)
    if kind == "all_gather":  # phase 3 alone: every site holds the same shards
        return SyncPrice(seconds=collective_time(cluster, kind, nbytes, site),
                         last_bucket_s=collective_time(cluster, kind, min(nbytes, DEFAULT_BUCKET_BYTES), site),
                         links=link_use(cluster, kind, nbytes, site))
    phases = _phases_1_and_2(cluster, nbytes, mesh, site)
    if kind == "reduce_scatter":
        return phases
    gather = collective_time(cluster, "all_gather", nbytes, site)
    return SyncPrice(seconds=phases.seconds + gather, last_bucket_s=phases.last_bucket_s + gather,
                     links=phases.links + link_use(cluster, "all_gather", nbytes, site))


def cross_site_all_reduce(cluster: ClusterSpec, shard_bytes: float, mesh: MeshShape) -> SyncPrice:
    """Phase 2 alone, bucket after bucket: the all-reduce between sites of a rank's `shard_bytes`
    (zero 2/3 reduce-scatter inside the site in every micro-batch's backward; the shards cross
    once a step). Nothing without sites."""
    if mesh.sites == 1 or shard_bytes == 0:
        return NOTHING
    cross = mesh.cross_site_group_shape()
    return _in_flight(cluster, "all_reduce", shard_bytes, DEFAULT_BUCKET_BYTES / mesh.dp_local, cross,
                      link_use(cluster, "all_reduce", shard_bytes, cross))


def _in_flight(cluster: ClusterSpec, kind: str, nbytes: float, bucket: float, group: GroupShape,
               links: LinkUse) -> SyncPrice:
    """`nbytes` in collectives of `bucket` bytes over `group`, which crosses sites, all posted
    before any is waited for (module docstring: buckets in flight): every bucket's time but its
    long-haul latency, one after the other, and that latency once per `collectives_in_flight`
    buckets."""
    latency = long_haul_latency_s(cluster, kind, group)
    full, rest = divmod(nbytes, bucket)
    count = int(full) + (1 if rest else 0)
    last = collective_time(cluster, kind, rest or bucket, group)
    each = collective_time(cluster, kind, bucket, group) - latency
    waits = math.ceil(count / collectives_in_flight(cluster))
    return SyncPrice(seconds=full * each + (last - latency if rest else 0.0) + waits * latency, last_bucket_s=last,
                     links=links)


def _phases_1_and_2(cluster: ClusterSpec, nbytes: float, mesh: MeshShape, site: GroupShape) -> SyncPrice:
    """Reduce-scatter inside the site, then the shard's all-reduce between sites, bucket by bucket,
    the two phases pipelined (module docstring)."""
    cross = mesh.cross_site_group_shape()
    num_buckets = math.ceil(nbytes / DEFAULT_BUCKET_BYTES)
    bucket = nbytes / num_buckets
    scatter = collective_time(cluster, "reduce_scatter", bucket, site)
    exchange = collective_time(cluster, "all_reduce", bucket / site.size, cross)
    # phase 2's latency shared by the buckets in flight together (module docstring)
    latency, alone = long_haul_latency_s(cluster, "all_reduce", cross), scatter + exchange
    exchange -= latency * (1 - math.ceil(num_buckets / collectives_in_flight(cluster)) / num_buckets)
    seconds = max(scatter, exchange) * num_buckets + min(scatter, exchange)
    links = (link_use(cluster, "reduce_scatter", nbytes, site)
             + link_use(cluster, "all_reduce", nbytes / site.size, cross))
    return SyncPrice(seconds=seconds, last_bucket_s=alone, links=links)
