"""Turn a search result into a `Plan`: stages, per-parameter placements, op strategies, figures.

The TP strategy of every op is stored under its stable key (`OpNode.key`): block types once (the
first traced instance's nodes stand for every instance), glue segments by name (`Plan.ops`).
Parameters of block instances a shallow capture did not trace take the placements of the first
instance; a tied parameter is listed under each of its names. Each op's price in the sharding
ILP's objective at the plan's micro-batch is kept under the same keys (`Plan.op_costs`), so
`mplan explain` shows per-op costs without pricing anything again; so are the ZeRO levels the
search weighed (`Plan.zero_levels`, from `SearchResult.zero_levels`).
"""
from __future__ import annotations

from collections.abc import Mapping

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.blocks import relative_name
from mplan.ir.graph import Graph
from mplan.ir.graph_hash import graph_hash
from mplan.ir.moe import expert_parameters
from mplan.ir.strategy import Strategy
from mplan.planner.context_pricing import ContextEstimate
from mplan.planner.evaluate import Estimate
from mplan.planner.parallel_config import DEFAULT_RUNTIME
from mplan.planner.dp_sync import LinkUse
from mplan.planner.plan import (Alternative, ClusterInfo, LinkTraffic, Mesh, ModelInfo, OpCost, Plan, Predicted, Stage,
                                StageMemory, ZeroLevel)
from mplan.planner.search import SearchResult, ShardedModel
from mplan.planner.sharding_ilp import GraphSharding, SegmentSharding

GiB = float(1 << 30)


def op_table(graph: Graph, choice: Mapping[str, Strategy]) -> dict[str, dict[str, str]]:
    """`Plan.ops` for `choice` on `graph`: {segment key: {node key: strategy text}}."""
    ops: dict[str, dict[str, str]] = {}
    for bt in graph.block_types:
        ops[bt.name] = {graph.node(n).key: str(choice[n]) for n in bt.template}
    for segment in graph.segments:
        if segment.block_type is None and segment.nodes:
            ops[segment.name] = {graph.node(n).key: str(choice[n]) for n in segment.nodes}
    return ops


def op_cost_table(graph: Graph, sharding: GraphSharding) -> dict[str, dict[str, OpCost]]:
    """`Plan.op_costs`: what each segment's ILP charged each of its ops, keyed as `op_table` keys
    the strategies (a block type by its first traced instance's nodes)."""
    def costs(segment: SegmentSharding, nodes: tuple[str, ...]) -> dict[str, OpCost]:
        return {graph.node(n).key: OpCost(compute_ms=p.compute_s * 1e3, comm_ms=p.comm_s * 1e3,
                                          reshard_ms=p.reshard_s * 1e3)
                for n in nodes if (p := segment.op_prices.get(n)) is not None}
    table = {bt.name: costs(sharding.segments[bt.name], bt.template) for bt in graph.block_types}
    for segment in graph.segments:
        if segment.block_type is None and segment.nodes:
            table[segment.name] = costs(sharding.segments[segment.name], segment.nodes)
    return {name: entries for name, entries in table.items() if entries}


def predicted_of(estimate: Estimate) -> Predicted:
    memory = tuple(StageMemory(stage=r, params_gib=m.params_bytes / GiB, grads_gib=m.grads_bytes / GiB,
                               optimizer_gib=m.optimizer_bytes / GiB, activations_gib=m.activations_bytes / GiB,
                               transient_gib=m.transient_bytes / GiB, total_gib=m.total_bytes / GiB)
                   for r, m in enumerate(estimate.memory))
    return Predicted(step_time_s=estimate.step_time_s, tflops_per_gpu=estimate.tflops_per_gpu, mfu=estimate.mfu,
                     tokens_per_s=estimate.tokens_per_s, bubble_fraction=estimate.bubble_fraction,
                     memory_gib=estimate.peak_memory_bytes / GiB, memory_by_stage=memory,
                     compute_s=estimate.compute_s, comm_s=estimate.comm_s, p2p_s=estimate.p2p_s,
                     optimizer_s=estimate.optimizer_s, a2a_s=estimate.a2a_s,
                     experts_per_rank=estimate.experts_per_rank, moe_imbalance=estimate.moe_imbalance,
                     zero_comm_s=estimate.zero_comm_s, dp_links=_link_traffic(estimate.dp_links))


def _link_traffic(links: LinkUse) -> LinkTraffic | None:
    """`Predicted.dp_links` (GB and seconds); None where the plan moves nothing between ranks."""
    if not (links.intra_node_bytes or links.inter_node_bytes or links.inter_site_bytes):
        return None
    return LinkTraffic(intra_node_gb=links.intra_node_bytes / 1e9, inter_node_gb=links.inter_node_bytes / 1e9,
                       inter_site_gb=links.inter_site_bytes / 1e9, intra_node_s=links.intra_node_s,
                       inter_node_s=links.inter_node_s, inter_site_s=links.inter_site_s)


