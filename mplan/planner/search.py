"""Outer search: every mesh, micro-batching, SP, recomputation, optimizer sharding and schedule.

Input: a captured `Graph` (shallow is enough: costs are per unit), a `ClusterSpec`, the global
batch and a `PlanSpec` (keys fixed by the user). Output: `SearchResult` with the best estimate
and the best rejected candidates, each with the reason it lost.

Steps:
1. for each TP degree and SP setting, solve the sharding ILP once per block type and glue segment
   (`sharding_ilp.solve_graph_sharding`) and price the units (`unit_costs`, and their MoE layers:
   `unit_experts`, which `evaluate` prices per expert-parallel degree) at every micro-batch size;
   cached, and done on a thread of its own ahead of step 2 (`_PricedAhead`);
2. enumerate configs (`parallel_config.enumerate_configs`, context parallelism's degrees and
   methods among them), evaluate each with the closed-form schedule model (cuts by
   `stage_partition` under memory; a cp config as one cp rank's units, `context_pricing`), drop
   those that do not fit; zero 0 and 1 first, then zero 2 and 3 only where they can still win
   (`_AboveOne`); cp > 1 after every cp = 1, in the order of a lower bound on their step, skipped
   once a plan that fits beats the bound (`_context_bound`) or where the replicas' parameters and
   optimizer state alone exceed the device (`_ReplicaState`), and a cp method another exchanges
   faster with less memory skipped (`_dominated`); a config (at zero 0, 2 or 3) whose state alone,
   at a floor no cut goes below, exceeds the device and every leanest rejected peak is skipped
   unpriced (`_never_fits`: its estimate would change nothing the search returns). Evaluations
   share what configs have in common: a rank's gradient sync and a chunk's seconds (`evaluate`'s
   memos, kept by the planner);
3. re-evaluate the best few with the event simulator and rank by simulated step time; a cp
   winner is priced under its other methods too, for `explain`;
4. for `explain`, the best plan's layout at every other ZeRO level (`zero_levels`), and whether any
   plan of the search fits below the chosen level.
"""
from __future__ import annotations

import heapq
import math
import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from types import TracebackType
from typing import Callable, Iterator, Sequence, TypeVar

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.dtypes import canonical_dtype
from mplan.ir.graph import Graph, OpNode
from mplan.ir.mesh import GroupShape
from mplan.ir.moe import experts_nodes, num_experts
from mplan.ir.rebatch import rebatch
from mplan.planner.context_pricing import (AttentionOp, ContextEstimate, Exchange, LinearGemm, TokenStatistic,
                                           attention_ops, linear_gemms, method_price, rank_experts, rank_units,
                                           replica_config, replica_facts, splits_loss, token_statistic_ops,
                                           whole_batch, with_context)
from mplan.ir.strategy import Strategy
from mplan.planner.evaluate import (NO_CUT_IN_MEMORY, ChunkMemo, Estimate, ModelFacts, SyncMemo, device_word,
                                    evaluate, gib_versus, state_floor_bytes)
from mplan.planner.fused_pricing import find_fp8_linears, find_fused_chains, find_fused_saves
from mplan.planner.host_cost import graph_priced, runtime_host
from mplan.planner.op_cost import OpCoster
from mplan.planner.parallel_config import (DEFAULT_RUNTIME, RUNTIMES, ZERO_LEVELS, ModelLimits, ParallelConfig,
                                           PlanSpec, PlanSpecError, context_methods, enumerate_configs, outer_refusal,
                                           outer_variants, site_variants, zero_variants)
from mplan.planner.plan import TP_LAYOUTS
from mplan.planner.spec_check import spec_refusal
from mplan.planner.sharding_ilp import (GraphSharding, ShardingInfeasible, StrategyFilter, reprice_graph,
                                        reprice_segment, stream_meta)
from mplan.planner.tp_layout import solve_tp_layout
from mplan.planner.unit_costs import UnitCost, unit_costs
from mplan.planner.unit_experts import UnitExperts, unit_experts

SIMULATED_FINALISTS = 8  # candidates re-ranked by the event simulator
REJECTED_KEPT = 5  # the leanest candidates that do not fit, kept for the explanation (`SearchResult.rejected`)
_Found = TypeVar("_Found")  # what `Planner._per_unit` finds in each unit (attention ops, linears)


class PlanningError(ValueError):
    """The request cannot be planned: names the cause and what would fit."""


