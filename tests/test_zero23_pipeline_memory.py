"""ZeRO 2 and 3 under a pipeline (issue 33): a rank's peak against the memory model.

mplan's pipeline executor adds each stage's gradients into `.grad` itself (`split_backward.py`),
so no post-accumulate hook fires and zero 2 and 3 reduce-scatter every bucket at the step
(`runtime/sharded_optimizer.py`): the stage's gradients stay whole in the parameters' dtype over
all its micro-batches, beside the gradient shard in the master dtype, and the step flattens each
bucket into a master-dtype copy, drops its gradients and reduce-scatters it, at most
`MAX_IN_FLIGHT` + 1 in flight. zero=3 keeps its gathered weights from the first forward to the
step (`fully_sharded.py`: `keep_gathered` under a pipeline). The memory model counts the same
(`memory_model.estimate_memory`'s `grads_whole`, `reduction_peak`'s walk at the step).

Measured (one gloo group of 4 ranks, pp=2 x dp=2 as the planner lays it out: interleaved, a layer
a chunk, 8 chunks a rank; 4 micro-batches a replica; `MODEL` in bf16): benchmarks/ranks/zero_memory.py's `peak_of_step` (the CPU allocator's
profile of a step added to what the module holds) on every rank, beside its stage's predicted peak
without the fragmentation margin. On 2026-12-06 (first stage / second, MB measured, error):
  zero=1  158.70 / 158.70   +0.2% / +0.2%
  zero=2  158.70 / 158.70   +0.2% / +0.2%  (one bucket a stage: the step's last launch is the
          peak, its gradients dropped, with or without the whole gradients counted)
  zero=3  125.93 / 119.45   -5.4% / -0.4%  (counting only the shard: -13.3% / -8.6%)
The first stage's zero=3 peak is in its backward, the stage's weights and gradients whole beside
the activations of the micro-batches in flight.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
from typing import Any

import pytest
import torch

from distributed import run_checks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.ranks import zero_memory  # noqa: E402

WORLD = 4
MODEL = "llama:layers=16,hidden=256,heads=4,kv_heads=2,ffn=1024,seq=64,vocab=256"
"""Eight layers a pipeline rank, 7.9M parameters: zero=3's units are its layers, so the rank's
whole gradients (16 MB in bf16) are eight units', not the one or three a reduction holds."""
PLAN = "dp=2,pp=2,mbs=1,zero={zero}"
GLOBAL_BATCH = 8
TOLERANCE = 0.10
"""Largest |predicted / measured - 1| allowed on any rank (issue 33: within 10%)."""
GiB = float(1 << 30)


def _stage_prediction(plan: Any, stage: int) -> dict[str, float]:
    """Stage `stage`'s predicted memory in bytes, without the planner's fragmentation margin."""
    from mplan.cost_models.memory_model import FRAGMENTATION_FRACTION

    memory = {m.stage: m for m in plan.predicted.memory_by_stage}[stage]
    total = memory.total_gib * GiB / (1 + FRAGMENTATION_FRACTION)
    return {"params": memory.params_gib * GiB, "grads": memory.grads_gib * GiB,
            "optimizer": memory.optimizer_gib * GiB, "activations": memory.activations_gib * GiB, "total": total}


def measure(zero: int) -> dict[str, Any]:
    """This rank's peak during a step of `MODEL` under pp=2 x dp=2 at `zero`."""
    import mplan
    from mplan.models import build_model

    generator = torch.Generator().manual_seed(0)
    data = [tuple(torch.randint(0, 256, (GLOBAL_BATCH, 64), generator=generator) for _ in range(2)) for _ in range(2)]
    pm = mplan.autoparallel(build_model(MODEL, device="cpu", dtype=zero_memory.DTYPE, seed=0),
                            example_inputs=(data[0][0],), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                            global_batch=GLOBAL_BATCH, plan=PLAN.format(zero=zero), max_grad_norm=1.0,
                            progress="quiet")
    steps = itertools.cycle(data)
    measured = zero_memory.peak_of_step(pm, lambda: pm.train_step(*next(steps)))
    expected = _stage_prediction(pm.plan, pm.groups.pp_rank)
    return {"zero": zero, "plan": pm.plan.spec(), "stage": pm.groups.pp_rank, **measured, "predicted": expected,
            "error": expected["total"] / measured["peak_bytes"] - 1}


