"""Memory model: Megatron's distributed-optimizer bytes per parameter, activations by recompute mode,
and the planner's evaluation of every pipeline rank through it (in-flight counts from the schedule IR)."""
from __future__ import annotations

import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.memory_model import (FRAGMENTATION_FRACTION, activation_bytes_kept, backward_peak,
                                            bytes_per_param, estimate_memory, mplan_bytes_per_param)
from mplan.ir.schedule import max_in_flight, one_f_one_b
from mplan.planner.evaluate import ModelFacts, evaluate, schedule_of
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.planning import capture_for_planning
from mplan.planner.unit_costs import UnitCost


@pytest.mark.parametrize("param, grad, whole, fixed, sharded", [
    ("bf16", "fp32", 18, 6, 12),  # Megatron dist_optimizer.md: 18 -> 6 + 12/d
    ("fp16", "fp16", 20, 4, 16),  # 20 -> 4 + 16/d
    ("fp32", "fp32", 16, 8, 8),  # 16 -> 8 + 8/d
])
def test_bytes_per_param_match_megatrons_table(param: str, grad: str, whole: int, fixed: int, sharded: int) -> None:
    per = bytes_per_param(param, grad)
    assert per.total() == whole
    assert (per.param + per.grad, per.optimizer) == (fixed, sharded)
    for dp in (2, 8, 64):
        assert per.total(zero=1, dp=dp) == pytest.approx(fixed + sharded / dp)
        assert per.total(zero=0, dp=dp) == whole


def test_mplans_runtime_steps_bf16_in_place_at_zero0_and_keeps_fp32_master_shards_at_zero1() -> None:
    """Measured on two H200s with Llama-3-8B: the plan priced so came within 1.2% and 7% of peak
    memory, where Megatron's accounting priced the zero=0 plan 81% high."""
    assert mplan_bytes_per_param("bf16", zero=0).total(zero=0, dp=2) == 2 + 2 + 4
    assert mplan_bytes_per_param("bf16", zero=1).total(zero=1, dp=2) == 2 + 2 + 16 / 2
    assert mplan_bytes_per_param("fp32", zero=1).total(zero=1, dp=4) == 4 + 4 + 16 / 4


def test_fp64_and_sgd_states() -> None:
    assert bytes_per_param("fp64", "fp64").total() == 8 + 8 + 16  # fp64 Adam moments, no master copy
    assert bytes_per_param("bf16", "fp32", "sgd").optimizer == 4 + 4  # master + one momentum
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        bytes_per_param("bf16", "fp32", "lion")


def test_a_one_billion_parameter_stage_with_the_distributed_optimizer() -> None:
    act = 3.0e9
    result = estimate_memory(num_params=1e9, per_param=bytes_per_param("bf16", "fp32"), zero=1, dp=8,
                             activation_bytes=act, num_in_flight=4, largest_workspace_bytes=0.5e9)
    assert (result.params_bytes, result.grads_bytes, result.optimizer_bytes) == (2e9, 4e9, 1.5e9)
    assert result.activations_bytes == 4 * act
    steady = 2e9 + 4e9 + 1.5e9 + 12e9 + 0.5e9
    assert result.transient_bytes == pytest.approx(0.5e9 + FRAGMENTATION_FRACTION * steady)
    assert result.total_bytes == pytest.approx(steady * (1 + FRAGMENTATION_FRACTION))
    assert result.gib == pytest.approx(result.total_bytes / 2**30)
    as_dict = result.as_dict()
    assert set(as_dict) == {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                            "transient_bytes", "total_bytes", "total_gib"}
    assert as_dict["total_bytes"] == result.total_bytes


def test_in_flight_microbatches_come_from_the_schedule() -> None:
    schedule = one_f_one_b(4, 16)
    per_rank = [estimate_memory(num_params=0, per_param=bytes_per_param(), activation_bytes=1e9,
                                num_in_flight=max_in_flight(schedule, r), fragmentation=0.0).activations_bytes
                for r in range(4)]
    assert per_rank == [4e9, 3e9, 2e9, 1e9]


