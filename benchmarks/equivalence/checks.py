"""A test module's equivalence checks run as a table: each group of checks in one gloo group of its
world size, one row per check with the worst rank's errors, and the versions beside them."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from distributed import run_checks, run_ranks  # noqa: E402,F401 (run_ranks: for zoo)

from benchmarks.report import machine_header, package_versions  # noqa: E402

Check = Callable[[], dict[str, Any]]
STEPS = 5
"""AdamW steps each pipeline and expert check takes (the tests' own)"""


def header() -> dict[str, Any]:
    """The machine, torch, transformers (the tables' outside models) and the commit."""
    return {**machine_header(), **package_versions("transformers")}


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
