"""Predict one `ParallelConfig`: stage cuts, step time, memory per rank, throughput.

Input: the unit costs of the model under its TP sharding (`unit_costs.py`, priced for one
micro-batch of the captured batch), the cluster, the config and the model's FLOPs. Output: an
`Estimate` with the figures a Plan carries.

Model (each term from the cost models, nothing fitted here):
- units come priced for one micro-batch of `config.mbs` sequences (the planner re-prices the graph
  at each micro-batch size, `ir.rebatch`); recomputation adds the re-run forward to backward, to
  its input-gradient part (I) under a zero-bubble schedule: the weight-gradient part (W, the units'
  `weight_backward_s`) reads what the re-run left behind and re-runs nothing; W takes at least
  `SPLIT_W_HOST_S` a parameter-reading op: the host issues it node by node (runtime/split_backward.py);
- units are cut into pp * vpp chunks by `stage_partition.partition` under each chunk's memory;
- memory per pipeline rank is `cost_models.memory_model.estimate_memory` (the one memory model) on
  the rank's parameters and per-chunk activations, with the micro-batches it holds in flight
  counted on the schedule it runs (`ir.schedule.max_in_flight` on `schedule_of(config)`, tabled
  once per schedule shape, so the closed form reads the same counts as the simulator);
- activations cross stage borders with a send/recv per micro-batch (p2p over the pipeline axis);
- DP gradient sync per rank: all-reduce of fp32 gradients (zero=0) or reduce-scatter of gradients
  plus all-gather of updated bf16 parameters (zero=1), started after the rank's last backward, so
  only its tail past the pipeline's end is exposed; TP all-reduce of partial parameter gradients;
  each DP collective priced on the links it uses (`dp_sync`: flat, flat across sites on the
  long haul, or hierarchical over sites, ZeRO sharding over a site's replicas);
  under mplan's runtime the buckets' reduction starts during the last backward (`overlapped_sync`)
  of a one-stage plan, and under a pipeline it runs at the step, after every rank's last action
  (the pipeline executor reduces gradients once the schedule is done: nothing overlaps);
  the step's loss is averaged over dp after the update (`parallel_module._flat_step`: a blocking
  all-reduce of one float64 over the whole dp group, across the sites in either layout), priced
  as one more collective in the sync (`LOSS_BYTES`: microseconds inside a site, the long haul's
  chain latency across sites);
- ZeRO-2 and ZeRO-3 (`zero_pricing.zero_collectives`), as mplan's runtime runs them (runtime/sharded_optimizer.py,
  fully_sharded.py): zero=2 reduce-scatters each bucket's gradients over DP in every micro-batch's
  backward (not once a step) and gathers the updated parameters after the step as zero=1 does;
  zero=3 also all-gathers each unit's weights before its forward and again before its backward,
  every micro-batch, or, keeping them (`keep_weights`, and always under a pipeline in mplan's
  runtime), once a step at the unit's first forward, on the pipeline's way down (serial); no
  gather after the step. Overlap as the runtime achieves it (`ZERO_OVERLAP`): mplan's gathers are
  prefetched one unit ahead (each under the compute of the unit before it in its pass, the first of
  each pass exposed), its reduce-scatters asynchronous (hidden under the backward after them, the
  last one of the step exposed); on CPU ranks neither (`ZERO_OVERLAP_CPU`: measured, the prefetch
  shortens no gloo step); nothing is assumed overlapped that the runtime does not overlap.
  Memory counts the gathered units in flight (`ZERO3_UNITS_IN_FLIGHT`, a tied embedding and head
  beside them) and the gradients whole between backward and their reduce-scatter, with the copies
  the reductions hold, at their worst moment of the step (`gradient_reductions`,
  `cost_models.memory_model.reduction_peak`); under mplan's pipelines, which reduce at the step,
  the stage's gradients whole through the step beside their shard (`grads_whole_until_step`);
- an outer loop across sites (`outer_steps = H`, inexact, `outer_pricing`): the gradients'
  all-reduce inside the site every step (overlapped with the last backward as flat DP's), the
  outer step's cross-site all-reduce of the pseudo-gradient over H, the loss averaged inside the
  site; memory adds the outer loop's anchor and momentum (`OUTER_STATE_COPIES`);
- the optimizer step is memory-bound over the rank's optimizer shard: clipping's gradient norm,
  then one multi-tensor AdamW, mplan's kernel or torch's fused one (`optimizer_time`), and under
  ZeRO-1 the copies between parameters, flat gradients and master shard (`zero1_copy_time`; under
  mplan's runtime zero 2/3's, whose reductions copy in every micro-batch: `zero23_copy_time`);
- MoE layers (`unit_experts.py`) are priced per config (`expert_pricing.py`), not by the TP solve:
  on the busiest rank of the expert-parallel group, E/ep experts a layer, their GEMMs at that
  rank's load (the `moe_imbalance` over the mean, capped by a capacity factor), a dispatch and a
  combine all-to-all per pass over the EP group (`cost_models/moe_cost.py`); expert weights count
  E/ep a layer, their gradients sync and ZeRO shards their optimizer state over
  `expert_dp = dp / ep` (`ir/mesh.py`);
- `fast=True` uses the closed form of the schedule, `fast=False` runs the event simulator on the
  same per-stage numbers (what the final ranking and `explain` use).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES, collective_time
from mplan.ir.mesh import GroupShape
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.memory_model import (FRAGMENTATION_FRACTION, BytesPerParam, MemoryBreakdown, ReductionPeak,
                                            activation_bytes_kept, backward_peak, bytes_per_param, estimate_memory,
                                            mplan_bytes_per_param)
from mplan.cost_models.simulator import PipelineCosts, SimResult, simulate
from mplan.ir.schedule import Schedule, build_schedule, check_schedule, max_in_flight_by_rank
from mplan.planner.parallel_config import DEFAULT_RUNTIME, ParallelConfig
from mplan.planner.stage_partition import Partition, partition
from mplan.planner.host_cost import host_timing
from mplan.planner.unit_costs import UnitCost, chunk_backward_s, chunk_forward_s, param_tensors
from mplan.planner.expert_pricing import UnitFigures, price_experts, rank_params
from mplan.planner.dp_sync import NOTHING, LinkUse, cross_site_all_reduce, dp_collective
from mplan.planner.outer_pricing import OUTER_STATE_COPIES, outer_loop_sync
from mplan.planner.unit_experts import UnitExperts
from mplan.planner.zero_pricing import (ZERO_OVERLAP, ZERO_OVERLAP_CPU, gathered_window, gradient_reductions,
                                        grads_whole_until_step, shared_glue,
                                        zero1_copy_time, zero23_copy_time, zero_collectives,
                                        zero_links)

LOSS_BYTES = 8
"""The step's loss averaged over dp: one float64 (`parallel_module._flat_step`)."""

