"""Intra-stage sharding of a segment (one block type, or the glue around blocks) on the
tensor-parallel axis, as an integer program.

Formulation (Alpa-style, one mesh axis of size n, the nodes of one segment of the captured graph):

    variables   x[v,s] in {0,1}        node v runs strategy s (a node with one strategy: x = 1;
                                       a follower, below: no variable of its own)
                z[u,v,s,k] in [0,1]    u runs s and its reader v reads it in layout k = (p, g):
                                       placement p forward, gradient placement g
                w[u,s,k] in [0,1]      u, produced under s, is also materialized in layout k
    minimize    sum_v sum_s c[v,s] x[v,s]  +  sum_(u,s,k) r[u,s,k] w[u,s,k]
    subject to  (1) sum_s x[v,s] = 1                            one strategy per node
                (2) sum_k z[u,v,s,k] = x[u,s]                    the edge's marginals: u's choice
                    sum_s z[u,v,s,k] = y[v,k]                    and v's, y[v,k] = sum of x[v,t]
                                                                 over v's strategies t reading u in k
                    w[u,s,k] >= z[u,v,s,k]                       for every reader v of u
                (3) sum_v sum_s m[v,s] x[v,s] <= M               per-device memory (optional)
                (4) z[u,v,s,k] = 0 where no pass turns s's output into k (R -> P: `can_transition`)

    c[v,s]   forward + backward seconds of v's op on its local shapes and its own collectives, plus
             `grad_sync_share` (1 / micro-batches) of the once-per-step TP all-reduce of the
             parameter gradients s leaves partial                                  (`_node_costs`)
    r[u,s,k] the resharding collective from s's output placement to p (forward) and from g back to
             the gradient placement s's output needs (backward), priced by the cost model
             (`_copy_cost`). All consumers that want u in the same layout share one copy, as
             the passes emit it: Megatron's single all-gather feeding q, k and v, for instance.
             Where one reader alone may want layout k, w[u,s,k] is its z (no variable of its own);
             where u or v has a single option, z is the other's x or y.
    m[v,s]   bytes v adds on one device: its parameters' shards times the optimizer-state factor,
             plus its output's shard when backward keeps it, times the micro-batches in flight
             (`_memory_coefficients`)

Why z (2) and not w >= x[u,s] + x[v,t] - 1, as until 2026-12-05: that row lets the relaxation set
every w to 0 at x = 1/2, so the Qwen3-8B block's root bound sat 30% under its optimum and HiGHS
cut and branched for 1-2.5 s per solve; with the edge's marginals the relaxation is tight on
chains and trees, and the same block solves at the root in 0.03 s. Why (4): an impossible copy
was priced at `op_cost.IMPOSSIBLE_S` (1e3 s), a coefficient 1e9 times the smallest.
Followers (`ilp_followers.py`): a node that provably loses nothing by taking the layout its one
input arrives in is folded into its producer: x[v,t] := sum of x[root,s] over the root's
strategies s that make it run t, so its c is charged to those x; it reads its input uncopied.
Scale: the objective is divided by its largest coefficient (seconds, or `tp_layout`'s collective
counts), so HiGHS's absolute tolerances (1e-6 to 1e-7) mean the same on every cost model: in
seconds (coefficients 1.6e-6 to 1e-2 on that block) one variant came back 0.5% above its optimum.
Tiers: a cost model may rank solutions lexicographically (`tp_layout`'s collective counts: fewest
collectives, then the bytes and work that break ties, `coster.tiers`); the ILP then minimizes
each tier in turn, each held at its optimum (within `TIER_SLACK`) for the next. One weighted sum
cannot do it: a tie-breaker of 1e-12 per byte sits under HiGHS's tolerances (1e-7 of the
largest coefficient), so among equal counts the solver returned whichever vertex it reached
first (a TP=2 Hugging Face Llama's head by rows, its logits all-reduced, against Megatron's head
by vocabulary that moves 6 KB less; the fused head + loss needs the latter). c and r above are
then vectors, one entry per tier; the fold's dominance test adds them up with the model's own
weights, which implies dominance in every tier while one node's tie-breakers stay under one
collective.

Edges to values outside the segment (its input, buffers, its outputs) have one fixed endpoint and
fold into c. Values crossing the border with the residual stream's shape take the boundary
placement (R, or S(seq) under sequence parallelism), so consecutive segments compose; one solve
serves every instance of a block type.
Solved with HiGHS through PuLP when available (it was ~9x faster than CBC here), else CBC.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from mplan.ir.graph import BlockType, Graph, OpNode, TensorMeta
from mplan.ir.op_table import persistent_inputs, rule_for
from mplan.ir.placement import Placement, R, can_transition, grad_placement
from mplan.ir.strategy import Strategy
from mplan.fusion.entry import FusedSave
from mplan.planner.fused_pricing import extra_saved_bytes
from mplan.planner.ilp_followers import Follower, Layout, find_followers
from mplan.planner.op_cost import OpCoster, partial_param_grad_bytes
from mplan.planner.op_registry import shard_bytes, strategies_for


GAP = 1e-7
"""Relative gap at which a solve stops: HiGHS's default, 1e-4, let a Mistral-7B epilogue stop 3.1e-5
above its optimum; the tight relaxation (2) closes these problems at the root, so the exact optimum
costs nothing more."""


def _load_pulp() -> tuple[Any, tuple[Any, ...]]:
    """PuLP and the solvers to try in turn: HiGHS through PuLP where it is installed, else CBC.

    HiGHS runs on one thread. Its MIP solver runs only symmetry detection, clique-table queries and
    the analytic centre in parallel (HiGHS's documentation, "Parallelism"), and one thread found the
    same solutions (every segment ILP of the gpt3-175b and llama3-8b searches, at every TP degree
    and micro-batch size); on these problems of tens to hundreds of binaries a second worker mostly
    waits, and charged the 2-core machine twice the CPU time (gpt3-175b on 128 DGX A100: 1.85 s of
    CPU for 66 solves with two threads, 0.94 s with one). HiGHS sizes one scheduler per calling
    thread on its first run there; on a thread where HiGHS ran earlier with another thread count,
    a one-thread run fails without solving and the solve is repeated by a HiGHS that leaves the
    thread count to that scheduler.

    Imported on a thread of its own: importing PuLP imports its optional solver packages, and
    PuLP keeps each failed import's exception, with its traceback and so every frame on the
    stack at the time, for later messages. On the caller's stack those frames would be the user's
    and mplan's (the script that first touched `mplan.autoparallel`, the planner with its graph)
    and would keep the model, its optimizer state and the graph alive for the rest of the process
    (seen on the H200: 18 GiB left allocated after `del pm, model`)."""
    loaded: dict[str, Any] = {}

    def load() -> None:
        import pulp

        loaded["pulp"] = pulp
        loaded["solvers"] = ((pulp.HiGHS(msg=False, threads=1, gapRel=GAP), pulp.HiGHS(msg=False, gapRel=GAP))
                             if "HiGHS" in pulp.listSolvers(onlyAvailable=True)
                             else (pulp.PULP_CBC_CMD(msg=False, gapRel=GAP),))
    thread = threading.Thread(target=load, name="mplan-import-pulp")
    thread.start()
    thread.join()
    if "solvers" not in loaded:
        raise ImportError("mplan's planner needs PuLP (pip install pulp; highspy makes it faster)")
    return loaded["pulp"], loaded["solvers"]


pulp, _SOLVERS = _load_pulp()
_NO_PRESOLVE = _SOLVERS[-1] if len(_SOLVERS) == 1 else pulp.HiGHS(msg=False, gapRel=GAP, presolve="off")
"""The solver of a later tier found infeasible (`_solve_in_tiers`); CBC where HiGHS is missing."""


class ShardingInfeasible(RuntimeError):
    """No assignment of strategies fits the memory budget."""


@dataclass(frozen=True, slots=True)
class OpPrice:
    """What the objective charges one node under its chosen strategy: forward + backward seconds of
    one instance and one micro-batch, split into the op's compute, its own collectives (with its
    `grad_sync_share` of the TP all-reduce of partial parameter gradients) and the resharding copies
    charged to it (`_copy_charges`). A segment's `forward_s + backward_s` is their sum over its nodes."""

    compute_s: float
    comm_s: float
    reshard_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentSharding:
    """The solved sharding of a segment: a strategy per node and what one instance costs."""

    segment: str  # block type name, or "prologue"/"epilogue"/"glue.N"
    axis_size: int
    boundary: Placement  # placement of the block's input and output activations
    choice: dict[str, Strategy] = field(hash=False)  # node name -> strategy
    forward_s: float  # compute + resharding, one instance, one micro-batch
    backward_s: float
    comm_forward_s: float  # the collectives' share of forward_s
    comm_backward_s: float
    param_bytes: int  # local parameter bytes of one instance (captured dtype)
    tp_grad_sync_bytes: int  # replicated parameters with partial gradients: all-reduced over TP per step
    saved_bytes: int  # local activation bytes one instance keeps for backward, per micro-batch
    objective_s: float
    op_prices: dict[str, OpPrice] = field(default_factory=dict, hash=False)  # node name -> its share of objective_s
    solve_seconds: float = 0.0
    solver: str = "none"  # "none": priced, not solved (a fixed assignment)
    num_variables: int = 0

    def placements(self) -> dict[str, str]:
        return {name: str(s) for name, s in self.choice.items()}