def test_recompute_modes() -> None:
    common = dict(activation_bytes=10.0, num_in_flight=3)
    assert activation_bytes_kept(recompute="none", **common) == 30.0
    assert activation_bytes_kept(recompute="selective", selective_activation_bytes=6.0, **common) == 18.0
    assert activation_bytes_kept(recompute="full", checkpoint_bytes=1.0, layer_activation_bytes=2.5, **common) == 5.5
    assert activation_bytes_kept(recompute="full", checkpoint_bytes=1.0, layer_activation_bytes=2.5,
                                 activation_bytes=10.0, num_in_flight=0) == 0.0
    with pytest.raises(ValueError, match="needs selective_activation_bytes"):
        activation_bytes_kept(recompute="selective", **common)
    with pytest.raises(ValueError, match="needs checkpoint_bytes"):
        activation_bytes_kept(recompute="full", **common)
    with pytest.raises(ValueError, match="unknown recompute mode 'some'"):
        activation_bytes_kept(recompute="some", **common)


def test_gradients_made_during_backward_take_the_place_of_the_activations_it_frees() -> None:
    """One micro-batch without gradient buffers: the peak holds the larger of activations and
    gradients (the runtime's .grad is made as backward frees each layer), not their sum."""
    per = mplan_bytes_per_param("bf16", zero=0)
    common = dict(num_params=1e9, per_param=per, num_in_flight=1, fragmentation=0.0)
    both = estimate_memory(activation_bytes=1.5e9, **common)
    overlapped = estimate_memory(activation_bytes=1.5e9, grads_during_backward=True, **common)
    assert both.total_bytes - overlapped.total_bytes == 1.5e9  # grads (2e9) exceed the activations
    assert overlapped.activations_bytes == 0.0 and overlapped.grads_bytes == both.grads_bytes
    wide = estimate_memory(activation_bytes=5e9, grads_during_backward=True, **common)
    assert wide.total_bytes == 1e9 * (per.param + per.optimizer) + 5e9  # activations exceed the grads


def test_the_backward_walk_finds_the_moment_activations_and_gradients_peak_together() -> None:
    """Three units in forward order, walked in reverse: an embedding (tied to the head), a layer,
    a head. Under full recomputation the layer keeps only its input (1), works with all its
    activations (10) when it re-runs, and the peak comes late: the layer's activations with the
    head's and its own gradients (5 + 4), not at the forward's end (all kept: 1 + 1 + 3)."""
    kept, working = [1.0, 1.0, 3.0], [1.0, 10.0, 3.0]
    grads, again = [5.0, 4.0, 5.0], [5.0, 0.0, 0.0]  # the embedding's is the head's tied weight, again
    # head: 1 + 1 kept + 3 working + 5 made = 10; layer: 1 kept + 10 + 5 + 4 = 20; embedding: 1 + 9 + 5 = 15
    assert backward_peak(kept, working, grads, again) == 20.0
    # nothing re-run, activations outweighing the gradients: the last unit's gradients beside them all
    assert backward_peak([30.0, 30.0], [30.0, 30.0], [1.0, 1.0], [0.0, 0.0]) == 61.0
    # the tied weight's second gradient is what the embedding's moment adds on top of all the others
    assert backward_peak([0.0, 0.0], [0.0, 0.0], [5.0, 5.0], [5.0, 0.0]) == 10.0
    with pytest.raises(ValueError, match="one kept, working, grads and again figure per unit"):
        backward_peak([1.0], [1.0, 2.0], [1.0], [0.0])


def test_evaluate_overlaps_gradients_and_activations_only_where_the_runtime_does() -> None:
    """One micro-batch, dp=1: the peak is the backward walk's, between the larger of all the
    activations and all the gradients and their sum; two micro-batches accumulate into gradients
    held throughout, on top of the activations."""
    from mplan.planner.search import Planner

    graph = capture_for_planning("tiny-llama")
    planner = Planner(graph, ClusterSpec.preset("h200"), runtime="mplan")
    one = planner.evaluate(ParallelConfig(dp=1, tp=1, pp=1, mbs=1, num_micro_batches=1), fragmentation=0.0)
    two = planner.evaluate(ParallelConfig(dp=1, tp=1, pp=1, mbs=1, num_micro_batches=2), fragmentation=0.0)
    (m1,), (m2,) = one.memory, two.memory
    held_together = m1.grads_bytes + m1.activations_bytes
    assert max(m1.grads_bytes, m2.activations_bytes) <= held_together < m1.grads_bytes + m2.activations_bytes
    assert m1.total_bytes == pytest.approx(m1.params_bytes + m1.optimizer_bytes + held_together + m1.transient_bytes)
    assert m2.total_bytes > m1.total_bytes  # accumulating over micro-batches holds the gradients throughout


