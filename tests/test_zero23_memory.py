"""ZeRO's memory (issue 33): a rank's peak against the memory model, and zero=3's parameters
between steps, released storage that refuses to be read.

Peak (one gloo group of 4 ranks): benchmarks/ranks/zero_memory.py's `measure_level` on every rank,
a 4-layer Llama in bf16 under dp=4 at zero 1, 2 and 3 built on the planner's plan for each spec:
the CPU allocator's peak during a training step (profiled, added to what the module holds) beside
the Plan's predicted peak without its fragmentation margin. Every rank within `TOLERANCE` (10%).

Released parameters (the same 4 ranks, dp=4; tiny Llama, float64; at dp=1 nothing is released,
the parameters being the shard itself):
zero=3 frees each unit's gathered weights by resizing their storage to 0 bytes, so between steps
`pm.params` are tensors of the right shape over no memory; torch does not check, and reading one
read freed memory (garbage, or a crash). Now reading one raises one line naming
`pm.whole_parameter(name)` and `pm.full_state_dict()` (`runtime/released_parameters.py`), while
its metadata, the whole-parameter accessors, inference and the next step work as before.
"""
from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from distributed import rel_err, run_checks
from test_equivalence import batches, family

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.ranks import zero_memory  # noqa: E402

LEVELS = (1, 2, 3)


# -- the peak against the memory model (4 ranks) ---------------------------------------------------
def zero1_peak() -> dict[str, Any]:
    return zero_memory.measure_level(1)


def zero2_peak() -> dict[str, Any]:
    return zero_memory.measure_level(2)


def zero3_peak() -> dict[str, Any]:
    return zero_memory.measure_level(3)


CHECKS = [zero1_peak, zero2_peak, zero3_peak]


def zero1_reductions_in_flight() -> dict[str, Any]:
    """zero=1 over many buckets (8 Linear(128, 128) layers in fp32, `bucket_bytes` one layer's):
    the most bytes the reduce-scatters' copies (gloo's, allocated inside c10d) hold during the
    last backward, lowest of three profiled steps, beside the walk (`reduction_peak`) of the
    optimizer's own buckets in the order backward launches them."""
    import functools

    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    from mplan.cost_models.memory_model import mplan_bytes_per_param, reduction_peak
    from mplan.ir.mesh import mesh_for_world
    from mplan.runtime import build_optimizer
    from mplan.runtime.process_groups import init_process_groups

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    optimizer = build_optimizer(model.parameters(), functools.partial(torch.optim.AdamW, lr=1e-3),
                                init_process_groups(mesh_for_world(zero_memory.WORLD)), zero=1,
                                bucket_bytes=(128 * 128 + 128) * 4)
    inputs = torch.randn(16, 128)

    def step() -> None:
        optimizer.zero_grad()
        optimizer.before_last_backward()
        loss = model(inputs).square().mean()
        with record_function(zero_memory.MEASURED):
            loss.backward()
        optimizer.step()

    step()
    peaks = []
    for _ in range(6):  # the least of six steps: under load gloo's thread frees a waited copy late, at random
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events, (first, last) = zero_memory.allocations(prof)
        live: dict[int, tuple[int, str]] = {}
        peak = 0
        for time_ns, size, address, op in events:
            if size > 0:
                live[address] = (size, op)
            else:
                live.pop(address, None)
            if first <= time_ns <= last:
                peak = max(peak, sum(n for n, by in live.values() if "c10d::" in by))
        peaks.append(peak)
    sizes = [bucket.numel for _, bucket in optimizer._slots]
    walk = reduction_peak(sizes, [0.0] * len(sizes), zero=1, per_param=mplan_bytes_per_param("fp32", zero=1),
                          copy_bytes=4, replicas=zero_memory.WORLD, outstanding=2, backend_copies=True)
    return {"buckets": len(sizes), "started_in_backward": optimizer.started_in_backward,
            "measured": min(peaks), "predicted": walk.transient_bytes, "every_bucket": 4 * sum(sizes)}