@dataclass(slots=True)
class ShardedModel:
    """The model under one TP degree and SP setting: the sharding solved at one sequence per
    micro-batch, and unit costs re-priced for every micro-batch size asked for."""

    tp: int
    sp: bool
    coster: OpCoster
    shardings: dict[int, GraphSharding]  # by micro-batch size
    units: dict[int, list[UnitCost]]  # by micro-batch size
    experts: dict[int, tuple[UnitExperts | None, ...]]  # each unit's MoE layers, by micro-batch size

    @property
    def sharding(self) -> GraphSharding:
        """The sharding solved at one sequence per micro-batch."""
        return self.shardings[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroLevelResult:
    """One ZeRO level (and zero=3's keep_weights) beside the best plan: its layout at that level, and
    whether the search found any plan at that level or below it that fits."""

    zero: int
    keep_weights: bool
    same_layout: Estimate  # the best plan's config at this level (simulated)
    # the search's fastest plan that fits at this level, among those it evaluated (a level above 1 is
    # evaluated only where the level below does not fit); None where none did
    best_fitting: Estimate | None
    # whether the search found no fitting plan at any level below this one (it then evaluated this
    # level on every config it tried)
    nothing_fits_below: bool


@dataclass(slots=True)
class SearchResult:
    best: Estimate
    ranked: list[Estimate]  # feasible candidates, best first (the finalists simulated)
    rejected: list[Estimate]  # best infeasible ones, for the explanation
    sharded: dict[tuple[int, bool], ShardedModel]
    facts: ModelFacts
    num_candidates: int
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    # the ZeRO levels beside the best plan (`ZeroLevelResult`), by (zero, keep_weights); empty where
    # the best plan has dp = 1 or the search was held to one level
    zero_levels: dict[tuple[int, bool], ZeroLevelResult] = field(default_factory=dict)
    # the cp degree whose one rank's slice of each sequence the graph is (1: whole sequences)
    context_slice: int = 1


class Planner:
    """Caches per-(tp, sp) shardings of one graph on one cluster; evaluates and searches configs."""

    def __init__(self, graph: Graph, cluster: ClusterSpec, *, allow: StrategyFilter | None = None,
                 grad_dtype: str = "fp32", fp32_grad_copy: bool = True, kernels: bool = False,
                 fp8: bool = False, runtime: str = DEFAULT_RUNTIME, tp_layout: str = "ilp", moe_imbalance: float = 1.0,
                 progress: Callable[[str], None] | None = None, host_factor: float | None = None,
                 context_slice: int = 1, cuda_graphs: bool | None = None) -> None:
        """`moe_imbalance`: for MoE models, the token copies the busiest expert-parallel rank takes
        over the mean (1.0: uniform routing; `ModelFacts.moe_imbalance`). `host_factor`: host
        seconds per op over the bare ops' (None: the runtime's own, `host_cost.runtime_host`).
        `cuda_graphs`: whether the step's forwards and backwards replay as a CUDA graph, their ops
        then costing the host nothing (None: where autoparallel's default does, one rank on a GPU).
        `context_slice`: the cp degree whose one rank's slice of each sequence `graph` is (1: whole
        sequences); configs of another cp are refused, since the slice is what a cp plan is priced on
        (`context_pricing.py`)."""
        self.context_slice = context_slice
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
        if tp_layout not in TP_LAYOUTS:
            raise ValueError(f"tp_layout must be one of {TP_LAYOUTS}, got {tp_layout!r}")
        if not moe_imbalance >= 1:
            raise ValueError(f"moe_imbalance is the busiest expert-parallel rank's load over the mean, >= 1; "
                             f"got {moe_imbalance}")
        self.tp_layout = tp_layout
        self.dynamic = any(m.sym is not None for m in graph.graph_inputs.values())
        if not self.dynamic and graph.batch_size != 1:
            raise ValueError("the planner prices micro-batches from a graph captured with a dynamic batch, "
                             "or with a static batch of 1 (then micro-batch 1 only)")
        self.captured = graph
        self.graph = rebatch(graph, 1) if self.dynamic else graph
        self._at_batch: dict[int, Graph] = {1: self.graph}
        self.cluster = cluster
        self.graphed = graph_priced(cluster, runtime, host_factor, cuda_graphs)
        """whether the program's ops are priced as a CUDA graph's replay (no host time per op)"""
        self.host = runtime_host(cluster, runtime, host_factor, cuda_graphs=self.graphed)
        self.allow = allow
        # chains fuse_kernels will run as one kernel, priced so (names survive rebatching)
        self.fused = find_fused_chains(graph) if kernels else {}
        self.saves = find_fused_saves(graph) if kernels else {}
        self.fp8_linears = find_fp8_linears(graph) if fp8 else frozenset()
        self.progress = progress or (lambda _: None)
        self._sharded: dict[tuple[int, bool], ShardedModel] = {}
        self._context: dict[tuple[int, bool, int, int, str], tuple[list[UnitCost], list[tuple[Exchange, ...]]]] = {}
        self._attention_ops: dict[tuple[int, bool, int], list[tuple[AttentionOp, ...]]] = {}
        self._linear_gemms: dict[tuple[int, bool, int], list[tuple[LinearGemm, ...]]] = {}
        self._token_statistics: tuple[TokenStatistic, ...] | None = None
        self._dominated_methods: dict[tuple[int, bool, int, int, str], bool] = {}
        self._context_sums: dict[tuple[int, bool, int, int, str], tuple[float, float, float]] = {}
        self._syncs: SyncMemo = {}  # `evaluate`'s gradient syncs and optimizer steps, on this cluster
        self._chunks: dict[int, tuple[list[UnitCost], ChunkMemo]] = {}  # by id of a units list: it, its chunks
        self.facts = replace(_facts(self.graph), grad_dtype=grad_dtype, fp32_grad_copy=fp32_grad_copy,
                             mplan_adamw=kernels, runtime=runtime, moe_imbalance=moe_imbalance)
        self.limits = _limits(self.graph)

    def sharded(self, tp: int, sp: bool) -> ShardedModel:
        key = (tp, sp)
        if key not in self._sharded:
            group = GroupShape.from_mesh_axis(size=tp, stride=1, gpus_per_node=self.cluster.gpus_per_node)
            coster = OpCoster(self.cluster, tp, group, fused=self.fused, fp8_linears=self.fp8_linears,
                              saves=self.saves, host=self.host)
            self.progress(f"solving the sharding ILP for tp={tp}{' with SP' if sp else ''}")
            sharding = self._solve(self.graph, coster, sp)
            units = unit_costs(self.graph, sharding, coster)
            self._sharded[key] = ShardedModel(tp=tp, sp=sp, coster=coster, shardings={1: sharding}, units={1: units},
                                              experts={1: unit_experts(self.graph, sharding, coster, units)})
        return self._sharded[key]

    def units(self, tp: int, sp: bool, mbs: int) -> list[UnitCost]:
        """Unit costs at micro-batch `mbs`: the mbs=1 strategies re-priced on the rebatched graph, or,
        where a segment's strategy is not valid at that batch (a reshape that merges batch and
        sequence shards differently once the batch is more than one), that segment solved again
        with every other segment held to its mbs=1 strategies (solving all again lets the ILP, which
        does not price memory, trade the weights' sharding for a batch split)."""
        model = self.sharded(tp, sp)
        if mbs not in model.units:
            if mbs not in self._at_batch:
                self._at_batch[mbs] = rebatch(self.captured, mbs)
            graph = self._at_batch[mbs]
            try:
                sharding = reprice_graph(graph, model.sharding, model.coster)
            except ShardingInfeasible:
                sharding = self._solve(graph, model.coster, sp, keep=_still_valid(graph, model.sharding, model.coster))
            units = unit_costs(graph, sharding, model.coster)
            model.shardings[mbs] = sharding
            model.experts[mbs] = unit_experts(graph, sharding, model.coster, units)
            model.units[mbs] = units  # last: a priced mbs has its experts too (`_PricedAhead` runs this)
        return model.units[mbs]

    def _solve(self, graph: Graph, coster: OpCoster, sp: bool,
               keep: dict[str, tuple[object, ...]] | None = None) -> GraphSharding:
        allow = self.allow
        if keep:
            base = allow

            def allow(node: OpNode, strategy: Strategy) -> bool:  # type: ignore[no-redef]
                held = keep.get(node.name)
                return (base is None or base(node, strategy)) and (held is None or _strategy_id(strategy) == held)
        return solve_tp_layout(graph, coster, sp=sp, layout=self.tp_layout, allow=allow)

    def evaluate(self, config: ParallelConfig, *, fast: bool = False, **options: float) -> Estimate:
        if self.context_slice > 1 and config.cp != self.context_slice:
            raise PlanningError(f"this graph is one rank's slice of each sequence under cp={self.context_slice} "
                                f"(as autoparallel captures it): it prices cp={self.context_slice} only, not "
                                f"cp={config.cp}")
        units = self.units(config.tp, config.sp, config.mbs)
        experts = self.sharded(config.tp, config.sp).experts[config.mbs]
        if config.cp == 1:
            return evaluate(config, units, self.cluster, self.facts, experts=experts, fast=fast,
                            sync_memo=self._syncs, chunk_memo=self._chunk_memo(units), **options)
        # one cp rank, priced as dp * cp replicas of its units (`context_pricing`), its experts at its tokens
        whole = self.context_slice == 1
        if whole:
            batch = whole_batch(config.mbs, config.cp)
            experts = rank_experts(self.sharded(config.tp, config.sp).experts[batch],
                                   config.mbs / (config.cp * batch))
        ranked, exchanges = self.context_units(config)
        facts = replica_facts(self.facts, config.cp) if whole else self.facts
        replica = evaluate(replica_config(config), ranked, self.cluster, facts, experts=experts, fast=fast,
                           sync_memo=self._syncs, chunk_memo=self._chunk_memo(ranked), **options)
        return with_context(replica, config, method_price(config, exchanges, replica.stage_bounds))

    def _chunk_memo(self, units: list[UnitCost]) -> ChunkMemo:
        """`evaluate`'s chunk seconds of `units` (a list this planner keeps), kept across configs."""
        held = self._chunks.get(id(units))
        if held is None or held[0] is not units:
            held = self._chunks[id(units)] = (units, {})
        return held[1]

    def context_units(self, config: ParallelConfig) -> tuple[list[UnitCost], list[tuple[Exchange, ...]]]:
        """One cp rank's units under `config` and each unit's exchanges (`context_pricing.rank_units`),
        cached by (tp, sp, mbs, cp, method)."""
        key = (config.tp, config.sp, config.mbs, config.cp, config.cp_method)
        if key not in self._context:
            whole = self.context_slice == 1
            batch = whole_batch(config.mbs, config.cp) if whole else config.mbs
            units = self.units(config.tp, config.sp, batch)
            self._context[key] = rank_units(config, units, self._attention(config.tp, config.sp, batch),
                                            self.cluster, whole=whole, batch=batch,
                                            gemms=self._linears(config.tp, config.sp, batch) if whole else (),
                                            statistics=self._statistics(config.tp, config.sp, batch))
        return self._context[key]

    def _attention(self, tp: int, sp: bool, mbs: int) -> list[tuple[AttentionOp, ...]]:
        """Each unit's attention ops on one tp rank at micro-batch `mbs` (a block instance a shallow
        capture did not trace: its block type's)."""
        key = (tp, sp, mbs)
        if key not in self._attention_ops:
            self._attention_ops[key] = self._per_unit(tp, sp, mbs, attention_ops)
        return self._attention_ops[key]

    def _linears(self, tp: int, sp: bool, mbs: int) -> list[tuple[LinearGemm, ...]]:
        """Each unit's linears on one tp rank at micro-batch `mbs`, as `_attention` finds its attention."""
        key = (tp, sp, mbs)
        if key not in self._linear_gemms:
            self._linear_gemms[key] = self._per_unit(tp, sp, mbs, linear_gemms)
        return self._linear_gemms[key]

    def _statistics(self, tp: int, sp: bool, mbs: int) -> list[tuple[TokenStatistic, ...]]:
        """The loss's token statistics each unit computes (`context_pricing.token_statistic_ops`: their
        bytes do not depend on tp or the micro-batch; the units' order does)."""
        if self._token_statistics is None:
            self._token_statistics = token_statistic_ops(self.graph)
        held = self._token_statistics

        def computed(nodes: Sequence[OpNode], *_: object) -> tuple[TokenStatistic, ...]:
            names = {n.name for n in nodes}
            return tuple(s for s in held if s.node in names)
        return self._per_unit(tp, sp, mbs, computed)

    def _per_unit(self, tp: int, sp: bool, mbs: int,
                  find: Callable[..., tuple[_Found, ...]]) -> list[tuple[_Found, ...]]:
        """`find(nodes, choice, coster)` of each unit's nodes on one tp rank at micro-batch `mbs`."""
        model = self.sharded(tp, sp)
        graph = self._at_batch[mbs] if mbs in self._at_batch else self.graph
        choice = model.shardings[mbs].choice
        by_segment = {}
        for segment in graph.segments:
            names = segment.nodes or (graph.block_type(segment.block_type).template if segment.block_type else ())
            by_segment[segment.name] = find(graph.nodes_of(names), choice, model.coster)
        return [by_segment.get(u.name, ()) for u in model.units[mbs]]

    def _context_bound(self, config: ParallelConfig) -> float:
        """A lower bound on the step of a cp config: its rank's compute over one step, every pipeline
        rank as busy as the mean, with the fill 1F1B and interleaving cannot avoid (`evaluate`'s
        closed form: m micro-batches of the slowest rank, at least the mean, plus the other stages'
        F + B, or (pp - 1) / vpp of the slowest rank's; zb-h1's none), no gradient sync (`evaluate`
        adds those to the same units' seconds). The sums are cached by (tp, sp, mbs, cp, method)."""
        key = (config.tp, config.sp, config.mbs, config.cp, config.cp_method)
        if key not in self._context_sums:
            units, _ = self.context_units(config)
            self._context_sums[key] = (sum(u.forward_s for u in units), sum(u.backward_s for u in units),
                                       sum(u.selective_extra_s for u in units))
        forward, backward, selective = self._context_sums[key]
        rerun = {"none": 0.0, "selective": selective, "full": forward}[config.recompute]
        fill = 0.0 if config.schedule == "zb-h1" else (config.pp - 1) / config.vpp
        return (config.num_micro_batches + fill) * (forward + backward + rerun) / config.pp

    def _never_fits(self, config: ParallelConfig, limit: float, held: _ReplicaState) -> bool:
        """Whether `config`'s parameters, gradients and optimizer state alone, at their floor
        (`evaluate.state_floor_bytes`, on the units `evaluate` prices it on: a cp rank's for cp > 1),
        exceed `limit` (`_Leanest.limit`: the device, and the peak of every leanest candidate
        rejected so far), so that its estimate would neither fit nor be kept among the rejected:
        skipping it changes nothing the search returns. Not at zero=1, whose estimate bounds zero 2
        and 3's (`_AboveOne`), nor for MoE models (their experts' parameters move with ep); at cp = 1
        only where `held` takes the floor for the state its estimate would have recorded
        (`_ReplicaState.record_floor`)."""
        if config.zero == 1 or self.limits.num_experts or limit == math.inf:
            return False
        if config.cp == 1:
            floor = state_floor_bytes(config, self.units(config.tp, config.sp, config.mbs), self.facts)
            return floor > limit * (1 + _FLOOR_MARGIN) and held.record_floor(config, floor)
        whole = self.context_slice == 1
        units, _ = self.context_units(config)
        facts = replica_facts(self.facts, config.cp) if whole else self.facts
        return state_floor_bytes(replica_config(config), units, facts) > limit * (1 + _FLOOR_MARGIN)

    def _dominated(self, config: ParallelConfig, spec: PlanSpec) -> bool:
        """Whether another cp method at `config`'s tp, sp, micro-batch and cp exchanges no slower per
        micro-batch and holds no more, one of them strictly (it then prices no worse at any
        schedule and recomputation: the search skips this one); never where `spec` fixes the method.
        Cached by (tp, sp, mbs, cp, method)."""
        if config.cp == 1 or spec.cp_method is not None:
            return False
        key = (config.tp, config.sp, config.mbs, config.cp, config.cp_method)
        if key not in self._dominated_methods:
            def figures(method: str) -> tuple[float, float, float, float]:
                _, exchanges = self.context_units(replace(config, cp_method=method))
                flat = [e for ex in exchanges for e in ex]
                return (sum(e.forward_s for e in flat), sum(e.backward_s for e in flat),
                        sum(e.saved_bytes for e in flat), max((e.transient_bytes for e in flat), default=0.0))
            mine = figures(config.cp_method)
            others = [figures(m) for m in context_methods(config.tp, config.cp, self.limits, PlanSpec())
                      if m != config.cp_method]
            self._dominated_methods[key] = any(all(o <= a for o, a in zip(other, mine)) and other != mine
                                               for other in others)
        return self._dominated_methods[key]

    def search(self, global_batch: int, spec: PlanSpec | None = None, *,
               allow_cross_node_tp: bool = False, zero_levels: tuple[int, ...] = ZERO_LEVELS,
               inexact_ok: bool = False) -> SearchResult:
        """The fastest config that fits (module docstring); `zero_levels`: the ZeRO levels to
        search (those the runtime that will run the plan executes, `EXECUTABLE_ZERO`);
        `inexact_ok`: the user allows inexact training, so an outer loop across sites
        (`outer_variants`, priced by `outer_pricing`) competes with synchronous plans."""
        spec = spec or PlanSpec()
        if spec.outer_steps and self.cluster.num_sites == 1:
            raise PlanSpecError(f"plan spec {spec}: outer_steps={spec.outer_steps} averages over sites; cluster "
                                f"{self.cluster.name} has one site")
        start = time.perf_counter()
        world = self.cluster.world_size
        configs = list(enumerate_configs(world_size=world, gpus_per_node=self.cluster.gpus_per_node,
                                         global_batch=global_batch, limits=self.limits, spec=spec,
                                         allow_cross_node_tp=allow_cross_node_tp,
                                         max_mbs=8 if self.dynamic else 1, zero_levels=zero_levels,
                                         runtime=self.facts.runtime))
        if self.context_slice > 1:  # a slice graph prices its own cp only
            configs = [c for c in configs if c.cp == self.context_slice]
        # flat and hierarchical data parallelism where the cluster has sites
        configs = [v for c in configs for v in site_variants(c, self.cluster.num_sites, spec)]
        # an outer loop across sites only where the user allows inexact training (or the spec asks for one)
        configs = [v for c in configs for v in outer_variants(c, spec, inexact_ok)]
        if not configs:
            raise PlanningError(_no_config_reason(world, self.cluster.gpus_per_node, global_batch, self.limits,
                                                  spec, _ranks(self.cluster), model=self.graph.model_name,
                                                  allow_cross_node_tp=allow_cross_node_tp, zero_levels=zero_levels,
                                                  num_sites=self.cluster.num_sites))
        estimates = []
        above_one = _AboveOne()
        held = _ReplicaState(self.cluster.device.memory_bytes)
        leanest = _Leanest(self.cluster.device.memory_bytes)
        fastest = math.inf  # of the configs evaluated so far that fit
        # a cp rank is priced from the units of `whole_batch` sequences (`context_units`)
        whole = [(tp, sp, whole_batch(mbs, cp)) for tp, sp, mbs, cp in dict.fromkeys(
            (c.tp, c.sp, c.mbs, c.cp) for c in configs if c.cp > 1 and self.context_slice == 1)]
        with _PricedAhead(self.units, [(c.tp, c.sp, c.mbs) for c in configs] + whole) as priced:
            def ordered() -> Iterator[ParallelConfig]:
                """cp = 1 first, then cp > 1 (their units priced meanwhile), fastest lower bound first,
                none whose bound a fitting plan beats (`_context_bound`); at each, zero 0 and 1 first,
                then zero 2 and 3 where they can still win (`_AboveOne`)."""
                yield from (c for c in configs if c.zero <= 1 and c.cp == 1)
                yield from (c for c in configs if c.zero > 1 and c.cp == 1)
                for key in list(dict.fromkeys((c.tp, c.sp, c.mbs) for c in configs if c.cp > 1)) + whole:
                    priced.wait(*key)
                yield from sorted((c for c in configs if c.zero <= 1 and c.cp > 1), key=self._context_bound)
                yield from (c for c in configs if c.zero > 1 and c.cp > 1)
            for config in ordered():
                if not above_one.worth(config, fastest) or (config.cp > 1 and (
                        self._context_bound(config) >= fastest or held.over(config))):
                    continue
                priced.wait(config.tp, config.sp, config.mbs)
                if self._dominated(config, spec) or self._never_fits(config, leanest.limit(), held):
                    continue
                estimates.append(self.evaluate(config, fast=True))
                above_one.record(estimates[-1])
                held.record(estimates[-1])
                leanest.record(estimates[-1])
                if estimates[-1].fits:
                    fastest = min(fastest, estimates[-1].step_time_s)
        feasible = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time_s)
        infeasible = sorted((e for e in estimates if not e.fits), key=lambda e: e.peak_memory_bytes)
        if not feasible:
            raise PlanningError(_refusal(self.graph.model_name, self.cluster, global_batch, infeasible[0]))
        finalists = [self.evaluate(e.config, fast=False) for e in feasible[:SIMULATED_FINALISTS]]
        finalists.sort(key=lambda e: e.step_time_s)
        ranked = finalists + feasible[SIMULATED_FINALISTS:]
        ranked[0] = self._beside_other_methods(ranked[0])
        return SearchResult(best=ranked[0], ranked=ranked, rejected=infeasible[:REJECTED_KEPT], sharded=self._sharded,
                            facts=self.facts, num_candidates=len(configs), seconds=time.perf_counter() - start,
                            zero_levels=self._zero_levels(ranked[0], ranked, spec, zero_levels),
                            context_slice=self.context_slice)

    def _beside_other_methods(self, best: Estimate) -> Estimate:
        """A cp plan with the other methods' figures at its config (simulated), for `explain`."""
        if not isinstance(best, ContextEstimate):
            return best
        others = tuple(self.evaluate(replace(best.config, cp_method=m)).context  # type: ignore[attr-defined]
                       for m in context_methods(best.config.tp, best.config.cp, self.limits, PlanSpec())
                       if m != best.config.cp_method)
        return replace(best, others=others)

    def _zero_levels(self, best: Estimate, ranked: Sequence[Estimate], spec: PlanSpec,
                     levels: tuple[int, ...]) -> dict[tuple[int, bool], ZeroLevelResult]:
        """The best plan at every ZeRO level the search could choose (`ZeroLevelResult`); `ranked`:
        the search's fitting candidates, best first (the finalists simulated)."""
        if best.config.dp == 1 or spec.zero is not None or len(levels) < 2:
            return {}
        pairs = zero_variants(best.config, levels, self.facts.runtime, dominated=True)
        # an outer loop runs at zero=0 only: its layout at another level is no plan
        pairs = [(z, k) for z, k in pairs if outer_refusal(replace(best.config, zero=z, keep_weights=k)) is None]
        fastest: dict[tuple[int, bool], Estimate] = {}
        for e in ranked:
            fastest.setdefault((e.config.zero, e.config.keep_weights), e)
        out = {}
        for zero, keep in pairs:
            config = replace(best.config, zero=zero, keep_weights=keep)
            same = best if config == best.config else self.evaluate(config, fast=False)
            out[(zero, keep)] = ZeroLevelResult(zero=zero, keep_weights=keep, same_layout=same,
                                                best_fitting=fastest.get((zero, keep)),
                                                nothing_fits_below=not any(z < zero for z, _ in fastest))
        return out


