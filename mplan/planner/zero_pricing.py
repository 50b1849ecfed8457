"""What each ZeRO level communicates and keeps in memory, priced for one pipeline rank.

Role: the ZeRO half of `evaluate.py`'s model. Input: a `ParallelConfig` (its `zero` level, mesh and
`keep_weights`), the cluster, the bytes a parameter takes (`BytesPerParam`) and the units a rank runs.
Output: zero 2/3's per-unit collectives (`zero_collectives`, `ZeroCollectives.unit_seconds`: what
they add to each unit's forward and backward under the overlap a runtime achieves, `ZERO_OVERLAP`),
zero 1's copies around its collectives (`zero1_copy_time`; zero 2/3's, each micro-batch:
`zero23_copy_time`), their traffic per link (`zero_links`), the worst moment of the gradient
reductions (`gradient_reductions`) and the weights zero=3 holds gathered at once (`gathered_window`).

As mplan's runtime runs them (runtime/sharded_optimizer.py, fully_sharded.py): zero=1 reduce-scatters
the gradients once a step and gathers the updated parameters after it; zero=2 reduce-scatters each
bucket's gradients over DP in every micro-batch's backward; zero=3 also all-gathers each unit's
weights before its forward and again before its backward (or once a step, keeping them). Dense
weights shard over DP, the experts' over expert-DP (`ir/mesh.py`). Under a pipeline mplan's zero 2
and 3 reduce at the step instead, the stage's gradients whole until then (`grads_whole_until_step`).
Invariants: nothing is priced as overlapped that the runtime does not overlap; identical units are
priced once.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES, collective_time
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.memory_model import BytesPerParam, ReductionPeak, reduction_peak
from mplan.ir.mesh import GroupShape
from mplan.planner.dp_sync import LinkUse, link_use
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.unit_costs import UnitCost


ZERO3_UNITS_IN_FLIGHT = 2
"""Units whose gathered weights a zero=3 rank holds at once: the one computing and the next one,
prefetched one unit ahead in forward and in backward, as mplan's runtime does (its
`runtime/fully_sharded.UNITS_IN_FLIGHT`; FSDP2's default too). A window of this many consecutive
units of the rank, the largest, and beside it the parameters two units far apart read (a tied
embedding and head), which stay whole between their readers (`gathered_window`)."""

@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroOverlap:
    """Which of zero 2/3's collectives a runtime runs under compute."""

    # the all-gather of a unit's weights runs under the compute of the unit before it in its pass
    # (prefetched one unit ahead; the first unit of each pass waits for its own)
    gathers: bool
    reduce_scatters: bool  # a unit's reduce-scatter runs under the backward of the units after it


ZERO_OVERLAP: dict[str, ZeroOverlap] = {"mplan": ZeroOverlap(gathers=True, reduce_scatters=True),
                                        "megatron": ZeroOverlap(gathers=False, reduce_scatters=False)}
"""As each runtime runs zero 2/3 on GPUs (on CPU ranks: `ZERO_OVERLAP_CPU`). mplan
(runtime/fully_sharded.py, "Prefetch"): each unit's all-gather issued asynchronously when the
unit before it in the pass starts, waited for when its own starts; reduce-scatters asynchronous,
at most two outstanding (sharded_optimizer.py MAX_IN_FLIGHT), hidden under the backward that
follows them. Both as the runtime issues them, by construction: not yet measured on a GPU, where
NCCL's kernels also take SMs from the compute they run under. Megatron-LM: neither, as
Megatron-FSDP's overlap has not been measured here. An overlapped collective costs the unit it
runs under max(its compute, it), else their sum."""

ZERO_OVERLAP_CPU = ZeroOverlap(gathers=False, reduce_scatters=False)
"""Any runtime on CPU ranks (gloo): a collective's copies run on the cores the compute runs on, so
issuing it early shortens no step. Measured for mplan's prefetched gathers on 4 gloo ranks of a
2-core machine (benchmarks/results/zero3_prefetch-cpu-2026-12-06.json: a float32 Llama of 21 M
parameters at dp=4, its gathers 53% of a step before the prefetch): the prefetch cut the seconds
ranks wait in gathers by a third (1.00 to 0.66 s a step) and the step stayed as long (1.90 s
before, 1.96 s after; medians of 30 steps each, on a machine shared with other jobs)."""

ZERO_REDUCTIONS_IN_FLIGHT = 3
"""Flat gradient copies (the master dtype) the reduce-scatters hold at once, at zero 1-3: mplan's
runtime keeps at most two outstanding and makes the third's copy before waiting for the oldest
(runtime/sharded_optimizer.py `_reduce` and zero=1's `_Launches`, MAX_IN_FLIGHT = 2)."""

