"""Data-parallel gradient synchronization in flat buckets (the zero=0 path).

Input: a rank's local parameters, its `ProcessGroups` and each parameter's `ParamPlacement`.
Output: after `sync_gradients()`, every `param.grad` holds the gradient of the global-batch
loss (see `param_placement.py` for the averaging convention), identical on all replicas.

How: each parameter's `.grad` is a view into a persistent flat bucket buffer (as DDP's
`gradient_as_bucket_view` and Megatron's contiguous grad buffer), so autograd accumulates
micro-batch gradients straight into the buffer and a bucket is reduced by one collective with
no copy. Gradient accumulation needs nothing: run backward on every micro-batch, then call
`sync_gradients()` once after the last one. A `.grad` that was replaced or set to None
(`optimizer.zero_grad()` does that) is copied back into its bucket at sync time, so results
stay correct; `zero_grad()` here keeps the views and avoids that copy.

Overlap with backward (as DDP and Megatron do): `arm()` before the last micro-batch's backward
makes each bucket start its reduction from a post-accumulate-grad hook as soon as its last
gradient lands, while backward goes on with the earlier layers. Buckets are laid out in reverse
parameter order (the order backward produces gradients) and start strictly in that order, so
every replica issues the same collectives in the same sequence; a bucket whose gradients did
not all arrive (an unused parameter) waits for `sync_gradients()`, and so do the ones after it.

Across sites (`groups.sites > 1`): a dense bucket is reduced in three phases instead of one
all-reduce (reduce-scatter inside the site, all-reduce of the shard over sites, all-gather
inside the site: `hierarchical_reduce.py`), its buffer padded to a multiple of the site's
replicas; the first phase starts where the flat all-reduce would, the last at the sync.
Expert buckets keep their flat all-reduce over expert_dp.

Inside the site only (an outer loop across sites, `outer_loop.py`): `GradientSync` built on
`inner_only(groups)` sees the site's replicas as the whole of data parallelism, so each bucket is
one all-reduce over `site_dp`, divided by the site's replica count: nothing crosses the long haul,
and each site steps as a data-parallel job of its own until the outer step averages the sites.

Parameters whose gradient needs no collective and no scaling (dp=1, unless it is a TP partial
sum over tp > 1: every parameter of a one-rank or pure-TP run) get no bucket: autograd makes
their `.grad` and `zero_grad()` sets it to None, as eager PyTorch does. A bucket would hold
their gradients through the forward's activation peak (a whole model's gradients more peak
memory) and make backward add into it (a read-add-write of every gradient) for nothing.

Invariants:
- Buckets hold parameters of one dtype, device and reduction kind (dense or expert, with or
  without a TP partial sum), at most `bucket_bytes` each (a larger parameter gets its own).
  Replicas hold the same parameters in the same order, so their bucket layouts match and
  the collectives pair up.
- `tp_reduce` buckets are summed over TP before the data-parallel average.
- A parameter that received no gradient is synchronized as zeros and keeps a zero `.grad`
  (like DDP with bucket views): unlike a `None` gradient, the optimizer still steps it, with
  or without a bucket, so every plan updates the same parameters.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mplan.collectives.flat import all_gather_flat, reduce_scatter_flat
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.runtime.hierarchical_reduce import CrossSiteLink, SiteReductions
from mplan.runtime.param_placement import ParamPlacement, Placements, placement_of, replica_group, shard_group
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups, group_size



def inner_only(groups: ProcessGroups) -> ProcessGroups:
    """`groups` as a site's own data parallelism sees them (module docstring): dp is the site's
    replicas (`site_dp`), one site, no cross-site group. The optimizers built on them reduce
    gradients (and shard ZeRO state) inside the site only; the batch rows a rank reads still come
    from the whole mesh's `groups`. Experts' replicas span sites flat, so ep must be 1."""
    mesh = groups.mesh
    if mesh.sites == 1 or mesh.ep > 1:
        raise ValueError(f"inner-only gradient sync needs sites > 1 and ep = 1, got sites={mesh.sites}, ep={mesh.ep}")
    local = dataclasses.replace(mesh, dp=mesh.dp_local, sites=1)
    position = groups.coord.dp % mesh.dp_local
    coord = dataclasses.replace(groups.coord, dp=position, expert_dp=position, site=0)
    return dataclasses.replace(groups, mesh=local, coord=coord, dp=groups.site_dp, expert_dp=groups.site_dp,
                               cross_site_dp=None)


def unique_trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters that need gradients, each once (tied weights appear once), in given order."""
    seen: set[int] = set()
    unique = []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def split_into_buckets(
    params: list[torch.Tensor], bucket_bytes: int
) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `params` of at most `bucket_bytes` (a larger parameter alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(param)
        size += nbytes
    if bucket:
        yield bucket


def group_by_reduction(
    params: list[torch.Tensor], placements: Placements | None
) -> dict[tuple[ParamPlacement, torch.dtype, torch.device], list[torch.Tensor]]:
    """Parameters that can share a flat buffer: same placement, dtype and device, in order."""
    keyed: dict[tuple[ParamPlacement, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        key = (placement_of(param, placements), param.dtype, param.device)
        keyed.setdefault(key, []).append(param)
    return keyed


def needs_reduction(placement: ParamPlacement, groups: ProcessGroups) -> bool:
    """Whether a parameter's gradient is averaged over replicas or summed over TP at all."""
    return groups.mesh.dp > 1 or (placement.tp_reduce and group_size(groups.tp) > 1)


def all_reduce_tp_partials(grads: list[torch.Tensor], groups: ProcessGroups) -> None:
    """Sum partial gradients of TP-replicated parameters over TP, in place, in one collective
    (for gradients that do not live in a bucket, as under ZeRO)."""
    if group_size(groups.tp) == 1 or not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=groups.tp)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class ReductionStarts:
    """Numbered gradient reductions started in a fixed order: during an armed backward each as
    soon as every gradient it reads has landed (post-accumulate-grad hooks), the rest at the step.
    Strictly in order, so every replica issues the same collectives in the same sequence; a unit
    whose gradients did not all arrive (an unused parameter) waits for the step, and so do the
    units after it. Shared by the zero=0 buckets and ZeRO-1's.

    No reference cycles, so that deleting a module frees its weights without a garbage
    collection: the hooks hold this object weakly, and `start` must not hold its owner."""

    def __init__(self, members: Sequence[Sequence[torch.Tensor]], start: Callable[[int], dist.Work | None]) -> None:
        self._sizes = [len(params) for params in members]
        self._start = start
        self._unit_of = {id(param): index for index, params in enumerate(members) for param in params}
        hook = functools.partial(_gradient_landed, weakref.ref(self))
        for params in members:
            for param in params:
                param.register_post_accumulate_grad_hook(hook)
        self._armed = False
        self._arrived = [0] * len(self._sizes)
        self._started = 0  # units [0, _started) have their reduction under way
        self._pending: list[dist.Work] = []
        self.started_in_backward = 0
        """Units of the last step whose reduction backward started (the rest waited for the step)."""

    def arm(self) -> None:
        """The next backward is the step's last: start each unit once its gradients are all in."""
        self._armed, self._arrived, self._started = True, [0] * len(self._sizes), 0

    def _landed(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._arrived[self._unit_of[id(param)]] += 1
        while self._started < len(self._sizes) and self._arrived[self._started] == self._sizes[self._started]:
            self._launch()

    def _launch(self) -> None:
        work = self._start(self._started)
        if work is not None:
            self._pending.append(work)
        self._started += 1

    def start_rest_and_wait(self) -> None:
        """At the step: start the units backward did not, in the same order, and wait for all."""
        self.started_in_backward = self._started if self._armed else 0
        self._started = self.started_in_backward
        while self._started < len(self._sizes):
            self._launch()
        self.wait()

    def wait(self) -> None:
        """Wait for every started reduction (also what a step that failed after arming left in flight)."""
        for work in self._pending:
            work.wait()
        self._pending = []
        self._armed = False


def _gradient_landed(starts: weakref.ref[ReductionStarts], param: torch.Tensor) -> None:
    alive = starts()
    if alive is not None:
        alive._landed(param)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Bucket:
    params: tuple[torch.Tensor, ...]
    buffer: torch.Tensor
    """Flat gradient storage; each parameter's `.grad` is a view into it."""
    grads: tuple[torch.Tensor, ...]
    """The views, one per parameter (made once: a step only re-points `.grad` at them)."""
    placement: ParamPlacement
    group: ProcessGroup | None
    """Replicas whose gradients are summed (dp, or expert_dp for experts)."""
    site_group: ProcessGroup | None = None
    """Across sites: the replicas inside this rank's site (phases 1 and 3); None: one all-reduce."""

    @staticmethod
    def of(params: list[torch.Tensor], placement: ParamPlacement, groups: ProcessGroups) -> _Bucket:
        site_group = shard_group(placement, groups) if groups.sites > 1 and not placement.expert else None
        numel = sum(p.numel() for p in params)
        padded = -(-numel // group_size(site_group)) * group_size(site_group)  # reduce-scattered evenly
        buffer = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        offsets = itertools.accumulate((p.numel() for p in params), initial=0)
        grads = tuple(buffer[start:start + p.numel()].view_as(p) for p, start in zip(params, offsets))
        return _Bucket(params=tuple(params), buffer=buffer, grads=grads, placement=placement,
                       group=replica_group(placement, groups), site_group=site_group)

    def views(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.params, self.grads)


class GradientSync:
    """Sums partial TP gradients and averages gradients over data-parallel replicas."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        groups: ProcessGroups,
        *,
        placements: Placements | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.groups = groups
        self.params = unique_trainable(params)
        bucketed: list[torch.Tensor] = []
        self._unbucketed: list[torch.Tensor] = []
        for param in reversed(self.params):  # the order backward produces their gradients
            reduced = needs_reduction(placement_of(param, placements), groups)
            (bucketed if reduced else self._unbucketed).append(param)
        self._buckets = [
            _Bucket.of(bucket, placement, groups)
            for (placement, _, _), members in group_by_reduction(bucketed, placements).items()
            for bucket in split_into_buckets(members, bucket_bytes)
        ]
        for bucket in self._buckets:
            for param, view in bucket.views():
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
        self._sites = SiteReductions(CrossSiteLink(groups.cross_site_dp)) if groups.sites > 1 else None
        self._starts = ReductionStarts([bucket.params for bucket in self._buckets],
                                       functools.partial(_start_all_reduce, groups, self._buckets, self._sites))

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def started_in_backward(self) -> int:
        """Buckets of the last step whose reduction backward started (the rest waited for the sync)."""
        return self._starts.started_in_backward

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's reduction once it is complete."""
        self._starts.arm()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every bucketed gradient, keeping them as views into the buckets; drop the others."""
        self._starts.wait()  # a step that failed after arming may have reductions in flight
        if self._sites is not None:
            self._sites.abandon()
        for bucket in self._buckets:
            bucket.buffer.zero_()
            for param, view in bucket.views():
                param.grad = view
        for param in self._unbucketed:
            param.grad = None

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Reduce the accumulated gradients; call once after the last micro-batch's backward."""
        for param in self._unbucketed:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._starts.start_rest_and_wait()
        if self._sites is not None:
            self._sites.finish()


@torch.no_grad()
def _start_all_reduce(groups: ProcessGroups, buckets: list[_Bucket], sites: SiteReductions | None,
                      index: int) -> dist.Work | None:
    """Bucket `index`: TP sum (if partial), the division by dp, then the asynchronous
    data-parallel sum (across sites: its first phase, handed to `sites`)."""
    bucket = buckets[index]
    _adopt_foreign_grads(bucket)
    if bucket.placement.tp_reduce and group_size(groups.tp) > 1:
        dist.all_reduce(bucket.buffer, group=groups.tp)
    # Divide before summing, as DDP and Megatron do: a sum of low-precision gradients
    # over many replicas can overflow where their mean would not.
    if groups.mesh.dp > 1:
        bucket.buffer.div_(groups.mesh.dp)
    if sites is not None and bucket.site_group is not None:
        _start_across_sites(bucket, sites)
        return None
    if group_size(bucket.group) > 1:
        return dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
    return None


def _start_across_sites(bucket: _Bucket, sites: SiteReductions) -> None:
    """The bucket's reduce-scatter inside the site; `sites` carries its shard over the sites and
    all-gathers it back into the bucket."""
    n = group_size(bucket.site_group)
    if n == 1:  # one replica per site: the whole bucket crosses
        sites.add(None, bucket.buffer)
        return
    shard = torch.empty(bucket.buffer.numel() // n, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
    local = reduce_scatter_flat(shard, bucket.buffer, group=bucket.site_group, async_op=True)
    sites.add(local, shard, functools.partial(all_gather_flat, bucket.buffer, shard, group=bucket.site_group,
                                              async_op=True))


def _adopt_foreign_grads(bucket: _Bucket) -> None:
    """Gradients that are not the bucket's views (replaced, or None) copied into it."""
    for param, view in bucket.views():
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        param.grad = view