_FLOOR_MARGIN = 1e-9
"""Relative margin `_never_fits` leaves its floor: it adds the parameters in another order than the
ranks' figures do, which moves it by far less."""


class _ReplicaState:
    """cp configs whose parameters, gradients and optimizer state alone exceed the device. A cp
    config is priced as dp * cp replicas (`context_pricing.replica_config`), so it holds what the
    config without cp at dp * cp replicas holds of them, at any micro-batch and recomputation; the
    least any such config evaluated held on its fullest pipeline rank stands for it (stage cuts
    move with activations, which a cp rank holds fewer of, so this is the cut that suited them).
    Interleaving (vpp) and the schedule leave a rank the same layers, so a twin at another vpp
    stands for it too, but only past `OTHER_VPP_MARGIN` of the device: the glue units (embedding,
    head) may fall on other ranks there. Without it gpt3-175b's search priced 700 interleaved cp
    configs whose state alone was 4-8x the device, their twins at vpp=1 having been evaluated."""

    OTHER_VPP_MARGIN = 1.25

    def __init__(self, capacity_bytes: float) -> None:
        self._capacity = capacity_bytes
        self._least: dict[tuple[object, ...], float] = {}  # replica layout -> bytes
        self._least_any_vpp: dict[tuple[object, ...], float] = {}

    @staticmethod
    def _key(config: ParallelConfig, replicas: int) -> tuple[object, ...]:
        return (replicas, config.tp, config.pp, config.zero, config.keep_weights, config.sites, config.outer_steps)

    def record(self, estimate: Estimate) -> None:
        config = estimate.config
        if config.cp == 1:
            self._record(config, max(m.params_bytes + m.grads_bytes + m.optimizer_bytes for m in estimate.memory))

    def record_floor(self, config: ParallelConfig, floor_bytes: float) -> bool:
        """Record a cp = 1 config the search does not price at its state's floor (at most the state
        its estimate holds, `evaluate.state_floor_bytes`), where `over` then answers as the state
        would: a floor above `OTHER_VPP_MARGIN` of the device is above both of its bars, as the state
        is, and a minimum it lowers stays above them. Returns whether it was recorded."""
        if floor_bytes <= self._capacity * self.OTHER_VPP_MARGIN * (1 + _FLOOR_MARGIN):
            return False
        self._record(config, floor_bytes)
        return True

    def _record(self, config: ParallelConfig, state: float) -> None:
        key = self._key(config, config.dp)
        self._least[(*key, config.vpp)] = min(state, self._least.get((*key, config.vpp), math.inf))
        self._least_any_vpp[key] = min(state, self._least_any_vpp.get(key, math.inf))

    def over(self, config: ParallelConfig) -> bool:
        key = self._key(config, config.dp * config.cp)
        return (self._least.get((*key, config.vpp), 0.0) > self._capacity
                or self._least_any_vpp.get(key, 0.0) > self._capacity * self.OTHER_VPP_MARGIN)


