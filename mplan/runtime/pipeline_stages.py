"""A pipeline plan as one rank runs it: its schedule, its stages, what it holds.

Input: the rank's local program (`insert_collectives` and `fuse_kernels` on the micro-batch
graph), the captured graph, the Plan and the rank's `ProcessGroups`. Output: `RankStages`: the
checked schedule of the plan (`ir.schedule.build_schedule`, the one definition), the program cut
into the plan's stages (`passes.split_stages`, for every stage: each rank knows what the others
hold, which the shared-parameter groups, `full_state_dict` and checkpoints need), the stages this
rank runs (global stage s runs on pipeline rank s mod pp) with the plan's recomputation applied
inside each, and the parameters shared with other pipeline ranks (`stage_copies`).

Collective: `stage_copies` creates process groups, so every rank builds its `RankStages` in the
same order. Everything that can be refused is checked first (schedule, cut), alike on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from mplan.ir.graph import Graph
from mplan.ir.schedule import Schedule, build_schedule, check_schedule
from mplan.passes.insert_collectives import LocalInput
from mplan.passes.recompute import checkpoint_units
from mplan.passes.split_stages import StageProgram, split_stages
from mplan.planner.plan import Plan
from mplan.runtime.process_groups import ProcessGroups
from mplan.runtime.stage_copies import StageCopies, stage_copies


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStages:
    """The pipeline as seen from one rank."""

    schedule: Schedule
    stages: tuple[StageProgram, ...]  # every global stage of this TP rank's program
    mine: tuple[int, ...]  # the global stages this rank runs
    copies: StageCopies
    recomputed_units: tuple[str, ...]  # checkpointed units inside this rank's stages

    @property
    def parameters(self) -> frozenset[str]:
        """The parameters this rank's stages read (what it holds)."""
        return frozenset(p for s in self.mine for p in self.stages[s].parameters)

    @property
    def inputs(self) -> tuple[LocalInput, ...]:
        """Every input this rank's stages read, each once."""
        seen: dict[str, LocalInput] = {}
        for s in self.mine:
            for spec in self.stages[s].inputs:
                seen.setdefault(spec.placeholder, spec)
        return tuple(seen.values())

    def owner(self, param: str) -> int:
        """The pipeline rank that owns `param`: the first whose stages read it."""
        return self.schedule.rank_of(next(s.index for s in self.stages if param in s.parameters))


def pipeline_schedule(plan: Plan) -> Schedule:
    """The plan's schedule as per-rank action lists, deadlock-checked."""
    schedule = build_schedule(plan.schedule, plan.mesh.pp, plan.num_micro_batches, plan.mesh.vpp)
    check_schedule(schedule)
    return schedule


def rank_stages(program: fx.GraphModule, graph: Graph, plan: Plan, groups: ProcessGroups) -> RankStages:
    """This rank's `RankStages` (see the module docstring; collective)."""
    schedule = pipeline_schedule(plan)
    stages = split_stages(program, graph, [s.units for s in plan.stages])
    mine = schedule.stages_of(groups.pp_rank)
    readers = [frozenset(p for s in schedule.stages_of(r) for p in stages[s].parameters) for r in range(plan.mesh.pp)]
    copies = stage_copies(readers, groups.mesh, groups)
    recomputed = tuple(unit for s in mine for unit in checkpoint_units(stages[s].module, graph, plan.recompute))
    return RankStages(schedule=schedule, stages=stages, mine=mine, copies=copies, recomputed_units=recomputed)


__all__ = ["RankStages", "pipeline_schedule", "rank_stages"]
