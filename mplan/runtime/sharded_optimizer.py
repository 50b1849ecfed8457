"""The zero=1 and zero=2 optimizers (ZeRO stages 1 and 2; Megatron's distributed optimizer).

Input: local parameters (or parameter groups), an element-wise torch optimizer factory such as
`functools.partial(torch.optim.AdamW, lr=3e-4)`, `ProcessGroups` and placements.
Output: `step()` = reduce-scatter of the averaged gradients -> optional global-norm clipping
-> the torch optimizer's update of this rank's shard of master weights (a torch Adam/AdamW by
mplan's multi-tensor kernel where `adamw.applies`) -> all-gather of the updated shards into
the model's parameters. Optimizer state and master weights exist only for the shard: 1/dp of
them per rank.

    zero=1  gradients accumulate whole in `.grad` over the step's micro-batches; each bucket is
            reduce-scattered once, during the last backward (`before_last_backward()` arms
            `ReductionStarts`, data_parallel.py) or at `step()`.
    zero=2  (`shard_gradients`) each bucket is reduce-scattered in EVERY micro-batch's backward
            as soon as its gradients are complete, added into the shard's gradient (master
            dtype), and the parameters' `.grad` is dropped at once: whole gradients live only
            from a bucket's first gradient to its reduce-scatter, never across micro-batches.

zero=2's order: buckets start strictly in a fixed cyclic order (the reverse of the layout, the
order backward completes them), so every replica issues the same collectives in the same
sequence; a bucket starts once each of its parameters received a gradient since its last start.
A bucket whose gradient never comes (an unused parameter) holds the pointer: it and the buckets
after it keep accumulating in `.grad` until `step()` reduces every bucket that holds any gradient,
in slot order. That costs memory, never exactness: each launch reduces exactly what `.grad`
holds since the previous one. Parameters whose gradient is summed with another pipeline rank's
copy first (`summed_first`: a tied embedding and head on two stages, `stage_copies.py`) keep
their `.grad` whole until `step()`, in partitions of their own.
At most `MAX_IN_FLIGHT` reduce-scatters are outstanding at every level (each holds its bucket's
flat gradient in the master dtype, and gloo a copy of it until the work is dropped): zero=1's too,
whose last backward would otherwise hold a copy of every bucket at once (`_Launches`).
The starts come from post-accumulate-grad hooks, i.e. from autograd's own accumulation: the
pipeline executor adds a stage's gradients into `.grad` itself (`split_backward.py`, for its
B/I/W split), so under a pipeline plan no hook fires and every bucket is reduced at `step()`,
its gradients whole over the step's micro-batches as under zero=1.

Layout: parameters of one group, placement, dtype and device form a *partition*. Its
parameters are laid end to end and cut into buckets at parameter boundaries (at most
`bucket_bytes` each, a larger parameter alone; or, given `units`, at unit borders, as zero=3
gathers them: fully_sharded.py); each bucket is zero-padded to a multiple of
the replica count n and rank r owns elements [r*s, (r+1)*s) of it (s = padded size / n). The
rank's slices of all buckets, concatenated, are the partition's *shard*: one flat tensor of
master weights (the parameter dtype promoted to at least float32, so bf16 models keep fp32
masters and float64 stays float64), which the torch optimizer sees as a single parameter.

    bucket 0: [ r0 | r1 | r2 | r3 ]   bucket 1: [ r0 | r1 | r2 | r3 ]   (each padded)
    shard of rank 1 = bucket0[r1] ++ bucket1[r1]

Why this is exact: Adam(W), SGD and the like update every element from its own gradient and
state only, so updating a flat shard equals updating the corresponding elements of the
whole parameters. Optimizers with per-tensor quantities (LAMB, Adafactor, Muon) are not
element-wise and must not be sharded this way (use zero=0). zero=2 sums over replicas per
micro-batch and then over micro-batches (zero=1: the other way round): equal up to the order
of float additions.

Across sites (`groups.sites > 1`, hierarchical_reduce.py): dense partitions shard over the
replicas inside this rank's site (`param_placement.shard_group`) and are replicated across
sites, as Megatron Core's partial distributed optimizer does. The bucket's reduce-scatter
inside the site is then followed by an all-reduce of its shard over the sites, once a step:
zero=1 posts it one bucket after the reduce-scatter (under the rest of the last backward);
zero>=2 once the micro-batches' reduce-scatters have summed the site's gradients into the
shard, i.e. when a reduce-scatter of the last backward (`before_last_backward()`) that read
every one of the bucket's gradients of that backward has been added in (the oldest in flight
is, when a third starts), else at `step()`, in slot order, after the others. The
all-gather of the updated parameters stays inside the site. Expert partitions keep their flat
expert_dp group.

Invariants:
- Replicas hold the same parameters in the same order, so layouts (and collectives) match.
- Padding elements have zero gradient and zero master weight and are never gathered.
- Gradients are divided by `mesh.dp` and summed over replicas (see `param_placement.py`),
  reduced in the master dtype; `tp_reduce` gradients are first summed over TP.
- A parameter without a gradient is stepped with a zero gradient, as in `data_parallel.py`.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
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
from mplan.runtime.hierarchical_reduce import CrossSiteLink, SiteReductions
from mplan.runtime.optimizer_state import (
    ParamsArg,
    StateRange,
    as_param_groups,
    flatten_optimizer_state,
    unflatten_optimizer_state,
)
from mplan.runtime.param_placement import ParamPlacement, Placements, counts_in_norm, shard_group
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups, group_rank, group_size
from mplan.runtime.replicated_optimizer import OptimizerFactory

MAX_IN_FLIGHT = 2
"""Reduce-scatters outstanding at once (every level); the oldest is completed once a third starts."""


class _Launches:
    """zero=1's reduce-scatters in flight, oldest first, at most `MAX_IN_FLIGHT` of them: each one
    launched past the bound waits for the oldest and drops it (with gloo's copy of its input).
    Kept apart from `ShardedOptimizer` so that `ReductionStarts`' callback does not hold its owner."""

    def __init__(self) -> None:
        self._works: list[dist.Work] = []

    def add(self, work: dist.Work | None) -> None:
        if work is not None:
            self._works.append(work)
        while len(self._works) > MAX_IN_FLIGHT:
            self._works.pop(0).wait()

    def wait(self) -> None:
        """Wait for every one in flight."""
        for work in self._works:
            work.wait()
        self._works = []


@dataclass(frozen=True, kw_only=True, slots=True)
class _Bucket:
    params: tuple[torch.Tensor, ...]
    numel: int
    """Elements of its parameters, before padding."""
    shard_numel: int
    """Elements each replica owns: padded size / number of replicas."""
    shard_offset: int
    """Where this rank's slice of the bucket sits in the partition's shard."""
    unit: int = -1
    """zero=3: the unit (gathered together) whose parameters it holds; -1 otherwise."""

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
    summed_first: bool = False
    """zero>=2: its gradients are summed with other pipeline ranks' copies before reduction, so
    they stay whole in `.grad` until `step()`."""
    across_sites: bool = False
    """`group` is this rank's site: each shard's gradient is then summed over the sites."""

    @property
    def num_replicas(self) -> int:
        return group_size(self.group)


def _make_partition(params: list[torch.Tensor], placement: ParamPlacement, groups: ProcessGroups,
                    cut: Sequence[Sequence[torch.Tensor]], unit_of: Mapping[int, int],
                    summed_first: bool) -> _Partition:
    group = shard_group(placement, groups)
    n, rank = group_size(group), group_rank(group)
    buckets, offset = [], 0
    for members in cut:
        numel = sum(p.numel() for p in members)
        shard_numel = -(-numel // n)
        buckets.append(_Bucket(params=tuple(members), numel=numel, shard_numel=shard_numel, shard_offset=offset,
                               unit=unit_of.get(id(members[0]), -1)))
        offset += shard_numel
    master_dtype = torch.promote_types(params[0].dtype, torch.float32)
    master = torch.zeros(offset, dtype=master_dtype, device=params[0].device)
    for bucket in buckets:
        padded = _flatten_padded(list(bucket.params), bucket.shard_numel * n, master_dtype)
        master[bucket.in_shard] = padded[rank * bucket.shard_numel:(rank + 1) * bucket.shard_numel]
    shard = torch.nn.Parameter(master)
    shard.grad = torch.zeros_like(master)
    return _Partition(placement=placement, group=group, buckets=tuple(buckets), master=shard,
                      summed_first=summed_first, across_sites=groups.sites > 1 and not placement.expert)


def _cut(params: list[torch.Tensor], bucket_bytes: int, unit_of: Mapping[int, int] | None) -> list[list[torch.Tensor]]:
    """Buckets: at most `bucket_bytes` each, or (zero=3) one per run of parameters of one unit."""
    if unit_of is None:
        return list(split_into_buckets(params, bucket_bytes))
    runs: list[list[torch.Tensor]] = []
    for param in params:
        if runs and unit_of.get(id(runs[-1][0]), -1) == unit_of.get(id(param), -1):
            runs[-1].append(param)
        else:
            runs.append([param])
    return runs


def _flatten_padded(tensors: list[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(size, dtype=dtype, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()] = tensor.detach().reshape(-1)
        offset += tensor.numel()
    return flat


@torch.no_grad()
def _start_reduce_scatter(groups: ProcessGroups, slots: list[tuple[_Partition, _Bucket]],
                          sites: SiteReductions | None, launches: _Launches, index: int) -> None:
    """Slot `index`: TP sum of partial gradients (if any), then the bucket's reduce-scatter into
    its slice of the master gradient (asynchronous over more than one replica), added to
    `launches`; across sites, handed to `sites` to be summed over them instead (which waits for
    each one before the next is added)."""
    part, bucket = slots[index]
    grads = [p.grad for p in bucket.params]
    if part.placement.tp_reduce:
        all_reduce_tp_partials(grads, groups)
    n = part.num_replicas
    flat = _flatten_padded(grads, bucket.shard_numel * n, part.master.dtype)
    if groups.mesh.dp > 1:
        flat.div_(groups.mesh.dp)  # before the sum, as data_parallel.py explains
    shard_grad = part.master.grad[bucket.in_shard]
    work = None
    if n > 1:  # the work keeps `flat` alive until it completes (c10d holds its tensors)
        work = reduce_scatter_flat(shard_grad, flat, group=part.group, async_op=True)
    else:
        shard_grad.copy_(flat)
    if sites is not None and part.across_sites:
        sites.add(work, shard_grad)
    else:
        launches.add(work)


@dataclass(frozen=True, slots=True)
class _Accumulation:
    """A zero>=2 reduce-scatter in flight: its result is added to the shard's gradient on `wait()`."""

    work: dist.Work
    result: torch.Tensor
    into: torch.Tensor
    then: Callable[[], None] | None = None
    """Run once `into` holds the sum (across sites: its all-reduce over them posted)."""

    def wait(self) -> None:
        self.work.wait()
        self.into.add_(self.result)
        if self.then is not None:
            self.then()


def _gradient_landed(owner: weakref.ref[ShardedOptimizer], param: torch.Tensor) -> None:
    alive = owner()
    if alive is not None:
        alive._gradient_landed(param)


class ShardedOptimizer:
    """ZeRO-1 (ZeRO-2 with `shard_gradients`): optimizer state and fp32 masters sharded over DP,
    gradients reduce-scattered into the shards."""

    def __init__(
        self,
        params: ParamsArg,
        optimizer: OptimizerFactory,
        groups: ProcessGroups,
        *,
        placements: Placements | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        shard_gradients: bool = False,
        summed_first: Collection[torch.Tensor] = (),
        units: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """`units` (zero=3, fully_sharded.py): the parameters each unit gathers together, in
        forward order; the layout follows it, bucket borders at unit borders."""
        self.groups = groups
        self.shard_gradients = shard_gradients or units is not None
        unit_of = None if units is None else {id(p): k for k, members in enumerate(units) for p in members}
        later = {id(p) for p in summed_first} if self.shard_gradients else set()
        self._partitions: list[_Partition] = []
        inner_groups = []
        for param_group in as_param_groups(params):
            members = unique_trainable(param_group["params"])
            if unit_of is not None:  # stable: the given order within a unit
                members.sort(key=lambda p: unit_of.get(id(p), len(unit_of)))
            partitions = []
            for (placement, _, _), keyed in group_by_reduction(members, placements).items():
                for deferred in (False, True):
                    chosen = [p for p in keyed if (id(p) in later) == deferred]
                    if chosen:
                        partitions.append(_make_partition(chosen, placement, groups, _cut(chosen, bucket_bytes, unit_of),
                                                          unit_of or {}, deferred))
            self._partitions += partitions
            options = {k: v for k, v in param_group.items() if k != "params"}
            inner_groups.append({**options, "params": [p.master for p in partitions]})
        self.params = [p for part in self._partitions for b in part.buckets for p in b.params]
        self.optimizer = optimizer(inner_groups)
        """The torch optimizer over the shards; attach learning-rate schedulers to it."""
        self._sites = SiteReductions(CrossSiteLink(groups.cross_site_dp)) if groups.sites > 1 else None
        # (partition, bucket) slots in the order backward completes them: the reverse of the layout
        # (zero=3: units complete in reverse forward order; a sort is stable)
        self._slots = [(part, bucket) for part in reversed(self._partitions) for bucket in reversed(part.buckets)]
        if units is not None:  # parameters no unit reads (unit -1) get no gradient: last
            self._slots.sort(key=lambda slot: -slot[1].unit if slot[1].unit >= 0 else 1)
        if not self.shard_gradients:
            self._launches = _Launches()
            self._starts = ReductionStarts([bucket.params for _, bucket in self._slots],
                                           functools.partial(_start_reduce_scatter, groups, self._slots,
                                                             self._sites, self._launches))
            return
        self._slot_of = {id(p): k for k, (_, bucket) in enumerate(self._slots) for p in bucket.params}
        # started from backward's hooks: all but the summed-first and (zero=3) the never-read ones
        self._eager = [k for k, (part, bucket) in enumerate(self._slots)
                       if not part.summed_first and (units is None or bucket.unit >= 0)]
        self._arrived = [0] * len(self._slots)
        self._next = 0  # position in `_eager` of the next slot to start
        self._pending: list[_Accumulation] = []
        self._reduced_in_backward = 0
        self._last_reduced_in_backward = 0
        # across sites, during the last backward: each slot's gradients landed in it so far, and
        # the slots whose cross-site sum is posted (complete: no gradient of theirs comes later)
        self._landed_last: list[int] | None = None
        self._crossed: set[int] = set()
        self.crossed_in_backward = 0
        """zero>=2 across sites: buckets of the last step whose cross-site sum the backward posted."""
        hook = functools.partial(_gradient_landed, weakref.ref(self))
        for param in self.params:
            param.register_post_accumulate_grad_hook(hook)

    @property
    def started_in_backward(self) -> int:
        """zero=1: buckets of the last step whose reduce-scatter backward started (the rest waited
        for the step); zero>=2: reduce-scatters backward started over the last step's micro-batches."""
        return self._last_reduced_in_backward if self.shard_gradients else self._starts.started_in_backward

    def before_last_backward(self) -> None:
        """The step's last backward comes next: zero=1's buckets start reduce-scattering as they
        complete (zero>=2's do so in every backward)."""
        if not self.shard_gradients:
            self._starts.arm()
        elif self._sites is not None:
            self._landed_last = [0] * len(self._slots)

    # -- zero>=2: a reduce-scatter per bucket and backward -----------------------------------------
    def _gradient_landed(self, param: torch.Tensor) -> None:
        index = self._slot_of[id(param)]
        self._arrived[index] += 1
        if self._landed_last is not None:
            self._landed_last[index] += 1
        self._bucket_landed(index)
        eager = self._eager
        while eager:
            k = eager[self._next]
            if self._arrived[k] < len(self._slots[k][1].params):
                break
            self._reduce(k)
            self._reduced_in_backward += 1
            self._next = (self._next + 1) % len(eager)

    def _bucket_landed(self, index: int) -> None:
        """A gradient of slot `index`'s bucket landed (zero=3 frees a unit's gathered weights)."""

    @torch.no_grad()
    def _reduce(self, index: int) -> None:
        """Slot `index`'s gradients (as they are in `.grad`, None as zeros) reduce-scattered and added
        into its slice of the master gradient; `.grad` dropped."""
        part, bucket = self._slots[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if part.placement.tp_reduce:
            all_reduce_tp_partials(grads, self.groups)
        n = part.num_replicas
        flat = _flatten_padded(grads, bucket.shard_numel * n, part.master.dtype)
        del grads
        for param in bucket.params:
            param.grad = None
        self._arrived[index] = 0
        if self.groups.mesh.dp > 1:
            flat.div_(self.groups.mesh.dp)  # before the sum, as data_parallel.py explains
        into = part.master.grad[bucket.in_shard]
        cross = None
        if part.across_sites and self._landed_last is not None and self._landed_last[index] == len(bucket.params):
            self._crossed.add(index)
            cross = functools.partial(self._sites.add, None, into)
        if n == 1:
            into.add_(flat)
            if cross is not None:
                cross()
            return
        result = torch.empty_like(into)
        work = reduce_scatter_flat(result, flat, group=part.group, async_op=True)
        self._pending.append(_Accumulation(work, result, into, cross))
        while len(self._pending) > MAX_IN_FLIGHT:
            self._pending.pop(0).wait()

    def _reduce_rest(self) -> None:
        """At the step: every slot still holding a gradient, in slot order; then wait for all;
        across sites, then each bucket's shard summed over the sites."""
        self.crossed_in_backward = len(self._crossed)
        for index, (_, bucket) in enumerate(self._slots):
            if any(p.grad is not None for p in bucket.params):
                self._reduce(index)
        self._wait()
        self._last_reduced_in_backward, self._reduced_in_backward = self._reduced_in_backward, 0
        if self._sites is not None:
            for index, (part, bucket) in enumerate(self._slots):
                if part.across_sites and index not in self._crossed:
                    self._sites.add(None, part.master.grad[bucket.in_shard])
            self._sites.finish()
            self._landed_last, self._crossed = None, set()

    def _wait(self) -> None:
        for pending in self._pending:
            pending.wait()
        self._pending = []

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def zero_grad(self) -> None:
        if self._sites is not None:
            self._sites.abandon()  # what a step that failed midway left in flight
            self._landed_last, self._crossed = None, set()
        if not self.shard_gradients:
            self._starts.wait()  # a step that failed after arming may have reduce-scatters in flight
            self._launches.wait()
        else:
            self._wait()
            self._arrived, self._next, self._reduced_in_backward = [0] * len(self._slots), 0, 0
            for part in self._partitions:
                part.master.grad.zero_()
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """Reduce-scatter gradients, clip if asked, update the shard, all-gather parameters.

        Collective over the world when clipping (the norm), else over TP and DP. Returns the
        global gradient norm when clipping.
        """
        if self.shard_gradients:
            self._reduce_rest()
        else:
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            self._starts.start_rest_and_wait()
            self._launches.wait()
            if self._sites is not None:
                self._sites.finish()
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
        self._masters_changed()
        return norm

    def _masters_changed(self) -> None:
        """The master shards changed (a step, a load): bring the model's parameters up to date."""
        for part in self._partitions:
            self._all_gather_params(part)

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
        return self._ranges(lambda part: part.master)

    def _ranges(self, holder_of: Callable[[_Partition], torch.Tensor], *, empty: bool = False) -> list[StateRange]:
        """`state_ranges` with `holder_of(partition)` as the holder; `empty`: also a range of no
        elements for each parameter this rank keeps none of."""
        out = []
        for part in self._partitions:
            rank, holder = group_rank(part.group), holder_of(part)
            for bucket in part.buckets:
                own, start = slice(rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel), 0
                for param in bucket.params:
                    lo, hi = max(start, own.start), min(start + param.numel(), own.stop)
                    if lo < hi:
                        out.append(StateRange(param=param, holder=holder, start=lo - start, stop=hi - start,
                                              at=bucket.shard_offset + lo - own.start))
                    elif empty:
                        out.append(StateRange(param=param, holder=holder, start=0, stop=0, at=bucket.shard_offset))
                    start += param.numel()
        return out

    def sharded_params(self) -> list[StateRange] | None:
        """None: the parameters are held whole in `pm.params` (zero=3 holds them as shards)."""
        return None

    def parameters_whole(self) -> contextlib.AbstractContextManager[None]:
        """The parameters are always whole here (zero=3 gathers them for the context)."""
        return contextlib.nullcontext()

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
        self._masters_changed()
