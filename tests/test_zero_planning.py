"""ZeRO-2 and ZeRO-3 in the planner (issue 33): the grammar and the Plan file, the memory each level
holds per rank, the collectives each adds to a step, the search's choice and what `explain` says.

The byte arithmetic is written out here (`cost_models/memory_model.py` states the accounting);
the time checks rebuild zero 2/3's collectives from `collective_time` on the plan's own units, so
a change to what a level gathers or scatters, or to their overlap, shows as a failure here.
"""
from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES, collective_time
from mplan.cost_models.memory_model import bytes_per_param, estimate_memory, mplan_bytes_per_param
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.planner.zero_pricing import (ZERO3_UNITS_IN_FLIGHT, ZERO_OVERLAP, ZERO_REDUCTIONS_IN_FLIGHT, ZeroOverlap,
                                        gathered_window, zero1_copy_time, zero23_copy_time)
from mplan.planner.evaluate import LOSS_BYTES
from mplan.planner.explain import explain_data, render
from mplan.planner.parallel_config import (EXECUTABLE_ZERO, ParallelConfig, PlanSpec, PlanSpecError,
                                           enumerate_configs, parse_plan_spec)
from mplan.planner.plan import Plan, PlanError
from mplan.planner.planning import capture_for_planning, plan
from mplan.planner.resolve import check_before_capture
from mplan.planner.search import Planner, PlanningError
from mplan.runtime.fully_sharded import UNITS_IN_FLIGHT

TINY = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
# a 32.8M-element embedding (above a 25 MiB bucket of bf16) and 24 blocks of 12.6M: deep enough that
# zero=3 saves more than its gathered units and gradient buckets hold
SMALL = "gpt:layers=24,hidden=1024,heads=16,seq=256,vocab=32000"
N = 1e9  # parameters of the byte-arithmetic rank


# --- grammar ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, zero, keep", [("zero=2", 2, None), ("zero=3", 3, None),
                                              ("zero=3,keep_weights=1", 3, 1), ("keep_weights=0", None, 0),
                                              ("zero=auto", None, None)])
def test_the_spec_grammar_reads_zero_0_to_3_and_keep_weights(text: str, zero: int | None, keep: int | None) -> None:
    spec = parse_plan_spec(text)
    assert (spec.zero, spec.keep_weights) == (zero, keep)
    assert parse_plan_spec(str(spec)) == spec


@pytest.mark.parametrize("text, words", [
    ("zero=4", "zero must be 0, 1, 2 or 3"), ("zero=-1", "zero must be 0, 1, 2 or 3"),
    ("zero=x", "zero must be 0, 1, 2 or 3"), ("zero=1,keep_weights=1", "keep_weights=1 keeps zero=3's"),
    ("zero=3,keep_weights=2", "keep_weights must be 0 or 1"),
])
def test_a_bad_zero_is_one_line_naming_the_key_and_range(text: str, words: str) -> None:
    with pytest.raises(PlanSpecError) as err:
        parse_plan_spec(text)
    message = str(err.value)
    assert words in message and text.split(",")[-1].split("=")[1] in message and "\n" not in message


