"""Process groups of a mesh, from torch's `DeviceMesh`, passed explicitly to everything that
communicates.

Input: a `MeshShape` (`ir/mesh.py`) and an initialized default process group (or none, on one
device). Output: a frozen `ProcessGroups` holding the job's `DeviceMesh` with named axes
("pp", "dp", "tp", and, with expert parallelism, "expert_dp" and "ep" splitting "dp"), this rank's
group along every axis, the ranks in it and its coordinates. The mesh is torch's own, so
torch.distributed.checkpoint, DTensor and users' code read the same layout; nothing is stored
globally: code that communicates receives a `ProcessGroups` (or one of its groups) as an argument,
so two meshes can coexist in one process (tests do this) and no function can reach for the
wrong grid.

Context parallelism (cp > 1): the groups are those of `mesh.replicas()`, whose "dp" axis is
dp x cp (the ranks holding the same parameters: gradients reduce and optimizer state shards over
them, as Megatron's distributed optimizer does over its dp-cp group), plus `cp`, this rank's
context-parallel group (attention's exchanges), and `data_rank`, the true data-parallel
coordinate that picks the batch rows. Its "ep" and "expert_dp" axes split those replicas, so ep
divides dp x cp, not necessarily dp (dp=1, cp=4, ep=2: each ep group two ranks of one cp group):
the plan's mesh lays them out alike (`MeshShape.coord`).

Sites (`sites > 1`, hierarchical data parallelism, `hierarchical_reduce.py`): the site is the
outermost factor of dp, and the mesh (`MeshShape.site_dp_groups`, `cross_site_dp_groups`) lays
whole pipelines inside one site. Besides the flat dp group, a rank then holds `site_dp`, its
replicas inside its site (where ZeRO shards and gradients are reduce-scattered), and
`cross_site_dp`, the ranks of the other sites at its site-local position (the shards' sums over
the slow link). With one site `site_dp` is the dp group and `cross_site_dp` None.

Invariants:
- The DeviceMesh's rank grid is `MeshShape`'s layout (`MeshShape.rank`: tp fastest, then
  dp = ep + ep * expert_dp, then pp; with sites, the site outermost), so each axis group holds
  exactly the ranks `MeshShape.groups(axis)` lists.
- Creating a DeviceMesh is collective over the whole world: every rank calls
  `init_process_groups` with the same mesh, in the same order.
- With no default process group the world is one rank: all groups are `None`, which in mplan
  always means "a group of one rank" and never torch's implicit default group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mplan.collectives.redistribute import AxisGroup
from mplan.ir.mesh import Axis, MeshCoord, MeshShape

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in `group`; `None` is a group of one."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index inside `group`; `None` is a group of one."""
    return 0 if group is None else group.rank()


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessGroups:
    """This rank's groups along every mesh axis, with their member ranks (global ranks)."""

    mesh: MeshShape
    rank: int
    """Global rank of this process."""
    coord: MeshCoord
    device_mesh: DeviceMesh | None
    """torch's mesh over ("pp", "dp", "tp"); None on one device"""
    expert_mesh: DeviceMesh | None
    """("pp", "expert_dp", "ep", "tp"), the dp axis split for expert parallelism; None when ep == 1"""
    world: ProcessGroup | None
    tp: ProcessGroup | None
    dp: ProcessGroup | None
    pp: ProcessGroup | None
    ep: ProcessGroup | None
    expert_dp: ProcessGroup | None
    """Replicas of this rank's experts: the dp group divided by ep."""
    cp: ProcessGroup | None = None
    """This rank's context-parallel group (None: cp == 1)."""
    cp_size: int = 1
    cp_rank: int = 0
    site_dp: ProcessGroup | None = None
    """This rank's replicas inside its site (sites > 1; the dp group otherwise)."""
    cross_site_dp: ProcessGroup | None = None
    """The ranks at this rank's site-local position in every site (None: one site)."""

    @property
    def sites(self) -> int:
        """Sites the data-parallel replicas span (the outermost factor of dp)."""
        return self.mesh.sites

    @property
    def site_rank(self) -> int:
        """Which site this rank is in (the outermost factor of its dp coordinate)."""
        return self.coord.site

    @property
    def data_rank(self) -> int:
        """The data-parallel coordinate that picks this rank's batch rows (the dp coordinate
        counts dp x cp under context parallelism: cp ranks of one replica share rows)."""
        return self.coord.dp // self.cp_size

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def ep_rank(self) -> int:
        return self.coord.ep

    @property
    def expert_dp_rank(self) -> int:
        return self.coord.expert_dp

    def group(self, axis: Axis) -> ProcessGroup | None:
        return getattr(self, axis)

    def ranks(self, axis: Axis) -> tuple[int, ...]:
        """Global ranks of this rank's group along `axis`, in coordinate order."""
        return tuple(next(g for g in self.mesh.groups(axis) if self.rank in g))

    def axis(self, axis: Axis) -> AxisGroup:
        """This rank's view of one axis (group, size, index), as the collectives take it."""
        if axis == "cp":
            return AxisGroup(group=self.cp, size=self.cp_size, rank=self.cp_rank)
        return AxisGroup(group=self.group(axis), size=self.mesh.degree(axis), rank=getattr(self.coord, axis))


