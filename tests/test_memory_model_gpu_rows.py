"""Issue 33's GPU rows: the memory model against the peaks measured on one H100.

A 1.26B Llama at dp=1, two micro-batches of 2 sequences of 2048 a step, under zero=0, 1 and 3
(benchmarks/results/zero_bench_h100-2026-12-06.json: `mplan bench --measure`, torch 2.11 + CUDA 13).
The measured peak is `torch.cuda.max_memory_allocated`. The Plan's `memory_gib` puts the planner's
allocator margin (`FRAGMENTATION_FRACTION`, 10%) on top of what the tensors hold: room for the
caching allocator's cached blocks and the CUDA context, which that counter never sees, so it reads
9.4-10.5% above those peaks by construction. What the model predicts the tensors hold (the same
evaluation, margin 0) is within 1% of each measured peak, component by component as the runtime
allocates them:
  zero=0  bf16 weights, their bf16 gradients (kept whole over the 4 micro-batches) and AdamW's two
          bf16 moments stepped in place: 8 bytes a parameter (replicated_optimizer.py)
  zero=1  at dp=1 still the fp32 master shard, its fp32 gradient and two fp32 moments (16 bytes)
          beside the bf16 weights and gradients; the flat copies of the last backward's reductions
  zero=3  over a group of one the weights are the shard (no gather, fully_sharded.py); the fp32
          gradient shard, master and moments (16 bytes) and the bf16 weights, one bucket's
          gradients whole at a time
and one micro-batch's activations of the fused kernels (1F1B at pp=1 holds one).
"""
from __future__ import annotations

import json
import os

import pytest

from mplan.cost_models.memory_model import FRAGMENTATION_FRACTION

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
MEASURED = os.path.join(RESULTS, "zero_bench_h100-2026-12-06.json")
CLUSTER = os.path.join(RESULTS, "profile_h100-2026-12-05.json")
MODEL = "llama:layers=24,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000"
GLOBAL_BATCH = 8
TOLERANCE = 0.02
"""|predicted allocated / measured - 1| allowed: the rows read -0.6%, +0.0% and +0.5%."""
OPTIMIZER_BYTES_PER_PARAM = {0: 4, 1: 16, 3: 12}
"""The optimizer's bytes a parameter at dp=1 (mplan_bytes_per_param): bf16 moments at zero=0;
fp32 master, gradient and moments at zero=1; zero=3's gradient shard counted with the gradients."""
GiB = float(1 << 30)


@pytest.fixture(scope="module")
def rows():
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.parallel_config import ParallelConfig, parse_plan_spec
    from mplan.planner.planning import capture_for_planning
    from mplan.planner.search import Planner

    with open(MEASURED, encoding="utf-8") as f:
        measured = json.load(f)["plans"]
    planner = Planner(capture_for_planning(MODEL), ClusterSpec.from_json(CLUSTER), kernels=True, runtime="mplan")
    out = []
    for row in measured:
        spec = parse_plan_spec(row["resolved_spec"])
        config = ParallelConfig(dp=1, tp=1, pp=1, mbs=spec.mbs, num_micro_batches=GLOBAL_BATCH // spec.mbs,
                                zero=spec.zero)
        out.append((row, config, planner.evaluate(config, fast=True, fragmentation=0.0),
                    planner.evaluate(config, fast=True)))
    return out


def test_three_rows_were_measured_at_zero_0_1_and_3(rows) -> None:
    assert [config.zero for _, config, _, _ in rows] == [0, 1, 3]
    assert all(row["measured"]["device"].startswith("NVIDIA H100") for row, _, _, _ in rows)


def test_what_the_tensors_hold_is_predicted_within_2_percent_of_the_measured_peak(rows) -> None:
    for row, config, allocated, _ in rows:
        peak = row["measured"]["peak_memory_gib"]
        assert abs(allocated.peak_memory_bytes / GiB / peak - 1) < TOLERANCE, (config.spec(), peak)


def test_the_plans_memory_is_that_prediction_with_the_allocator_margin_on_top(rows) -> None:
    """The 9.4-10.5% over the measured peaks is the margin, nothing the tensors hold. (The run's own
    predictions were made with the fused head's 4096-row chunks at this 2048-wide head; the
    default is 2048 rows since session 15, 128 MiB less, so today's prediction is not the run's.)"""
    for row, _, allocated, planned in rows:
        assert planned.peak_memory_bytes == pytest.approx(allocated.peak_memory_bytes * (1 + FRAGMENTATION_FRACTION))
        assert 0 < row["predicted"]["memory_gib"] - planned.peak_memory_bytes / GiB < 0.15


def test_the_optimizer_state_is_the_runtimes_bytes_per_parameter(rows) -> None:
    for _, config, allocated, _ in rows:
        (memory,) = allocated.memory
        params = memory.params_bytes / 2  # bf16 weights, whole at every level over one replica
        assert memory.optimizer_bytes == pytest.approx(OPTIMIZER_BYTES_PER_PARAM[config.zero] * params)
        assert 1.2e9 < params < 1.3e9
