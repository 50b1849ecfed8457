"""A steps run's rows predicted by the planner: single-GPU steps, measured against the cost model (issue 3).

On a CPU: reads what `steps` wrote and predicts each configuration with the planner's own evaluator on a
cluster preset (`--cluster`, default `h200`, which carries the profile measured on that GPU,
mplan/cost_models/profiles/h200.json): same model, batch, bf16 parameters and gradients, ZeRO-1 fp32
master weights on one rank. Memory is compared with `max_memory_allocated`, so the allocator's
fragmentation share is left out of the prediction (it is not in that counter). The report's `priced_by`
names the checkout and machine that priced it.

    PYTHONPATH=. python -m benchmarks.calibration steps-check benchmarks/results/h200_step-2026-11-29.json \
        --out benchmarks/results/h200_calibration-2026-11-29.json

(benchmarks/results/h200_calibration-2026-11-29*.json were made by the old `python
benchmarks/step_calibration.py check benchmarks/results/h200_step-2026-11-29.json -o FILE`, whose rows
this case gives figure for figure on the same input and checkout.)
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.calibration.gpu import GiB
from benchmarks.report import machine_header
from mplan.cost_models.cluster import ClusterSpec
from mplan.models import GPTConfig, LlamaConfig, build_model
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("measured", help="what `steps` wrote (e.g. benchmarks/results/h200_step-2026-11-29.json)")
    parser.add_argument("--cluster", default="h200", help="the cluster preset the predictions run on")


def model_of(row: dict[str, Any]) -> GPTConfig | LlamaConfig:
    c = row["config"]
    common = dict(name=row["name"], num_layers=c["num_layers"], hidden=c["hidden"], num_heads=c["num_heads"],
                  seq_len=c["seq_len"], vocab=c["vocab"], tie_embeddings=c["tie_embeddings"])
    if row["family"] == "gpt":
        return GPTConfig(**common)
    return LlamaConfig(**common, num_kv_heads=c["kv_heads"], ffn_hidden=c["ffn"],
                       rope_theta=500000.0 if c["vocab"] == 128256 else 10000.0)


def predict(row: dict[str, Any], cluster: str) -> dict[str, Any]:
    config = model_of(row)
    model = build_model(config, device="meta", dtype=torch.bfloat16)  # priced in the dtype it trains in
    graph = capture_for_planning(model, (torch.zeros(1, config.seq_len, dtype=torch.long),))
    # Priced as on 2026-11-29, with Megatron-LM's accounting (gradients held beside the
    # activations). Priced for mplan's runtime (at dp=1 the gradients replace the activations as
    # backward frees them) the peaks come out ~7% low, the gap `mplan bench --measure` shows on
    # Hugging Face models (-6.6%, benchmarks/results/hf_bench_h200-2026-12-02.json): open in issue 19.
    planner = Planner(graph, ClusterSpec.preset(cluster), grad_dtype="bf16", fp32_grad_copy=True, runtime="megatron")
    estimate = planner.evaluate(ParallelConfig(dp=1, tp=1, pp=1, mbs=row["batch"], num_micro_batches=1, zero=1),
                                fast=False, fragmentation=0.0)
    mem = estimate.memory[0]
    return {"step_s": estimate.step_time_s, "peak_gib": mem.total_bytes / GiB,
            "breakdown_gib": {k: v / GiB for k, v in mem.as_dict().items()} if hasattr(mem, "as_dict") else {},
            "optimizer_s": estimate.optimizer_s, "compute_s": estimate.compute_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each measured row against the planner's prediction on `args.cluster`."""
    with open(args.measured) as f:
        measured = json.load(f)
    rows = []
    for row in measured["rows"]:
        p = predict(row, args.cluster)
        rows.append({"name": row["name"], "num_parameters": row["num_parameters"], "batch": row["batch"],
                     "measured_step_s": row["step_s"], "predicted_step_s": p["step_s"],
                     "step_error": p["step_s"] / row["step_s"] - 1,
                     "measured_peak_gib": row["peak_allocated_gib"], "predicted_peak_gib": p["peak_gib"],
                     "memory_error": p["peak_gib"] / row["peak_allocated_gib"] - 1,
                     "predicted_breakdown_gib": p["breakdown_gib"], "predicted_optimizer_s": p["optimizer_s"]})
        r = rows[-1]
        print(f"{r['name']:>14}: step {r['measured_step_s'] * 1e3:7.1f} ms measured, "
              f"{r['predicted_step_s'] * 1e3:7.1f} predicted ({r['step_error']:+.1%}); "
              f"peak {r['measured_peak_gib']:6.2f} GiB measured, "
              f"{r['predicted_peak_gib']:6.2f} predicted ({r['memory_error']:+.1%})")
    return {"measured_file": args.measured, "cluster": args.cluster, "gpu": measured["gpu"], "date": measured["date"],
            "torch_on_gpu": measured["torch"], "priced_by": machine_header(), "rows": rows}