class _Leanest:
    """The peaks of the `REJECTED_KEPT` leanest estimates that do not fit so far, which the
    search returns for the explanation. A config that peaks above all of them and the device
    changes neither what fits nor what is rejected: `limit` is the least it must exceed (infinite
    until that many were rejected)."""

    def __init__(self, capacity_bytes: float) -> None:
        self._capacity = capacity_bytes
        self._peaks: list[float] = []  # negated: the largest of the leanest first

    def record(self, estimate: Estimate) -> None:
        if not estimate.fits:
            heapq.heappush(self._peaks, -estimate.peak_memory_bytes)
            if len(self._peaks) > REJECTED_KEPT:
                heapq.heappop(self._peaks)

    def limit(self) -> float:
        return max(self._capacity, -self._peaks[0]) if len(self._peaks) == REJECTED_KEPT else math.inf


class _AboveOne:
    """Which configs at zero 2 and 3 the search evaluates. They add DP traffic to save memory
    (`evaluate`): zero=2 moves zero=1's reduce-scatter into every micro-batch's backward, zero=3
    adds gathers to zero=2's. zero=3 is no faster than zero=2 for the same config (up to zero=2's
    gather after the step, which the host's pace may hide behind zero=3's: 0.1% of a small
    model's step here), nor is zero=2 than zero=1 in one stage (zero=1 overlaps its reduce-scatter
    with the last backward); under mplan's pipeline zero=2 can be: zero=1 reduces at the step,
    exposed, zero=2 under every backward. So a level is skipped where the level below fits (zero=3
    always, zero=2 in one stage: it would fit too and be no faster), or where a lower bound on its
    step from the same config at zero=1 (`_zero1_bound`) is no faster than a plan found to fit."""

    def __init__(self) -> None:
        self._fits: dict[tuple[tuple[object, ...], int], bool] = {}  # (config but its ZeRO, zero) -> fits
        self._bound: dict[tuple[object, ...], float] = {}  # config but its ZeRO -> zero=1's lower bound, seconds

    # the config's every field but its ZeRO level and keep_weights, read at C speed: a search asks
    # for tens of thousands
    _base = staticmethod(operator.attrgetter(*(f.name for f in fields(ParallelConfig)
                                               if f.name not in ("zero", "keep_weights"))))

    def record(self, estimate: Estimate) -> None:
        config, base = estimate.config, self._base(estimate.config)
        if not config.keep_weights:
            self._fits[(base, config.zero)] = estimate.fits
        if config.zero == 1:
            self._bound[base] = _zero1_bound(estimate)

    def worth(self, config: ParallelConfig, fastest_fitting_s: float) -> bool:
        if config.zero <= 1:
            return True
        base = self._base(config)
        below_fits = self._fits.get((base, config.zero - 1), False)
        if below_fits and (config.zero == 3 or config.pp == 1) or self._bound.get(base, 0.0) >= fastest_fitting_s:
            self._fits[(base, config.zero)] = below_fits  # it would fit too where the level below does
            return False
        return True


