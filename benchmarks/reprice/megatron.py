"""Every published Megatron-LM run (SC'21 Tables 1-2) predicted with its own configuration (issues 3, 4).

For each row: the GPT model (tied embeddings, vocabulary 51,200, sequence 2048, attention with the
score matrix materialized as Megatron-LM ran it in 2021, before fused attention) is captured once,
the `dgx-a100` cluster gets the row's node count, and two predictions are made by the same cost
model:
  * `own`: the row's TP, PP and DP, full recomputation, no sequence parallelism, no distributed
    optimizer (as in 2021), fp16 gradients (below), in the layout the paper publishes: its micro-batch
    size where it reports one (1 in Table 2), and for Table 1's pipelined rows the interleaved
    schedule it reports. What the paper leaves out (Table 1's micro-batch size, the number of
    virtual stages, Table 2's schedule) spans the candidates, up to 24 a row;
  * `auto`: the planner's free choice (TP kept inside a node).
The predicted TFLOP/s per GPU counts the recomputed forward (Narayanan eq. 3), as the paper does.

Data parallelism as the paper's code ran it (Megatron-LM at 8cfef1b, April 2021, the release that
went with the paper; assumptions where the paper is silent):
  * fp16 gradients: its GPT-3 script (examples/pretrain_gpt3_175B.sh) trains with --fp16 and
    without --accumulate-allreduce-grads-in-fp32, so the DDP buffer takes the parameters' dtype
    (megatron/model/distributed.py, `_get_buffer_type`) and the all-reduce moves 2 bytes a
    parameter; the fp16 optimizer keeps fp32 copies of them (`fp32_grad_copy`). Until 2026-12-05
    this calibration priced fp32 gradients (Megatron's bf16 rule), twice the bytes;
  * `--DDP-impl local`, the default: `allreduce_gradients()` reduces each model chunk's whole
    buffer in one call after the pipeline schedule returns (megatron/training.py, `train_step`):
    no buckets, no overlap with backward; a pipeline rank's sync hides only behind the other
    ranks' drain (cost_models/simulator.py). torch's DDP (`--DDP-impl torch`) would overlap it;
    the paper does not say which its runs used;
  * NCCL's rings across nodes, 32-way DP paced by the NICs the group owns on each node
    (cost_models/collective_cost.py).
`--before FILE` sets the per-row errors of an earlier run of this case beside this run's.

The row's score is the median candidate by predicted step time (the lower median: for an even
count, the faster of the two middle ones), among those predicted to fit (all of them if none
does). Not the fastest: the model predicts low on most rows, so its fastest candidate is also
its closest, and scoring it would pick the candidate that flatters the model. The spread is
stated beside it: per row the error of the fastest, the median and the slowest candidate, and
over the table the largest and mean |error| under each.

    PYTHONPATH=. python -m benchmarks.reprice megatron --out benchmarks/results/megatron-calibration-2026-12-05.json
    PYTHONPATH=. python -m benchmarks.reprice megatron --before OLD.json \\
        --out benchmarks/results/megatron-calibration-2026-12-05-dp.json
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.report import machine_header
from benchmarks.reprice.pricing import Committed, capture, cluster, error, print_table
from mplan.cost_models.megatron_reference import MegatronRun, load_megatron_runs
from mplan.models import GPTConfig
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.search import Planner

RULES = {rule: f"{rule}_candidate_error" for rule in ("fastest", "median", "slowest")}
"""the spread over a row's candidates: each rule's error key"""
BEFORE_KEYS = ("own_spec", "own_step_s", "own_error", *RULES.values(), "auto_spec", "auto_vs_own")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference", default=None, help="megatron-sc21-a100.json's path (default: mplan's)")
    parser.add_argument("--before", default=None,
                        help="a results file this case wrote earlier: its per-row errors are set beside this run's")
    parser.add_argument("--before-note", default="", help="what the --before run was (its commit)")


def own_configs(run: MegatronRun) -> list[ParallelConfig]:
    """The row's own TP/PP/DP in its published layout, with each micro-batch size and interleaving
    depth Megatron allows where the paper does not report them."""
    configs = []
    per_replica = run.global_batch // run.dp
    for mbs in ([run.micro_batch] if run.micro_batch else [1, 2, 4, 8]):
        if per_replica % mbs:
            continue
        m = per_replica // mbs
        interleaved = [("interleaved", v) for v in (2, 3, 4, 6, 8)
                       if run.pp > 1 and run.layers % (run.pp * v) == 0 and m % run.pp == 0]
        # a pipelined row the paper ran interleaved (Table 1, not "1F1B or interleaved") keeps 1F1B only
        # where no interleaving divides it
        plain = [] if interleaved and run.schedule.lower().startswith("interleaved") else [("1f1b", 1)]
        for schedule, vpp in plain + interleaved:
            configs.append(ParallelConfig(dp=run.dp, tp=run.tp, pp=run.pp, vpp=vpp, mbs=mbs, num_micro_batches=m,
                                          sp=False, zero=0, recompute="full", schedule=schedule))
    return configs


def planner_for(run: MegatronRun) -> Planner:
    """The row's model on its DGX A100 nodes, priced as Megatron-LM ran it (module docstring)."""
    config = GPTConfig(name=run.id, num_layers=run.layers, hidden=run.hidden, num_heads=run.heads,
                       seq_len=run.seq_len, vocab=run.vocab, tie_embeddings=True, fused_attention=False)
    nodes = run.num_gpus // run.gpus_per_node
    # fp16 gradients all-reduced as they are, with fp32 copies in the optimizer
    return Planner(capture(config, run.seq_len), cluster("dgx-a100", nodes=nodes), grad_dtype="fp16",
                   fp32_grad_copy=True, runtime="megatron")


