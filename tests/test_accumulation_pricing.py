"""Gradient accumulation is priced (`planner/evaluate._accumulation_s`): under mplan's runtime each
micro-batch's backward adds its gradients into the ones already held, a memory-bound pass of
3 x the gradient bytes (read both, write one). At dp=1 the first backward creates the gradients,
so a step of m micro-batches pays m - 1 passes; at dp > 1 the buckets hold zeroed gradients from
the step's start, so it pays m. Megatron's wgrad GEMMs accumulate in place: none. On an H100 a
Qwen3-1.7B step at micro-batch 1 was priced 12% low without it (hf_measure_h100-2026-12-06-qwen3.json).
"""
from __future__ import annotations

import pytest
import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.memory_model import mplan_bytes_per_param
from mplan.models import GPTConfig, build_model
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner

CLUSTER = ClusterSpec.preset("dgx-h100", nodes=1)


@pytest.fixture(scope="module")
def graph():  # noqa: ANN201
    config = GPTConfig(num_layers=4, hidden=1024, num_heads=16, seq_len=512, vocab=32000, tie_embeddings=True)
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    return capture_for_planning(model, (torch.zeros(1, config.seq_len, dtype=torch.long),))


def _config(dp: int, mbs: int, micro_batches: int, zero: int = 0) -> ParallelConfig:
    return ParallelConfig(dp=dp, tp=1, pp=1, mbs=mbs, num_micro_batches=micro_batches, zero=zero)


def _one_pass(planner: Planner) -> float:
    """One accumulation pass over the model's every parameter, as the evaluator prices it."""
    return planner.evaluate(_config(1, 1, 2)).chunk_accumulate_s[0] * 2  # m = 2 at dp = 1: one, over 2


def test_a_pass_is_three_times_the_gradient_bytes_at_the_cards_copy_rate(graph) -> None:  # noqa: ANN001
    planner = Planner(graph, CLUSTER, runtime="mplan")
    units = planner.units(1, False, 1)
    params = sum(u.num_params for u in units)
    grad = mplan_bytes_per_param("bf16", zero=0).grad
    want = ComputeCostModel(CLUSTER).memory_bound_time(3 * grad * params)
    assert _one_pass(planner) == pytest.approx(want, rel=1e-12)
    assert want > 0


@pytest.mark.parametrize("dp, micro_batches, passes", [(1, 1, 0), (1, 4, 3), (1, 8, 7), (2, 1, 1), (2, 4, 4)])
def test_a_step_pays_one_pass_per_micro_batch_that_finds_gradients_there(graph, dp: int, micro_batches: int,
                                                                         passes: int) -> None:  # noqa: ANN001
    planner = Planner(graph, CLUSTER, runtime="mplan")
    estimate = planner.evaluate(_config(dp, 1, micro_batches))
    assert sum(estimate.chunk_accumulate_s) * micro_batches == pytest.approx(passes * _one_pass(planner), rel=1e-12)
    # inside each micro-batch's backward, and in its weight-gradient (W) share
    assert estimate.chunk_weight_s[0] >= estimate.chunk_accumulate_s[0]


def test_more_micro_batches_of_the_same_tokens_cost_the_passes_more(graph) -> None:  # noqa: ANN001
    """Eight micro-batches of one sequence against one of eight: the difference holds seven passes."""
    planner = Planner(graph, CLUSTER, runtime="mplan")
    many, one = planner.evaluate(_config(1, 1, 8)), planner.evaluate(_config(1, 8, 1))
    assert one.chunk_accumulate_s == (0.0,)
    assert many.step_time_s - one.step_time_s > 7 * _one_pass(planner)


def test_megatrons_runtime_accumulates_in_its_wgrad_gemms_and_pays_no_pass(graph) -> None:  # noqa: ANN001
    planner = Planner(graph, CLUSTER, runtime="megatron")
    assert planner.evaluate(_config(2, 1, 4)).chunk_accumulate_s == (0.0,)
