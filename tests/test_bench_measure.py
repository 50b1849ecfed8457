"""`mplan bench --measure`: each plan runs as the bench predicted it, from a bare device, and a
refusal says what stops it (issue 19, item 6(b))."""
from __future__ import annotations

import weakref

import pytest
import torch

import mplan
from mplan import bench
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner import evaluate
from mplan.planner.parallel_config import parse_plan_spec
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner, PlanningError

MODEL = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128"
PLANS = ["dp=1,mbs=2", "dp=1,mbs=4,recompute=selective"]


@pytest.fixture(scope="module")
def graph():  # noqa: ANN201 - one capture for the module's tests (the first export in a process takes seconds)
    return capture_for_planning(MODEL)


class _Run:
    """What `autoparallel` returns, holding device memory; its first plan runs out of it."""

    def __init__(self, out_of_memory: bool) -> None:
        self.weights = torch.zeros(1024)
        self.out_of_memory = out_of_memory

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.out_of_memory:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.weights.sum()


def test_each_plan_is_measured_on_the_bench_cluster_after_the_last_one_is_released(graph, monkeypatch):
    """Two plans measured in one bench (autoparallel stood in for: the real one takes seconds a
    plan here): each is resolved on the bench's --cluster, never the job's own, and the memory of
    the plan before (here one that ran out of it) is unreferenced when the bench releases it."""
    cluster = ClusterSpec.preset("cpu")
    runs: list[weakref.ref[_Run]] = []
    resolved_on: list[ClusterSpec | None] = []
    released: list[bool] = []

    def autoparallel(model, *, cluster=None, **kwargs):  # noqa: ANN001, ANN202 - autoparallel's arguments
        resolved_on.append(cluster)
        run = _Run(out_of_memory=not runs)
        runs.append(weakref.ref(run))
        return run

    real_release = bench._release_device_memory

    def release() -> None:
        released.append(all(ref() is None for ref in runs))
        real_release()

    monkeypatch.setattr(bench, "capture_for_planning", lambda model, seq_len=None: graph)
    monkeypatch.setattr(mplan, "autoparallel", autoparallel)
    monkeypatch.setattr(bench, "_release_device_memory", release)
    rows = bench.bench_plans(MODEL, cluster, 8, PLANS, measure=True)

    assert [row["error"] for row in rows] == [None, None]
    assert rows[0]["measured"]["error"].startswith("out of memory: CUDA out of memory")
    assert rows[1]["measured"]["step_time_s"] > 0 and "prediction_error" in rows[1]["measured"]
    assert resolved_on == [cluster, cluster] and all(c is cluster for c in resolved_on)
    assert released == [True, True]  # after each plan, with nothing of it left referenced


def test_a_plan_refused_for_no_stage_cut_says_so_and_not_that_it_needs_1x_the_devices(graph, monkeypatch):
    """The H200's Python 3.12 once found no one-chunk cut of a selective-recomputation plan (its
    compensated sum() rounded below the running sum, fixed in stage_partition): the refusal read
    '18 units cannot fill 1 pipeline chunks. It would need about 1x the devices (or 3 GiB per
    device)', a memory figure of a stand-in cut. No cut is simulated here."""
    monkeypatch.setattr(evaluate, "partition", lambda times, k, **options: None)
    planner = Planner(graph, ClusterSpec.preset("h200"), kernels=True, runtime="mplan")
    with pytest.raises(PlanningError) as err:
        planner.search(8, parse_plan_spec(PLANS[1]))
    message = str(err.value)
    assert "found no cut of its 4 units into 1 pipeline chunk, which is not a matter of memory" in message
    assert "x the devices" not in message and "GiB per device" not in message and "does not fit" not in message
