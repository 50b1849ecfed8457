"""The planner weighs context parallelism like the other axes (issue 34, item 2).

What is held: each cp method's exchange priced as the runtime runs it (the ring's hops hidden
behind its blocks' attention on GPUs, not on gloo; all-gather's K/V held for backward; all-to-all's
GQA copies); one cp rank's units as 1/cp of the whole-sequence work; the degrees and methods the
search tries; and the long-context plans the issue asks for: an 8B Llama at 128k tokens on 8 DGX
H100 nodes, and a 405B-class model at 128k on 2048 nodes, choose cp > 1, with the best plan
without cp (recomputation, deeper pipelines) among their alternatives and slower or over memory.
All figures are predictions (datasheet H100 and links), none measured.
"""
from __future__ import annotations

import dataclasses
import io
import math

import pytest

import mplan
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.mesh import GroupShape
from mplan.planner.context_pricing import AttentionOp, exchange
from mplan.planner.parallel_config import (MIN_CONTEXT_CHUNK, ModelLimits, PlanSpec, context_degrees, context_methods,
                                           enumerate_configs, parse_plan_spec)

LLAMA3_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=131072"
LLAMA3_405B = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=131072"
MiB = 1 << 20


def _op(kv_bytes: float, forward_s: float, backward_s: float, heads: int = 32, kv_heads: int = 8) -> AttentionOp:
    return AttentionOp(q_bytes=2 * kv_bytes, kv_bytes=kv_bytes, out_bytes=2 * kv_bytes, num_heads=heads,
                       num_kv_heads=kv_heads, forward_s=forward_s, backward_s=backward_s)


# --- one attention op's exchange ------------------------------------------------------------------

def test_the_ring_hides_each_hop_behind_its_blocks_attention_on_gpus_and_not_on_gloo() -> None:
    h100 = ClusterSpec.preset("dgx-h100", nodes=1)
    group = GroupShape(size=4, ranks_per_node=4)
    kv = 64 * MiB
    hop = collective_time(h100, "send_recv", kv, group)
    two = collective_time(h100, "send_recv", 2 * kv, group)
    # attention far longer than a hop: only the last dK, dV accumulator's way home is exposed
    slow = exchange("ring", 4, _op(kv, forward_s=100 * hop, backward_s=200 * hop), h100, group, overlaps=True)
    assert slow.forward_s == 0.0 and slow.backward_s == pytest.approx(hop)
    assert slow.link_forward_s == pytest.approx(3 * hop) and slow.link_backward_s == pytest.approx(2 * hop + 2 * two + hop)
    # attention shorter than a hop: each step pays what its block's attention does not cover
    a, g = 2 * hop, 4 * hop  # a / cp = hop / 2, g / cp = hop
    fast = exchange("ring", 4, _op(kv, forward_s=a, backward_s=g), h100, group, overlaps=True)
    assert fast.forward_s == pytest.approx(3 * (hop - a / 4))
    assert fast.backward_s == pytest.approx((hop - g / 4) + 2 * (two - g / 4) + max(0.0, hop - g / 4) + hop)
    # gloo's ranks share their cores: no overlap priced, every hop exposed
    serial = exchange("ring", 4, _op(kv, forward_s=100 * hop, backward_s=200 * hop), h100, group, overlaps=False)
    assert serial.forward_s == pytest.approx(3 * hop) and serial.saved_bytes == 0


def test_all_gather_holds_the_gathered_keys_and_all_to_all_repeats_gqa_kv_heads() -> None:
    h100 = ClusterSpec.preset("dgx-h100", nodes=1)
    group = GroupShape(size=8, ranks_per_node=8)
    kv = 64 * MiB
    gathered = exchange("all_gather", 8, _op(kv, 1.0, 2.0), h100, group, overlaps=True)
    assert gathered.saved_bytes == 7 * kv  # the other ranks' K, V, saved for backward
    assert gathered.forward_s == pytest.approx(collective_time(h100, "all_gather", 8 * kv, group))
    assert gathered.backward_s == pytest.approx(collective_time(h100, "reduce_scatter", 8 * kv, group))
    # 8 kv heads over cp=8: each rank one kv head, no copies; 2 kv heads (tp=4): each repeated 4 times
    split = exchange("all_to_all", 8, _op(kv, 1.0, 2.0, kv_heads=8), h100, group, overlaps=True)
    repeated = exchange("all_to_all", 8, _op(kv, 1.0, 2.0, kv_heads=2), h100, group, overlaps=True)
    assert split.saved_bytes == 0 and repeated.saved_bytes == 3 * kv
    assert repeated.forward_s > split.forward_s and split.forward_s == split.backward_s


# --- what the search tries ------------------------------------------------------------------------

