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
  whole-sequence graph (`mplan plan`, the search): the units at the micro-batch m of whole
      sequences nearest below the rank's b / cp (`whole_batch`), their device seconds and
      activation bytes times b / (cp m). Where cp divides b that is 1: the units at m = b / cp have
      the rank's rows in every GEMM, its attention pairs and its K, V bytes, so its GEMM
      efficiency, launches and collective latency are priced as it runs them. Otherwise the units
      are scaled: up from m where b > cp, down from one sequence where b < cp, other ops linearly
      (host seconds per op unchanged) and each linear's forward and both backward GEMMs re-priced
      at the rank's rows (`gemm_rows`: a linear scaling keeps the graph's GEMM efficiency, higher
      at more rows). MoE layers (ep=1: every expert on every rank) are priced at the tokens the
      rank routes (`rank_experts`). Scaled down from b instead, a cp=8 rank of 8 sequences of
      8192 tokens was priced 3.8% below one sequence on one rank, the same rows (a 4-layer
      8B-wide Llama, H100: 125.0 against 129.9 ms), and llama3-8b at 8192 tokens on 64 H100s
      chose cp=8 over plain data parallelism;
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

The loss's token statistics (an MoE load-balancing loss's token means, `ir.token_statistics`):
each is all-reduced over the cp group once per micro-batch (`passes/split_context.ContextStatistic`),
and its gradient once more backward where one flows into it (a mean of router probabilities; not a
histogram of the routed choices, integers cast):

    statistics  forward  sum_s t(all_reduce, bytes_s), backward  sum over those with a gradient,
                exposed (the loss waits for them), added to the device seconds of the unit that
                computes them (hidden behind the host where that unit is host-bound, as any)

a few [experts] vectors, so latency alone in practice (`token_statistic_ops`;
tests/test_cp_statistics_pricing.py).

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

import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.dtypes import canonical_dtype
from mplan.ir.graph import Graph, OpNode
from mplan.ir.mesh import GroupShape
from mplan.ir.op_table import LOSS_CASTS, op_packet
from mplan.ir.placement import Shard, local_shape
from mplan.ir.sharding import UnexecutableStrategy
from mplan.ir.strategy import Strategy
from mplan.ir.token_statistics import TokenStatistics, token_statistics
from mplan.planner.evaluate import Estimate, ModelFacts
from mplan.planner.host_cost import host_timing
from mplan.planner.op_cost import OpCoster
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.unit_costs import UnitCost
from mplan.planner.unit_experts import UnitExperts

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
class TokenStatistic:
    """One token statistic of the loss (`ir.token_statistics`: a mean or partial sum over a rank's
    tokens) that the runtime all-reduces over the cp group once per micro-batch."""

    node: str  # the graph node computing it (its unit holds the exchange)
    nbytes: float
    grad: bool  # a gradient flows into it: its backward all-reduces that too


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


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearGemm:
    """One linear's GEMM on one tp rank as the graph holds it: rows (tokens), columns, contracted."""

    rows: int
    cols: int
    depth: int
    dtype: str
    weight_grad: bool  # a parameter's: its backward computes the weight gradient too


def linear_gemms(nodes: Sequence[OpNode], choice: dict[str, Strategy], coster: OpCoster) -> tuple[LinearGemm, ...]:
    """The linears among `nodes` on one tp rank under the strategies of `choice` (as `OpCoster`
    prices them: rows the product of the input's leading dims, FP8 linears left out)."""
    found = []
    for node in nodes:
        if node.kind != "matmul" or op_packet(node.op) != "linear" or node.name not in choice \
                or node.name in coster.fp8_linears:
            continue
        a, b = (local_shape(m.shape, p, coster.n) for m, p in zip(node.input_metas[:2], choice[node.name].inputs))
        found.append(LinearGemm(rows=math.prod(a[:-1]), cols=b[0], depth=a[-1],
                                dtype=canonical_dtype(node.output.dtype), weight_grad=bool(node.params)))
    return tuple(found)


def gemm_rows(gemms: Sequence[LinearGemm], share: float, compute: ComputeCostModel) -> tuple[float, float]:
    """Forward and backward seconds the linears `gemms` take at `share` of their rows beyond
    `share` of their seconds at the graph's rows (>= 0 where efficiency grows with rows): what a
    linear scaling of the units leaves out (module docstring)."""
    def times(m: int, g: LinearGemm) -> tuple[float, float]:
        forward = compute.matmul_time(m, g.cols, g.depth, g.dtype)
        backward = compute.matmul_time(m, g.depth, g.cols, g.dtype) + \
            (compute.matmul_time(g.cols, g.depth, m, g.dtype) if g.weight_grad else 0.0)
        return forward, backward
    added_f = added_b = 0.0
    for g in gemms:
        rows = max(1, round(g.rows * share))
        (f, b), (f0, b0) = times(rows, g), times(g.rows, g)
        added_f, added_b = added_f + f - share * f0, added_b + b - share * b0
    return added_f, added_b


