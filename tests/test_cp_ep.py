"""Context and expert parallelism together (issue 34): cp=2 x ep=2 on 4 gloo ranks trains exactly
as one process.

A cp config runs as dp * cp replicas that hold the same parameters (`MeshShape.replicas`), and
expert parallelism is carved out of those replicas: each ep group routes the tokens its ranks
hold, whichever sequence slice they are, to the experts it shards, and an expert's gradients are
reduced over the replicas that hold it (cp ranks' shares summed, dp replicas averaged, as for the
dense parameters). Checked as tests/test_cp_moe.py checks cp with ep=1: 3 AdamW steps with active
clipping, every loss and every final parameter against one process trained on the plan's
micro-batches, float64, relative error under 1e-9, on Hugging Face Mixtral and Qwen2-MoE (shared
expert) without their router loss (with it, dp=2 x cp=2 x ep=2: tests/test_cp_router_loss.py),
with and without ZeRO-1. An ep group is any ep consecutive replicas (`MeshShape`: replica =
cp_rank + cp * dp_rank), so ep divides dp x cp, not dp alone: with no data parallelism, dp=1 x cp=4
x ep=2 (each pair of cp ranks an ep group, each expert on two ranks, ZeRO-1 sharding its state over
them) and dp=1 x cp=4 x ep=4 (the cp group is the ep group), and dp=2 x cp=2 x ep=4 (an ep group
across both dp replicas, each expert on one rank) train as exactly. The search prices these plans
as it prices cp with ep=1 (tests/test_cp_moe.py).
"""
from __future__ import annotations

from typing import Any

import pytest

from distributed import run_checks
from test_cp_moe import without_router_loss
from test_equivalence import TOL, batches, errors, trained
from test_expert_parallel import accumulated, hf_moe

STEPS = 3


def _compare(kind: str, plan: str) -> dict[str, Any]:
    make = without_router_loss(hf_moe(kind))
    data = batches(4, steps=STEPS)
    pm, losses, norms = trained(make, plan, data, micro_batch_size=1)
    sharded = [name for name in pm.params if "experts" in name and pm.params[name].shape[0] < 4]
    held = {pm.params[name].shape[0] for name in sharded}
    return {**errors(pm, losses, norms, accumulated(make, data, 1)), "dp": pm.plan.mesh.dp, "cp": pm.plan.mesh.cp,
            "ep": pm.plan.mesh.ep, "zero": pm.plan.zero, "experts_sharded": len(sharded),
            "experts_held": sorted(held), "expert_replicas": pm.groups.mesh.expert_dp}


def cp2_ep2_mixtral() -> dict[str, Any]:
    return _compare("mixtral", "dp=2,cp=2,ep=2")


def cp2_ep2_qwen2_moe_zero1() -> dict[str, Any]:
    return _compare("qwen2_moe", "dp=2,cp=2,ep=2,zero=1")


def dp1_cp4_ep2_mixtral_zero1() -> dict[str, Any]:
    return _compare("mixtral", "dp=1,cp=4,ep=2,zero=1")


def dp1_cp4_ep4_qwen2_moe() -> dict[str, Any]:
    return _compare("qwen2_moe", "dp=1,cp=4,ep=4")


def dp2_cp2_ep4_mixtral() -> dict[str, Any]:
    return _compare("mixtral", "dp=2,cp=2,ep=4")


CHECKS = [cp2_ep2_mixtral, cp2_ep2_qwen2_moe_zero1, dp1_cp4_ep2_mixtral_zero1, dp1_cp4_ep4_qwen2_moe,
          dp2_cp2_ep4_mixtral]


@pytest.fixture(scope="module")
def world4() -> Any:
    return run_checks(4, CHECKS, timeout_s=600)


@pytest.mark.parametrize("check,zero", [(cp2_ep2_mixtral, 0), (cp2_ep2_qwen2_moe_zero1, 1)])
def test_cp2_ep2_trains_as_one_process(world4: Any, check: Any, zero: int) -> None:
    for rank, result in enumerate(world4.assert_passed(check)):
        assert (result["cp"], result["ep"], result["zero"]) == (2, 2, zero), result
        assert result["experts_sharded"] > 0, f"rank {rank}: no expert parameter is sharded over ep: {result}"
        assert result["loss"] < TOL and result["param"] < TOL and result["clipped"], f"rank {rank}: {result}"


@pytest.mark.parametrize("check,mesh,held", [
    (dp1_cp4_ep2_mixtral_zero1, (1, 4, 2, 1, 2), 2),
    (dp1_cp4_ep4_qwen2_moe, (1, 4, 4, 0, 1), 1),
    (dp2_cp2_ep4_mixtral, (2, 2, 4, 0, 1), 1),
], ids=lambda v: getattr(v, "__name__", None))
def test_ep_carved_from_dp_x_cp_trains_as_one_process(world4: Any, check: Any, mesh: tuple, held: int) -> None:
    """(dp, cp, ep, zero, replicas of each expert): ep divides dp x cp but not dp; every rank holds
    `held` of the 4 experts, each replicated on dp x cp / ep ranks."""
    for rank, result in enumerate(world4.assert_passed(check)):
        assert (result["dp"], result["cp"], result["ep"], result["zero"], result["expert_replicas"]) == mesh, result
        assert result["experts_held"] == [held], f"rank {rank}: {result}"
        assert result["loss"] < TOL and result["param"] < TOL and result["clipped"], f"rank {rank}: {result}"