ADAMW_STREAMS = 8
"""Elements an AdamW step with a grad_scale (the clip coefficient folded in, as the runtime clips)
moves per parameter: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq and
the gradient so divided, all in the dtype it steps (mplan/kernels/adamw.py, Cost; the "fewest
bytes" of benchmarks/kernel_peers/optimizer.py, which counts the same for torch's fused AdamW)."""

MPLAN_ADAMW_COPY_FRACTION: dict[int, float] = {2: 0.945, 4: 0.961}
"""Share of copy bandwidth mplan's AdamW kernel reached on the H200 with a grad_scale, by bytes per
element: fewest_bytes_ms / ms of `mplan_device_steps` under `grad_scale` in
benchmarks/results/optimizer_h200-2026-11-29.json, GPT-1.3B and Llama-1.1B averaged (bf16
5.361 / 5.667 = 0.946 and 4.243 / 4.495 = 0.944; fp32 10.721 / 11.148 = 0.962 and 8.487 / 8.829 = 0.961).
Fitted on those four rows: tests/test_fused_pricing.py's check against them holds the price to its fit
only; its held-out check refits on one model's rows and predicts the other's within 2%."""

TORCH_ADAMW_COPY_FRACTION: dict[int, float] = {2: 0.632, 4: 0.809}
"""The same for torch's fused AdamW (`torch_fused` under `grad_scale`, same file): bf16
5.361 / 8.511 = 0.630 and 4.243 / 6.693 = 0.634; fp32 10.721 / 13.248 = 0.809 and 8.487 / 10.501 = 0.808.
Fitted on those four rows, checked held out as the constant above."""

GRAD_NORM_COPY_FRACTION: dict[int, float] = {2: 0.547, 4: 0.832}
"""Share of copy bandwidth (the 4.235 TB/s of optimizer_h200-2026-11-29.json) torch's `_foreach_norm`
(LpNorm kernel), which computes clipping's global norm, reached reading the gradients in mplan's
H200 steps: bf16 1.238 ms for GPT-1.3B (0.541) and 0.959 ms for Llama-1.1B (0.553), averaged, in
benchmarks/results/step_profile_h200-2026-11-29-session3.json; fp32 1.611 ms for GPT-1.3B (0.832)
in benchmarks/results/step_profile_autocast_h200-2026-11-29-session4.json. Fitted on those three
kernel times by `fit_copy_fraction` (the copy time of the gradients' bytes at 4.235 TB/s over the
kernel's time). Held out (tests/test_held_out.py): bf16 refitted on one model's kernel predicts the
other's; fp32, fitted on one model's row, is judged only on the same kernel in the eager and
torch.compile steps of the same autocast run (same model and gradients: a repeat, not a transfer)."""


SPLIT_W_HOST_S = 0.30e-3
"""Host seconds a split weight-gradient pass (W) spends per op that reads a parameter, below which
no W runs however small its GEMMs: measured on the H200 at 1 x 2048 tokens, where the GPU waits on
the host (benchmarks/results/split_backward_h200-2026-12-02.json: W took 10.36 ms of wall time for
the 36 parameter-reading ops of 4 Llama blocks, 0.288 ms each, and 10.36 ms for the 32 of 4 GPT
blocks, 0.324 ms each, against 1.57 and 2.15 ms of kernels). At 4 x 2048 tokens the same passes took
9.6 and 11.2 ms, kernels 4.9 and 6.2 ms: the bound, 10.8 and 9.6 ms, holds there too.
Fitted by `fit_split_w_host_s` on the two 1 x 2048 rows (20.72 ms over 68 ops, 0.305 ms, to 0.30);
held out (tests/test_held_out.py): one model's row predicts the other's, the two predict 4 x 2048."""


def fit_copy_fraction(pairs: Sequence[tuple[float, float]]) -> float:
    """The rule this module's copy fractions (MPLAN_ADAMW_, TORCH_ADAMW_, GRAD_NORM_COPY_FRACTION)
    were fitted by: over (seconds the fewest bytes take at the run's copy bandwidth, seconds the
    kernel took) pairs, the mean of their ratios, to three places."""
    ratios = [fewest / measured for fewest, measured in pairs]
    return round(sum(ratios) / len(ratios), 3)


def fit_split_w_host_s(rows: Sequence[tuple[float, int]]) -> float:
    """The rule SPLIT_W_HOST_S was fitted by: over (W's wall seconds, its parameter-reading ops) of
    runs where the GPU waits on the host, all the seconds over all the ops, to 0.01 ms."""
    return round(sum(seconds for seconds, _ in rows) / sum(ops for _, ops in rows), 5)


def adamw_time(compute: ComputeCostModel, params: float, itemsize: int, *, mplan_adamw: bool) -> float:
    """Seconds of one AdamW step with a grad_scale over `params` elements in a dtype of `itemsize`
    bytes, by mplan's kernel (`mplan_adamw`) or torch's fused AdamW: one multi-tensor launch
    moving `ADAMW_STREAMS` elements a parameter at its measured share of copy bandwidth (dtypes
    wider than 4 bytes at the fp32 share, unmeasured)."""
    fraction = (MPLAN_ADAMW_COPY_FRACTION if mplan_adamw else TORCH_ADAMW_COPY_FRACTION)[min(itemsize, 4)]
    return compute.memory_bound_time(ADAMW_STREAMS * params * itemsize / fraction)


def optimizer_time(compute: ComputeCostModel, params: float, itemsize: int, *, mplan_adamw: bool) -> float:
    """Seconds of the clipped optimizer step the runtime takes (clipping is on by default,
    max_grad_norm=1.0): clipping's global gradient norm (one read of the gradients), then
    `adamw_time` with the clip coefficient as its grad_scale (mplan/runtime/grad_clip.py)."""
    norm = compute.memory_bound_time(params * itemsize / GRAD_NORM_COPY_FRACTION[min(itemsize, 4)])
    return norm + adamw_time(compute, params, itemsize, mplan_adamw=mplan_adamw)



def overlapped_sync(cluster: ClusterSpec, reduction: str, sync_s: float, last_backward_s: float,
                    grad_bytes: float, dp_group: GroupShape) -> float:
    """What is left of a gradient reduction (all-reduce at zero=0, reduce-scatter at zero=1) that
    mplan's runtime overlaps with the rank's last micro-batch backward (data_parallel.py,
    sharded_optimizer.py): the part that outlasts that backward, and at least the last bucket's,
    which starts only when backward ends."""
    last_bucket = collective_time(cluster, reduction, min(grad_bytes, DEFAULT_BUCKET_BYTES), dp_group)
    return max(sync_s - last_backward_s, last_bucket)



