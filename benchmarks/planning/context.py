"""The long-context plans issue 34 asks for, as the planner predicts them (nothing here is measured):
an 8B Llama-3 shape at 131072 tokens on 8 DGX H100 nodes (64 GPUs), and a 405B-class shape at
131072 tokens on 2048 nodes (16384 GPUs).

    python -m benchmarks.planning context -o benchmarks/results/context_plans-predicted-2026-12-06.json
(that result made before the harness, by `python benchmarks/context_plans.py` with the same flags)

For each job: the plan the search chooses (`mplan.plan`, mplan's runtime, fused kernels priced),
its mesh, predicted step, memory and MFU per GPU, each cp method's exchange at its layout (the
Plan's `context.*` figures), its alternatives with why each lost, the best plan the search finds
with cp held to 1 (`spec="cp=1"`) and the best at each recomputation mode with cp=1 (or why none
fits), planned in the same process; plus the planning seconds of
both (CPU seconds of this process, its threads included, and wall seconds: a loaded machine
stretches wall time, CPU time far less).

Global batches: 32 sequences of 131072 tokens (4M tokens) for the 8B; 128 (16M tokens, Llama 3
405B's batch at that length: "The Llama 3 Herd of Models", 2024, table 4) for the 405B.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import mplan
from benchmarks.report import machine_header
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.explain import explain_data
from mplan.planner.search import PlanningError

JOBS = {
    "llama3-8b-shape": ("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=131072", 8, 32),
    "llama3-405b-shape": ("llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=131072",
                          2048, 128),
}


def _timed_plan(model: str, nodes: int, global_batch: int, spec: str) -> tuple[mplan.Plan, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    plan = mplan.plan(model, cluster=ClusterSpec.preset("dgx-h100", nodes=nodes), global_batch=global_batch,
                      spec=spec, runtime="mplan", progress="quiet")
    return plan, time.process_time() - cpu, time.perf_counter() - wall


def _figures(plan: mplan.Plan, cpu_s: float, wall_s: float) -> dict[str, Any]:
    p = plan.predicted
    return {"spec": plan.spec(), "mesh": {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp,
                                          "vpp": plan.mesh.vpp, "cp": plan.mesh.cp,
                                          "cp_method": plan.mesh.cp_method if plan.mesh.cp > 1 else None},
            "recompute": plan.recompute, "zero": plan.zero, "schedule": plan.schedule,
            "micro_batch_size": plan.micro_batch_size, "num_micro_batches": plan.num_micro_batches,
            "step_time_s": p.step_time_s, "memory_gib": p.memory_gib, "mfu": p.mfu,
            "tflops_per_gpu": p.tflops_per_gpu, "tokens_per_s": p.tokens_per_s,
            "bubble_fraction": p.bubble_fraction, "context": explain_data(plan)["context"],
            "alternatives": [{"spec": a.spec, "step_time_s": None if a.predicted is None else a.predicted.step_time_s,
                              "memory_gib": None if a.predicted is None else a.predicted.memory_gib, "why": a.why}
                             for a in plan.alternatives],
            "candidates": plan.planner.get("candidates"), "planning_cpu_s": round(cpu_s, 2),
            "planning_wall_s": round(wall_s, 2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=sorted(JOBS))


def run(args: argparse.Namespace) -> dict[str, Any]:
    jobs: dict[str, Any] = {}
    for name, (model, nodes, batch) in JOBS.items():
        if args.only and name != args.only:
            continue
        chosen = _figures(*_timed_plan(model, nodes, batch, "auto"))
        without = _figures(*_timed_plan(model, nodes, batch, "cp=1"))
        by_recompute = {}
        for recompute in ("none", "selective", "full"):
            try:
                by_recompute[recompute] = _figures(*_timed_plan(model, nodes, batch, f"cp=1,recompute={recompute}"))
            except PlanningError as refused:  # nothing fits: the refusal says by how much
                by_recompute[recompute] = {"error": str(refused)}
        jobs[name] = {"model": model, "cluster": f"dgx-h100 x{nodes}", "world_size": nodes * 8,
                      "global_batch": batch, "seq_len": 131072, "chosen": chosen, "best_without_cp": without,
                      "best_without_cp_by_recompute": by_recompute,
                      "cp_speedup": without["step_time_s"] / chosen["step_time_s"]}
        print(f"{name}: {chosen['spec']} {chosen['step_time_s']:.2f} s, {chosen['memory_gib']:.1f} GiB; "
              f"without cp {without['spec']} {without['step_time_s']:.2f} s")
    return {"what": "predicted plans at 131072 tokens (issue 34): datasheet H100 figures, nothing measured",
            **machine_header(), "jobs": jobs}
