"""How much of mplan's lead over torch.compile in benchmarks/e2e.py is its AdamW kernel
(runs on a CPU, from committed results; derived, not measured).

e2e.py's torch.compile baseline compiles the model only: its optimizer is torch's fused
AdamW, run eagerly, while mplan steps with its own Triton AdamW. This script takes each bf16 run's
measured step times (compile and mplan) and adds to mplan's step the gap between the two AdamWs'
kernel times measured alone on the same GPU with a grad_scale (optimizer_h200-2026-11-29.json,
the same bf16 parameters at the same model sizes): the ratio compile / (mplan + gap) estimates
mplan's lead with torch's AdamW. An estimate: the gap is timed outside the step.

    python benchmarks/compile_adamw_share.py -o benchmarks/results/compile_adamw_share-2026-12-02.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS = ["e2e_h200-2026-11-29-session7.json", "e2e_h200-2026-12-01.json"]
OPTIMIZER = "optimizer_h200-2026-11-29.json"
MODEL_ROWS = {"gpt-1.3b": "gpt-1.3b", "llama-1.1b": "llama-1.1b"}  # e2e model -> optimizer benchmark row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    with open(os.path.join(RESULTS, OPTIMIZER), encoding="utf-8") as f:
        optimizer = {(r["model"], r["dtype"]): r["timing"]["grad_scale"] for r in json.load(f)["rows"]}
    rows = []
    for run in RUNS:
        with open(os.path.join(RESULTS, run), encoding="utf-8") as f:
            measured = json.load(f)
        for model, entry in measured["models"].items():
            systems = entry["systems"]
            if model not in MODEL_ROWS or "compile" not in systems or "mplan" not in systems:
                continue
            timing = optimizer[(MODEL_ROWS[model], "bf16")]
            gap_s = (timing["torch_fused"]["ms"] - timing["mplan_device_steps"]["ms"]) * 1e-3
            compile_s, mplan_s = systems["compile"]["step_s"], systems["mplan"]["step_s"]
            row = {"run": f"benchmarks/results/{run}", "model": model, "compile_step_s": compile_s,
                   "mplan_step_s": mplan_s, "adamw_gap_s": gap_s,
                   "mplan_vs_compile_measured": compile_s / mplan_s,
                   "mplan_vs_compile_with_torch_adamw": compile_s / (mplan_s + gap_s)}
            row["share_of_lead_from_adamw"] = ((compile_s - mplan_s) and gap_s / (compile_s - mplan_s))
            rows.append(row)
            print(f"{run} {model}: mplan {row['mplan_vs_compile_measured']:.3f}x compile measured, "
                  f"{row['mplan_vs_compile_with_torch_adamw']:.3f}x with torch's AdamW's kernel time "
                  f"(+{gap_s * 1e3:.2f} ms; {row['share_of_lead_from_adamw']:.0%} of the lead)")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "kind": "derived from measured results, not measured",
                       "optimizer_file": f"benchmarks/results/{OPTIMIZER}", "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
