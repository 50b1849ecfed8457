"""The one bridge from planning to execution: whatever `autoparallel(plan=...)` was given, as one
complete `Plan` for the graph the runtime will execute.

Input: the plan argument (None or "auto", a spec string such as `tp=2,dp=2,sp=1,zero=1`, a `Plan`,
or a plan.json path), the captured training graph (`ir.trace.capture_for_training`: the very
graph the runtime rewrites and runs), the cluster, world size and global batch, and `within`: the
keys the runtime can execute (ep=1 today), which a search respects. Output: a `Plan` whose
`ops` hold a strategy for every node of that graph under its stable key, so the runtime only
reads it (`Plan.op_strategies`): it never solves, searches or re-captures.

- None / "auto"  the planner searches (`search.Planner`) on this graph, within `within` and the
                 ZeRO levels mplan's runtime executes (`EXECUTABLE_ZERO`);
- a spec string  keys as in the plan-spec grammar; keys left out take defaults here (tp=1, sp=0,
                 zero=0, dp fills the world, mbs = the whole replica batch unless
                 `micro_batch_size` says otherwise, or with pp > 1 the largest that still gives
                 every stage pp micro-batches to overlap, recompute=none, schedule=1f1b, or
                 interleaved with vpp > 1); the TP strategies are
                 Megatron-LM's layout (`tp_layout="megatron"`) or the ILP's cheapest valid mix on
                 the cluster (`"ilp"`), solved on this graph; the figures priced on the cluster;
- a Plan / path  checked against this job (world size, global batch, the model's hash) and bound
                 to this graph by node keys: a node the plan does not name (a plan made from a
                 shallow bf16 capture of a model spec has no `slice` that a symbolic batch adds)
                 runs replicated, which is always exact, and the Plan records how many did.

`check_before_capture` is every refusal above that needs no graph (a spec's grammar and arithmetic
on this world and batch, a plan file for another world size or batch, a ZeRO level the runtime
does not execute), for a caller to run before it captures: `autoparallel` refuses those in well
under a second.

Every resolved Plan passes `ir.sharding.check_sharding` and `ir.stage_cut.stage_of_units` on the
graph before it is returned, so a plan the passes cannot run (a sharding no pass lowers, a stage
cut that does not list the model's units) fails here, on every rank alike, before any collective.
Invariants: dp*tp*pp == world size; dp * micro_batch_size * num_micro_batches == global_batch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.graph import Graph
from mplan.ir.graph_hash import graph_hash
from mplan.ir.placement import Shard
from mplan.ir.rebatch import rebatch
from mplan.ir.moe import experts_nodes
from mplan.ir.sharding import UnexecutableStrategy, check_sharding
from mplan.ir.stage_cut import StageCutError, stage_of_units
from mplan.ir.strategy import Strategy, parse_strategy
from mplan.planner.op_registry import replicated
from mplan.planner.parallel_config import (EXECUTABLE_ZERO, ZERO3_KEEPS_UNDER_PIPELINES, ParallelConfig, PlanSpec,
                                           PlanSpecError, carving_refusal, outer_refusal, parse_plan_spec)
from mplan.planner.plan import TP_LAYOUTS, Plan, PlanError
from mplan.planner.plan_builder import build_plan
from mplan.planner.search import Planner, SearchResult
from mplan.planner.spec_check import context_capacity_refusal, experts_refusal, heads_refusal


def resolve_plan(plan: Plan | str | None, graph: Graph, *, cluster: ClusterSpec, world_size: int,
                 global_batch: int, micro_batch_size: int | None = None, tp_layout: str = "megatron",
                 within: PlanSpec = PlanSpec(), kernels: bool = False, fp8: bool = False,
                 progress: Callable[[str], None] | None = None, inexact_ok: bool = False,
                 cuda_graphs: bool | None = None) -> Plan:
    """One complete Plan for `graph` (see the module docstring). `inexact_ok`: a search may choose
    an outer loop across sites (`outer_steps`), which is not the single-device loop's arithmetic.
    `cuda_graphs`: autoparallel's, which prices the host as the runtime will run (`Planner`)."""
    plan = check_before_capture(plan, world_size=world_size, global_batch=global_batch,
                                micro_batch_size=micro_batch_size, tp_layout=tp_layout)

    def planner(layout: str, context_slice: int = 1) -> Planner:
        # FP8 GEMMs priced where the cluster has them; elsewhere the runtime refuses fp8, naming why
        return Planner(graph, cluster, kernels=kernels, fp8=fp8 and bool(cluster.device.peak_fp8), runtime="mplan",
                       tp_layout=layout, progress=progress, context_slice=context_slice, cuda_graphs=cuda_graphs)

    if plan is None or (isinstance(plan, str) and plan.strip() in ("", "auto")):
        # cp=1: `graph` holds whole sequences (`api` captures a cp rank's slice only for a cp it is given)
        within = within if within.cp is not None else dataclasses.replace(within, cp=1)
        search = planner("ilp")
        result = search.search(global_batch, within, zero_levels=EXECUTABLE_ZERO["mplan"], inexact_ok=inexact_ok)
        made = build_plan(result, graph, cluster, global_batch, tp_layout="ilp", runtime="mplan")
        made.planner["cuda_graphs_priced"] = float(search.graphed)
    elif isinstance(plan, Plan):
        made = _bind(plan, graph, world_size, global_batch)
    elif isinstance(plan, str):
        config = _config_of(plan, world_size, global_batch, micro_batch_size, graph)
        try:  # before pricing: groups across sites the cluster does not have cannot be priced
            config.mesh.check_sites(cluster.num_sites)
        except ValueError as exc:
            raise PlanSpecError(f"plan {plan!r} on cluster {cluster.name}: {exc}") from None
        # with cp, `graph` is one rank's slice of each sequence (`api.autoparallel` captures it so)
        search = planner(tp_layout, config.cp)
        _check_heads(plan, config.tp, search.limits.num_heads, graph)
        estimate = search.evaluate(config)
        result = SearchResult(best=estimate, ranked=[estimate], rejected=[], sharded=search._sharded,
                              facts=search.facts, num_candidates=1, seconds=0.0, context_slice=config.cp)
        made = build_plan(result, graph, cluster, global_batch, tp_layout=tp_layout, runtime="mplan")
        made.planner["cuda_graphs_priced"] = float(search.graphed)
    else:
        raise TypeError(f"plan must be None, a Plan, a plan.json path or a spec string, not {type(plan).__name__}")
    if not isinstance(plan, Plan):  # planned here, at the sequence length of the example inputs captured
        made = dataclasses.replace(made, model=dataclasses.replace(made.model, seq_len_source="example inputs"))
    made = dataclasses.replace(made, fp8=made.fp8 or fp8)
    _check_sites(made, cluster)
    _check_outer_loop(made)
    _check(made, graph)
    return made


