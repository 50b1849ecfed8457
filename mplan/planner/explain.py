"""Why a plan won: the mesh, the stages and their layers, memory and time per stage, the per-op
sharding of one block, what each rejected alternative would have cost, why its ZeRO level won
(`Plan.zero_levels`: the plan's layout at every level, memory against the extra all-gathers and
reduce-scatters, and whether any plan fits below it), and for an MoE model its expert parallelism
(experts per rank, the load imbalance priced, the all-to-all's share of the step).

`explain_data(plan)` is plain data (for `--json`); `render(plan, console)` prints it as rich
tables, which also read fine as text without a terminal: ops named by module path and op, the
strategy notation explained once (NOTATION), the losers sorted by their gap to the plan, and the
headline bubble reconciled with each rank's idle time (warm-up, waits, cool-down) and the step
(pipeline + exposed DP sync + optimizer). Nothing is re-planned or re-priced: the op table shows
what the strategy text says (work split, the op's own collectives) and what the sharding ILP
priced each op at (`Plan.op_costs`: compute, communication, resharding; `-` for a plan written
before plans recorded them), added up and compared with the per-layer time of the plan's stages
(`_block_time`); `simulate_plan(plan)` re-runs the
schedule simulator on the plan's own stage times, the weight-gradient part of each backward
included (zero-bubble schedules run it as W), for the Gantt chart and per-rank figures.
"""
from __future__ import annotations

import re
from typing import Any

from mplan.cost_models.rates import flops_rate
from mplan.cost_models.simulator import PipelineCosts, SimResult, simulate
from mplan.ir.strategy import StrategyParseError, parse_strategy
from mplan.planner.evaluate import device_word, schedule_of
from mplan.planner.zero_pricing import ZERO_OVERLAP, ZeroOverlap
from mplan.planner.parallel_config import EXECUTABLE_ZERO, ParallelConfig
from mplan.planner.plan import Plan, ZeroLevel

RUNTIME_NAMES = {"mplan": "mplan's runtime", "megatron": "Megatron-LM's runtime (--runtime megatron)"}


NOTATION = (
    "notation of the strategy column (placements on the tensor-parallel axis):\n"
    "  name:lowering[input placements->output placement|input-gradient placements], one placement per tensor "
    "input, in the op's argument order\n"
    "  R replicated (whole on every rank); S(d) sharded along tensor dim d; P partial sum (each rank holds an "
    "addend, summed by an all-reduce or reduce-scatter)\n"
    "  '->' what the op needs -> what it produces; '|' then the placements its input gradients come out with "
    "in backward\n"
    "  a trailing * the op's work is split tp ways; {kind:bytes} the collectives the op issues itself (forward)\n"
    "  resharding: where a producer's output placement differs from what its consumer needs, the passes insert "
    "S->R all-gather, P->R all-reduce, P->S reduce-scatter, S(d)->S(e) all-to-all, R->S a free local slice")
"""The strategy text form of `mplan/ir/strategy.py` and the placements of `mplan/ir/placement.py`,
explained once above the per-op table."""

COSTS_NOTE = (
    "compute / comm / reshard ms: forward + backward of one micro-batch, as the sharding ILP priced the op under "
    "its strategy: its compute on local shapes (a chain priced as one fused kernel: all on its anchor op, 0 on "
    "the others); its own collectives (and its share of the TP all-reduce of "
    "partial parameter gradients); the resharding copies of its inputs (a copy several ops read is charged to "
    "the first, the block's output leaving in the boundary placement to its producer)")
"""What the cost columns of the per-op table hold (`sharding_ilp.OpPrice`), printed under it."""

COST_KEYS = ("compute_ms", "comm_ms", "reshard_ms")
COST_COLUMNS = ("compute ms", "comm ms", "reshard ms")
GLUE_SEGMENTS = ("prologue", "epilogue")


PREDICTION_BASIS = {
    "measured": "predicted from measured figures",
    "datasheet": "predicted from datasheet figures, not measured",
    "completed": "predicted from a measured profile too thin to price a model, its kernels from datasheet "
                 "figures (`mplan profile` without --quick measures them)",
    "nominal": "NOT a prediction for this machine: the cluster's figures are nominal placeholders "
               "(`mplan profile` measures real ones)",
    "unrecorded": "predicted, not measured",
}
"""What a predicted figure rests on, by `ClusterInfo.figures`: shown wherever one is printed, so
that a time priced from placeholders (the `cpu` preset's) is never read as a forecast."""


def prediction_basis(plan: Plan) -> str:
    return PREDICTION_BASIS.get(plan.cluster.figures, PREDICTION_BASIS["unrecorded"])


