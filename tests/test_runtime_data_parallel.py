"""Data parallelism (zero=0 and ZeRO-1) against one process, on gloo ranks in float64.

Each rank trains the small MLP of tests/dp_fixtures.py on its slice of the global batch, in two
micro-batches with gradient accumulation, with AdamW, two parameter groups and global-norm
clipping; the reference trains the same model on the whole batch in one process. Losses and
final parameters must agree to 1e-9 (they agree to ~1e-15), and the two zero levels to 1e-12.
The MLP's 66 parameters are not divisible by 4, and in 100-byte buckets not by 2 either, so
ZeRO's padding is exercised at both world sizes.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_checks
from dp_fixtures import (ADAMW, SMALL_BUCKET_BYTES, STEPS, TO_REFERENCE, batch, max_rel_err, mlp, param_groups,
                         reference, train_steps)
from mplan.ir.mesh import MeshShape, mesh_for_world
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.process_groups import ProcessGroups, init_process_groups

BETWEEN_ZERO_LEVELS = 1e-12


@functools.cache
def _groups() -> ProcessGroups:
    return init_process_groups(mesh_for_world(dist.get_world_size()))


def _train(zero: int, bucket_bytes: int) -> tuple[list[float], nn.Module]:
    model = mlp()
    optimizer = build_optimizer(param_groups(model), ADAMW, _groups(), zero=zero,
                                bucket_bytes=bucket_bytes)
    return train_steps(model, optimizer, _groups(), range(STEPS)), model


def _compare(losses: list[float], model: nn.Module, ref_losses: list[float], ref_model: nn.Module,
             tolerance: float) -> float:
    error = max_rel_err(losses, model, ref_losses, ref_model)
    assert error < tolerance, f"largest relative error {error}"
    return error


def _check_against_reference(bucket_bytes: int) -> dict[str, float]:
    ref_losses, _, ref_model = reference()
    plain_losses, plain = _train(0, bucket_bytes)
    zero_losses, zero = _train(1, bucket_bytes)
    return {
        "zero0_vs_single": _compare(plain_losses, plain, ref_losses, ref_model, TO_REFERENCE),
        "zero1_vs_single": _compare(zero_losses, zero, ref_losses, ref_model, TO_REFERENCE),
        "zero1_vs_zero0": _compare(zero_losses, zero, plain_losses, plain, BETWEEN_ZERO_LEVELS),
    }


def check_one_bucket() -> dict[str, float]:
    return _check_against_reference(bucket_bytes=2**20)


def check_small_padded_buckets() -> dict[str, float]:
    return _check_against_reference(bucket_bytes=SMALL_BUCKET_BYTES)


def check_zero0_buckets_reduce_during_the_last_backward() -> int:
    """Every 100-byte bucket (three: [b2, w2], [b1], [w1], last layer first) starts its all-reduce
    from backward's hooks; none waits for the step (the results above are exact with this overlap)."""
    model = mlp()
    optimizer = build_optimizer(param_groups(model), ADAMW, _groups(), zero=0, bucket_bytes=SMALL_BUCKET_BYTES)
    train_steps(model, optimizer, _groups(), range(1))
    sync = optimizer.grad_sync
    assert sync.started_in_backward == sync.num_buckets == 3, (sync.started_in_backward, sync.num_buckets)
    return sync.started_in_backward


def check_zero1_buckets_reduce_scatter_during_the_last_backward() -> int:
    """ZeRO-1's buckets (two parameter groups: weights [w1], [w2], biases [b1, b2]) start their
    reduce-scatter from backward's hooks too, last first."""
    model = mlp()
    optimizer = build_optimizer(param_groups(model), ADAMW, _groups(), zero=1, bucket_bytes=SMALL_BUCKET_BYTES)
    train_steps(model, optimizer, _groups(), range(1))
    slots = len(optimizer._slots)
    assert optimizer.started_in_backward == slots >= 3, (optimizer.started_in_backward, slots)
    return optimizer.started_in_backward


