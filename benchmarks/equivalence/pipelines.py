"""Every check of tests/test_pipeline.py on 2, 4 and 8 gloo ranks against the one-process loop."""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.equivalence.checks import STEPS, check_rows, header


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the table is the test module's checks."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    from test_pipeline import WORLD2, WORLD4, WORLD8

    table = check_rows([(2, WORLD2), (4, WORLD4), (8, WORLD8)])
    print("| check | ranks | layout that ran | loss | parameters |\n|---|---|---|---|---|")
    for row in table:
        print(f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['loss']:.0e} | "
              f"{row['param']:.0e} ({row['worst_param']}) |")
    return {**header(), "table": "pipelines", "steps": STEPS, "dtype": "float64", "rows": table}
