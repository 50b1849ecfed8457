"""The outside-model zoo's table: every zoo model (tests/zoo_models.py) under every plan of
tests/test_zoo.py, on gloo CPU ranks in float64, against the plain one-process loop: the largest
relative error over the losses and every parameter after 3 AdamW steps, the bound the test holds
it to, and the layout that ran (or the error that refused it).

    python benchmarks/zoo_table.py -o benchmarks/results/zoo-cpu-2026-12-01.json

It runs the same function the test runs (`zoo_models.train_under_plan`) and prints the README's
markdown table. About 8 minutes on the 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

import zoo_models  # noqa: E402
from distributed import run_ranks  # noqa: E402

PLANS = zoo_models.PLANS


def _all_plans(plans: tuple[str | None, ...]) -> dict[str, dict]:
    out = {}
    for plan in plans:
        try:
            out[plan or "auto"] = zoo_models.train_under_plan(zoo_models.ZOO, plan)
        except Exception as exc:  # noqa: BLE001 - a refusal is a row of the table, not a crash
            out[plan or "auto"] = {name: {"refused": f"{type(exc).__name__}: {exc}"} for name in zoo_models.ZOO}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    results = {world: run_ranks(world, _all_plans, plans, timeout_s=1800)[0] for world, plans in PLANS.items()}
    bounds = {name: zoo_models.error_bound(zoo) for name, zoo in zoo_models.ZOO.items()}
    doc = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "steps": zoo_models.STEPS, "global_batch": zoo_models.GLOBAL_BATCH,
           "float32_factor": zoo_models.FLOAT32_FACTOR, "bounds": bounds,
           "results": {f"world{w}": r for w, r in results.items()}}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    columns = [(w, p or "auto") for w, plans in PLANS.items() for p in plans]
    print("| model | bound | " + " | ".join(f"{p} ({w} ranks)" for w, p in columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for name in zoo_models.ZOO:
        cells = []
        for world, plan in columns:
            row = results[world][plan][name]
            cells.append(row["refused"] if "refused" in row else f"{row['error']:.1e}")
        print(f"| {name} | {bounds[name]:.0e} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
