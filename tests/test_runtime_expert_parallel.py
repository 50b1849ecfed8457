"""Expert parallelism with data parallelism against one process (gloo, float64).

A toy MoE layer: token i of a micro-batch goes to expert i % E (a fixed, balanced routing,
so every all-to-all chunk has the same size) and is scaled by its learned gate probability,
out_i = softmax(x_i Wr^T)[e] * tanh(W_e x_i + b_e). Experts are sharded over the EP ranks
(E / ep each) and replicated over expert_dp = dp / ep; the router is dense. Training with
clipping at zero=0 and zero=1 must match the single-device model: this checks the expert
gradient scaling (sum over expert_dp, divide by dp) and the norm's counting of experts.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from distributed import rel_err, run_checks
from mplan.collectives.redistribute import all_to_all
from mplan.ir.mesh import MeshShape
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.param_placement import ParamPlacement
from mplan.runtime.process_groups import ProcessGroups, init_process_groups

EXPERTS, HIDDEN, GLOBAL_TOKENS, MICRO_BATCHES = 4, 3, 32, 2
STEPS, MAX_NORM = 4, 0.05
ADAMW = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)


def _full_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "router": torch.randn(EXPERTS, HIDDEN, generator=gen),
        "w": torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=gen),
        "b": torch.randn(EXPERTS, HIDDEN, generator=gen),
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(70 + step)
    return torch.randn(GLOBAL_TOKENS, HIDDEN, generator=gen), torch.randn(GLOBAL_TOKENS, HIDDEN, generator=gen)


def _gates(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Each token's probability for its own expert (token i -> expert i % E)."""
    probs = torch.softmax(x @ router.t(), dim=-1)
    return probs.gather(1, (torch.arange(x.shape[0]) % EXPERTS).unsqueeze(1))


def _moe(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    expert = torch.arange(x.shape[0]) % EXPERTS
    hidden = torch.tanh(torch.einsum("toi,ti->to", p["w"][expert], x) + p["b"][expert])
    return _gates(x, p["router"]) * hidden


def _parallel_moe(x: torch.Tensor, p: dict[str, torch.Tensor], groups: ProcessGroups) -> torch.Tensor:
    tokens = x.shape[0]
    # (T, h) -> (E, T/E, h): row e holds the tokens routed to expert e (a strided view).
    by_expert = x.view(tokens // EXPERTS, EXPERTS, HIDDEN).transpose(0, 1)
    # Chunk j of the expert dim goes to EP rank j; tokens from every EP rank arrive along dim 1.
    received = all_to_all(by_expert, groups.ep, split_dim=0, concat_dim=1)
    hidden = torch.tanh(torch.einsum("eoi,eti->eto", p["w"], received) + p["b"].unsqueeze(1))
    returned = all_to_all(hidden, groups.ep, split_dim=1, concat_dim=0)
    return _gates(x, p["router"]) * returned.transpose(0, 1).reshape(tokens, HIDDEN)


def _local_params(groups: ProcessGroups):
    local_experts = EXPERTS // groups.mesh.ep
    params, placements = {}, {}
    for name, value in _full_params().items():
        expert = name != "router"
        if expert:
            value = value[groups.ep_rank * local_experts:(groups.ep_rank + 1) * local_experts]
        params[name] = value.clone().requires_grad_(True)
        placements[params[name]] = ParamPlacement(expert=expert)
    return params, placements


def _check_training(mesh: MeshShape, zero: int) -> float:
    groups = init_process_groups(mesh)
    reference = {k: v.requires_grad_(True) for k, v in _full_params().items()}
    ref_optimizer = ADAMW(reference.values())
    params, placements = _local_params(groups)
    optimizer = build_optimizer(params.values(), ADAMW, groups, zero=zero, placements=placements)
    local = GLOBAL_TOKENS // mesh.dp
    local_experts = EXPERTS // mesh.ep
    mine = slice(groups.ep_rank * local_experts, (groups.ep_rank + 1) * local_experts)
    clipped = False
    for step in range(STEPS):
        inputs, targets = _batch(step)
        ref_optimizer.zero_grad()
        F.mse_loss(_moe(inputs, reference), targets).backward()
        clipped |= torch.nn.utils.clip_grad_norm_(reference.values(), MAX_NORM).item() > MAX_NORM
        ref_optimizer.step()

        optimizer.zero_grad()
        x = inputs[groups.dp_rank * local:(groups.dp_rank + 1) * local]
        y = targets[groups.dp_rank * local:(groups.dp_rank + 1) * local]
        for x_micro, y_micro in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            (F.mse_loss(_parallel_moe(x_micro, params, groups), y_micro) / MICRO_BATCHES).backward()
        optimizer.step(max_grad_norm=MAX_NORM)
        if zero == 0:
            # Adam is nearly invariant to a gradient's scale: compare the gradients themselves.
            grad_errors = [rel_err(params["router"].grad, reference["router"].grad)]
            grad_errors += [rel_err(params[n].grad, reference[n].grad[mine]) for n in ("w", "b")]
            assert max(grad_errors) < 1e-12, grad_errors
    assert clipped, "the test must exercise clipping"
    errors = [rel_err(params["router"], reference["router"])]
    errors += [rel_err(params[n], reference[n][mine]) for n in ("w", "b")]
    assert max(errors) < 1e-9, errors
    return max(errors)


def check_dp4_ep2_zero0() -> float:
    return _check_training(MeshShape(dp=4, ep=2), zero=0)


def check_dp4_ep2_zero1() -> float:
    return _check_training(MeshShape(dp=4, ep=2), zero=1)


def check_dp4_ep4_zero1() -> float:
    return _check_training(MeshShape(dp=4, ep=4), zero=1)


CHECKS = [check_dp4_ep2_zero0, check_dp4_ep2_zero1, check_dp4_ep4_zero1]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(4, CHECKS)


@pytest.mark.distributed
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_expert_parallel(outcomes, check) -> None:
    outcomes.assert_passed(check)


def test_routing_reference_matches_the_dispatch_layout() -> None:
    """With one rank (groups of one) the dispatch path is the reference computation."""
    torch.set_default_dtype(torch.float64)
    try:
        params = _full_params()
        x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
        groups = init_process_groups(MeshShape())
        assert rel_err(_parallel_moe(x, params, groups), _moe(x, params)) < 1e-14
    finally:
        torch.set_default_dtype(torch.float32)
