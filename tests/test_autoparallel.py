"""`mplan.autoparallel` end to end: plans from the planner, plan files, refusals, one device,
and `verify_plan` (what `mplan verify` calls).

Distributed checks share one gloo group of 2 ranks: a Plan made by `mplan.plan` on the module
(run as the planner made it: its per-op strategies, bound to the graph autoparallel captures by
node key) and the planner's own search (plan=None) train like one process; a plan for another
world size or another model is refused with one clear error, raised on every rank before any
collective (a collective on one rank only would hang the test). Each model is captured once per
rank (tests/capture_cache.py).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from capture_cache import reused_captures
from distributed import rel_err, run_checks
from test_equivalence import OPTIMIZER, TOL, assert_equivalent, batches, compare, family, single_device


def _planned(spec: str, gpus: int, name: str) -> str:
    """Rank 0 plans tiny-gpt for `gpus` H100s and writes the plan; every rank gets the path."""
    import mplan

    where = [None]
    if dist.get_rank() == 0:
        model, ids = family("tiny-gpt")(), batches(4, steps=1)[0][0]
        cluster = mplan.ClusterSpec.preset("dgx-h100", nodes=1, gpus_per_node=gpus)
        plan = mplan.plan(model, (ids,), cluster=cluster, global_batch=4, spec=spec, runtime="mplan")
        where[0] = os.path.join(tempfile.mkdtemp(prefix="mplan_plan_"), name)
        plan.save(where[0])
    dist.broadcast_object_list(where)
    return where[0]


def plan_file_tp2() -> dict:
    from mplan.planner.plan import Plan

    path = _planned("tp=2,pp=1", 2, "tp2.json")
    result = compare(family("tiny-gpt"), path, 4)
    planned = {text for entries in Plan.load(path).ops.values() for text in entries.values()}
    return {**result, "path": path, "as_planned": result["strategy_texts"] <= planned}


def planner_search() -> dict:
    return compare(family("tiny-llama"), None, 4)


def plan_for_four_ranks() -> str:
    import mplan
    from mplan.planner.plan import PlanError

    path = _planned("tp=2,dp=2,pp=1", 4, "world4.json")
    make = family("tiny-gpt")
    with pytest.raises(PlanError) as caught, reused_captures(make.capture_key):  # plan_file_tp2 captured it
        mplan.autoparallel(make(), example_inputs=(batches(4, steps=1)[0][0],), global_batch=4, plan=path)
    return str(caught.value)


def plan_for_another_model() -> str:
    import mplan
    from mplan.planner.plan import PlanError

    path = _planned("tp=2,pp=1", 2, "gpt.json")
    make = family("tiny-llama")
    with pytest.raises(PlanError) as caught, reused_captures(make.capture_key):  # planner_search captured it
        mplan.autoparallel(make(), example_inputs=(batches(4, steps=1)[0][0],), global_batch=4, plan=path)
    return str(caught.value)


CHECKS = [plan_file_tp2, planner_search, plan_for_four_ranks, plan_for_another_model]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(2, CHECKS, timeout_s=240)


def test_executes_a_planner_plan_as_planned(outcomes) -> None:
    values = outcomes.assert_passed(plan_file_tp2)
    assert_equivalent(values)
    assert values[0]["as_planned"] and "tp=2" in values[0]["ran"]
    assert set(values[0]["strategies"]) - {"replicate", "partial"}, values[0]["strategies"]  # real splits ran


def test_plan_none_searches_and_runs(outcomes) -> None:
    assert_equivalent(outcomes.assert_passed(planner_search))


def test_plan_for_another_world_size_is_refused(outcomes) -> None:
    for message in outcomes.assert_passed(plan_for_four_ranks):
        assert "made for 4 ranks" in message and "has 2" in message, message


def test_plan_for_another_model_is_refused(outcomes) -> None:
    for message in outcomes.assert_passed(plan_for_another_model):
        assert "another model" in message and "graph hash" in message, message


def test_one_device_without_a_process_group() -> None:
    """No torchrun environment, no group: autoparallel runs the model on this process."""
    import mplan

    assert not dist.is_initialized() and "RANK" not in os.environ
    data = batches(4)
    make = family("tiny-gpt")
    with _default_dtype(torch.float64):
        pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                                plan="mbs=2", max_grad_norm=0.3)
        losses = [pm.train_step(x, y) for x, y in data]
        ref_losses, ref_state = single_device(make, data)
    assert pm.plan.num_micro_batches == 2
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-12
    state = pm.full_state_dict()
    # Attention's key bias has a zero gradient in exact arithmetic (softmax is invariant to it):
    # AdamW normalizes what rounding leaves there, so two summation orders (micro-batches of 2
    # against one batch of 4) part at ~1e-12 on it, and by the thread count's order (1.3e-12 on
    # one intra-op thread). It is held to the project's bound; every other parameter to 1e-12.
    key_bias = {k for k in ref_state if k.endswith("k_proj.bias")}
    assert key_bias and max(rel_err(state[k], ref_state[k]) for k in key_bias) < TOL
    assert max(rel_err(state[k], v) for k, v in ref_state.items() if k not in key_bias) < 1e-12


def test_a_cluster_given_by_name_or_path_is_refused_in_one_line() -> None:
    """The Python API takes a ClusterSpec; a preset's name or a profile's path given instead is one
    line naming the three ways to make one, before the capture, not an AttributeError from the planner."""
    import mplan
    from mplan.cost_models.cluster import ClusterSpecError

    data = batches(4, steps=1)
    with pytest.raises(ClusterSpecError, match=r"autoparallel\(cluster=...\): expected a mplan\.ClusterSpec .*"
                                               r"got str 'profile\.json'"):
        mplan.autoparallel(family("tiny-gpt")(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                           plan="dp=1", cluster="profile.json")
    with pytest.raises(ClusterSpecError, match=r"mplan\.plan\(cluster=...\): .*got str 'h200'"):
        mplan.plan(family("tiny-gpt")(), (data[0][0],), cluster="h200", global_batch=4)


def test_fp8_on_a_cpu_is_refused_naming_why() -> None:
    """FP8 GEMMs need CUDA capability >= 8.9: asking for them elsewhere is one clear error
    before anything trains, never a silent bf16 fallback."""
    import mplan
    from mplan.kernels.fp8 import Fp8Unavailable

    data = batches(4, steps=1)
    with pytest.raises(Fp8Unavailable, match=r"FP8 linear needs a CUDA device of compute capability >= 8\.9, not cpu"):
        mplan.autoparallel(family("tiny-gpt")(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                           plan="dp=1", fp8=True)


def test_fp8_with_recomputation_is_refused_naming_why() -> None:
    """Delayed scaling records each cast's amax in forward: a recomputed forward would quantize
    differently from the forward it stands for, so the two are not combined."""
    import mplan

    data = batches(4, steps=1)
    with pytest.raises(ValueError, match="recompute=full with fp8=True: FP8's delayed scaling"):
        mplan.autoparallel(family("tiny-gpt")(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                           plan="dp=1,recompute=full", fp8=True)


def test_a_plan_made_for_fp8_runs_fp8_or_refuses_naming_why() -> None:
    import mplan
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.kernels.fp8 import Fp8Unavailable

    data = batches(4, steps=1)
    made = mplan.plan(family("tiny-gpt")(), (data[0][0],), cluster=ClusterSpec.preset("h200", gpus_per_node=1),
                      global_batch=4, fp8=True)
    assert made.fp8
    with pytest.raises(Fp8Unavailable, match="not cpu"):
        mplan.autoparallel(family("tiny-gpt")(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                           plan=made)


def test_verify_plan_scales_a_plan_down() -> None:
    from mplan.verify import verify_plan

    report = verify_plan("gpt3-175b", "tp=8,dp=8,sp=1,zero=1", world_size=2, steps=2)
    assert report.passed, report
    assert report.executed.startswith("dp=1,tp=2,pp=1") and "sp=1,zero=1" in report.executed, report.executed
    assert "num_layers=2" in report.scaled_model and "tie_embeddings=True" in report.scaled_model


def test_the_planners_pipeline_plan_for_llama3_70b_verifies(tmp_path) -> None:
    """`mplan plan llama3-70b --cluster dgx-h100 --nodes 4 --global-batch 512` picks a pipeline, and
    that plan file, scaled down to 4 gloo ranks with its TP, pipeline, schedule and recomputation,
    trains as one process does."""
    from mplan.cli import main as cli_main
    from mplan.planner.plan import Plan
    from mplan.verify import scaled_plan, verify_plan

    path = tmp_path / "llama3-70b.plan.json"
    assert cli_main(["plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "4", "--global-batch", "512",
                     "-o", str(path)]) == 0
    plan = Plan.load(str(path))
    assert plan.mesh.pp > 1 and plan.mesh.tp > 1, plan.spec()
    layout = scaled_plan(str(path), 4)
    assert (layout.tp, layout.pp) == (2, 2) and f"schedule={plan.schedule}" in layout.spec, layout
    report = verify_plan("llama3-70b", str(path), world_size=4, steps=2)
    assert report.passed, report
    assert "tp=2,pp=2" in report.executed and f"recompute={plan.recompute}" in report.executed, report.executed


@functools.lru_cache(maxsize=None)
def _tiny_graph():
    from mplan.ir.trace import capture_for_training

    return capture_for_training(family("tiny-gpt")(), (batches(4, steps=1)[0][0],))


def _resolve(spec: str, world: int, batch: int, **options):
    from mplan.cost_models.presets import local_cluster
    from mplan.planner.resolve import resolve_plan

    cluster = local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    return resolve_plan(spec, _tiny_graph(), cluster=cluster, world_size=world, global_batch=batch, **options)


@pytest.mark.parametrize("spec,world,batch,error,match", [
    ("tp=2,dp=2", 2, 4, ValueError, r"dp\*tp\*pp = 2\*2\*1 = 4 ranks but the world has 2"),
    ("dp=2,mbs=3", 2, 8, ValueError, "not a multiple of the micro-batch size 3"),
    ("dp=4", 4, 6, ValueError, "not divisible by dp=4"),
    ("tp=3", 4, 4, ValueError, r"tp\*pp = 3\*1 = 3 does not divide the world size 4"),
    ("pp=3", 4, 4, ValueError, r"tp\*pp = 1\*3 = 3 does not divide the world size 4"),
    ("pp=8", 8, 8, ValueError, r"pp\*vpp = 8 pipeline stages but .* has 4 units to cut .*use pp\*vpp <= 4"),
    ("pp=2,vpp=4", 2, 4, ValueError, r"pp\*vpp = 8 pipeline stages"),
    ("pp=2,schedule=zb-h2", 2, 4, ValueError, r"schedule must be one of 1f1b, interleaved, gpipe, zb-h1, got .zb-h2."),
])
def test_spec_strings_fail_with_the_arithmetic(spec, world, batch, error, match) -> None:
    with pytest.raises(error, match=match):
        _resolve(spec, world, batch)


def test_a_pipeline_spec_gets_micro_batches_for_every_stage() -> None:
    plan = _resolve("pp=2", 2, 8)
    assert (plan.micro_batch_size, plan.num_micro_batches, plan.schedule) == (4, 2, "1f1b")
    plan = _resolve("pp=2,vpp=2", 2, 8)
    assert (plan.micro_batch_size, plan.num_micro_batches, plan.schedule) == (4, 2, "interleaved")
    assert [s.rank for s in plan.stages] == [0, 1, 0, 1]


def test_spec_fills_left_out_keys() -> None:
    plan = _resolve("tp=2,sp=1,zero=1", 8, 16, micro_batch_size=2)
    assert (plan.mesh.dp, plan.mesh.tp, plan.micro_batch_size, plan.num_micro_batches) == (4, 2, 2, 2)
    assert plan.sequence_parallel and plan.zero == 1 and plan.tp_layout == "megatron"


def test_pipeline_plans_that_cannot_run_fail_before_any_collective() -> None:
    """A plan file whose stage cut does not list the model's units, and a schedule the micro-batches
    do not fit, fail at resolve / check time with what is wrong."""
    import dataclasses

    from mplan.ir.schedule import ScheduleError
    from mplan.planner.plan import PlanError
    from mplan.planner.resolve import _check
    from mplan.runtime.parallel_module import check_executable

    plan = _resolve("pp=2", 2, 4, micro_batch_size=1)
    first, second = plan.stages
    swapped = dataclasses.replace(plan, stages=(dataclasses.replace(first, units=second.units),
                                                dataclasses.replace(second, units=first.units)))
    with pytest.raises(PlanError, match=r"the stages do not list .*'s units in order"):
        _check(swapped, _tiny_graph())
    dropped = dataclasses.replace(plan, stages=(first, dataclasses.replace(second, units=second.units[:-1])))
    with pytest.raises(PlanError, match=r"missing \['epilogue'\]"):
        _check(dropped, _tiny_graph())
    interleaved = _resolve("pp=2,vpp=2,schedule=interleaved", 2, 4, micro_batch_size=1)
    with pytest.raises(ScheduleError, match=r"multiple of the pipeline size"):
        check_executable(dataclasses.replace(interleaved, num_micro_batches=3, global_batch=3))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_a_hugging_face_model_on_the_meta_device_gets_transformers_init(family: str) -> None:
    """A Hugging Face model built from its config on the meta device (as `mplan bench` builds one)
    is initialized shard by shard the way transformers initializes it: norms one, projections
    normal(0, initializer_range), biases zero; its modules have no reset_parameters()."""
    import mplan

    if family == "qwen2":
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model
        extra: dict = {}
    else:
        from transformers import MixtralConfig as Config, MixtralForCausalLM as Model
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2}
    config = Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, use_cache=False, **extra)
    with torch.device("meta"):
        model = Model(config)
    ids = batches(4, steps=1)[0][0]
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=OPTIMIZER, global_batch=4, plan="dp=1")
    state = pm.full_state_dict()
    norms = [v for k, v in state.items() if k.endswith("layernorm.weight") or k.endswith("norm.weight")]
    weights = [v for k, v in state.items() if v.dim() >= 2]
    assert norms and all(torch.equal(v, torch.ones_like(v)) for v in norms)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert all(abs(float(v.std()) - config.initializer_range) < 0.3 * config.initializer_range for v in weights)
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in state.items() if k.endswith(".bias"))
    assert math.isfinite(pm.train_step(ids, ids))


class _NoGradRegion(nn.Module):
    """A forward with a `torch.no_grad()` region that creates a tensor on its input's device:
    torch.export records the region as a higher-order op whose body (a submodule) holds
    `device=<the capture's device>`, as transformers' RoPE does on torch 2.11."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            offsets = torch.arange(x.shape[1], device=x.device).to(x.dtype)
        return self.lin(x + offsets)