def rank_experts(experts: Sequence[UnitExperts | None], share: float) -> tuple[UnitExperts | None, ...]:
    """The MoE layers of one cp rank from a whole-sequence graph's (`unit_experts`, ep=1): `share`
    of their tokens, the seconds the units hold for them and their routed activations (the units
    are scaled so too, `rank_units`), so `evaluate` prices the experts at the tokens the rank
    routes, its own. A block type's instances keep sharing one record."""
    scaled: dict[int, UnitExperts] = {}
    for held in experts:
        if held is not None and id(held) not in scaled:
            scaled[id(held)] = dataclasses.replace(
                held, layers=tuple(dataclasses.replace(layer, tokens=max(1, round(layer.tokens * share)))
                                   for layer in held.layers),
                held_forward_s=held.held_forward_s * share, held_backward_s=held.held_backward_s * share,
                held_weight_s=held.held_weight_s * share,
                routed_saved_bytes=tuple(int(b * share) for b in held.routed_saved_bytes))
    return tuple(None if held is None else scaled[id(held)] for held in experts)


def splits_loss(graph: Graph) -> bool:
    """Whether `passes/split_context` can make the graph's loss exact over the cp ranks: a token-mean
    cross-entropy, alone or beside terms computed from token means (an MoE load-balancing loss),
    as `ir.token_statistics` reads them off the captured program (their all-reduces are priced,
    `token_statistic_ops`). A graph without its program (read from a file) is asked the narrower
    question: its last op, casts aside, a cross-entropy."""
    program = getattr(graph, "program", None)
    if program is None:
        for node in reversed(graph.nodes):
            if node.op not in LOSS_CASTS:
                return node.op == "aten.cross_entropy_loss.default"
        return False
    return _statistics(program) is not None


def token_statistic_ops(graph: Graph) -> tuple[TokenStatistic, ...]:
    """The loss's token statistics that cp all-reduces (module docstring): each one's bytes, and
    whether a gradient flows into it (dataflow from a parameter through floating-point values: a
    histogram of routed choices, integer indices cast, carries none). Empty for a graph without its
    program or a loss cp cannot split (`splits_loss`)."""
    program = getattr(graph, "program", None)
    found = _statistics(program) if program is not None else None
    if found is None:
        return ()
    params = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "PARAMETER"}
    carries: dict[torch.fx.Node, bool] = {}
    for node in program.graph.nodes:  # topological: inputs first
        val = node.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        carries[node] = floating and (node.name in params or any(carries.get(i, False) for i in node.all_input_nodes))
    return tuple(TokenStatistic(node=n.name, nbytes=float(n.meta["val"].numel() * n.meta["val"].element_size()),
                                grad=carries[n]) for n in (*found.means, *found.sums))


def statistics_exchange(ops: Sequence[TokenStatistic], cluster: ClusterSpec, group: GroupShape) -> Exchange:
    """The all-reduces of `ops` over the cp group for one micro-batch (module docstring), exposed."""
    forward = sum(collective_time(cluster, "all_reduce", op.nbytes, group) for op in ops)
    backward = sum(collective_time(cluster, "all_reduce", op.nbytes, group) for op in ops if op.grad)
    return Exchange(forward_s=forward, backward_s=backward, link_forward_s=forward, link_backward_s=backward,
                    saved_bytes=0.0, transient_bytes=0.0)


def _statistics(program: torch.export.ExportedProgram) -> TokenStatistics | None:
    """`ir.token_statistics` of the program's one token-mean cross-entropy, or None where there is
    none or a term beside it that cp cannot make exact."""
    nodes = program.graph.nodes
    losses = [n for n in nodes if n.target is torch.ops.aten.cross_entropy_loss.default and _token_mean(n)]
    inputs = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"}
    tokens = [n for n in nodes if n.op == "placeholder" and n.name in inputs]
    if len(losses) != 1 or not tokens:
        return None
    try:
        return token_statistics(program.graph, loss=losses[0], tokens=tokens, cp=2)
    except UnexecutableStrategy:
        return None


def _token_mean(node: torch.fx.Node) -> bool:
    """A cross-entropy node that means over its tokens (reduction 1, aten's default)."""
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    return int(reduction) == 1


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


