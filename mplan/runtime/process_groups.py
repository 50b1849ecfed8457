"""Process groups of a mesh, created once and passed explicitly to everything that communicates.

Input: a `MeshShape` and an initialized default process group (or none, on one device).
Output: a frozen `ProcessGroups` holding this rank's group along every mesh axis, the ranks
in it and its coordinates. Nothing is stored globally: code that communicates receives a
`ProcessGroups` (or one of its groups) as an argument, so two meshes can coexist in one
process (tests do this) and no function can reach for the wrong grid.

Invariants:
- `torch.distributed.new_group` is collective over the whole world, even for ranks outside
  the new group, and every rank must create the groups in the same order. So every rank
  creates every group of every axis, in the order of `AXES` and then `MeshShape.groups`.
- A group of one rank still exists (collectives skip it, see `collectives.py`).
- With no default process group the world is one rank: all groups are `None`, which in mplan
  always means "a group of one rank" and never torch's implicit default group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mplan.runtime.mesh import AXES, Axis, MeshCoord, MeshShape

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
    world: ProcessGroup | None
    tp: ProcessGroup | None
    dp: ProcessGroup | None
    pp: ProcessGroup | None
    ep: ProcessGroup | None
    expert_dp: ProcessGroup | None
    """Replicas of this rank's experts: the dp group divided by ep."""
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    """Global ranks of the pipeline stages, first to last (p2p sends address these)."""
    ep_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]

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
        return getattr(self, f"{axis}_ranks")


def init_process_groups(mesh: MeshShape, backend: str | None = None) -> ProcessGroups:
    """Create the groups of `mesh` on every rank (collective: call it on all ranks alike).

    `backend` is passed to `new_group` (e.g. "gloo" for CPU-side groups in an NCCL world);
    `None` inherits the default group's backend.
    """
    if not dist.is_initialized():
        mesh.check_world_size(1)
        return _single_rank_groups(mesh)
    rank = dist.get_rank()
    mesh.check_world_size(dist.get_world_size())
    mine: dict[str, ProcessGroup | None] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for axis in AXES:
        for members in mesh.groups(axis):
            group = dist.new_group(members, backend=backend)
            if rank in members:
                mine[axis], ranks[f"{axis}_ranks"] = group, tuple(members)
    return ProcessGroups(
        mesh=mesh, rank=rank, coord=mesh.coord(rank), world=dist.group.WORLD, **mine, **ranks
    )


def _single_rank_groups(mesh: MeshShape) -> ProcessGroups:
    alone = (0,)
    return ProcessGroups(
        mesh=mesh, rank=0, coord=mesh.coord(0), world=None,
        tp=None, dp=None, pp=None, ep=None, expert_dp=None,
        tp_ranks=alone, dp_ranks=alone, pp_ranks=alone, ep_ranks=alone, expert_dp_ranks=alone,
    )