@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """What the evaluator needs to know about the model beyond its unit costs."""

    training_flops_per_sequence: float  # model FLOPs, forward + backward, no recomputation
    seq_len: int
    param_dtype: str  # "bf16" for mixed-precision training
    grad_dtype: str = "fp32"  # dtype gradients are accumulated and reduced in (Megatron: fp32)
    fp32_grad_copy: bool = True  # Megatron keeps an fp32 copy of 16-bit gradients; mplan's runtime does not
    # plans priced with mplan's kernels step by its AdamW kernel (mplan/kernels/adamw.py), as the runtime
    # does on CUDA; others by torch's fused AdamW (eager training)
    mplan_adamw: bool = False
    # whose optimizer memory (RUNTIMES): "megatron" (fp32 masters, grads and moments at any zero) or
    # "mplan" (mplan's runtime: zero=0 steps bf16 parameters in place, zero=1 keeps fp32 master shards)
    runtime: str = DEFAULT_RUNTIME
    stream_bytes_per_sequence: int  # one sequence's residual-stream activation (bytes, full)
    # MoE models: the token copies the busiest expert-parallel rank's experts take over the mean
    # (1.0: uniform routing); scales that rank's expert GEMMs, all-to-all and routed activations
    moe_imbalance: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    fits: bool
    step_time_s: float
    tflops_per_gpu: float  # model FLOPs (no recompute) per GPU per second, / 1e12
    mfu: float
    tokens_per_s: float
    bubble_fraction: float
    compute_s: float  # busy compute of the critical rank (collectives inside TP ops included)
    comm_s: float  # TP collectives + p2p + exposed DP sync on the critical rank
    memory: tuple[MemoryBreakdown, ...]  # per pipeline rank
    stage_bounds: tuple[tuple[int, int], ...]  # unit ranges per chunk (global stage)
    chunk_forward_s: tuple[float, ...]
    chunk_backward_s: tuple[float, ...]  # recomputation included
    chunk_weight_s: tuple[float, ...]  # the weight-gradient (W) part of chunk_backward_s
    # the gradient-accumulation part of chunk_backward_s and chunk_weight_s, per micro-batch
    # (`_accumulation_s`; zeros where none is priced)
    chunk_accumulate_s: tuple[float, ...] = ()
    p2p_s: float
    grad_sync_s: tuple[float, ...]  # per pipeline rank
    optimizer_s: float
    # MoE models: the experts' all-to-all (dispatch and combine, forward and backward, the re-run
    # forward under full recomputation) over one step on the busiest pipeline rank, seconds
    a2a_s: float = 0.0
    # zero 2/3: seconds per step their per-unit all-gathers and reduce-scatters add to the busiest
    # pipeline rank's forward and backward (what the runtime does not overlap, ZERO_OVERLAP), and
    # zero=3's gathers once a step where it keeps its weights
    zero_comm_s: float = 0.0
    # the DP gradient sync's traffic and transfer seconds per link, one step of the pipeline rank
    # whose sync is longest (`dp_sync.LinkUse`: what crosses the long haul, with sites)
    dp_links: LinkUse = LinkUse()
    experts_per_rank: int = 0  # experts of each MoE layer a rank holds (0: no MoE layers)
    moe_imbalance: float = 0.0  # the busiest EP rank's load over the mean priced (`ModelFacts`; 0.0: no MoE layers)
    reason: str = ""  # why it does not fit, if it does not
    # refused for memory (no stage cut within it, or the peak over the device); False for a refusal
    # that no memory would lift (no cut into that many chunks: the figures are of a stand-in cut)
    short_of_memory: bool = False
    # rows per chunk of the fused head + loss when the plan fits only with a chunk below the op's
    # default (`_lean_head_chunk`); None: the default
    head_chunk_rows: int | None = None
    simulation: SimResult | None = field(default=None, compare=False, repr=False)

    @property
    def peak_memory_bytes(self) -> float:
        return max(m.total_bytes for m in self.memory)


SyncMemo = dict[tuple[object, ...], tuple[float, float, LinkUse]]
"""`_sync_and_step`'s answers on one cluster, by everything they read (`_sync_key`)."""
ChunkMemo = dict[tuple[tuple[int, int], str, bool], tuple[float, float]]
"""One units list's chunk seconds (forward, backward) on one cluster, by (unit range, recomputation,
whether the host overlaps the device), where the units' own seconds are priced (below zero=2,
without experts)."""


