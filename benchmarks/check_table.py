"""Run an equivalence test module's checks on gloo CPU ranks and keep their rows (shared by the
`*_table.py` scripts: each runs the very functions its test runs, then prints a markdown table).

    rows(groups, fields)        one row per check: the worst rank's loss and parameter errors,
                                the layout that ran, and `fields(result)` of that rank
    write(path, rows, **facts)  the JSON document: date, machine, torch, float64, 5 steps, facts, rows
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

from distributed import run_checks  # noqa: E402

Check = Callable[[], dict[str, Any]]


def rows(groups: Sequence[tuple[int, Sequence[Check]]],
         fields: Callable[[dict[str, Any]], dict[str, Any]] = lambda result: {}) -> list[dict[str, Any]]:
    """Each group's checks in one gloo group of its world size."""
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


def write(path: str, table: list[dict[str, Any]], **facts: Any) -> None:
    doc = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, **facts, "steps": 5, "dtype": "float64", "rows": table}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
