"""Test order for the two xdist workers (`-n 2 --dist loadfile`, the README's command).

Each worker takes a whole file, in collection order. The files that start gloo groups and train
for minutes come first, longest first, so no long file is left to run alone at the end while the
other worker idles (at alphabetical order test_zoo.py, ~3 minutes, started last). Within a file
the order is the file's own."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: a second intra-op thread each would only contend

LONGEST_FIRST = (
    "test_calibration.py", "test_kernels.py", "test_expert_parallel.py", "test_autoparallel_overhead.py",
    "test_checkpoint_resharding.py", "test_planner.py", "test_zero23_pipeline_memory.py", "test_recompute.py",
    "test_autoparallel.py", "test_zero23.py", "test_moe_planning.py", "test_pipeline.py", "test_profile_command.py",
    "test_zero_planning.py", "test_zoo.py", "test_equivalence.py", "test_context_parallel.py", "test_benchmarks.py",
    "test_sites_planner.py", "test_hierarchical_dp.py", "test_zero23_memory.py", "test_watchdog.py",
    "test_context_parallel_hf.py", "test_kernel_adamw.py",
)
"""Ordered by the seconds each took in a contended run on 2 cores (pytest --durations=0, summed per
file; 2026-12-06: 2474 s in all, 1273 s of wall time), largest first."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: files stay whole
