"""The expert-parallel equivalence table: every check of tests/test_expert_parallel.py (EP2, EP4,
EP2xTP2 with and without SP, EP2xDP2 with ZeRO-1, EP2xPP2 under 1f1b and zb-h1, a skewed router, a
plan's capacity factor; mplan's MoE family and Hugging Face Mixtral and Qwen2-MoE) on 2 and 4 gloo
CPU ranks in float64, against the one-process model with gradient accumulation over the same
micro-batches: the largest relative error of the losses and of every parameter after 5 AdamW
steps with active clipping, and the layout that ran.

    python benchmarks/experts_table.py -o benchmarks/results/experts-cpu-2026-12-02.json

It runs the very functions the test runs and prints the markdown table docs/execution.md carries.
About 4 minutes on the 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers  # noqa: E402

from check_table import rows, write  # noqa: E402
from test_expert_parallel import TABLE_ONLY_WORLD4, WORLD2, WORLD4  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    world4 = [c for world in (WORLD4, TABLE_ONLY_WORLD4) for group in world.values() for c in group]
    table = rows([(2, WORLD2), (4, world4)],
                 lambda r: {"ep": r["ep"][0], "experts_strategy": r["experts_strategy"]})
    write(args.out, table, transformers=transformers.__version__)
    print("| check | ranks | layout that ran | experts | loss | parameters |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['experts_strategy'][0]} | "
              f"{row['loss']:.0e} | {row['param']:.0e} ({row['worst_param']}) |")


if __name__ == "__main__":
    main()
