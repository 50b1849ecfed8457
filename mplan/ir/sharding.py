"""What a TP choice implies, and whether it can run: parameter storage and edge transitions.

Input: a captured `Graph` and a TP choice (node name -> `Strategy`, one for every node).
Output: one `ParamLayout` per parameter (`parameter_layouts`): the placement every rank stores it
under (the consumers' input placement at the parameter's slot) and how its gradient comes out;
and `check_sharding`, which raises `UnexecutableStrategy` naming node and strategy unless every
node has a strategy with one placement per input and a lowering the passes implement
(`strategy.LOWERINGS`), every edge's forward and backward transitions exist (no R -> P), and
every parameter has one storage placement. The planner checks its Plans with it before handing
them on, and the passes before touching a tensor or issuing a collective.

Invariants:
- A parameter is stored once per rank, so all its consumers must read it under the same
  placement (tied weights read by a vocabulary-parallel embedding and a column-parallel head
  agree on S(0)); otherwise `ParameterPlacementConflict` names the consumers and strategies.
- Storage is S(d) or R, never P: a partial parameter has no meaning before any op ran.
- A replicated parameter whose every consumer leaves a partial gradient (a norm weight applied
  to sequence shards, a row-parallel bias) is `grad_partial`: its gradient is summed over TP
  once per optimizer step, after the last micro-batch, as Megatron does. When only some
  consumers leave a partial gradient, those edges all-reduce their share in backward instead
  (the generic reshard of `insert_collectives`), so the stored gradient is already whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mplan.ir.graph import Graph
from mplan.ir.placement import P, Partial, Placement, R, Replicate, can_transition, grad_placement
from mplan.ir.strategy import LOWERINGS, Strategy


class UnexecutableStrategy(ValueError):
    """A strategy (or a mix of them) that the passes cannot run exactly."""


class ParameterPlacementConflict(UnexecutableStrategy):
    """Two consumers of one parameter want it stored differently."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamLayout:
    """One parameter on one TP rank."""

    name: str  # the user's FQN (`layers.0.attn.q_proj.weight`)
    placement: Placement  # S(d): rank i holds chunk i of dim d; R: the whole tensor
    grad_partial: bool  # R storage, partial gradient: TP all-reduce before the optimizer step
    consumers: tuple[str, ...]  # node names that read it

    @property
    def grad_placement(self) -> Placement:
        """What the gradient accumulated in `.grad` is, before the per-step TP reduction."""
        return P if self.grad_partial else self.placement

    @property
    def tp_sharded(self) -> bool:
        return not isinstance(self.placement, Replicate)


def parameter_layouts(graph: Graph, choice: Mapping[str, Strategy]) -> dict[str, ParamLayout]:
    """The storage layout of every parameter of `graph` under `choice` (graph order)."""
    reads: dict[str, list[tuple[str, Strategy, int]]] = {name: [] for name in graph.params}
    for node in graph.nodes:
        for slot, name in enumerate(node.inputs):
            if name in reads:
                reads[name].append((node.name, choice[node.name], slot))
    layouts: dict[str, ParamLayout] = {}
    for name, uses in reads.items():
        wanted = {strategy.inputs[slot] for _, strategy, slot in uses}
        if len(wanted) > 1:
            detail = "; ".join(f"{node} runs {strategy} and reads it as {strategy.inputs[slot]}"
                               for node, strategy, slot in uses)
            raise ParameterPlacementConflict(
                f"parameter {name} is stored once per rank but its consumers disagree on its "
                f"placement: {detail}")
        placement = wanted.pop() if wanted else R
        if isinstance(placement, Partial):
            node, strategy, _ = uses[0]
            raise ParameterPlacementConflict(
                f"parameter {name}: {node} runs {strategy}, which reads a parameter as a partial sum")
        grads = [strategy.input_grads[slot] for _, strategy, slot in uses]
        partial = placement == R and bool(grads) and all(isinstance(g, Partial) for g in grads)
        layouts[name] = ParamLayout(name=name, placement=placement, grad_partial=partial,
                                    consumers=tuple(node for node, _, _ in uses))
    return layouts


def tp_reduced_parameters(layouts: Mapping[str, ParamLayout]) -> list[str]:
    """Replicated parameters whose gradient is summed over TP once per step (SP norm weights,
    row-parallel biases), in graph order."""
    return [name for name, layout in layouts.items() if layout.grad_partial]


def check_sharding(graph: Graph, choice: Mapping[str, Strategy]) -> None:
    """Validate `choice` for execution (see the module docstring)."""
    missing = [node.name for node in graph.nodes if node.name not in choice]
    if missing:
        raise UnexecutableStrategy(f"no strategy for nodes {missing[:5]}")
    layouts = parameter_layouts(graph, choice)
    produced = {node.name: choice[node.name].output for node in graph.nodes}
    for node in graph.nodes:
        strategy = choice[node.name]
        if len(strategy.inputs) != len(node.inputs) or len(strategy.input_grads) != len(node.inputs):
            raise UnexecutableStrategy(f"node {node.name}: strategy {strategy} has "
                                       f"{len(strategy.inputs)} input placements for {len(node.inputs)} inputs")
        if strategy.lowering not in LOWERINGS:
            raise UnexecutableStrategy(f"node {node.name} ({node.op}): strategy {strategy} names lowering "
                                       f"{strategy.lowering!r}; the passes implement {', '.join(sorted(LOWERINGS))}")
        for slot, value in enumerate(node.inputs):
            if value in layouts:
                out, grad_needed = layouts[value].placement, layouts[value].grad_placement
            else:
                out = produced.get(value, R)
                grad_needed = grad_placement(out)
            wanted, grad = strategy.inputs[slot], strategy.input_grads[slot]
            if not can_transition(out, wanted) or not can_transition(grad, grad_needed):
                raise UnexecutableStrategy(
                    f"edge {value} -> {node.name} ({strategy}): no collective turns {out} into "
                    f"{wanted} forward or {grad} into {grad_needed} backward")
