"""The zero=1 optimizer (ZeRO stage 1, Megatron's distributed optimizer).

Input: local parameters (or parameter groups), an element-wise torch optimizer factory such
as `functools.partial(torch.optim.AdamW, lr=3e-4)`, `ProcessGroups` and placements.
Output: `step()` = reduce-scatter of the averaged gradients -> optional global-norm clipping
-> the torch optimizer's update of this rank's shard of master weights (a torch Adam/AdamW by
mplan's multi-tensor kernel where `adamw.applies`) -> all-gather of the updated shards into
the model's parameters. Optimizer state and master weights exist only for the shard: 1/dp of
them per rank.

Overlap: `before_last_backward()` arms `ReductionStarts` (data_parallel.py), so that during the
last micro-batch's backward each bucket starts its reduce-scatter as soon as its last gradient
lands, buckets in reverse layout order (the order backward completes them); the rest start at
`step()`.

Layout: parameters of one group, placement, dtype and device form a *partition*. Its
parameters are laid end to end and cut into buckets at parameter boundaries (at most
`bucket_bytes` each, a larger parameter alone); each bucket is zero-padded to a multiple of
the replica count n and rank r owns elements [r*s, (r+1)*s) of it (s = padded size / n). The
rank's slices of all buckets, concatenated, are the partition's *shard*: one flat tensor of
master weights (the parameter dtype promoted to at least float32, so bf16 models keep fp32
masters and float64 stays float64), which the torch optimizer sees as a single parameter.

    bucket 0: [ r0 | r1 | r2 | r3 ]   bucket 1: [ r0 | r1 | r2 | r3 ]   (each padded)
    shard of rank 1 = bucket0[r1] ++ bucket1[r1]

Why this is exact: Adam(W), SGD and the like update every element from its own gradient and
state only, so updating a flat shard equals updating the corresponding elements of the
whole parameters. Optimizers with per-tensor quantities (LAMB, Adafactor, Muon) are not
element-wise and must not be sharded this way (use zero=0).

Invariants:
- Replicas hold the same parameters in the same order, so layouts (and collectives) match.
- Padding elements have zero gradient and zero master weight and are never gathered.
- Gradients are divided by `mesh.dp` and summed over replicas (see `param_placement.py`),
  reduced in the master dtype; `tp_reduce` gradients are first summed over TP.
- A parameter without a gradient is stepped with a zero gradient, as in `data_parallel.py`.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mplan.collectives.flat import all_gather_flat, reduce_scatter_flat
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.runtime.data_parallel import (
    ReductionStarts,
    all_reduce_tp_partials,
    group_by_reduction,
    split_into_buckets,
    unique_trainable,
)
from mplan.runtime.grad_clip import global_grad_norm, step_clipped, step_unclipped
from mplan.runtime.optimizer_state import (
    ParamsArg,
    StateRange,
    as_param_groups,
    flatten_optimizer_state,
    unflatten_optimizer_state,
)
from mplan.runtime.param_placement import ParamPlacement, Placements, counts_in_norm, replica_group
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups, group_rank, group_size
from mplan.runtime.replicated_optimizer import OptimizerFactory


@dataclass(frozen=True, kw_only=True, slots=True)
class _Bucket:
    params: tuple[torch.Tensor, ...]
    numel: int
    """Elements of its parameters, before padding."""
    shard_numel: int
    """Elements each replica owns: padded size / number of replicas."""
    shard_offset: int
    """Where this rank's slice of the bucket sits in the partition's shard."""

    @property
    def in_shard(self) -> slice:
        """This rank's slice of the bucket, as a range of the partition's shard."""
        return slice(self.shard_offset, self.shard_offset + self.shard_numel)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Partition:
    placement: ParamPlacement
    group: ProcessGroup | None
    buckets: tuple[_Bucket, ...]
    master: torch.nn.Parameter
    """This rank's shard of master weights; its `.grad` receives the reduce-scatter."""

    @property
    def num_replicas(self) -> int:
        return group_size(self.group)


