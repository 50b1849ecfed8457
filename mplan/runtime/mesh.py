"""The device mesh: how a world of ranks is laid out over the parallel axes.

Input: the degrees `dp`, `tp`, `pp` and `ep` of a plan. Output: rank <-> coordinate maps
and the rank lists of every group along every axis. Pure arithmetic, no torch.distributed:
the planner's tests and `explain` can use it without a process group.

Axis order (fastest-varying first), as Megatron-LM's default `tp-cp-ep-dp-pp`:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank),   dp_rank = ep_rank + ep * expert_dp_rank

- `tp` innermost: tensor parallelism all-reduces inside every layer on the critical path,
  so a TP group must be consecutive ranks, i.e. on one node's NVLink domain.
- `ep` inside `dp`: expert parallelism borrows data-parallel ranks (each EP rank still
  reads its own micro-batch); its all-to-all runs in every MoE layer, so it sits next to TP.
  The remaining data-parallel factor, `expert_dp = dp / ep`, replicates each expert.
- `dp` next: one gradient all-reduce per step, overlappable with backward.
- `pp` outermost: pipeline stages exchange only activations point-to-point, the least
  traffic, so they are the axis that crosses nodes first.

Invariants: every degree is positive, `dp * tp * pp == world_size`, `ep` divides `dp`.
Every rank appears in exactly one group per axis; groups along an axis are listed in
increasing order of their smallest rank, and ranks inside a group in increasing order
(which is also increasing coordinate along that axis).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Axis = Literal["tp", "dp", "pp", "ep", "expert_dp"]
AXES: tuple[Axis, ...] = ("tp", "dp", "pp", "ep", "expert_dp")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshCoord:
    """One rank's position on the mesh; `ep` and `expert_dp` split the `dp` coordinate."""

    tp: int
    dp: int
    pp: int
    ep: int
    expert_dp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    """Parallel degrees of a plan. `ep` is a factor of `dp`, not a separate axis of the world."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh degree {name} must be a positive int, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(
                f"ep must divide dp (experts are sharded over data-parallel ranks): "
                f"dp % ep = {self.dp} % {self.ep} = {self.dp % self.ep}"
            )

    @property
    def size(self) -> int:
        """Number of ranks the mesh spans."""
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the data-parallel factor left after expert parallelism."""
        return self.dp // self.ep

    def check_world_size(self, world_size: int) -> None:
        """Raise, showing the arithmetic, unless the mesh spans exactly `world_size` ranks."""
        if self.size != world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.size} "
                f"but the world size is {world_size}"
            )

    def degree(self, axis: Axis) -> int:
        return self.expert_dp if axis == "expert_dp" else getattr(self, axis)

    def coord(self, rank: int) -> MeshCoord:
        """Coordinates of `rank` (see the module docstring for the order)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        tp_rank, rest = rank % self.tp, rank // self.tp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        return MeshCoord(
            tp=tp_rank, dp=dp_rank, pp=pp_rank,
            ep=dp_rank % self.ep, expert_dp=dp_rank // self.ep,
        )

    def rank(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Inverse of `coord` (the dp coordinate already encodes ep and expert_dp)."""
        for name, value, degree in (("tp", tp, self.tp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= value < degree:
                raise ValueError(f"{name} coordinate {value} is outside 0..{degree - 1}")
        return tp + self.tp * (dp + self.dp * pp)

    def groups(self, axis: Axis) -> list[list[int]]:
        """All groups along `axis`: each the ranks that differ only in that coordinate."""
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):
            by_key.setdefault(_fixed_coords(self.coord(rank), axis), []).append(rank)
        return sorted(by_key.values())

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp},ep={self.ep}"


def _fixed_coords(coord: MeshCoord, axis: Axis) -> tuple[int, ...]:
    """The coordinates held fixed inside a group along `axis` (its identity)."""
    if axis == "tp":
        return (coord.dp, coord.pp)
    if axis == "dp":
        return (coord.tp, coord.pp)
    if axis == "pp":
        return (coord.tp, coord.dp)
    if axis == "ep":
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