def zero1_copy_time(compute: ComputeCostModel, params: float, dp: int, param_bytes: int) -> float:
    """Seconds of ZeRO-1's own copies around its collectives over a rank's `params` (elements of
    `param_bytes` bytes), counted in mplan/runtime/sharded_optimizer.py: the gradients flattened
    into a zeroed fp32 buffer (write 4; read p, write 4), divided by dp when dp > 1 (read and write
    4), at dp = 1 copied into the master shard's gradient (read and write 4 per shard element), the
    master shard narrowed to the parameter dtype (read 4, write p per shard element) and the gathered
    buckets copied into the parameters (read and write p), all at copy bandwidth."""
    whole = params * (8 + 3 * param_bytes + (8 if dp > 1 else 0))
    shard = params / dp * (4 + param_bytes + (8 if dp == 1 else 0))
    return compute.memory_bound_time(whole + shard)

def zero23_copy_time(compute: ComputeCostModel, params: float, dp: int, param_bytes: int, *, zero: int,
                     reductions: int) -> float:
    """Seconds of zero 2 and 3's own copies over a rank's `params` (elements of `param_bytes`
    bytes) in one step of `reductions` gradient reductions (the micro-batches of a one-stage
    program; one under a pipeline, which reduces at the step), counted in
    mplan/runtime/sharded_optimizer.py `_reduce` and fully_sharded.py. Each reduction: the
    gradients flattened into a zeroed fp32 buffer (write 4; read p, write 4), divided by dp when
    dp > 1 (read and write 4), then added into the master shard's gradient (read 4 and 4, write 4
    per shard element). The step: the master shard narrowed to the parameter dtype (read 4, write
    p per shard element; zero=3 not where the dtypes agree: its compute shard is the master);
    zero=2 then copies the gathered buckets into the parameters (read and write p); zero=3's
    gathers are collectives (`zero_collectives`) and over a group of one copy nothing (its
    parameters are the shard). So at dp=1 zero 2/3 cost `reductions` times zero=1's
    reduction copies."""
    whole = reductions * (8 + param_bytes + (8 if dp > 1 else 0)) + (2 * param_bytes if zero == 2 else 0)
    narrow = 4 + param_bytes if zero == 2 or param_bytes < 4 else 0
    shard = reductions * 12 + narrow
    return compute.memory_bound_time(params * whole + params / dp * shard)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroCollectives:
    """zero 2/3's collectives of each unit (in order) in one micro-batch, seconds, and where they run."""

    gather_s: tuple[float, ...]  # one all-gather of the unit's weights (zero=3, before forward and backward)
    scatter_s: tuple[float, ...]  # the reduce-scatter of its gradients (zero 2 and 3)
    per_micro_batch: bool  # zero=3 gathers before every forward and backward (False: once a step)
    overlap: ZeroOverlap

    def unit_seconds(self, forward_s: Sequence[float], backward_s: Sequence[float]) -> tuple[list[float], list[float]]:
        """Each unit's forward and backward seconds with the collectives that run beside it: an
        overlapped one costs it only what outlasts its compute, the others their whole time
        (`ZERO_OVERLAP`). Prefetched gathers run one unit ahead, so unit u's forward runs beside
        u+1's gather and its backward beside u-1's; the first unit of each pass (the forward's
        first, the backward's last) waits for its own gather. A reduce-scatter is charged to its
        own unit's backward."""
        n = len(forward_s)
        gather = list(self.gather_s) if self.per_micro_batch else [0.0] * n
        scatter_hidden = self.scatter_s if self.overlap.reduce_scatters else (0.0,) * n
        scatter_shown = (0.0,) * n if self.overlap.reduce_scatters else self.scatter_s
        if not self.overlap.gathers:
            return ([f + g for f, g in zip(forward_s, gather)],
                    [max(b, r) + g + s for b, g, r, s in zip(backward_s, gather, scatter_hidden, scatter_shown)])
        ahead, behind = gather[1:] + [0.0], [0.0] + gather[:-1]
        forward = [max(f, g) for f, g in zip(forward_s, ahead)]
        backward = [max(b, g + r) + s for b, g, r, s in zip(backward_s, behind, scatter_hidden, scatter_shown)]
        if n:
            forward[0] += gather[0]
            backward[-1] += gather[-1]
        return forward, backward