def _make_partition(
    params: list[torch.Tensor], placement: ParamPlacement, groups: ProcessGroups, bucket_bytes: int
) -> _Partition:
    group = replica_group(placement, groups)
    n, rank = group_size(group), group_rank(group)
    buckets, offset = [], 0
    for members in split_into_buckets(params, bucket_bytes):
        numel = sum(p.numel() for p in members)
        shard_numel = -(-numel // n)
        buckets.append(_Bucket(params=tuple(members), numel=numel,
                               shard_numel=shard_numel, shard_offset=offset))
        offset += shard_numel
    master_dtype = torch.promote_types(params[0].dtype, torch.float32)
    master = torch.zeros(offset, dtype=master_dtype, device=params[0].device)
    for bucket in buckets:
        padded = _flatten_padded(list(bucket.params), bucket.shard_numel * n, master_dtype)
        master[bucket.in_shard] = padded[rank * bucket.shard_numel:(rank + 1) * bucket.shard_numel]
    shard = torch.nn.Parameter(master)
    shard.grad = torch.zeros_like(master)
    return _Partition(placement=placement, group=group, buckets=tuple(buckets), master=shard)


def _flatten_padded(tensors: list[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(size, dtype=dtype, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()] = tensor.detach().reshape(-1)
        offset += tensor.numel()
    return flat


@torch.no_grad()
def _start_reduce_scatter(groups: ProcessGroups, slots: list[tuple[_Partition, _Bucket]],
                          index: int) -> dist.Work | None:
    """Slot `index`: TP sum of partial gradients (if any), then the bucket's reduce-scatter into
    its slice of the master gradient (asynchronous over more than one replica)."""
    part, bucket = slots[index]
    grads = [p.grad for p in bucket.params]
    if part.placement.tp_reduce:
        all_reduce_tp_partials(grads, groups)
    n = part.num_replicas
    flat = _flatten_padded(grads, bucket.shard_numel * n, part.master.dtype)
    if groups.mesh.dp > 1:
        flat.div_(groups.mesh.dp)  # before the sum, as data_parallel.py explains
    shard_grad = part.master.grad[bucket.in_shard]
    if n > 1:  # the work keeps `flat` alive until it completes (c10d holds its tensors)
        return reduce_scatter_flat(shard_grad, flat, group=part.group, async_op=True)
    shard_grad.copy_(flat)
    return None


class ShardedOptimizer:
    """ZeRO-1: gradients reduce-scattered, optimizer state and fp32 masters sharded over DP."""

    def __init__(
        self,
        params: ParamsArg,
        optimizer: OptimizerFactory,
        groups: ProcessGroups,
        *,
        placements: Placements | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.groups = groups
        self._partitions: list[_Partition] = []
        inner_groups = []
        for param_group in as_param_groups(params):
            members = unique_trainable(param_group["params"])
            partitions = [
                _make_partition(keyed, placement, groups, bucket_bytes)
                for (placement, _, _), keyed in group_by_reduction(members, placements).items()
            ]
            self._partitions += partitions
            options = {k: v for k, v in param_group.items() if k != "params"}
            inner_groups.append({**options, "params": [p.master for p in partitions]})
        self.params = [p for part in self._partitions for b in part.buckets for p in b.params]
        self.optimizer = optimizer(inner_groups)
        """The torch optimizer over the shards; attach learning-rate schedulers to it."""
        # (partition, bucket) slots in the order backward completes them: the reverse of the layout
        self._slots = [(part, bucket) for part in reversed(self._partitions) for bucket in reversed(part.buckets)]
        self._starts = ReductionStarts([bucket.params for _, bucket in self._slots],
                                       functools.partial(_start_reduce_scatter, groups, self._slots))

    @property
    def started_in_backward(self) -> int:
        """Buckets of the last step whose reduce-scatter backward started (the rest waited for the step)."""
        return self._starts.started_in_backward

    def before_last_backward(self) -> None:
        """The step's last backward comes next: buckets start reduce-scattering as they complete."""
        self._starts.arm()

    def zero_grad(self) -> None:
        self._starts.wait()  # a step that failed after arming may have reduce-scatters in flight
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """Reduce-scatter gradients, clip if asked, update the shard, all-gather parameters.

        Collective over the world when clipping (the norm), else over TP and DP. Returns the
        global gradient norm when clipping.
        """
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._starts.start_rest_and_wait()
        norm = None
        if max_grad_norm is None:
            step_unclipped(self.optimizer)
        else:
            norm = global_grad_norm(
                (part.master.grad for part in self._partitions
                 if counts_in_norm(part.placement, self.groups, dp_sharded=True)),
                self.groups,
                device=self._partitions[0].master.device,
            )
            step_clipped(self.optimizer, (part.master.grad for part in self._partitions), max_grad_norm, norm)
        for part in self._partitions:
            self._all_gather_params(part)
        return norm

    @staticmethod
    def _all_gather_params(part: _Partition) -> None:
        n = part.num_replicas
        for bucket in part.buckets:
            dtype = bucket.params[0].dtype
            # Gather in the parameters' dtype: the model needs nothing finer, and bf16 halves
            # the traffic of fp32 masters.
            local = part.master.detach()[bucket.in_shard].to(dtype)
            if n > 1:
                full = torch.empty(bucket.shard_numel * n, dtype=dtype, device=local.device)
                all_gather_flat(full, local, group=part.group)
            else:
                full = local
            offset = 0
            for param in bucket.params:
                param.copy_(full[offset:offset + param.numel()].view_as(param))
                offset += param.numel()

    def state_ranges(self) -> list[StateRange]:
        """This rank's slice of each bucket, cut at parameter boundaries: the elements of each
        parameter whose state and master weights it keeps, and where they sit in the shard."""
        out = []
        for part in self._partitions:
            rank = group_rank(part.group)
            for bucket in part.buckets:
                own, start = slice(rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel), 0
                for param in bucket.params:
                    lo, hi = max(start, own.start), min(start + param.numel(), own.stop)
                    if lo < hi:
                        out.append(StateRange(param=param, holder=part.master, start=lo - start, stop=hi - start,
                                              at=bucket.shard_offset + lo - own.start))
                    start += param.numel()
        return out

    @torch.no_grad()
    def params_loaded(self) -> None:
        """Master weights from the (just loaded) parameters, as the constructor takes them."""
        for part in self._partitions:
            rank = group_rank(part.group)
            for bucket in part.buckets:
                padded = _flatten_padded(list(bucket.params), bucket.shard_numel * part.num_replicas,
                                         part.master.dtype)
                part.master[bucket.in_shard] = padded[rank * bucket.shard_numel:(rank + 1) * bucket.shard_numel]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard: optimizer state, master weights and the layout it assumes.

        Tensors only. Each data-parallel rank saves its own; a checkpoint loads into the same
        mesh and parameter layout (the layout tensors are checked on load).
        """
        state = flatten_optimizer_state(self.optimizer.state_dict())
        for index, part in enumerate(self._partitions):
            state[f"master.{index}"] = part.master.detach()
        state["layout.shard_numels"] = torch.tensor([p.master.numel() for p in self._partitions])
        state["layout.num_replicas"] = torch.tensor([p.num_replicas for p in self._partitions])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore a shard saved by `state_dict` and all-gather the masters into the model's
        parameters (collective over DP), so the model matches the restored masters exactly."""
        saved = {k: v for k, v in state.items() if not k.startswith(("master.", "layout."))}
        for name, live in (("shard_numels", [p.master.numel() for p in self._partitions]),
                           ("num_replicas", [p.num_replicas for p in self._partitions])):
            if state[f"layout.{name}"].tolist() != live:
                raise ValueError(
                    f"layout.{name}: the checkpoint has {state[f'layout.{name}'].tolist()}, "
                    f"this optimizer {live}; a sharded checkpoint loads only into the same "
                    f"mesh and model"
                )
        for index, part in enumerate(self._partitions):
            part.master.copy_(state[f"master.{index}"])
        live = self.optimizer.state_dict()
        self.optimizer.load_state_dict(unflatten_optimizer_state(saved, live))
        for part in self._partitions:
            self._all_gather_params(part)
