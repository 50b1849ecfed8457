"""What a config's expert parallelism does to each unit: its MoE layers re-priced at `config.ep`.

A unit's costs (`unit_costs.py`) price its `moe_experts` ops for one rank holding every expert, as
the TP solve sees them; how a layer runs depends on the EP degree and on the busiest rank's load,
which the solve does not know. So per config this swaps what the units' times hold for their MoE
layers (`unit_experts.UnitExperts`) for `cost_models.moe_cost`'s price on the busiest rank of the
EP group: E/ep experts a layer, their GEMMs at that rank's load (`load_factor`: the imbalance over
the mean, capped by a capacity factor), a dispatch and a combine all-to-all per pass over the EP
group; that rank keeps its load's share of the routed activations and holds E/ep of each layer's
expert weights, split from the dense parameters so `evaluate.py` can count and sync them apart
(`rank_params`: one pipeline rank's parameters, dense and experts').

Its own module: this is the one place a config's ep changes a unit's figures; `evaluate.py`
composes a step from whatever figures it is given (pipeline cuts, memory, sync, schedule) and reads
these in place of the units' own.

Input: the units' `UnitCost`s and `UnitExperts` records (one per unit, None without MoE layers),
the config, the cluster, its compute model and the routing imbalance. Output: a `UnitFigures`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.moe_cost import all_to_all_time, experts_time, load_factor
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.unit_costs import UnitCost
from mplan.planner.unit_experts import UnitExperts


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitFigures:
    """Per unit, in order, what a config's expert parallelism changes of its `UnitCost` (`price_experts`)."""

    forward_s: list[float]
    backward_s: list[float]  # before recomputation
    weight_s: list[float]  # the weight-gradient part of backward_s
    saved_bytes: list[float]
    selective_bytes: list[float]
    dense_params: list[int]  # the parameters but the experts'
    expert_params: list[int]  # the expert parameters a rank holds (E/ep of each layer)
    glue_params: list[tuple[tuple[str, int], ...]]  # `UnitCost.glue_params`, expert weights E/ep
    a2a_pass_s: list[float]  # one pass's dispatches and combines (forward, or backward), one micro-batch
    experts_per_rank: int  # the fewest experts a layer puts on a rank; 0 without MoE layers


@dataclass(frozen=True, slots=True, kw_only=True)
class _LayersPrice:
    """One unit's MoE layers at a config: their seconds per micro-batch, and what they keep."""

    forward_s: float  # expert GEMMs and one pass's all-to-all
    backward_s: float
    weight_s: float  # the weight-gradient part of backward_s
    a2a_pass_s: float
    extra_saved_bytes: float  # routed activations above the dropless balanced load's (negative below it)


def _layers_price(held: UnitExperts, config: ParallelConfig, cluster: ClusterSpec, compute: ComputeCostModel,
                  imbalance: float) -> _LayersPrice:
    ep_group = config.mesh.group_shape("ep", cluster.gpus_per_node)
    forward = backward = weight = a2a = extra = 0.0
    for layer, routed in zip(held.layers, held.routed_saved_bytes):
        capacity = config.capacity_factor if config.capacity_factor is not None else layer.capacity_factor
        load = load_factor(ep=config.ep, imbalance=imbalance, capacity_factor=capacity)
        gemms = experts_time(compute, layer, ep=config.ep, load=load)
        forward, backward, weight = forward + gemms.forward_s, backward + gemms.backward_s, weight + gemms.weight_s
        a2a += 2 * all_to_all_time(cluster, layer, ep_group, load=load)  # a dispatch and a combine
        extra += (load - 1.0) * routed
    return _LayersPrice(forward_s=forward + a2a, backward_s=backward + a2a, weight_s=weight, a2a_pass_s=a2a,
                        extra_saved_bytes=extra)


def price_experts(config: ParallelConfig, units: Sequence[UnitCost], experts: Sequence[UnitExperts | None],
                  cluster: ClusterSpec, compute: ComputeCostModel, imbalance: float) -> UnitFigures:
    """The units' figures with what their times hold for their MoE layers (priced by the TP solve
    for a rank that holds every expert) swapped for `cost_models.moe_cost`'s price at `config.ep`:
    the busiest EP rank's expert GEMMs under its load (`load_factor`: the imbalance, capped by the
    plan's capacity factor, else the layer's), and a dispatch and a combine per pass over the EP
    group. That rank holds E/ep experts a layer and keeps its load's share of the routed activations."""
    if experts and len(experts) != len(units):
        raise ValueError(f"experts must list one record (or None) per unit: {len(experts)} for {len(units)} units")
    figures = UnitFigures(
        forward_s=[u.forward_s for u in units], backward_s=[u.backward_s for u in units],
        weight_s=[u.weight_backward_s for u in units], saved_bytes=[u.saved_bytes for u in units],
        selective_bytes=[u.selective_bytes for u in units], dense_params=[u.num_params for u in units],
        expert_params=[0] * len(units), glue_params=[u.glue_params for u in units], a2a_pass_s=[0.0] * len(units),
        experts_per_rank=min((layer.num_experts for held in experts if held is not None for layer in held.layers),
                             default=0) // config.ep)
    prices: dict[int, _LayersPrice] = {}  # by the record's id: a block type's instances share one
    for i, (unit, held) in enumerate(zip(units, experts)):
        if held is None:
            continue
        if id(held) not in prices:
            prices[id(held)] = _layers_price(held, config, cluster, compute, imbalance)
        price = prices[id(held)]
        figures.forward_s[i] += price.forward_s - held.held_forward_s
        figures.backward_s[i] += price.backward_s - held.held_backward_s
        figures.weight_s[i] = min(figures.backward_s[i], max(0.0, unit.weight_backward_s - held.held_weight_s
                                                             + price.weight_s))
        figures.saved_bytes[i] = max(0.0, unit.saved_bytes + price.extra_saved_bytes)
        figures.selective_bytes[i] = max(0.0, unit.selective_bytes + price.extra_saved_bytes)
        figures.dense_params[i] -= held.expert_params
        figures.expert_params[i] = held.expert_params // config.ep
        figures.glue_params[i] = tuple((name, n // config.ep if name in held.expert_weights else n)
                                       for name, n in unit.glue_params)
        figures.a2a_pass_s[i] = price.a2a_pass_s
    return figures


def rank_params(units: Sequence[UnitCost], figures: UnitFigures, indices: Sequence[int]) -> tuple[int, int]:
    """Local parameters of the rank holding the units at `indices`, (dense, experts'): blocks add
    up, glue parameters count once (a tied embedding used by the prologue and the epilogue on the
    same rank is one tensor)."""
    glue: dict[str, int] = {}
    dense = experts = 0
    for u in indices:
        experts += figures.expert_params[u]
        if units[u].glue_params:
            glue.update(figures.glue_params[u])
            dense -= figures.expert_params[u]  # listed by name with the glue
        else:
            dense += figures.dense_params[u]
    return dense + sum(glue.values()), experts
