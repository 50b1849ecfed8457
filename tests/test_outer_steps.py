"""The plan key `outer_steps=H`: an outer loop across sites (DiLoCo-style, issue 36 item 5), opt-in
and inexact, from the spec grammar and the Plan JSON through the planner's search to `train_step`.

What must hold:
- training: with inner SGD, H=1 and the outer optimizer plain SGD at lr 1.0 (no momentum), a
  model trained through `mplan.autoparallel` on 4 gloo ranks = 2 sites of 2, float64, equals
  synchronous data parallelism over all 4 ranks to 1e-9 over 4 steps (parameters, and the sites'
  mean loss): the identity `runtime/outer_loop.py` states. Also with TP inside the sites
  (tp=2, one replica a site, whose gradients need no collective at all) and with a pipeline
  inside them (pp=2, 1F1B over 2 micro-batches);
- traffic: under H=2 no collective whose group spans both sites runs in a non-outer step (every
  torch.distributed collective counted, by the ranks of its group), exactly one (the
  pseudo-gradient's all-reduce) in an outer step; the sites' parameters differ after an inner
  step and agree after an outer one; bf16 parameters' pseudo-gradient crosses in float32 (as
  `planner/outer_pricing.py` prices it);
- refusals in one line: no sites, H < 0, a non-integer H, zero > 0, clipping, checkpoints;
- the plan key round-trips the Plan JSON, an old file without it loads synchronous, a bad
  value names the field;
- the search tries an outer loop only where inexact training is allowed, and `explain` says so.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distributed import rel_err, run_checks
from test_equivalence import batches, family
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.parallel_config import PlanSpecError, parse_plan_spec
from mplan.planner.plan import Plan, PlanError
from mplan.runtime.outer_loop import OuterOptimizer

WORLD, STEPS, GLOBAL_BATCH, TOL = 4, 4, 8, 1e-9
SGD = functools.partial(torch.optim.SGD, lr=0.1)
PLAIN = OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False)


def two_site_cluster(world_size: int) -> ClusterSpec:
    """This machine's ranks as 2 sites of one node each (the figures only price; the ranks are local)."""
    from mplan.api import _local_cluster

    base = _local_cluster(world_size)
    inter = dataclasses.replace(base.links.intra_node, kind="roce", source="unused: each site is one node")
    cluster = dataclasses.replace(base, num_nodes=2, gpus_per_node=world_size // 2,
                                  links=dataclasses.replace(base.links, inter_node=inter))
    return cluster.with_sites(2, inter_site_gbps=1.0, inter_site_latency_ms=10.0, source="test: two local sites")


def _built(spec: str, **options: Any) -> Any:
    import mplan
    from capture_cache import reused_captures

    make = family("tiny-gpt")
    data = batches(GLOBAL_BATCH, steps=STEPS)
    with reused_captures(make.capture_key):
        return mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=SGD, progress="quiet",
                                  global_batch=GLOBAL_BATCH, plan=spec, cluster=two_site_cluster(WORLD), **options)


def _trained(spec: str, **options: Any) -> tuple[Any, list[float]]:
    pm = _built(spec, **options)
    return pm, [pm.train_step(ids, labels) for ids, labels in batches(GLOBAL_BATCH, steps=STEPS)]


def _sites_mean(loss: float, pm: Any) -> float:
    """The mean of the sites' losses (each site's is its replicas' mean)."""
    value = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(value, group=pm.groups.cross_site_dp)
    return float(value) / 2


def _against_synchronous(spec: str) -> dict[str, float]:
    sync, sync_losses = _trained(spec)
    outer, outer_losses = _trained(f"{spec},outer_steps=1", outer_optimizer=PLAIN)
    assert outer.plan.outer_steps == 1 and outer.outer_loop is not None and sync.outer_loop is None
    assert outer.outer_loop.outer_steps == STEPS
    theirs, mine = sync.full_state_dict(), outer.full_state_dict()
    result = {"param": max(rel_err(mine[name], ref) for name, ref in theirs.items()),
              "loss": max(abs(_sites_mean(a, outer) - b) / abs(b) for a, b in zip(outer_losses, sync_losses))}
    assert result["param"] < TOL and result["loss"] < TOL, result
    return result


def h1_with_plain_outer_sgd_equals_synchronous_dp() -> dict[str, float]:
    return _against_synchronous("dp=4,sites=2")


def h1_equals_synchronous_dp_with_tp_inside_sites() -> dict[str, float]:
    return _against_synchronous("tp=2,dp=2,sites=2")


def h1_equals_synchronous_dp_with_a_pipeline_inside_sites() -> dict[str, float]:
    return _against_synchronous("pp=2,dp=2,mbs=2,sites=2")


