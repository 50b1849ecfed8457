"""What a context-parallel plan costs (issue 34): one cp rank's ops at its slice of every sequence,
the attention's exchange priced per method with the overlap the runtime achieves, and what each
method holds in memory.

Input: a `ParallelConfig` with cp > 1, the unit costs of the graph the planner holds (`UnitCost`,
at the config's tp, sp and micro-batch) and, per unit, its attention ops (`AttentionOp`: the
rank's query, key, value and output bytes and the attention's seconds). Output: the unit costs
of one cp rank (`rank_units`), which `evaluate` prices as the config's replicas
(`replica_config`: dp * cp data-parallel ranks, as the runtime reduces gradients and shards
optimizer state), and a `ContextPrice` per step for `explain`.

Per-rank work. Head-tail chunking (`ir.context_layout`) gives every rank of a causal sequence the
same share of attention pairs, so a rank at micro-batch b does the work of b / cp whole
sequences: attention total / cp, every other op per token.
  whole-sequence graph (`mplan plan`, the search): the units at b with their device seconds and
      activation bytes divided by cp (host seconds per op unchanged; collective latency and GEMM
      efficiency at 1/cp of the rows scaled linearly too, which is small at the lengths cp serves);
  slice graph (`autoparallel(plan="cp=N")` captures S / cp tokens): the units as captured, whose
      attention sees S / cp keys, 1/cp of its share: (cp - 1) x its seconds are added.

The exchange, per attention op and micro-batch on one rank; kv = the rank's K + V bytes (heads
split over tp where they divide), a, g = the rank's attention forward, backward seconds,
t(kind, n) = `collective_time` on the cp group's `GroupShape` (order tp-cp-dp-pp: inside a node
while tp * cp <= gpus per node):

    all_gather  forward t(all_gather, cp kv), backward t(reduce_scatter, cp kv), exposed: the
                attention needs every key first (`redistribute.gather_sequence`).
                Holds (cp - 1) kv gathered keys and values, saved for backward by autograd.
    ring        forward: cp blocks of a / cp; before each of the first cp - 1 the next K, V block
                is posted to the neighbour and waited for after the block's math
                (`_RingAttention.forward`), so the step takes max(t(send_recv, kv), a / cp):
                  exposed_f = (cp - 1) max(0, t(send_recv, kv) - a / cp)
                backward: cp blocks of g / cp; block s carries the next K, V (s < cp - 1) and the
                dK, dV accumulator of block s - 1 (s > 0) on the same link, and the last
                accumulator is waited for after the loop:
                  exposed_b = sum_s max(0, t(send_recv, carried_s) - g / cp) + t(send_recv, kv)
                Holds two K, V blocks in flight forward, four backward (transient).
                Overlap only where the device runs kernels beside the host's sends (NCCL's
                P2P stream); gloo's CPU ranks share the cores: no overlap priced there.
    all_to_all  (Ulysses) q, k, v and out all-to-all'd forward, their gradients backward,
                exposed; k and v repeated cp / gcd(kv heads, cp) times first where cp does not
                divide the rank's kv heads (`_ulysses`), so their traffic and saved bytes grow
                by that factor: holds (copies - 1) kv. Needs cp | the rank's query heads.

A fully recomputed forward exchanges again (`evaluate` re-runs a unit's forward seconds, the
exchange is in them); selective recomputation keeps the attention and what it gathered.

Not priced: the runtime's context attention is plain torch (scores materialised, the ring's
diagonal block computed whole and masked), a correctness reference; it is priced as the flash
attention the planner prices for every SDPA, what a GPU run at these lengths needs.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.graph import OpNode
from mplan.ir.mesh import GroupShape
from mplan.ir.placement import Shard
from mplan.ir.strategy import Strategy
from mplan.planner.evaluate import Estimate, ModelFacts
from mplan.planner.host_cost import host_timing
from mplan.planner.op_cost import OpCoster
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.unit_costs import UnitCost

ATTENTION_OPS = ("aten.scaled_dot_product_attention.default",)
"""The attention the runtime turns into context attention (`passes/split_context.py`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionOp:
    """One attention op on one tp rank at one micro-batch, as the graph holds it (whole sequences
    or one cp rank's slice): bytes of the rank's tensors, seconds of its attention."""

    q_bytes: float
    kv_bytes: float  # K + V
    out_bytes: float
    num_heads: int  # query heads on the tp rank
    num_kv_heads: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    """One method's exchange for one attention op and one micro-batch on one cp rank."""

    forward_s: float  # exposed: on the critical path
    backward_s: float
    link_forward_s: float  # the link's busy seconds before any overlap
    link_backward_s: float
    saved_bytes: float  # held for backward beyond the rank's own tensors
    transient_bytes: float  # held while the op runs


@dataclass(frozen=True, slots=True, kw_only=True)
class MethodPrice:
    """A method over one step on the busiest pipeline rank (the figures `explain` compares)."""

    method: str
    exposed_s: float  # exchange seconds on the critical path
    link_s: float  # the link's busy seconds; link_s - exposed_s is hidden behind attention
    held_bytes: float  # saved for backward per micro-batch in flight, summed over the rank's layers
    # the plan's step and peak under this method, and whether it fits (`with_context`)
    step_time_s: float = 0.0
    peak_bytes: float = 0.0
    fits: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextEstimate(Estimate):
    """An Estimate of a cp plan with its exchange: the chosen method's and the others' beside it."""

    context: MethodPrice
    others: tuple[MethodPrice, ...] = ()


def replica_config(config: ParallelConfig) -> ParallelConfig:
    """`config` as data parallelism over dp * cp ranks (the same layout: `MeshShape.replicas`)."""
    return dataclasses.replace(config, dp=config.dp * config.cp, cp=1)


def replica_facts(facts: ModelFacts, cp: int) -> ModelFacts:
    """The model as one cp rank sees it from a whole-sequence graph: S / cp tokens per sequence,
    1/cp of its FLOPs and residual stream (throughput over dp * cp replicas comes out whole)."""
    return dataclasses.replace(facts, training_flops_per_sequence=facts.training_flops_per_sequence / cp,
                               seq_len=max(1, facts.seq_len // cp),
                               stream_bytes_per_sequence=facts.stream_bytes_per_sequence // cp)


def attention_ops(nodes: Sequence[OpNode], choice: dict[str, Strategy], coster: OpCoster) -> tuple[AttentionOp, ...]:
    """The attention ops among `nodes` on one tp rank, under the strategies of `choice`."""
    found = []
    for node in nodes:
        if node.op not in ATTENTION_OPS or node.name not in choice:
            continue
        strategy = choice[node.name]
        q, k, v, out = node.input_metas[0], node.input_metas[1], node.input_metas[2], node.outputs[0]
        split = [isinstance(p, Shard) and p.dim == 1 for p in strategy.inputs[:3]]
        n = coster.n
        cost = coster.op(node, strategy)
        found.append(AttentionOp(q_bytes=q.nbytes / (n if split[0] else 1),
                                 kv_bytes=k.nbytes / (n if split[1] else 1) + v.nbytes / (n if split[2] else 1),
                                 out_bytes=out.nbytes / (n if split[0] else 1),
                                 num_heads=q.shape[1] // (n if split[0] else 1),
                                 num_kv_heads=k.shape[1] // (n if split[1] else 1),
                                 forward_s=cost.forward_s, backward_s=cost.backward_s))
    return tuple(found)


def exchange(method: str, cp: int, op: AttentionOp, cluster: ClusterSpec, group: GroupShape,
             overlaps: bool) -> Exchange:
    """`method`'s exchange for `op`, given at one cp rank's share (module docstring)."""
    def t(kind: str, nbytes: float) -> float:
        return collective_time(cluster, kind, nbytes, group)

    kv = op.kv_bytes
    if method == "all_gather":
        forward, backward = t("all_gather", kv * cp), t("reduce_scatter", kv * cp)
        return Exchange(forward_s=forward, backward_s=backward, link_forward_s=forward, link_backward_s=backward,
                        saved_bytes=kv * (cp - 1), transient_bytes=kv * cp)
    if method == "ring":
        hop = t("send_recv", kv)
        block_f, block_b = (op.forward_s / cp, op.backward_s / cp) if overlaps else (0.0, 0.0)
        forward = (cp - 1) * max(0.0, hop - block_f)
        carried = [t("send_recv", kv * ((s < cp - 1) + (s > 0))) for s in range(cp)]
        backward = sum(max(0.0, c - block_b) for c in carried) + hop
        return Exchange(forward_s=forward, backward_s=backward, link_forward_s=(cp - 1) * hop,
                        link_backward_s=sum(carried) + hop, saved_bytes=0.0, transient_bytes=4 * kv)
    copies = cp // math.gcd(op.num_kv_heads, cp)
    moved = t("all_to_all", op.q_bytes) + t("all_to_all", op.out_bytes) + 2 * t("all_to_all", kv * copies / 2)
    return Exchange(forward_s=moved, backward_s=moved, link_forward_s=moved, link_backward_s=moved,
                    saved_bytes=kv * (copies - 1),
                    transient_bytes=op.q_bytes + kv * copies + op.out_bytes)


def rank_units(config: ParallelConfig, units: Sequence[UnitCost], attention: Sequence[tuple[AttentionOp, ...]],
               cluster: ClusterSpec, *, whole: bool) -> tuple[list[UnitCost], list[tuple[Exchange, ...]]]:
    """The units of one cp rank under `config.cp_method`, and each unit's exchanges per micro-batch.
    `attention[u]`: unit u's attention ops as the graph holds them; `whole`: the graph holds whole
    sequences (else one rank's slice, module docstring)."""
    cp = config.cp
    share = 1.0 / cp if whole else 1.0
    group = config.mesh.group_shape("cp", cluster.gpus_per_node)
    overlaps = host_timing(cluster).overlaps
    out, exchanges = [], []
    for unit, ops in zip(units, attention):
        # the rank's attention: total / cp (head-tail), from the whole graph's or the slice's seconds
        at_rank = [dataclasses.replace(op, q_bytes=op.q_bytes * share, kv_bytes=op.kv_bytes * share,
                                       out_bytes=op.out_bytes * share,
                                       forward_s=op.forward_s * (share if whole else cp),
                                       backward_s=op.backward_s * (share if whole else cp)) for op in ops]
        added_f = 0.0 if whole else sum(op.forward_s * (cp - 1) for op in ops)
        added_b = 0.0 if whole else sum(op.backward_s * (cp - 1) for op in ops)
        ex = tuple(exchange(config.cp_method, cp, op, cluster, group, overlaps) for op in at_rank)
        ex_f, ex_b = sum(e.forward_s for e in ex), sum(e.backward_s for e in ex)
        saved = sum(e.saved_bytes for e in ex)
        forward = unit.forward_s * share + added_f + ex_f
        backward = unit.backward_s * share + added_b + ex_b
        out.append(dataclasses.replace(
            unit, forward_s=forward, backward_s=backward, weight_backward_s=unit.weight_backward_s * share,
            comm_forward_s=unit.comm_forward_s * share + ex_f, comm_backward_s=unit.comm_backward_s * share + ex_b,
            saved_bytes=int(unit.saved_bytes * share + saved), selective_bytes=int(unit.selective_bytes * share + saved),
            selective_extra_s=unit.selective_extra_s * share, input_bytes=int(unit.input_bytes * share),
            largest_op_bytes=int(max([unit.largest_op_bytes * share, *(e.transient_bytes for e in ex)])),
            host_forward=unit.host_forward.with_device(unit.host_forward.device_s * share + added_f + ex_f),
            host_backward=unit.host_backward.with_device(unit.host_backward.device_s * share + added_b + ex_b)))
        exchanges.append(ex)
    return out, exchanges


def method_price(config: ParallelConfig, exchanges: Sequence[tuple[Exchange, ...]],
                 stage_bounds: tuple[tuple[int, int], ...]) -> MethodPrice:
    """`config`'s method over one step on the busiest pipeline rank: every micro-batch's exchanges of
    the units it holds (`stage_bounds`: unit ranges per chunk), a fully recomputed forward's twice
    (and nothing held for backward: full recomputation keeps the units' inputs only)."""
    full = config.recompute == "full"
    forwards = 2 if full else 1
    busiest: tuple[float, float, float] = (0.0, 0.0, 0.0)
    for rank in range(config.pp):
        held = [e for c in range(rank, len(stage_bounds), config.pp) for u in range(*stage_bounds[c])
                for e in exchanges[u]]
        exposed = sum(forwards * e.forward_s + e.backward_s for e in held)
        if exposed >= busiest[0]:
            busiest = (exposed, sum(forwards * e.link_forward_s + e.link_backward_s for e in held),
                       0.0 if full else sum(e.saved_bytes for e in held))
    m = config.num_micro_batches
    return MethodPrice(method=config.cp_method, exposed_s=busiest[0] * m, link_s=busiest[1] * m, held_bytes=busiest[2])


def with_context(replica: Estimate, config: ParallelConfig, price: MethodPrice,
                 others: tuple[MethodPrice, ...] = ()) -> ContextEstimate:
    """The replica Estimate of `config` (priced on `rank_units`) as the cp plan it is."""
    fields = {f.name: getattr(replica, f.name) for f in dataclasses.fields(replica)}
    price = dataclasses.replace(price, step_time_s=replica.step_time_s, peak_bytes=replica.peak_memory_bytes,
                                fits=replica.fits)
    return ContextEstimate(**{**fields, "config": config}, context=price, others=others)