def zero_levels_of(result: SearchResult) -> tuple[ZeroLevel, ...]:
    """`Plan.zero_levels`: each ZeRO level the search weighed beside its best plan, in level order."""
    return tuple(ZeroLevel(zero=level.zero, keep_weights=level.keep_weights, spec=level.same_layout.config.spec(),
                           fits=level.same_layout.fits, step_time_s=level.same_layout.step_time_s,
                           memory_gib=level.same_layout.peak_memory_bytes / GiB,
                           zero_comm_s=level.same_layout.zero_comm_s,
                           best_spec=None if level.best_fitting is None else level.best_fitting.config.spec(),
                           best_step_time_s=None if level.best_fitting is None else level.best_fitting.step_time_s,
                           nothing_fits_below=level.nothing_fits_below)
                 for level in result.zero_levels.values())


def _why_lost(best: Estimate, other: Estimate) -> str:
    if not other.fits:
        return other.reason
    slower = (other.step_time_s - best.step_time_s) * 1e3
    parts = [f"{slower:.0f} ms slower per step ({other.step_time_s / best.step_time_s - 1:+.1%})"]
    if other.bubble_fraction > best.bubble_fraction + 0.01:
        parts.append(f"bubble {other.bubble_fraction:.1%} vs {best.bubble_fraction:.1%}")
    if other.comm_s > best.comm_s * 1.05:
        parts.append(f"comm {other.comm_s * 1e3:.0f} vs {best.comm_s * 1e3:.0f} ms")
    if other.compute_s > best.compute_s * 1.02:
        parts.append(f"compute {other.compute_s * 1e3:.0f} vs {best.compute_s * 1e3:.0f} ms")
    haul, best_haul = other.dp_links.inter_site_bytes, best.dp_links.inter_site_bytes
    if haul > best_haul * 1.05:
        parts.append(f"{haul / 1e9:.0f} GB a site over the long haul per step vs {best_haul / 1e9:.0f} GB "
                     f"({other.dp_links.inter_site_s:.1f} vs {best.dp_links.inter_site_s:.1f} s on the link)")
    return "; ".join(parts)


def _diverse(ranked: list[Estimate], best: Estimate, meshes: int = 4) -> list[Estimate]:
    """The best candidate of each other mesh shape, then the best variant of the winning mesh; where
    the winner has cp > 1, the best plan without context parallelism among the meshes too, and
    where it runs DP hierarchically over sites, the best flat plan (sites=1); where it is inexact (an
    outer loop across sites), the best synchronous plan first, what `explain` weighs it against."""
    def mesh(e: Estimate) -> tuple[int, ...]:
        return (e.config.dp, e.config.tp, e.config.pp, e.config.vpp, e.config.cp, e.config.sites, e.config.outer_steps)
    seen, picked = {mesh(best)}, []
    exact = next((e for e in ranked if not e.config.inexact), None) if best.config.inexact else None
    without_cp = next((e for e in ranked if e.config.cp == 1), None) if best.config.cp > 1 else None
    flat = next((e for e in ranked if e.config.sites == 1), None) if best.config.sites > 1 else None
    for kept in (exact, without_cp, flat):
        if kept is not None and mesh(kept) not in seen:
            seen.add(mesh(kept))
            picked.append(kept)
    for e in ranked:
        if mesh(e) not in seen and len(picked) < meshes:
            seen.add(mesh(e))
            picked.append(e)
    variant = next((e for e in ranked if e is not best and mesh(e) == mesh(best)), None)
    return picked + ([variant] if variant else [])


def _param_placements(graph: Graph, model: ShardedModel, estimate: Estimate, units: list[str]) -> dict[str, dict[str, str]]:
    choice = model.shardings[estimate.config.mbs].choice
    tp_of: dict[str, str] = {}
    for node in graph.nodes:
        s = choice.get(node.name)
        for _, name in node.params:
            if s is not None:
                tp_of.setdefault(name, str(s.inputs[node.inputs.index(name)]))
    stage_of_unit = {}
    for index, (a, b) in enumerate(estimate.stage_bounds):
        for u in units[a:b]:
            stage_of_unit[u] = index
    segment_of = {p: seg.name for seg in graph.segments for n in graph.nodes_of(seg.nodes) for _, p in n.params}
    first_instances = {bt.instances[0]: bt for bt in graph.block_types}
    # stacked expert weights: dim 0 (the experts) split over the expert-parallel ranks
    experts = expert_parameters(graph) if estimate.config.ep > 1 else frozenset()
    placements: dict[str, dict[str, str]] = {}
    for name, info in graph.params.items():
        if info.block is None:
            pairs = [(name, segment_of.get(name, "prologue"))]
        elif info.block in first_instances:  # fan out to every instance of the block type
            rel = relative_name(name, info.block)
            pairs = [(f"{inst}.{rel}", inst) for inst in first_instances[info.block].instances]
        else:
            continue  # a later traced instance: covered by its block type's fan-out
        for target, unit in pairs:
            for alias in graph.names_of(target) if target in graph.params else (target,):
                placements[alias] = {"tp": tp_of.get(name, "R"), "dp": "R", "pp": str(stage_of_unit.get(unit, 0))}
                if name in experts:
                    placements[alias]["ep"] = "S(0)"
    return placements