def evaluate(config: ParallelConfig, units: Sequence[UnitCost], cluster: ClusterSpec, facts: ModelFacts, *,
             experts: Sequence[UnitExperts | None] = (), fast: bool = True,
             fragmentation: float = FRAGMENTATION_FRACTION, sync_memo: SyncMemo | None = None,
             chunk_memo: ChunkMemo | None = None) -> Estimate:
    """Predict `config`. `experts`: the MoE layers of each unit (`unit_experts`), priced at the
    config's expert parallelism (`expert_pricing.price_experts`). `fragmentation` is the allocator's
    share on top of allocated bytes (0 to compare with `torch.cuda.max_memory_allocated`, which does
    not see it). `sync_memo`: a pipeline rank's gradient sync and optimizer step kept across calls
    on `cluster` (a search asks for the same ones of thousands of configs); `chunk_memo`: the
    pipeline chunks' forward and backward seconds kept across calls on `cluster` with these same
    `units`."""
    compute = ComputeCostModel(cluster)
    has_experts = any(held is not None for held in experts)
    moe = price_experts(config, units, experts, cluster, compute, facts.moe_imbalance)
    per = _bytes_per_param(config, facts)
    bwd = [b + {"none": 0.0, "selective": u.selective_extra_s, "full": f - u.unrecomputed_forward_s}[config.recompute]
           for u, f, b in zip(units, moe.forward_s, moe.backward_s)]
    issue = host_timing(cluster)  # each op's host time queued against the device (unit_costs.chunk_*_s)
    # zero 2/3's collectives of each unit, after recomputation: a re-run forward reads the weights
    # its backward gathered; on CPU ranks gloo's collectives share the cores with the compute
    overlap = ZERO_OVERLAP[facts.runtime] if issue.overlaps else ZERO_OVERLAP_CPU
    # under mplan's pipelines zero 2/3 reduce at the step, not in backward (`grads_whole_until_step`)
    grads_whole = grads_whole_until_step(config, facts.runtime)
    zc = zero_collectives(config, cluster, per, list(zip(moe.dense_params, moe.expert_params)), overlap,
                          reduced_at_step=grads_whole)
    fwd, zero_added = moe.forward_s, [0.0] * len(units)
    if config.zero >= 2:
        fwd, bwd_zero = zc.unit_seconds(moe.forward_s, bwd)
        # what they add to each unit's micro-batch (all of them that the runtime does not overlap)
        zero_added = [f - f0 + b - b0 for f, f0, b, b0 in zip(fwd, moe.forward_s, bwd_zero, bwd)]
        bwd = bwd_zero
    wgt = moe.weight_s
    k = config.pp * config.vpp
    mesh = config.mesh
    # ZeRO shards over one site's replicas (all of dp without sites, `ir/mesh.py`)
    param_state = per.total(zero=config.zero, dp=mesh.dp_local, keep_weights=config.keep_weights,
                            grads_whole=grads_whole)
    expert_state = per.total(zero=config.zero, dp=mesh.expert_dp_local, keep_weights=config.keep_weights,
                             grads_whole=grads_whole)
    in_flight = in_flight_of(config)
    # what a unit keeps of one micro-batch under the plan's recomputation, for the stage cut's memory
    kept = [activation_bytes_kept(recompute=config.recompute, activation_bytes=saved, num_in_flight=1,
                                  selective_activation_bytes=selective, checkpoint_bytes=u.checkpoint_bytes)
            for u, saved, selective in zip(units, moe.saved_bytes, moe.selective_bytes)]

    def unit_memory(u: int, chunk: int) -> float:
        return (moe.dense_params[u] * param_state + moe.expert_params[u] * expert_state
                + kept[u] * in_flight[chunk % config.pp] / config.vpp)

    capacity = cluster.device.memory_bytes / (1 + fragmentation)
    times = [f + b for f, b in zip(fwd, bwd)]
    # One stage has no cut to choose: the peak below decides whether it fits. (The cut's memory is
    # a sum over units, which cannot see gradients replacing activations as backward runs,
    # `grads_during_backward`: it refused single-stage plans whose peak fits.)
    cut: Partition | None = (partition(times, k, memory=unit_memory, cap=capacity / config.vpp) if k > 1
                             else partition(times, 1))
    reason = ""
    if cut is None:
        cut = partition(times, k)  # the time-only cut, to price what does not fit (searched once)
        reason = NO_CUT_IN_MEMORY if cut is not None else _no_cut(len(units), k)
        cut = cut or _fallback(times, k)
    short_of_memory = reason == NO_CUT_IN_MEMORY
    # below zero=2 and without experts a chunk's seconds are its units' own: kept across calls
    memo = chunk_memo if config.zero < 2 and not has_experts else None

    def chunk_seconds(bounds: tuple[int, int]) -> tuple[float, float]:
        key = (bounds, config.recompute, issue.overlaps)
        if memo is None or key not in memo:
            seconds = (chunk_forward_s(units, fwd, bounds, serial=not issue.overlaps),
                       chunk_backward_s(units, bwd, bounds, recompute=config.recompute, serial=not issue.overlaps))
            if memo is None:
                return seconds
            memo[key] = seconds
        return memo[key]
    seconds = [chunk_seconds(bounds) for bounds in cut.bounds]
    accumulate = _accumulation_s(config, facts, compute, per, moe, cut.bounds)
    chunk_f = tuple(f for f, _ in seconds)
    chunk_b = tuple(b + a for (_, b), a in zip(seconds, accumulate))
    chunk_w = tuple(sum(wgt[lo:hi]) + a for (lo, hi), a in zip(cut.bounds, accumulate))
    if config.schedule == "zb-h1" and config.pp > 1:  # W as long as its host work at least
        host = tuple(SPLIT_W_HOST_S * sum(u.num_weight_ops for u in units[a:b]) for a, b in cut.bounds)
        chunk_b = tuple(b - w + max(w, h) for b, w, h in zip(chunk_b, chunk_w, host))
        chunk_w = tuple(max(w, h) for w, h in zip(chunk_w, host))

    pp_group = mesh.p2p_shape(cluster.gpus_per_node)
    stream = facts.stream_bytes_per_sequence * config.mbs / (config.tp if config.sp else 1)
    p2p = collective_time(cluster, "send_recv", stream, pp_group) if config.pp > 1 else 0.0

    def rank_memory(rank: int, head_rows: int | None = None) -> MemoryBreakdown:
        rank_units, dense, expert_params = holdings[rank]
        # Backward of the largest op holds its output's gradient and its input's at once; a fused
        # kernel's working memory (the head + loss's chunk of logits, `head_rows` rows) is held
        # once, in its forward.
        workspace = (max(map(workspaces.__getitem__, rank_units), default=0.0) if head_rows is None else
                     max((max(2 * units[u].largest_op_bytes, units[u].working_bytes(head_rows)) for u in rank_units),
                         default=0.0))
        sizes = [moe.dense_params[u] + moe.expert_params[u] for u in rank_units] if config.zero >= 1 else []
        gathered = 0.0
        # over groups of one mplan's runtime gathers nothing: the parameters are the shard (fully_sharded.py)
        alone = facts.runtime == "mplan" and mesh.dp_local == 1 and mesh.expert_dp_local == 1
        if config.zero == 3 and not alone:
            shared = shared_glue(moe.glue_params, rank_units)
            apart = [size - sum(n for name, n in moe.glue_params[u] if name in shared)
                     for u, size in zip(rank_units, sizes)]
            gathered = gathered_window(apart, spanning=sum(shared.values()))
        # gloo (CPU ranks) reduce-scatters a copy of its input; at zero=0 nothing is reduced apart
        reductions = gradient_reductions(config, per, [units[u] for u in rank_units], sizes,
                                         [kept[u] for u in rank_units], runtime=facts.runtime,
                                         copies_inputs=not issue.overlaps) if config.zero else NO_REDUCTION
        # mplan's runtime keeps no gradient buffer at dp=1: one micro-batch's gradients replace
        # its activations as backward runs (data_parallel.py)
        during_backward = facts.runtime == "mplan" and config.dp == 1 and config.num_micro_batches == 1 \
            and config.zero <= 1
        breakdown = estimate_memory(
            num_params=dense, per_param=per, zero=config.zero, dp=mesh.dp_local, expert_params=expert_params,
            expert_dp=mesh.expert_dp_local, keep_weights=config.keep_weights,
            gathered_params=gathered,
            grad_transient_bytes=reductions.transient_bytes, activations_beside_transient=reductions.activations_bytes,
            recompute=config.recompute,
            activation_bytes=sum(map(moe.saved_bytes.__getitem__, rank_units)) / config.vpp,
            selective_activation_bytes=sum(map(moe.selective_bytes.__getitem__, rank_units)) / config.vpp,
            checkpoint_bytes=sum(map(checkpointed.__getitem__, rank_units)) / config.vpp,
            # full recomputation re-runs one unit at a time: the largest one's activations on top
            layer_activation_bytes=max(map(moe.saved_bytes.__getitem__, rank_units), default=0),
            num_in_flight=in_flight[rank], largest_workspace_bytes=workspace, fragmentation=fragmentation,
            grads_during_backward=during_backward, grads_whole=grads_whole,
            backward_peak_bytes=_backward_peak(units, moe, kept, rank_units, per) if during_backward else None)
        if not config.outer_steps:
            return breakdown
        outer_state = OUTER_STATE_COPIES * (dense + expert_params) * per.param  # the anchor and momentum
        return replace(breakdown, optimizer_bytes=breakdown.optimizer_bytes + outer_state)

    # per unit, what each rank adds up (with `map`, in the units' order: a search does it for
    # every rank of thousands of configs): the largest working memory at the fused head's default
    # chunk, what a full recomputation keeps, the TP gradient sync's bytes
    workspaces = [max(2 * u.largest_op_bytes, u.working_bytes(None)) for u in units]
    checkpointed = [u.checkpoint_bytes for u in units]
    tp_sync_bytes = [u.tp_grad_sync_bytes for u in units]
    memory, syncs, opt = [], [], 0.0
    holdings: list[tuple[list[int], int, int]] = []  # per pipeline rank: its units, dense and expert parameters
    # ranks holding as many parameters (the middle ranks of a deep pipeline) sync and step alike
    by_params: dict[tuple[int, int, int, float | None, float], tuple[float, float, LinkUse]] = {}
    links = LinkUse()  # the traffic of the rank that sends most over the long haul (else between nodes)
    # a CPU rank's gloo reductions run on the cores its backward runs on: they take turns, nothing overlaps
    overlapped = facts.runtime == "mplan" and config.dp > 1 and config.pp == 1 and issue.overlaps
    for rank in range(config.pp):
        chunks = range(rank, k, config.pp)
        rank_units = [u for c in chunks for u in range(*cut.bounds[c])]
        dense, expert_params = rank_params(units, moe, rank_units)
        tp_sync = sum(map(tp_sync_bytes.__getitem__, rank_units))
        last_backward = sum(chunk_b[c] for c in chunks) if overlapped else None
        # the step waits for the reduce-scatters still in flight: the last unit's at most
        last_scatter = max(map(zc.scatter_s.__getitem__, rank_units), default=0.0) \
            if zc.overlap.reduce_scatters and config.zero >= 2 else 0.0  # below zero=2 there are none
        key = (dense, expert_params, tp_sync, last_backward, last_scatter)
        if key not in by_params:
            memo_key = None if sync_memo is None else _sync_key(config, facts, key)
            found = None if memo_key is None else sync_memo.get(memo_key)
            if found is None:
                found = _sync_and_step(config, cluster, compute, facts, dense=dense, experts=expert_params,
                                       tp_sync_bytes=tp_sync, last_backward_s=last_backward, last_scatter_s=last_scatter)
                if memo_key is not None:
                    sync_memo[memo_key] = found
            by_params[key] = found
        sync, step, rank_links = by_params[key]
        if config.zero >= 2:  # zero 2/3's unit collectives (below zero=2 none)
            rank_links = rank_links + zero_links(config, cluster, per, [(moe.dense_params[u], moe.expert_params[u])
                                                                       for u in rank_units], reduced_at_step=grads_whole)
        if (rank_links.inter_site_bytes, rank_links.inter_node_bytes) > (links.inter_site_bytes, links.inter_node_bytes):
            links = rank_links
        syncs.append(sync)
        opt = max(opt, step)
        holdings.append((rank_units, dense, expert_params))
        memory.append(rank_memory(rank))
    # the optimizer's host work per parameter tensor: torch's foreach AdamW (its default), or one
    # multi-tensor kernel (mplan's) priced as torch's fused one; alongside its kernels on a GPU
    tensors_s = (issue.adamw_fused_tensor_s if facts.mplan_adamw else issue.adamw_foreach_tensor_s) * max(
        param_tensors(units, rank_units) for rank_units, _, _ in holdings)
    opt = opt + tensors_s if not issue.overlaps else max(opt, tensors_s)
    head_rows = None
    if not reason:
        head_rows, chunk_f = _lean_head_chunk(units, cut.bounds, chunk_f, memory, cluster, compute, rank_memory)
    peak = max(m.total_bytes for m in memory)
    fits = not reason and peak <= cluster.device.memory_bytes
    if not reason and not fits:
        reason = "needs " + gib_versus(peak, cluster.device.memory_bytes, per=device_word(cluster.device.name))
        short_of_memory = True

    at_step = facts.runtime == "mplan" and config.pp > 1  # the sync waits for the schedule's end
    # zero=3 keeping its weights gathers each unit once a step, at its first forward: one after the
    # other down the pipeline, on the way every micro-batch waits for (serial, not overlapped)
    kept_gather = sum(zc.gather_s) if config.zero == 3 and config.keep_weights else 0.0
    costs = PipelineCosts(forward_s=chunk_f, backward_s=chunk_b, p2p_s=(p2p,) * (k - 1),
                          grad_sync_s=tuple(0.0 if at_step else syncs[c % config.pp] / config.vpp for c in range(k)),
                          optimizer_s=opt + kept_gather + (max(syncs) if at_step else 0.0), weight_s=chunk_w)
    if fast:
        step, bubble, busy = _closed_form(config, costs)
        sim = None
    else:
        sim = simulate(schedule_of(config), costs, check=False)  # schedule_of checked it once
        step, bubble, busy = sim.step_time_s, sim.bubble_fraction, sim.compute_s
    zero_comm = (max(sum(zero_added[u] for c in range(rank, k, config.pp) for u in range(*cut.bounds[c]))
                     for rank in range(config.pp)) * config.num_micro_batches if config.zero >= 2 else 0.0) + kept_gather
    tp_comm = sum((units[u].comm_forward_s + units[u].comm_backward_s)
                  for c in range(0, k, config.pp) for u in range(*cut.bounds[c])) * config.num_micro_batches
    # all-to-all passes a micro-batch runs: forward and backward, and forward again when fully recomputed
    passes = 3 if config.recompute == "full" else 2
    a2a = max(sum(moe.a2a_pass_s[u] for c in range(rank, k, config.pp) for u in range(*cut.bounds[c]))
              for rank in range(config.pp)) * passes * config.num_micro_batches if has_experts else 0.0
    sequences = config.dp * config.mbs * config.num_micro_batches
    flops = facts.training_flops_per_sequence * sequences / step
    world = config.world_size
    exposed = max(0.0, step - opt - busy / (1 - bubble + 1e-12))
    return Estimate(config=config, fits=fits, step_time_s=step, tflops_per_gpu=flops / world / 1e12,
                    mfu=flops / world / cluster.device.peak_flops("bf16"),
                    tokens_per_s=sequences * facts.seq_len / step, bubble_fraction=bubble,
                    compute_s=busy, comm_s=tp_comm + a2a + zero_comm + 2 * (config.pp - 1) * p2p + exposed,
                    memory=tuple(memory), stage_bounds=cut.bounds, chunk_forward_s=chunk_f, chunk_backward_s=chunk_b,
                    chunk_weight_s=chunk_w, chunk_accumulate_s=accumulate, p2p_s=p2p, grad_sync_s=tuple(syncs),
                    optimizer_s=opt, a2a_s=a2a,
                    zero_comm_s=zero_comm, dp_links=links,
                    experts_per_rank=moe.experts_per_rank,
                    moe_imbalance=facts.moe_imbalance if moe.experts_per_rank else 0.0, reason=reason,
                    short_of_memory=short_of_memory, head_chunk_rows=head_rows, simulation=sim)


