"""`mplan bench`: one row's failure is reported in that row and the other rows still run (issue
30, "a crash and a lost table": a pass that raised in one `--measure` row lost every later row).

Predicted rows are checked in this process; measured rows on two gloo ranks, where the planted
failure happens on one rank only and the other, left alone, would wait forever in the plan's
first collective. `autoparallel` is stood in for by a step that all-reduces (the real one takes
seconds a plan here); planning and capture are real.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mplan
from distributed import run_checks
from mplan import bench
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.search import Planner

MODEL = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128"


def test_a_row_that_crashes_reports_its_cause_and_the_next_rows_are_planned(monkeypatch) -> None:
    real_search = Planner.search

    def search(self, global_batch, spec=None, **options):  # noqa: ANN001, ANN202 - Planner.search's arguments
        if spec is not None and spec.mbs == 2:
            raise ZeroDivisionError("float division by zero")  # a planted bug in the planner
        return real_search(self, global_batch, spec, **options)

    monkeypatch.setattr(Planner, "search", search)
    rows = bench.bench_plans(MODEL, ClusterSpec.preset("h200", gpus_per_node=2), 8,
                             ["dp=2,mbs=1", "dp=2,mbs=2", "tp=2", "tp=3"])
    assert [r["spec"] for r in rows] == ["dp=2,mbs=1", "dp=2,mbs=2", "tp=2", "tp=3"]
    assert rows[0]["error"] is None and rows[0]["predicted"]["step_time_s"] > 0
    assert rows[1]["predicted"] is None
    assert rows[1]["error"].startswith("ZeroDivisionError: float division by zero (raised at test_bench_rows.py:")
    assert rows[2]["error"] is None and rows[2]["predicted"]["step_time_s"] > 0
    assert "tp=3" in rows[3]["error"] and "ZeroDivisionError" not in rows[3]["error"]  # a refusal keeps its words


class _Step:
    """A plan's run as `measure_plan` drives it: every step all-reduces over the job."""

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total)


def _bench_with_a_planted_failure(fail: dict[str, Any]) -> list[dict[str, Any]]:
    """Three measured rows; `fail` says which call of `autoparallel` raises, on which rank, and what."""
    calls = [0]

    def autoparallel(model, **kwargs):  # noqa: ANN001, ANN202 - autoparallel's arguments
        calls[0] += 1
        if calls[0] == fail["call"] and dist.get_rank() in fail["ranks"]:
            raise fail["error"]
        return _Step()

    real = mplan.autoparallel
    mplan.autoparallel = autoparallel
    try:
        return bench.bench_plans(MODEL, ClusterSpec.preset("cpu", gpus_per_node=2), 4,
                                 ["dp=2,mbs=1", "dp=2,mbs=2", "dp=2,mbs=1,recompute=full"], measure=True)
    finally:
        mplan.autoparallel = real


def check_a_crash_on_one_rank_fails_that_row_on_every_rank() -> list[Any]:
    """Rank 1 raises while building the second plan (as the recompute pass did on one stage);
    rank 0 would have entered that plan's first all-reduce and waited for it forever."""
    rows = _bench_with_a_planted_failure(
        {"call": 2, "ranks": (1,), "error": RuntimeError("Argument 'submod_1' was used before it has been defined!")})
    assert rows[0]["error"] is None and rows[0]["measured"]["step_time_s"] > 0
    assert rows[1]["error"].startswith("rank 1: RuntimeError: Argument 'submod_1' was used before it has been "
                                       "defined! (raised at test_bench_rows.py:"), rows[1]["error"]
    assert rows[1]["measured"] == {"error": rows[1]["error"]}
    assert rows[2]["error"] is None and rows[2]["measured"]["step_time_s"] > 0
    return [r["error"] for r in rows]


def check_running_out_of_memory_everywhere_stays_a_measured_refusal() -> list[Any]:
    rows = _bench_with_a_planted_failure(
        {"call": 1, "ranks": (0, 1), "error": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")})
    assert rows[0]["error"] is None  # the plan is sound; this device could not hold it
    assert rows[0]["measured"]["error"] == ("rank 0: out of memory: CUDA out of memory. Tried to allocate 2 GiB; "
                                            "rank 1: out of memory: CUDA out of memory. Tried to allocate 2 GiB")
    assert rows[1]["measured"]["step_time_s"] > 0 and rows[2]["measured"]["step_time_s"] > 0
    return [r["measured"].get("error") for r in rows]


CHECKS = [check_a_crash_on_one_rank_fails_that_row_on_every_rank,
          check_running_out_of_memory_everywhere_stays_a_measured_refusal]


@pytest.fixture(scope="module")
def outcomes():  # noqa: ANN201 - CheckOutcomes
    return run_checks(2, CHECKS, timeout_s=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_measured_rows_on_two_ranks(outcomes, check) -> None:  # noqa: ANN001 - fixtures
    per_rank = outcomes.assert_passed(check)
    assert per_rank[0] == per_rank[1]  # every rank ends each row with the same verdict
