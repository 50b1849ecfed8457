"""Context parallelism (issue 34, stage 1): a plan with `cp` trains exactly as one device.

Each check trains with `mplan.autoparallel(..., plan="cp=2")` (and cp x tp with sp, cp x dp with
ZeRO-1 and ZeRO-3, cp with full and selective recomputation, cp with the fused kernels) for 3 AdamW steps with active global-norm clipping and compares every step's loss and every
final parameter with one process, in float64: relative error under 1e-9. The sequence is split in
head-tail chunks over the cp ranks; attention all-gathers keys and values (`split_context`).
Refusals: a sequence that does not split into 2*cp chunks. Models that build their own mask
tensor (Hugging Face's, nanoGPT's) and their refusals: tests/test_context_parallel_hf.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import run_checks
from test_equivalence import TOL, batches, errors, family, single_device, trained

STEPS = 3
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"
GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


def _compare(make: Any, plan: Any, global_batch: int, *, ignored: int = 0, **options: Any) -> dict[str, Any]:
    """`ignored`: the first tokens of every sequence have label -100, so the cp ranks count
    different numbers of tokens (head-tail: rank 0 holds the first chunk) and the loss's mean is
    only exact if the counts are summed over the group."""
    data = batches(global_batch, steps=STEPS, vocab=64, seq=16)
    for _, labels in data:
        labels[:, :ignored] = -100
    pm, losses, norms = trained(make, plan, data, **options)
    kinds = [type(m).__name__ for m in pm.program.modules()]
    return {**errors(pm, losses, norms, single_device(make, data)), "cp": pm.plan.mesh.cp,
            "attention": kinds.count("ContextAttention"), "positions": kinds.count("ContextPositions")}


def cp2_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2", 2, ignored=5)


def cp2_llama_ring() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,cp_method=ring", 2, ignored=5)


def cp2_llama_all_to_all() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,cp_method=all_to_all", 2, ignored=5)


def cp2_llama_planned() -> dict[str, Any]:
    """A cp plan `mplan plan` makes (on a shallow capture of whole sequences, its method chosen by
    price) binds to autoparallel's capture of the rank's slice and trains exactly."""
    import mplan
    from mplan.cost_models.presets import local_cluster

    plan = mplan.plan(LLAMA, cluster=local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}), global_batch=2,
                      spec="cp=2", runtime="mplan", progress="quiet")
    return _compare(family(LLAMA), plan, 2, ignored=5)


def cp2_gpt() -> dict[str, Any]:
    """Learned position embeddings: the embedding of arange(S) reads the rank's positions."""
    return _compare(family(GPT), "cp=2", 2, ignored=5)


def cp2_pp2_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,pp=2", 4)


def cp4_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=4", 2)


def cp2_tp2_sp_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,tp=2,sp=1", 2)


def cp2_dp2_zero1_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,dp=2,zero=1", 4)


def cp2_recompute_full_llama() -> dict[str, Any]:
    """Every block re-run in backward: the re-run forward gathers K/V again and reads the same positions."""
    return _compare(family(LLAMA), "cp=2,recompute=full", 2, ignored=5)


def cp2_recompute_selective_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,recompute=selective", 2, ignored=5)


def cp2_kernels_llama() -> dict[str, Any]:
    """mplan's fused program (norms, RoPE, SwiGLU, the head + loss as fused ops; on a CPU their torch
    paths, Triton's on a GPU) around context attention."""
    return _compare(family(LLAMA), "cp=2", 2, ignored=5, kernels=True)


def cp2_dp2_zero3_llama() -> dict[str, Any]:
    return _compare(family(LLAMA), "cp=2,dp=2,zero=3", 4)


def _refusal(make: Any, plan: str, seq: int) -> str:
    import mplan

    ids = torch.randint(0, 64, (2, seq))
    try:
        mplan.autoparallel(make(), example_inputs=(ids,), global_batch=2, plan=plan)
    except Exception as error:  # the refusal's one line is what is checked
        return f"{type(error).__name__}: {error}"
    return "not refused"