@dataclass(slots=True)
class _Problem:
    graph: Graph
    name: str
    nodes: list[OpNode]
    strategies: dict[str, list[Strategy]]
    stream_shape: tuple[int, ...] | None
    outputs: dict[str, Placement]  # segment node -> placement required by consumers outside


def stream_meta(graph: Graph) -> TensorMeta | None:
    """The residual stream: the activation the main block type takes and hands on."""
    if not graph.block_types:
        return None
    block = max(graph.block_types, key=lambda b: b.num_instances)
    inside = set(block.template)
    for v in graph.nodes_of(block.template):
        for a in v.inputs:
            if a not in inside and a not in graph.params and (meta := value_meta(graph, a)) is not None \
                    and len(meta.shape) >= 2 and not meta.dtype.startswith("int"):
                return meta
    return None


def stream_shape(graph: Graph) -> tuple[int, ...] | None:
    meta = stream_meta(graph)
    return None if meta is None else meta.shape


StrategyFilter = Callable[[OpNode, Strategy], bool]


def _problem(graph: Graph, name: str, node_names: Sequence[str], n: int, boundary: Placement,
             allow: StrategyFilter | None = None) -> _Problem:
    nodes = list(graph.nodes_of(node_names))
    inside = {v.name for v in nodes}
    consumers: dict[str, set[str]] = {}
    for v in graph.nodes:
        for a in v.inputs:
            consumers.setdefault(a, set()).add(v.name)
    shape = stream_shape(graph)
    outputs = {v.name: (boundary if v.outputs and v.output.shape == shape else R)
               for v in nodes if consumers.get(v.name, set()) - inside}
    return _Problem(graph=graph, name=name, nodes=nodes,
                    strategies={v.name: _allowed(v, strategies_for(v, n), allow) for v in nodes},
                    stream_shape=shape, outputs=outputs)