def _op_facts(key: str, text: str) -> dict[str, Any]:
    """Module path and op of a node key (`attn.q_proj:linear#0`), and what its strategy text says
    about cost without re-pricing: the work split or not, the op's own collectives (bytes, forward)."""
    module, _, op = key.rpartition(":")
    facts: dict[str, Any] = {"module": module, "op_name": op, "name": None, "lowering": None, "split": None,
                             "collectives": []}
    try:
        s = parse_strategy(text)
    except StrategyParseError:
        return facts
    facts.update(name=s.name, lowering=s.lowering, split=s.split,
                 collectives=[{"kind": kind, "bytes": nbytes} for kind, nbytes in s.comm])
    return facts


def _op_costs(plan: Plan, segment: str, key: str) -> dict[str, float | None]:
    """The op's priced costs from `plan.op_costs` (None each where the plan has none)."""
    cost = plan.op_costs.get(segment, {}).get(key)
    return {k: None if cost is None else getattr(cost, k) for k in COST_KEYS}


def _is_glue(segment: str) -> bool:
    return segment in GLUE_SEGMENTS or segment.startswith("glue")


def _stage_per_layer_ms(plan: Plan) -> tuple[float | None, str]:
    """The per-layer time the plan's stages give: their forward + backward (one micro-batch) less the
    priced ops of the glue units they hold (prologue, epilogue, glue.N), over their layers; with why
    it cannot be had (several block types share the layers, or a glue unit has no op costs)."""
    blocks = [segment for segment in plan.ops if not _is_glue(segment)]
    if len(blocks) != 1:
        return None, f"the layers are of {len(blocks)} block types"
    layers = sum(len(s.layers) for s in plan.stages)
    glue = [u for s in plan.stages for u in s.units if _is_glue(u)]
    if not layers or any(u not in plan.op_costs for u in glue):
        return None, "the plan has no op costs for its " + ("layers" if not layers else "prologue and epilogue")
    glue_ms = sum(c.total_ms for u in glue for c in plan.op_costs[u].values())
    return (sum(s.forward_ms + s.backward_ms for s in plan.stages) - glue_ms) / layers, ""


def _difference_why(plan: Plan, difference_ms: float, total_ms: float) -> str:
    """What the stages add to the block's priced ops, from the plan's settings (evaluate.py)."""
    if abs(difference_ms) <= 1e-6 * max(total_ms, 1e-9):
        return "none: the stage times are these ops' prices added up"
    reasons = []
    if plan.recompute == "selective":
        reasons.append("recompute=selective re-runs the forward of the block's norms and elementwise ops and its "
                       "reshards in backward")
    elif plan.recompute == "full":
        reasons.append("recompute=full re-runs the block's whole forward in backward")
    if plan.predicted.experts_per_rank:
        reasons.append(f"the stage times price the experts at ep={plan.mesh.ep} (GEMMs at the busiest rank's load, "
                       f"all-to-all), the ILP every expert local")
    if plan.schedule == "zb-h1" and plan.mesh.pp > 1:
        reasons.append("zb-h1 charges each weight-gradient pass at least the host time of issuing it")
    if difference_ms > 0 and not plan.planner.get("cuda_graphs_priced"):
        reasons.append("the host issues every op before the device can run it (planner/host_cost.py): the "
                       "stages add what the device does not hide of that time")
    return "; ".join(reasons) or "not accounted for by this plan's settings"


def _block_time(plan: Plan, block: str | None) -> dict[str, Any] | None:
    """The explained block's priced ops added up (forward + backward of one layer and one
    micro-batch) and compared with the per-layer time of the plan's stages (`_stage_per_layer_ms`);
    None for a plan without op costs for the block."""
    costs = plan.op_costs.get(block) if block is not None else None
    if not costs:
        return None
    totals = {k: sum(getattr(c, k) for c in costs.values()) for k in COST_KEYS}
    total = sum(totals.values())
    per_layer, missing = _stage_per_layer_ms(plan)
    difference = None if per_layer is None else per_layer - total
    return {**totals, "total_ms": total, "num_ops": len(costs), "stage_per_layer_ms": per_layer,
            "difference_ms": difference,
            "why": f"not compared with the stages' per-layer time: {missing}" if difference is None
            else _difference_why(plan, difference, total)}


def _rank_times(sim: SimResult) -> list[dict[str, Any]]:
    """Each pipeline rank's step: compute, and its idle time (pipeline time - compute) split into
    before its first op (warm-up), between ops (waits for a micro-batch or a gradient) and after its
    last op (cool-down); its DP gradient sync, and the part of it past the end of the pipeline."""
    pipeline = sim.pipeline_time_s
    first: dict[int, float] = {}
    for ev in sim.timeline:
        if ev.stream == "compute" and ev.rank not in first:
            first[ev.rank] = ev.start_s
    out = []
    for r in sorted(sim.ranks, key=lambda r: r.rank):
        lead = first.get(r.rank, 0.0)
        tail = max(pipeline - r.compute_end_s, 0.0)
        out.append({"rank": r.rank, "busy_ms": r.busy_s * 1e3, "idle_ms": r.idle_s * 1e3,
                    "grad_sync_ms": r.grad_sync_s * 1e3,
                    "idle_fraction": r.idle_s / pipeline if pipeline > 0 else 0.0,
                    "idle_share_of_step": r.idle_s / sim.step_time_s if sim.step_time_s > 0 else 0.0,
                    "warmup_ms": lead * 1e3, "cooldown_ms": tail * 1e3,
                    "between_ms": max(r.idle_s - lead - tail, 0.0) * 1e3,
                    "exposed_grad_sync_ms": max(r.grad_sync_end_s - pipeline, 0.0) * 1e3,
                    "critical": r.rank == sim.critical_rank})
    return out