def zero1_pipeline() -> dict[str, Any]:
    return measure(1)


def zero2_pipeline() -> dict[str, Any]:
    return measure(2)


def zero3_pipeline() -> dict[str, Any]:
    return measure(3)


CHECKS = [zero1_pipeline, zero2_pipeline, zero3_pipeline]


@pytest.fixture(scope="module")
def world4():
    return run_checks(WORLD, CHECKS, timeout_s=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_predicted_peak_of_each_stage_is_within_10_percent(world4, check) -> None:
    for rank, row in enumerate(world4.assert_passed(check)):
        assert row["plan"].startswith("dp=2,") and ",pp=2," in row["plan"], row
        assert abs(row["error"]) < TOLERANCE, (rank, row)


# -- the model's accounting (no process group) ------------------------------------------------------
def test_the_step_walk_counts_the_whole_gradients_left_against_the_reductions_in_flight() -> None:
    """Four buckets of 10 bf16 elements over 2 gloo replicas, reduced at the step with their
    gradients whole (20 bytes each) until flattened into a 40-byte fp32 copy; a reduction holds
    that copy and its 20-byte result, gloo its own copy at the launch; three in flight at most.
    The worst moment is the third launch: 3 * 60 in flight + 40 of gloo's - 60 of gradients
    dropped = 160 beyond the whole gradients. Counting one bucket's gradients beside the
    reductions instead (the one-stage walk) reads 220 beyond the shard alone."""
    from mplan.cost_models.memory_model import mplan_bytes_per_param, reduction_peak

    per = mplan_bytes_per_param("bf16", zero=2)
    walk = functools.partial(reduction_peak, [10, 10, 10, 10], [0.0] * 4, zero=2, per_param=per, copy_bytes=4,
                             replicas=2, outstanding=2, backend_copies=True, micro_batches=4)
    assert walk(grads_whole=True).transient_bytes == 160
    assert walk().transient_bytes == 220


def test_whole_gradients_are_held_beside_the_shard_and_the_activations() -> None:
    """zero=2 over 4 replicas, 1000 bf16 parameters: whole gradients (2 B) beside the fp32 shard
    (4/4 B) through the step; the backward holds them with every activation (500 B), so the peak
    is the larger of that and the step's reductions beyond them (300 B)."""
    from mplan.cost_models.memory_model import estimate_memory, mplan_bytes_per_param

    per = mplan_bytes_per_param("bf16", zero=2)
    common = dict(num_params=1000, per_param=per, zero=2, dp=4, activation_bytes=500.0, num_in_flight=1,
                  fragmentation=0.0, activations_beside_transient=0.0)
    whole = estimate_memory(**common, grads_whole=True, grad_transient_bytes=300.0)
    assert whole.grads_bytes == 1000 * (2 + 1) and whole.activations_bytes == 500
    assert whole.total_bytes == 1000 * (2 + 2 + 1 + 3) + 500
    assert estimate_memory(**common, grads_whole=True, grad_transient_bytes=800.0).total_bytes == \
        1000 * (2 + 2 + 1 + 3) + 800
    assert per.total(zero=2, dp=4, grads_whole=True) == per.total(zero=2, dp=4) + 2
    shard_only = estimate_memory(**common, grad_transient_bytes=300.0)
    assert whole.total_bytes - shard_only.total_bytes == 1000 * 2


def test_the_planner_counts_whole_gradients_only_under_mplan_pipelines() -> None:
    from mplan.planner.parallel_config import ParallelConfig
    from mplan.planner.zero_pricing import grads_whole_until_step

    pipeline = ParallelConfig(dp=2, tp=1, pp=2, mbs=1, num_micro_batches=4, zero=2)
    assert grads_whole_until_step(pipeline, "mplan")
    assert not grads_whole_until_step(pipeline, "megatron")
    assert not grads_whole_until_step(ParallelConfig(dp=4, tp=1, pp=1, mbs=1, num_micro_batches=4, zero=3), "mplan")
    assert not grads_whole_until_step(ParallelConfig(dp=2, tp=1, pp=2, mbs=1, num_micro_batches=4, zero=1), "mplan")
