"""The learning-rate schedule of a training run: linear warmup, then cosine, linear or no decay.

Input: the schedule section of the config, the number of steps, the torch optimizer. Output: a
torch `LambdaLR` (so `pm.save(..., extras={"lr_scheduler": schedule})` keeps its position, and
any user of torch schedulers reads it as one) whose factor at step s is `lr_factor(s, ...)`.

The shape is Megatron's and torchtitan's: step s (0-based, the step about to run) uses
lr * (s + 1) / warmup during warmup, then decays from lr to lr * min_lr_ratio over the remaining
steps; after the last step it stays at the minimum.
"""
from __future__ import annotations

import functools
import math

import torch


def lr_factor(step: int, *, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """The multiple of the peak learning rate that step `step` (0-based) runs at."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay must be cosine, linear or constant, got {decay!r}")
    return min_ratio + (1.0 - min_ratio) * shape


def make_schedule(optimizer: torch.optim.Optimizer, *, warmup: int, total: int, decay: str,
                  min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` following `lr_factor` (step it once after each optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, warmup=warmup, total=total, decay=decay, min_ratio=min_ratio))
