"""The zero=0 optimizer: full optimizer state on every data-parallel rank.

Input: local parameters (or parameter groups), a torch optimizer factory such as
`functools.partial(torch.optim.AdamW, lr=3e-4)`, `ProcessGroups` and parameter placements.
Output: `step()` = data-parallel gradient sync -> optional global-norm clipping -> the torch
optimizer's step; every replica applies the same update to the same averaged gradients.

Invariants: call `step()` once per global batch, after the backward of the last
micro-batch; `zero_grad()` between steps (it keeps the gradients as bucket views).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from mplan.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradientSync
from mplan.runtime.grad_clip import replicated_grad_norm, step_clipped
from mplan.runtime.optimizer_state import (
    ParamsArg,
    as_param_groups,
    flatten_optimizer_state,
    unflatten_optimizer_state,
)
from mplan.runtime.param_placement import Placements
from mplan.runtime.process_groups import ProcessGroups

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""Called with a list of parameter groups; e.g. functools.partial(torch.optim.AdamW, lr=...)."""


class ReplicatedOptimizer:
    """Data-parallel all-reduce of gradients followed by any torch optimizer (zero=0)."""

    def __init__(
        self,
        params: ParamsArg,
        optimizer: OptimizerFactory,
        groups: ProcessGroups,
        *,
        placements: Placements | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        param_groups = as_param_groups(params)
        self.params = [p for group in param_groups for p in group["params"]]
        self.groups, self.placements = groups, placements
        self.grad_sync = GradientSync(
            self.params, groups, placements=placements, bucket_bytes=bucket_bytes
        )
        self.optimizer = optimizer(param_groups)
        """The torch optimizer; attach learning-rate schedulers to it."""

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()

    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """Synchronize gradients, clip them if asked, update; returns the global norm if clipped."""
        self.grad_sync.sync_gradients()
        if max_grad_norm is None:
            self.optimizer.step()
            return None
        params = self.grad_sync.params
        norm = replicated_grad_norm(params, self.groups, placements=self.placements)
        step_clipped(self.optimizer, (p.grad for p in params if p.grad is not None), max_grad_norm, norm)
        return norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The optimizer state as tensors only (identical on every data-parallel replica)."""
        return flatten_optimizer_state(self.optimizer.state_dict())

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.optimizer.load_state_dict(
            unflatten_optimizer_state(state, self.optimizer.state_dict())
        )
