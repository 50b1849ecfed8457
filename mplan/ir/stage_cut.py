"""A pipeline stage cut checked against the model: which stage runs each unit.

Input: a captured `Graph` (its segments in execution order: "prologue", block instances such
as "layers.0", "glue.N", "epilogue") and a cut, the units of each global stage in stage order
(a Plan's `stages[i].units`). Output: each unit's stage, or `StageCutError` naming what does not
fit: a unit missing, unknown or out of order, or a stage left empty (more stages than units).

The planner's resolver checks a Plan with it before any rank communicates; the `split_stages`
pass reads the same map to cut the program.
"""
from __future__ import annotations

from collections.abc import Sequence

from mplan.ir.graph import Graph


class StageCutError(ValueError):
    """A stage cut that does not fit the model: the message names the units."""


def stage_of_units(graph: Graph, stages: Sequence[Sequence[str]]) -> dict[str, int]:
    """Each unit's stage; the stages must list every unit of the model once, in order, and none
    may be empty."""
    listed = [unit for units in stages for unit in units]
    model = [seg.name for seg in graph.segments]
    if listed != model:
        missing = [u for u in model if u not in listed]
        unknown = [u for u in listed if u not in model]
        detail = (f"missing {missing[:4]} " if missing else "") + (f"unknown {unknown[:4]}" if unknown else "")
        raise StageCutError(f"the stages do not list {graph.model_name}'s units in order "
                            f"({detail.strip() or 'out of order or repeated'}): the model has {len(model)} units "
                            f"{model[0]} .. {model[-1]}, the stages list {len(listed)}; re-plan for this model")
    empty = [i for i, units in enumerate(stages) if not units]
    if empty:
        raise StageCutError(f"stages {empty} hold no unit: {len(stages)} stages for a model of {len(model)} units "
                            f"({', '.join(model[:3])}, ...); use fewer pipeline stages (pp * vpp <= {len(model)})")
    return {unit: index for index, units in enumerate(stages) for unit in units}


__all__ = ["StageCutError", "stage_of_units"]