def zero_collectives(config: ParallelConfig, cluster: ClusterSpec, per: BytesPerParam,
                     params: Sequence[tuple[int, int]], overlap: ZeroOverlap, *,
                     reduced_at_step: bool = False) -> ZeroCollectives:
    """Per unit (its `params`: dense and expert elements a rank holds), the collectives of one
    micro-batch at `config.zero`, each over the group that shares the unit's shards: dense weights
    over DP, the experts' over expert-DP (`ir/mesh.py`). All-gathers move the weights in the
    parameters' dtype (`per.param`: mixed precision gathers the compute dtype), reduce-scatters the
    gradients in theirs (`per.grad`); one call a unit, its whole size (nccl-tests' size: the
    gather's output, the scatter's input; zero=2's buckets of a unit add up to about the same).
    `reduced_at_step` (`grads_whole_until_step`): no reduce-scatter in backward; the gradients are
    reduced at the step, priced there as zero=1's (evaluate's `_sync_and_step`)."""
    zeros = tuple(0.0 for _ in params)
    if config.zero < 2:
        return ZeroCollectives(gather_s=zeros, scatter_s=zeros, per_micro_batch=False, overlap=overlap)
    mesh, gpn = config.mesh, cluster.gpus_per_node
    groups = _zero_groups(config, cluster)
    priced: dict[tuple[int, int], tuple[float, float]] = {}  # identical blocks priced once
    for held in params:
        if held not in priced:
            gather = sum(collective_time(cluster, "all_gather", n * per.param, g) for n, g in zip(held, groups))
            scatter = sum(collective_time(cluster, "reduce_scatter", n * per.grad, g) for n, g in zip(held, groups))
            priced[held] = (gather if config.zero == 3 else 0.0, 0.0 if reduced_at_step else scatter)
    return ZeroCollectives(gather_s=tuple(priced[h][0] for h in params), scatter_s=tuple(priced[h][1] for h in params),
                           per_micro_batch=not config.keep_weights, overlap=overlap)


def _zero_groups(config: ParallelConfig, cluster: ClusterSpec) -> tuple[GroupShape, GroupShape]:
    """The dp and expert_dp groups zero 2/3's unit collectives run over: with sites, inside the site
    (the shards cross once a step, `dp_sync.cross_site_all_reduce`); a flat plan's groups across
    sites priced there."""
    mesh, gpn = config.mesh, cluster.gpus_per_node
    return tuple(mesh.site_group_shape(axis, gpn) if mesh.sites > 1 else mesh.group_shape(axis, gpn, cluster.num_sites)
                 for axis in ("dp", "expert_dp"))  # type: ignore[return-value]


def zero_links(config: ParallelConfig, cluster: ClusterSpec, per: BytesPerParam,
               params: Sequence[tuple[int, int]], *, reduced_at_step: bool = False) -> LinkUse:
    """The traffic of one step of zero 2/3's unit collectives on a rank holding units of `params`
    (dense and expert elements): a reduce-scatter per unit and micro-batch (none where the
    gradients are `reduced_at_step`: that traffic is the step's sync), zero=3's gathers before
    each forward and backward (once a step, keeping its weights)."""
    if config.zero < 2:
        return LinkUse()
    groups, m = _zero_groups(config, cluster), (0 if reduced_at_step else config.num_micro_batches)
    gathers = 0 if config.zero == 2 else (1 if config.keep_weights else 2 * m)
    total = LinkUse()
    for held in params:
        for n, group in zip(held, groups):
            if m:
                total = total + link_use(cluster, "reduce_scatter", n * per.grad, group).times(m)
            if gathers:
                total = total + link_use(cluster, "all_gather", n * per.param, group).times(gathers)
    return total


def grads_whole_until_step(config: ParallelConfig, runtime: str) -> bool:
    """Whether zero 2/3 keep the parameters' gradients whole until the step (beside their shard)
    and reduce them there: mplan's runtime under a pipeline, whose executor adds each stage's
    gradients into `.grad` itself (runtime/split_backward.py), where the reduce-scatter hooks of
    runtime/sharded_optimizer.py never fire. Megatron-FSDP's pipelines are not known here: priced
    as it reduces without one."""
    return runtime == "mplan" and config.zero >= 2 and config.pp > 1