def _accumulation_s(config: ParallelConfig, facts: ModelFacts, compute: ComputeCostModel, per: BytesPerParam,
                    moe: UnitFigures, bounds: tuple[tuple[int, int], ...]) -> tuple[float, ...]:
    """Seconds per micro-batch (averaged over the step's) each chunk's backward spends adding its
    gradients into those already held, under mplan's runtime: autograd's AccumulateGrad reads the
    held gradient and the new one and writes the sum, a memory-bound pass over every parameter of
    the chunk at each micro-batch where a gradient is already there: all but the first at dp=1
    (the first backward creates them), every one at dp > 1 (the buckets hold zeroed gradients from
    the step's start, `runtime/data_parallel.py`). Megatron's wgrad GEMMs accumulate into the fp32
    main gradient in place (gradient-accumulation fusion): no pass, none priced. Priced alike at
    every ZeRO level: zero 2/3's backward also lands in the bucket its reduce-scatter reads (and
    the search's ZeRO pruning, `search._zero1_bound`, holds because no level escapes it). On one H100 (2026-12-06,
    `hf_measure_h100-2026-12-06-qwen3.json`) a Qwen3-1.7B step replayed as a CUDA graph took 6.6 ms
    more per micro-batch beyond the first than the price without this term, at micro-batch 1 and 2
    alike: this term is 3 x 2 bytes x 1.72e9 parameters, about 3.5 ms of it."""
    m = config.num_micro_batches
    accumulations = m - 1 if config.dp == 1 else m
    if facts.runtime != "mplan" or accumulations <= 0:
        return (0.0,) * len(bounds)
    params = [sum(moe.dense_params[lo:hi]) + sum(moe.expert_params[lo:hi]) for lo, hi in bounds]
    return tuple(compute.memory_bound_time(3 * per.grad * n) * accumulations / m for n in params)