def check_before_capture(plan: Plan | str | None, *, world_size: int, global_batch: int,
                         micro_batch_size: int | None = None, tp_layout: str = "megatron",
                         model: object = None) -> Plan | str | None:
    """Whatever `resolve_plan` can refuse without the graph, refused before the capture (a capture
    costs seconds): the tp layout, a spec string's grammar and arithmetic on this world and
    batch, what `model`'s own config states against it (tp dividing its heads, ep and capacity
    only with experts; a module without a config states nothing; stages are cut over units, the
    prologue and epilogue too, so pp is left to the graph), a plan
    file that cannot be read or was made for another world size or global batch.
    Returns the plan argument with a plan.json path read into its Plan (read once)."""
    if tp_layout not in TP_LAYOUTS:
        raise PlanSpecError(f"tp_layout must be one of {TP_LAYOUTS}, got {tp_layout!r}")
    if global_batch < 1:
        raise PlanSpecError(f"global_batch must be a positive number of sequences, got {global_batch}")
    if isinstance(plan, str) and plan.strip().endswith(".json"):
        plan = Plan.load(plan.strip())
    if isinstance(plan, Plan):
        plan.check_runs_on(world_size=world_size)
        _check_batch_of(plan, global_batch)
        refused = _unexecutable_zero(plan.zero, f"plan {plan.spec()!r}")
        if refused:
            raise PlanError(refused)
    elif isinstance(plan, str) and plan.strip() not in ("", "auto"):
        spec, _, _ = _degrees_of(plan, world_size, global_batch, micro_batch_size)
        refused = _unexecutable_zero(spec.zero, f"plan {plan!r}")
        if refused:
            raise PlanSpecError(refused)
        if model is not None:
            _check_stated(spec, plan, model)
    return plan