def whole_batch(mbs: int, cp: int) -> int:
    """The micro-batch of whole sequences a cp rank at `mbs` is priced from (module docstring): the
    largest divisor of `mbs` at most mbs / cp (mbs / cp itself where cp divides it), else 1."""
    return max(m for m in range(1, mbs + 1) if mbs % m == 0 and (m * cp <= mbs or m == 1))


def rank_units(config: ParallelConfig, units: Sequence[UnitCost], attention: Sequence[tuple[AttentionOp, ...]],
               cluster: ClusterSpec, *, whole: bool, batch: int,
               gemms: Sequence[tuple[LinearGemm, ...]] = (), statistics: Sequence[tuple[TokenStatistic, ...]] = (),
               ) -> tuple[list[UnitCost], list[tuple[Exchange, ...]]]:
    """The units of one cp rank under `config.cp_method`, and each unit's exchanges per micro-batch.
    `attention[u]`: unit u's attention ops as the graph holds them; `whole`: the graph holds whole
    sequences, `batch` of them per micro-batch (`whole_batch`; else one rank's slice at
    `config.mbs`, module docstring), `gemms[u]` unit u's linears (re-priced at the rank's rows),
    `statistics[u]` the loss's token statistics unit u computes (`token_statistic_ops`)."""
    cp = config.cp
    share = config.mbs / (cp * batch) if whole else 1.0
    compute = ComputeCostModel(cluster)
    # a block type's instances hold the same linears and attention: each priced once
    rows = {g: gemm_rows(g, share, compute) for g in set(gemms)} if whole else {}
    priced: dict[AttentionOp, Exchange] = {}
    group = config.mesh.group_shape("cp", cluster.gpus_per_node)
    overlaps = host_timing(cluster).overlaps

    def exchanged(ops: tuple[AttentionOp, ...]) -> tuple[tuple[Exchange, ...], float, float, float]:
        """The exchanges of a unit's attention `ops` and their forward and backward seconds and
        saved bytes: the rank's attention, total / cp (head-tail), from the whole graph's or the
        slice's seconds."""
        at_rank = [dataclasses.replace(op, q_bytes=op.q_bytes * share, kv_bytes=op.kv_bytes * share,
                                       out_bytes=op.out_bytes * share,
                                       forward_s=op.forward_s * (share if whole else cp),
                                       backward_s=op.backward_s * (share if whole else cp)) for op in ops]
        for op in at_rank:
            if op not in priced:
                priced[op] = exchange(config.cp_method, cp, op, cluster, group, overlaps)
        ex = tuple(priced[op] for op in at_rank)
        return ex, sum(e.forward_s for e in ex), sum(e.backward_s for e in ex), sum(e.saved_bytes for e in ex)
    by_ops: dict[tuple[AttentionOp, ...], tuple[tuple[Exchange, ...], float, float, float]] = {}
    out, exchanges = [], []
    for u, (unit, ops) in enumerate(zip(units, attention)):
        rows_f, rows_b = rows[gemms[u]] if rows else (0.0, 0.0)
        added_f = rows_f if whole else sum(op.forward_s * (cp - 1) for op in ops)
        added_b = rows_b if whole else sum(op.backward_s * (cp - 1) for op in ops)
        if ops not in by_ops:  # a block type's instances hold equal ops: exchanged once
            by_ops[ops] = exchanged(ops)
        ex, ex_f, ex_b, saved = by_ops[ops]
        if statistics and statistics[u]:
            reduced = statistics_exchange(statistics[u], cluster, group)
            ex, ex_f, ex_b = (*ex, reduced), ex_f + reduced.forward_s, ex_b + reduced.backward_s
        forward = unit.forward_s * share + added_f + ex_f
        backward = unit.backward_s * share + added_b + ex_b
        out.append(dataclasses.replace(
            unit, forward_s=forward, backward_s=backward, weight_backward_s=unit.weight_backward_s * share,
            comm_forward_s=unit.comm_forward_s * share + ex_f, comm_backward_s=unit.comm_backward_s * share + ex_b,
            saved_bytes=int(unit.saved_bytes * share + saved), selective_bytes=int(unit.selective_bytes * share + saved),
            selective_extra_s=unit.selective_extra_s * share, input_bytes=int(unit.input_bytes * share),
            # the head + loss runs on the rank's share of tokens; the gradients it holds are mostly
            # its weight's (held_bytes), whole on every cp rank, so they stay as they are
            unrecomputed_forward_s=unit.unrecomputed_forward_s * share,
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