def test_a_meta_device_capture_runs_the_bodies_of_its_no_grad_regions_on_the_real_device() -> None:
    """2026-12-02, `mplan bench CONFIG.json --measure` on the H200: 'Tensor device mismatch!
    Expected: meta, Got: cuda:0' inside such a body; the program's own nodes were retargeted, the
    bodies were not."""
    import mplan

    torch.manual_seed(0)
    model = _NoGradRegion().to("meta")
    x, target = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    pm = mplan.autoparallel(model, example_inputs=(x,), global_batch=2, plan="dp=1",
                            loss_fn=lambda y, t: ((y - t) ** 2).mean(), optimizer=OPTIMIZER)
    state = pm.full_state_dict()
    reference = _NoGradRegion()
    reference.load_state_dict(state)
    expected = ((reference(x) - target) ** 2).mean()
    assert torch.allclose(torch.as_tensor(pm.train_step(x, target), dtype=torch.float64), expected, rtol=1e-12)


@pytest.mark.parametrize("zero, says", [(0, False), (3, True)])
def test_it_says_when_the_model_passed_in_will_not_train(capsys, zero: int, says: bool) -> None:
    """At dp=1 zero=0 the model's own parameters train (updated in place, nothing said); under
    zero=3 they are shards of a flat buffer, so the model keeps its initial values: autoparallel
    says so and names the accessors, and that is true (the model's weights do not move)."""
    import mplan

    data = batches(4)
    with _default_dtype(torch.float64):
        model = family("tiny-gpt")()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        pm = mplan.autoparallel(model, example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                                plan=f"dp=1,zero={zero}", progress="lines")
        pm.train_step(*data[0])
    said = [line for line in capsys.readouterr().err.splitlines() if "parameters of the model passed in" in line]
    moved = any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert bool(said) == says and moved != says
    if says:
        assert f"{len(before)} of {len(before)} parameters" in said[0] and "pm.full_state_dict()" in said[0]