def _zero1_bound(estimate: Estimate) -> float:
    """A lower bound on the step of `estimate`'s config at zero 2 or 3, from its estimate at zero=1.
    One stage, a pipeline cut for time alone (no cut fits its memory) or one that fits: zero=1's
    step less its gradient sync, as zero 2/3 run the same compute with more collectives inside it,
    on the same cut, a no faster one, or (where zero=1 fits) one that zero 2/3's spare memory may
    balance better, which this leaves out (nearly a bound there). Else zero=1's compute over the
    ranks as the schedule's closed form (`evaluate._closed_form`) can do no better than: every
    rank as busy as the mean, 1F1B's fill of one micro-batch's way down and back, interleaved's
    (p - 1)/v of a rank's chunk, none for ZB-H1."""
    config = estimate.config
    if config.pp == 1 or estimate.reason == NO_CUT_IN_MEMORY or estimate.fits:
        return estimate.step_time_s - max(estimate.grad_sync_s, default=0.0)
    total = sum(estimate.chunk_forward_s) + sum(estimate.chunk_backward_s)
    m, p = config.num_micro_batches, config.pp
    fill = {"1f1b": p - 1.0, "gpipe": p - 1.0, "interleaved": (p - 1.0) / config.vpp}.get(config.schedule, 0.0)
    return (m + fill) * total / p