_CP_WORDS = {"all_gather": "keys and values all-gathered", "ring": "keys and values passed around a ring",
             "all_to_all": "heads all-to-all (Ulysses)"}


def _context(plan: Plan) -> dict[str, dict[str, Any]]:
    """A cp plan's exchange under each method the planner weighed (`plan_builder.context_figures`),
    the plan's own first: exposed and link ms a step on the busiest rank, the exposed share of the
    step, GiB held for backward, and the plan's step and peak under that method."""
    prefix = "context."
    out: dict[str, dict[str, Any]] = {}
    for key, value in plan.planner.items():
        if key.startswith(prefix):
            method, figure = key.removeprefix(prefix).rsplit(".", 1)
            out.setdefault(method, {})[figure] = value
    step = plan.predicted.step_time_s
    order = sorted(out, key=lambda m: m != plan.mesh.cp_method)
    return {m: {"exposed_ms": out[m]["exposed_s"] * 1e3, "link_ms": out[m]["link_s"] * 1e3,
                "share_of_step": out[m]["exposed_s"] / out[m]["step_time_s"] if out[m]["step_time_s"] > 0 else 0.0,
                "held_gib": out[m]["held_gib"], "step_ms": out[m]["step_time_s"] * 1e3,
                "memory_gib": out[m]["memory_gib"], "fits": bool(out[m]["fits"]), "chosen": m == plan.mesh.cp_method}
            for m in order} if step > 0 else {}


def config_of(plan: Plan) -> ParallelConfig:
    m = plan.mesh
    return ParallelConfig(dp=m.dp, tp=m.tp, pp=m.pp, vpp=m.vpp, ep=m.ep, cp=m.cp, cp_method=m.cp_method,
                          mbs=plan.micro_batch_size,
                          num_micro_batches=plan.num_micro_batches, sp=plan.sequence_parallel, zero=plan.zero,
                          keep_weights=plan.zero3_keep_weights, recompute=plan.recompute, schedule=plan.schedule,
                          sites=m.sites, outer_steps=plan.outer_steps)


def simulate_plan(plan: Plan) -> SimResult:
    stages = sorted(plan.stages, key=lambda s: s.index)
    costs = PipelineCosts(forward_s=tuple(s.forward_ms / 1e3 for s in stages),
                          backward_s=tuple(s.backward_ms / 1e3 for s in stages),
                          p2p_s=(plan.predicted.p2p_s,) * (len(stages) - 1),
                          grad_sync_s=tuple(s.grad_sync_ms / 1e3 for s in stages),
                          optimizer_s=plan.predicted.optimizer_s, weight_s=tuple(s.weight_ms / 1e3 for s in stages))
    return simulate(schedule_of(config_of(plan)), costs)


def _span(units: tuple[str, ...]) -> str:
    """`prologue, layers.0 .. layers.11` instead of twelve names."""
    out, run = [], []
    for u in units + ("",):
        m = re.match(r"^(.*)\.(\d+)$", u)
        if m and run and run[-1][0] == m.group(1) and run[-1][1] + 1 == int(m.group(2)):
            run.append((m.group(1), int(m.group(2))))
            continue
        if run:
            out.append(f"{run[0][0]}.{run[0][1]}" if len(run) == 1 else
                       f"{run[0][0]}.{run[0][1]}-{run[-1][1]}")
            run = []
        if m:
            run = [(m.group(1), int(m.group(2)))]
        elif u:
            out.append(u)
    return ", ".join(out)


