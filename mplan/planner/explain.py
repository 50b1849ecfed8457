"""Why a plan won: the mesh, the stages and their layers, memory and time per stage, the per-op
sharding of one block, what each rejected alternative would have cost, and for an MoE model its
expert parallelism (experts per rank, the load imbalance priced, the all-to-all's share of the step).

`explain_data(plan)` is plain data (for `--json`); `render(plan, console)` prints it as rich
tables, which also read fine as text without a terminal; `simulate_plan(plan)` re-runs the
schedule simulator on the plan's own stage times, the weight-gradient part of each backward
included (zero-bubble schedules run it as W), for the Gantt chart and per-rank figures.
"""
from __future__ import annotations

import re
from typing import Any

from mplan.cost_models.simulator import PipelineCosts, SimResult, simulate
from mplan.planner.evaluate import schedule_of
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.plan import Plan

RUNTIME_NAMES = {"mplan": "mplan's runtime", "megatron": "Megatron-LM's runtime (--runtime megatron)"}


def config_of(plan: Plan) -> ParallelConfig:
    m = plan.mesh
    return ParallelConfig(dp=m.dp, tp=m.tp, pp=m.pp, vpp=m.vpp, ep=m.ep, mbs=plan.micro_batch_size,
                          num_micro_batches=plan.num_micro_batches, sp=plan.sequence_parallel, zero=plan.zero,
                          recompute=plan.recompute, schedule=plan.schedule)


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
    per_rank = [{"rank": r, "busy_ms": ranks[r].busy_s * 1e3, "idle_ms": ranks[r].idle_s * 1e3,
                 "grad_sync_ms": ranks[r].grad_sync_s * 1e3} for r in sorted(ranks)]
    main = max(plan.ops, key=lambda k: len(plan.ops[k])) if plan.ops else None
    block_ops = [] if main is None else [{"index": i, "op": op, "strategy": s}
                                         for i, (op, s) in enumerate(plan.ops[main].items())]
    best = plan.predicted.step_time_s
    alternatives = [{"spec": a.spec, "step_ms": None if a.predicted is None else a.predicted.step_time_s * 1e3,
                     "delta_ms": None if a.predicted is None else (a.predicted.step_time_s - best) * 1e3,
                     "memory_gib": None if a.predicted is None else a.predicted.memory_gib, "why": a.why}
                    for a in plan.alternatives]
    return {"model": plan.model.name, "cluster": f"{plan.cluster.name} x{plan.cluster.nodes}",
            "world_size": plan.cluster.world_size, "spec": plan.spec(), "fp8": plan.fp8, "runtime": plan.runtime,
            "fused_kernels_priced": bool(plan.planner.get("fused_kernels_priced")),
            "fused_kernels": {key.removeprefix("fused."): int(count) for key, count in plan.planner.items()
                              if key.startswith("fused.")},
            "mesh": {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp, "ep": plan.mesh.ep,
                     "vpp": plan.mesh.vpp},
            "predicted": {"step_time_ms": best * 1e3, "tflops_per_gpu": plan.predicted.tflops_per_gpu,
                          "mfu": plan.predicted.mfu, "tokens_per_s": plan.predicted.tokens_per_s,
                          "bubble_fraction": plan.predicted.bubble_fraction, "memory_gib": plan.predicted.memory_gib,
                          "simulated_step_ms": sim.step_time_s * 1e3},
            "schedule": {"name": plan.schedule, "text": schedule_of(config_of(plan)).render() if plan.mesh.pp > 1 else ""},
            "stages": stages, "ranks": per_rank, "block_type": main, "block_ops": block_ops,
            "experts": _experts(plan), "alternatives": alternatives}


def _experts(plan: Plan) -> dict[str, Any] | None:
    """Expert parallelism of an MoE model's plan (None for a dense model): the EP degree, the
    experts of each layer a rank holds, the busiest EP rank's load over the mean that was priced,
    and the all-to-all (dispatch and combine, both passes) over one step and its share of it."""
    p = plan.predicted
    if not p.experts_per_rank:
        return None
    return {"ep": plan.mesh.ep, "experts_per_rank": p.experts_per_rank,
            "num_experts": p.experts_per_rank * plan.mesh.ep, "expert_dp": plan.mesh.dp // plan.mesh.ep,
            "imbalance": p.moe_imbalance, "capacity_factor": plan.capacity_factor,
            "all_to_all_ms": p.a2a_s * 1e3, "all_to_all_share": p.a2a_s / p.step_time_s}


