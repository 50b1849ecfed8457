"""The planner's price, on a CPU, of the Hugging Face models measured on the H200 (one step, plan
`auto`, global batch 8 x 2048, fused kernels priced), from the very config.json files the GPU run
used (recorded in benchmarks/results/hf_bench_h200-2026-12-02.json), beside that run's measurement.

Runs `mplan bench CONFIG --cluster h200 --global-batch 8 --seq-len 2048 --plans auto --json` per
model (no --measure: a prediction only) with this machine's torch and transformers.

    python benchmarks/hf_price.py -o benchmarks/results/hf_price_h200-cpu-2026-12-02.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MEASURED = "hf_bench_h200-2026-12-02.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    with open(os.path.join(RESULTS, MEASURED), encoding="utf-8") as f:
        measured = json.load(f)
    import torch
    import transformers

    rows = {}
    for name, entry in measured["models"].items():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "config.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(entry["config"], f)
            out = subprocess.run([sys.executable, "-m", "mplan", "bench", path, "--cluster", "h200",
                                  "--global-batch", "8", "--seq-len", "2048", "--plans", "auto", "--json"],
                                 check=True, capture_output=True, text=True).stdout
        (row,) = json.loads(out)["plans"]
        judged = (entry.get("judged") or [{}])[0]
        rows[name] = {"resolved_spec": row["resolved_spec"], "predicted": row["predicted"],
                      "measured_step_s": judged.get("measured_step_s"),
                      "measured_peak_gib": judged.get("measured_peak_gib")}
        if judged.get("measured_step_s"):
            rows[name]["step_time_error"] = row["predicted"]["step_time_s"] / judged["measured_step_s"] - 1
        print(f"{name}: predicted {row['predicted']['step_time_s'] * 1e3:.1f} ms, "
              f"{row['predicted']['memory_gib']:.2f} GiB [{row['resolved_spec']}]", flush=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "transformers": transformers.__version__, "measured_file": f"benchmarks/results/{MEASURED}",
                       "note": "memory_gib is the planner's peak with its 10% allocator margin", "rows": rows},
                      f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
