"""The zero=0 optimizer: full optimizer state on every data-parallel rank.

Input: local parameters (or parameter groups), a torch optimizer factory such as
`functools.partial(torch.optim.AdamW, lr=3e-4)`, `ProcessGroups` and parameter placements.
Output: `step()` = data-parallel gradient sync -> optional global-norm clipping -> the torch
optimizer's step (a torch Adam/AdamW by mplan's multi-tensor kernel where `adamw.applies`);
every replica applies the same update to the same averaged gradients.

Compute copies (`compute_copies.py`, autocast runs): parameters that have one keep their
gradient on the copy, outside the gradient buckets (they are given copies only when their
gradient needs no collective).

Invariants: call `step()` once per global batch, after the backward of the last
micro-batch; `zero_grad()` between steps (it keeps the gradients as bucket views).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.kernels import adamw
from mplan.runtime.compute_copies import ComputeCopies
from mplan.runtime.data_parallel import GradientSync
from mplan.runtime.grad_clip import replicated_grad_norm, step_clipped, step_unclipped
from mplan.runtime.optimizer_state import (
    ParamsArg,
    StateRange,
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
        copies: ComputeCopies | None = None,
    ) -> None:
        param_groups = as_param_groups(params)
        self.params = [p for group in param_groups for p in group["params"]]
        self.groups, self.placements, self.copies = groups, placements, copies
        # a parameter with a compute copy gets its gradient there, and needs no collective
        self.grad_sync = GradientSync(
            [p for p in self.params if copies is None or copies.of(p) is p], groups, placements=placements,
            bucket_bytes=bucket_bytes,
        )
        self.optimizer = optimizer(param_groups)
        """The torch optimizer; attach learning-rate schedulers to it."""

    def before_last_backward(self) -> None:
        """The step's last backward comes next: buckets start reducing as they complete."""
        self.grad_sync.arm()

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()
        if self.copies is not None:
            self.copies.zero_grad()

    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """Synchronize gradients, clip them if asked, update; returns the global norm if clipped.

        With compute copies, mplan's AdamW reads their gradients and rewrites them as it updates
        the masters; any other optimizer gets the gradients widened onto the masters, and the
        copies are refreshed after its step."""
        self.grad_sync.sync_gradients()
        copies, by_kernel = self.copies, adamw.applies(self.optimizer)
        if copies is not None:
            copies.fill_missing_grads()
            if not by_kernel:
                copies.widen_grads()
        linked = copies.copies if copies is not None and by_kernel else None
        norm = None
        if max_grad_norm is None:
            step_unclipped(self.optimizer, copies=linked)
        else:
            grad_of = copies.grad_of if linked is not None else (lambda p: p.grad)
            norm = replicated_grad_norm(self.params, self.groups, placements=self.placements, grad_of=grad_of)
            grads = [grad for grad in map(grad_of, self.params) if grad is not None]
            step_clipped(self.optimizer, grads, max_grad_norm, norm, copies=linked)
        if copies is not None and not by_kernel:
            copies.refresh()
        return norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The optimizer state as tensors only (identical on every data-parallel replica)."""
        return flatten_optimizer_state(self.optimizer.state_dict())

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.optimizer.load_state_dict(
            unflatten_optimizer_state(state, self.optimizer.state_dict())
        )

    def state_ranges(self) -> list[StateRange]:
        """Every parameter's state is whole, in the parameter's own entry of the torch optimizer."""
        return [StateRange(param=p, holder=p, start=0, stop=p.numel(), at=0) for p in self.params]

    def params_loaded(self) -> None:
        if self.copies is not None:
            self.copies.refresh()

    def sharded_params(self) -> None:
        """The parameters are held whole (see `DistributedOptimizer.sharded_params`)."""
        return None

    def parameters_whole(self) -> contextlib.AbstractContextManager[None]:
        """The parameters are always whole here."""
        return contextlib.nullcontext()