def render(plan: Plan, console: Any) -> None:
    """Print the explanation as rich tables."""
    from rich.table import Table

    d = explain_data(plan)
    p = d["predicted"]
    m = d["mesh"]
    console.print(f"[bold]{d['model']}[/] on {d['cluster']} ({d['world_size']} GPUs): "
                  f"dp={m['dp']} tp={m['tp']} pp={m['pp']} vpp={m['vpp']} ep={m['ep']}, "
                  f"{plan.schedule}, micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}, "
                  f"SP {'on' if plan.sequence_parallel else 'off'}, zero={plan.zero}, recompute={plan.recompute}")
    fused = ", ".join(f"{kernel} x{count}" for kernel, count in d["fused_kernels"].items())
    kernels = (f"fused kernels priced ({fused}; per block: mplan inspect)" if fused else "fused kernels priced") \
        if plan.planner.get("fused_kernels_priced") else "ops priced one by one"
    console.print(f"GEMMs: {'FP8 block linears (output head in bf16)' if plan.fp8 else 'training dtype'}; {kernels}; "
                  f"memory priced for {RUNTIME_NAMES[plan.runtime]}")
    console.print(f"predicted: step {p['step_time_ms']:.1f} ms, {p['tflops_per_gpu']:.1f} TFLOP/s per GPU "
                  f"(MFU {p['mfu']:.1%}), {p['tokens_per_s']:,.0f} tokens/s, bubble {p['bubble_fraction']:.1%}, "
                  f"peak memory {p['memory_gib']:.1f} GiB  [predicted, not measured]")
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
    stages = Table(title="stages: layers, time per micro-batch, memory per GPU (GiB)")
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
    for col in ("rank", "compute ms", "bubble/wait ms", "DP sync ms"):
        ranks.add_column(col, justify="right")
    for r in d["ranks"]:
        ranks.add_row(str(r["rank"]), f"{r['busy_ms']:.1f}", f"{r['idle_ms']:.1f}", f"{r['grad_sync_ms']:.1f}")
    console.print(ranks)
    if d["block_ops"]:
        ops = Table(title=f"tensor-parallel strategy of each op in one {d['block_type']} (tp={m['tp']})")
        ops.add_column("#", justify="right")
        ops.add_column("op")
        ops.add_column("strategy [inputs->output | input gradients]")
        for o in d["block_ops"]:
            if not o["strategy"].startswith("replicate") or m["tp"] == 1:
                ops.add_row(str(o["index"]), o["op"], o["strategy"])
        console.print(ops)
    if d["alternatives"]:
        alts = Table(title="why the alternatives lost")
        for col in ("spec", "step ms", "vs best", "memory GiB", "why"):
            alts.add_column(col)
        for a in d["alternatives"]:
            alts.add_row(a["spec"], "-" if a["step_ms"] is None else f"{a['step_ms']:.1f}",
                         "-" if a["delta_ms"] is None else f"{a['delta_ms']:+.1f} ms",
                         "-" if a["memory_gib"] is None else f"{a['memory_gib']:.1f}", a["why"])
        console.print(alts)


def draw_gantt(plan: Plan, path: str) -> None:
    """The simulated schedule, one row per pipeline rank: forward, backward (or its input- and
    weight-gradient halves) and DP sync bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = simulate_plan(plan)
    pp = plan.mesh.pp
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * pp))
    colors = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#DD8452", "GRAD_SYNC": "#999999"}
    for ev in sim.timeline:
        kind = ev.action.kind
        y = ev.rank + (0.35 if ev.stream == "comm" else 0.0)
        height = 0.25 if ev.stream == "comm" else 0.6
        ax.broken_barh([(ev.start_s * 1e3, (ev.end_s - ev.start_s) * 1e3)], (y - 0.3, height),
                       facecolors=colors.get(kind, "#C44E52"), edgecolor="white", linewidth=0.3)
        width = (ev.end_s - ev.start_s) / max(sim.step_time_s, 1e-12)
        if kind in ("F", "B", "I", "W") and width > 0.012:
            ax.text((ev.start_s + ev.end_s) / 2 * 1e3, y, str(ev.action.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    backward = "green I (input grad), orange W (weight grad)" if any(
        ev.action.kind == "W" for ev in sim.timeline) else "green B"
    ax.set_title(f"{plan.model.name}: {plan.schedule}, pp={pp}, vpp={plan.mesh.vpp}, "
                 f"{plan.num_micro_batches} micro-batches, step {sim.step_time_s * 1e3:.0f} ms, "
                 f"bubble {sim.bubble_fraction:.1%} (blue F, {backward}, grey DP sync; numbers = micro-batch)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