def explain_data(plan: Plan) -> dict[str, Any]:
    sim = simulate_plan(plan)
    ranks = {r.rank: r for r in sim.ranks}
    memory = {m.stage: m for m in plan.predicted.memory_by_stage}
    stages = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        mem = memory.get(s.rank)
        stages.append({"stage": s.index, "rank": s.rank, "layers": _span(s.units), "num_layers": len(s.layers),
                       "forward_ms": s.forward_ms, "backward_ms": s.backward_ms, "weight_ms": s.weight_ms,
                       "grad_sync_ms": s.grad_sync_ms,
                       "memory_gib": None if mem is None else {
                           "params": mem.params_gib, "grads": mem.grads_gib, "optimizer": mem.optimizer_gib,
                           "activations": mem.activations_gib, "transient": mem.transient_gib, "total": mem.total_gib}})
    per_rank = _rank_times(sim)
    main = max(plan.ops, key=lambda k: len(plan.ops[k])) if plan.ops else None
    block_ops = [] if main is None else [{"index": i, "op": op, "strategy": s, **_op_facts(op, s),
                                          **_op_costs(plan, main, op)}
                                         for i, (op, s) in enumerate(plan.ops[main].items())]
    best = plan.predicted.step_time_s
    alternatives = [{"spec": a.spec, "step_ms": None if a.predicted is None else a.predicted.step_time_s * 1e3,
                     "delta_ms": None if a.predicted is None else (a.predicted.step_time_s - best) * 1e3,
                     "memory_gib": None if a.predicted is None else a.predicted.memory_gib, "why": a.why,
                     "fits": a.predicted is not None}
                    for a in plan.alternatives]
    # closest loser first; those that do not fit last, in the planner's order
    alternatives.sort(key=lambda a: (a["delta_ms"] is None, a["delta_ms"] or 0.0))
    return {"model": plan.model.name, "seq_len": plan.model.seq_len, "seq_len_source": plan.model.seq_len_source,
            "cluster": f"{plan.cluster.name} x{plan.cluster.nodes}",
            "world_size": plan.cluster.world_size, "spec": plan.spec(), "fp8": plan.fp8, "runtime": plan.runtime,
            "head_loss_chunk_rows": plan.head_loss_chunk_rows,
            "fused_kernels_priced": bool(plan.planner.get("fused_kernels_priced")),
            "cuda_graphs_priced": bool(plan.planner.get("cuda_graphs_priced")),
            "fused_kernels": {key.removeprefix("fused."): int(count) for key, count in plan.planner.items()
                              if key.startswith("fused.")},
            "mesh": {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp, "ep": plan.mesh.ep,
                     "vpp": plan.mesh.vpp, "cp": plan.mesh.cp, "cp_method": plan.mesh.cp_method,
                     "sites": plan.mesh.sites},
            "links": _links(plan),
            "inexact": _inexact(plan),
            "context": _context(plan),
            "predicted": {"step_time_ms": best * 1e3, "tflops_per_gpu": plan.predicted.tflops_per_gpu,
                          "mfu": plan.predicted.mfu, "tokens_per_s": plan.predicted.tokens_per_s,
                          "bubble_fraction": plan.predicted.bubble_fraction, "memory_gib": plan.predicted.memory_gib,
                          "simulated_step_ms": sim.step_time_s * 1e3,
                          # what the bubble counts: the busiest rank's idle share of the pipeline time
                          "bubble_rank": sim.critical_rank, "pipeline_ms": sim.pipeline_time_s * 1e3,
                          "exposed_grad_sync_ms": sim.exposed_comm_s * 1e3,
                          "optimizer_ms": plan.predicted.optimizer_s * 1e3,
                          "figures": plan.cluster.figures, "basis": prediction_basis(plan)},
            "notation": NOTATION,
            "schedule": {"name": plan.schedule, "text": schedule_of(config_of(plan)).render() if plan.mesh.pp > 1 else ""},
            "stages": stages, "ranks": per_rank, "block_type": main, "block_ops": block_ops,
            "block_time": _block_time(plan, main),
            "experts": _experts(plan), "zero": _zero(plan), "alternatives": alternatives}


def _level_name(zero: int, keep_weights: bool) -> str:
    return f"zero={zero}" + (" keeping its weights" if keep_weights else "")


def _zero(plan: Plan) -> dict[str, Any]:
    """The plan's ZeRO level and why it won: its zero 2/3 collectives per step, the plan's layout
    at every other level (`Plan.zero_levels`), whether mplan's runtime runs the level, and one
    sentence saying it (`zero_summary`)."""
    levels = [{"zero": z.zero, "keep_weights": z.keep_weights, "spec": z.spec, "fits": z.fits,
               "step_ms": z.step_time_s * 1e3, "memory_gib": z.memory_gib, "zero_comm_ms": z.zero_comm_s * 1e3,
               "best_spec": z.best_spec,
               "best_step_ms": None if z.best_step_time_s is None else z.best_step_time_s * 1e3,
               "nothing_fits_below": z.nothing_fits_below} for z in plan.zero_levels]
    runs = plan.runtime != "mplan" or plan.zero in EXECUTABLE_ZERO["mplan"]
    return {"zero": plan.zero, "keep_weights": plan.zero3_keep_weights,
            "zero_comm_ms": plan.predicted.zero_comm_s * 1e3,
            "gathers_overlapped": _zero_overlap(plan).gathers,
            "reduce_scatters_overlapped": _zero_overlap(plan).reduce_scatters, "runtime_runs_it": runs,
            "levels": levels, "summary": zero_summary(plan)}


def _zero_overlap(plan: Plan) -> ZeroOverlap:
    """What of zero 2/3's collectives the plan was priced as overlapping (`zero_pricing.ZERO_OVERLAP`;
    nothing on CPU ranks, whose gloo collectives take turns with the compute)."""
    return ZeroOverlap(gathers=False, reduce_scatters=False) if plan.cluster.device == "cpu" else \
        ZERO_OVERLAP[plan.runtime]


