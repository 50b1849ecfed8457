"""Wall time of the planning-time issue's two `mplan plan` jobs, each in a fresh process, start-up
included (CPU only; what the README's planning-time row quotes).

Each job runs `python -m mplan plan ... -o PLAN` `--repeats` times; the file records every run's
wall seconds, the plan's own `planner` figures (candidates, search and total seconds), the plan
chosen (identical across runs or not) and the load average before and after, since other
processes on a shared machine stretch wall time.

    python benchmarks/planning_time.py -o benchmarks/results/planning_time-cpu-2026-12-02.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

JOBS = {
    "gpt3-175b": ["gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128", "--global-batch", "1536",
                  "--runtime", "mplan"],
    "llama3-8b": ["llama3-8b", "--cluster", "dgx-h100", "--nodes", "8", "--seq-len", "8192",
                  "--global-batch", "512", "--runtime", "mplan"],
}


def run_job(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mplan", "plan", *args, "-o", out], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        with open(out, encoding="utf-8") as f:
            made = json.load(f)
    mesh = made.get("mesh", {})
    return {"wall_s": round(wall, 3), "planner": made.get("planner", {}),
            "plan": json.dumps(mesh, sort_keys=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "python": platform.python_version(),
           "load_average_before": os.getloadavg(), "jobs": {}}
    for name, job in JOBS.items():
        runs = [run_job(job) for _ in range(args.repeats)]
        walls = [r["wall_s"] for r in runs]
        doc["jobs"][name] = {"command": "mplan plan " + " ".join(job), "runs": runs,
                             "wall_s_min": min(walls), "wall_s_max": max(walls),
                             "same_plan_every_run": len({r["plan"] for r in runs}) == 1}
        print(f"{name}: {min(walls):.1f}-{max(walls):.1f} s wall, "
              f"{runs[0]['planner'].get('candidates')} candidates", flush=True)
    doc["load_average_after"] = os.getloadavg()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