def _allowed(node: OpNode, strategies: list[Strategy], allow: StrategyFilter | None) -> list[Strategy]:
    kept = [s for s in strategies if allow is None or allow(node, s)]
    return kept or strategies[:1]  # the replicated strategy always remains


def value_meta(graph: Graph, name: str) -> TensorMeta | None:
    """Metadata of a value by name: a node's (first) output or a graph input; None otherwise."""
    if name in graph:
        node = graph.node(name)
        return node.output if node.outputs else None
    return graph.graph_inputs.get(name)


def _fixed_input(problem: _Problem, name: str, boundary: Placement) -> Placement:
    meta = value_meta(problem.graph, name)
    return boundary if meta is not None and meta.shape == problem.stream_shape else R


def _node_costs(problem: _Problem, coster: OpCoster, grad_sync_share: float) -> dict[str, list[tuple[float, ...]]]:
    """Per node and strategy: (forward s, backward s, forward comm s, backward comm s); the
    communication is included in the first two."""
    metas = {k: p.meta for k, p in problem.graph.params.items()}
    return {v.name: _node_costs_of(v, problem.strategies[v.name], coster, grad_sync_share, metas)
            for v in problem.nodes}


def _node_costs_of(v: OpNode, strategies: Sequence[Strategy] | Strategy, coster: OpCoster,
                   grad_sync_share: float, metas: dict[str, TensorMeta]) -> list[tuple[float, ...]]:
    row = []
    for s in strategies if isinstance(strategies, (list, tuple)) else [strategies]:
        op = coster.op(v, s)
        own = coster.op_comm(s)
        sync = grad_sync_share * coster.collective("all_reduce", partial_param_grad_bytes(v, s, metas))
        row.append((op.forward_s, op.backward_s + sync, own, own + sync))
    return row



def _uses(problem: _Problem) -> dict[str, list[tuple[str, int]]]:
    """Every non-parameter value read by the segment, with its (consumer, argument slot) pairs."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for v in problem.nodes:
        for slot, a in enumerate(v.inputs):
            if a not in problem.graph.params and value_meta(problem.graph, a) is not None:
                uses.setdefault(a, []).append((v.name, slot))
    return uses


def _copy_cost(coster: OpCoster, meta: TensorMeta, out: Placement, layout: Layout) -> tuple[float, float]:
    place, grad = layout
    return coster.reshard(meta, out, place), coster.reshard(meta, grad, grad_placement(out))


def _memory_coefficients(problem: _Problem, n: int, param_state_factor: float,
                         activation_factor: float) -> dict[str, list[float]]:
    """m[v,s]: v's parameter shards x `param_state_factor`, plus x `activation_factor` what
    `_saved_bytes` charges v alone under s: its output's shard when backward keeps it and its own
    side tensors (statistics, logsumexp). The copies consumers keep of resharded values depend on
    two nodes' strategies at once and are not in this linear bound."""
    graph = problem.graph
    saved_roots = {graph.storage_root(s) for v in problem.nodes for s in v.saved}
    coeff: dict[str, list[float]] = {}
    for v in problem.nodes:
        row = []
        for s in problem.strategies[v.name]:
            m = sum(shard_bytes(graph.params[name].meta, s.inputs[v.inputs.index(name)], n)
                    for _, name in v.params) * param_state_factor
            kept = v.saved_extra_bytes // (n if s.split else 1)
            if v.name in saved_roots and v.outputs:
                kept += shard_bytes(v.output, s.output, n)
            row.append(m + kept * activation_factor)
        coeff[v.name] = row
    return coeff