def zero_summary(plan: Plan) -> str:
    """Why the plan's ZeRO level won, in one sentence: that nothing fits below it, or what the
    levels below would need and the levels above would cost (memory saved against the extra
    all-gathers and reduce-scatters), each in the plan's own layout."""
    own_name = _level_name(plan.zero, plan.zero3_keep_weights)
    overlap = _zero_overlap(plan)
    gathers = ""
    if plan.zero == 3:
        how = ("one gather of each unit a step, its weights kept through the step" if plan.zero3_keep_weights else
               "a gather before each unit's forward and backward")
        gathers = f", {how}, {'overlapped with' if overlap.gathers else 'NOT overlapped with'} compute"
    traffic = "" if plan.zero < 2 else (
        f"; its all-gathers and reduce-scatters add {plan.predicted.zero_comm_s * 1e3:,.0f} ms a step (priced as "
        f"{RUNTIME_NAMES[plan.runtime]} runs them: reduce-scatters "
        f"{'overlapped with' if overlap.reduce_scatters else 'NOT overlapped with'} the backward{gathers})")
    runs = "" if plan.runtime != "mplan" or plan.zero in EXECUTABLE_ZERO["mplan"] else (
        f"; mplan's runtime does not run zero={plan.zero} yet (it runs zero "
        f"{', '.join(map(str, EXECUTABLE_ZERO['mplan']))}): autoparallel refuses this plan")
    if plan.mesh.dp == 1:
        return f"{own_name}: dp=1, nothing to shard over{traffic}{runs}"
    if not plan.zero_levels:
        return f"{own_name}, as the spec asked (no other level was searched){traffic}{runs}"
    own = next((z for z in plan.zero_levels if (z.zero, z.keep_weights) == (plan.zero, plan.zero3_keep_weights)),
               None)
    others = [z for z in plan.zero_levels if z is not own]
    below = [z for z in others if z.zero < plan.zero]
    if own is not None and own.nothing_fits_below and below:
        head = (f"{own_name} chosen: the plan fits only with zero>={plan.zero}, no plan of the search fits at a lower "
                f"level")
    else:
        head = f"{own_name} chosen, the fastest that fits"
    parts = [_versus(z, plan) for z in others]
    return head + (": " + "; ".join(parts) if parts else "") + traffic + runs


def _versus(level: ZeroLevel, plan: Plan) -> str:
    """One other level against the plan's, in the plan's layout."""
    name = _level_name(level.zero, level.keep_weights)
    here = plan.predicted.memory_gib
    if not level.fits:
        return f"{name} needs {level.memory_gib:.1f} GiB per GPU in this layout (this plan {here:.1f})"
    slower = (level.step_time_s - plan.predicted.step_time_s) * 1e3
    extra = (level.zero_comm_s - plan.predicted.zero_comm_s) * 1e3
    saved = here - level.memory_gib
    memory = f"{saved:.1f} GiB less" if saved > 0 else f"{-saved:.1f} GiB more"
    comm = f", {extra:+,.0f} ms of all-gathers/reduce-scatters a step" if abs(extra) >= 0.5 else ""
    return f"{name} would hold {memory} for a step {slower:+,.0f} ms{comm}"


def _experts(plan: Plan) -> dict[str, Any] | None:
    """Expert parallelism of an MoE model's plan (None for a dense model): the EP degree, the
    experts of each layer a rank holds, the busiest EP rank's load over the mean that was priced,
    and the all-to-all (dispatch and combine, both passes) over one step and its share of it."""
    p = plan.predicted
    if not p.experts_per_rank:
        return None
    return {"ep": plan.mesh.ep, "experts_per_rank": p.experts_per_rank,
            "num_experts": p.experts_per_rank * plan.mesh.ep, "expert_dp": plan.mesh.dp * plan.mesh.cp // plan.mesh.ep,
            "imbalance": p.moe_imbalance, "capacity_factor": plan.capacity_factor,
            "all_to_all_ms": p.a2a_s * 1e3, "all_to_all_share": p.a2a_s / p.step_time_s}


def _seq_len_words(source: str | None) -> str:
    """Where the sequence length came from, as the first line says it: a config's field is named, since
    a config's maximum (40960 for some 8B models) is seldom the length a user trains at."""
    if source is None:
        return "source not recorded: a plan written before plans recorded it"
    if source.startswith("config "):
        return f"the config's {source.removeprefix('config ')}; --seq-len plans another"
    return {"--seq-len": "given by --seq-len / seq_len="}.get(source, f"from the {source}")


