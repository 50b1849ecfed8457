"""The equivalence tables: a test module's equivalence checks run on gloo CPU ranks in float64, each
against the single-device model, their largest relative errors kept as JSON and printed as the
markdown table the docs carry (the question "does every parallel layout train exactly like one
device?"). One table a run:

    pipelines  every check of tests/test_pipeline.py (schedules, TP, SP, DP, ZeRO-1, uneven stages,
               tied heads, Hugging Face Llama and Mistral) on 2, 4 and 8 ranks, against the plain
               one-process loop; 5 AdamW steps with active clipping (about 6 minutes on 2 cores)
    experts    every check of tests/test_expert_parallel.py (EP2, EP4, EP2xTP2 with and without SP,
               EP2xDP2 with ZeRO-1, EP2xPP2 under 1f1b and zb-h1, a skewed router, a plan's capacity
               factor; mplan's MoE family, Hugging Face Mixtral and Qwen2-MoE) on 2 and 4 ranks,
               against the one-process model with gradient accumulation over the same micro-batches
               (about 4 minutes)
    zoo        every outside model of tests/zoo_models.py under every plan of tests/test_zoo.py, 3
               AdamW steps, with the bound the test holds each model to and the layout that ran or
               the error that refused it (the README's table; about 8 minutes)

Each runs the very functions its test runs; rows keep the worst rank's loss and parameter errors
and the layout that ran. The machine, torch and transformers versions are in the JSON.

    python benchmarks/equivalence_tables.py pipelines -o benchmarks/results/pipeline-cpu-2026-12-02.json
    python benchmarks/equivalence_tables.py experts -o benchmarks/results/experts-cpu-2026-12-02.json
    python benchmarks/equivalence_tables.py zoo -o benchmarks/results/zoo-cpu-2026-12-02.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

from distributed import run_checks, run_ranks  # noqa: E402

Check = Callable[[], dict[str, Any]]
STEPS = 5
"""AdamW steps each pipeline and expert check takes (the tests' own)"""


def header() -> dict[str, Any]:
    transformers = importlib.import_module("transformers")
    return {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def check_rows(groups: Sequence[tuple[int, Sequence[Check]]],
               fields: Callable[[dict[str, Any]], dict[str, Any]] = lambda result: {}) -> list[dict[str, Any]]:
    """Each group's checks in one gloo group of its world size: one row per check, the worst
    rank's loss and parameter errors, the layout that ran, and `fields(result)` of that rank."""
    out = []
    for world, checks in groups:
        outcomes = run_checks(world, list(checks), timeout_s=1800)
        for check in checks:
            results = outcomes.assert_passed(check)
            worst = max(results, key=lambda r: max(r["loss"], r["param"]))
            out.append({"check": check.__name__, "world_size": world, "ran": worst["ran"], "loss": worst["loss"],
                        "param": worst["param"], "worst_param": worst["worst"], "clipped": worst["clipped"],
                        **fields(worst)})
    return out


def pipelines() -> tuple[dict[str, Any], list[str]]:
    from test_pipeline import WORLD2, WORLD4, WORLD8

    table = check_rows([(2, WORLD2), (4, WORLD4), (8, WORLD8)])
    lines = ["| check | ranks | layout that ran | loss | parameters |", "|---|---|---|---|---|"]
    lines += [f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['loss']:.0e} | "
              f"{row['param']:.0e} ({row['worst_param']}) |" for row in table]
    return {"steps": STEPS, "dtype": "float64", "rows": table}, lines


def experts() -> tuple[dict[str, Any], list[str]]:
    from test_expert_parallel import TABLE_ONLY_WORLD4, WORLD2, WORLD4

    world4 = [c for world in (WORLD4, TABLE_ONLY_WORLD4) for group in world.values() for c in group]
    table = check_rows([(2, WORLD2), (4, world4)],
                       lambda r: {"ep": r["ep"][0], "experts_strategy": r["experts_strategy"]})
    lines = ["| check | ranks | layout that ran | experts | loss | parameters |", "|---|---|---|---|---|---|"]
    lines += [f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['experts_strategy'][0]} | "
              f"{row['loss']:.0e} | {row['param']:.0e} ({row['worst_param']}) |" for row in table]
    return {"steps": STEPS, "dtype": "float64", "rows": table}, lines


def _zoo_plans(plans: tuple[str | None, ...]) -> dict[str, dict]:
    import zoo_models

    out = {}
    for plan in plans:
        try:
            out[plan or "auto"] = zoo_models.train_under_plan(zoo_models.ZOO, plan)
        except Exception as exc:  # noqa: BLE001 - a refusal is a row of the table, not a crash
            out[plan or "auto"] = {name: {"refused": f"{type(exc).__name__}: {exc}"} for name in zoo_models.ZOO}
    return out


def zoo() -> tuple[dict[str, Any], list[str]]:
    import zoo_models

    results = {world: run_ranks(world, _zoo_plans, plans, timeout_s=1800)[0]
               for world, plans in zoo_models.PLANS.items()}
    bounds = {name: zoo_models.error_bound(model) for name, model in zoo_models.ZOO.items()}
    columns = [(w, p or "auto") for w, plans in zoo_models.PLANS.items() for p in plans]
    lines = ["| model | bound | " + " | ".join(f"{p} ({w} ranks)" for w, p in columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for name in zoo_models.ZOO:
        cells = [row["refused"] if "refused" in (row := results[world][plan][name]) else f"{row['error']:.1e}"
                 for world, plan in columns]
        lines.append(f"| {name} | {bounds[name]:.0e} | " + " | ".join(cells) + " |")
    doc = {"steps": zoo_models.STEPS, "global_batch": zoo_models.GLOBAL_BATCH,
           "float32_factor": zoo_models.FLOAT32_FACTOR, "bounds": bounds,
           "results": {f"world{w}": r for w, r in results.items()}}
    return doc, lines


TABLES: dict[str, Callable[[], tuple[dict[str, Any], list[str]]]] = {
    "pipelines": pipelines, "experts": experts, "zoo": zoo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=list(TABLES), help="which equivalence table")
    parser.add_argument("-o", "--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    doc, lines = TABLES[args.table]()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({**header(), "table": args.table, **doc}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