UnitsKey = tuple[int, bool, int]  # (tp, sp, micro-batch size)


class _PricedAhead:
    """`Planner.units` of every (tp, sp, mbs) a search needs, one after the other in the order of
    its first config, on a thread of its own, while the search evaluates the configs of those
    already priced: HiGHS solves without holding the GIL, so where a second core is free the
    sharding ILPs run beside the closed-form evaluations (llama3-8b at 8192 tokens on 64 H100s:
    2.2-2.9 s of ILPs, 1.3 s of evaluations). Each key is priced as a search in one thread prices
    it, in the same order, so the results are the same; the search reads a key's units only once
    they are priced (`wait`), and an error raised pricing a key is raised there, where a search in
    one thread would have raised it. `progress` messages come from that thread."""

    def __init__(self, price: Callable[[int, bool, int], object], needed: Sequence[UnitsKey]) -> None:
        self._price = price
        self._keys = list(dict.fromkeys(needed))
        self._priced = {key: threading.Event() for key in self._keys}
        self._errors: dict[UnitsKey, BaseException] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mplan-price-units")

    def __enter__(self) -> _PricedAhead:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()  # the search failed or was interrupted: price nothing more
        self._thread.join()

    def _run(self) -> None:
        for key in self._keys:
            if self._stop.is_set():
                break
            try:
                self._price(*key)
            except BaseException as error:  # raised by `wait`, on the search's thread
                self._errors[key] = error
                break
            finally:
                self._priced[key].set()
        for event in self._priced.values():  # keys left unpriced: a search that reaches one prices it itself
            event.set()

    def wait(self, tp: int, sp: bool, mbs: int) -> None:
        """Return once the units of (tp, sp, mbs) are priced; raise what pricing them raised."""
        key = (tp, sp, mbs)
        self._priced[key].wait()
        if key in self._errors:
            raise self._errors[key]


