"""The device mesh: how a world of ranks is laid out over the parallel axes, the one home of
rank-layout arithmetic.

Input: the degrees `dp`, `tp`, `pp`, `ep` and `cp` of a plan, and `sites`, the data centers data
parallelism spans hierarchically. Output: rank <-> coordinate maps, the
rank lists of every group along every axis (the runtime's process groups), and each axis's
`GroupShape` on a cluster (how many of a group's ranks share a node: what the cost model prices).
Pure arithmetic, no torch.distributed: the planner and `explain` use it without a process group.

Axis order (fastest-varying first), as Megatron-LM's default `tp-cp-ep-dp-pp`:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    replica = cp_rank + cp * dp_rank = ep_rank + ep * expert_dp_rank

- `tp` innermost: tensor parallelism all-reduces inside every layer on the critical path,
  so a TP group must be consecutive ranks, i.e. on one node's NVLink domain.
- `cp` next to it: context parallelism exchanges keys and values (or heads) in every
  attention layer, forward and backward, also on the critical path, so its groups are the
  next consecutive ranks, inside a node as long as tp * cp fits one. Putting it just inside
  `dp` also makes `replicas()` (dp * cp ranks holding the same parameters) a plain mesh: the
  runtime reduces gradients and shards optimizer state over dp x cp as over data parallelism.
- `ep` inside the replicas: expert parallelism borrows ranks that hold the same parameters,
  the dp x cp replicas (each EP rank still routes its own tokens: its micro-batch, or its slice
  of the sequences under cp); its all-to-all runs in every MoE layer, so it sits next to TP.
  The replica coordinate `cp_rank + cp * dp_rank` advances by tp ranks whatever splits it, so
  ep may divide dp (with cp = 1, or groups of whole cp groups), cp (dp=1, cp=4, ep=2: an MoE
  at long context on one node), or neither alone (dp=2, cp=2, ep=4): only `ep | dp * cp`.
  The remaining factor, `expert_dp = dp * cp / ep`, replicates each expert.
- `dp` next: one gradient all-reduce per step, overlappable with backward.
- `pp` outermost: pipeline stages exchange only activations point-to-point, the least
  traffic, so they are the axis that crosses nodes first.

Sites (`sites = S > 1`, data centers joined by a long-haul link; hierarchical data parallelism).
The site is the outermost factor of dp: `dp = S * dp_local`, and

    rank = tp_rank + tp * (cp_rank + cp * (dp_local + dp_local_size * (pp_rank + pp * site))),
    dp_rank = dp_local + dp_local_size * site,   site = rank // (world / S)

so whole pipelines (tp x cp x dp_local x pp ranks) live inside one site, as the cluster places
ranks (`ClusterSpec`: rank r on site r // (world / sites)): TP, CP, EP (a factor of dp_local) and
PP groups never cross sites, by construction; only data parallelism does, hierarchically. Its
groups: `site_dp_groups()` (the dp_local ranks of one site holding the same tp, cp and pp
coordinates: gradients are reduce-scattered and gathered there, and ZeRO shards over them) and
`cross_site_dp_groups()` (one rank a site, the same dp_local coordinate in each: the shards'
all-reduce over the long-haul link). `groups("dp")` is still the whole data-parallel group, all
sites. With `sites == 1` the formula is the one above: nothing changes.
PP crossing sites (one activation transfer per micro-batch over the long haul) has no key yet: its
price depends on how the schedule hides a 10 ms hop per micro-batch, which the simulator does not
model per link; a plan with `sites=1` whose pipelines would cross the sites of its cluster is
refused (`check_sites`).

Invariants: every degree is positive, `dp * tp * pp * cp == world_size`, `ep` divides
`dp * cp`, `sites` divides `dp` and `ep` divides `dp * cp / sites`; the ep and expert_dp groups
are those of `replicas()` (dp x cp ranks), the mesh the runtime builds its groups on.
Ranks fill nodes in order (rank r on node r // gpus_per_node).
Every rank appears in exactly one group per axis; groups along an axis are listed in
increasing order of their smallest rank, and ranks inside a group in increasing order
(which is also increasing coordinate along that axis).
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal

Axis = Literal["tp", "dp", "pp", "ep", "expert_dp", "cp"]
AXES: tuple[Axis, ...] = ("tp", "dp", "pp", "ep", "expert_dp", "cp")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshCoord:
    """One rank's position on the mesh; `ep` and `expert_dp` split the replica coordinate
    `cp + cp_degree * dp` (the `dp` coordinate where cp = 1)."""

    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int
    cp: int = 0
    """position on the context-parallel axis: which slice of each sequence the rank holds"""
    site: int = 0
    """the site (data center) the rank is in: the outermost factor of `dp`"""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    """Parallel degrees of a plan. `ep` is a factor of `dp * cp` (the replicas), not a separate
    axis of the world."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    """context-parallel degree: each rank of a cp group holds 1/cp of every sequence"""
    sites: int = 1
    """sites data parallelism spans hierarchically (the outermost factor of dp, module docstring)"""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "sites"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh degree {name} must be a positive int, got {value!r}")
        replicas, names = self.dp * self.cp, ("dp*cp", f"{self.dp}*{self.cp}") if self.cp > 1 else ("dp", f"{self.dp}")
        if replicas % self.ep:
            raise ValueError(
                f"ep must divide {names[0]} (experts are sharded over the ranks holding the same parameters): "
                f"{names[0]} % ep = {names[1]} % {self.ep} = {replicas % self.ep}"
            )
        if self.dp % self.sites:
            raise ValueError(f"sites must divide dp (data parallelism is what spans sites): "
                             f"dp % sites = {self.dp} % {self.sites} = {self.dp % self.sites}")
        if (replicas // self.sites) % self.ep:
            raise ValueError(f"ep must divide {names[0]} / sites (expert groups stay inside a site): "
                             f"{names[1]} / {self.sites} = {replicas // self.sites}, not a multiple of ep={self.ep}")

    @property
    def size(self) -> int:
        """Number of ranks the mesh spans."""
        return self.dp * self.tp * self.pp * self.cp

    def replicas(self) -> MeshShape:
        """The same ranks seen as data parallelism over dp * cp: the ranks that hold the same
        parameters and sum (a cp rank's gradients are partial: its tokens' share) or average
        their gradients. The layout is identical (cp sits just inside dp), so the replica
        coordinate is cp_rank + cp * dp_rank."""
        return MeshShape(dp=self.dp * self.cp, tp=self.tp, pp=self.pp, ep=self.ep, sites=self.sites)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the dp x cp replicas left after expert parallelism."""
        return self.dp * self.cp // self.ep

    @property
    def dp_local(self) -> int:
        """Data-parallel ranks inside one site: the group ZeRO shards over (all of dp at one site)."""
        return self.dp // self.sites

    @property
    def expert_dp_local(self) -> int:
        """Replicas of each expert inside one site."""
        return self.dp_local * self.cp // self.ep

    def check_world_size(self, world_size: int) -> None:
        """Raise, showing the arithmetic, unless the mesh spans exactly `world_size` ranks."""
        if self.size != world_size:
            names, values = ("dp*tp*pp*cp", f"{self.dp}*{self.tp}*{self.pp}*{self.cp}") if self.cp > 1 else \
                ("dp*tp*pp", f"{self.dp}*{self.tp}*{self.pp}")
            raise ValueError(f"{names} = {values} = {self.size} but the world size is {world_size}")

    def degree(self, axis: Axis) -> int:
        return self.expert_dp if axis == "expert_dp" else getattr(self, axis)

    def coord(self, rank: int) -> MeshCoord:
        """Coordinates of `rank` (see the module docstring for the order)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_local, rest = rest % self.dp_local, rest // self.dp_local
        pp_rank, site = rest % self.pp, rest // self.pp
        dp_rank = dp_local + self.dp_local * site
        replica = cp_rank + self.cp * dp_rank  # replicas()'s dp coordinate (ep divides a site's share)
        return MeshCoord(
            tp=tp_rank, dp=dp_rank, pp=pp_rank,
            ep=replica % self.ep, expert_dp=replica // self.ep, cp=cp_rank, site=site,
        )

    def rank(self, *, tp: int = 0, dp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """Inverse of `coord` (the dp and cp coordinates already encode ep and expert_dp)."""
        for name, value, degree in (("tp", tp, self.tp), ("dp", dp, self.dp), ("pp", pp, self.pp),
                                    ("cp", cp, self.cp)):
            if not 0 <= value < degree:
                raise ValueError(f"{name} coordinate {value} is outside 0..{degree - 1}")
        site, dp_local = divmod(dp, self.dp_local)
        return tp + self.tp * (cp + self.cp * (dp_local + self.dp_local * (pp + self.pp * site)))

    def groups(self, axis: Axis) -> list[list[int]]:
        """All groups along `axis`: each the ranks that differ only in that coordinate."""
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):
            by_key.setdefault(_fixed_coords(self.coord(rank), axis), []).append(rank)
        return sorted(by_key.values())

    def site_dp_groups(self) -> list[list[int]]:
        """The data-parallel groups inside each site: ranks of one site that differ only in their
        dp_local coordinate (all of `groups("dp")` at one site). Hierarchical DP reduce-scatters
        and all-gathers over them; ZeRO shards over them."""
        return self._groups_by(lambda c: (c.tp, c.pp, c.cp, c.site))

    def cross_site_dp_groups(self) -> list[list[int]]:
        """One rank a site, the same tp, cp, pp and dp_local coordinates in each: the groups that
        all-reduce the site-local shards over the long-haul link (one group of one rank per rank
        at one site)."""
        return self._groups_by(lambda c: (c.tp, c.pp, c.cp, c.dp % self.dp_local))

    def _groups_by(self, identity: Callable[[MeshCoord], tuple[int, ...]]) -> list[list[int]]:
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):
            by_key.setdefault(identity(self.coord(rank)), []).append(rank)
        return sorted(by_key.values())

    def __str__(self) -> str:
        return (f"dp={self.dp},tp={self.tp},pp={self.pp},ep={self.ep}" + (f",cp={self.cp}" if self.cp > 1 else "")
                + (f",sites={self.sites}" if self.sites > 1 else ""))

    def stride(self, axis: Axis) -> int:
        """Rank distance between consecutive members of a group along `axis` inside one site (dp and
        expert_dp groups also jump from site to site, `size // sites` ranks apart). The replica
        coordinate (cp inside dp) advances by tp ranks, so ep and expert_dp are tp-strided."""
        inner = self.tp * self.cp
        return {"tp": 1, "cp": self.tp, "ep": self.tp, "dp": inner, "expert_dp": self.tp * self.ep,
                "pp": inner * self.dp_local}[axis]

    def group_shape(self, axis: Axis, gpus_per_node: int, cluster_sites: int = 1) -> GroupShape:
        """How a group along `axis` sits on nodes of `gpus_per_node` (see `GroupShape.from_mesh_axis`)
        and on the `cluster_sites` sites of the cluster (rank r on site r // (size / cluster_sites)):
        with `sites > 1` dp and expert_dp groups span every site, the others none by construction;
        with `sites == 1` on a cluster of several sites, an axis spans the sites its ranks fall on
        (a flat data-parallel ring crosses the long haul: it is priced there)."""
        if self.sites > 1 and axis in ("dp", "expert_dp"):
            local = self.site_group_shape(axis, gpus_per_node)
            return GroupShape(size=local.size * self.sites, ranks_per_node=local.ranks_per_node, num_sites=self.sites)
        shape = GroupShape.from_mesh_axis(size=self.degree(axis), stride=self.stride(axis), gpus_per_node=gpus_per_node)
        if self.sites > 1 or cluster_sites == 1:
            return shape
        if self.size % cluster_sites:
            raise ValueError(f"{cluster_sites} sites do not divide the mesh's {self.size} ranks")
        num_sites = _site_span(shape.size, self.stride(axis), self.size // cluster_sites)
        return GroupShape(size=shape.size, ranks_per_node=shape.ranks_per_node, num_sites=num_sites)

    def site_group_shape(self, axis: Axis, gpus_per_node: int) -> GroupShape:
        """The part of a dp or expert_dp group inside one site (`site_dp_groups`), on nodes."""
        if axis not in ("dp", "expert_dp"):
            raise ValueError(f"only dp and expert_dp groups span sites, not {axis}")
        return GroupShape.from_mesh_axis(size=self.degree(axis) // self.sites, stride=self.stride(axis),
                                         gpus_per_node=gpus_per_node)

    def cross_site_group_shape(self) -> GroupShape:
        """A group of `cross_site_dp_groups`: one rank a site, on as many nodes."""
        return GroupShape(size=self.sites, ranks_per_node=1, num_sites=self.sites)

    def check_sites(self, cluster_sites: int) -> None:
        """Raise one line unless this mesh keeps TP, CP, EP and PP inside the sites of a cluster of
        `cluster_sites` sites: a mesh with `sites > 1` must have the cluster's count; one with
        `sites == 1` (flat data parallelism) must not put any of those groups across two sites."""
        if self.sites > 1 and self.sites != cluster_sites:
            raise ValueError(f"sites={self.sites} but the cluster has {cluster_sites} site(s): a plan's sites "
                             f"must be 1 (flat) or the cluster's")
        if self.sites > 1 or cluster_sites == 1:
            return
        if self.size % cluster_sites:
            raise ValueError(f"{cluster_sites} sites do not divide the mesh's {self.size} ranks")
        for axis in ("tp", "cp", "ep", "pp"):
            if self.degree(axis) > 1 and _site_span(self.degree(axis), self.stride(axis),
                                                    self.size // cluster_sites) > 1:
                raise ValueError(f"{axis}={self.degree(axis)} groups would cross the cluster's {cluster_sites} sites "
                                 f"under sites=1 (TP, CP and EP stay inside a site; PP across sites is not "
                                 f"planned yet): use sites={cluster_sites} (hierarchical data parallelism)")

    def p2p_shape(self, gpus_per_node: int) -> GroupShape:
        """Two neighbouring pipeline stages (a send/recv pair): across two nodes if any such pair of
        the mesh is (the slowest hop paces the pipeline), else on one node."""
        if self.pp == 1:
            return GroupShape(size=1, ranks_per_node=1)
        return _p2p_shape(self.stride("pp"), self.pp, gpus_per_node)


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupShape:
    """A process group as the cost model sees it: ``size`` ranks, ``ranks_per_node`` of them per node."""

    size: int
    ranks_per_node: int
    num_sites: int = 1
    """sites the group spans (> 1: it crosses the long-haul link); a mesh spreads a group's ranks
    evenly over them wherever the cluster's sites divide it (`MeshShape.check_sites`)"""

    def __post_init__(self) -> None:
        if self.size < 1 or self.ranks_per_node < 1 or self.size % self.ranks_per_node:
            raise ValueError(f"GroupShape needs size >= 1 and ranks_per_node dividing it, "
                             f"got size={self.size}, ranks_per_node={self.ranks_per_node}")
        if not 1 <= self.num_sites <= self.size:
            raise ValueError(f"GroupShape needs 1 <= num_sites <= size, got num_sites={self.num_sites}, "
                             f"size={self.size}")

    @property
    def crosses_sites(self) -> bool:
        return self.num_sites > 1

    @property
    def ranks_per_site(self) -> int:
        """The group's ranks on one site (the fewest, where they fall unevenly)."""
        return self.size // self.num_sites

    @property
    def num_nodes(self) -> int:
        return self.size // self.ranks_per_node

    @property
    def level(self) -> str:
        """"intra_node", "inter_node" (one rank per node) or "hierarchical"; "intra_node" for one rank."""
        if self.num_nodes == 1:
            return "intra_node"
        return "inter_node" if self.ranks_per_node == 1 else "hierarchical"

    @classmethod
    def from_mesh_axis(cls, *, size: int, stride: int, gpus_per_node: int) -> GroupShape:
        """The groups of a mesh axis whose consecutive members are ``stride`` ranks apart, as they
        fall on nodes of ``gpus_per_node`` (ranks fill nodes in order).

        Every group of the axis is laid out, not only the first: a group that starts mid-node can
        straddle a node boundary (tp=3 on 2-GPU nodes: ranks 0,1 | 2), and one that fits a node
        (two pipeline neighbours on a 3-GPU node) must never be priced across two. Where every
        group holds the same number of ranks on each node it touches, that number is exact (TP
        innermost, size 8 on 8-GPU nodes: one node; DP outside TP=8: one rank per node). Where
        they fall unevenly (tp=3 on 2-GPU nodes holds 2 and 1), the group is priced as if
        gcd(counts) of its ranks shared each node: no node's NICs carry less than that share, so
        the price is the slower, conservative one, and its `num_nodes` (size / gcd) may exceed
        the nodes it spans (`collective_cost.check_group_fits` allows that, never more ranks).
        """
        if size < 1 or stride < 1 or gpus_per_node < 1:
            raise ValueError(f"mesh axis needs size, stride and gpus_per_node >= 1, got size={size}, "
                             f"stride={stride}, gpus_per_node={gpus_per_node}")
        return _axis_shape(size, stride, gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _axis_shape(size: int, stride: int, gpus_per_node: int) -> GroupShape:
    # An axis's groups are the ranks sharing every other coordinate: digit (rank // stride) % size
    # runs over the group. Nodes and groups both repeat with period lcm(size*stride, gpus_per_node),
    # which divides any world the mesh fills (stride*size and gpus_per_node both divide it), so
    # the groups of one period are those of every world. Cached: the search asks per candidate.
    period = math.lcm(size * stride, gpus_per_node)
    counts: set[int] = set()
    for base in range(period):
        if (base // stride) % size == 0:
            counts.update(Counter((base + i * stride) // gpus_per_node for i in range(size)).values())
    return GroupShape(size=size, ranks_per_node=math.gcd(*counts))


@functools.lru_cache(maxsize=4096)
def _p2p_shape(stride: int, pp: int, gpus_per_node: int) -> GroupShape:
    # Stage s of a pipeline sends to stage s+1, `stride` ranks on; the pairs repeat as the axis's groups do.
    period = math.lcm(pp * stride, gpus_per_node)
    crosses = any(base // gpus_per_node != (base + stride) // gpus_per_node
                  for base in range(period) if (base // stride) % pp < pp - 1)
    return GroupShape(size=2, ranks_per_node=1 if crosses else 2)


@functools.lru_cache(maxsize=4096)
def _site_span(size: int, stride: int, ranks_per_site: int) -> int:
    # Sites a group of `size` ranks `stride` apart touches, the same for every group of the axis
    # (else the most, which is what the long haul carries): periodic as nodes are.
    period = math.lcm(size * stride, ranks_per_site)
    return max(len({(base + i * stride) // ranks_per_site for i in range(size)})
               for base in range(period) if (base // stride) % size == 0)


def _fixed_coords(coord: MeshCoord, axis: Axis) -> tuple[int, ...]:
    """The coordinates held fixed inside a group along `axis` (its identity)."""
    if axis == "tp":
        return (coord.dp, coord.pp, coord.cp)
    if axis == "cp":
        return (coord.tp, coord.dp, coord.pp)
    if axis == "dp":
        return (coord.tp, coord.pp, coord.cp)
    if axis == "pp":
        return (coord.tp, coord.dp, coord.cp)
    if axis == "ep":  # expert_dp holds the site and the replica coordinate beyond ep
        return (coord.tp, coord.pp, coord.expert_dp)
    return (coord.tp, coord.pp, coord.ep)


def mesh_for_world(world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1) -> MeshShape:
    """The mesh that fills `world_size` with data parallelism after `tp` and `pp`."""
    model_parallel = tp * pp
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(
            f"tp*pp = {tp}*{pp} = {model_parallel} does not divide the world size {world_size}"
        )
    return MeshShape(dp=world_size // model_parallel, tp=tp, pp=pp, ep=ep)

