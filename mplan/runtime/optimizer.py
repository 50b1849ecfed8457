"""The training-step interface over data parallelism, and the choice of zero=0 or zero=1.

Input: the plan's `zero` setting, local parameters, a torch optimizer factory, groups and
placements. Output: a `DistributedOptimizer` whose `step()` turns the gradients accumulated
over a global batch's micro-batches into one update, equal to the single-device update.

    zero=0  ReplicatedOptimizer  all-reduce gradients; full optimizer state on every rank
    zero=1  ShardedOptimizer     reduce-scatter; state and fp32 masters sharded over DP

The two are interchangeable: same methods, same results (float64: relative error < 1e-12).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.runtime.compute_copies import ComputeCopies
from mplan.runtime.optimizer_state import ParamsArg, StateRange
from mplan.runtime.param_placement import Placements
from mplan.runtime.process_groups import ProcessGroups
from mplan.runtime.replicated_optimizer import OptimizerFactory, ReplicatedOptimizer
from mplan.runtime.sharded_optimizer import ShardedOptimizer


class DistributedOptimizer(Protocol):
    optimizer: torch.optim.Optimizer
    """The underlying torch optimizer, for learning-rate schedulers."""

    def zero_grad(self) -> None: ...

    def before_last_backward(self) -> None:
        """Called before the step's last backward (gradient reductions may start during it)."""
        ...

    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """Reduce gradients over replicas, clip by the global norm if asked, update."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def state_ranges(self) -> list[StateRange]:
        """Where this rank keeps the optimizer state of each parameter it owns elements of."""
        ...

    def params_loaded(self) -> None:
        """The parameters were overwritten (a checkpoint load): re-derive what is kept from them
        (ZeRO-1's master weights, compute copies)."""
        ...


def build_optimizer(
    params: ParamsArg,
    optimizer: OptimizerFactory,
    groups: ProcessGroups,
    *,
    zero: int = 0,
    placements: Placements | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    copies: ComputeCopies | None = None,
) -> DistributedOptimizer:
    """The data-parallel optimizer for a plan's `zero` level (0 or 1); `copies` (compute copies
    of some parameters, `compute_copies.py`) only with zero=0."""
    if zero not in (0, 1):
        raise ValueError(f"zero must be 0 or 1, got {zero!r}")
    if zero == 1:
        if copies is not None:
            raise ValueError("compute copies are kept by the zero=0 optimizer only")
        return ShardedOptimizer(params, optimizer, groups, placements=placements, bucket_bytes=bucket_bytes)
    return ReplicatedOptimizer(params, optimizer, groups, placements=placements, bucket_bytes=bucket_bytes,
                               copies=copies)