def _crossing(group: dist.ProcessGroup | None, sites: list[set[int]]) -> bool:
    ranks = set(range(dist.get_world_size())) if group is None else set(dist.get_process_group_ranks(group))
    return all(ranks & site for site in sites)


COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "barrier",
           "all_gather_object", "broadcast_object_list")


def h2_crosses_sites_only_at_outer_steps() -> list[int]:
    """Every torch.distributed collective a step issues, counted where its group spans both sites."""
    pm = _built("dp=4,sites=2,outer_steps=2")
    sites = [set(range(0, 2)), set(range(2, 4))]
    assert pm.groups.site_dp is not None and set(dist.get_process_group_ranks(pm.groups.site_dp)) in sites
    real = {name: getattr(dist, name) for name in COUNTED}
    crossed: list[str] = []

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if group is None:  # positional: the group follows the tensor (and the op, or src/dst)
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        if _crossing(group, sites):
            crossed.append(name)
        return real[name](*args, **kwargs)

    per_step, agree = [], []
    try:
        for name in COUNTED:
            setattr(dist, name, functools.partial(counting, name))
        for ids, labels in batches(GLOBAL_BATCH, steps=STEPS):
            crossed.clear()
            pm.train_step(ids, labels)
            per_step.append(list(crossed))
            flat = torch.cat([p.detach().reshape(-1) for p in pm.params.values()])
            every = [torch.empty_like(flat) for _ in range(2)]
            real["all_gather"](every, flat, group=pm.groups.cross_site_dp)
            agree.append(torch.equal(every[0], every[1]))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert per_step == [[], ["all_reduce"], [], ["all_reduce"]], per_step
    assert agree == [False, True, False, True], agree
    assert pm.outer_loop.outer_steps == STEPS // 2
    return [len(calls) for calls in per_step]