def gradient_reductions(config: ParallelConfig, per: BytesPerParam, units: Sequence[UnitCost],
                        sizes: Sequence[float], kept: Sequence[float], *, runtime: str,
                        copies_inputs: bool) -> ReductionPeak:
    """The worst moment of a rank's gradient reductions (`memory_model.reduction_peak`), for its
    units `units` of `sizes` local elements and `kept` bytes of one micro-batch's activations each.
    mplan's runtime (runtime/sharded_optimizer.py): zero=3's buckets are its units, zero 1 and 2's
    `DEFAULT_BUCKET_BYTES` of parameters (the largest parameter alone where it is larger) cut in the
    units' order (data_parallel.split_into_buckets), each complete once backward has passed the
    first unit it holds a parameter of; under a pipeline they are reduced at the step, the
    activations gone (zero 2/3 dropping the whole gradients bucket by bucket,
    `grads_whole_until_step`); `copies_inputs`: the backend copies a reduce-scatter's input (gloo, on CPU
    ranks). Megatron-LM's runtime: zero=1 reduces its gradient buffer in place; zero 2/3 a bucket's
    gradients and `ZERO_REDUCTIONS_IN_FLIGHT` copies beside all the activations (not walked)."""
    if config.zero == 0 or not sizes:
        return ReductionPeak(transient_bytes=0.0, activations_bytes=None)
    if runtime != "mplan":
        if config.zero == 1:
            return ReductionPeak(transient_bytes=0.0, activations_bytes=None)
        largest = max(u.largest_param for u in units)
        bucket = max(sizes) if config.zero == 3 else min(sum(sizes), max(DEFAULT_BUCKET_BYTES / per.param, largest))
        return ReductionPeak(transient_bytes=bucket * (per.grad + ZERO_REDUCTIONS_IN_FLIGHT * max(per.param, 4)),
                             activations_bytes=None)
    one_stage = config.pp == 1
    return _walked_reductions(config.zero, per, tuple(sizes), tuple(u.largest_param for u in units),
                              tuple(kept) if one_stage else None, config.mesh.dp_local,
                              min(config.num_micro_batches, 2) if one_stage else 1, copies_inputs,
                              grads_whole_until_step(config, runtime))


@functools.lru_cache(maxsize=4096)
def _walked_reductions(zero: int, per: BytesPerParam, sizes: tuple[float, ...], largest: tuple[int, ...],
                       kept: tuple[float, ...] | None, dp: int, micro_batches: int,
                       copies_inputs: bool, grads_whole: bool = False) -> ReductionPeak:
    """`gradient_reductions` for mplan's runtime, once per rank shape (`kept` None: reduced at the
    step, the activations gone; two micro-batches walk as many as more)."""
    if zero == 3:
        buckets, first_unit = list(sizes), list(range(len(sizes)))
    else:
        cap = DEFAULT_BUCKET_BYTES / per.param
        buckets, first_unit, filled = [], [], cap
        for u, (size, alone) in enumerate(zip(sizes, largest)):
            if alone > cap:  # a parameter larger than a bucket has one of its own
                buckets.append(float(alone))
                first_unit.append(u)
                size, filled = size - alone, cap
            while size > 0:
                if filled >= cap:
                    buckets.append(0.0)
                    first_unit.append(u)
                    filled = 0.0
                take = min(size, cap - filled)
                buckets[-1] += take
                filled += take
                size -= take
    before = list(itertools.accumulate(kept, initial=0.0)) if kept is not None else [0.0] * (len(sizes) + 1)
    return reduction_peak(buckets[::-1], [before[u] for u in first_unit][::-1], zero=zero, per_param=per,
                          copy_bytes=max(per.param, 4), replicas=dp, outstanding=ZERO_REDUCTIONS_IN_FLIGHT - 1,
                          micro_batches=micro_batches, activation_bytes=before[-1], backend_copies=copies_inputs,
                          grads_whole=grads_whole)


def gathered_window(sizes: Sequence[float], width: int = ZERO3_UNITS_IN_FLIGHT, *, spanning: float = 0.0) -> float:
    """The most elements zero=3 holds gathered at once: `width` consecutive units of `sizes` (all
    of them when fewer), plus `spanning`, the elements of parameters that units far apart read (a
    tied embedding and head, whole from its first reader to its last), which `sizes` leave out."""
    if len(sizes) <= width:
        return float(sum(sizes)) + spanning
    return float(max(sum(sizes[i:i + width]) for i in range(len(sizes) - width + 1))) + spanning


def shared_glue(glue_params: Sequence[Sequence[tuple[str, int]]], indices: Sequence[int]) -> dict[str, int]:
    """Glue parameters (name -> local elements) that more than one of the units `indices` reads
    (`glue_params`: per unit, its glue parameters' names and local elements): a tied embedding and
    head on a rank that runs both, which zero=3 keeps whole between its readers (`gathered_window`)."""
    seen: set[str] = set()
    shared: dict[str, int] = {}
    for u in indices:
        for name, n in glue_params[u]:
            if name in seen:
                shared[name] = n
            seen.add(name)
    return shared
