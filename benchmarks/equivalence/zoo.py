"""Every outside model of tests/zoo_models.py under every plan of tests/test_zoo.py: its error
against one process and the bound its test holds it to, or the error that refused the plan."""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.equivalence.checks import header, run_ranks


def _plans(plans: tuple[str | None, ...]) -> dict[str, dict]:
    import zoo_models

    out = {}
    for plan in plans:
        try:
            out[plan or "auto"] = zoo_models.train_under_plan(zoo_models.ZOO, plan)
        except Exception as exc:  # noqa: BLE001 - a refusal is a row of the table, not a crash
            out[plan or "auto"] = {name: {"refused": f"{type(exc).__name__}: {exc}"} for name in zoo_models.ZOO}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the table is the zoo's models under the test's plans."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    import zoo_models

    results = {world: run_ranks(world, _plans, plans, timeout_s=1800)[0] for world, plans in zoo_models.PLANS.items()}
    bounds = {name: zoo_models.error_bound(model) for name, model in zoo_models.ZOO.items()}
    columns = [(w, p or "auto") for w, plans in zoo_models.PLANS.items() for p in plans]
    print("| model | bound | " + " | ".join(f"{p} ({w} ranks)" for w, p in columns) + " |\n"
          + "|---" * (len(columns) + 2) + "|")
    for name in zoo_models.ZOO:
        cells = [row["refused"] if "refused" in (row := results[world][plan][name]) else f"{row['error']:.1e}"
                 for world, plan in columns]
        print(f"| {name} | {bounds[name]:.0e} | " + " | ".join(cells) + " |")
    return {**header(), "table": "zoo", "steps": zoo_models.STEPS, "global_batch": zoo_models.GLOBAL_BATCH,
            "float32_factor": zoo_models.FLOAT32_FACTOR, "bounds": bounds,
            "results": {f"world{w}": r for w, r in results.items()}}