def init_process_groups(mesh: MeshShape) -> ProcessGroups:
    """Create the groups of `mesh` on every rank (collective: call it on all ranks alike)."""
    if mesh.cp == 1:
        return _with_sites(_init_groups(mesh), mesh)
    replicas = mesh.replicas()  # dp x cp, with the same sites: cp stays inside a site
    made = _with_sites(_init_groups(replicas), replicas)
    if not dist.is_initialized():
        raise ValueError(f"cp={mesh.cp} needs {mesh.size} ranks; there is no process group")
    mine = None
    for ranks in mesh.groups("cp"):  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if made.rank in ranks:
            mine = group
    coord = mesh.coord(made.rank)
    assert made.coord.dp == coord.cp + mesh.cp * coord.dp, "cp must sit just inside dp (ir/mesh.py)"
    assert (made.coord.ep, made.coord.expert_dp) == (coord.ep, coord.expert_dp), "ep splits the replicas (ir/mesh.py)"
    return dataclasses.replace(made, cp=mine, cp_size=mesh.cp, cp_rank=coord.cp)


def _with_sites(made: ProcessGroups, mesh: MeshShape) -> ProcessGroups:
    """`made` with its site-local and cross-site data-parallel groups (the mesh's rank lists)."""
    if mesh.sites == 1:
        return dataclasses.replace(made, site_dp=made.dp)
    found = {}
    for name, lists in (("site_dp", mesh.site_dp_groups()), ("cross_site_dp", mesh.cross_site_dp_groups())):
        for ranks in lists:  # every rank creates every group, in the same order
            group = dist.new_group(list(ranks))
            if made.rank in ranks:
                found[name] = (group, tuple(ranks))
    site_ranks, cross_ranks = found["site_dp"][1], found["cross_site_dp"][1]
    assert len(site_ranks) * len(cross_ranks) == mesh.dp and set(site_ranks) | set(cross_ranks) <= set(made.ranks("dp")), \
        f"site groups {site_ranks} x {cross_ranks} do not split the dp group {made.ranks('dp')}"
    return dataclasses.replace(made, site_dp=found["site_dp"][0], cross_site_dp=found["cross_site_dp"][0])


def _init_groups(mesh: MeshShape) -> ProcessGroups:
    if not dist.is_initialized():
        mesh.check_world_size(1)
        return ProcessGroups(mesh=mesh, rank=0, coord=mesh.coord(0), device_mesh=None, expert_mesh=None,
                             world=None, tp=None, dp=None, pp=None, ep=None, expert_dp=None)
    rank = dist.get_rank()
    mesh.check_world_size(dist.get_world_size())
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # the rank grid as `mesh.rank` lays it out (not assumed to be arange: sites reorder it)
    grid = torch.tensor([[[mesh.rank(tp=t, dp=d, pp=p) for t in range(mesh.tp)] for d in range(mesh.dp)]
                         for p in range(mesh.pp)])
    main = DeviceMesh(device, grid, mesh_dim_names=("pp", "dp", "tp"))
    groups = {axis: main.get_group(axis) for axis in ("pp", "dp", "tp")}
    expert = None
    if mesh.ep > 1:
        expert = DeviceMesh(device, grid.view(mesh.pp, mesh.expert_dp, mesh.ep, mesh.tp),
                            mesh_dim_names=("pp", "expert_dp", "ep", "tp"))
        groups.update(ep=expert.get_group("ep"), expert_dp=expert.get_group("expert_dp"))
    else:  # every rank holds all its experts; their replicas are the data-parallel ones
        groups.update(ep=None, expert_dp=groups["dp"])
    made = ProcessGroups(mesh=mesh, rank=rank, coord=mesh.coord(rank), device_mesh=main, expert_mesh=expert,
                         world=dist.group.WORLD, **groups)
    for axis in ("tp", "dp", "pp"):
        mine = tuple(int(r) for r in main[axis].mesh.flatten().tolist())
        assert mine == made.ranks(axis), f"DeviceMesh's {axis} group {mine} is not the mesh's {made.ranks(axis)}"
    return made


__all__ = ["ProcessGroups", "group_rank", "group_size", "init_process_groups"]
