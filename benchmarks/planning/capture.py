"""Time and peak memory of capturing the largest presets on the meta device, full depth and
shallow, each capture in a fresh process so that its peak RSS is its own (what the README's
capture row quotes).

    python -m benchmarks.planning capture -o benchmarks/results/capture-cpu-2026-11-29.json
(that result made before the harness, by `python benchmarks/planning_time.py --capture`)
"""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.planning.processes import run_json
from benchmarks.report import machine_header

PRESETS = ["gpt3-175b", "llama3-405b", "mixtral-8x7b"]

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from mplan.planner.planning import capture_spec
t1 = time.perf_counter()
g = capture_spec(sys.argv[1], shallow=sys.argv[2] == "shallow")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "capture_call_s": t2 - t1, "export_s": g.capture_seconds,
                  "num_parameters": g.num_parameters, "num_layers": g.num_layers,
                  "num_ops": len(g.nodes), "training_flops_per_token": g.training_flops / g.tokens(),
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def measure(preset: str, mode: str) -> dict[str, Any]:
    """One capture of `preset` (mode "full" or "shallow") in a fresh process: its figures."""
    row, wall, _ = run_json(["-c", _CHILD, preset, mode])
    row["process_wall_s"] = wall
    return {"preset": preset, "mode": mode, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=PRESETS, help="the presets to capture")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = [measure(p, m) for p in args.presets for m in ("full", "shallow")]
    for row in rows:
        print(f"{row['preset']} {row['mode']}: {row['capture_call_s']} s, {row['peak_rss_gib']} GiB", flush=True)
    return {**machine_header(), "note": "meta device; peak_rss_gib is the capturing process's max RSS (ru_maxrss)",
            "rows": rows}
