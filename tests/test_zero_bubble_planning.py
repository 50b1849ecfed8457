"""ZB-H1 in the planner: weight-gradient prices, the closed form, the search space, the Plan file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.simulator import PipelineCosts, simulate
from mplan.ir.graph import Graph
from mplan.ir.schedule import build_schedule
from mplan.planner.evaluate import _closed_form
from mplan.planner.explain import simulate_plan
from mplan.planner.gantt import draw_gantt
from mplan.planner.parallel_config import ModelLimits, ParallelConfig, enumerate_configs, parse_plan_spec
from mplan.planner.plan import Plan, PlanError
from mplan.planner.plan_builder import build_plan
from mplan.planner.planning import capture_for_planning, search_plans
from mplan.planner.search import Planner

CLUSTER = ClusterSpec.preset("dgx-a100", nodes=1)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return capture_for_planning("gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=32000")


@pytest.fixture(scope="module")
def planner(graph: Graph) -> Planner:
    return Planner(graph, CLUSTER)


@pytest.fixture(scope="module")
def wide_planner() -> Planner:
    """Blocks whose weight-gradient GEMMs outlast the host's work of issuing a split W pass."""
    return Planner(capture_for_planning("gpt:layers=4,hidden=6144,heads=48,seq=2048,vocab=32000"), CLUSTER)


def test_the_search_offers_zb_h1_wherever_there_is_a_pipeline() -> None:
    limits = ModelLimits(num_layers=8, num_heads=16, num_kv_heads=16, num_experts=0, seq_len=1024)
    configs = list(enumerate_configs(world_size=8, gpus_per_node=8, global_batch=32, limits=limits,
                                     spec=parse_plan_spec("auto")))
    zero_bubble = [c for c in configs if c.schedule == "zb-h1"]
    assert {c.pp for c in zero_bubble} == {c.pp for c in configs} - {1} == {2, 4, 8}
    assert {c.vpp for c in zero_bubble} == {1}
    asked = enumerate_configs(world_size=8, gpus_per_node=8, global_batch=32, limits=limits,
                              spec=parse_plan_spec("pp=4,schedule=zb-h1"))
    assert {(c.pp, c.schedule) for c in asked} == {(4, "zb-h1")}


def test_units_price_the_weight_gradient_as_their_gemms_forward(planner: Planner) -> None:
    units = planner.units(1, False, 1)
    assert all(0.0 < u.weight_backward_s <= u.backward_s for u in units)
    block = next(u for u in units if u.block_type is not None)
    # a GEMM's backward is two GEMMs, one of them the weight gradient; attention's backward and the
    # memory-bound ops' have little or none: a GEMM-heavy block lands a little under half
    assert 0.3 < block.weight_backward_s / block.backward_s < 0.5


def test_recomputation_lengthens_the_input_gradient_not_the_weight_gradient(planner: Planner) -> None:
    plain = planner.evaluate(ParallelConfig(dp=2, tp=1, pp=4, num_micro_batches=8, schedule="zb-h1"), fast=False)
    full = planner.evaluate(dataclasses.replace(plain.config, recompute="full"), fast=False)
    assert full.stage_bounds == plain.stage_bounds
    assert full.chunk_weight_s == plain.chunk_weight_s
    assert all(f > p for f, p in zip(full.chunk_backward_s, plain.chunk_backward_s))


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_zb_h1_beats_1f1b_where_the_weight_gradients_outlast_their_host_work(wide_planner: Planner, pp: int,
                                                                             m: int, recompute: str) -> None:
    plain = ParallelConfig(dp=8 // pp, tp=1, pp=pp, num_micro_batches=m, recompute=recompute)
    zero_bubble = dataclasses.replace(plain, schedule="zb-h1")
    for fast in (False, True):
        a, b = wide_planner.evaluate(plain, fast=fast), wide_planner.evaluate(zero_bubble, fast=fast)
        assert b.step_time_s < a.step_time_s and b.bubble_fraction < a.bubble_fraction
        assert b.compute_s == pytest.approx(a.compute_s)
    # the price: the later ranks hold the W's they defer, up to rank 0's pp micro-batches
    a, b = wide_planner.evaluate(plain), wide_planner.evaluate(zero_bubble)
    assert b.memory[0].activations_bytes == a.memory[0].activations_bytes
    assert b.memory[-1].activations_bytes > a.memory[-1].activations_bytes


def test_small_blocks_price_w_at_its_host_work_and_keep_1f1b(planner: Planner) -> None:
    """Blocks of hidden 1024 on an A100: each W's GEMMs take less than the host's 0.3 ms a
    parameter-reading op (measured on the H200), so the split costs more than it saves."""
    from mplan.planner.evaluate import SPLIT_W_HOST_S

    plain = ParallelConfig(dp=2, tp=1, pp=4, num_micro_batches=8)
    a, b = planner.evaluate(plain), planner.evaluate(dataclasses.replace(plain, schedule="zb-h1"))
    units = planner.units(1, False, 1)
    for (start, end), weight in zip(b.stage_bounds, b.chunk_weight_s):
        assert weight == pytest.approx(SPLIT_W_HOST_S * sum(u.num_weight_ops for u in units[start:end]))
    assert b.step_time_s > a.step_time_s


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 9)])
@pytest.mark.parametrize("f, i, w", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 2.0)])
def test_the_closed_form_is_the_simulators_pipeline_on_uniform_stages(pp: int, m: int, f: float, i: float,
                                                                      w: float) -> None:
    costs = PipelineCosts.uniform(pp, forward_s=f, backward_s=i + w, weight_s=w)
    config = ParallelConfig(dp=1, tp=1, pp=pp, num_micro_batches=m, schedule="zb-h1")
    step, bubble, busy = _closed_form(config, costs)
    simulated = simulate(build_schedule("zb-h1", pp, m), costs)
    assert step == pytest.approx(simulated.step_time_s, rel=1e-12)
    assert bubble == pytest.approx(simulated.bubble_fraction, rel=1e-12)
    assert busy == pytest.approx(simulated.compute_s, rel=1e-12)


