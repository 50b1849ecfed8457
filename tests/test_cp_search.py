"""Which cp degrees the search tries, and how it prices one cp rank's share (issue 34).

The search tries every cp that divides the world and leaves each head-tail chunk
`MIN_CONTEXT_CHUNK` tokens or more, and lets the pricing decide; no token floor per rank. For the
pricing to decide right at short slices, a cp rank is priced at its own rows: where cp divides
the micro-batch, from the units of mbs / cp whole sequences (the same GEMM rows, attention pairs
and K/V bytes), and each linear's GEMMs re-priced at the rank's rows where it holds less than a
sequence. All figures are predictions (datasheet H100s), none measured.
"""
from __future__ import annotations

import dataclasses

import pytest

import mplan
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.context_pricing import replica_config, replica_facts, whole_batch
from mplan.planner.evaluate import state_floor_bytes
from mplan.planner.parallel_config import (MIN_CONTEXT_CHUNK, ModelLimits, ParallelConfig, PlanSpec,
                                           context_degrees, enumerate_configs, parse_plan_spec)
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner, SearchResult

WIDE_4_LAYERS = "llama:layers=4,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=32768"
"""An 8B-wide Llama of 4 layers (hidden 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256)."""


def test_every_cp_dividing_the_world_is_tried_down_to_two_chunks_of_128_tokens() -> None:
    limits = ModelLimits(num_layers=32, num_heads=32, num_kv_heads=8, num_experts=0, seq_len=131072)
    assert MIN_CONTEXT_CHUNK == 128
    assert context_degrees(64, limits, PlanSpec()) == [1, 2, 4, 8, 16, 32, 64]
    # 8192 tokens: cp=32 leaves 2 chunks of 128, cp=64 chunks of 64
    assert context_degrees(64, dataclasses.replace(limits, seq_len=8192), PlanSpec()) == [1, 2, 4, 8, 16, 32]
    assert context_degrees(8, dataclasses.replace(limits, seq_len=32768), PlanSpec()) == [1, 2, 4, 8]
    # not only powers of two: 24 ranks at 12288 tokens (cp=24 would leave chunks of 256 too)
    assert context_degrees(24, dataclasses.replace(limits, seq_len=12288), PlanSpec()) == [1, 2, 3, 4, 6, 8, 12, 24]
    # a sequence that does not split into 2 cp chunks: 1000 tokens make no 2 chunks of 128 at cp=4
    assert context_degrees(8, dataclasses.replace(limits, seq_len=1000), PlanSpec()) == [1, 2]
    assert context_degrees(8, dataclasses.replace(limits, seq_len=256), parse_plan_spec("cp=8")) == [8]


