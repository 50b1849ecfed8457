"""One host factor fitted on one measured H100 step, held out on the others (issue 30).

How far the host term's micro-benchmarks are from mplan's own runtime, from GPU measurements already taken.

The host figures `mplan profile` measures (`measure_device.measure_host`) time tiny eager ops, one
kind at a time. mplan's training step pays more per op than such a stream: its fused kernels are
autograd Functions whose Python forward and backward allocate and launch several kernels, the
local program is an FX module, and each micro-batch runs its own hooks. On an H100 a host-bound
step (micro-batch 1) of a Qwen2-0.5B config measured 117 ms a micro-batch where the priced host
term said far less. This case asks whether one factor on every host figure closes that gap:

1. read the measured rows: `host_overhead_h100-2026-12-05.json` (Qwen2-0.5B, 8 x 1024 tokens, at
   micro-batch 1, 2 and 8) and the `hf_measure` rows (Qwen3-1.7B and SmolLM2-1.7B shapes, 8 x 2048
   tokens, micro-batch 1 and 8), all on one H100, and the H100's profile from the same session
   (`profile_h100-2026-12-05.json`, its kernel tables and measured host figures);
2. fit f on the FIT row alone (Qwen2-0.5B at micro-batch 1, the most host-bound), by bisection on
   the predicted step time with every host figure scaled by f (the Planner's `host_factor`);
3. predict every other row at f = 1 (as measured) and at the fitted f: those are held out.

    PYTHONPATH=. python -m benchmarks.reprice host-fit --out benchmarks/results/host_factor_fit-cpu-2026-12-05.json
"""
from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.report import machine_header
from benchmarks.reprice.pricing import RESULTS, Committed, capture, cluster, error, print_table
from mplan.planner.parallel_config import parse_plan_spec
from mplan.planner.search import Planner

OVERHEAD = "host_overhead_h100-2026-12-05.json"
PROFILE = "profile_h100-2026-12-05.json"
FIT = ("qwen2-0.5b", 1)
"""The one row the factor is fitted on: the most host-bound step measured."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-rows", nargs="*", type=Path,
                        default=sorted(RESULTS.glob("hf_measure_h100-2026-12-05_work/*_rows.json")),
                        help="bench-cli's per-model rows files (default: those of the 2026-12-05 H100 run)")


def measured_rows(hf_rows: list[Path]) -> list[dict[str, Any]]:
    """(model, config path, seq, mbs, measured step s), from the results files."""
    from benchmarks.calibration import bench_cli
    from benchmarks.calibration import host

    work, overhead = Path(tempfile.mkdtemp(prefix="host_fit")), Committed(OVERHEAD)
    qwen2 = work / "qwen2-0.5b.json"
    host.write_config(overhead.at("config"), qwen2)
    rows = [{"model": "qwen2-0.5b", "config": qwen2, "seq": overhead.at("seq_len"), "mbs": r["mbs"],
             "measured_step_s": r["measured_step_s"], "source": OVERHEAD}
            for r in overhead.at("comparison", "rows") if r["measured_step_s"]]
    for path in hf_rows:
        name = path.name.split("_rows")[0]
        config = bench_cli.write_config(name, work, small=False)
        for r in Committed(path).at("plans"):
            step = (r.get("measured") or {}).get("step_time_s")
            if step:
                rows.append({"model": name, "config": config, "seq": 2048, "mbs": parse_plan_spec(r["spec"]).mbs,
                             "spec": r["spec"], "measured_step_s": step, "source": path.name})
    return rows


def pricer() -> Callable[[dict[str, Any], float], float]:
    """Predicted step seconds of a row's plan under a host factor, on the H100's profile; one capture per model."""
    card, graph = cluster(PROFILE), functools.cache(capture)

    def step_s(row: dict[str, Any], factor: float) -> float:
        planner = Planner(graph(row["config"], row["seq"]), card, kernels=True, runtime="mplan", host_factor=factor)
        spec = row.get("spec") or f"dp=1,tp=1,pp=1,mbs={row['mbs']},recompute=none"
        return planner.search(8, parse_plan_spec(spec)).best.step_time_s
    return step_s


def fit(step_s: Callable[[dict[str, Any], float], float], row: dict[str, Any]) -> float:
    """The factor whose prediction of `row` equals its measurement (bisection: monotone in f)."""
    low, high = 0.0, 16.0
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if step_s(row, middle) < row["measured_step_s"] else (low, middle)
    return (low + high) / 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows, step_s = measured_rows(args.hf_rows), pricer()
    fit_row = next(r for r in rows if (r["model"], r["mbs"]) == FIT and "spec" not in r)
    factor = fit(step_s, fit_row)
    table = []
    for r in rows:
        at_one, at_fit = step_s(r, 1.0), step_s(r, factor)
        table.append({"model": r["model"], "mbs": r["mbs"], "spec": r.get("spec"), "source": r["source"],
                      "measured_step_s": r["measured_step_s"], "predicted_as_measured_s": at_one,
                      "predicted_fitted_s": at_fit, "error_as_measured": round(error(at_one, r["measured_step_s"]), 4),
                      "error_fitted": round(error(at_fit, r["measured_step_s"]), 4), "fitted_on": r is fit_row})
    print_table(table, {"model": "", "mbs": "", "measured_step_s": ".4f", "error_as_measured": "+.1%",
                        "error_fitted": "+.1%", "fitted_on": ""})
    held = [t for t in table if not t["fitted_on"]]
    print(f"factor {factor:.3f}")
    return {"priced_by": machine_header(), "date": time.strftime("%Y-%m-%d"), "device": "NVIDIA H100 80GB HBM3 (measured 2026-12-05)",
            "profile": PROFILE, "fitted_on": f"{FIT[0]} at micro-batch {FIT[1]}", "factor": round(factor, 4),
            "rows": table, "held_out_worst_error_fitted": max(abs(t["error_fitted"]) for t in held),
            "held_out_worst_error_as_measured": max(abs(t["error_as_measured"]) for t in held)}