def solve_block_sharding(graph: Graph, block: BlockType, coster: OpCoster, boundary: Placement,
                         **options: Any) -> SegmentSharding:
    """The sharding of one block type: solved on its first traced instance, valid for all."""
    return solve_segment_sharding(graph, block.name, block.template, coster, boundary, **options)


def solve_segment_sharding(graph: Graph, name: str, node_names: Sequence[str], coster: OpCoster,
                           boundary: Placement, *, allow: StrategyFilter | None = None,
                           grad_sync_share: float = 1.0,
                           memory_budget_bytes: float | None = None, param_state_factor: float = 1.0,
                           activation_factor: float = 1.0) -> SegmentSharding:
    """Choose a strategy for every node of a segment minimizing its forward + backward time.

    `memory_budget_bytes` bounds sum m[v,s] x[v,s] (parameter bytes x `param_state_factor` +
    saved activations x `activation_factor`); None leaves memory to the outer search.
    """
    n = coster.n
    start = time.perf_counter()
    problem = _problem(graph, name, node_names, n, boundary, allow)
    if memory_budget_bytes is None and all(len(ss) == 1 for ss in problem.strategies.values()):
        # nothing to choose (tp=1): priced, not solved
        return _price(problem, {v: ss[0] for v, ss in problem.strategies.items()}, coster, boundary,
                      grad_sync_share, solve_seconds=time.perf_counter() - start)
    node_cost = _node_costs(problem, coster, grad_sync_share)
    uses = _uses(problem)
    copy = _copy_pricer(problem, coster)
    tiers: Sequence[OpCoster] = getattr(coster, "tiers", (coster,))  # see "Tiers" in the module docstring
    tier_costs = [node_cost] if len(tiers) == 1 else [_node_costs(problem, t, grad_sync_share) for t in tiers]
    tier_copies = [copy] if len(tiers) == 1 else [_copy_pricer(problem, t) for t in tiers]
    # the fold's proof compares prices only: under a memory bound the problem is solved unfolded
    followers = {} if memory_budget_bytes is not None else find_followers(
        problem.nodes, problem.strategies, uses, problem.outputs,
        {v: [c[0] + c[1] for c in row] for v, row in node_cost.items()},
        lambda u, out, layout: sum(copy(u, out, layout)))
    lp = pulp.LpProblem(f"shard_{n}", pulp.LpMinimize)
    x = _choice_terms(problem, followers)
    objective: list[tuple[tuple[float, ...], Any]] = [
        (tuple(costs[v][j][0] + costs[v][j][1] for costs in tier_costs), term)
        for v in node_cost for j, term in enumerate(x[v]) if term is not None]
    for v, terms in x.items():
        if v not in followers and len(terms) > 1:
            lp += pulp.lpSum(terms) == 1
    for ui, u in enumerate(uses):
        def price(out: Placement, layout: Layout, u: str = u) -> tuple[float, ...]:
            return tuple(sum(priced(u, out, layout)) for priced in tier_copies)
        objective += _copy_terms(lp, str(ui), _outs(problem, x, u, boundary),
                                 _readers(problem, x, followers, u, uses[u]), price)
    if memory_budget_bytes is not None:
        mem = _memory_coefficients(problem, n, param_state_factor, activation_factor)
        lp += pulp.lpSum(c * term for v in x for c, term in zip(mem[v], x[v])) <= memory_budget_bytes
    status, solver = _solve_in_tiers(lp, objective, len(tiers))
    if pulp.LpStatus[status] != "Optimal":
        raise ShardingInfeasible(f"{name} on a tensor-parallel axis of {n}: no sharding fits "
                                 f"{memory_budget_bytes / 2**30:.2f} GiB" if memory_budget_bytes
                                 else f"{name}: solver status {pulp.LpStatus[status]}")
    index: dict[str, int] = {}
    for v, terms in x.items():
        follow = followers.get(v)
        index[v] = follow.pick[index[follow.root]] if follow else 0 if len(terms) == 1 else _argmax(terms)
    choice = {v: problem.strategies[v][i] for v, i in index.items()}
    return _price(problem, choice, coster, boundary, grad_sync_share,
                  solve_seconds=time.perf_counter() - start, solver=solver.name, num_variables=len(lp.variables()))


TIER_SLACK = 1e-6
"""How far above its optimum a tier may go while the next is minimized, on the tier's scaled
objective (coefficients at most 1): a collective fewer is at least 1 / its largest coefficient."""