@pytest.fixture(scope="module")
def world4():
    return run_checks(zero_memory.WORLD, [*CHECKS, zero1_reductions_in_flight, released_parameters],
                      timeout_s=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_predicted_peak_is_within_10_percent_of_the_measured_one(world4, check) -> None:
    for rank, row in enumerate(world4.assert_passed(check)):
        measured, predicted = row["peak_bytes"], row["predicted"]["total"]
        assert abs(predicted / measured - 1) < zero_memory.TOLERANCE, (rank, row)
        assert row["plan"].startswith("dp=4,") and f"zero={row['zero']}" in row["plan"], row


def test_zero3_holds_less_than_zero1_measured_and_predicted(world4) -> None:
    """zero=3 shards the parameters and its unit's gradients; zero=1 holds both whole, and at the
    end of the backward a master-dtype copy of every gradient bucket for its reduce-scatter."""
    for one, three in zip(world4.assert_passed(zero1_peak), world4.assert_passed(zero3_peak)):
        assert three["peak_bytes"] < 0.7 * one["peak_bytes"], (one, three)
        assert three["predicted"]["total"] < 0.7 * one["predicted"]["total"], (one, three)


def test_zero1_holds_at_most_three_buckets_reducing_and_the_walk_counts_them(world4) -> None:
    """Uncapped, zero=1's last backward kept every bucket's copy until the step (1.06 MB of copies
    for 16 buckets of 0.53 MB here); now at most MAX_IN_FLIGHT + 1 reduce-scatters hold theirs.
    The walk (0.197 MB) reads one layer's copy below the allocator's profile (0.263 MB): the copy
    of the reduction waited for last may be freed on gloo's thread, unrecorded (see
    zero_memory.peak_of_step), or stay until that thread lets it go; not resolved. On a quiet
    machine (2026-12-06) most runs measured 1 KiB more than one layer's copy above the walk (0.264
    MB: two bias buckets' copies more), where loaded CI runs had measured 0.263; so the walk is held
    to within two layers' copies (0.33 MB, against 1.06 MB uncapped), not 2%."""
    layer_copy = 4 * (128 * 128 + 128)
    for row in world4.assert_passed(zero1_reductions_in_flight):
        assert row["buckets"] >= 8 and row["started_in_backward"] == row["buckets"], row
        assert row["predicted"] <= row["measured"] <= row["predicted"] + 2 * layer_copy, row
        assert row["measured"] < 0.6 * row["every_bucket"], row  # uncapped: twice every bucket


# -- released parameters (the same 4 ranks) --------------------------------------------------------
RELEASED = "embed.weight"
READS: dict[str, Callable[[torch.Tensor], object]] = {
    "sum": lambda p: p.sum(), "tolist": lambda p: p.tolist(), "clone": lambda p: p.clone(),
    "add": lambda p: p + 1, "index": lambda p: p[0], "numpy_of_detached": lambda p: p.detach().numpy(),
    "save": lambda p: torch.save(p, io.BytesIO()), "transpose": lambda p: p.t()}


def released_parameters() -> dict[str, Any]:
    """tiny-llama under dp=4 at zero=3 and zero=1 after one step: what each read of a released
    parameter raised, its metadata, the whole-parameter accessors, and the step after a refused read."""
    import mplan

    world = zero_memory.WORLD
    data = batches(world, steps=2)
    built = {zero: mplan.autoparallel(family("tiny-llama")(), example_inputs=(data[0][0],), global_batch=world,
                                      plan=f"dp={world},zero={zero}", progress="quiet") for zero in (1, 3)}
    for pm in built.values():
        pm.train_step(*data[0])
    pm, zero1 = built[3], built[1]
    param = pm.params[RELEASED]
    raised: dict[str, str | None] = {}
    for name, read in READS.items():
        try:
            read(param)
            raised[name] = None
        except RuntimeError as err:
            raised[name] = str(err)
    result: dict[str, Any] = {
        "raised": raised, "repr": repr(param), "str": f"{param}", "type": type(param).__name__,
        "metadata": (isinstance(param, torch.nn.Parameter), param.requires_grad, param.grad is None,
                     tuple(param.shape), str(param.dtype), param.untyped_storage().nbytes()),
        "zero1_type": type(zero1.params[RELEASED]).__name__}
    whole = pm.whole_parameter(RELEASED)
    with pm.optimizer.parameters_whole():
        inside = pm.params[RELEASED].detach().clone()
    result["accessors_agree"] = torch.equal(whole, pm.full_state_dict()[RELEASED]) and torch.equal(whole, inside)
    result["whole_vs_zero1"] = rel_err(whole, zero1.whole_parameter(RELEASED))
    try:
        param.sum()
        result["refused_again"] = False
    except RuntimeError:
        result["refused_again"] = True
    result["next_loss"] = (pm.train_step(*data[1]), zero1.train_step(*data[1]))
    result["inference_vs_zero1"] = rel_err(pm(data[1][0]), zero1(data[1][0]))
    return result


@pytest.mark.parametrize("read", READS)
def test_reading_a_released_parameter_raises_one_line_naming_the_accessors(world4, read: str) -> None:
    for row in world4.assert_passed(released_parameters):
        message = row["raised"][read]
        assert message is not None and "\n" not in message and "released between steps" in message
        assert f"pm.whole_parameter('{RELEASED}')" in message and "pm.full_state_dict()" in message


def test_its_metadata_reads_as_usual_and_its_repr_says_how_to_read_it(world4) -> None:
    for row in world4.assert_passed(released_parameters):
        assert row["metadata"] == (True, True, True, (64, 32), "torch.float64", 0)
        assert f"pm.whole_parameter('{RELEASED}')" in row["repr"] and row["str"] in row["repr"]


def test_the_whole_parameter_reads_the_trained_values(world4) -> None:
    """`pm.whole_parameter`, `pm.full_state_dict()` and reads inside `parameters_whole()` agree,
    and equal zero=1's parameter trained on the same step (to the order of the sums)."""
    for row in world4.assert_passed(released_parameters):
        assert row["accessors_agree"] and row["whole_vs_zero1"] < 1e-12, row["whole_vs_zero1"]


def test_steps_and_inference_run_on_after_a_refused_read(world4) -> None:
    for row in world4.assert_passed(released_parameters):
        assert row["refused_again"]
        three, one = row["next_loss"]
        assert abs(three - one) <= 1e-12 * abs(one) and row["inference_vs_zero1"] < 1e-12, row
        assert row["type"] == "ReleasedParameter"
        assert row["zero1_type"] == "Parameter"  # whole between steps: nothing to guard


# -- the reductions' walk (no process group) -------------------------------------------------------
def _walk(zero: int, buckets: list[float], left: list[float], **options: Any) -> Any:
    from mplan.cost_models.memory_model import mplan_bytes_per_param, reduction_peak

    return reduction_peak(buckets, left, zero=zero, per_param=mplan_bytes_per_param("bf16", zero=zero),
                          copy_bytes=4, replicas=4, outstanding=2, **options)


def test_zero1_holds_at_most_three_copies_in_flight() -> None:
    """Four buckets of 10 elements (40 bytes of fp32 copy each), complete with 30, 20, 10, then no
    bytes of activations left: the runtime keeps two reduce-scatters outstanding and launches a
    third before waiting for the oldest; gloo keeps each copy with its work until then (a launch
    adds our own copy beside gloo's), NCCL reduces ours."""
    gloo = _walk(1, [10, 10, 10, 10], [30, 20, 10, 0], backend_copies=True, activation_bytes=40)
    assert (gloo.transient_bytes, gloo.activations_bytes) == (4 * 40, 10)
    nccl = _walk(1, [10, 10, 10, 10], [30, 20, 10, 0], activation_bytes=40)
    assert (nccl.transient_bytes, nccl.activations_bytes) == (3 * 40, 10)


def test_zero2_walks_every_micro_batch_with_the_reductions_before_still_in_flight() -> None:
    """One bucket of 100 elements, two micro-batches, gloo: the first's copy and result (a quarter
    of the bucket) are still in flight when the second's gradients land, flattened and launched."""
    peak = _walk(2, [100], [0], micro_batches=2, backend_copies=True, activation_bytes=50)
    copy, result = 4 * 100, 4 * 100 / 4
    assert (peak.transient_bytes, peak.activations_bytes) == (2 * (copy + result) + copy, 0)


def test_the_peak_is_the_larger_of_the_activations_and_the_reductions_beside_what_is_left() -> None:
    from mplan.cost_models.memory_model import estimate_memory, mplan_bytes_per_param

    def total(transient: float, beside: float | None) -> float:
        return estimate_memory(num_params=0, per_param=mplan_bytes_per_param("bf16", zero=1), zero=1, dp=4,
                               activation_bytes=100.0, num_in_flight=1, fragmentation=0.0,
                               grad_transient_bytes=transient, activations_beside_transient=beside).total_bytes
    assert total(80.0, 0.0) == 100.0  # the activations' peak
    assert total(80.0, 30.0) == 110.0  # the reductions' with 30 bytes of activations left
    assert total(80.0, None) == 180.0  # beside every activation
