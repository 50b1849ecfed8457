"""Global-norm clipping and training on a TP2 x DP2 mesh against one process (gloo, float64).

The model is a pre-norm MLP block, y = x + W2 gelu(W1 LN(x) + b1) + b2, sharded Megatron-style:
W1/b1 column-parallel and W2 row-parallel (TP-sharded), LN and b2 replicated. Without
sequence parallelism the replicated parameters get full gradients on every TP rank and must
be counted once in the norm; with it, LN and b2 see only their sequence shard and are
flagged `tp_reduce`. Both must give torch's `clip_grad_norm_` of the single-device model.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from distributed import rel_err, run_checks
from mplan.collectives.redistribute import (
    copy_to_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
)
from mplan.runtime.data_parallel import GradientSync
from mplan.runtime.grad_clip import clip_grad_norm_
from mplan.ir.mesh import MeshShape
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.param_placement import ParamPlacement
from mplan.runtime.process_groups import ProcessGroups, init_process_groups

SEQ, BATCH, HIDDEN, FFN = 4, 4, 6, 8
MAX_NORM, STEPS, MICRO_BATCHES = 0.5, 4, 2
ADAMW = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)
SHARD_DIM = {"w1": 0, "b1": 0, "w2": 1}
"""TP-sharded parameters and the dim they are split on; the others are replicated."""


def _full_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "ln_w": 1 + 0.1 * torch.randn(HIDDEN, generator=gen), "ln_b": torch.randn(HIDDEN, generator=gen),
        "w1": torch.randn(FFN, HIDDEN, generator=gen), "b1": torch.randn(FFN, generator=gen),
        "w2": torch.randn(HIDDEN, FFN, generator=gen), "b2": torch.randn(HIDDEN, generator=gen),
    }


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=gen), torch.randn(SEQ, BATCH, HIDDEN, generator=gen)


def _block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.layer_norm(x, (HIDDEN,), p["ln_w"], p["ln_b"])
    return x + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"]) + p["b2"]


def _parallel_block(x: torch.Tensor, p: dict[str, torch.Tensor], groups: ProcessGroups,
                    sequence_parallel: bool) -> torch.Tensor:
    """The block on local shards; `x` is sequence-sharded when `sequence_parallel`."""
    h = F.layer_norm(x, (HIDDEN,), p["ln_w"], p["ln_b"])
    h = gather_sequence(h, groups.tp, dim=0) if sequence_parallel else copy_to_region(h, groups.tp)
    partial = F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"])
    out = (reduce_scatter_sequence(partial, groups.tp, dim=0) if sequence_parallel
           else reduce_from_region(partial, groups.tp))
    return x + out + p["b2"]


def _local_params(groups: ProcessGroups, sequence_parallel: bool):
    params, placements = {}, {}
    for name, value in _full_params().items():
        if name in SHARD_DIM:
            value = value.chunk(groups.mesh.tp, SHARD_DIM[name])[groups.tp_rank]
        params[name] = value.clone().requires_grad_(True)
        placements[params[name]] = ParamPlacement(
            tp_sharded=name in SHARD_DIM, tp_reduce=sequence_parallel and name not in SHARD_DIM)
    return params, placements


def _local_slice(x: torch.Tensor, groups: ProcessGroups, sequence_parallel: bool) -> torch.Tensor:
    x = x.chunk(groups.mesh.dp, 1)[groups.dp_rank]
    return x.chunk(groups.mesh.tp, 0)[groups.tp_rank] if sequence_parallel else x


def _shard(name: str, full: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    return full.chunk(groups.mesh.tp, SHARD_DIM[name])[groups.tp_rank] if name in SHARD_DIM else full


@functools.cache
def _groups() -> ProcessGroups:
    return init_process_groups(MeshShape(dp=2, tp=2))


def _check_clip(sequence_parallel: bool) -> dict[str, float]:
    groups = _groups()
    inputs, targets = _batch(0)
    reference = {k: v.requires_grad_(True) for k, v in _full_params().items()}
    F.mse_loss(_block(inputs, reference), targets).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.values(), MAX_NORM)
    assert ref_norm > MAX_NORM, "the test must exercise clipping"

    params, placements = _local_params(groups, sequence_parallel)
    x, y = (_local_slice(t, groups, sequence_parallel) for t in (inputs, targets))
    # mse over the local slice is the mean over this rank's share of the tokens; with
    # sequence parallelism the TP ranks' shards are disjoint, so the loss is summed over TP
    # (each TP rank's gradient is its shard's contribution) and averaged over DP by the sync.
    loss = F.mse_loss(_parallel_block(x, params, groups, sequence_parallel), y)
    (loss / groups.mesh.tp if sequence_parallel else loss).backward()
    sync = GradientSync(params.values(), groups, placements=placements)
    sync.sync_gradients()
    norm = clip_grad_norm_(params.values(), MAX_NORM, groups, placements=placements)
    errors = {"norm": rel_err(norm, ref_norm)}
    inf = float("inf")
    errors["inf_norm"] = rel_err(
        clip_grad_norm_(params.values(), inf, groups, placements=placements, norm_type=inf),
        torch.nn.utils.clip_grad_norm_(reference.values(), inf, norm_type=inf),
    )
    for name, param in params.items():
        errors[name] = rel_err(param.grad, _shard(name, reference[name].grad, groups))
    assert max(errors.values()) < 1e-12, errors
    return errors


def check_clip_tp2_dp2() -> dict[str, float]:
    return _check_clip(sequence_parallel=False)


def check_clip_tp2_dp2_sequence_parallel() -> dict[str, float]:
    return _check_clip(sequence_parallel=True)


def check_replicated_gradients_are_counted_once() -> float:
    """Counting the TP replicas on both TP ranks would give a larger norm: the check can fail."""
    groups = _groups()
    params, placements = _local_params(groups, sequence_parallel=False)
    inputs, targets = _batch(0)
    x, y = (_local_slice(t, groups, False) for t in (inputs, targets))
    F.mse_loss(_parallel_block(x, params, groups, False), y).backward()
    GradientSync(params.values(), groups, placements=placements).sync_gradients()
    every_rank_sharded = {p: ParamPlacement(tp_sharded=True) for p in params.values()}
    right = clip_grad_norm_(params.values(), float("inf"), groups, placements=placements)
    wrong = clip_grad_norm_(params.values(), float("inf"), groups, placements=every_rank_sharded)
    assert wrong > right * (1 + 1e-6)
    return (wrong / right).item()


def _check_training(zero: int, sequence_parallel: bool) -> float:
    groups = _groups()
    reference = {k: v.requires_grad_(True) for k, v in _full_params().items()}
    ref_optimizer = ADAMW(reference.values())
    params, placements = _local_params(groups, sequence_parallel)
    optimizer = build_optimizer(params.values(), ADAMW, groups, zero=zero, placements=placements)
    for step in range(STEPS):
        inputs, targets = _batch(step)
        ref_optimizer.zero_grad()
        F.mse_loss(_block(inputs, reference), targets).backward()
        torch.nn.utils.clip_grad_norm_(reference.values(), MAX_NORM)
        ref_optimizer.step()

        optimizer.zero_grad()
        x, y = (_local_slice(t, groups, sequence_parallel) for t in (inputs, targets))
        for x_micro, y_micro in zip(x.chunk(MICRO_BATCHES, 1), y.chunk(MICRO_BATCHES, 1)):
            loss = F.mse_loss(_parallel_block(x_micro, params, groups, sequence_parallel), y_micro)
            scale = MICRO_BATCHES * (groups.mesh.tp if sequence_parallel else 1)
            (loss / scale).backward()
        optimizer.step(max_grad_norm=MAX_NORM)
    errors = [rel_err(params[n], _shard(n, reference[n], groups)) for n in params]
    assert max(errors) < 1e-9, errors
    return max(errors)


def check_training_zero0() -> float:
    return _check_training(zero=0, sequence_parallel=False)


def check_training_zero1_sequence_parallel() -> float:
    return _check_training(zero=1, sequence_parallel=True)


def check_training_zero0_sequence_parallel() -> float:
    return _check_training(zero=0, sequence_parallel=True)


CHECKS = [
    check_clip_tp2_dp2,
    check_clip_tp2_dp2_sequence_parallel,
    check_replicated_gradients_are_counted_once,
    check_training_zero0,
    check_training_zero0_sequence_parallel,
    check_training_zero1_sequence_parallel,
]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(4, CHECKS)


@pytest.mark.distributed
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_tp2_dp2(outcomes, check) -> None:
    outcomes.assert_passed(check)


# -- clipping folded into fused Adam/AdamW (one process) --------------------------------------------

def test_fused_adamw_takes_the_clip_coefficient_as_its_grad_scale() -> None:
    """step_clipped on fused AdamW (fp32) updates exactly as clip_grad_norm_ then step, and leaves
    the gradients clipped; float64 or non-fused optimizers are clipped the ordinary way."""
    from mplan.runtime.grad_clip import folds_clipping, step_clipped

    torch.manual_seed(0)
    weights = [torch.randn(37, 5), torch.randn(11)]
    grads = [10 * torch.randn_like(w) for w in weights]
    runs = []
    for folded in (False, True):
        params = [w.clone().requires_grad_() for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
        for step in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (step + 1)
            if folded:
                assert folds_clipping(optimizer)
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in
                                                             (p.grad for p in params)]))
                step_clipped(optimizer, (p.grad for p in params), 1.0, norm.double())
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
        assert not hasattr(optimizer, "grad_scale")
        runs.append(params)
    for plain, folded in zip(*runs):
        assert rel_err(folded, plain) < 1e-6 and rel_err(folded.grad, plain.grad) < 1e-6
    assert not folds_clipping(torch.optim.AdamW([torch.zeros(2, dtype=torch.float64, requires_grad=True)],
                                                fused=True))
    assert not folds_clipping(torch.optim.AdamW([torch.zeros(2, requires_grad=True)]))
