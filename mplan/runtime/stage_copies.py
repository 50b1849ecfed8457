"""Parameters read by pipeline stages on more than one pipeline rank (a tied input embedding and
output head), kept as one value.

Input: which parameters each pipeline rank's stages read (`StageProgram.parameters`), the mesh
and this rank's `ProcessGroups`. Output: `StageCopies`: for every parameter this rank shares with
other pipeline ranks, the process group of the ranks holding it (same data- and tensor-parallel
coordinates, the pipeline ranks that read it), and whether this rank is its owner (the lowest
such pipeline rank).

Every holder starts from the same value and runs the same optimizer on the same gradient, so
the copies stay equal: `sum_gradients()` adds the holders' gradients before the step (each
holds the part its stages contributed; their sum is the single-device gradient, as Megatron
all-reduces the embedding group), and only the owner counts the parameter in the global
gradient norm (`ParamPlacement.pp_copy`). The sum runs before the data-parallel reduction,
whose average commutes with it.

Groups are created with `dist.new_group` by every rank of the world in the same order (it is
collective), one per (set of pipeline ranks, dp coordinate, tp coordinate).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mplan.ir.mesh import MeshShape
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCopies:
    """This rank's parameters that other pipeline ranks hold copies of."""

    groups: Mapping[str, ProcessGroup]  # parameter -> the ranks holding a copy (this one included)
    owned: frozenset[str]  # the shared parameters this rank owns (counted in the norm here)

    def copy_here(self, name: str) -> bool:
        """A copy whose owner is another pipeline rank (not counted in the norm here)."""
        return name in self.groups and name not in self.owned

    @torch.no_grad()
    def sum_gradients(self, params: Mapping[str, torch.Tensor]) -> None:
        """Add up the holders' gradients of every shared parameter, in place (collective over
        each group; a parameter no stage here gave a gradient contributes zeros)."""
        for name in sorted(self.groups):
            param = params[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.groups[name])


def stage_copies(readers_by_rank: Sequence[frozenset[str]], mesh: MeshShape, groups: ProcessGroups) -> StageCopies:
    """`readers_by_rank[r]`: the parameters pipeline rank r's stages read (every rank passes the
    same list; see the module docstring)."""
    holders: dict[str, tuple[int, ...]] = {}
    for rank, names in enumerate(readers_by_rank):
        for name in names:
            holders[name] = (*holders.get(name, ()), rank)
    shared = sorted({ranks for ranks in holders.values() if len(ranks) > 1})
    made: dict[tuple[int, ...], ProcessGroup] = {}
    for pp_ranks in shared:
        for dp in range(mesh.dp):
            for tp in range(mesh.tp):
                ranks = [mesh.rank(tp=tp, dp=dp, pp=r) for r in pp_ranks]
                group = dist.new_group(ranks)
                if groups.rank in ranks:
                    made[pp_ranks] = group
    mine = groups.pp_rank
    by_name = {name: made[ranks] for name, ranks in holders.items() if len(ranks) > 1 and mine in ranks}
    owned = frozenset(name for name in by_name if holders[name][0] == mine)
    return StageCopies(groups=by_name, owned=owned)


__all__ = ["StageCopies", "stage_copies"]