def _links(plan: Plan) -> dict[str, Any] | None:
    """The DP collectives' traffic per link over one step (`Predicted.dp_links`), and with sites,
    what crosses the long haul: None where the plan records none."""
    traffic, c = plan.predicted.dp_links, plan.cluster
    if traffic is None:
        return None
    levels = {level: {"gb": getattr(traffic, f"{level}_gb"), "s": getattr(traffic, f"{level}_s")}
              for level in ("intra_node", "inter_node", "inter_site")}
    if c.sites == 1:
        crossing = None
    elif plan.outer_steps:
        crossing = (f"outer loop: gradients reduced inside each site every step, nothing crosses; every "
                    f"{plan.outer_steps} steps each site rank's 1/{plan.mesh.dp // plan.mesh.sites} of the "
                    f"pseudo-gradient is all-reduced between sites (the figures are per step, over {plan.outer_steps})")
    elif plan.mesh.sites > 1:
        crossing = (f"hierarchical: each site reduce-scatters gradients over its {plan.mesh.dp // plan.mesh.sites} "
                    f"replicas, only the 1/{plan.mesh.dp // plan.mesh.sites} shards cross, all-reduced between sites")
    else:
        crossing = f"flat: the data-parallel ring of {plan.mesh.dp} ranks crosses between sites, whole gradients"
    return {"levels": levels, "sites": c.sites, "inter_site_gbps": c.inter_site_gbps,
            "inter_site_latency_ms": c.inter_site_latency_ms, "crossing": crossing}


def _inexact(plan: Plan) -> dict[str, Any] | None:
    """For a plan with an outer loop across sites: that it is inexact and why, and why it won, against
    the best synchronous plan of the search (the first exact alternative that fits); None otherwise."""
    if not plan.outer_steps:
        return None
    h = plan.outer_steps
    out: dict[str, Any] = {
        "outer_steps": h,
        "why_inexact": f"not the single-device loop's arithmetic: each site takes {h} optimizer steps on its own "
                       f"gradients (averaged over its replicas only), then one outer step (SGD over the sites' mean "
                       f"parameter change, runtime/outer_loop.py) joins them; chosen only because inexact training "
                       f"was allowed (inexact_ok / --allow-inexact). Its convergence is not priced: measured on a "
                       f"tiny model only (benchmarks/results/outer_loop-cpu-2026-12-06.json)",
        "exact_spec": None, "exact_step_ms": None, "won_by_ms": None, "why_won": None}
    exact = next((a for a in plan.alternatives if "outer_steps=" not in a.spec and a.predicted is not None), None)
    if exact is None:
        return out
    mine, theirs = plan.predicted, exact.predicted
    haul = "" if mine.dp_links is None or theirs.dp_links is None else (
        f"; the long haul carries {mine.dp_links.inter_site_gb:.2f} GB a site per step "
        f"({mine.dp_links.inter_site_s * 1e3:.0f} ms) against {theirs.dp_links.inter_site_gb:.2f} GB "
        f"({theirs.dp_links.inter_site_s * 1e3:.0f} ms)")
    out.update(exact_spec=exact.spec, exact_step_ms=theirs.step_time_s * 1e3,
               won_by_ms=(theirs.step_time_s - mine.step_time_s) * 1e3,
               why_won=f"{(theirs.step_time_s - mine.step_time_s) * 1e3:.0f} ms faster per step than the best "
                       f"synchronous plan ({theirs.step_time_s * 1e3:.0f} ms){haul}")
    return out