def test_the_closed_form_follows_the_last_gradient_up_a_short_pipeline() -> None:
    # two micro-batches on two uneven stages: the steady-state fill alone would say 7.06 s; rank 1's
    # last I ends at 0.98 + 6.03 - 2 * 0.59, then rank 0 runs its I and W of micro-batch 1
    costs = PipelineCosts(forward_s=(0.98, 1.05), backward_s=(1.92, 1.96), weight_s=(0.93, 0.59), p2p_s=(0.0,),
                          grad_sync_s=(0.0, 0.0))
    config = ParallelConfig(dp=1, tp=1, pp=2, num_micro_batches=2, schedule="zb-h1")
    simulated = simulate(build_schedule("zb-h1", 2, 2), costs)
    assert simulated.step_time_s == pytest.approx(0.98 + 2 * (1.05 + 1.96) - 2 * 0.59 + 1.92)
    assert _closed_form(config, costs)[0] == pytest.approx(simulated.step_time_s)


@pytest.fixture(scope="module")
def zb_plan(graph: Graph) -> Plan:
    _, result = search_plans(graph, CLUSTER, 64, "tp=2,pp=2,schedule=zb-h1")
    return build_plan(result, graph, CLUSTER, 64)


def test_a_zb_h1_plan_round_trips_and_explain_redraws_its_split_backward(zb_plan: Plan, tmp_path: Path) -> None:
    assert zb_plan.schedule == "zb-h1"
    assert all(0.0 < s.weight_ms < s.backward_ms for s in zb_plan.stages)
    path = tmp_path / "plan.json"
    zb_plan.save(str(path))
    assert Plan.load(str(path)).to_dict() == zb_plan.to_dict()
    sim = simulate_plan(Plan.load(str(path)))
    assert sim.step_time_s == pytest.approx(zb_plan.predicted.step_time_s, rel=1e-9)
    w_bars = [e for e in sim.timeline if e.action.kind == "W"]
    assert len(w_bars) == 2 * zb_plan.num_micro_batches
    assert {round((e.end_s - e.start_s) * 1e3, 9) for e in w_bars} == {round(s.weight_ms, 9) for s in zb_plan.stages}
    png = tmp_path / "schedule.png"
    draw_gantt(zb_plan, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plans_written_before_weight_ms_still_load_and_a_bad_one_is_named(zb_plan: Plan, tmp_path: Path) -> None:
    doc = json.loads(dataclasses.replace(zb_plan, schedule="1f1b").to_json())
    for stage in doc["stages"]:
        del stage["weight_ms"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    assert {s.weight_ms for s in Plan.load(str(old)).stages} == {0.0}
    doc["stages"][1]["weight_ms"] = doc["stages"][1]["backward_ms"] * 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"stages\[1\]\.weight_ms"):
        Plan.load(str(bad))
