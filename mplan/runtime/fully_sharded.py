"""The zero=3 optimizer (ZeRO stage 3, FSDP-style): parameters sharded over DP too.

Input: as zero=2's (`sharded_optimizer.py`), plus the program's *units* (`unit_gathers.py`: the
parameters each group of consecutive segments reads, in forward order). Output: the same
`DistributedOptimizer`, and parameters that exist whole only while a unit runs:

    each rank keeps   its flat shard of every bucket: fp32 (or wider) masters, the optimizer
                      state, the gradient shard, and the same elements in the parameters' dtype
                      (the gather's source; the masters themselves where the dtypes agree)
    a bucket          the parameters of one unit and one partition (placement, dtype, group)
    gather(unit)      all-gather of its buckets, in the parameters' dtype, into storage the
                      local parameters (`pm.params`, the program's placeholders) point into
    release(unit)     that storage resized to 0 bytes: the parameter tensors stay, empty

A group of one (dp=1, or expert-DP of one): the rank's shard is the whole bucket, so its
parameters point into the compute shard itself and stay whole: no gather, copy or release, and
the calls `unit_gathers.py` inserts find them whole (measured on an H200, a 1.26B Llama at dp=1
ran zero=3 80 ms a step slower than zero=1 while it still copied and freed every unit twice per
micro-batch; benchmarks/results/train_gpu-2026-12-06.json). The gradients still take zero=2's
path into the master shard's gradient each micro-batch.

In a one-stage program a unit is gathered before its first op, released after its last (forward),
gathered again when the first gradient of its outputs arrives (a multi-grad hook: before any of
its backward, recomputation included) and released when every one of its parameters has its
gradient, which zero=2's machinery then reduce-scatters into the shards. Under a pipeline plan,
or a Plan that keeps the weights (`zero3_keep_weights`), `keep_gathered`: a rank's units are
gathered at their first forward of the step and kept until the update, one gather per unit and
step, the weights of its stages whole meanwhile. (A pipeline's gradients are reduced at the step:
its executor accumulates them itself, which no hook sees; `sharded_optimizer.py`.)

Prefetch, one unit ahead (`UNITS_IN_FLIGHT`): when a unit starts, forward or backward, it waits
for its own gather and issues the next unit's before it computes, so that all-gather runs under
its compute:

    forward    unit r-1 running: r's gather in flight     start of r: wait(r), issue(r+1), run r
    backward   r+1's backward:   r's gather in flight     start of r's: wait(r), issue(r-1), run it

Only the first unit of each pass gathers blocking (forward: the first unit; backward: the last,
released at the end of the forward before it). The next unit is the next run of the program that
reads any parameter (`unit_gathers.py` names it when it inserts the calls). Keeping the weights,
only the step's first forward prefetches: later passes find every unit whole.

Why mplan's own gathers rather than torch's FSDP2 (`fully_shard`): FSDP2 unshards and reshards
around `nn.Module.forward` calls and keeps parameters as DTensors (sharded per tensor on dim 0)
registered on those modules. mplan's rank program is one generated FX graph whose parameters are
placeholders fed by the caller (`ParallelModule._feed`), cut into units by segment labels, and
its runtime already owns what FSDP2 would have to be taught: the gradient convention (divide by
dp, sum over the replica group, expert weights over expert-DP: `param_placement.py`), TP partial
sums, the fp32 master shards, flat ranges in checkpoints and clipping. So the gathers are two
calls inserted into the program at unit borders, and FSDP2's one trick that matters is reused:
freeing by resizing storage, which leaves every tensor autograd saved valid for the regather.

Exactness: the gathered values are the masters in the parameters' dtype, as zero=1's all-gather
writes them; the gradients are zero=2's. Float64 runs match one process to rounding.

Overlap: an all-gather issued ahead is asynchronous (c10d's `async_op`: NCCL's own stream on a
GPU, gloo's worker threads on CPU ranks). On 4 gloo ranks of 2 cores it cut the time waited in
gathers by a third and left the step as long: gloo's copies take the cores the compute needs
(benchmarks/results/zero3_prefetch-cpu-2026-12-06.json). Reduce-scatters are asynchronous too (at
most `MAX_IN_FLIGHT`). Under autocast, torch's cast cache keeps a low-precision copy of each
weight for the forward's duration.

Invariants: storage is gathered only from the shards (never written back from it, except by
`params_loaded` after a load into the whole parameters); gathers and releases run in program
order, the same on every replica; a gather in flight is waited for before its storage is read,
released or written and before the step updates the shards it reads; at most
`UNITS_IN_FLIGHT` runs' units are whole or in flight at once in a one-stage program, besides those
a later run reads again; outside a step (and its `parameters_whole` contexts) no unit is
gathered, except over a group of one, whose parameters are the shard. So outside them
`pm.params` hold tensors of the right shape over storage of 0 bytes, which `released_parameters.py`
guards: reading their values raises one line naming the accessors. Read
them inside `pm.optimizer.parameters_whole()`, as `full_state_dict`, inference and the
checkpoints do.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mplan.collectives.flat import all_gather_flat
from mplan.runtime.optimizer_state import ParamsArg, StateRange
from mplan.runtime.param_placement import Placements
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups, group_rank
from mplan.runtime.replicated_optimizer import OptimizerFactory
from mplan.runtime.sharded_optimizer import ShardedOptimizer, _Bucket, _Partition

UNITS_IN_FLIGHT = 2
"""Runs of a one-stage program whose units are whole or being gathered at once: the one computing
and the next `UNITS_IN_FLIGHT - 1` that read parameters (prefetched), in forward order in the
forward and in reverse in the backward. Besides them, a unit that a later run reads again stays
whole between its readers (a tied embedding and head, from the prologue to the epilogue). The
planner's memory counts the same window (`planner.zero_pricing.ZERO3_UNITS_IN_FLIGHT`)."""