def render(plan: Plan, console: Any) -> None:
    """Print the explanation as rich tables."""
    from rich.table import Table

    d = explain_data(plan)
    p = d["predicted"]
    m = d["mesh"]
    device = device_word(plan.cluster.device)
    console.print(f"[bold]{d['model']}[/] at sequence length {d['seq_len']:,} ({_seq_len_words(d['seq_len_source'])}) "
                  f"on {d['cluster']} ({d['world_size']} {device}s): "
                  f"dp={m['dp']} tp={m['tp']} pp={m['pp']} vpp={m['vpp']} ep={m['ep']}"
                  + (f" sites={m['sites']} (hierarchical DP)" if m["sites"] > 1 else "")
                  + (f" cp={m['cp']} (head-tail chunks, {_CP_WORDS[m['cp_method']]})" if m["cp"] > 1 else "") + ", "
                  f"{plan.schedule}, micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}, "
                  f"SP {'on' if plan.sequence_parallel else 'off'}, zero={plan.zero}, recompute={plan.recompute}")
    inexact = d["inexact"]
    if inexact is not None:
        console.print(f"[bold yellow]INEXACT[/]: outer_steps={inexact['outer_steps']}, {inexact['why_inexact']}",
                      highlight=False)
        if inexact["why_won"] is not None:
            console.print(f"why it won over {inexact['exact_spec']}: {inexact['why_won']}", highlight=False)
    if m["cp"] > 1:
        console.print(f"context parallelism: cp={m['cp']} ({m['cp_method']}), each rank {d['seq_len'] // m['cp']:,} "
                      f"tokens of every sequence (head-tail: attention total / cp a rank), gradients over dp x cp; "
                      f"the exchange priced per method with the overlap the runtime achieves (planner/context_pricing.py)")
        for method, c in d["context"].items():
            console.print(f"  {method}{' (chosen)' if c['chosen'] else ''}: exchange {c['exposed_ms']:.0f} ms of the "
                          f"step exposed ({c['share_of_step']:.1%} of {c['step_ms']:.0f} ms), link busy "
                          f"{c['link_ms']:.0f} ms, {c['held_gib']:.2f} GiB held for backward per micro-batch; peak "
                          f"{c['memory_gib']:.1f} GiB{'' if c['fits'] else ', does not fit'}")
    fused = ", ".join(f"{kernel} x{count}" for kernel, count in d["fused_kernels"].items())
    kernels = (f"fused kernels priced ({fused}; per block: mplan inspect)" if fused else "fused kernels priced") \
        if plan.planner.get("fused_kernels_priced") else "ops priced one by one"
    host = ("host: the step's forwards and backwards replay as one CUDA graph, no host time per op"
            if plan.planner.get("cuda_graphs_priced") else "host time priced per op")
    console.print(f"GEMMs: {'FP8 block linears (output head in bf16)' if plan.fp8 else 'training dtype'}; {kernels}; "
                  f"{host}; memory priced for {RUNTIME_NAMES[plan.runtime]}")
    busiest = d["ranks"][p["bubble_rank"]] if d["ranks"] else None
    console.print(f"predicted: step {p['step_time_ms']:.1f} ms, {flops_rate(p['tflops_per_gpu'] * 1e12)} per "
                  f"{device} "
                  f"(MFU {p['mfu']:.1%}), {p['tokens_per_s']:,.0f} tokens/s, bubble {p['bubble_fraction']:.1%}"
                  + (f" (idle share of the pipeline time on rank {p['bubble_rank']}, the busiest)"
                     if plan.mesh.pp > 1 else "")
                  + f", peak memory {p['memory_gib']:.1f} GiB  \\[{prediction_basis(plan)}]")
    if d["head_loss_chunk_rows"] is not None:
        console.print(f"fused head + loss: {d['head_loss_chunk_rows']} rows a chunk, below the op's default: "
                      f"the default chunk of logits would not fit in the last stage's memory")
    console.print(f"ZeRO: {d['zero']['summary']}", highlight=False)
    links = d["links"]
    if links is not None:
        words = {"intra_node": "intra-node (NVLink, a rank)", "inter_node": "inter-node (NIC, a rank)",
                 "inter_site": "inter-site (long haul, a site each way)"}
        shown = [f"{words[level]} {v['gb']:.1f} GB, {v['s'] * 1e3:.0f} ms" for level, v in links["levels"].items()
                 if v["gb"] or level != "inter_site"]
        console.print("DP traffic per step: " + "; ".join(shown), highlight=False)
        if links["crossing"] is not None:
            console.print(f"long haul ({links['sites']} sites, {links['inter_site_gbps']:g} Gb/s, "
                          f"{links['inter_site_latency_ms']:g} ms): {links['crossing']}; TP, CP, EP and PP stay "
                          f"inside sites", highlight=False)
    e = d["experts"]
    if e is not None and e["ep"] == 1:
        console.print(f"experts: ep=1, all {e['num_experts']} experts of a layer on every rank, no all-to-all")
    elif e is not None:
        capacity = f"capacity factor {e['capacity_factor']:g}" if e["capacity_factor"] is not None else \
            "the model's own capacity"
        console.print(f"experts: ep={e['ep']}, {e['experts_per_rank']} of {e['num_experts']} experts per rank "
                      f"(each replicated on {e['expert_dp']} ranks), load imbalance {e['imbalance']:.2f}x priced, "
                      f"{capacity}; all-to-all {e['all_to_all_ms']:.1f} ms per step, "
                      f"{e['all_to_all_share']:.1%} of the step")
    stages = Table(title=f"stages: layers, time per micro-batch, memory per {device} (GiB)")
    for col in ("stage", "rank", "layers", "fwd ms", "bwd ms", "sync ms", "params", "grads", "optim", "activ",
                "transient", "total"):
        stages.add_column(col, justify="left" if col == "layers" else "right")
    for s in d["stages"]:
        mem = s["memory_gib"] or {}
        stages.add_row(str(s["stage"]), str(s["rank"]), s["layers"], f"{s['forward_ms']:.2f}",
                       f"{s['backward_ms']:.2f}", f"{s['grad_sync_ms']:.2f}",
                       *(f"{mem.get(k, 0):.2f}" for k in ("params", "grads", "optimizer", "activations",
                                                           "transient", "total")))
    console.print(stages)
    ranks = Table(title="time per pipeline rank over one step (simulated)")
    for col in ("rank", "compute ms", "idle ms", "idle %", "warm-up ms", "waits ms", "cool-down ms", "DP sync ms",
                "sync exposed ms"):
        ranks.add_column(col, justify="right")
    for r in d["ranks"]:
        ranks.add_row(f"{r['rank']}{' *' if r['critical'] else ''}", f"{r['busy_ms']:.1f}",
                      f"{r['idle_ms']:.1f}", f"{r['idle_fraction']:.1%}", f"{r['warmup_ms']:.1f}",
                      f"{r['between_ms']:.1f}", f"{r['cooldown_ms']:.1f}", f"{r['grad_sync_ms']:.1f}",
                      f"{r['exposed_grad_sync_ms']:.1f}")
    console.print(ranks)
    if busiest is not None:
        most = max(d["ranks"], key=lambda r: (r["idle_fraction"], -r["rank"]))
        console.print(
            f"how the step adds up: step {p['step_time_ms']:.1f} ms = pipeline {p['pipeline_ms']:.1f} ms (first op to "
            f"the last compute of any rank) + {p['exposed_grad_sync_ms']:.1f} ms of DP gradient sync not hidden "
            f"behind compute + {p['optimizer_ms']:.1f} ms optimizer step."
            + ("" if plan.mesh.pp == 1 else "\n"
            f"  idle = pipeline time - the rank's compute: warm-up before its first op + waits between ops (for an "
            f"activation or a gradient) + cool-down after its last op; idle % is of the pipeline time.\n"
            f"  the headline bubble ({p['bubble_fraction']:.1%}) is the idle % of the busiest rank (*, rank "
            f"{p['bubble_rank']}), as Megatron counts the pipeline bubble; a rank with less work idles longer "
            f"(most: rank {most['rank']}, {most['idle_fraction']:.1%} of the pipeline time, "
            f"{most['idle_share_of_step']:.1%} of the step)."), highlight=False)
    if d["block_ops"]:
        _render_block_ops(d, plan, console)
    if d["alternatives"]:
        alts = Table(title="why the alternatives lost (closest first)")
        for col in ("spec", "step ms", "vs best", "memory GiB", "why"):
            alts.add_column(col)
        for a in d["alternatives"]:
            alts.add_row(a["spec"], "-" if a["step_ms"] is None else f"{a['step_ms']:.1f}",
                         "-" if a["delta_ms"] is None else f"{a['delta_ms']:+.1f} ms",
                         "-" if a["memory_gib"] is None else f"{a['memory_gib']:.1f}", a["why"])
        console.print(alts)