def test_zero_must_be_0_to_3() -> None:
    for zero in (4, -1, True):
        with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
            estimate_memory(num_params=1, per_param=bytes_per_param(), zero=zero, dp=2, activation_bytes=0,
                            num_in_flight=1)


# --- the planner's evaluation goes through this model ------------------------------------------

def _units(count: int) -> list[UnitCost]:
    """Identical blocks of 1M parameters that keep 2 GB, 1 GB selectively and a 0.25 GB input."""
    return [UnitCost(name=f"layers.{i}", block_type="Block", forward_s=1e-3, backward_s=2e-3, comm_forward_s=0.0,
                     comm_backward_s=0.0, num_params=1_000_000, tp_grad_sync_bytes=0, saved_bytes=2_000_000_000,
                     selective_bytes=1_000_000_000, selective_extra_s=1e-4, input_bytes=250_000_000,
                     largest_op_bytes=50_000_000) for i in range(count)]


@pytest.mark.parametrize("runtime", ["megatron", "mplan"])
@pytest.mark.parametrize("config", [
    # all m * vpp forwards run before the first backward: 4 chunks in flight on rank 0, not 5
    ParallelConfig(dp=1, tp=1, pp=2, vpp=2, num_micro_batches=2, schedule="interleaved", recompute="full"),
    ParallelConfig(dp=2, tp=1, pp=2, vpp=2, num_micro_batches=6, schedule="interleaved", recompute="none"),
    ParallelConfig(dp=2, tp=1, pp=4, num_micro_batches=8, recompute="selective", zero=1),
    ParallelConfig(dp=1, tp=1, pp=2, num_micro_batches=3, schedule="gpipe"),
    # one stage runs its micro-batches one at a time whatever the schedule is called
    ParallelConfig(dp=1, tp=1, pp=1, num_micro_batches=4, schedule="gpipe"),
], ids=lambda c: c.short())
def test_evaluate_prices_every_rank_by_the_memory_model_with_the_schedules_in_flight_counts(
        config: ParallelConfig, runtime: str) -> None:
    units = _units(8)
    facts = ModelFacts(training_flops_per_sequence=1e12, seq_len=2048, param_dtype="bf16", runtime=runtime,
                       fp32_grad_copy=runtime == "megatron", stream_bytes_per_sequence=1 << 20)
    per = mplan_bytes_per_param("bf16", zero=config.zero) if runtime == "mplan" else bytes_per_param("bf16", "fp32")
    fast = evaluate(config, units, ClusterSpec.preset("dgx-a100"), facts, fast=True)
    simulated = evaluate(config, units, ClusterSpec.preset("dgx-a100"), facts, fast=False)
    assert fast.memory == simulated.memory
    schedule = schedule_of(config)
    for rank, got in enumerate(fast.memory):
        mine = [u for c in range(rank, config.pp * config.vpp, config.pp) for u in units[slice(*fast.stage_bounds[c])]]
        assert got == estimate_memory(
            num_params=sum(u.num_params for u in mine), per_param=per, zero=config.zero, dp=config.dp,
            recompute=config.recompute, num_in_flight=max_in_flight(schedule, rank),
            activation_bytes=sum(u.saved_bytes for u in mine) / config.vpp,
            selective_activation_bytes=sum(u.selective_bytes for u in mine) / config.vpp,
            checkpoint_bytes=sum(u.input_bytes for u in mine) / config.vpp,
            layer_activation_bytes=max(u.saved_bytes for u in mine), largest_workspace_bytes=2 * 50_000_000)
    if config.schedule == "interleaved" and config.num_micro_batches == config.pp:
        assert max_in_flight(schedule, 0) == config.num_micro_batches * config.vpp
    if config.pp == 1:
        assert max_in_flight(schedule, 0) == 1