def bf16_pseudo_gradient_crosses_in_float32() -> str:
    from mplan.runtime.outer_loop import OuterLoop

    groups = _built("dp=4,sites=2,outer_steps=2").groups
    site = dist.get_rank() // 2
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    loop = OuterLoop(layer.parameters(), groups.cross_site_dp, 1, PLAIN, site_group=groups.site_dp)
    start = [p.detach().clone() for p in layer.parameters()]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(2.0 ** -4 * (site + 1))  # each site moved its own way (exact in bf16 here)
    real, sent = dist.all_reduce, []

    def recording(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if group is groups.cross_site_dp:
            sent.append(tensor.dtype)
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    try:
        assert loop.after_inner_step()
    finally:
        dist.all_reduce = real
    assert sent == [torch.float32], sent
    for before, p in zip(start, layer.parameters()):  # plain SGD at lr 1: the sites' mean
        assert p.dtype == torch.bfloat16 and torch.equal(p, before + 2.0 ** -4 * 1.5), (p - before).unique()
    return str(sent[0])


def plan_key_round_trips_the_json() -> int:
    pm = _built("dp=4,sites=2,outer_steps=2")
    doc = json.loads(pm.plan.to_json())
    assert doc["outer_steps"] == 2 and Plan.from_dict(doc) == pm.plan
    assert pm.plan.spec().endswith(",sites=2,outer_steps=2") and pm.plan.inexact
    return doc["outer_steps"]


def refusals_in_one_line() -> None:
    import mplan

    with pytest.raises(PlanSpecError, match="outer_steps=2 averages over sites; it needs sites > 1"):
        _built("dp=4,outer_steps=2")
    with pytest.raises(PlanSpecError, match="runs with zero=0 only"):
        _built("dp=4,sites=2,zero=1,outer_steps=2")
    with pytest.raises(ValueError, match="max_grad_norm with outer_steps"):
        _built("dp=4,sites=2,outer_steps=2", max_grad_norm=1.0)
    pm = _built("dp=4,sites=2,outer_steps=2")
    for call in (pm.save, pm.load):
        with pytest.raises(NotImplementedError, match="anchor and momentum are not in mplan's checkpoints"):
            call("/nonexistent")
    with pytest.raises(Exception, match="averages over sites; it needs sites > 1"):
        make = family("tiny-gpt")  # one site: the spec's sites=1 can only be flat
        mplan.autoparallel(make(), example_inputs=(batches(GLOBAL_BATCH)[0][0],), optimizer=SGD, progress="quiet",
                           global_batch=GLOBAL_BATCH, plan="dp=4,sites=1,outer_steps=2")


CHECKS = [h1_with_plain_outer_sgd_equals_synchronous_dp, h1_equals_synchronous_dp_with_tp_inside_sites,
          h1_equals_synchronous_dp_with_a_pipeline_inside_sites, h2_crosses_sites_only_at_outer_steps,
          bf16_pseudo_gradient_crosses_in_float32, plan_key_round_trips_the_json, refusals_in_one_line]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(WORLD, CHECKS)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_distributed(outcomes, check):
    outcomes.assert_passed(check)


# -- the grammar and the Plan JSON, in one process ---------------------------------------------------
@pytest.mark.parametrize("text, why", [
    ("dp=4,sites=2,outer_steps=-1", "outer_steps must be a whole number"),
    ("dp=4,sites=2,outer_steps=2.5", "outer_steps must be a whole number"),
    ("dp=4,sites=2,outer_steps=eight", "outer_steps must be a whole number"),
    ("dp=4,sites=1,outer_steps=8", "needs sites > 1"),
])
def test_spec_refusals(text, why):
    with pytest.raises(PlanSpecError, match=why) as raised:
        parse_plan_spec(text)
    assert "\n" not in str(raised.value)


def test_spec_values():
    assert parse_plan_spec("dp=4,sites=2,outer_steps=8").outer_steps == 8
    assert parse_plan_spec("outer_steps=0").outer_steps == 0  # synchronous, said out loud
    assert parse_plan_spec("dp=4").outer_steps is None


def _cluster(gbps: float = 1.0) -> ClusterSpec:
    return ClusterSpec.preset("dgx-h100", nodes=2, sites=2, inter_site_gbps=gbps, inter_site_latency_ms=10)


@functools.cache
def _outer_plan() -> Plan:
    from mplan.planner.planning import plan

    return plan("tiny-gpt", cluster=_cluster(), global_batch=16, spec="dp=16,sites=2,outer_steps=4", progress="quiet")


def test_plan_json_round_trip_and_old_files():
    made = _outer_plan()
    doc = made.to_dict()
    assert doc["outer_steps"] == 4 and Plan.from_dict(json.loads(json.dumps(doc))) == made
    old = {k: v for k, v in doc.items() if k != "outer_steps"}  # a file written before the key
    assert Plan.from_dict(old).outer_steps == 0 and "outer_steps" not in Plan.from_dict(old).to_dict()


@pytest.mark.parametrize("value, why", [(-1, "outer_steps must be an integer >= 0"),
                                        (2.5, "outer_steps must be an integer >= 0"),
                                        ("8", "outer_steps must be an integer >= 0")])
def test_plan_json_bad_values_name_the_field(value, why):
    doc = {**_outer_plan().to_dict(), "outer_steps": value}
    with pytest.raises(PlanError, match=why) as raised:
        Plan.from_dict(doc)
    assert "\n" not in str(raised.value)


def test_plan_json_outer_steps_without_sites_is_refused():
    doc = _outer_plan().to_dict()
    doc["mesh"]["sites"] = 1
    with pytest.raises(PlanError, match="outer_steps=4 averages over sites; it needs sites > 1"):
        Plan.from_dict(doc)


def test_a_plan_made_in_code_says_why_its_outer_loop_cannot_run():
    made = _outer_plan()
    assert made.outer_refusal() is None
    assert "runs with zero=0 only" in dataclasses.replace(made, zero=1).outer_refusal()
    assert "needs sites > 1" in dataclasses.replace(made, mesh=dataclasses.replace(made.mesh, sites=1)).outer_refusal()


def test_search_tries_an_outer_loop_only_when_inexact_training_is_allowed():
    """On a slow long haul (0.1 Gb/s) the outer loop is much faster by the planner's prices, yet
    without `inexact_ok` no plan of the search has one."""
    from mplan.planner.explain import explain_data
    from mplan.planner.planning import plan

    exact = plan("tiny-gpt", cluster=_cluster(0.1), global_batch=16, progress="quiet")
    assert exact.outer_steps == 0 and not any("outer_steps" in a.spec for a in exact.alternatives)
    inexact = plan("tiny-gpt", cluster=_cluster(0.1), global_batch=16, progress="quiet", inexact_ok=True)
    assert inexact.outer_steps > 0 and inexact.mesh.sites == 2, inexact.spec()
    assert inexact.predicted.step_time_s < exact.predicted.step_time_s
    assert inexact.predicted.dp_links.inter_site_gb < exact.predicted.dp_links.inter_site_gb
    assert {z.zero for z in inexact.zero_levels} <= {0}  # no other ZeRO level runs an outer loop
    said = explain_data(inexact)["inexact"]
    assert "not the single-device loop's arithmetic" in said["why_inexact"]
    assert said["exact_spec"] is not None and "outer_steps" not in said["exact_spec"] and said["won_by_ms"] > 0
    assert explain_data(exact)["inexact"] is None


def test_search_refuses_an_outer_loop_on_one_site():
    from mplan.planner.planning import plan

    with pytest.raises(PlanSpecError, match="outer_steps=8 averages over sites; the cluster has one site"):
        plan("tiny-gpt", cluster=ClusterSpec.preset("dgx-h100", nodes=2), global_batch=16, spec="outer_steps=8",
             progress="quiet")