def _render_block_ops(d: dict[str, Any], plan: Plan, console: Any) -> None:
    """The per-op table of one block: strategy, work, own collectives and the priced costs, a row
    for the replicated ops left out at tp > 1, the block's total, and that total against the
    per-layer time of the plan's stages."""
    from rich.table import Table

    tp = d["mesh"]["tp"]
    ops = Table(title=f"tensor-parallel strategy and priced cost of each op in one {d['block_type']} (tp={tp})"
                      + ("" if tp == 1 else "; replicated ops left out")
                      + f"; ms: forward + backward of one micro-batch of {plan.micro_batch_size}")
    for col in ("#", "module", "op", "strategy", "work", "own collectives (fwd)", *COST_COLUMNS):
        ops.add_column(col, justify="right" if col == "#" or col in COST_COLUMNS else "left")
    def listed(o: dict[str, Any]) -> bool:
        return tp == 1 or not o["strategy"].startswith("replicate")
    hidden = [o for o in d["block_ops"] if not listed(o)]
    for o in d["block_ops"]:
        if listed(o):
            comm = ", ".join(f"{c['kind']} {_bytes(c['bytes'])}" for c in o["collectives"]) or "-"
            work = "-" if o["split"] is None else (f"1/{tp}" if o["split"] else "whole")
            ops.add_row(str(o["index"]), o["module"] or "(block)", o["op_name"], o["strategy"], work, comm,
                        *(_ms(o[k]) for k in COST_KEYS))
    total = d["block_time"]
    if hidden and total is not None:
        ops.add_row("", f"{len(hidden)} replicated ops", "", "", "whole", "",
                    *(_ms(sum(o[k] or 0.0 for o in hidden)) for k in COST_KEYS))
    if total is not None:
        ops.add_row("", "total", f"{total['num_ops']} ops", "", "", "", *(_ms(total[k]) for k in COST_KEYS),
                    end_section=True)
    console.print(d["notation"], markup=False, highlight=False)
    console.print(ops)
    if total is None:
        console.print("per-op costs are not in this plan (written before plans recorded them): re-plan it, or "
                      "`mplan inspect MODEL` prices each op (compute, communication)", highlight=False)
        return
    console.print(COSTS_NOTE, highlight=False)
    line = (f"{d['block_type']}: {total['total_ms']:.3f} ms per layer priced by the ILP (compute "
            f"{total['compute_ms']:.3f} + comm {total['comm_ms']:.3f} + reshard {total['reshard_ms']:.3f})")
    if total["stage_per_layer_ms"] is None:
        line += f"; {total['why']}"
    else:
        line += (f"; the plan's stages: {total['stage_per_layer_ms']:.3f} ms per layer (their forward + backward "
                 f"less the prologue's and epilogue's ops, over the layers); difference "
                 f"{round(total['difference_ms'], 3) + 0.0:+.3f} ms: {total['why']}")
    console.print(line, highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
