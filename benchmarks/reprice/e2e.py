"""The planner's price of fused kernels against a `models e2e` run on the H200 (mplan's own models).

For the two models of benchmarks/models/e2e.py, predicts one training step on one H200 (the `h200`
preset, which carries the profile measured on that GPU) three ways: every op priced on its own and
the optimizer as torch's fused AdamW (as eager runs them), with the memory-bound chains priced as
mplan's fused kernels (mplan/planner/fused_pricing.py) and the optimizer as mplan's AdamW kernel
(mplan/planner/evaluate.py), and with the block linears as FP8 GEMMs on top. Compares them with
the eager, mplan and mplan_fp8 step times measured in one run (benchmarks/results/e2e_h200-2026-11-29*.json),
and the predicted gains with the measured ones.

    PYTHONPATH=. python -m benchmarks.reprice e2e benchmarks/results/e2e_h200-2026-11-29-session4.json \\
        --out benchmarks/results/fused_pricing_check-2026-11-29-session5.json
    PYTHONPATH=. python -m benchmarks.reprice e2e benchmarks/results/e2e_h200-2026-11-29-session7.json \\
        --out benchmarks/results/fused_pricing_check-2026-11-29-session7.json
"""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.models.workloads import FULL
from benchmarks.report import machine_header
from benchmarks.reprice.pricing import Committed, capture, cluster, error, print_table
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.search import Planner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("measured", help="a `models e2e` result file (e2e_h200-*.json)")


def predict_step_s(workload: Any, kernels: bool, fp8: bool = False) -> float:
    """One step of `workload` at its batch on one H200, as one micro-batch (the e2e run's plan)."""
    planner = Planner(capture(workload.config, workload.config.seq_len), cluster("h200"), grad_dtype="bf16",
                      fp32_grad_copy=False, kernels=kernels, fp8=fp8)
    config = ParallelConfig(dp=1, tp=1, pp=1, mbs=workload.batch, num_micro_batches=1)
    return planner.evaluate(config, fast=False, fragmentation=0.0).step_time_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    measured = Committed(args.measured)
    rows = {}
    for workload in FULL:
        eager_s, mplan_s, fp8_measured_s = (measured.at("models", workload.name, "systems", system, "step_s")
                                            for system in ("eager", "mplan", "mplan_fp8"))
        unfused_s, fused_s = predict_step_s(workload, kernels=False), predict_step_s(workload, kernels=True)
        fp8_s = predict_step_s(workload, kernels=True, fp8=True)
        rows[workload.name] = {
            "measured_eager_s": eager_s, "measured_mplan_s": mplan_s, "measured_mplan_fp8_s": fp8_measured_s,
            "predicted_unfused_s": unfused_s, "predicted_fused_s": fused_s, "predicted_fp8_s": fp8_s,
            "unfused_error": error(unfused_s, eager_s), "fused_error": error(fused_s, mplan_s),
            "fp8_error": error(fp8_s, fp8_measured_s), "measured_gain": eager_s / mplan_s,
            "predicted_gain": unfused_s / fused_s, "measured_fp8_gain": mplan_s / fp8_measured_s,
            "predicted_fp8_gain": fused_s / fp8_s}
    print_table([{"model": name, **row} for name, row in rows.items()],
                {"model": "", "unfused_error": "+.1%", "fused_error": "+.1%", "fp8_error": "+.1%",
                 "measured_gain": ".3f", "predicted_gain": ".3f"})
    return {"priced_by": machine_header(), "measured_file": args.measured, "gpu": measured.at("gpu"), "date": measured.at("date"),
            "cluster": "h200 preset (profile measured on the H200)", "rows": rows}
