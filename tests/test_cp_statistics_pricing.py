"""The all-reduces of a loss's token statistics under cp are priced (issue 34,
`planner/context_pricing.py`): each statistic an MoE load-balancing loss reads (a token mean or
partial sum, `ir.token_statistics`) is all-reduced over the cp group once per micro-batch, and its
gradient once more backward where one flows into it (`passes/split_context.ContextStatistic`).

Checked on the Mixtral-style model of tests/test_cp_moe.py with its router loss on, at 131072
tokens (the unit computing the statistics is then device-bound, so its added seconds reach the
step whole): its two statistics are found with their bytes and gradients, and the priced step of
a cp plan exceeds the same plan priced without them by exactly m x (two forward all-reduces and
one backward) on the cp group, from `collective_time`.
"""
from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest

from test_cp_moe import MIXTRAL_CONFIG


@pytest.fixture(scope="module")
def routed_graph(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mplan.planner.planning import capture_for_planning

    where = tmp_path_factory.mktemp("mixtral_router_loss")
    (where / "config.json").write_text(json.dumps({**MIXTRAL_CONFIG, "output_router_logits": True}))
    return capture_for_planning(str(where), seq_len=131072)


def test_the_router_loss_has_two_statistics_one_with_a_gradient(routed_graph: Any) -> None:
    """transformers' load-balancing loss sums, over the layers, a histogram of the routed choices
    (integer indices cast: no gradient) and the router probabilities (a gradient): two [8] float32
    vectors, both computed in the last unit, where the loss is."""
    from mplan.planner.context_pricing import token_statistic_ops

    found = token_statistic_ops(routed_graph)
    assert [(s.nbytes, s.grad) for s in found] == [(32.0, False), (32.0, True)], found
    last = routed_graph.segments[-1]
    assert {s.node for s in found} <= set(last.nodes), (found, last.name)


@pytest.mark.parametrize("degrees", [dict(dp=4, cp=2), dict(tp=4, cp=2, sp=True), dict(cp=8, ep=8)],
                         ids=["dp4-cp2", "tp4-cp2", "cp8-ep8"])
def test_a_cp_step_costs_exactly_the_statistics_all_reduces_more(routed_graph: Any, degrees: dict) -> None:
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.cost_models.collective_cost import collective_time
    from mplan.planner.parallel_config import ParallelConfig
    from mplan.planner.search import Planner

    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    config = ParallelConfig(**{"dp": 1, "tp": 1, "pp": 1, **degrees}, mbs=1, num_micro_batches=2)
    priced = Planner(routed_graph, cluster).evaluate(config)
    with mock.patch("mplan.planner.search.token_statistic_ops", return_value=()):
        without = Planner(routed_graph, cluster).evaluate(config)
    one = collective_time(cluster, "all_reduce", 32.0, config.mesh.group_shape("cp", cluster.gpus_per_node))
    term = config.num_micro_batches * 3 * one  # two forward, the probabilities' backward
    assert term > 0
    assert priced.step_time_s - without.step_time_s == pytest.approx(term, rel=1e-9)
    assert priced.context.exposed_s - without.context.exposed_s == pytest.approx(term, rel=1e-9)


def test_a_model_without_its_router_loss_has_no_statistics() -> None:
    from mplan.planner.context_pricing import token_statistic_ops
    from mplan.planner.planning import capture_for_planning

    dense = "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=4096,vocab=64,ffn=48"
    assert token_statistic_ops(capture_for_planning(dense, seq_len=4096)) == ()