def test_the_search_tries_cp_where_each_chunk_keeps_a_kernel_tile() -> None:
    """Degrees in detail, and MoE models: tests/test_cp_search.py."""
    limits = ModelLimits(num_layers=32, num_heads=32, num_kv_heads=8, num_experts=0, seq_len=131072)
    assert context_degrees(64, limits, PlanSpec()) == [1, 2, 4, 8, 16, 32, 64]
    assert 131072 // (2 * 64) >= MIN_CONTEXT_CHUNK
    assert context_degrees(64, dataclasses.replace(limits, seq_len=256), PlanSpec()) == [1]
    assert context_degrees(64, dataclasses.replace(limits, seq_len=256), parse_plan_spec("cp=4")) == [4]
    # all_to_all splits a tp rank's query heads: 32 heads at tp=8 leave 4, over cp=8 no
    assert context_methods(8, 4, limits, PlanSpec()) == ("all_gather", "ring", "all_to_all")
    assert context_methods(8, 8, limits, PlanSpec()) == ("all_gather", "ring")
    assert context_methods(1, 8, limits, parse_plan_spec("cp_method=ring")) == ("ring",)
    configs = list(enumerate_configs(world_size=64, gpus_per_node=8, global_batch=32, limits=limits,
                                     spec=parse_plan_spec("tp=8,pp=1,zero=1,recompute=none")))
    assert {(c.cp, c.dp) for c in configs} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(c.world_size == 64 for c in configs)


# --- the plans the issue asks for ------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_8b() -> mplan.Plan:
    return mplan.plan(LLAMA3_8B, cluster=ClusterSpec.preset("dgx-h100", nodes=8), global_batch=32, progress="quiet")


def test_an_8b_model_at_128k_tokens_on_64_h100s_chooses_cp(plan_8b: mplan.Plan) -> None:
    plan = plan_8b
    assert plan.model.seq_len == 131072 and plan.mesh.cp > 1
    assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp * plan.mesh.cp == 64
    assert plan.predicted.memory_gib <= 80
    # every method weighed at the plan's layout; the chosen one the fastest that fits
    figures = {k.split(".")[1]: None for k in plan.planner if k.startswith("context.")}
    assert plan.mesh.cp_method in figures and len(figures) >= 2
    chosen = plan.planner[f"context.{plan.mesh.cp_method}.step_time_s"]
    for method in figures:
        if plan.planner[f"context.{method}.fits"]:
            assert chosen <= plan.planner[f"context.{method}.step_time_s"] * (1 + 1e-9)
    # the best plan without cp is an alternative, and it lost on time
    without = [a for a in plan.alternatives if "cp=" not in a.spec]
    assert without and all(a.predicted is None or a.predicted.step_time_s > plan.predicted.step_time_s
                           for a in without)


def test_explain_shows_the_cp_variant_and_its_share_of_the_step(plan_8b: mplan.Plan) -> None:
    from rich.console import Console

    from mplan.planner.explain import explain_data, render

    context = explain_data(plan_8b)["context"]
    chosen = context[plan_8b.mesh.cp_method]
    assert chosen["chosen"] and list(context)[0] == plan_8b.mesh.cp_method
    assert 0 <= chosen["share_of_step"] < 1 and chosen["exposed_ms"] <= chosen["link_ms"] * 2 + 1e-9
    out = io.StringIO()
    render(plan_8b, Console(file=out, width=250))
    assert f"{plan_8b.mesh.cp_method} (chosen): exchange" in out.getvalue()


def test_without_cp_the_8b_at_128k_is_slower(plan_8b: mplan.Plan) -> None:
    """No cp: what recomputation and deeper pipelines make of it, priced on the same graph."""
    plan = mplan.plan(LLAMA3_8B, cluster=ClusterSpec.preset("dgx-h100", nodes=8), global_batch=32,
                      spec="cp=1", progress="quiet")
    assert plan.mesh.cp == 1 and plan.predicted.step_time_s > plan_8b.predicted.step_time_s
    assert plan.recompute != "none" or plan.mesh.pp > 1


def test_short_sequences_plan_as_before() -> None:
    """At 8192 tokens the search weighs cp too (chunks of 128 tokens or more), and the plan is the
    one without cp: a rank's slice is priced at its own rows (`context_pricing.whole_batch`)."""
    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    auto = mplan.plan("llama3-8b", cluster=cluster, global_batch=8, seq_len=8192, progress="quiet")
    held = mplan.plan("llama3-8b", cluster=cluster, global_batch=8, seq_len=8192, spec="cp=1", progress="quiet")
    assert auto.mesh.cp == 1 and auto.spec() == held.spec()
    assert auto.planner["candidates"] > held.planner["candidates"]


@pytest.mark.slow
def test_a_405b_model_at_128k_tokens_on_2048_nodes_chooses_cp() -> None:
    plan = mplan.plan(LLAMA3_405B, cluster=ClusterSpec.preset("dgx-h100", nodes=2048), global_batch=128,
                      progress="quiet")
    assert plan.mesh.cp > 1 and plan.predicted.memory_gib <= 80
    assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp * plan.mesh.cp == 16384
    without = [a for a in plan.alternatives if "cp=" not in a.spec]
    assert without and all(a.predicted is None or a.predicted.step_time_s > 2 * plan.predicted.step_time_s
                           for a in without)
    assert not math.isnan(plan.predicted.mfu)
