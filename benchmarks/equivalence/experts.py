"""Every check of tests/test_expert_parallel.py on 2 and 4 gloo ranks against the one-process model."""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.equivalence.checks import STEPS, check_rows, header


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the table is the test module's checks."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    from test_expert_parallel import TABLE_ONLY_WORLD4, WORLD2, WORLD4

    world4 = [c for world in (WORLD4, TABLE_ONLY_WORLD4) for group in world.values() for c in group]
    table = check_rows([(2, WORLD2), (4, world4)],
                       lambda r: {"ep": r["ep"][0], "experts_strategy": r["experts_strategy"]})
    print("| check | ranks | layout that ran | experts | loss | parameters |\n|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['experts_strategy'][0]} | "
              f"{row['loss']:.0e} | {row['param']:.0e} ({row['worst_param']}) |")
    return {**header(), "table": "experts", "steps": STEPS, "dtype": "float64", "rows": table}
