"""An earlier `peers` run's steps beside the card's clock trace: is a system's step spread the card's doing?

A `peers` run with `--gpu-trace TRACE.csv` samples the card's SM clock, power, temperature and
clock-event reasons with nvidia-smi while its families run and adds to each family of its JSON a
"gpu_trace": per system, the clock and power while its steps ran, the share of samples under the
software power cap or another reason, and the correlation of a step's time with the clock
(benchmarks/models/trace.py says how, and why it exists). This case does the same on an earlier
run's files, on any machine: the report is the run's JSON with "gpu_trace" added (`--out` the
run's own file rewrites it), and each family's figures are printed, a line per system:
    PYTHONPATH=. python -m benchmarks.models gpu-trace --report RESULT.json --trace TRACE.csv --out RESULT.json
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks.models.trace import annotate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--report", required=True, help="the `peers` run's JSON")
    parser.add_argument("--trace", required=True, help="the CSV its `--gpu-trace` wrote")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.report, encoding="utf-8") as handle:
        report = annotate(json.load(handle), args.trace)
    for family, entry in report.get("families", {}).items():
        for system, figures in entry.get("gpu_trace", {}).items():
            print(family, system, json.dumps(figures))
    return report