def _solve_in_tiers(lp: Any, objective: Sequence[tuple[tuple[float, ...], Any]], num_tiers: int) -> tuple[int, Any]:
    """(status, solver) of minimizing each tier of `objective` in turn, each held at its optimum
    for the next ("Tiers", "Scale" in the module docstring)."""
    status, solver = pulp.LpStatusNotSolved, _SOLVERS[0]
    for tier in range(num_tiers):
        terms = [(c[tier], term) for c, term in objective if c[tier] and not isinstance(term, int)]  # constants choose nothing
        if not terms and tier:
            continue
        scale = 1.0 / max((c for c, _ in terms), default=1.0)
        expr = pulp.lpSum(c * scale * term for c, term in terms)
        lp.setObjective(expr)
        with _quiet_stdout():
            for solver in _SOLVERS:
                status = lp.solve(solver)
                if status != pulp.LpStatusNotSolved:
                    break
        if tier and pulp.LpStatus[status] == "Infeasible" and solver is not _NO_PRESOLVE:
            # impossible: the previous tier's optimum satisfies every row. HiGHS 1.16's MIP presolve
            # said so of a TP=2 Hugging Face Llama's epilogue (Megatron's layout, bf16, its assertions
            # folded), and of the same model read back from an MPS file; without presolve it solves
            with _quiet_stdout():
                status, solver = lp.solve(_NO_PRESOLVE), _NO_PRESOLVE
        if pulp.LpStatus[status] != "Optimal":
            return status, solver
        if terms and tier < num_tiers - 1:
            lp += expr <= pulp.value(expr) + TIER_SLACK
    return status, solver


def _outs(problem: _Problem, x: dict[str, list[Any]], u: str, boundary: Placement) -> list[tuple[int, Placement, Any]]:
    """(strategy index, output placement, x term) of every strategy u can run; a value from
    outside the segment has one, fixed."""
    if u not in problem.strategies:
        return [(0, _fixed_input(problem, u, boundary), 1)]
    return [(si, s.output, term) for si, (s, term) in enumerate(zip(problem.strategies[u], x[u])) if term is not None]


def _readers(problem: _Problem, x: dict[str, list[Any]], followers: Mapping[str, Follower], u: str,
             consumers: Sequence[tuple[str, int]]) -> list[dict[Layout, Any]]:
    """Per reader of u (a consumer's slot, or the border's requirement): layout k -> y[k], the sum
    of the reader's x over its strategies that read u in k (at most one of them is 1). A follower
    reads u as u lays it out, by construction: no copy, no reader here."""
    readers = []
    for v, slot in consumers:
        if v in followers:
            continue
        reads: dict[Layout, list[Any]] = {}
        for t, term in zip(problem.strategies[v], x[v]):
            if term is not None:
                reads.setdefault((t.inputs[slot], t.input_grads[slot]), []).append(term)
        readers.append({k: _sum_of(terms) for k, terms in reads.items()})
    if u in problem.outputs:
        need = problem.outputs[u]
        readers.append({(need, need): 1})
    return readers


def _copy_terms(lp: Any, tag: str, outs: list[tuple[int, Placement, Any]], readers: list[dict[Layout, Any]],
                price: Callable[[Placement, Layout], tuple[float, ...]]) -> list[tuple[tuple[float, ...], Any]]:
    """Constraints (2) and (4) of one value, and the objective's r terms: a reader's z directly
    where it alone may want the layout, else w (one copy, shared)."""
    sharers: dict[Layout, int] = {}
    for reads in readers:
        for k in reads:
            sharers[k] = sharers.get(k, 0) + 1
    terms: list[tuple[tuple[float, ...], Any]] = []
    shared: dict[tuple[int, Layout], Any] = {}
    for ri, reads in enumerate(readers):
        for (si, k), (out, z) in _pairs(lp, f"{tag}_{ri}", outs, reads).items():
            r = price(out, k)
            if not any(r):
                continue
            if sharers[k] == 1:
                terms.append((r, z))
                continue
            if (si, k) not in shared:
                shared[(si, k)] = pulp.LpVariable(f"w_{tag}_{si}_{len(shared)}", lowBound=0, upBound=1)
                terms.append((r, shared[(si, k)]))
            lp += shared[(si, k)] >= z
    return terms


def _pairs(lp: Any, tag: str, outs: list[tuple[int, Placement, Any]],
           reads: dict[Layout, Any]) -> dict[tuple[int, Layout], tuple[Placement, Any]]:
    """z[s,k] of one (value, reader) edge with constraints (2): u runs s and the reader reads it
    in layout k. Where either side has one option, z is the other side's term; an impossible
    pair (4) gets no z, which the marginals then hold at 0."""
    z: dict[tuple[int, Layout], tuple[Placement, Any]] = {}
    if len(outs) == 1 or len(reads) == 1:
        for si, out, xs in outs:
            for k, y in reads.items():
                term = y if len(outs) == 1 else xs
                if _possible(out, k):
                    z[(si, k)] = (out, term)
                elif not isinstance(term, int):  # both fixed: nothing to choose (priced as it is)
                    lp += term <= 0
        return z
    for si, out, xs in outs:
        row = []
        for k in reads:
            if _possible(out, k):
                z[(si, k)] = (out, pulp.LpVariable(f"z_{tag}_{si}_{len(z)}", lowBound=0, upBound=1))
                row.append(z[(si, k)][1])
        lp += pulp.lpSum(row) == xs
    for k, y in reads.items():
        lp += pulp.lpSum(var for (_, kk), (_, var) in z.items() if kk == k) == y
    return z