def calibrate(run: MegatronRun, *, with_auto: bool = True) -> dict[str, Any]:
    planner = planner_for(run)
    estimates = [planner.evaluate(c, fast=False) for c in own_configs(run)]
    fitting = [e for e in estimates if e.fits] or estimates  # Megatron ran it: keep it even if we think it does not fit
    by_time = sorted(fitting, key=lambda e: e.step_time_s)
    own = by_time[(len(by_time) - 1) // 2]  # the rule: the (lower) median predicted candidate that fits
    flops = run.recompute_counted_flops()

    def tflops(e: Any) -> float:
        return flops / e.step_time_s / run.num_gpus / 1e12

    row = {"id": run.id, "gpus": run.num_gpus, "tp": run.tp, "pp": run.pp, "dp": run.dp, "batch": run.global_batch,
           "measured_tflops": run.measured_tflops_with_recompute, "measured_step_s": run.measured_step_s(),
           "own_spec": own.config.spec(), "own_step_s": own.step_time_s, "own_tflops": tflops(own),
           "own_memory_gib": own.peak_memory_bytes / 2**30, "own_fits": own.fits,
           "own_error": error(tflops(own), run.measured_tflops_with_recompute)}
    errors = [error(tflops(e), run.measured_tflops_with_recompute) for e in by_time]
    row.update(candidates=len(by_time), candidate_errors_fastest_first=errors, fastest_candidate_error=errors[0],
               median_candidate_error=errors[(len(errors) - 1) // 2], slowest_candidate_error=errors[-1])
    if with_auto:
        auto = planner.search(run.global_batch).best
        row.update(auto_spec=auto.config.spec(), auto_step_s=auto.step_time_s,
                   auto_tflops_recompute_convention=tflops(auto), auto_vs_own=own.step_time_s / auto.step_time_s,
                   auto_tp_within_node=auto.config.tp <= planner.cluster.gpus_per_node)
    return row


def set_beside(rows: list[dict[str, Any]], path: str, note: str) -> dict[str, Any]:
    """Each row's errors in the earlier results file at `path` (written by this case) under the
    row's "before" key; the earlier file's summary, returned."""
    earlier = Committed(path)
    by_id = {row["id"]: row for row in earlier.at("rows")}
    for row in rows:
        row["before"] = {key: value for key, value in by_id.get(row["id"], {}).items() if key in BEFORE_KEYS}
    return {"priced_by": machine_header(), "note": note, "date": earlier.at("date"), "max_abs_error": earlier.at("max_abs_error"),
            "mean_abs_error": earlier.at("mean_abs_error"), "candidate_spread": earlier.data.get("candidate_spread")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.time()
    rows = [calibrate(run) for run in load_megatron_runs(args.reference)]
    spread = {}
    for rule, key in RULES.items():
        abs_errors = [abs(r[key]) for r in rows]
        spread[rule] = {"max_abs_error": max(abs_errors), "mean_abs_error": sum(abs_errors) / len(abs_errors),
                        "rows_predicted_low": sum(r[key] < 0 for r in rows)}
    doc = {"date": time.strftime("%Y-%m-%d"),
           "cluster": "dgx-a100 preset (datasheet, published NCCL and matmul figures)",
           "rule": "own = the lower-median predicted candidate that fits, among the row's published layout "
                   "(micro-batch size where reported, interleaved where Table 1 says so) x what the paper "
                   "leaves out (micro-batch size, interleaving depth); max_abs_error and mean_abs_error "
                   "are under this rule",
           **{key: spread["median"][key] for key in ("max_abs_error", "mean_abs_error")}, "candidate_spread": spread,
           "auto_never_slower": all(r["auto_vs_own"] >= 1 - 1e-9 for r in rows),
           "seconds": round(time.time() - start, 1), "rows": rows}
    if args.before:
        doc["before"] = set_beside(rows, args.before, args.before_note)
    print_table([{**r, "before_error": r.get("before", {}).get("own_error")} for r in rows],
                {"id": "", "measured_tflops": ".0f", "own_tflops": ".1f", "before_error": "+.1%", "own_error": "+.1%",
                 **{key: "+.1%" for key in RULES.values()}, "own_fits": "", "own_spec": "", "auto_vs_own": ".2f"})
    print_table([{"rule": rule, **s} for rule, s in spread.items()],
                {"rule": "", "max_abs_error": ".1%", "mean_abs_error": ".1%", "rows_predicted_low": ""})
    return doc