def test_a_rank_of_cp_sequences_is_priced_as_one_whole_sequence_plus_its_exchange() -> None:
    """cp=8 at 8 sequences a micro-batch: each rank's GEMMs have one sequence's rows, so its units
    are the units at one sequence with the exchange added, not 1/8 of 8 sequences' (whose GEMMs
    run more efficiently than the rank's; that priced cp=8 3.8% below plain data parallelism)."""
    graph = capture_for_planning(WIDE_4_LAYERS.replace("seq=32768", "seq=8192"), seq_len=8192)
    planner = Planner(graph, ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    one = planner.units(1, False, 1)
    assert whole_batch(8, 8) == 1 and whole_batch(8, 2) == 4 and whole_batch(8, 3) == 2 and whole_batch(1, 8) == 1
    config = ParallelConfig(dp=1, tp=1, pp=1, cp=8, cp_method="all_gather", mbs=8)
    ranked, exchanges = planner.context_units(config)
    for unit, whole, held in zip(ranked, one, exchanges):
        exchanged = sum(e.forward_s for e in held)
        assert unit.forward_s == pytest.approx(whole.forward_s + exchanged, rel=1e-12)
    # a rank holding 1/8 of one sequence: its linears at 1024 rows cost more than 1/8 of them at 8192
    slice_units, _ = planner.context_units(dataclasses.replace(config, mbs=1, cp_method="ring"))
    blocks = [(u, w) for u, w in zip(slice_units, one) if u.block_type]
    assert blocks and all(u.backward_s > w.backward_s / 8 * 1.05 for u, w in blocks)


def test_the_wide_4_layer_model_at_32k_on_8_h100s_picks_its_cheapest_priced_cp() -> None:
    """Found with the 8192-token floor: this case planned tp2 x cp4 though cp=8 was never tried
    (32768 / 8 = 4096 tokens a rank). Every cp is tried now, and the plan is the cheapest of the
    best plan at each cp degree."""
    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    graph = capture_for_planning(WIDE_4_LAYERS, seq_len=32768)
    planner = Planner(graph, cluster, kernels=True)
    best = planner.search(1).best
    per_cp = {cp: planner.search(1, PlanSpec(cp=cp)).best.step_time_s for cp in (1, 2, 4, 8)}
    assert best.step_time_s == pytest.approx(min(per_cp.values()), rel=1e-9), (best.config.short(), per_cp)
    assert best.config.cp == min(per_cp, key=per_cp.__getitem__) > 1
    assert per_cp[8] < per_cp[1]  # cp=8 is priced, and beats no cp at one sequence a step


def test_llama3_8b_at_8192_tokens_on_64_h100s_keeps_data_parallelism() -> None:
    """At 8192 tokens the search now weighs cp up to 32 (chunks of 128), and plain data
    parallelism still wins: a cp rank of cp sequences is priced at its own rows."""
    plan = mplan.plan("llama3-8b", cluster=ClusterSpec.preset("dgx-h100", nodes=8), global_batch=512,
                      seq_len=8192, progress="quiet")
    assert plan.mesh.cp == 1, plan.spec()
    held = mplan.plan("llama3-8b", cluster=ClusterSpec.preset("dgx-h100", nodes=8), global_batch=512,
                      seq_len=8192, spec="cp=8,tp=1,pp=1", progress="quiet")
    assert held.predicted.step_time_s > plan.predicted.step_time_s


def test_moe_models_pair_cp_with_every_ep_dividing_dp_x_cp() -> None:
    """ep groups are carved from the dp x cp replicas (ep divides dp x cp, not only dp): at 8 ranks
    every cp pairs with ep 1, 2, 4 and 8 (8 experts), cp=8 at dp=1 too; a loss cp cannot make exact
    keeps cp=1."""
    limits = ModelLimits(num_layers=4, num_heads=16, num_kv_heads=8, num_experts=8, seq_len=131072)
    assert context_degrees(8, limits, PlanSpec()) == [1, 2, 4, 8]
    # a reduction over the tokens beside the cross-entropy that split_context cannot make exact
    assert context_degrees(8, dataclasses.replace(limits, splits_loss=False), PlanSpec()) == [1]
    configs = list(enumerate_configs(world_size=8, gpus_per_node=8, global_batch=8, limits=limits,
                                     spec=parse_plan_spec("tp=1,pp=1,zero=0,recompute=none,mbs=1")))
    assert {(c.cp, c.ep) for c in configs if c.cp > 1} == {(cp, ep) for cp in (2, 4, 8) for ep in (1, 2, 4, 8)}
    assert {c.ep for c in configs if c.cp == 1} == {1, 2, 4, 8}


WIDE_405B_8_LAYERS = "llama:layers=8,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=8192"
"""A 405B-wide Llama of 8 layers: on 16 H100s its replicas' state alone exceeds the device at
many cp layouts, which the search skips unpriced (`Planner._never_fits`)."""


def test_the_state_floor_is_at_most_every_priced_ranks_state_and_exact_in_one_stage() -> None:
    """`state_floor_bytes`, by which the search skips a cp config that cannot fit, is never above
    the parameters, gradients and optimizer state `evaluate` puts on the fullest pipeline rank, at
    any ZeRO level, pipeline depth, interleaving and cp method; in one stage at zero=0 (no reductions'
    copies counted among the gradients) it is that state."""
    graph = capture_for_planning(WIDE_405B_8_LAYERS, seq_len=8192)
    planner = Planner(graph, ClusterSpec.preset("dgx-h100", nodes=2), kernels=True, runtime="mplan")
    configs = list(enumerate_configs(world_size=16, gpus_per_node=8, global_batch=16, limits=planner.limits,
                                     spec=PlanSpec(), max_mbs=2, runtime="mplan"))
    exact = 0
    for config in configs[::7]:
        estimate = planner.evaluate(config, fast=True)
        if config.cp > 1:
            floor = state_floor_bytes(replica_config(config), planner.context_units(config)[0],
                                      replica_facts(planner.facts, config.cp))
        else:
            floor = state_floor_bytes(config, planner.units(config.tp, config.sp, config.mbs), planner.facts)
        state = max(m.params_bytes + m.grads_bytes + m.optimizer_bytes for m in estimate.memory)
        assert floor <= state * (1 + 1e-12), config.short()
        if config.pp == 1 and config.zero == 0:
            assert floor == pytest.approx(state, rel=1e-9), config.short()
            exact += 1
    assert exact >= 3 and any(c.cp > 1 for c in configs[::7])


def test_skipping_cp_configs_that_cannot_fit_changes_nothing_the_search_returns(monkeypatch) -> None:
    """The search skips a config (at zero 0, 2 or 3) whose state floor exceeds the device and the
    peak of every leanest rejected plan so far (at cp = 1 also 1.25x the device, where it stands
    in for its cp twins' state): what fits, the ranking, the rejected plans and the ZeRO levels
    beside the best are those of the search that prices it."""
    graph = capture_for_planning(WIDE_405B_8_LAYERS, seq_len=8192)
    cluster = ClusterSpec.preset("dgx-h100", nodes=2)
    skipped = []
    never_fits = Planner._never_fits

    def counted(self: Planner, config: ParallelConfig, limit: float, held: object) -> bool:
        skipped.append((config.cp, never_fits(self, config, limit, held)))
        return skipped[-1][1]
    monkeypatch.setattr(Planner, "_never_fits", counted)
    fast = Planner(graph, cluster, kernels=True, runtime="mplan").search(16)
    monkeypatch.setattr(Planner, "_never_fits", lambda self, config, limit, held: False)
    full = Planner(graph, cluster, kernels=True, runtime="mplan").search(16)
    assert sum(cp > 1 and out for cp, out in skipped) >= 20 and sum(cp == 1 and out for cp, out in skipped) >= 10

    def seen(result: SearchResult) -> tuple[object, ...]:
        return ([(e.config, e.step_time_s, e.peak_memory_bytes) for e in result.ranked],
                [(e.config, e.peak_memory_bytes, e.reason) for e in result.rejected],
                {k: (v.same_layout.step_time_s, v.best_fitting and v.best_fitting.config, v.nothing_fits_below)
                 for k, v in result.zero_levels.items()})
    assert fast.best.config == full.best.config and fast.best.step_time_s == full.best.step_time_s
    assert seen(fast) == seen(full)


def test_a_spec_fixing_dp_tp_and_pp_leaves_the_rest_of_the_world_to_cp() -> None:
    """dp=1,tp=1,pp=1 on 8 GPUs is a cp=8 plan, not a spec that misses 7 GPUs: the spec check reads
    dp x cp x tp x pp against the world, a cp left out taking what the others leave; all four fixed
    must multiply to the world, and their product must divide it."""
    from mplan.planner.spec_check import spec_refusal

    def refusal(spec: str) -> str | None:
        return spec_refusal(parse_plan_spec(spec), world_size=8, gpus_per_node=8, global_batch=8)
    assert refusal("dp=1,tp=1,pp=1") is None
    assert refusal("dp=1,cp=4,tp=1,pp=1") == ("plan spec 'dp=1,tp=1,pp=1,cp=4': dp x cp x tp x pp = 1 x 4 x 1 x 1 = 4 "
                                              "ranks, but the cluster has 8 GPUs (dp x cp x tp x pp must equal 8)")
    assert "dp x cp x tp = 1 x 3 x 2 = 6 does not divide the cluster's 8 GPUs" in refusal("dp=1,cp=3,tp=2")
    graph = capture_for_planning(WIDE_4_LAYERS, seq_len=32768)
    best = Planner(graph, ClusterSpec.preset("dgx-h100", nodes=1), kernels=True).search(
        1, parse_plan_spec("dp=1,tp=1,pp=1")).best
    assert (best.config.dp, best.config.cp, best.config.tp, best.config.pp) == (1, 8, 1, 1) and best.fits