def _check_resume(zero: int) -> float:
    """3 steps, save, restore into a fresh (differently initialized) model, 2 more steps."""
    groups = _groups()
    uninterrupted_losses, uninterrupted = _train(zero, SMALL_BUCKET_BYTES)
    model = mlp()
    optimizer = build_optimizer(param_groups(model), ADAMW, groups, zero=zero,
                                bucket_bytes=SMALL_BUCKET_BYTES)
    losses = train_steps(model, optimizer, groups, range(3))
    state = optimizer.state_dict()
    assert all(torch.is_tensor(v) for v in state.values())
    resumed_model = mlp(seed=1)
    if zero == 0:
        # zero=0 keeps no master weights: the model's own checkpoint restores them.
        resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(param_groups(resumed_model), ADAMW, groups, zero=zero,
                              bucket_bytes=SMALL_BUCKET_BYTES)
    resumed.load_state_dict(state)
    losses += train_steps(resumed_model, resumed, groups, range(3, STEPS))
    assert losses == uninterrupted_losses
    assert all(torch.equal(p, q) for p, q in zip(resumed_model.parameters(), uninterrupted.parameters()))
    return 0.0


def check_zero0_resume_is_exact() -> float:
    return _check_resume(zero=0)


def check_zero1_resume_is_exact() -> float:
    return _check_resume(zero=1)


def check_zero1_refuses_a_checkpoint_of_another_layout() -> str:
    groups = _groups()
    state = build_optimizer(mlp().parameters(), ADAMW, groups, zero=1).state_dict()
    other = build_optimizer(mlp().parameters(), ADAMW, groups, zero=1,
                            bucket_bytes=SMALL_BUCKET_BYTES)
    with pytest.raises(ValueError, match="layout.shard_numels") as error:
        other.load_state_dict(state)
    return str(error.value)


def check_zero1_holds_one_shard_of_state() -> int:
    groups = _groups()
    model = mlp()
    optimizer = build_optimizer(model.parameters(), ADAMW, groups, zero=1)
    train_steps(model, optimizer, groups, range(1))
    exp_avg = [v for k, v in optimizer.state_dict().items() if k.endswith("exp_avg")]
    shard = sum(t.numel() for t in exp_avg)
    assert shard == -(-66 // groups.mesh.dp), shard
    return shard


CHECKS = [
    check_one_bucket,
    check_small_padded_buckets,
    check_zero0_buckets_reduce_during_the_last_backward,
    check_zero1_buckets_reduce_scatter_during_the_last_backward,
    check_zero0_resume_is_exact,
    check_zero1_resume_is_exact,
    check_zero1_refuses_a_checkpoint_of_another_layout,
    check_zero1_holds_one_shard_of_state,
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"dp{n}")
def outcomes(request: pytest.FixtureRequest):
    return run_checks(request.param, CHECKS)


@pytest.mark.distributed
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_distributed(outcomes, check) -> None:
    outcomes.assert_passed(check)


def test_one_process_zero1_is_adamw_to_the_bit() -> None:
    """With groups of one (no process group), ZeRO-1 is a flat AdamW over the same elements."""
    groups = init_process_groups(MeshShape())
    model, plain = mlp(), mlp()
    optimizer = build_optimizer(model.parameters(), ADAMW, groups, zero=1,
                                bucket_bytes=SMALL_BUCKET_BYTES)
    torch_optimizer = ADAMW(plain.parameters())
    for step in range(3):
        inputs, targets = batch(step)
        for net, opt in ((model, optimizer), (plain, torch_optimizer)):
            opt.zero_grad()
            nn.functional.mse_loss(net(inputs), targets).backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_zero_level_is_checked() -> None:
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3, got 4"):
        build_optimizer(mlp().parameters(), ADAMW, init_process_groups(MeshShape()), zero=4)
    with pytest.raises(ValueError, match="zero=3 gathers parameters per unit"):
        build_optimizer(mlp().parameters(), ADAMW, init_process_groups(MeshShape()), zero=3)