def build_plan(result: SearchResult, graph: Graph, cluster: ClusterSpec, global_batch: int,
               best: Estimate | None = None, *, tp_layout: str = "ilp", runtime: str = DEFAULT_RUNTIME) -> Plan:
    best = best or result.best
    config = best.config
    model = result.sharded[(config.tp, config.sp)]
    units = [u.name for u in model.units[config.mbs]]
    choice = model.shardings[config.mbs].choice
    stages = tuple(Stage(index=i, rank=i % config.pp, units=tuple(units[a:b]),
                         forward_ms=best.chunk_forward_s[i] * 1e3, backward_ms=best.chunk_backward_s[i] * 1e3,
                         grad_sync_ms=best.grad_sync_s[i % config.pp] / config.vpp * 1e3,
                         weight_ms=best.chunk_weight_s[i] * 1e3)
                   for i, (a, b) in enumerate(best.stage_bounds))
    ops = op_table(graph, choice)
    op_costs = op_cost_table(graph, model.shardings[config.mbs])
    alternatives = tuple(Alternative(spec=e.config.spec(), predicted=predicted_of(e) if e.fits else None,
                                     why=_why_lost(best, e))
                         for e in [*_diverse(result.ranked, best), *result.rejected[:2]])
    return Plan(
        model=ModelInfo(name=graph.model_name, num_parameters=graph.num_parameters, num_layers=graph.num_layers,
                        # a slice graph (`api` under cp) holds S / cp tokens of each sequence
                        seq_len=(graph.seq_len or 1) * result.context_slice, graph_hash=graph_hash(graph)),
        cluster=ClusterInfo(name=cluster.name, nodes=cluster.num_nodes, gpus_per_node=cluster.gpus_per_node,
                            world_size=cluster.world_size, device=cluster.device.name, figures=cluster.figures,
                            sites=cluster.num_sites, inter_site_gbps=cluster.sites.inter_site_gbps,
                            inter_site_latency_ms=cluster.sites.inter_site_latency_ms),
        mesh=Mesh(dp=config.dp, tp=config.tp, pp=config.pp, ep=config.ep, vpp=config.vpp, cp=config.cp,
                  cp_method=config.cp_method, sites=config.sites),
        sequence_parallel=config.sp, zero=config.zero, micro_batch_size=config.mbs,
        num_micro_batches=config.num_micro_batches, global_batch=global_batch, schedule=config.schedule,
        recompute=config.recompute, stages=stages, sharding=_param_placements(graph, model, best, units), ops=ops,
        predicted=predicted_of(best), alternatives=alternatives, tp_layout=tp_layout, runtime=runtime,
        capacity_factor=config.capacity_factor, head_loss_chunk_rows=best.head_chunk_rows, op_costs=op_costs,
        zero3_keep_weights=config.keep_weights, outer_steps=config.outer_steps, zero_levels=zero_levels_of(result) if best is result.best else (),
        planner={"search_seconds": round(result.seconds, 3), "candidates": result.num_candidates,
                 "capture_seconds": round(graph.capture_seconds, 3), **context_figures(best)})


CONTEXT_PREFIX = "context."
"""Plan.planner keys `context.<method>.<figure>`: a cp plan's exchange under each method weighed
(`context_pricing.MethodPrice`; `explain` shows them): exposed_s, link_s, held_gib, step_time_s,
memory_gib, fits (1 or 0)."""


def context_figures(estimate: Estimate) -> dict[str, float]:
    """`Plan.planner`'s `context.*` figures of a cp plan (`CONTEXT_PREFIX`); none for another."""
    if not isinstance(estimate, ContextEstimate):
        return {}
    out = {}
    for price in (estimate.context, *estimate.others):
        key = f"{CONTEXT_PREFIX}{price.method}."
        out.update({key + "exposed_s": price.exposed_s, key + "link_s": price.link_s,
                    key + "held_gib": price.held_bytes / GiB, key + "step_time_s": price.step_time_s,
                    key + "memory_gib": price.peak_bytes / GiB, key + "fits": float(price.fits)})
    return out
