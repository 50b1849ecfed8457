"""Join what benchmarks/train_gpu.sh wrote into one results file (issues 31, 32, 33): the step times
of `mplan train` on one GPU against the plan's prediction.

Reads, from the folder given (the device call's $OUT): gpu.txt (the card; torch, triton and
transformers versions), data.json (`mplan data prepare --json`), train_gpu_metrics.jsonl (one row
per step of `mplan train`, with the plan's predictions), checkpoint_time.json and zero_bench.json
where present. Writes one JSON with the run's step-time statistics against the prediction (median
over every step after the first, the median without steps over SLOW x it, their spread), peak
memory against the prediction, first and last losses, and the other two files as they are.
Nothing is measured here; it runs on any machine.

    PYTHONPATH=. python3 -m benchmarks.calibration train-summary $OUT -o $OUT/train_gpu.json  (train_gpu.sh's end)

This case was benchmarks/train_gpu_summary.py until 2026-12-07 (train_gpu-2026-12-06.json's figures
were joined by it, `python3 benchmarks/train_gpu_summary.py $OUT -o $OUT/train_gpu.json`, then
assembled by hand).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path
from typing import Any

SLOW = 1.15
"""A step over this multiple of the median is listed as slow (a checkpoint's stall) and left out
of the spread."""


def summarize(folder: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (folder / "train_gpu_metrics.jsonl").read_text().splitlines() if line.strip()]
    gpu, versions = (folder / "gpu.txt").read_text().splitlines()[:2]
    torch_v, triton_v, transformers_v = versions.split()
    steady = [r for r in rows if r["step"] >= 2]
    times = [r["step_time_s"] for r in steady]
    median = statistics.median(times)
    plain = [t for t in times if t <= SLOW * median]
    peak = max(r["peak_memory_gib"] for r in rows)
    last = rows[-1]
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch_v, "triton": triton_v,
        "transformers": transformers_v,
        "data": json.loads((folder / "data.json").read_text()),
        "first_step_s": rows[0]["step_time_s"], "steps_measured": len(steady),
        "step_time_median_s": median, "step_time_median_without_slow_steps_s": statistics.median(plain),
        "step_time_cv_without_slow_steps": statistics.pstdev(plain) / statistics.mean(plain),
        f"slow_steps (over {SLOW}x the median)": [(r["step"], round(r["step_time_s"], 4)) for r in steady
                                                 if r["step_time_s"] > SLOW * median],
        "predicted_step_time_s": last["predicted_step_time_s"],
        "step_time_prediction_error": last["predicted_step_time_s"] / median - 1,
        "mfu_median": statistics.median(r["mfu"] for r in steady), "predicted_mfu": last["predicted_mfu"],
        "peak_memory_gib": peak, "predicted_memory_gib": last["predicted_memory_gib"],
        "memory_prediction_error": last["predicted_memory_gib"] / peak - 1,
        "loss_first": rows[0]["loss"], "loss_last": last["loss"],
        "loss_mean_last_10": statistics.mean(r["loss"] for r in rows[-10:]),
    }
    for name, key in (("checkpoint_time.json", "checkpoint_time"), ("zero_bench.json", "zero_bench")):
        if (folder / name).exists():
            out[key] = json.loads((folder / name).read_text())
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="where train_gpu.sh wrote its files ($OUT)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return summarize(args.folder)