@pytest.mark.parametrize("zero, keep", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_config_spec_asks_for_exactly_that_config(zero: int, keep: bool) -> None:
    config = ParallelConfig(dp=4, tp=2, pp=2, num_micro_batches=4, zero=zero, keep_weights=keep)
    assert parse_plan_spec(config.spec()).admits(config)
    assert not parse_plan_spec(config.spec()).admits(replace(config, zero=(zero + 1) % 4, keep_weights=False))
    assert ("keep_weights=1" in config.spec()) == keep and f"zero{zero}" in config.short() if zero else True


def test_the_search_tries_every_level_where_dp_shards_as_the_runtime_runs_it() -> None:
    """mplan's runtime keeps zero=3's weights through the step under a pipeline, so its pipeline
    configs keep them and its one-stage ones do not; for Megatron both are priced where zero=2 is
    not searched (zero=2 is the kept plan, no slower and never larger)."""
    limits = Planner(capture_for_planning(TINY), ClusterSpec.preset("dgx-h100", nodes=1)).limits

    def configs(**options: object) -> list[ParallelConfig]:
        return list(enumerate_configs(world_size=8, gpus_per_node=8, global_batch=16, limits=limits, spec=PlanSpec(),
                                      **options))
    mplan_configs = configs()
    assert {c.zero for c in mplan_configs if c.dp > 1} == {0, 1, 2, 3}
    assert {c.zero for c in mplan_configs if c.dp == 1} == {0}
    assert {(c.pp > 1, c.keep_weights) for c in mplan_configs if c.zero == 3} == {(False, False), (True, True)}
    megatron = configs(runtime="megatron")
    assert not any(c.keep_weights for c in megatron)
    without_two = configs(runtime="megatron", zero_levels=(0, 1, 3))
    assert {(c.pp > 1, c.keep_weights) for c in without_two if c.zero == 3} == {(False, False), (True, False),
                                                                                 (True, True)}
    assert {c.zero for c in configs(zero_levels=(0, 1))} == {0, 1}


def test_one_data_parallel_rank_gets_a_zero_level_only_when_the_spec_names_it() -> None:
    """dp=1 has nothing to shard over, so the search never tries zero > 0 there; a spec that asks
    (to measure zero=3's unit gathers on one GPU, say) gets exactly that level, priced."""
    chosen = plan(TINY, cluster=ClusterSpec.preset("dgx-h100", nodes=1, gpus_per_node=1), global_batch=4,
                  spec="dp=1,zero=3")
    assert (chosen.mesh.dp, chosen.zero) == (1, 3) and chosen.predicted.step_time_s > 0
    searched = plan(TINY, cluster=ClusterSpec.preset("dgx-h100", nodes=1, gpus_per_node=1), global_batch=4)
    assert searched.zero == 0


# --- the Plan file ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero3_plan() -> Plan:
    return plan(SMALL, cluster=ClusterSpec.preset("dgx-h100", nodes=1), global_batch=16, spec="dp=8,zero=3")


def test_a_zero3_plan_round_trips_through_json(zero3_plan: Plan) -> None:
    doc = json.loads(zero3_plan.to_json())
    assert doc["zero"] == 3 and doc["zero3_keep_weights"] is False and doc["predicted"]["zero_comm_s"] > 0
    assert Plan.from_dict(doc) == zero3_plan
    kept = dataclasses.replace(zero3_plan, zero3_keep_weights=True)
    assert Plan.from_dict(json.loads(kept.to_json())).spec().endswith(",keep_weights=1")
    old = {k: v for k, v in doc.items() if k not in ("zero3_keep_weights", "zero_levels")}
    del old["predicted"]["zero_comm_s"]
    assert Plan.from_dict(old).zero3_keep_weights is False  # plans written before the fields read back


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(zero=4), "zero"), (lambda d: d.update(zero=-1), "zero"), (lambda d: d.update(zero="3"), "zero"),
    (lambda d: d.update(zero=1, zero3_keep_weights=True), "zero3_keep_weights"),
    (lambda d: d.update(zero3_keep_weights=1), "zero3_keep_weights"),
])
def test_a_bad_zero_in_a_plan_file_names_the_field(zero3_plan: Plan, change, field: str) -> None:  # noqa: ANN001
    doc = json.loads(zero3_plan.to_json())
    change(doc)
    with pytest.raises(PlanError, match=field):
        Plan.from_dict(doc)