@dataclass(slots=True, eq=False)
class _Gathered:
    """One bucket's parameters, whole while gathered."""

    bucket: _Bucket
    group: ProcessGroup | None
    source: torch.Tensor
    """This rank's slice of the bucket in the parameters' dtype (a view of the compute shard)."""
    whole: torch.Tensor
    """The padded bucket, flat; the parameters point into its storage. Written only by the
    gather, through this tensor, so no parameter's version counter moves (autograd's saved
    tensors stay valid)."""
    gathered: bool = False
    """Its storage allocated and filled, or being filled by `work`."""
    alone: bool = False
    """Its group has one rank: the shard is the whole bucket, `whole` is `source` itself (the
    parameters point into the compute shard), always gathered, never copied or released."""
    work: dist.Work | None = None
    """The all-gather still writing `whole` (issued ahead by `prefetch`); None once waited for."""
    arrived: int = 0
    """Gradients of its parameters that landed since it was last gathered."""

    @property
    def nbytes(self) -> int:
        return self.whole.numel() * self.whole.element_size()


class FullyShardedOptimizer(ShardedOptimizer):
    """ZeRO-3: zero=2 plus parameters held as shards and gathered per unit (module docstring)."""

    def __init__(self, params: ParamsArg, optimizer: OptimizerFactory, groups: ProcessGroups, *,
                 placements: Placements | None = None, units: Sequence[Sequence[torch.Tensor]],
                 summed_first: Collection[torch.Tensor] = (), keep_gathered: bool = False) -> None:
        super().__init__(params, optimizer, groups, placements=placements, units=units, summed_first=summed_first)
        self.keep_gathered = keep_gathered
        self._pinned = 0  # depth of `parameters_whole` contexts
        self.num_gathers = 0
        """Buckets all-gathered so far (a unit of one partition is one bucket)."""
        self.num_prefetched = 0
        """Of them, those issued ahead of their unit by `prefetch` (asynchronous)."""
        self._units: list[list[_Gathered]] = [[] for _ in units]
        self._unread: list[_Gathered] = []
        self._compute: list[torch.Tensor] = []
        by_bucket: dict[int, _Gathered] = {}
        with torch.no_grad():
            for part in self._partitions:
                dtype = part.buckets[0].params[0].dtype
                master = part.master.detach()
                compute = master if dtype == master.dtype else master.to(dtype)
                self._compute.append(compute)
                for bucket in part.buckets:
                    held = self._hold(part, bucket, compute)
                    by_bucket[id(bucket)] = held
                    (self._units[bucket.unit] if bucket.unit >= 0 else self._unread).append(held)
        self._held_of_slot = [by_bucket[id(bucket)] for _, bucket in self._slots]
        self._held_of_bucket = by_bucket
        self._unit_of = {id(p): bucket.unit for part in self._partitions for bucket in part.buckets
                         for p in bucket.params if bucket.unit >= 0}

    @staticmethod
    def _hold(part: _Partition, bucket: _Bucket, compute: torch.Tensor) -> _Gathered:
        """The bucket's whole storage, with its parameters re-pointed into it."""
        first = bucket.params[0]
        source = compute[bucket.in_shard]
        alone = part.num_replicas == 1
        whole = source if alone else torch.empty(bucket.shard_numel * part.num_replicas, dtype=first.dtype,
                                                  device=first.device)
        offset = whole.storage_offset()
        for param in bucket.params:
            view = torch.empty(0, dtype=param.dtype, device=param.device)
            view.set_(whole.untyped_storage(), offset, param.shape)
            param.data = view  # same Parameter object (placements, the program's feeds), new storage
            offset += param.numel()
        if alone:
            return _Gathered(bucket=bucket, group=part.group, source=source, whole=whole, gathered=True, alone=True)
        whole.untyped_storage().resize_(0)  # released until its unit's first gather
        return _Gathered(bucket=bucket, group=part.group, source=source, whole=whole)

    def _all(self) -> Iterator[_Gathered]:
        for unit in self._units:
            yield from unit
        yield from self._unread

    # -- gathering -----------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, units: Sequence[int]) -> None:
        """The units' buckets whole on return: waits for those `prefetch` issued, all-gathers the
        others (blocking; collective over each bucket's replicas)."""
        for unit in units:
            for held in self._units[unit]:
                if not held.gathered:
                    self._start(held, blocking=True)
                self._settle(held)

    @torch.no_grad()
    def prefetch(self, units: Sequence[int]) -> None:
        """Issue the all-gathers of the units' buckets not yet whole and return at once: they run
        under the compute that follows, and the units' `gather` waits for them."""
        for unit in units:
            for held in self._units[unit]:
                if not held.gathered:
                    self._start(held, blocking=False)

    def _start(self, held: _Gathered, *, blocking: bool) -> None:
        self.num_gathers += 1
        held.whole.untyped_storage().resize_(held.nbytes)
        work = all_gather_flat(held.whole, held.source, group=held.group, async_op=not blocking)
        if not blocking:
            held.work = work
            self.num_prefetched += 1
        held.gathered, held.arrived = True, 0

    @staticmethod
    def _settle(held: _Gathered) -> None:
        """Wait for the all-gather still writing `held`, if any."""
        if held.work is not None:
            held.work.wait()
            held.work = None

    def _drop(self, held: _Gathered) -> None:
        if held.gathered and not held.alone and not self._pinned:
            self._settle(held)  # the collective writes into the storage about to be freed
            held.whole.untyped_storage().resize_(0)
            held.gathered = False

    def _release_all(self) -> None:
        for held in self._all():
            self._drop(held)

    def after_unit(self, release: Sequence[int], regather: Sequence[int], ahead: Sequence[int],
                   outputs: Sequence[object]) -> None:
        """After a unit's forward (one-stage programs): release the units it read last, and have the
        first gradient of its outputs gather again the units it reads, before its backward, and
        prefetch `ahead`, the units of the backward after it."""
        if self.keep_gathered:
            return
        for unit in release:
            for held in self._units[unit]:
                self._drop(held)
        needing = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                needing, functools.partial(_gather_again, weakref.ref(self), tuple(regather), tuple(ahead)),
                mode="any")

    def _bucket_landed(self, index: int) -> None:
        held = self._held_of_slot[index]
        held.arrived += 1
        # every op that read these weights has run its backward: their gradients are all in
        if held.arrived >= len(held.bucket.params) and not self.keep_gathered:
            self._drop(held)

    def unit_of(self, param: torch.Tensor) -> int | None:
        """The unit `param` is gathered with; None for a parameter this optimizer does not hold
        (frozen) or no unit reads."""
        return self._unit_of.get(id(param))

    @contextlib.contextmanager
    def parameters_whole(self) -> Iterator[None]:
        """Every parameter whole inside the context (collective on entry: all-gathers), released on
        exit; writes to them are taken into the shards by `params_loaded()`."""
        if not self._pinned:
            with torch.no_grad():
                for held in self._all():
                    if not held.gathered:
                        self._start(held, blocking=True)
                    self._settle(held)
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1
            self._release_all()

    # -- the step and the state ----------------------------------------------------------------
    def zero_grad(self) -> None:
        super().zero_grad()
        self._release_all()  # a step that failed midway may have left units whole

    def step(self, *, max_grad_norm: float | None = None) -> torch.Tensor | None:
        """zero=2's step, once no gather is in flight: one prefetched for a backward that never came
        (outputs no loss reached) still reads the shards the update writes."""
        for held in self._all():
            self._settle(held)
        return super().step(max_grad_norm=max_grad_norm)

    @torch.no_grad()
    def _masters_changed(self) -> None:
        """The masters changed (a step, a load): the compute shards follow; whole units are
        released (or, inside `parameters_whole`, gathered again)."""
        for part, compute in zip(self._partitions, self._compute):
            if compute is not part.master:
                compute.copy_(part.master)
        for held in self._all():
            if held.alone:
                continue  # its parameters are the compute shard, just written
            if self._pinned and held.gathered:
                self._settle(held)
                self._start(held, blocking=True)
            else:
                self._drop(held)

    def sharded_params(self) -> list[StateRange]:
        """Where this rank keeps each parameter's elements: ranges of the compute shards (the
        parameters' dtype), laid out as `state_ranges()` lays out the masters; an empty range for
        a parameter of which this rank keeps no element."""
        compute = {id(part): c for part, c in zip(self._partitions, self._compute)}
        return self._ranges(lambda part: compute[id(part)], empty=True)

    @torch.no_grad()
    def params_loaded(self) -> None:
        """The parameters were written: whole ones (inside `parameters_whole`, a Hugging Face
        load) go back into the shards, else the compute shards were (a checkpoint's pieces), and
        the masters follow them."""
        for part, compute in zip(self._partitions, self._compute):
            rank = group_rank(part.group)
            for bucket in part.buckets:
                held = self._held_of_bucket[id(bucket)]
                if held.gathered and not held.alone:  # (alone: written in place, `whole` is the shard)
                    own = held.whole[rank * bucket.shard_numel:(rank + 1) * bucket.shard_numel]
                    compute[bucket.in_shard] = own
                if compute is not part.master:
                    part.master[bucket.in_shard] = compute[bucket.in_shard]
        self._release_all()


def _gather_again(owner: weakref.ref[FullyShardedOptimizer], units: tuple[int, ...], ahead: tuple[int, ...],
                  *_: object) -> None:
    alive = owner()
    if alive is not None:
        alive.gather(units)
        alive.prefetch(ahead)
