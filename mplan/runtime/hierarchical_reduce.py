"""Gradient reduction across sites in three phases (hierarchical data parallelism, issue 36).

Input: flat gradient buffers, already divided by the data-parallel degree, and this rank's
`ProcessGroups` with `sites > 1`: `site_dp` (its replicas inside its own site) and
`cross_site_dp` (the ranks of the other sites at the same site-local position).
Output: the same sums as one all-reduce over the whole data-parallel group, reached as
Megatron Core's multi-site training reaches them:

    1. reduce-scatter inside the site      site_dp,       fast links, the whole bucket
    2. all-reduce of the shard over sites  cross_site_dp, the slow link, 1/site_dp of the bucket
    3. all-gather inside the site          site_dp        (zero=0; ZeRO keeps the shard: its
                                                            step all-gathers the parameters)

so each byte that crosses the long-haul link is a shard, once. Exact: every element is the
sum of the same replicas' gradients (in another order of float additions: float64 runs agree
to rounding).

Overlap: a bucket's phase 1 is issued by the caller (from backward's hooks, where the flat
reduction would start it); its phase 2 is posted when the next bucket's phase 1 is issued (one
bucket of backward later, so waiting for its phase 1 rarely blocks), and phase 3 at the step,
once every cross-site sum has been posted, so the slow link's messages stay in flight under
the rest of the backward. The phases advance only at `add` and `finish` calls, never on
timing, so every rank issues the same collectives on each group in the same order.

Injected latency (emulation only, no effect unless set): with the environment variable
`MPLAN_INTER_SITE_DELAY_MS`, every cross-site collective is posted that many milliseconds
after the runtime asked for it, by one worker thread (in order, each delayed from its own
request, so messages requested together overlap their delays). It stands in for the
long-haul latency that `tc netem` would add where the kernel has it; the step's compute does
not wait for the delay, only what reads the sum does. Read once per `CrossSiteLink`.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mplan.runtime.process_groups import ProcessGroup

INTER_SITE_DELAY_ENV = "MPLAN_INTER_SITE_DELAY_MS"
"""Injected latency per cross-site collective, in milliseconds (emulated links only)."""


def injected_delay_s() -> float:
    """`MPLAN_INTER_SITE_DELAY_MS` in seconds; 0 when unset. A bad value is one clear line."""
    text = os.environ.get(INTER_SITE_DELAY_ENV, "").strip()
    if not text:
        return 0.0
    try:
        delay_ms = float(text)
    except ValueError:
        raise ValueError(f"{INTER_SITE_DELAY_ENV}={text!r} is not a number of milliseconds") from None
    if delay_ms < 0:
        raise ValueError(f"{INTER_SITE_DELAY_ENV}={text!r}: a delay cannot be negative")
    return delay_ms / 1000.0


class _Posted:
    """A cross-site collective, possibly not yet posted by the delaying worker."""

    def __init__(self, work: dist.Work | Future[dist.Work] | None) -> None:
        self._work = work

    def wait(self) -> None:
        work = self._work.result() if isinstance(self._work, Future) else self._work
        if work is not None:
            work.wait()


class CrossSiteLink:
    """Posts the collectives that cross sites on `group`, in order, `injected_delay_s()` late."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.delay_s = injected_delay_s()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mplan-inter-site") \
            if self.delay_s > 0 else None
        self.num_posted = 0
        """Cross-site collectives posted so far (messages over the slow link)."""
        self.num_bytes = 0
        """Bytes this rank's cross-site all-reduces summed so far (each tensor's size, once)."""

    def all_reduce(self, tensor: torch.Tensor) -> _Posted:
        """Sum `tensor` in place over the sites (asynchronous)."""
        self.num_posted += 1
        self.num_bytes += tensor.numel() * tensor.element_size()
        if self.group is None or self.group.size() == 1:
            return _Posted(None)
        if self._worker is None:
            return _Posted(dist.all_reduce(tensor, group=self.group, async_op=True))
        due = time.monotonic() + self.delay_s
        return _Posted(self._worker.submit(_post_when_due, due, tensor, self.group))


def _post_when_due(due: float, tensor: torch.Tensor, group: ProcessGroup) -> dist.Work:
    time.sleep(max(0.0, due - time.monotonic()))  # injected latency (MPLAN_INTER_SITE_DELAY_MS)
    return dist.all_reduce(tensor, group=group, async_op=True)


@dataclass(slots=True, eq=False)
class _Reduction:
    local: dist.Work | None
    """Phase 1, writing `shard` (None: already written)."""
    shard: torch.Tensor
    then: Callable[[], dist.Work | None] | None
    """Phase 3, run once the cross-site sum is in `shard`."""
    cross: _Posted | None = None


class SiteReductions:
    """Reductions whose site-local phase was issued, carried over the sites and through their
    last phase in the order they were added (module docstring)."""

    def __init__(self, link: CrossSiteLink) -> None:
        self.link = link
        self._queue: list[_Reduction] = []

    def add(self, local: dist.Work | None, shard: torch.Tensor,
            then: Callable[[], dist.Work | None] | None = None) -> None:
        """A reduction whose phase 1 (`local`, writing `shard`) was just issued (None: `shard` is
        ready); `then`, its phase 3. The earlier reductions' cross-site sums are posted now, and
        this one's too when it has no phase 1 to wait for."""
        self._post_cross()
        self._queue.append(_Reduction(local=local, shard=shard, then=then))
        if local is None:  # nothing to wait for: it crosses at once
            self._post_cross()

    def _post_cross(self) -> None:
        for reduction in self._queue:
            if reduction.cross is None:
                if reduction.local is not None:
                    reduction.local.wait()
                    reduction.local = None  # dropped with what its backend holds (gloo: a copy of the input)
                reduction.cross = self.link.all_reduce(reduction.shard)

    def finish(self) -> None:
        """Post every cross-site sum not yet posted, then each reduction's last phase, in order,
        and wait for all of them."""
        self._post_cross()
        last = []
        for reduction in self._queue:
            reduction.cross.wait()
            if reduction.then is not None:
                last.append(reduction.then())
        for work in last:
            if work is not None:
                work.wait()
        self._queue = []

    def abandon(self) -> None:
        """Wait for what was posted and drop the rest (after a step that failed midway)."""
        for reduction in self._queue:
            if reduction.local is not None:
                reduction.local.wait()
            if reduction.cross is not None:
                reduction.cross.wait()
        self._queue = []


__all__ = ["INTER_SITE_DELAY_ENV", "CrossSiteLink", "SiteReductions", "injected_delay_s"]