def refuses_uneven_sequence() -> str:
    return _refusal(family(LLAMA), "cp=2", 6)  # 6 tokens do not make 2*cp = 4 chunks


def _check(values: list[dict[str, Any]], cp: int, *, positions: int = 2) -> None:
    assert values, "no per-rank results"
    for rank, result in enumerate(values):
        # two attention layers; RoPE's cos and sin tables (GPT: its position ids) read at the rank's positions
        assert result["cp"] == cp and result["attention"] == 2 and result["positions"] == positions, result
        assert result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"


@pytest.fixture(scope="module")
def world2() -> Any:
    return run_checks(2, [cp2_llama, cp2_llama_ring, cp2_llama_all_to_all, cp2_llama_planned, cp2_gpt,
                          cp2_recompute_full_llama, cp2_recompute_selective_llama, cp2_kernels_llama,
                          refuses_uneven_sequence], timeout_s=300)


@pytest.mark.parametrize("check,positions", [(cp2_llama, 2), (cp2_llama_ring, 2), (cp2_llama_all_to_all, 2),
                                             (cp2_llama_planned, 2), (cp2_gpt, 1), (cp2_recompute_full_llama, 2),
                                             (cp2_recompute_selective_llama, 2), (cp2_kernels_llama, 2)])
def test_cp2(world2: Any, check: Any, positions: int) -> None:
    _check(world2.assert_passed(check), 2, positions=positions)


def test_sequence_must_split_into_2cp_chunks(world2: Any) -> None:
    for message in world2.assert_passed(refuses_uneven_sequence):
        assert message.startswith("PlanSpecError") and "2*cp = 4 chunks" in message and "[2, 6]" in message, message


@pytest.mark.parametrize("check,cp", [(cp4_llama, 4), (cp2_tp2_sp_llama, 2), (cp2_dp2_zero1_llama, 2),
                                      (cp2_pp2_llama, 2), (cp2_dp2_zero3_llama, 2)])
def test_world4(world4: Any, check: Any, cp: int) -> None:
    _check(world4.assert_passed(check), cp)


@pytest.fixture(scope="module")
def world4() -> Any:
    return run_checks(4, [cp4_llama, cp2_tp2_sp_llama, cp2_dp2_zero1_llama, cp2_pp2_llama, cp2_dp2_zero3_llama],
                      timeout_s=400)


# -- the plan: grammar, JSON, explain (one process) --------------------------------------------------
def _cp_plan() -> Any:
    from mplan.cost_models.presets import local_cluster
    from mplan.ir.trace import capture_for_training
    from mplan.models import build_model
    from mplan.planner.resolve import resolve_plan

    model = build_model(LLAMA, device="cpu", dtype=torch.float64, seed=0)
    graph = capture_for_training(model, (torch.zeros(2, 8, dtype=torch.long),))  # one rank's 16 / 2 tokens
    cluster = local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    return resolve_plan("cp=2", graph, cluster=cluster, world_size=2, global_batch=2)


def test_plan_records_cp_and_round_trips() -> None:
    import json

    from mplan.planner.explain import explain_data
    from mplan.planner.plan import Plan, PlanError

    plan = _cp_plan()
    assert (plan.mesh.cp, plan.mesh.dp, plan.model.seq_len) == (2, 1, 16)
    assert "cp=2" in plan.spec() and plan.mesh_shape().size == 2
    data = json.loads(plan.to_json())
    assert data["mesh"]["cp"] == 2
    assert Plan.from_dict(data) == plan
    assert explain_data(plan)["mesh"]["cp"] == 2
    old = json.loads(plan.to_json())
    del old["mesh"]["cp"]  # a plan file written before cp: cp=1, and its mesh must fill the world
    with pytest.raises(PlanError, match=r"mesh dp\*tp\*pp\*cp = 1\*1\*1\*1 = 1 does not equal cluster.world_size 2"):
        Plan.from_dict(old)


