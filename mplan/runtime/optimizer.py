"""The training-step interface over data parallelism, and the choice of zero level.

Input: the plan's `zero` setting, local parameters, a torch optimizer factory, groups and
placements. Output: a `DistributedOptimizer` whose `step()` turns the gradients accumulated
over a global batch's micro-batches into one update, equal to the single-device update.

    zero=0  ReplicatedOptimizer  all-reduce gradients; full optimizer state on every rank
    zero=1  ShardedOptimizer     reduce-scatter; state and fp32 masters sharded over DP
    zero=2  ShardedOptimizer     and gradients: reduce-scattered in every micro-batch's backward
    zero=3  FullyShardedOptimizer  and parameters: gathered per unit (fully_sharded.py)

They are interchangeable: same methods, same results (float64: relative error < 1e-12).
"""
from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch

from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.runtime.compute_copies import ComputeCopies
from mplan.runtime.fully_sharded import FullyShardedOptimizer
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

    def sharded_params(self) -> list[StateRange] | None:
        """zero=3: where this rank keeps the elements of each parameter it holds (flat ranges of its
        shards, in the parameters' dtype); None where `pm.params` hold the local tensors whole."""
        ...

    def parameters_whole(self) -> contextlib.AbstractContextManager[None]:
        """A context inside which every parameter is whole (zero=3 gathers them all, and on exit
        takes back into its shards what was written to them); a no-op below zero=3."""
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
    summed_first: Collection[torch.Tensor] = (),
    units: Sequence[Sequence[torch.Tensor]] | None = None,
    keep_gathered: bool = False,
) -> DistributedOptimizer:
    """The data-parallel optimizer for a plan's `zero` level (0 to 3); `copies` (compute copies
    of some parameters, `compute_copies.py`) only with zero=0. zero>=2: `summed_first`, the
    parameters whose gradient is first summed with other pipeline ranks' copies (reduced at the
    step). zero=3: `units`, the parameters each unit of the program reads, in forward order
    (`unit_gathers.py`), and `keep_gathered` (pipelines: gathered once per step)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if copies is not None and zero != 0:
        raise ValueError("compute copies are kept by the zero=0 optimizer only")
    if zero == 3:
        if units is None:
            raise ValueError("zero=3 gathers parameters per unit: give the program's units")
        return FullyShardedOptimizer(params, optimizer, groups, placements=placements, units=units,
                                     summed_first=summed_first, keep_gathered=keep_gathered)
    if zero in (1, 2):
        return ShardedOptimizer(params, optimizer, groups, placements=placements, bucket_bytes=bucket_bytes,
                                shard_gradients=zero == 2, summed_first=summed_first)
    return ReplicatedOptimizer(params, optimizer, groups, placements=placements, bucket_bytes=bucket_bytes,
                               copies=copies)