def _choice_terms(problem: _Problem, followers: Mapping[str, Follower]) -> dict[str, list[Any]]:
    """x[v,s] per node and strategy: a binary variable; 1 for a node with one strategy; for a
    follower, the sum of its root's variables of the strategies that make it run s (None where
    none does)."""
    x: dict[str, list[Any]] = {}
    for i, (v, strategies) in enumerate(problem.strategies.items()):
        follow = followers.get(v)
        if follow is not None:
            x[v] = [_sum_of([x[follow.root][r] for r, p in enumerate(follow.pick) if p == j])
                    for j in range(len(strategies))]
        elif len(strategies) == 1:
            x[v] = [1]
        else:
            x[v] = [pulp.LpVariable(f"x_{i}_{j}", cat="Binary") for j in range(len(strategies))]
    return x


def _sum_of(terms: list[Any]) -> Any:
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else pulp.lpSum(terms)


def _copy_pricer(problem: _Problem, coster: OpCoster) -> Callable[[str, Placement, Layout], tuple[float, float]]:
    """(value, its placement, layout) -> the copy's (forward s, backward s), each priced once."""
    prices: dict[tuple[str, Placement, Layout], tuple[float, float]] = {}

    def copy(u: str, out: Placement, layout: Layout) -> tuple[float, float]:
        key = (u, out, layout)
        if key not in prices:
            prices[key] = _copy_cost(coster, value_meta(problem.graph, u), out, layout)  # type: ignore[arg-type]
        return prices[key]
    return copy


def _possible(out: Placement, layout: Layout) -> bool:
    place, grad = layout
    return can_transition(out, place) and can_transition(grad, grad_placement(out))


def _price(problem: _Problem, choice: dict[str, Strategy], coster: OpCoster, boundary: Placement,
           grad_sync_share: float, **extra: Any) -> SegmentSharding:
    """Cost of a fixed assignment: its nodes plus one copy per (value, layout) its consumers use.
    The ILP's optimum is priced here too, so solving and re-pricing agree by construction."""
    graph = problem.graph
    metas = {k: p.meta for k, p in graph.params.items()}
    node_cost = {v.name: _node_costs_of(v, choice[v.name], coster, grad_sync_share, metas) for v in problem.nodes}
    copies = _copy_charges(problem, choice, coster, boundary)
    fixed = _Problem(graph=graph, name=problem.name, nodes=problem.nodes,
                     strategies={v: [s] for v, s in choice.items()}, stream_shape=problem.stream_shape,
                     outputs=problem.outputs)
    return _summarize(fixed, choice, node_cost, copies, coster, boundary, **extra)


def _copy_charges(problem: _Problem, choice: dict[str, Strategy], coster: OpCoster,
                  boundary: Placement) -> list[tuple[str, float, float]]:
    """One copy per (value, layout) the chosen strategies read, as the ILP prices them: (the node it
    is charged to, forward s, backward s). A copy shared by several consumers is charged to the
    first one in the segment's order that reads it so; the copy of a value leaving the segment in
    the boundary placement that no consumer inside reads so, to its producer."""
    graph = problem.graph
    charges = []
    for u, consumers in _uses(problem).items():
        out = choice[u].output if u in choice else _fixed_input(problem, u, boundary)
        first: dict[Layout, str] = {}
        for v, slot in consumers:
            first.setdefault((choice[v].inputs[slot], choice[v].input_grads[slot]), v)
        if u in choice and u in problem.outputs:
            first.setdefault((problem.outputs[u], problem.outputs[u]), u)
        for layout, node in first.items():
            fwd, bwd = _copy_cost(coster, value_meta(graph, u), out, layout)  # type: ignore[arg-type]
            charges.append((node, fwd, bwd))
    return charges


def reprice_segment(graph: Graph, name: str, node_names: Sequence[str], choice: dict[str, Strategy],
                    coster: OpCoster, boundary: Placement, *, grad_sync_share: float = 1.0) -> SegmentSharding:
    """The same strategies on another graph of the same model (e.g. another batch size)."""
    problem = _problem(graph, name, node_names, coster.n, boundary)
    local = {}
    for v in problem.nodes:
        want = choice[v.name]
        match = [s for s in problem.strategies[v.name] if (s.name, s.inputs, s.output, s.input_grads) ==
                 (want.name, want.inputs, want.output, want.input_grads)]
        if not match:
            raise ShardingInfeasible(f"{name}: strategy {want} of {v.name} is not valid at batch {graph.batch_size}")
        local[v.name] = match[0]
    return _price(problem, local, coster, boundary, grad_sync_share)