def _strategy_id(strategy: Strategy) -> tuple[object, ...]:
    return (strategy.name, strategy.inputs, strategy.output, strategy.input_grads)


def _still_valid(graph: Graph, sharding: GraphSharding, coster: OpCoster) -> dict[str, tuple[object, ...]]:
    """The strategies of `sharding` (solved at another batch) of every segment whose strategies all
    exist on `graph`, by node."""
    keep: dict[str, tuple[object, ...]] = {}
    segments = [(bt.name, bt.template, sharding.segments[bt.name].choice) for bt in graph.block_types]
    segments += [(s.name, s.nodes, sharding.choice) for s in graph.segments if s.block_type is None and s.nodes]
    for name, nodes, choice in segments:
        try:
            reprice_segment(graph, name, nodes, choice, coster, sharding.boundary)
        except ShardingInfeasible:
            continue
        keep.update({n: _strategy_id(choice[n]) for n in nodes})
    for seg in graph.segments:  # every traced instance holds its block type's strategies
        if seg.block_type and seg.nodes and graph.block_type(seg.block_type).template[0] in keep:
            template = graph.block_type(seg.block_type).template
            keep.update({n: keep[t] for n, t in zip(seg.nodes, template)})
    return keep


def _ranks(cluster: ClusterSpec) -> str:
    """The cluster's devices, plural, as messages name them."""
    return device_word(cluster.device.name) + "s"