def _unexecutable_zero(zero: int | None, asked: str) -> str | None:
    """Why mplan's runtime cannot run `zero` (`EXECUTABLE_ZERO`), or None."""
    levels = EXECUTABLE_ZERO["mplan"]
    if zero is None or zero in levels:
        return None
    return (f"{asked}: zero={zero} is planned and priced, but mplan's runtime runs zero "
            f"{', '.join(map(str, levels[:-1]))}{' or ' if len(levels) > 1 else ''}{levels[-1]} only, not yet "
            f"{zero}: use zero={max(levels)}")


def _check_stated(spec: PlanSpec, text: str, model: object) -> None:
    """`spec` against the heads and experts `model.config` states (`stated_shape`)."""
    from mplan.models.spec import stated_shape

    shape = stated_shape(getattr(model, "config", None), type(model).__name__)
    asked = f"plan {text!r}"
    reason = experts_refusal(spec, asked, shape.name, shape.num_experts) or heads_refusal(spec, asked, shape.num_heads)
    if reason is not None:
        raise PlanSpecError(reason)


def _check_batch_of(plan: Plan, global_batch: int) -> None:
    if plan.global_batch != global_batch:
        raise PlanError(f"plan was made for a global batch of {plan.global_batch}, "
                        f"autoparallel was given {global_batch}")


