"""Capture time and peak memory of the largest presets on the meta device (CPU only).

Each model is captured in a fresh process (so peak RSS is that capture's own), full depth and
shallow, and the figures are written as JSON.

    python benchmarks/capture_time.py -o benchmarks/results/capture-cpu-2026-11-29.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

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


def measure(preset: str, mode: str) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, preset, mode], check=True,
                         capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["process_wall_s"] = time.perf_counter() - start
    return {"preset": preset, "mode": mode, **{k: round(v, 3) if isinstance(v, float) else v
                                               for k, v in row.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None, help="write the JSON here")
    args = parser.parse_args()
    rows = [measure(p, m) for p in PRESETS for m in ("full", "shallow")]
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores", "torch": torch.__version__, "python": platform.python_version(),
           "note": "meta device; peak_rss_gib is the capturing process's max RSS (ru_maxrss)",
           "rows": rows}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
