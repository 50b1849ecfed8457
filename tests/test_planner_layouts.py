"""The planner's own layouts run exactly, on a cluster priced like real GPUs.

Nothing here replaces what the planner chose: the cluster is dgx-h100's figures at the local
world size (2 ranks), with only its device memory cut to what the models' data-parallel plans
need, so that memory binds and the search itself must pick tensor parallelism among one-stage
plans (`mplan.plan(..., spec="pp=1")`: a pipeline would fit too, holding half the layers a rank),
as it would for a model too big for one GPU; and a spec that fixes tp=2 alone takes the sharding ILP's cheapest mix
on those prices (`tp_layout="ilp"`), which differs from Megatron-LM's hand-written layout. Each
runs on gloo ranks in float64 against the plain one-process loop (5 AdamW steps, 1e-9).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

import zoo_models
from distributed import rel_err, run_checks

STEPS, TOL = 5, 1e-9
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
MODELS = {"llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,seq=16,vocab=128",
          "gpt": "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"}


def _mplan_model(spec: str):  # noqa: ANN202 - an nn.Module factory
    def make() -> torch.nn.Module:
        from mplan.models import build_model
        from mplan.verify import perturbed

        return perturbed(build_model(spec, device="cpu", dtype=torch.float64, seed=0))
    return make


def _data(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return zoo_models.batches(4, STEPS, vocab, 16)


def memory_bound_h100s(make: Any, ids: torch.Tensor, loss_fn: Any = None):  # noqa: ANN201 - a ClusterSpec
    """dgx-h100 at 2 GPUs, each with the memory halfway between the leanest tensor-parallel plan
    and the leanest data-parallel one (as priced by the planner itself): of the one-stage plans
    only tp=2 fits."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.ir.trace import capture_for_training
    from mplan.planner.parallel_config import PlanSpec
    from mplan.planner.search import Planner

    cluster = ClusterSpec.preset("dgx-h100", nodes=1, gpus_per_node=2)
    planner = Planner(capture_for_training(make(), (ids,), loss_fn=loss_fn), cluster, runtime="mplan",
                      kernels=True)  # as mplan.plan prices a GPU cluster

    def leanest(spec: PlanSpec) -> float:
        result = planner.search(4, spec)
        return min(e.peak_memory_bytes for e in result.ranked + result.rejected)
    dp, tp = leanest(PlanSpec(tp=1, pp=1)), leanest(PlanSpec(tp=2, pp=1))
    assert tp < dp, (tp, dp)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=int((tp + dp) / 2)))


def run(make: Any, plan: Any, *, loss_fn: Any = None, vocab: int = 128, **options: Any) -> dict[str, Any]:
    import mplan

    data = _data(vocab)
    pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), loss_fn=loss_fn, optimizer=OPTIMIZER,
                            global_batch=4, plan=plan, **options)
    losses = [pm.train_step(x, y) for x, y in data]
    state = pm.full_state_dict()
    model = make()
    opt = OPTIMIZER(model.parameters())
    ref_losses = []
    for x, y in data:
        opt.zero_grad()
        out = model(x, labels=y) if loss_fn is None else loss_fn(model(x), y)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    errors += [rel_err(state[k], v.detach()) for k, v in model.named_parameters(remove_duplicate=False)]
    return {"error": max(errors), "ran": pm.plan.spec(), "layout": pm.plan.tp_layout,
            "strategies": {pm.graph.plan_key(n): str(s) for n, s in pm.choice.items()}}


def searched(make: Any, *, loss_fn: Any = None, vocab: int = 128) -> dict[str, Any]:
    """The planner's own one-stage plan on the memory-bound cluster (`mplan.plan` on the user's
    module: everything searched but pp), run by autoparallel as the plan file says."""
    import mplan

    ids = _data(vocab)[0][0]
    cluster = memory_bound_h100s(make, ids, loss_fn)
    made = mplan.plan(make(), (ids,), cluster=cluster, global_batch=4, spec="pp=1", loss_fn=loss_fn,
                      runtime="mplan")
    return run(make, made, loss_fn=loss_fn, vocab=vocab, cluster=cluster)


def searched_llama() -> dict[str, Any]:
    return searched(_mplan_model(MODELS["llama"]))


def searched_nanogpt() -> dict[str, Any]:
    zoo = zoo_models.ZOO["nanogpt"]
    return searched(zoo.make, loss_fn=zoo.loss_fn, vocab=zoo.vocab)


def _h100s():  # noqa: ANN202 - a ClusterSpec
    from mplan.cost_models.cluster import ClusterSpec

    return ClusterSpec.preset("dgx-h100", nodes=1, gpus_per_node=2)


def ilp_tp2_gpt() -> dict[str, Any]:
    return run(_mplan_model(MODELS["gpt"]), "tp=2", tp_layout="ilp", cluster=_h100s())


def ilp_tp2_sp_llama() -> dict[str, Any]:
    return run(_mplan_model(MODELS["llama"]), "tp=2,sp=1", tp_layout="ilp", cluster=_h100s())


def megatron_tp2_gpt() -> dict[str, Any]:
    return run(_mplan_model(MODELS["gpt"]), "tp=2", cluster=_h100s())


def megatron_tp2_sp_llama() -> dict[str, Any]:
    return run(_mplan_model(MODELS["llama"]), "tp=2,sp=1", cluster=_h100s())


CHECKS = [searched_llama, searched_nanogpt, ilp_tp2_gpt, ilp_tp2_sp_llama, megatron_tp2_gpt, megatron_tp2_sp_llama]


@pytest.fixture(scope="module")
def outcomes():  # noqa: ANN201 - CheckOutcomes
    return run_checks(2, CHECKS, timeout_s=600)


def _first(outcomes, check) -> dict[str, Any]:  # noqa: ANN001
    values = outcomes.assert_passed(check)
    assert values[0]["strategies"] == values[1]["strategies"]
    return values[0]


def test_the_search_picks_tensor_parallelism_when_memory_binds_and_it_runs_exactly(outcomes) -> None:
    for check in (searched_llama, searched_nanogpt):
        result = _first(outcomes, check)
        assert "tp=2" in result["ran"] and result["layout"] == "ilp", result["ran"]
        assert result["error"] < TOL, (check.__name__, result["error"])


def test_the_ilps_own_layout_differs_from_megatrons_and_runs_exactly(outcomes) -> None:
    for ilp, megatron in ((ilp_tp2_gpt, megatron_tp2_gpt), (ilp_tp2_sp_llama, megatron_tp2_sp_llama)):
        mine, theirs = _first(outcomes, ilp), _first(outcomes, megatron)
        assert mine["error"] < TOL and theirs["error"] < TOL, (mine["error"], theirs["error"])
        differ = {key for key, text in mine["strategies"].items() if theirs["strategies"][key] != text}
        assert differ, f"{ilp.__name__}: the ILP chose Megatron's layout op for op"
