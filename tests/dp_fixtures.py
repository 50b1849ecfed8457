"""The small MLP that the data-parallel optimizer tests train, and its one-process reference.

Shared by test_runtime_data_parallel.py (flat data parallelism, ZeRO-1) and
test_hierarchical_dp.py (the same over 2 sites): both train `mlp()` for `STEPS` AdamW steps with
two parameter groups and global-norm clipping on `batch(step)`, each rank on its rows of the global
batch in `MICRO_BATCHES` micro-batches (`train_steps`), and compare the losses and the final
parameters with `reference()`, the same model trained on the whole batch in one process, by
`max_rel_err`.

The MLP has 66 parameters (35, 7, 21 and 3 elements): not divisible by 4 or 8, and in 100-byte
buckets not by 2 either, so ZeRO's padding is exercised at every world size. A global batch of
16 rows gives each of up to 8 ranks one row per micro-batch. Plain functions, no process group:
each test module starts its own (tests/distributed.py) and calls these inside its checks.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from distributed import rel_err
from mplan.runtime.process_groups import ProcessGroups

STEPS, MICRO_BATCHES, GLOBAL_BATCH, MAX_NORM = 5, 2, 16, 0.5
SMALL_BUCKET_BYTES = 100
"""Buckets of one or two parameters: several per step, of odd sizes."""
ADAMW = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)
TO_REFERENCE = 1e-9
"""Largest relative error against one process (observed: ~1e-15)."""


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def param_groups(model: nn.Module) -> list[dict]:
    """Weights with weight decay, biases without: two groups, as real training has."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: inputs and regression targets."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


@functools.cache
def reference() -> tuple[list[float], list[float], nn.Module]:
    """`mlp()` trained on the whole batch in one process: each step's loss and gradient norm
    (before clipping), and the trained model. Clipping engages at the first step."""
    model = mlp()
    optimizer = ADAMW(param_groups(model))
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        losses.append(loss.item())
    assert norms[0] > MAX_NORM, "the test must exercise clipping"
    return losses, norms, model


def train_steps(model: nn.Module, optimizer, groups: ProcessGroups, steps: range) -> list[float]:
    """Train on this rank's rows of each global batch, in micro-batches with gradient
    accumulation (the last backward announced, so buckets reduce during it); the global losses."""
    dp, rank = groups.mesh.dp, groups.dp_rank
    local = GLOBAL_BATCH // dp
    losses = []
    for step in steps:
        inputs, targets = (t[rank * local:(rank + 1) * local] for t in batch(step))
        optimizer.zero_grad()
        local_loss = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES))):
            loss = nn.functional.mse_loss(model(x), y) / MICRO_BATCHES
            if i == MICRO_BATCHES - 1:
                optimizer.before_last_backward()
            loss.backward()
            local_loss += loss.detach()
        optimizer.step(max_grad_norm=MAX_NORM)
        dist.all_reduce(local_loss)
        losses.append(local_loss.item() / dp)
    return losses


def max_rel_err(losses: list[float], model: nn.Module, other_losses: list[float], other: nn.Module) -> float:
    """The largest relative error of the losses (as one vector) and of any parameter."""
    errors = [rel_err(torch.tensor(losses), torch.tensor(other_losses))]
    errors += [rel_err(p.detach(), q.detach()) for p, q in zip(model.parameters(), other.parameters())]
    return max(errors)