def _lean_head_chunk(units: Sequence[UnitCost], bounds: tuple[tuple[int, int], ...], chunk_f: tuple[float, ...],
                     memory: list[MemoryBreakdown], cluster: ClusterSpec, compute: ComputeCostModel,
                     memory_at: Callable[[int, int], MemoryBreakdown]) -> tuple[int | None, tuple[float, ...]]:
    """When the fused head + loss's default chunk of logits is all that keeps its pipeline rank
    over the device's memory, the largest smaller chunk that fits: its rows, and the pipeline
    chunks' forward seconds with the smaller chunk's extra GEMM and d_W time on the head's
    (`HeadChunking.seconds`). `memory` gets that rank's memory at the chosen chunk. Else (None,
    `chunk_f`) and `memory` as it was."""
    at = next((u for u, unit in enumerate(units) if unit.head is not None), None)
    capacity = cluster.device.memory_bytes
    if at is None:
        return None, chunk_f
    stage = next(c for c, (a, b) in enumerate(bounds) if a <= at < b)
    rank = stage % len(memory)
    others = max((m.total_bytes for r, m in enumerate(memory) if r != rank), default=0.0)
    if memory[rank].total_bytes <= capacity or others > capacity:
        return None, chunk_f
    head = units[at].head
    for rows in head.smaller_chunks():
        lean = memory_at(rank, rows)
        if lean.total_bytes <= capacity:
            memory[rank] = lean
            # never priced faster than the default, which the op takes for speed (the GEMM curve
            # is not monotonic in m at toy shapes of a few dozen rows)
            extra = max(0.0, head.seconds(compute, rows) - head.seconds(compute, head.default_rows))
            return rows, tuple(f + extra * (c == stage) for c, f in enumerate(chunk_f))
    return None, chunk_f


def _backward_peak(units: Sequence[UnitCost], moe: UnitFigures, kept: Sequence[float], rank_units: Sequence[int],
                   per: BytesPerParam) -> float:
    """`backward_peak` of one micro-batch over a rank's units: each keeps `kept`, works with all its
    activations but the gradients a fused kernel made in forward (those are its parameters' and
    input's gradients, counted as gradients), and makes its parameters' gradients; a glue
    parameter a later unit read too (a tied embedding) gets a second, transient gradient."""
    grads, again, made = [], [], set()
    for u in reversed(rank_units):
        if units[u].glue_params:
            names = moe.glue_params[u]
            grads.append(sum(n for _, n in names) * per.grad)
            again.append(sum(n for name, n in names if name in made) * per.grad)
            made.update(name for name, _ in names)
        else:
            grads.append((moe.dense_params[u] + moe.expert_params[u]) * per.grad)
            again.append(0.0)
    return backward_peak([kept[u] for u in rank_units],
                         [max(0.0, moe.saved_bytes[u] - units[u].held_bytes) for u in rank_units],
                         grads[::-1], again[::-1])


def state_floor_bytes(config: ParallelConfig, units: Sequence[UnitCost], facts: ModelFacts) -> float:
    """A lower bound on the parameters, gradients and optimizer state `evaluate` counts on the
    fullest pipeline rank of `config` over `units` (a model without MoE layers; the first three
    figures of a rank's `MemoryBreakdown`, so on its peak too): the mean rank's, each block's
    parameters once and each glue parameter once by name (`expert_pricing.rank_params` counts one a
    rank), at the bytes a parameter holds through the step at the config's ZeRO level
    (`BytesPerParam.total`; zero=3's gathered weights, an outer loop's state and the reductions'
    transients come on top).
    It holds at any stage cut, micro-batching and recomputation: a config whose floor exceeds the
    device does not fit, which the search knows without pricing it."""
    glue: dict[str, int] = {}
    blocks = 0
    for unit in units:
        if unit.glue_params:
            for name, n in unit.glue_params:
                glue[name] = min(n, glue.get(name, n))
        else:
            blocks += unit.num_params
    per_param = _bytes_per_param(config, facts).total(
        zero=config.zero, dp=config.mesh.dp_local, keep_weights=config.keep_weights,
        grads_whole=grads_whole_until_step(config, facts.runtime))
    return (blocks + sum(glue.values())) * per_param / config.pp


def _bytes_per_param(config: ParallelConfig, facts: ModelFacts) -> BytesPerParam:
    return (mplan_bytes_per_param(facts.param_dtype, zero=config.zero) if facts.runtime == "mplan" else
            bytes_per_param(facts.param_dtype, facts.grad_dtype, fp32_grad_copy=facts.fp32_grad_copy))