def test_cp_is_priced_as_replicas_plus_the_kv_exchange() -> None:
    """The step of a cp plan on a slice graph (autoparallel's capture): its dp * cp replica config on
    the rank's slice, plus the K/V all-gather and reduce-scatter of both attention layers from
    collective_time, plus the attention the slice under-counts (its keys are 1/cp of the sequence)."""
    import dataclasses
    import io

    from rich.console import Console

    from mplan.cost_models.collective_cost import collective_time
    from mplan.cost_models.presets import local_cluster
    from mplan.ir.trace import capture_for_training
    from mplan.models import build_model
    from mplan.planner.context_pricing import replica_config
    from mplan.planner.explain import config_of, render
    from mplan.planner.search import Planner, PlanningError

    model = build_model(LLAMA, device="cpu", dtype=torch.float64, seed=0)
    graph = capture_for_training(model, (torch.zeros(2, 8, dtype=torch.long),))
    cluster = local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    planner = Planner(graph, cluster, runtime="mplan", tp_layout="megatron", context_slice=2)
    plan = _cp_plan()
    config = config_of(plan)
    replica = Planner(graph, cluster, runtime="mplan", tp_layout="megatron").evaluate(replica_config(config))
    with pytest.raises(PlanningError, match="it prices cp=2 only, not cp=1"):
        planner.evaluate(replica_config(config))

    def exchange_s(method: str) -> float:
        _, exchanges = planner.context_units(dataclasses.replace(config, cp_method=method))
        return sum(e.forward_s + e.backward_s for unit in exchanges for e in unit)
    # per layer: k and v of [2, kv_heads=2, 8, head_dim=8] float64, gathered to 16 tokens, and back
    kv_bytes = 2 * (2 * 2 * 8 * 8 * 8) * 2
    one = collective_time(cluster, "all_gather", kv_bytes, config.mesh.group_shape("cp", 2))
    exchange = exchange_s("all_gather")
    assert exchange == pytest.approx(2 * (one + collective_time(cluster, "reduce_scatter", kv_bytes,
                                                                 config.mesh.group_shape("cp", 2))))
    assert plan.predicted.step_time_s == pytest.approx(planner.evaluate(config).step_time_s)
    assert plan.predicted.step_time_s > replica.step_time_s + exchange  # and the rest of each rank's attention
    out = io.StringIO()
    render(plan, Console(file=out, width=200))
    assert "cp=2 (head-tail chunks, keys and values all-gathered)" in out.getvalue()
    # a ring of two ranks, gloo (no overlap on CPU ranks): one hop of K, V forward; backward one of
    # K, V, one of the first block's dK, dV, and the last accumulator's way home, per layer
    hop = collective_time(cluster, "send_recv", kv_bytes // 2, config.mesh.group_shape("cp", 2))
    assert exchange_s("ring") == pytest.approx(2 * 4 * hop)


def test_spec_grammar_and_search_keep_cp_one_at_short_sequences_unless_named() -> None:
    from mplan.planner.parallel_config import ModelLimits, PlanSpec, enumerate_configs, parse_plan_spec

    from mplan.collectives.context_attention import METHODS
    from mplan.planner.parallel_config import CP_METHODS, PlanSpecError

    assert parse_plan_spec("cp=2,tp=2").cp == 2
    assert CP_METHODS == METHODS and parse_plan_spec("cp=2,cp_method=ring").cp_method == "ring"
    with pytest.raises(PlanSpecError, match="cp_method must be one of all_gather, ring, all_to_all"):
        parse_plan_spec("cp=2,cp_method=ulysses")
    limits = ModelLimits(num_layers=2, num_heads=4, num_kv_heads=2, num_experts=0, seq_len=16)
    searched = list(enumerate_configs(world_size=4, gpus_per_node=4, global_batch=4, limits=limits, spec=PlanSpec()))
    assert searched and {c.cp for c in searched} == {1}
    named = list(enumerate_configs(world_size=4, gpus_per_node=4, global_batch=4, limits=limits,
                                   spec=parse_plan_spec("cp=2")))
    assert named and {c.cp for c in named} == {2} and all(c.world_size == 4 for c in named)
