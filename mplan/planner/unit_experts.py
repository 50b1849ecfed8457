"""The MoE layers of each unit, as the evaluator re-prices them for every expert-parallel config.

A unit's costs (`unit_costs.py`) come from the TP sharding alone: its `moe_experts` ops are
priced there for one rank holding every expert. How a layer runs also depends on the EP degree
(the experts a rank holds, the all-to-all over the EP group) and on the load the busiest rank
takes, which the TP solve does not know. So for each unit this records its layers' shapes on one
TP rank (local under the solved strategy: Megatron's expert tensor parallelism splits each
expert's FFN dim), what the unit's times hold for them, their expert parameters and the
activations that grow with the tokens a rank receives; `planner/expert_pricing.py` swaps the held
price for `cost_models.moe_cost`'s at the config's ep and load.

Input: the graph at one micro-batch size, its `GraphSharding` and the `OpCoster` that priced it.
Output: one `UnitExperts` (or None, a unit without MoE layers) per unit of `unit_costs`, in order.
Invariant: a block type's instances share one record, as they share one `UnitCost` template.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mplan.cost_models.dtypes import canonical_dtype
from mplan.cost_models.moe_cost import ExpertsLayer, experts_layer
from mplan.ir.graph import Graph
from mplan.ir.moe import experts_node, is_experts
from mplan.ir.placement import Shard, local_shape
from mplan.planner.op_cost import OpCoster
from mplan.planner.sharding_ilp import GraphSharding
from mplan.planner.unit_costs import UnitCost


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitExperts:
    """A unit's MoE layers on one TP rank, one micro-batch."""

    layers: tuple[ExpertsLayer, ...]
    held_forward_s: float  # what the unit's forward_s holds for the layers' experts ops
    held_backward_s: float
    held_weight_s: float  # the weight-gradient part of held_backward_s, as `unit_costs` counts it
    expert_params: int  # local elements of the stacked expert weights (all E experts), in num_params
    expert_weights: frozenset[str]  # their names (a glue unit lists its parameters by name)
    # per layer, the activations it keeps per micro-batch that scale with the copies its experts take
    routed_saved_bytes: tuple[int, ...]


def _segment_experts(graph: Graph, nodes: Sequence[str], sharding: GraphSharding,
                     coster: OpCoster) -> UnitExperts | None:
    n = sharding.axis_size
    layers, weights = [], set()
    forward = backward = weight = 0.0
    params = 0
    saved: list[int] = []
    for node in graph.nodes_of(nodes):
        if not is_experts(node):
            continue
        s, facts = sharding.choice[node.name], experts_node(node)
        local = [local_shape(m.shape, p, n) for m, p in zip(node.input_metas, s.inputs)]
        layers.append(experts_layer(local, canonical_dtype(node.output.dtype), facts.capacity_factor))
        cost = coster.op(node, s)
        forward += cost.forward_s
        backward += cost.backward_s
        weight += max(0.0, min(cost.forward_s, cost.backward_s) - coster.op_comm(s))  # as unit_costs counts it
        for name in facts.weights.values():
            placement = s.inputs[node.inputs.index(name)]
            params += graph.params[name].meta.numel // (n if isinstance(placement, Shard) else 1)
            weights.add(name)
        saved.append(node.saved_extra_bytes // (n if s.split else 1))  # as the sharding ILP counts it
    if not layers:
        return None
    return UnitExperts(layers=tuple(layers), held_forward_s=forward, held_backward_s=backward, held_weight_s=weight,
                       expert_params=params, expert_weights=frozenset(weights), routed_saved_bytes=tuple(saved))


def unit_experts(graph: Graph, sharding: GraphSharding, coster: OpCoster,
                 units: Sequence[UnitCost]) -> tuple[UnitExperts | None, ...]:
    """The MoE layers of every unit of `units` (`unit_costs(graph, sharding, coster)`), in order."""
    by_key = {bt.name: _segment_experts(graph, bt.template, sharding, coster) for bt in graph.block_types}
    by_key.update({seg.name: _segment_experts(graph, seg.nodes, sharding, coster)
                   for seg in graph.segments if seg.block_type is None and seg.nodes})
    return tuple(by_key[u.block_type or u.name] for u in units)