def reprice_graph(graph: Graph, sharding: GraphSharding, coster: OpCoster, **options: Any) -> GraphSharding:
    """Every segment of `sharding` priced on `graph` (same model, e.g. rebatched)."""
    segments: dict[str, SegmentSharding] = {}
    for block in graph.block_types:
        segments[block.name] = reprice_segment(graph, block.name, block.template, sharding.segments[block.name].choice,
                                               coster, sharding.boundary, **options)
    choice = dict(sharding.choice)
    for segment in graph.segments:
        if segment.block_type is None and segment.nodes:
            segments[segment.name] = reprice_segment(graph, segment.name, segment.nodes, sharding.choice, coster,
                                                     sharding.boundary, **options)
    for seg in segments.values():
        choice.update(seg.choice)
    return GraphSharding(axis_size=sharding.axis_size, boundary=sharding.boundary, choice=choice, segments=segments)


def _argmax(variables: list) -> int:
    values = [v.value() or 0.0 for v in variables]
    return max(range(len(values)), key=values.__getitem__)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner from C on file descriptor 1 even with msg=False; `--json` promises
    that stdout carries one JSON document, so the solver's stdout goes to /dev/null."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _summarize(problem: _Problem, choice: dict[str, Strategy], node_cost: dict,
               copies: list[tuple[str, float, float]], coster: OpCoster, boundary: Placement,
               **extra: Any) -> SegmentSharding:
    index = {v: problem.strategies[v].index(s) for v, s in choice.items()}
    fwd = bwd = comm_f = comm_b = 0.0
    for v, row in node_cost.items():
        f, b, cf, cb = row[index[v]]
        fwd, bwd, comm_f, comm_b = fwd + f, bwd + b, comm_f + cf, comm_b + cb
    reshard: dict[str, float] = {}
    for node, f, b in copies:
        fwd, bwd, comm_f, comm_b = fwd + f, bwd + b, comm_f + f, comm_b + b
        reshard[node] = reshard.get(node, 0.0) + f + b
    prices = {v: _op_price(row[index[v]], reshard.get(v, 0.0)) for v, row in node_cost.items()}
    graph, n = problem.graph, coster.n
    param_bytes = 0
    for v in problem.nodes:
        s = choice[v.name]
        param_bytes += sum(shard_bytes(graph.params[name].meta, s.inputs[v.inputs.index(name)], n)
                           for _, name in v.params)
    saved = _saved_bytes(problem, choice, n, boundary, coster.saves)
    metas = {k: p.meta for k, p in graph.params.items()}
    sync_bytes = sum(partial_param_grad_bytes(v, choice[v.name], metas) for v in problem.nodes)
    return SegmentSharding(segment=problem.name, axis_size=n, boundary=boundary, choice=choice,
                           forward_s=fwd, backward_s=bwd, comm_forward_s=comm_f, comm_backward_s=comm_b,
                           param_bytes=param_bytes, tp_grad_sync_bytes=sync_bytes, saved_bytes=saved,
                           objective_s=fwd + bwd, op_prices=prices, **extra)


def _op_price(cost: tuple[float, ...], reshard_s: float) -> OpPrice:
    """A node's `_node_costs_of` row (forward s, backward s, and the collectives' share of each)
    for its chosen strategy, split into compute and communication."""
    forward_s, backward_s, comm_forward_s, comm_backward_s = cost
    return OpPrice(compute_s=forward_s - comm_forward_s + backward_s - comm_backward_s,
                   comm_s=comm_forward_s + comm_backward_s, reshard_s=reshard_s)


