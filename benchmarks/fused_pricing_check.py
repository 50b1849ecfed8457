"""The planner's price of fused kernels against the H200's measurement (runs on a CPU).

For the two models of benchmarks/e2e.py, predicts one training step on one H200 (the
`h200` preset, which carries the profile measured on that GPU) three ways: every op priced on
its own and the optimizer as torch's fused AdamW (as eager runs them), with the memory-bound
chains priced as mplan's fused kernels (mplan/planner/fused_pricing.py) and the optimizer as
mplan's AdamW kernel (mplan/planner/evaluate.py), and with the block linears as FP8 GEMMs on
top. Compares them with the eager, mplan and mplan_fp8 step times measured in one run
(benchmarks/results/e2e_h200-2026-11-29*.json), and the predicted gains with the measured ones.

    python benchmarks/fused_pricing_check.py benchmarks/results/e2e_h200-2026-11-29-session4.json \
        -o benchmarks/results/fused_pricing_check-2026-11-29-session5.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e import FULL  # noqa: E402
from mplan.cost_models.cluster import ClusterSpec  # noqa: E402
from mplan.models import build_model  # noqa: E402
from mplan.planner.parallel_config import ParallelConfig  # noqa: E402
from mplan.planner.planning import capture_for_planning  # noqa: E402
from mplan.planner.search import Planner  # noqa: E402


def predict_step_s(workload: Any, kernels: bool, fp8: bool = False) -> float:
    model = build_model(workload.config, device="meta", dtype=torch.bfloat16)  # priced in the dtype it trains in
    graph = capture_for_planning(model, (torch.zeros(1, workload.config.seq_len, dtype=torch.long),))
    planner = Planner(graph, ClusterSpec.preset("h200"), grad_dtype="bf16", fp32_grad_copy=False, kernels=kernels,
                      fp8=fp8)
    config = ParallelConfig(dp=1, tp=1, pp=1, mbs=workload.batch, num_micro_batches=1)
    return planner.evaluate(config, fast=False, fragmentation=0.0).step_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measured")
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    with open(args.measured, encoding="utf-8") as handle:
        measured = json.load(handle)
    rows = {}
    for workload in FULL:
        systems = measured["models"][workload.name]["systems"]
        eager_s, mplan_s = systems["eager"]["step_s"], systems["mplan"]["step_s"]
        fp8_measured_s = systems["mplan_fp8"]["step_s"]
        unfused_s, fused_s = predict_step_s(workload, kernels=False), predict_step_s(workload, kernels=True)
        fp8_s = predict_step_s(workload, kernels=True, fp8=True)
        rows[workload.name] = {
            "measured_eager_s": eager_s, "measured_mplan_s": mplan_s, "measured_mplan_fp8_s": fp8_measured_s,
            "predicted_unfused_s": unfused_s, "predicted_fused_s": fused_s, "predicted_fp8_s": fp8_s,
            "unfused_error": unfused_s / eager_s - 1, "fused_error": fused_s / mplan_s - 1,
            "fp8_error": fp8_s / fp8_measured_s - 1,
            "measured_gain": eager_s / mplan_s, "predicted_gain": unfused_s / fused_s,
            "measured_fp8_gain": mplan_s / fp8_measured_s, "predicted_fp8_gain": fused_s / fp8_s,
        }
        r = rows[workload.name]
        print(f"{workload.name}: eager {eager_s * 1e3:.1f} ms measured, {unfused_s * 1e3:.1f} predicted "
              f"({r['unfused_error']:+.1%}); mplan {mplan_s * 1e3:.1f} measured, {fused_s * 1e3:.1f} predicted "
              f"({r['fused_error']:+.1%}); gain {r['measured_gain']:.3f}x measured, {r['predicted_gain']:.3f}x "
              f"predicted; FP8 {fp8_measured_s * 1e3:.1f} ms measured, {fp8_s * 1e3:.1f} predicted "
              f"({r['fp8_error']:+.1%}), gain over bf16 {r['measured_fp8_gain']:.3f}x measured, "
              f"{r['predicted_fp8_gain']:.3f}x predicted")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"measured_file": args.measured, "gpu": measured["gpu"], "date": measured["date"],
                       "cluster": "h200 preset (profile measured on the H200)", "rows": rows}, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