def _sync_key(config: ParallelConfig, facts: ModelFacts, rank: tuple[object, ...]) -> tuple[object, ...]:
    """Everything `_sync_and_step` reads, on one cluster, of a rank's figures `rank` (its dense and
    expert parameters, TP sync bytes, the backward it overlaps and its last reduce-scatter)."""
    return (config.dp, config.tp, config.pp, config.ep, config.cp, config.sites, config.zero, config.keep_weights,
            config.outer_steps, config.num_micro_batches, facts.param_dtype, facts.grad_dtype,
            facts.fp32_grad_copy, facts.runtime, facts.mplan_adamw, *rank)


def _sync_and_step(config: ParallelConfig, cluster: ClusterSpec, compute: ComputeCostModel, facts: ModelFacts, *,
                   dense: int, experts: int, tp_sync_bytes: int, last_backward_s: float | None,
                   last_scatter_s: float = 0.0) -> tuple[float, float, LinkUse]:
    """Seconds of one pipeline rank's gradient sync and optimizer step, and the sync's traffic on
    each link (`dp_sync`), for its `dense` parameters (synced and, under ZeRO, sharded over dp, a
    site's dp with sites) and its `experts` (the same over expert_dp, the ranks holding the same
    experts); `last_backward_s`: the backward a sync overlaps, if any.
    zero 2 and 3 reduce-scatter their gradients in every micro-batch's backward (`zero_collectives`),
    not here: the step waits only for the last of them still in flight (`last_scatter_s`), except
    under mplan's pipelines, which reduce them here as zero=1 does (`grads_whole_until_step`);
    zero 1 and 2 gather the updated parameters after the step, zero=3 never does (it gathers per
    unit, `evaluate`)."""
    per = _bytes_per_param(config, facts)
    mesh, gpn = config.mesh, cluster.gpus_per_node
    if config.outer_steps:
        return _outer_sync_and_step(config, cluster, compute, facts, per, params=dense + experts,
                                    tp_sync_bytes=tp_sync_bytes, last_backward_s=last_backward_s)
    at_step = config.zero <= 1 or grads_whole_until_step(config, facts.runtime)  # the gradients reduced here
    dp_group = mesh.group_shape("dp", gpn, cluster.num_sites)
    reduction = "reduce_scatter" if config.zero else "all_reduce"
    grads = [dp_collective(cluster, reduction, dense * per.grad, mesh, "dp"),
             dp_collective(cluster, reduction, experts * per.grad, mesh, "expert_dp")] if at_step else []
    sync = sum(g.seconds for g in grads)
    sync += collective_time(cluster, "all_reduce", tp_sync_bytes * per.grad / max(1, per.param),
                            mesh.group_shape("tp", gpn))
    if last_backward_s is not None and at_step:
        if mesh.sites == 1 and not dp_group.crosses_sites:
            sync = overlapped_sync(cluster, reduction, sync, last_backward_s, (dense + experts) * per.grad, dp_group)
        else:  # what outlasts the last backward, at least what follows the last bucket (`dp_sync`)
            sync = max(sync - last_backward_s, max(g.last_bucket_s for g in grads))
    sync += last_scatter_s
    # zero 2/3 across sites: each unit's gradients reduce-scattered inside the site (`zero_collectives`),
    # the shards' all-reduce between sites once a step
    shards = cross_site_all_reduce(cluster, (dense / mesh.dp_local + experts / mesh.expert_dp_local) * per.grad,
                                   mesh) if not at_step else NOTHING
    sync += shards.seconds
    sync += collective_time(cluster, "all_reduce", LOSS_BYTES, dp_group)  # the loss's average, after the step
    gathers = [dp_collective(cluster, "all_gather", dense * per.param, mesh, "dp"),
               dp_collective(cluster, "all_gather", experts * per.param, mesh, "expert_dp")] \
        if config.zero in (1, 2) else []  # never overlapped
    sync += sum(g.seconds for g in gathers)
    links = sum((p.links for p in (*grads, shards, *gathers)), LinkUse())
    # the dtype AdamW steps: the parameters', or ZeRO's master shard (at least fp32, sharded_optimizer.py);
    # zero 2 and 3's copies around the collectives: mplan's runtime's own, else priced as zero=1's;
    # ZeRO shards over a site's replicas (`ir/mesh.py`: dp_local, all of dp without sites)
    step_bytes = max(per.param, 4) if config.zero else per.param
    shard = dense / mesh.dp_local + experts / mesh.expert_dp_local if config.zero else dense + experts
    step = optimizer_time(compute, shard, step_bytes, mplan_adamw=facts.mplan_adamw)
    if config.zero >= 2 and facts.runtime == "mplan":  # reduced each micro-batch of a one-stage program
        reductions = config.num_micro_batches if config.pp == 1 else 1
        for held, replicas in ((dense, mesh.dp_local), (experts, mesh.expert_dp_local)):
            if held:
                step += zero23_copy_time(compute, held, replicas, per.param, zero=config.zero, reductions=reductions)
    elif config.zero:
        step += zero1_copy_time(compute, dense, mesh.dp_local, per.param)
        if experts:
            step += zero1_copy_time(compute, experts, mesh.expert_dp_local, per.param)
    return sync, step, links


def _outer_sync_and_step(config: ParallelConfig, cluster: ClusterSpec, compute: ComputeCostModel,
                         facts: ModelFacts, per: BytesPerParam, *, params: int, tp_sync_bytes: int,
                         last_backward_s: float | None) -> tuple[float, float, LinkUse]:
    """`_sync_and_step` under an outer loop across sites (zero=0, ep=1: `outer_refusal`): the
    gradients' all-reduce inside the site, overlapped with the last backward where flat DP's is,
    the outer step's share of a step (`outer_pricing.outer_loop_sync`), the loss averaged inside
    the site (the sites' models differ between outer steps); the step, AdamW over all `params`.
    The outer step's own arithmetic (a few passes over the parameters, once every H steps) is
    not priced."""
    mesh, gpn = config.mesh, cluster.gpus_per_node
    site = mesh.site_group_shape("dp", gpn)
    price = outer_loop_sync(cluster, params * per.grad, params, mesh, config.outer_steps)
    inner = price.last_bucket_s + collective_time(cluster, "all_reduce", tp_sync_bytes * per.grad / max(1, per.param),
                                                  mesh.group_shape("tp", gpn))
    if last_backward_s is not None and site.size > 1:
        inner = overlapped_sync(cluster, "all_reduce", inner, last_backward_s, params * per.grad, site)
    sync = inner + (price.seconds - price.last_bucket_s)
    if site.size > 1:
        sync += collective_time(cluster, "all_reduce", LOSS_BYTES, site)
    return sync, optimizer_time(compute, params, per.param, mplan_adamw=facts.mplan_adamw), price.links


def schedule_of(config: ParallelConfig) -> Schedule:
    """The schedule IR (per-rank action lists) a config runs: the simulator, `explain` and the
    runtime all read this one definition. Built and deadlock-checked once per shape."""
    return _checked_schedule(*_schedule_shape(config))