def _saved_bytes(problem: _Problem, choice: dict[str, Strategy], n: int, boundary: Placement,
                 fused: Mapping[str, FusedSave]) -> int:
    """Activations one instance keeps for backward under the chosen placements, as the local program
    (`passes/insert_collectives.py`) holds them: each storage counted once, at its producer's placement,
    plus the copies consumers keep of their own (below) and the ops' side tensors. A node of a chain
    `fuse_kernels` fuses (`fused`, empty without kernels) keeps what the fused kernel keeps instead."""
    graph = problem.graph
    placement_of: dict[str, Placement] = {v.name: choice[v.name].output for v in problem.nodes}
    persistent = persistent_inputs(graph)
    kept: dict[tuple[str, ...], int] = {}
    extra = 0
    for v in problem.nodes:
        s = choice[v.name]
        kernel = fused.get(v.name)
        side = v.saved_extra_bytes if kernel is None else extra_saved_bytes(graph, kernel)
        extra += side // (n if s.split else 1)
        rule = rule_for(v.op)
        for saved in (v.saved if kernel is None else kernel.kept):
            root = graph.storage_root(saved)
            # parameters, and buffers such as RoPE tables (a view of them is kept), are no activations
            if root in graph.params or root in persistent or (meta := value_meta(graph, root)) is None:
                continue
            key, placement = (root,), placement_of.get(root, _fixed_input(problem, root, boundary))
            if saved in v.inputs:
                slot = v.inputs.index(saved)
                wanted, value = s.inputs[slot], value_meta(graph, saved) or meta
                if rule is not None and slot in rule.converts and \
                        value.dtype != (dtype := value_meta(graph, v.inputs[0]).dtype):  # type: ignore[union-attr]
                    # the op keeps a converted copy of its own (SDPA's boolean mask in q's dtype), one per call
                    key, placement = ("converted", v.name, saved), wanted
                    meta = TensorMeta(shape=value.shape, dtype=dtype)
                elif wanted != placement_of.get(saved, _fixed_input(problem, saved, boundary)):
                    # The consumer keeps the reshard it reads (e.g. the all-gathered norm output under
                    # SP). The runtime makes one copy per (value, placement, gradient placement), shared
                    # by every consumer that wants it so (q, k and v read one gathered tensor: a copy
                    # per consumer counted it three times), and the copy is of the value itself. A view
                    # its producer left in the wanted placement is no copy (attention's output read by
                    # o_proj through a transpose and a reshape: comparing with the storage root's
                    # placement counted that output twice under TP); its storage is the root's.
                    key, placement = ("copy", saved, str(wanted), str(s.input_grads[slot])), wanted
                    meta = value
            kept[key] = max(kept.get(key, 0), shard_bytes(meta, placement, n))
    return extra + sum(kept.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphSharding:
    """Strategies for every node of a captured graph on the TP axis: what the passes execute."""

    axis_size: int
    boundary: Placement
    choice: dict[str, Strategy] = field(hash=False)  # every node of the graph
    segments: dict[str, SegmentSharding] = field(hash=False)  # by block type or glue segment name


def solve_graph_sharding(graph: Graph, coster: OpCoster, boundary: Placement, *,
                         allow: StrategyFilter | None = None, **options: Any) -> GraphSharding:
    """Solve each block type once and each glue segment on its own; map the block solution onto
    every traced instance by position (instances share one op sequence by construction).

    A parameter is stored once per rank, but segments are solved apart and each ILP prices its
    ops alone: a tied embedding can come out read vocabulary-parallel by the lookup and replicated
    by the head. Such a parameter is pinned to its first consumer's placement (then to R if that
    fails too) and the graph solved again (`ir.sharding.parameter_layouts` names any that still
    disagree). A segment that reads no pinned parameter poses the same problem again and keeps its
    solution: only the segments the pins constrain are solved again."""
    pins: dict[str, Placement] = {}

    def pinned(node: OpNode, strategy: Strategy) -> bool:
        return (allow is None or allow(node, strategy)) and all(
            strategy.inputs[slot] == pins[name] for slot, name in enumerate(node.inputs) if name in pins)

    solved: dict[tuple[object, ...], SegmentSharding] = {}
    for _ in range(3):
        sharding = _solve_segments(graph, coster, boundary, pins, solved, allow=pinned if pins else allow, **options)
        conflicts = _disagreeing_parameters(graph, sharding.choice)
        if not conflicts:
            break
        for name, first in conflicts.items():
            pins[name] = R if name in pins else first
    return sharding


def _disagreeing_parameters(graph: Graph, choice: dict[str, Strategy]) -> dict[str, Placement]:
    seen: dict[str, list[Placement]] = {}
    for node in graph.nodes:
        for slot, name in enumerate(node.inputs):
            if name in graph.params and node.name in choice:
                seen.setdefault(name, []).append(choice[node.name].inputs[slot])
    return {name: placements[0] for name, placements in seen.items() if len(set(placements)) > 1}


def _solve_segments(graph: Graph, coster: OpCoster, boundary: Placement, pins: dict[str, Placement],
                    solved: dict[tuple[object, ...], SegmentSharding], **options: Any) -> GraphSharding:
    """Every segment solved under `options` (whose `allow` holds `pins`), reusing from `solved` the
    solution of a segment whose pinned parameters are pinned as they were then (the same problem:
    its strategies, and so its ILP, depend on no other pin); new solutions are added to `solved`."""
    def solve(name: str, nodes: tuple[str, ...]) -> SegmentSharding:
        read = {p for v in graph.nodes_of(nodes) for p in v.inputs if p in pins}
        key = (name, tuple(sorted((p, pins[p]) for p in read)))
        if key not in solved:
            solved[key] = solve_segment_sharding(graph, name, nodes, coster, boundary, **options)
        return solved[key]

    segments: dict[str, SegmentSharding] = {}
    for block in graph.block_types:
        segments[block.name] = solve(block.name, block.template)
    choice: dict[str, Strategy] = {}
    for segment in graph.segments:
        if segment.block_type is not None:
            template = graph.block_type(segment.block_type).template
            by_position = segments[segment.block_type].choice
            choice.update({node: by_position[t] for node, t in zip(segment.nodes, template)})
        elif segment.nodes:
            segments[segment.name] = solve(segment.name, segment.nodes)
            choice.update(segments[segment.name].choice)
    return GraphSharding(axis_size=coster.n, boundary=boundary, choice=choice, segments=segments)