def _degrees_of(text: str, world_size: int, global_batch: int,
                micro_batch_size: int | None) -> tuple[PlanSpec, int, int]:
    """The spec, dp and micro-batch size a spec string asks for on this world and batch, with
    every refusal showing its arithmetic: all `_config_of` checks that need no graph."""
    spec = parse_plan_spec(text)
    tp, pp, cp = spec.tp or 1, spec.pp or 1, spec.cp or 1
    # cp shown in the arithmetic only where the spec has it
    names, values = ("*cp", f"*{cp}") if cp > 1 else ("", "")
    if spec.dp is None and world_size % (tp * pp * cp):
        raise PlanSpecError(f"plan {text!r}: tp*pp{names} = {tp}*{pp}{values} = {tp * pp * cp} does not divide the "
                            f"world size {world_size}")
    dp = spec.dp or world_size // (tp * pp * cp)
    if dp * tp * pp * cp != world_size:
        raise PlanSpecError(f"plan {text!r}: dp*tp*pp{names} = {dp}*{tp}*{pp}{values} = {dp * tp * pp * cp} ranks "
                            f"but the world has {world_size}")
    carving = carving_refusal(spec.ep or 1, dp, cp)
    if carving:
        raise PlanSpecError(f"plan {text!r}: {carving}")
    if spec.sites is not None and (dp % spec.sites or (dp * cp // spec.sites) % (spec.ep or 1)):
        raise PlanSpecError(f"plan {text!r}: sites={spec.sites} must divide dp={dp} and leave ep={spec.ep or 1} "
                            f"inside a site (data parallelism is what spans sites)")
    refused = outer_refusal(ParallelConfig(dp=dp, tp=tp, pp=pp, ep=spec.ep or 1, sites=spec.sites or 1,
                                           zero=spec.zero or 0, outer_steps=spec.outer_steps or 0))
    if refused:
        raise PlanSpecError(f"plan {text!r}: {refused}")
    if spec.zero == 3 and pp > 1 and spec.keep_weights == 0 and ZERO3_KEEPS_UNDER_PIPELINES["mplan"]:
        raise PlanSpecError(f"plan {text!r}: mplan's runtime keeps zero=3's gathered weights through the step "
                            f"under a pipeline (pp={pp}): keep_weights=0 cannot run there; leave it out")
    if spec.mbs is not None and micro_batch_size is not None and spec.mbs != micro_batch_size:
        raise PlanSpecError(f"plan {text!r} says mbs={spec.mbs} but micro_batch_size={micro_batch_size}")
    if global_batch % dp:
        raise PlanSpecError(f"global batch {global_batch} is not divisible by dp={dp} "
                         f"({global_batch} % {dp} = {global_batch % dp})")
    replica = global_batch // dp
    mbs = spec.mbs or micro_batch_size or max(d for d in range(1, replica + 1)
                                               if replica % d == 0 and (replica // d >= pp or d == 1))
    if replica % mbs:
        raise PlanSpecError(f"each of dp={dp} replicas gets {replica} sequences, not a multiple of "
                         f"the micro-batch size {mbs} ({replica} % {mbs} = {replica % mbs})")
    return spec, dp, mbs


def _config_of(text: str, world_size: int, global_batch: int, micro_batch_size: int | None,
               graph: Graph) -> ParallelConfig:
    """The complete config a spec string asks for, with every refusal showing its arithmetic."""
    spec, dp, mbs = _degrees_of(text, world_size, global_batch, micro_batch_size)
    tp, pp, replica = spec.tp or 1, spec.pp or 1, global_batch // dp
    _check_experts(text, spec.ep or 1, spec.capacity, graph)
    stages = pp * (spec.vpp or 1)
    if stages > len(graph.segments):
        raise PlanSpecError(f"plan {text!r}: pp*vpp = {stages} pipeline stages but {graph.model_name} has "
                            f"{len(graph.segments)} units to cut ({', '.join(s.name for s in graph.segments[:3])}, "
                            f"...): use pp*vpp <= {len(graph.segments)}")
    static = not any(m.sym is not None for m in graph.graph_inputs.values())
    if static and mbs != graph.batch_size:
        raise PlanError(f"plan {text!r}: {graph.model_name} could only be captured at a fixed batch of "
                        f"{graph.batch_size} (it specializes on the batch size), so micro-batches of {mbs} cannot "
                        f"run it; use mbs={graph.batch_size}")
    if spec.cp_method is not None and (spec.cp or 1) == 1:
        raise PlanSpecError(f"plan {text!r}: cp_method={spec.cp_method} without cp > 1 (it says how attention "
                            f"exchanges the sequence over the cp ranks)")
    return ParallelConfig(dp=dp, tp=tp, pp=pp, vpp=spec.vpp or 1, ep=spec.ep or 1, cp=spec.cp or 1,
                          cp_method=spec.cp_method or "all_gather", mbs=mbs,
                          num_micro_batches=replica // mbs, sp=bool(spec.sp), zero=spec.zero or 0,
                          keep_weights=bool(spec.keep_weights) or (spec.zero == 3 and pp > 1 and
                                                                   ZERO3_KEEPS_UNDER_PIPELINES["mplan"]),
                          recompute=spec.recompute or "none",
                          schedule=spec.schedule or ("interleaved" if (spec.vpp or 1) > 1 else "1f1b"),
                          capacity_factor=spec.capacity, sites=spec.sites or 1, outer_steps=spec.outer_steps or 0)


def _check_sites(plan: Plan, cluster: ClusterSpec) -> None:
    """The plan's sites against the cluster's (`MeshShape.check_sites`): a plan's sites are 1 or the
    cluster's, and no TP, CP, EP or PP group crosses a site."""
    try:
        plan.mesh_shape().check_sites(cluster.num_sites)
    except ValueError as exc:
        raise PlanSpecError(f"plan {plan.spec()!r} on cluster {cluster.name}: {exc}") from None


def _check_outer_loop(plan: Plan) -> None:
    """A Plan made in code (a file is checked as it loads) whose outer loop cannot run: one line."""
    refused = plan.outer_refusal()
    if refused:
        raise PlanError(f"plan {plan.spec()!r}: {refused}")


def _bind(plan: Plan, graph: Graph, world_size: int, global_batch: int) -> Plan:
    """`plan` checked against this job and completed for `graph` (see the module docstring)."""
    plan.check_runs_on(world_size=world_size, graph_hash=graph_hash(graph))
    _check_batch_of(plan, global_batch)
    ops = {segment: dict(entries) for segment, entries in plan.ops.items()}
    unbound = 0
    at = _at_micro_batch(graph, plan.micro_batch_size)
    for node in at.nodes:
        segment, key = at.plan_key(node.name)
        text = ops.get(segment, {}).get(key)
        if text is not None and _fits(parse_strategy(text), node):
            continue
        ops.setdefault(segment, {})[key] = str(replicated(node))
        unbound += 1
    planner = {**plan.planner, "unbound_ops": float(unbound)}
    return dataclasses.replace(plan, ops=ops, planner=planner)


def _fits(strategy: Strategy, node: object) -> bool:
    """A stored strategy can serve this node: one placement per input (a node the plan's capture
    saw with other inputs, e.g. a view reading a symbolic size, does not bind)."""
    return len(strategy.inputs) == len(node.inputs)  # type: ignore[attr-defined]


def _at_micro_batch(graph: Graph, mbs: int) -> Graph:
    symbolic = any(m.sym is not None for m in graph.graph_inputs.values())
    return rebatch(graph, mbs) if symbolic else graph


def _check(plan: Plan, graph: Graph) -> None:
    """The Plan runs on `graph` at its micro-batch: a strategy for every node, valid edges, one
    storage placement per parameter, lowerings the passes implement, shards that divide."""
    at = _at_micro_batch(graph, plan.micro_batch_size)
    choice = plan.op_strategies(at)
    try:
        stage_of_units(graph, [s.units for s in plan.stages])
    except StageCutError as exc:
        raise PlanError(f"plan {plan.spec()} cannot run on {graph.model_name}: {exc}") from None
    _check_experts(plan.spec(), plan.mesh.ep, plan.capacity_factor, graph, cp=plan.mesh.cp)
    try:
        check_sharding(at, choice)
        _check_divisible(at, choice, plan.mesh.tp)
    except UnexecutableStrategy as exc:
        raise PlanError(f"plan {plan.spec()} cannot run on {graph.model_name}: {exc}") from None


def _check_heads(plan: str, tp: int, heads: int, graph: Graph) -> None:
    """TP splits attention by heads: a tp that does not divide them would leave every attention op
    (and the projections around it) replicated, a plan named tp that splits nothing there. The
    search never tries one (`enumerate_configs`); a spec asking for one is refused. (A graph
    without attention reports one head and is limited by its tensors' dims alone, `_check_divisible`.)"""
    if heads > 1 and heads % tp:
        raise PlanSpecError(f"plan {plan!r}: tp={tp} does not divide the {heads} attention heads of "
                            f"{graph.model_name} ({heads} % {tp} = {heads % tp}): use a tp that divides {heads}")


def _check_experts(plan: str, ep: int, capacity: float | None, graph: Graph, *, cp: int = 1) -> None:
    """Expert parallelism and a capacity factor need MoE layers, and ep must divide their experts.
    A capacity (the plan's, or a layer's own) counts the tokens of one micro-batch
    (docs/execution.md, routing semantics), which context parallelism splits over its ranks: each
    would keep ceil(factor * k * T / E) choices of its own T / cp tokens, dropping other tokens
    than one process does, so cp > 1 with a capacity is refused."""
    layers = experts_nodes(graph)
    own = next((e.capacity_factor for e in layers if e.capacity_factor is not None), None)
    if cp > 1 and (capacity is not None or own is not None):
        what = f"capacity={capacity:g}" if capacity is not None else f"its MoE layers' own capacity factor {own:g}"
        raise PlanError(context_capacity_refusal(f"plan {plan}", cp, what))
    if (ep > 1 or capacity is not None) and not layers:
        what = f"ep={ep}" if ep > 1 else f"capacity={capacity:g}"
        raise PlanError(f"plan {plan} asks for {what} but {graph.model_name} has no MoE layer (no "
                        f"experts module mplan recognizes: mplan.kernels.moe.moe_experts, or an experts module "
                        f"following transformers' experts interface): use ep=1 and no capacity")
    uneven = sorted({e.num_experts for e in layers if e.num_experts % ep})
    if uneven:
        raise PlanError(f"plan {plan}: ep={ep} does not divide the {uneven[0]} experts of "
                        f"{graph.model_name}'s MoE layers ({uneven[0]} % {ep} = {uneven[0] % ep}): use an ep that "
                        f"divides {uneven[0]}")


def _check_divisible(graph: Graph, choice: dict[str, Strategy], n: int) -> None:
    for node in graph.nodes:
        strategy = choice[node.name]
        if len(node.input_metas) != len(node.inputs):
            continue  # symbolic sizes among the inputs: the tensors' slots are not known here
        for meta, placement in zip(node.input_metas, strategy.inputs):
            if isinstance(placement, Shard) and (placement.dim >= len(meta.shape) or meta.shape[placement.dim] % n):
                raise UnexecutableStrategy(f"node {node.name} ({node.op}) reads {meta} as {placement} on "
                                           f"{n} ranks: that dim does not divide")


__all__ = ["check_before_capture", "resolve_plan"]
