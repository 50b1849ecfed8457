"""The pipeline equivalence table: every pipeline check of tests/test_pipeline.py (schedules, TP,
SP, DP, ZeRO-1, uneven stages, tied heads, Hugging Face Llama and Mistral) on 2, 4 and 8 gloo CPU
ranks in float64, against the plain one-process loop: the largest relative error of the losses
and of every parameter after 5 AdamW steps with active clipping, and the layout that ran.

    python benchmarks/pipeline_table.py -o benchmarks/results/pipeline-cpu-2026-12-02.json

It runs the very functions the test runs and prints the markdown table docs/execution.md carries.
About 6 minutes on the 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from check_table import rows, write  # noqa: E402
from test_pipeline import WORLD2, WORLD4, WORLD8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    table = rows([(2, WORLD2), (4, WORLD4), (8, WORLD8)])
    write(args.out, table)
    print("| check | ranks | layout that ran | loss | parameters |")
    print("|---|---|---|---|---|")
    for row in table:
        print(f"| {row['check']} | {row['world_size']} | `{row['ran']}` | {row['loss']:.0e} | "
              f"{row['param']:.0e} ({row['worst_param']}) |")


if __name__ == "__main__":
    main()
