"""`split_stages`: cut one rank's local program into the Plan's pipeline stages.

Input: the local program of a TP rank (`insert_collectives`, after `fuse_kernels` when asked),
the captured `Graph` (its segments), and the Plan's stages as unit lists in stage order
(`Plan.stages[i].units`: "prologue", "layers.0", ..., "epilogue"; virtual stages included).
Output: one `StageProgram` per global stage: an fx module that takes the stage's own inputs
(the parameters, buffers, constants and user inputs its ops read) followed by the values it
receives from the stage before, and returns the values the next stage needs (the last stage
returns the program's output, the loss). What crosses each border is listed ahead as
`BoundaryValue`s with local shapes, so a receive can be posted before the data arrives.

Rules:
- every op belongs to the stage of its segment (`program_segments.op_segments`: reshards with
  their consumer, fused kernels where their chain ended, a `getitem` with its tuple);
- a value crosses border s (stage s -> s+1) when it is made at or before stage s and read after
  it; a value read two stages later passes through the stage between (returned as received), so
  each border carries everything live across it and transfers stay between neighbours;
- a boundary value is differentiable when it is floating point and depends on a parameter: its
  gradient travels back across the border; masks, token ids and RoPE tables travel forward only;
- a parameter read by several stages (a tied embedding and output head) is an input of each:
  the runtime holds one copy per pipeline rank and sums their gradients before the step.
Uneven stages, stages of a single unit and layer counts that do not divide are all the same case.

Invariants: the stages, run in order on the same inputs and handing over their boundary values,
compute exactly the flat program (same ops, same order within each stage); every stage's op
nodes are contiguous in program order, else the Plan's cut does not match the program and
`StageCutError` names the units out of order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from mplan.ir.graph import Graph
from mplan.ir.stage_cut import StageCutError, stage_of_units
from mplan.passes.insert_collectives import INPUTS, LOCAL_SHAPE, LocalInput
from mplan.passes.program_segments import OP_KINDS, op_segments


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryValue:
    """One tensor handed from a stage to the next."""

    name: str  # the value's node name in the flat program
    shape: tuple[int, ...]  # this rank's local shape
    dtype: torch.dtype  # as captured (the runtime checks the dtype it really sends once)
    differentiable: bool  # its gradient is sent back across the border


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProgram:
    """One global stage of one TP rank's program."""

    index: int  # global stage
    units: tuple[str, ...]  # the Plan's units it runs, in order
    module: fx.GraphModule  # (*inputs, *receives) -> tuple(sends), or the program's output on the last stage
    inputs: tuple[LocalInput, ...]  # the stage's own placeholders, in order (`module.meta[INPUTS]` too)
    receives: tuple[BoundaryValue, ...]  # from stage index - 1 (empty on the first stage)
    sends: tuple[BoundaryValue, ...]  # to stage index + 1 (empty on the last stage)

    @property
    def parameters(self) -> tuple[str, ...]:
        """The parameters (IR names) this stage reads."""
        return tuple(spec.name for spec in self.inputs if spec.kind == "PARAMETER")