def test_mplan_plan_takes_spec_zero3_and_refuses_zero4_in_one_line() -> None:
    run = [sys.executable, "-m", "mplan", "plan", TINY, "--cluster", "dgx-h100", "--nodes", "1",
           "--global-batch", "16", "--json"]
    made = subprocess.run(run + ["--spec", "dp=8,zero=3"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["zero"] == 3
    refused = subprocess.run(run + ["--spec", "zero=4"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.strip().count("\n") == 0 and "zero must be 0, 1, 2 or 3" in refused.stderr


def test_a_pipeline_plan_keeps_zero3s_weights_as_mplans_runtime_does() -> None:
    made = plan(SMALL, cluster=ClusterSpec.preset("dgx-h100", nodes=1), global_batch=16, spec="dp=4,pp=2,zero=3")
    assert made.zero3_keep_weights and made.spec().endswith(",keep_weights=1")
    assert check_before_capture("dp=2,pp=2,zero=3", world_size=4, global_batch=8) == "dp=2,pp=2,zero=3"
    with pytest.raises(PlanSpecError, match=r"keeps zero=3's gathered weights through the step under a pipeline"):
        check_before_capture("dp=2,pp=2,zero=3,keep_weights=0", world_size=4, global_batch=8)


def test_autoparallel_refuses_a_zero_level_the_runtime_does_not_run(zero3_plan: Plan,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the capture, in one line; `EXECUTABLE_ZERO` says which levels mplan's runtime runs
    (all four since issue 33's runtime; held to 0 and 1 here to show the refusal)."""
    assert EXECUTABLE_ZERO["mplan"] == (0, 1, 2, 3)
    assert check_before_capture("dp=4,zero=3", world_size=4, global_batch=8) == "dp=4,zero=3"
    monkeypatch.setitem(EXECUTABLE_ZERO, "mplan", (0, 1))
    with pytest.raises(PlanSpecError, match=r"zero=3 is planned and priced, but mplan's runtime runs zero 0 or 1"):
        check_before_capture("dp=4,zero=3", world_size=4, global_batch=8)
    with pytest.raises(PlanError, match="zero=3 is planned and priced"):
        check_before_capture(zero3_plan, world_size=8, global_batch=16)
    assert check_before_capture("dp=4,zero=1", world_size=4, global_batch=8) == "dp=4,zero=1"


# --- memory -------------------------------------------------------------------------------------

def _rank(per, zero: int, **extra: float):  # noqa: ANN001, ANN202
    return estimate_memory(num_params=N, per_param=per, zero=zero, dp=8, activation_bytes=0.0, num_in_flight=0,
                           fragmentation=0.0, **extra)


def test_bytes_per_rank_at_each_level_under_mplans_runtime() -> None:
    """bf16, dp=8, 0.1 N bytes of gradients whole at once (zero 2/3), two units gathered (0.1 N)."""
    got = {z: _rank(mplan_bytes_per_param("bf16", zero=z), z, grad_transient_bytes=0.1 * N if z >= 2 else 0.0,
                    gathered_params=0.1 * N if z == 3 else 0.0) for z in (0, 1, 2, 3)}
    parts = {z: (m.params_bytes, m.grads_bytes, m.optimizer_bytes) for z, m in got.items()}
    assert parts[0] == pytest.approx((2 * N, 2 * N, 4 * N))  # bf16 stepped in place, bf16 moments
    assert parts[1] == pytest.approx((2 * N, 2 * N, 16 * N / 8))  # fp32 master, its gradient, moments
    assert parts[2] == pytest.approx((2 * N, 4 * N / 8 + 0.1 * N, 12 * N / 8))  # fp32 gradient shard
    # a bf16 shard for the gathers beside the fp32 master, two units gathered in bf16
    assert parts[3] == pytest.approx((2 * N / 8 + 2 * 0.1 * N, 4 * N / 8 + 0.1 * N, 12 * N / 8))
    totals = [got[z].total_bytes for z in (3, 2, 1, 0)]
    assert totals == sorted(totals) and len(set(totals)) == 4  # zero=3 < zero=2 < zero=1 < zero=0
    assert [t / N for t in totals] == pytest.approx([2.55, 4.1, 6.0, 8.0])
    kept = _rank(mplan_bytes_per_param("bf16", zero=3), 3, keep_weights=True, grad_transient_bytes=0.1 * N)
    assert kept.params_bytes == pytest.approx(2 * N / 8 + 2 * N)  # the whole stage gathered through the step
    assert kept.total_bytes > got[2].total_bytes  # zero=2's memory and the shard: zero=2 is that plan


def test_bytes_per_rank_at_each_level_under_megatrons_runtime() -> None:
    """Megatron-FSDP: a bf16 model-weight shard beside the fp32 main weights and main gradients."""
    per = bytes_per_param("bf16", "fp32")
    got = {z: _rank(per, z, grad_transient_bytes=0.2 * N if z >= 2 else 0.0,
                    gathered_params=0.1 * N if z == 3 else 0.0) for z in (0, 1, 2, 3)}
    assert [got[z].total_bytes / N for z in (0, 1, 2, 3)] == pytest.approx(
        [18, 6 + 12 / 8, 2 + 16 / 8 + 0.2, 18 / 8 + 2 * 0.1 + 0.2])
    assert per.total(zero=2, dp=8) == pytest.approx(2 + 16 / 8) and per.total(zero=3, dp=8) == pytest.approx(18 / 8)


def test_fp32_parameters_gather_the_master_itself() -> None:
    per = mplan_bytes_per_param("fp32", zero=3)
    assert per.total(zero=3, dp=4) == pytest.approx(16 / 4)
    assert mplan_bytes_per_param("fp32", zero=2).total(zero=2, dp=4) == pytest.approx(4 + 16 / 4)


@pytest.fixture(scope="module")
def small_planner() -> Planner:
    return Planner(capture_for_planning(SMALL), ClusterSpec.preset("dgx-h100", nodes=1))


def _config(zero: int, *, pp: int = 1, keep: bool = False) -> ParallelConfig:
    return ParallelConfig(dp=8 // pp, tp=1, pp=pp, mbs=1, num_micro_batches=4, zero=zero, keep_weights=keep)


def test_the_parameters_dtype_sets_the_bytes_a_parameter_takes() -> None:
    """The planner reads the parameters' dtype off the capture (it priced bf16 whatever the model
    trained in): a float32 model holds 4-byte parameters, float64 (as the CPU equivalence runs
    train) 8."""
    import torch

    from mplan.planner.planning import capture_spec

    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    config = ParallelConfig(dp=8, tp=1, pp=1, mbs=1, num_micro_batches=1, zero=1)
    held = {}
    for dtype, name, size in ((torch.bfloat16, "bf16", 2), (torch.float32, "fp32", 4), (torch.float64, "fp64", 8)):
        planner = Planner(capture_spec(TINY, batch=2, shallow=True, dtype=dtype, dynamic_batch=True), cluster)
        assert planner.facts.param_dtype == name
        memory = planner.evaluate(config, fast=True).memory[0]
        held[name] = memory.params_bytes
        assert memory.params_bytes > 0
    assert held["fp32"] == pytest.approx(2 * held["bf16"]) and held["fp64"] == pytest.approx(4 * held["bf16"])


def test_the_planner_holds_less_per_rank_at_each_level(small_planner: Planner) -> None:
    """A small GPT on one DGX, dp=8: the rank's parameters n read off zero=0, then each level's
    bytes from n and the units. Gradients: zero 0/1 keep them whole through the step, zero 2/3 a
    shard; besides, the reductions hold at their worst moment (`gradient_reductions`, walked as the
    runtime issues them) between a bucket's bf16 gradients before they are flattened and a bucket
    plus three flat fp32 copies in flight; zero=2's bucket is the 32.8M-element embedding (above
    25 MiB of bf16), zero=3's the largest unit. zero=3 gathers the two largest consecutive units,
    as the runtime's prefetch holds them."""
    memory = {z: small_planner.evaluate(_config(z), fast=True).memory[0] for z in (0, 1, 2, 3)}
    n = memory[0].params_bytes / 2
    units = small_planner.units(1, False, 1)
    sizes = [u.num_params for u in units]
    largest_param = max(u.largest_param for u in units)
    assert largest_param > DEFAULT_BUCKET_BYTES / 2 and ZERO_REDUCTIONS_IN_FLIGHT == 3
    assert (memory[0].grads_bytes, memory[0].optimizer_bytes) == pytest.approx((2 * n, 4 * n))
    assert memory[1].optimizer_bytes == pytest.approx(16 * n / 8)
    assert 0 < memory[1].grads_bytes - 2 * n <= ZERO_REDUCTIONS_IN_FLIGHT * largest_param * 4
    assert (memory[2].params_bytes, memory[2].optimizer_bytes) == pytest.approx((2 * n, 12 * n / 8))
    assert largest_param * 2 <= memory[2].grads_bytes - 4 * n / 8 <= largest_param * (2 + 3 * 4)
    assert ZERO3_UNITS_IN_FLIGHT == UNITS_IN_FLIGHT == 2
    gathered = max(a + b for a, b in zip(sizes, sizes[1:]))
    assert gathered_window(sizes) == gathered
    assert (memory[3].params_bytes, memory[3].optimizer_bytes) == pytest.approx((2 * n / 8 + 2 * gathered, 12 * n / 8))
    assert max(sizes) * 2 <= memory[3].grads_bytes - 4 * n / 8 <= max(sizes) * (2 + 3 * 4)
    totals = [memory[z].total_bytes for z in (3, 2, 1, 0)]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_a_tied_embedding_stays_gathered_beside_the_prefetched_units() -> None:
    """A tied embedding and head is one unit the runtime keeps whole from the prologue to the
    epilogue (tests/test_zero23.py: three units whole at most), so zero=3's memory counts it once
    beside the two largest consecutive units of the rest, which a window over the units alone
    would undercount by a block."""
    planner = Planner(capture_for_planning(TINY + ",tie=1"), ClusterSpec.preset("dgx-h100", nodes=1))
    memory = {z: planner.evaluate(_config(z), fast=True).memory[0] for z in (0, 3)}
    n = memory[0].params_bytes / 2
    units = planner.units(1, False, 1)
    glue = [dict(u.glue_params) for u in units]
    (name,) = glue[0].keys() & glue[-1].keys()  # the embedding, read again as the head
    apart = [u.num_params - g.get(name, 0) for u, g in zip(units, glue)]
    gathered = glue[0][name] + max(a + b for a, b in zip(apart, apart[1:]))
    assert gathered > gathered_window([u.num_params for u in units])
    assert memory[3].params_bytes == pytest.approx(2 * n / 8 + 2 * gathered)


# --- time ---------------------------------------------------------------------------------------

def test_zero2_and_zero3_add_their_collectives_as_the_runtime_overlaps_them(small_planner: Planner) -> None:
    """zero=2: a reduce-scatter of each unit's bf16 gradients in every micro-batch's backward,
    asynchronous in mplan's runtime (what outlasts the unit's backward shows, and the step waits for
    the last one); zero=3: an all-gather of its weights before its forward and its backward
    besides, prefetched one unit ahead: unit u's forward runs beside u+1's gather, its backward
    beside u-1's (and its own reduce-scatter), what outlasts the compute shows, and the first unit
    of each pass (forward: the first, backward: the last) waits for its own gather."""
    assert ZERO_OVERLAP["mplan"] == ZeroOverlap(gathers=True, reduce_scatters=True)
    cluster = small_planner.cluster
    group = _config(2).mesh.group_shape("dp", cluster.gpus_per_node)
    units = small_planner.units(1, False, 1)
    scatter = [collective_time(cluster, "reduce_scatter", 2 * u.num_params, group) for u in units]
    gather = [collective_time(cluster, "all_gather", 2 * u.num_params, group) for u in units]
    shows = sum(max(0.0, r - u.backward_s) for r, u in zip(scatter, units))
    forward = sum(max(0.0, g - u.forward_s) for g, u in zip(gather[1:], units)) + gather[0]
    backward = sum(max(u.backward_s, g + r) - u.backward_s
                   for g, r, u in zip([0.0] + gather[:-1], scatter, units)) + gather[-1]
    e = {z: small_planner.evaluate(_config(z), fast=True) for z in (1, 2, 3)}
    assert e[1].zero_comm_s == 0.0
    assert e[2].zero_comm_s == pytest.approx(4 * shows)
    assert e[3].zero_comm_s == pytest.approx(4 * (forward + backward))
    # the first gather of each pass always shows; the prefetch hides most of the others here (the
    # step's zero=3 traffic at 35% of what the same gathers cost unoverlapped)
    unoverlapped = 4 * (shows + 2 * sum(gather))
    assert 4 * (shows + gather[0] + gather[-1]) < e[3].zero_comm_s < 0.5 * unoverlapped
    # zero=2 no faster than zero=1; zero=3's gathers can hide where the host paces the device (this
    # small model), against zero=2's gather after the step that zero=3 saves
    assert e[1].step_time_s < e[2].step_time_s
    # zero 1 and 2 gather the updated parameters after the step, zero=3 never gathers them whole
    whole = collective_time(cluster, "all_gather", e[2].memory[0].params_bytes, group)  # the rank's bf16 weights
    loss = collective_time(cluster, "all_reduce", LOSS_BYTES, group)  # the loss averaged over dp after the step
    assert e[2].grad_sync_s[0] == pytest.approx(whole + max(scatter) + loss)
    assert e[3].grad_sync_s[0] == pytest.approx(max(scatter) + loss)


def test_zero2_and_zero3_copy_their_gradients_in_every_micro_batch(small_planner: Planner) -> None:
    """mplan's runtime reduces zero 2/3's gradients in every micro-batch's backward (flattened into
    fp32, added into the master shard's gradient: bf16 10 bytes a parameter, 12 more a shard
    element), zero=1 once a step (as one reduction, plus the step's narrowing and copy into the
    parameters). At dp=1 zero=3 gathers nothing (its parameters are the shard: fully_sharded.py),
    so what sets it above zero=1 is those copies, 3 more reductions at 4 micro-batches. Measured
    on an H200 for a 1.26B Llama before zero=3 stopped copying its units at dp=1: zero=3 483 ms,
    zero=1 403 (benchmarks/results/train_gpu-2026-12-06.json), both priced 314 then."""
    compute = ComputeCostModel(small_planner.cluster)
    assert zero23_copy_time(compute, N, 1, 2, zero=3, reductions=4) == compute.memory_bound_time(N * (4 * 10 + 4 * 12 + 6))
    # one reduction: zero=1's copies, but added into the gradient (read 4 more) where zero=1 copies
    assert zero1_copy_time(compute, N, 1, 2) == compute.memory_bound_time(N * 28)
    assert zero23_copy_time(compute, N, 1, 2, zero=2, reductions=1) == compute.memory_bound_time(N * 32)
    # fp32 parameters: zero=3's compute shard is the master, nothing to narrow
    assert zero23_copy_time(compute, N, 4, 4, zero=3, reductions=2) == compute.memory_bound_time(
        N * 2 * (8 + 4 + 8) + N / 4 * 2 * 12)
    one_rank = {z: small_planner.evaluate(ParallelConfig(dp=1, tp=1, pp=1, mbs=1, num_micro_batches=4, zero=z),
                                          fast=True) for z in (1, 3)}
    params = one_rank[1].memory[0].params_bytes / 2
    assert one_rank[3].zero_comm_s == 0.0
    assert one_rank[3].optimizer_s - one_rank[1].optimizer_s == pytest.approx(
        zero23_copy_time(compute, params, 1, 2, zero=3, reductions=4) - zero1_copy_time(compute, params, 1, 2))
    assert one_rank[3].step_time_s > one_rank[1].step_time_s


def test_keeping_zero3s_weights_prices_one_gather_a_step(small_planner: Planner) -> None:
    """Under a pipeline mplan's runtime keeps them: the per-unit gathers go, each unit is gathered
    once a step on the pipeline's way down (serial), and the stage's weights are held whole:
    zero=2's reduce-scatters and more memory than zero=2."""
    e2, kept = (small_planner.evaluate(_config(z, pp=2, keep=k), fast=True) for z, k in ((2, False), (3, True)))
    gathers = sum(collective_time(small_planner.cluster, "all_gather", 2 * u.num_params,
                                  _config(3, pp=2).mesh.group_shape("dp", 8)) for u in small_planner.units(1, False, 1))
    assert kept.zero_comm_s == pytest.approx(e2.zero_comm_s + gathers)
    assert kept.peak_memory_bytes > e2.peak_memory_bytes


# --- the search and explain ---------------------------------------------------------------------

def test_the_search_keeps_to_the_levels_it_is_given() -> None:
    """llama3-405b on 2048 DGX H100s at 8k with one pipeline stage fits only at zero=3; held to
    the levels mplan's runtime runs, the same search finds nothing."""
    planner = Planner(capture_for_planning("llama3-405b", seq_len=8192), ClusterSpec.preset("dgx-h100", nodes=2048),
                      kernels=True)
    assert planner.search(2048, parse_plan_spec("pp=1")).best.config.zero == 3
    if 3 not in EXECUTABLE_ZERO["mplan"]:
        with pytest.raises(PlanningError, match="does not fit"):
            planner.search(2048, parse_plan_spec("pp=1"), zero_levels=EXECUTABLE_ZERO["mplan"])


def test_405b_at_8k_on_2048_nodes_with_one_stage_fits_only_with_zero3_and_says_so() -> None:
    made = plan("llama3-405b", cluster=ClusterSpec.preset("dgx-h100", nodes=2048), global_batch=2048, seq_len=8192,
                spec="pp=1")
    assert made.zero == 3 and made.mesh.pp == 1 and made.predicted.memory_gib < 80
    levels = {(z.zero, z.keep_weights): z for z in made.zero_levels}
    assert set(levels) == {(0, False), (1, False), (2, False), (3, False)}
    assert levels[(3, False)].nothing_fits_below and all(not levels[(z, False)].fits for z in (0, 1, 2))
    summary = explain_data(made)["zero"]["summary"]
    assert summary.startswith("zero=3 chosen: the plan fits only with zero>=3")
    assert "zero=2 needs" in summary and "forward and backward, overlapped with compute" in summary  # prefetched
    out = io.StringIO()
    from rich.console import Console
    render(made, Console(file=out, width=400))
    assert "ZeRO: zero=3 chosen: the plan fits only with zero>=3" in out.getvalue()


def test_llama3_70b_on_two_nodes_with_one_stage_says_why_zero3_does_not_win() -> None:
    """Issue 33's first planning case. Priced for mplan's runtime, zero=0 steps bf16 parameters in
    place with bf16 moments (8 bytes a parameter, 16.4 GiB of weights a GPU at tp=8), as lean as
    zero=3's 18 bytes over dp=2: the search keeps zero=0 and explain gives each level's memory in
    the plan's layout (zero=3 above the device by its gathered units and gradient shard)."""
    made = plan("llama3-70b", cluster=ClusterSpec.preset("dgx-h100", nodes=2), global_batch=256, spec="pp=1")
    assert made.mesh.pp == 1 and made.predicted.memory_gib < 80
    levels = {z.zero: z for z in made.zero_levels}
    assert set(levels) == {0, 1, 2, 3} and levels[made.zero].fits
    summary = explain_data(made)["zero"]["summary"]
    assert f"zero={made.zero} chosen" in summary
    for zero in {0, 1, 2, 3} - {made.zero}:
        assert f"zero={zero} " in summary


@pytest.mark.slow
def test_405b_at_8k_on_2048_nodes_weighs_every_level() -> None:
    """The whole search: every level priced beside the plan, zero 2 and 3 with what their extra
    traffic costs (not overlapped, they lose to the pipeline of zero <= 1 here)."""
    made = plan("llama3-405b", cluster=ClusterSpec.preset("dgx-h100", nodes=2048), global_batch=2048, seq_len=8192)
    levels = {z.zero: z for z in made.zero_levels}
    assert set(levels) == {0, 1, 2, 3}
    for zero in (2, 3):
        if zero != made.zero and levels[zero].fits:
            assert levels[zero].step_time_s > made.predicted.step_time_s
            # under a pipeline zero=2 reduces at the step, as zero=1 does (the test below)
            assert levels[zero].zero_comm_s > 0 or (zero == 2 and made.mesh.pp > 1)
    assert "all-gathers/reduce-scatters" in explain_data(made)["zero"]["summary"] or made.zero >= 2


def test_under_a_pipeline_zero2_reduces_at_the_step_as_zero1_does(small_planner: Planner) -> None:
    """mplan's pipeline executor adds each stage's gradients into `.grad` itself, so zero 2/3's
    backward hooks never fire and every bucket is reduced at the step (`grads_whole_until_step`):
    no reduce-scatter in backward, the step's sync that of zero=1, and zero=2 no faster than zero=1
    (it was priced faster, its per-micro-batch scatters hidden behind backward, and the search chose
    it for llama3-405b where it gains nothing). Without a pipeline zero=2 still scatters in backward."""
    e = {z: small_planner.evaluate(_config(z, pp=2), fast=True) for z in (1, 2)}
    assert e[2].zero_comm_s == 0.0
    assert e[2].grad_sync_s == pytest.approx(e[1].grad_sync_s)
    assert e[2].step_time_s >= e[1].step_time_s
    flat = small_planner.evaluate(_config(2), fast=True)
    assert flat.zero_comm_s > 0.0