def in_flight_of(config: ParallelConfig) -> tuple[int, ...]:
    """Per pipeline rank, the most (chunk, micro-batch) activations it holds at once: what
    `max_in_flight` counts on the schedule `schedule_of(config)` returns (`ir.schedule`'s
    `max_in_flight_by_rank`, from the same builders' compute orders), tabled per shape: a search
    asks for a few hundred shapes thousands of times."""
    return _in_flight_table(*_schedule_shape(config))


def _schedule_shape(config: ParallelConfig) -> tuple[str, int, int, int]:
    # one stage runs its micro-batches one after the other whatever the schedule's name
    return config.schedule if config.pp > 1 else "1f1b", config.pp, config.num_micro_batches, config.vpp


@functools.lru_cache(maxsize=64)
def _checked_schedule(name: str, pp: int, m: int, vpp: int) -> Schedule:
    schedule = build_schedule(name, pp, m, vpp)
    check_schedule(schedule)
    return schedule


@functools.lru_cache(maxsize=4096)
def _in_flight_table(name: str, pp: int, m: int, vpp: int) -> tuple[int, ...]:
    return max_in_flight_by_rank(name, pp, m, vpp)


NO_REDUCTION = ReductionPeak(transient_bytes=0.0, activations_bytes=None)
"""What `gradient_reductions` holds at zero=0 (the gradients whole through the step, counted apart)."""

NO_CUT_IN_MEMORY = "cannot be cut into pipeline stages that each fit in a device's memory"
"""The reason of a plan whose units have a cut into its chunks, but none within the device's memory."""


def device_word(device: str) -> str:
    """What a cluster's devices (by their name) are called in messages: "GPU", or "CPU rank" on
    the cpu preset."""
    return "CPU rank" if device == "cpu" else "GPU"


def gib_versus(need: float, have: float, *, per: str = "GPU") -> str:
    """`80.5 GiB per GPU, has 80.0`: bytes needed against a device's, each in GiB with as many
    decimals as it takes for an amount over the device's not to read as equal to it (80.03 vs
    80.00), in MiB where even three decimals would not tell them apart."""
    for digits in (1, 2, 3):
        shown = f"{need / 2**30:.{digits}f}", f"{have / 2**30:.{digits}f}"
        if shown[0] != shown[1] or need == have:
            return f"{shown[0]} GiB per {per}, has {shown[1]}"
    return f"{need / 2**20:,.1f} MiB per {per}, has {have / 2**20:,.1f}"


def _no_cut(num_units: int, k: int) -> str:
    """The reason of a plan whose units have no cut into its k chunks at all."""
    if k > num_units:
        return f"has {k} pipeline chunks (pp*vpp) for only {num_units} units to cut"
    return f"found no cut of its {num_units} units into {k} pipeline chunk{'s' if k > 1 else ''}"


def _fallback(times: Sequence[float], k: int) -> Partition:
    bounds = tuple((min(c, len(times) - 1), min(c + 1, len(times))) for c in range(k))
    return Partition(bounds=bounds, bottleneck_s=max(times), chunk_times=tuple(times[a] for a, _ in bounds))


def _closed_form(config: ParallelConfig, costs: PipelineCosts) -> tuple[float, float, float]:
    """Step time of 1F1B-family schedules without simulation: (step, bubble fraction, busy).

    1F1B and GPipe: the slowest rank's m micro-batches plus the other stages' F + B (the first
    micro-batch's way down and back). ZB-H1 (I = B - W per stage), the larger of two paths:
      steady: the slowest rank's m micro-batches plus, for each other stage, max(F + I - W, F, I),
        the fill its deferred W's leave (the paper's (p-1)(F + I - W) while W <= F and W <= I);
      tail: rank r starts after the stages above it ran F, does its m micro-batches, of which its
        last min(r + 1, m) W's come after its last I; that I's gradient then climbs through one I
        per stage above it, and rank 0 ends with one W.
    On uniform stages with free transfers and m >= pp this is the event simulator's pipeline time
    exactly (tests/test_simulator.py states the law); on 1,000 random pipelines (F in 0.5..1.5,
    B = 2F x 0.7..1.3, W = B x 0.2..0.6, transfers up to 0.1) it was within -4% / +18% of the
    simulator for m >= pp (1F1B's form here: -2% / +25%), and -10% / +18% for m < pp.
    ZB-H1's ranks end together where 1F1B's rank r ends r backwards early, so rank r's head start
    for its grad sync is r * max(0, I - W), never more than simulated on uniform stages.
    """
    p, m, v = config.pp, config.num_micro_batches, config.vpp
    # a rank's chunks r, r + p, ...; one chunk each without interleaving (0 + x is x)
    per_rank = ([f + b for f, b in zip(costs.forward_s, costs.backward_s)] if v == 1 else
                [sum(costs.forward_s[c] + costs.backward_s[c] for c in range(r, p * v, p)) for r in range(p)])
    slowest = max(per_rank)
    weight = costs.weight_s or (0.0,) * len(costs.backward_s)
    inputs = [b - w for b, w in zip(costs.backward_s, weight)]
    zero_bubble = config.schedule == "zb-h1" and p > 1
    hop = costs.p2p_s[0] if costs.p2p_s else 0.0
    if p == 1:
        pipeline = m * slowest
    elif config.schedule == "interleaved" and v > 1:
        pipeline = m * slowest + (p - 1) * slowest / v + 2 * (p - 1) * hop
    elif zero_bubble:
        fill = [max(f + i - w, f, i) for f, i, w in zip(costs.forward_s, inputs, weight)]
        steady = m * slowest + sum(fill) - fill[per_rank.index(slowest)] + 2 * (p - 1) * hop
        above = itertools.accumulate((f + i + 2 * hop for f, i in zip(costs.forward_s, inputs)), initial=0.0)
        tail = max(way + m * per_rank[r] - min(r + 1, m) * weight[r] + (weight[0] if r else 0.0)
                   for r, way in zip(range(p), above))
        pipeline = max(steady, tail)
    else:
        fill_1f1b = sum(costs.forward_s[c] + costs.backward_s[c] for c in range(p * v)) - slowest
        pipeline = m * slowest + fill_1f1b + 2 * (p - 1) * hop
    # Rank r's last backward ends about r chunk-backwards before the pipeline does (1F1B), or r
    # times what its I outlasts its W by (ZB-H1).
    head_start = [r * (max(0.0, inputs[r] - weight[r]) if zero_bubble else costs.backward_s[r]) for r in range(p)]
    synced = costs.grad_sync_s if v == 1 else [sum(costs.grad_sync_s[c] for c in range(r, p * v, p)) for r in range(p)]
    exposed = max(max(0.0, synced[r] - head_start[r]) for r in range(p))
    busy = m * slowest
    return pipeline + exposed + costs.optimizer_s, 1.0 - busy / pipeline, busy