def split_stages(program: fx.GraphModule, graph: Graph, stages: Sequence[Sequence[str]]) -> tuple[StageProgram, ...]:
    """The stages of `program` (see the module docstring); `stages[i]` lists stage i's units."""
    stage_of_unit = stage_of_units(graph, stages)
    ops = op_segments(program, graph)
    stage_of: dict[fx.Node, int] = {}
    previous: tuple[int, str] | None = None
    for node, segment in ops:
        stage = stage_of_unit[segment]
        if previous is not None and stage < previous[0]:
            raise StageCutError(f"the stage cut does not follow the program: unit {segment} (stage {stage}) runs after "
                                f"unit {previous[1]} (stage {previous[0]}); stages must list the units in program order")
        stage_of[node] = stage
        previous = (stage, segment)
    last = len(stages) - 1
    output = next(n for n in program.graph.nodes if n.op == "output")
    specs = {spec.placeholder: spec for spec in program.meta[INPUTS]}
    differentiable = _differentiable(program, specs)

    # last stage that reads each op value; values read by the output are read by the last stage
    last_reader: dict[fx.Node, int] = {}
    for node in program.graph.nodes:
        reader = last if node is output else stage_of.get(node)
        if reader is None:
            continue
        for value in node.all_input_nodes:
            if value.op in OP_KINDS:
                last_reader[value] = max(last_reader.get(value, -1), reader)
    borders: list[list[fx.Node]] = [[] for _ in range(last)]
    for value, reader in last_reader.items():
        for border in range(stage_of[value], reader):
            borders[border].append(value)
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    crossing = [[_boundary(v, v in differentiable) for v in sorted(values, key=order.__getitem__)]
                for values in borders]
    return tuple(
        _stage_program(program, index, tuple(units), [n for n, s in stage_of.items() if s == index], specs,
                       receives=crossing[index - 1] if index else [], sends=crossing[index] if index < last else [],
                       output=output if index == last else None)
        for index, units in enumerate(stages))


def _differentiable(program: fx.GraphModule, specs: dict[str, LocalInput]) -> set[fx.Node]:
    """Floating-point values that depend on a parameter (what can carry a gradient)."""
    out: set[fx.Node] = set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if specs[node.name].kind == "PARAMETER":
                out.add(node)
        elif node.op in OP_KINDS and any(i in out for i in node.all_input_nodes):
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.is_floating_point():
                out.add(node)  # tuples stay in: their floating elements are judged at their getitem
    return out


def _boundary(node: fx.Node, differentiable: bool) -> BoundaryValue:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise StageCutError(f"value {node.name} ({node.op} {node.target}) crosses a stage border but is not a "
                            f"single tensor; the stage cut cannot fall there")
    shape = tuple(node.meta.get(LOCAL_SHAPE, value.shape))
    return BoundaryValue(name=node.name, shape=shape, dtype=value.dtype,
                         differentiable=differentiable and value.is_floating_point())


def _stage_program(program: fx.GraphModule, index: int, units: tuple[str, ...], nodes: list[fx.Node],
                   specs: dict[str, LocalInput], *, receives: list[BoundaryValue], sends: list[BoundaryValue],
                   output: fx.Node | None) -> StageProgram:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)
    reads = {i for n in nodes for i in n.all_input_nodes if i.op == "placeholder"}
    inputs: list[LocalInput] = []
    for node in program.graph.nodes:  # the stage's own inputs, in the program's order
        if node in reads:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            inputs.append(specs[node.name])
    for node in program.graph.nodes:  # lifted constants the stage reads, as attributes of its own
        if node.op == "get_attr" and any(u in inside for u in node.users):
            env[node] = graph.get_attr(node.target)
            env[node].meta = dict(node.meta)
    by_name = {n.name: n for n in program.graph.nodes}
    for value in receives:
        source = by_name[value.name]
        env[source] = graph.placeholder(value.name)
        env[source].meta = dict(source.meta)
    for node in program.graph.nodes:
        if node in inside:
            env[node] = graph.node_copy(node, lambda x: env[x])
    if output is not None:
        graph.output(env[output.args[0]] if not isinstance(output.args[0], (tuple, list))
                     else type(output.args[0])(env[a] for a in output.args[0]))
    else:
        graph.output(tuple(env[by_name[v.name]] for v in sends))
    module = fx.GraphModule(program, graph, class_name=f"Stage{index}")
    module.meta[INPUTS] = tuple(inputs)
    unused = [v.name for v in receives if not env[by_name[v.name]].users]
    if unused:  # a border carries only what a later stage reads, so every receive is read or passed on
        raise AssertionError(f"stage {index} receives {unused} and neither reads nor passes them on")
    return StageProgram(index=index, units=units, module=module, inputs=tuple(inputs), receives=tuple(receives),
                        sends=tuple(sends))


__all__ = ["BoundaryValue", "StageCutError", "StageProgram", "split_stages"]