def _refusal(model_name: str, cluster: ClusterSpec, global_batch: int, leanest: Estimate) -> str:
    """Why no plan of a search runs, from its leanest candidate: what does not fit a device and by
    how much, and what to change; or, for a plan refused for another reason, that reason alone (its
    memory figures are of a stand-in cut then, and more devices are not what it needs)."""
    have = cluster.device.memory_bytes
    on = (f"{cluster.world_size} x {cluster.device.name} ({have / 2**30:.0f} GiB each) at global batch "
          f"{global_batch}")
    plan = f"the leanest plan ({leanest.config.short()})"
    if not leanest.short_of_memory:
        return f"{model_name} cannot run on {on}: {plan} {leanest.reason}, which is not a matter of memory."
    return f"{model_name} does not fit on {on}: even {plan} {leanest.reason}. {_what_would_fit(leanest, cluster)}"


def _what_would_fit(estimate: Estimate, cluster: ClusterSpec) -> str:
    need = estimate.peak_memory_bytes
    have = cluster.device.memory_bytes
    if need <= 0 or have <= 0:
        return ""
    device = device_word(cluster.device.name)
    hint = "a smaller --global-batch" + ("" if estimate.config.recompute == "full" else
                                         ", or --spec recompute=full")
    if need <= have:  # the whole peak is within a device: what does not fit is a pipeline chunk
        k = estimate.config.pp * estimate.config.vpp
        return (f"Its busiest {device} would hold {need / 2**30:.2f} GiB of the {have / 2**30:.2f} GiB it has, "
                f"but no cut of its units into {k} pipeline chunk{'s' if k > 1 else ''} keeps each chunk under "
                f"that once the allocator's margin is set aside: try more {device}s (--nodes {cluster.num_nodes + 1}) or {hint}.")
    times = math.ceil(need / have)
    return f"About {times}x the {device}s would hold it: try --nodes {cluster.num_nodes * times} or {hint}."


def _no_config_reason(world: int, gpus_per_node: int, global_batch: int, limits: ModelLimits,
                      spec: PlanSpec, ranks: str = "GPUs", *, model: str = "the model",
                      allow_cross_node_tp: bool = False, zero_levels: tuple[int, ...] = ZERO_LEVELS,
                      num_sites: int = 1) -> str:
    """Why a spec admits no config, quoting the spec as written (`tp=8,pp=4`) and the arithmetic
    that fails (`tp x pp = 8 x 4 = 32 > 8 GPUs`): `spec_check`'s reason on the graph's figures, the
    same sentence a check before the capture gives; `ranks` names the cluster's devices."""
    reason = spec_refusal(spec, world_size=world, gpus_per_node=gpus_per_node, global_batch=global_batch,
                          model=model, num_layers=limits.num_layers, num_heads=limits.num_heads,
                          num_experts=limits.num_experts, allow_cross_node_tp=allow_cross_node_tp, ranks=ranks,
                          zero_levels=zero_levels, num_sites=num_sites)
    return reason or (f"no split of {world} {ranks} fits plan spec {str(spec)!r} (global batch {global_batch}, "
                      f"{limits.num_heads} heads, {limits.num_layers} layers)")


def _limits(graph: Graph) -> ModelLimits:
    heads = kv = 1
    for node in graph.nodes:
        if node.kind == "attention" and len(node.input_metas) >= 2:
            heads, kv = node.input_metas[0].shape[1], node.input_metas[1].shape[1]
            break
        if node.kind == "matmul" and not node.params and len(node.input_metas) == 2 and \
                len(node.input_metas[0].shape) == 4:  # attention written out: [b, heads, s, d] @ [b, heads, d, s]
            heads = kv = node.input_metas[0].shape[1]
            break
    # experts from the graph's MoE layers (their `moe_experts` ops), never from parameter names
    return ModelLimits(num_layers=graph.num_layers, num_heads=heads, num_kv_heads=kv,
                       num_experts=num_experts(graph), seq_len=graph.seq_len or 1, splits_loss=splits_loss(graph),
                       capacity_limited=any(e.capacity_factor is not None for e in experts_nodes(graph)))


def _param_dtype(graph: Graph) -> str:
    """The dtype most of the parameters' elements are in, which they, their gradients and ZeRO's
    gathers take in the runtime (bf16 where the capture holds no parameter)."""
    elements: Counter[str] = Counter()
    for info in graph.params.values():
        elements[canonical_dtype(info.meta.dtype)] += info.meta.numel
    return elements.most_common(1)[0][0] if elements else "bf16"


def _facts(graph: Graph) -> ModelFacts:
    stream = stream_meta(graph)
    return ModelFacts(training_flops_per_sequence=graph.training_flops / graph.batch_size,
                      seq_len=graph.seq_len or 1, param_dtype=_param_dtype(graph),
                      stream_bytes_per_sequence=0 if stream is None else stream.nbytes // graph.batch_size)


__all__ = ["Planner", "PlanningError", "PlanSpecError", "SearchResult", "ShardedModel"]
