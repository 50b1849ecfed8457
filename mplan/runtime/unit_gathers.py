"""zero=3's units on a rank program: which parameters each reads, and the calls that gather them.

Input: a rank's program (the flat local program, or a pipeline stage's module), after
`checkpoint_units` (recomputation) and every other rewrite; the captured `Graph` (its segments);
the parameters by name. Output: `unit_parameters` (the optimizer's layout: parameters grouped by
the units that read them, in forward order) and `insert_unit_gathers`, which edits a program in
place so that it gathers and releases those groups as it runs (`fully_sharded.py`).

Units: the program's ops cut into maximal runs of one segment (prologue, each block instance,
glue, epilogue), as recomputation and the pipeline cut label them (`program_segments`); an op of a
checkpointed unit (one `CheckpointedUnit` call) takes its inner ops' segment. A parameter is read
by a run when an op of the run takes it, or a view of it (`t`, `view`, ... followed through
view ops), so a weight's transpose made in one run and used in the next keeps it whole.
Parameters are grouped by (first run, last run) that read them: a block's weights by their
block, a tied embedding and output head as one group from the prologue to the epilogue; groups
are numbered in forward order, across a rank's stage modules in stage order.

Calls inserted (`_GatherUnits`, `_AfterUnit`: modules, so the generated code can name them):
    before run r  gather the groups with a parameter read in r (waiting for those prefetched; a
                  no-op for those already whole), then prefetch those of the next
                  `UNITS_IN_FLIGHT - 1` runs that read any
    after run r   one-stage programs only: release the groups whose last reader is r, and hook
                  r's outputs so that their first gradient gathers again what r reads and
                  prefetches what the `UNITS_IN_FLIGHT - 1` runs before r read (their backward
                  comes next)
A pipeline stage (`keep=True`) only gathers (and prefetches): its units stay whole until the step.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from mplan.ir.graph import Graph
from mplan.passes.insert_collectives import INPUTS, LocalInput
from mplan.passes.program_segments import OP_KINDS, op_segments
from mplan.passes.recompute import CheckpointedUnit
from mplan.runtime.fully_sharded import UNITS_IN_FLIGHT, FullyShardedOptimizer


def _labels(program: fx.GraphModule, graph: Graph) -> list[tuple[fx.Node, str]]:
    """`op_segments`, where a checkpointed unit's call takes its own ops' segment; every op in
    one unit "program" where no op is labelled."""
    def inner_segment(node: fx.Node) -> str | None:
        inner = program.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(inner, CheckpointedUnit):
            return next((segment for _, segment in op_segments(inner.unit, graph)), None)
        return None

    return (op_segments(program, graph, label_of=inner_segment)
            or [(n, "program") for n in program.graph.nodes if n.op in OP_KINDS])


def _runs(program: fx.GraphModule, graph: Graph) -> list[list[fx.Node]]:
    runs: list[tuple[str, list[fx.Node]]] = []
    for node, label in _labels(program, graph):
        if runs and runs[-1][0] == label:
            runs[-1][1].append(node)
        else:
            runs.append((label, [node]))
    return [nodes for _, nodes in runs]


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _is_view(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _reads(program: fx.GraphModule, runs: list[list[fx.Node]]) -> dict[str, set[int]]:
    """Parameter name -> the runs that read it (or a view of it)."""
    run_of = {node: k for k, run in enumerate(runs) for node in run}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs: tuple[LocalInput, ...] = program.meta[INPUTS]
    reads: dict[str, set[int]] = {}
    for spec in specs:
        if spec.kind != "PARAMETER":
            continue
        found = reads.setdefault(spec.name, set())
        stack = list(placeholders[spec.placeholder].users)
        while stack:
            user = stack.pop()
            if user in run_of:
                found.add(run_of[user])
                if _is_view(user):
                    stack += list(user.users)
    return reads


def unit_parameters(programs: Sequence[fx.GraphModule], graph: Graph,
                    params: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """The trainable parameters grouped as zero=3 gathers them (module docstring), in forward
    order; parameters no program reads are in none."""
    keyed: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    placed: set[int] = set()
    for index, program in enumerate(programs):
        for name, runs in _reads(program, _runs(program, graph)).items():
            param = params[name]
            if not runs or not param.requires_grad or id(param) in placed:
                continue
            placed.add(id(param))
            keyed.setdefault((index, min(runs), max(runs)), []).append(param)
    return [keyed[key] for key in sorted(keyed)]


class _GatherUnits(nn.Module):
    """Before a run's first op: gathers its units (a no-op for those whole), then prefetches the
    next runs' (`ahead`), whose all-gathers run under this run's ops."""

    _is_impure = True  # no users: dead-code elimination must keep it

    def __init__(self, owner: FullyShardedOptimizer, units: tuple[int, ...], ahead: tuple[int, ...]) -> None:
        super().__init__()
        self.owner, self.units, self.ahead = owner, units, ahead

    def forward(self) -> None:
        self.owner.gather(self.units)
        self.owner.prefetch(self.ahead)


class _AfterUnit(nn.Module):
    """After a run's last op: `FullyShardedOptimizer.after_unit` on the run's outputs."""

    _is_impure = True

    def __init__(self, owner: FullyShardedOptimizer, release: tuple[int, ...], regather: tuple[int, ...],
                 behind: tuple[int, ...]) -> None:
        super().__init__()
        self.owner, self.release, self.regather, self.behind = owner, release, regather, behind

    def forward(self, *outputs: object) -> None:
        self.owner.after_unit(self.release, self.regather, self.behind, outputs)


def _nearby(units_of_run: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """For each run, the units of the next `UNITS_IN_FLIGHT - 1` runs that read any (`ahead`, the
    forward's prefetch) and of as many before it (`behind`, the backward's), less its own."""
    reading = [k for k, units in enumerate(units_of_run) if units]
    depth = UNITS_IN_FLIGHT - 1

    def of(near: list[int], k: int) -> tuple[int, ...]:
        return tuple(sorted({u for j in near for u in units_of_run[j]} - set(units_of_run[k])))
    ahead: list[tuple[int, ...]] = [() for _ in units_of_run]
    behind: list[tuple[int, ...]] = [() for _ in units_of_run]
    for i, k in enumerate(reading):
        ahead[k] = of(reading[i + 1:i + 1 + depth], k)
        behind[k] = of(reading[max(0, i - depth):i], k)
    return ahead, behind


def insert_unit_gathers(program: fx.GraphModule, graph: Graph, params: Mapping[str, torch.Tensor],
                        owner: FullyShardedOptimizer, *, keep: bool) -> None:
    """Edit `program` in place: gather each run's units before it, prefetching the next runs', and
    (unless `keep`) release them after their last reader and hook the run's outputs to gather them
    again for backward, prefetching the runs' before it."""
    runs = _runs(program, graph)
    reads: list[set[int]] = [set() for _ in runs]
    last_of_unit: dict[int, int] = {}
    for name, readers in _reads(program, runs).items():
        unit = owner.unit_of(params[name])
        if unit is None:
            continue
        for k in readers:
            reads[k].add(unit)
        if readers:
            last_of_unit[unit] = max(last_of_unit.get(unit, -1), max(readers))
    units_of_run = [tuple(sorted(units)) for units in reads]
    ahead, behind = _nearby(units_of_run)
    for k, run in enumerate(runs):
        units = units_of_run[k]
        if not units:
            continue
        name = f"zero3_gather_{k}"
        program.add_submodule(name, _GatherUnits(owner, units, ahead[k]))
        with program.graph.inserting_before(run[0]):
            program.graph.call_module(name, ())
        if keep:
            continue
        inside = set(run)
        outputs = [n for n in run if any(u not in inside for u in n.users)]
        release = tuple(sorted(u for u, last in last_of_unit.items() if last == k))
        name = f"zero3_after_{k}"
        program.add_submodule(name, _AfterUnit(owner, release, units, behind[k]))
        with program.graph.inserting_after(run[-1]):
            program.graph.call_module(name, tuple(outputs))
    program.graph.lint()
    program.recompile()
