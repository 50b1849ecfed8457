"""Does the planner price a step replayed as a CUDA graph, and the same step launched from Python?

The race of 2026-12-06 on one H100 (benchmarks/models/peers.py, session 14) timed each family's mplan step
twice in the same rounds: with its CUDA graphs (`mplan`, autoparallel's default for one rank on a
GPU) and without (`mplan_eager`). Here, on a CPU, the planner prices the same families, configs,
batches and plan (dp=1, tp=1, pp=1, fused kernels, bf16) on the H100 profile committed beside them
(`profile_h100-2026-12-05.json`), once as a graph replays (`Planner(cuda_graphs=True)`: the
program's ops cost the host nothing per step) and once eager (the runtime's host factor per op),
and sets each price beside its measurement: predicted / measured - 1. Beside the graphed step, the
planner's device milliseconds by kernel category (`device_categories`) and the race's torch.profiler
kernel breakdown of the same step (`KERNEL_PROFILES`): where a family's price goes wrong.

    PYTHONPATH=. python -m benchmarks.reprice races --out benchmarks/results/graph_price-cpu-2026-12-06.json
    PYTHONPATH=. python -m benchmarks.reprice races --profile profile_h100-2026-12-06-graphed.json \\
        --out benchmarks/results/graph_price-cpu-2026-12-06-graphed-profile.json

Captures with this machine's transformers (the race's: 5.17); a family's capture takes 10-60 s.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.models.families import family
from benchmarks.report import machine_header
from benchmarks.reprice.pricing import Committed, capture, cluster, error, print_table
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.parallel_config import parse_plan_spec
from mplan.planner.search import Planner

PROFILE = "profile_h100-2026-12-05.json"
RACES = {"gemma3": "peers_h100-2026-12-06-session14-b.json", "qwen3_moe": "peers_h100-2026-12-06-session14-c.json",
         "gemma2": "peers_h100-2026-12-06-session14-c.json", "granite": "peers_h100-2026-12-06-session14-a.json"}
"""Each family's race file: the graphed and eager steps were timed in the same rounds there (granite's
graphs were refused in that call, so its two rows are both eager steps)."""
KERNEL_PROFILES = {**dict.fromkeys(("gemma3", "gemma2", "granite"), "peers_h100-2026-12-06-session14-a.json"),
                   "qwen3_moe": "peers_h100-2026-12-06-session13-c.json"}
"""Where each family's graphed step was profiled by kernel on the same card (torch.profiler, `models peers --profile`):
qwen3_moe's only in session 13 (older code than session 14's: compare its categories, not its total)."""
PLAN = "dp=1,tp=1,pp=1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", default=",".join(RACES))
    parser.add_argument("--profile", default=PROFILE,
                        help="the card's profile to price on (default: the one of the races' day, kernels timed one "
                             "eager call at a time; profile_h100-2026-12-06-graphed.json times them as graph replays)")


def _category(node: Any, coster: Any) -> str:
    """The kernel category one priced op falls in, named as the race's kernel profile names them
    where one matches (gemm, attention, loss, optimizer, rope); a fused chain by its kernel."""
    from mplan.ir.op_table import op_packet

    chain, save = coster.fused.get(node.name), coster.saves.get(node.name)
    if node.kind == "attention" or (save is not None and save.kernel == "attention"):
        return "attention"  # eager attention's chain is priced on its last matmul, as one SDPA call
    if op_packet(node.op) == "moe_experts" or node.kind == "matmul":
        return "gemm"
    if chain is not None:
        return {"linear_cross_entropy": "loss", "rope": "rope"}.get(chain.op, chain.op)
    return "memory-bound (unfused)"


def device_categories(planner: Planner, best: Any, global_batch: int) -> dict[str, float]:
    """The planner's device milliseconds of one step of `best` (one rank, cp = 1) by kernel category:
    each op's forward and backward price on its solved sharding, times the micro-batches, and the
    optimizer's step."""
    from mplan.ir.rebatch import rebatch

    config = best.config
    model = planner.sharded(config.tp, config.sp)
    planner.units(config.tp, config.sp, config.mbs)  # solves the micro-batch's sharding
    graph = rebatch(planner.captured, config.mbs) if planner.dynamic else planner.graph
    choice = model.shardings[config.mbs].choice
    micro_batches = global_batch // (config.mbs * config.dp)
    totals: dict[str, float] = {}
    for segment in graph.segments:
        names = segment.nodes or (graph.block_type(segment.block_type).template if segment.block_type else ())
        for node in graph.nodes_of(names):
            cost = model.coster.op(node, choice[node.name])
            key = _category(node, model.coster)
            totals[key] = totals.get(key, 0.0) + (cost.forward_s + cost.backward_s) * micro_batches * 1e3
    totals["optimizer"] = best.optimizer_s * 1e3
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def price(name: str, card: ClusterSpec) -> dict[str, Any]:
    """The planner's step for one family, graphed and eager, beside the race's measurements."""
    import transformers

    fam = family(name, small=False)
    race, profiled = Committed(RACES[name]), Committed(KERNEL_PROFILES[name])
    with torch.device("meta"):
        model = getattr(transformers, fam.model_class)(fam.config()).to(torch.bfloat16)
    start = time.perf_counter()
    graph = capture(model, fam.seq, fam.batch)
    row: dict[str, Any] = {"batch": fam.batch, "seq": fam.seq, "capture_s": round(time.perf_counter() - start, 1),
                           "race": RACES[name]}
    for system, graphs in (("mplan", True), ("mplan_eager", False)):
        planner = Planner(graph, card, kernels=True, runtime="mplan", cuda_graphs=graphs)
        estimate = planner.search(fam.batch, parse_plan_spec(PLAN)).best
        if graphs:
            kernels = profiled.at("families", name, "profile", "mplan")
            row["device_ms"] = {"predicted": device_categories(planner, estimate, fam.batch),
                                "measured": kernels["by_category_ms"],
                                "measured_total": kernels["gpu_kernel_ms_per_step"],
                                "measured_in": KERNEL_PROFILES[name]}
        measured = race.at("families", name, "systems", system)
        row[system] = {"cuda_graphs": graphs, "mbs": estimate.config.mbs, "predicted_ms": estimate.step_time_s * 1e3,
                       "measured_ms": measured["step_s"] * 1e3, "replayed": measured.get("cuda_graphs"),
                       "error": error(estimate.step_time_s, measured["step_s"])}
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    card = cluster(args.profile)
    families = {name: price(name, card) for name in args.families.split(",")}
    print_table([{"family": name, "system": system, **row[system]} for name, row in families.items()
                 for system in ("mplan", "mplan_eager")],
                {"family": "", "system": "", "mbs": "", "predicted_ms": ".1f", "measured_ms": ".1f", "error": "+.1%"})
    return {"priced_by": machine_header(), "date": time.strftime("%Y-%m-%d"), "machine": "cpu (prices only)", "torch": torch.__version__,
            "transformers": transformers.__version__, "profile": Path(args.profile).name, "plan": PLAN,
            "families": families}
