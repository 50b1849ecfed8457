"""How much of mplan's lead over torch.compile in `python -m benchmarks.models e2e` is its AdamW kernel (derived, not measured).

e2e's torch.compile baseline compiles the model only: its optimizer is torch's fused AdamW, run
eagerly, while mplan steps with its own Triton AdamW. This case takes each bf16 run's measured step
times (compile and mplan) and adds to mplan's step the gap between the two AdamWs' kernel times
measured alone on the same GPU with a grad_scale (optimizer_h200-2026-11-29.json, the same bf16
parameters at the same model sizes): the ratio compile / (mplan + gap) estimates mplan's lead with
torch's AdamW. An estimate: the gap is timed outside the step.

    PYTHONPATH=. python -m benchmarks.reprice adamw-share --out benchmarks/results/compile_adamw_share-2026-12-02.json
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.report import machine_header
from benchmarks.reprice.pricing import Committed, print_table

RUNS = ("e2e_h200-2026-11-29-session7.json", "e2e_h200-2026-12-01.json")
OPTIMIZER = "optimizer_h200-2026-11-29.json"
MODELS = ("gpt-1.3b", "llama-1.1b")
"""e2e's models, each timed under the same name in the optimizer benchmark"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the runs it reads are the committed ones above."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    optimizer = Committed(OPTIMIZER)
    timed = {(r.get("model"), r.get("dtype")): i for i, r in enumerate(optimizer.at("rows"))}
    rows = []
    for name in RUNS:
        measured = Committed(name)
        for model, entry in measured.at("models").items():
            if model not in MODELS or not {"compile", "mplan"} <= set(entry.get("systems", {})):
                continue
            timing = optimizer.at("rows", timed.get((model, "bf16"), f"{model} in bf16"), "timing", "grad_scale")
            gap_s = (timing["torch_fused"]["ms"] - timing["mplan_device_steps"]["ms"]) * 1e-3
            compile_s, mplan_s = (measured.at("models", model, "systems", system, "step_s")
                                  for system in ("compile", "mplan"))
            rows.append({"run": f"benchmarks/results/{name}", "model": model, "compile_step_s": compile_s,
                         "mplan_step_s": mplan_s, "adamw_gap_s": gap_s,
                         "mplan_vs_compile_measured": compile_s / mplan_s,
                         "mplan_vs_compile_with_torch_adamw": compile_s / (mplan_s + gap_s),
                         "share_of_lead_from_adamw": (compile_s - mplan_s) and gap_s / (compile_s - mplan_s)})
    print_table(rows, {"run": "", "model": "", "mplan_vs_compile_with_torch_adamw": ".3f",
                       "share_of_lead_from_adamw": ".0%"})
    return {"priced_by": machine_header(), "date": time.strftime("%Y-%m-%d"), "kind": "derived from measured results, not measured",
            "optimizer_file": f"benchmarks/results/{OPTIMIZER}", "rows": rows}
