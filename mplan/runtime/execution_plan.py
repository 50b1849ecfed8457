"""What one training job executes: the mesh, batching and TP strategies, resolved from a plan.

Input: whatever `autoparallel(plan=...)` was given (None, a `Plan`, a plan.json path, or a spec
string such as `tp=2,dp=2,sp=1,zero=1`), the world size and the global batch. Output: an
`ExecutionPlan` (pure data, checked locally: a wrong world size or batch split fails here, on
every rank, before any collective) and, once the model is captured, the TP choice of every node
(`tp_choice`) and the plan hash every rank must agree on (`plan_hash`).

`resolve_execution_plan` is the one hook between planning and execution:
- None or "auto"  the planner searches (`mplan.planner.planning.plan`), restricted to what this
                  runtime executes (pp=1, ep=1); its Plan is then used as below;
- a Plan / path   mesh, SP, ZeRO, micro-batching and recomputation from the plan; the TP strategy of every op
                  from `plan.ops` (per segment, in node order), zipped onto the re-captured graph;
                  `plan.check_runs_on` refuses another world size or another model's graph;
- a spec string   keys as in DESIGN.md (dp, tp, pp, sp, zero, mbs); keys left out take defaults
                  here (tp=1, sp=0, zero=0, dp fills the world, mbs = the whole replica batch
                  unless `micro_batch_size` says otherwise, recompute=none); TP strategies are Megatron's
                  (`megatron_required`), solved deterministically on the captured graph, or,
                  with tp_strategies="ilp", any valid mix the sharding ILP finds cheapest.

Invariants: dp*tp*pp == world size; dp * micro_batch_size * num_micro_batches == global_batch;
pp == ep == 1 (pipeline and expert parallelism execute in a later issue).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mplan.ir.graph import Graph, OpNode, TensorMeta
from mplan.ir.graph_hash import graph_hash
from mplan.planner.parallel_config import RECOMPUTE, PlanSpec, parse_plan_spec
from mplan.planner.op_cost import Cost
from mplan.planner.placement import Placement, R, Shard, can_transition, transition
from mplan.planner.plan import Plan, PlanError
from mplan.planner.sharding_ilp import megatron_style, solve_graph_sharding, stream_shape
from mplan.planner.strategies import Strategy, replicated, strategies_for
from mplan.runtime.mesh import MeshShape

LATER_ISSUE = "pipeline (pp) and expert (ep) parallelism execute in Execution II, a later issue"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionPlan:
    """The parallel layout one job runs; identical on every rank."""

    mesh: MeshShape
    sequence_parallel: bool
    zero: int  # 0: replicated optimizer, 1: ZeRO-1 (state and fp32 masters sharded over DP)
    micro_batch_size: int  # sequences per micro-batch per DP replica
    num_micro_batches: int  # per DP replica per optimizer step
    global_batch: int  # sequences per optimizer step over all replicas
    tp_strategies: str  # "megatron" (spec strings), "ilp" (any valid mix), "plan" (a Plan's ops)
    source: str  # what the user passed, for messages
    plan: Plan | None = None  # the planner's Plan, when there is one (its ops and graph hash)
    recompute: str = "none"  # activation recomputation per unit (`passes/recompute.py`)

    def __post_init__(self) -> None:
        if self.mesh.pp != 1 or self.mesh.ep != 1:
            raise NotImplementedError(f"{self.source}: pp={self.mesh.pp}, ep={self.mesh.ep}: {LATER_ISSUE}")
        if self.zero not in (0, 1):
            raise ValueError(f"{self.source}: zero must be 0 or 1, got {self.zero}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"{self.source}: recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        share = self.mesh.dp * self.micro_batch_size * self.num_micro_batches
        if share != self.global_batch:
            raise ValueError(f"{self.source}: dp*micro_batch_size*num_micro_batches = {self.mesh.dp}*"
                             f"{self.micro_batch_size}*{self.num_micro_batches} = {share} but the "
                             f"global batch is {self.global_batch}")

    def describe(self) -> str:
        m = self.mesh
        return (f"dp={m.dp},tp={m.tp},sp={int(self.sequence_parallel)},zero={self.zero},"
                f"mbs={self.micro_batch_size},micro_batches={self.num_micro_batches},recompute={self.recompute}")


def resolve_execution_plan(plan: Plan | str | None, *, world_size: int, global_batch: int,
                           micro_batch_size: int | None = None, tp_strategies: str = "megatron",
                           search: Callable[[PlanSpec], Plan] | None = None) -> ExecutionPlan:
    """The hook from planning to execution (see the module docstring). `search` runs the planner
    for None/"auto" (`autoparallel` passes one bound to the model and cluster); `tp_strategies`
    says how a spec string's TP degree is filled: "megatron", or "ilp" (whatever valid mix the
    sharding ILP finds cheapest)."""
    if tp_strategies not in ("megatron", "ilp"):
        raise ValueError(f"tp_strategies must be 'megatron' or 'ilp', got {tp_strategies!r}")
    if isinstance(plan, str) and plan.strip().endswith(".json"):
        plan = Plan.load(plan.strip())
    if plan is None or (isinstance(plan, str) and plan.strip() in ("", "auto")):
        if search is None:
            raise ValueError("plan=None searches for a plan, which needs the model and cluster")
        plan = search(PlanSpec(pp=1, ep=1))
    if isinstance(plan, Plan):
        return _from_plan(plan, world_size, global_batch)
    if isinstance(plan, str):
        return _from_spec(plan, world_size, global_batch, micro_batch_size, tp_strategies)
    raise TypeError(f"plan must be None, a Plan, a plan.json path or a spec string, not {type(plan).__name__}")


def _from_plan(plan: Plan, world_size: int, global_batch: int) -> ExecutionPlan:
    plan.check_runs_on(world_size=world_size)
    if plan.global_batch != global_batch:
        raise PlanError(f"plan was made for a global batch of {plan.global_batch}, "
                        f"autoparallel was given {global_batch}")
    m = plan.mesh
    if m.vpp != 1:
        raise NotImplementedError(f"plan {plan.spec()}: vpp={m.vpp}: {LATER_ISSUE}")
    return ExecutionPlan(mesh=MeshShape(dp=m.dp, tp=m.tp, pp=m.pp, ep=m.ep),
                         sequence_parallel=plan.sequence_parallel, zero=plan.zero,
                         micro_batch_size=plan.micro_batch_size, num_micro_batches=plan.num_micro_batches,
                         global_batch=global_batch, tp_strategies="plan", source=plan.spec(), plan=plan,
                         recompute=plan.recompute)


def _from_spec(text: str, world_size: int, global_batch: int, micro_batch_size: int | None,
               tp_strategies: str) -> ExecutionPlan:
    spec = parse_plan_spec(text)
    if (spec.pp or 1) != 1 or (spec.ep or 1) != 1 or (spec.vpp or 1) != 1:
        raise NotImplementedError(f"plan {text!r}: {LATER_ISSUE}")
    tp = spec.tp or 1
    if spec.dp is None and world_size % tp:
        raise ValueError(f"plan {text!r}: tp={tp} does not divide the world size {world_size}")
    mesh = MeshShape(dp=spec.dp or world_size // tp, tp=tp)
    if mesh.size != world_size:
        raise ValueError(f"plan {text!r}: dp*tp*pp = {mesh.dp}*{mesh.tp}*1 = {mesh.size} ranks but "
                         f"the world has {world_size}")
    if spec.mbs is not None and micro_batch_size is not None and spec.mbs != micro_batch_size:
        raise ValueError(f"plan {text!r} says mbs={spec.mbs} but micro_batch_size={micro_batch_size}")
    if global_batch % mesh.dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={mesh.dp} "
                         f"({global_batch} % {mesh.dp} = {global_batch % mesh.dp})")
    mbs = spec.mbs or micro_batch_size or global_batch // mesh.dp
    replica = global_batch // mesh.dp
    if replica % mbs:
        raise ValueError(f"each of dp={mesh.dp} replicas gets {replica} sequences, not a multiple of "
                         f"the micro-batch size {mbs} ({replica} % {mbs} = {replica % mbs})")
    return ExecutionPlan(mesh=mesh, sequence_parallel=bool(spec.sp), zero=spec.zero or 0,
                         micro_batch_size=mbs, num_micro_batches=replica // mbs, global_batch=global_batch,
                         tp_strategies=tp_strategies, source=text, recompute=spec.recompute or "none")


def megatron_required(n: int, stream: tuple[int, ...] | None = None) -> Callable[[OpNode, Strategy], bool]:
    """`megatron_style` (and, for kv_heads < tp, query heads split over whole kv heads), plus two
    rules a cost model alone would not follow on small shapes:
    weights and attention may not stay replicated when a Megatron split exists (a plan that
    names tp>1 asks for tensor parallelism), and, with sequence parallelism (`stream` = the
    residual stream's shape), no other op of that shape stays whole or splits the batch: the
    residual adds, norms and casts then run on sequence shards, S(1), as in Megatron-LM's
    sequence parallelism (ops of that shape inside a TP region keep their column split)."""
    def megatron(node: OpNode, strategy: Strategy) -> bool:
        return megatron_style(node, strategy) or strategy.name == "heads_kv_replicated"

    def allow(node: OpNode, strategy: Strategy) -> bool:
        if not megatron(node, strategy):
            return False
        if node.kind in ("matmul", "attention", "embedding", "loss"):
            return strategy.split or not any(s.split and megatron(node, s) for s in strategies_for(node, n))
        if stream is not None and node.outputs and node.output.shape == stream:
            # on sequence shards (norms, residual adds) or inside a TP region (by heads/columns)
            return strategy.output not in (R, Shard(0))
        return True
    return allow


def tp_choice(graph: Graph, plan: ExecutionPlan, coster_for: Callable[[int], Any],
              planner_graph: Callable[[], Graph] | None = None) -> dict[str, Strategy]:
    """The strategy of every node on the TP axis. `coster_for(n)` builds the `OpCoster` for an
    axis of n ranks (the ILP path); `planner_graph()` re-captures the model the way the planner
    did, to line a Plan's per-op strategies up with this graph's nodes."""
    n = plan.mesh.tp
    if n == 1:
        return {node.name: replicated(node) for node in graph.nodes}
    if plan.tp_strategies == "plan":
        assert plan.plan is not None
        return _zip_plan_ops(graph, plan.plan.ops, n, planner_graph)
    boundary = Shard(1) if plan.sequence_parallel else R
    if plan.tp_strategies == "megatron":
        base = megatron_required(n, stream_shape(graph) if plan.sequence_parallel else None)
        coster = CollectiveCountCoster(n)
    else:
        base, coster = None, coster_for(n)
    return _solve_agreeing(graph, lambda allow: solve_graph_sharding(graph, coster, boundary, allow=allow).choice, base)


def _solve_agreeing(graph: Graph, solve: Callable[[Any], Mapping[str, Strategy]],
                    base: Callable[[OpNode, Strategy], bool] | None) -> dict[str, Strategy]:
    """Solve, then pin any parameter whose consumers disagree (a tied embedding read by a
    vocabulary-parallel lookup and a row-parallel head) to its first consumer's placement, or to
    R if that fails too, and solve again: the ILP prices each op alone and knows no ties."""
    pins: dict[str, Placement] = {}

    def allow(node: OpNode, strategy: Strategy) -> bool:
        return (base is None or base(node, strategy)) and all(
            strategy.inputs[slot] == pins[name] for slot, name in enumerate(node.inputs) if name in pins)

    for _ in range(3):
        choice = dict(solve(allow if pins or base else None))
        conflicts = _disagreeing_parameters(graph, choice)
        if not conflicts:
            return choice
        for name, first in conflicts.items():
            pins[name] = R if name in pins else first
    return choice  # check_sharding names the parameter that still disagrees


def _disagreeing_parameters(graph: Graph, choice: Mapping[str, Strategy]) -> dict[str, Placement]:
    seen: dict[str, list[Placement]] = {}
    for node in graph.nodes:
        for slot, name in enumerate(node.inputs):
            if name in graph.params:
                seen.setdefault(name, []).append(choice[node.name].inputs[slot])
    return {name: placements[0] for name, placements in seen.items() if len(set(placements)) > 1}


class CollectiveCountCoster:
    """Prices under which the sharding ILP minimizes the number of collectives first, then the
    bytes they move, then the work left unsplit. Megatron's layout is the one with fewest
    collectives per block (q/k/v, gate/up, fc_in by columns; o, down, fc_out by rows; embedding,
    head and loss by vocabulary), so it falls out of these prices on any shape, independent of
    the measured cost model and of the machine running the job. Duck-types `OpCoster`."""

    COLLECTIVE = 1.0  # one collective
    PER_BYTE = 1e-12  # ties between equal counts: fewer bytes
    PER_UNIT = 1e-15  # ties between equal traffic: more work split (FLOPs + bytes touched)
    IMPOSSIBLE = 1e6  # a transition no pass can emit (R -> P)

    def __init__(self, n: int) -> None:
        self.n = n

    def collective(self, kind: str | None, nbytes: int) -> float:
        return 0.0 if kind is None or nbytes == 0 or self.n == 1 else self.COLLECTIVE + self.PER_BYTE * nbytes

    def reshard(self, meta: TensorMeta, src: Placement, dst: Placement) -> float:
        if not can_transition(src, dst):
            return self.IMPOSSIBLE
        return self.collective(transition(src, dst), meta.nbytes)

    def op_comm(self, strategy: Strategy) -> float:
        return sum(self.collective(kind, nbytes) for kind, nbytes in strategy.comm)

    def op(self, node: OpNode, strategy: Strategy) -> Cost:
        work = self.PER_UNIT * (node.flops + node.bytes_read + node.bytes_written) / (self.n if strategy.split else 1)
        comm = self.op_comm(strategy)
        return Cost(forward_s=work + comm, backward_s=2 * work + comm)


def _zip_plan_ops(graph: Graph, ops: Mapping[str, list[str]], n: int,
                  planner_graph: Callable[[], Graph] | None) -> dict[str, Strategy]:
    """A Plan stores one strategy key per node of each block type's template and glue segment,
    in the order of the planner's capture. That capture has a symbolic batch: it carries
    `sym_size` nodes this static capture lacks, and ops that read them (views) list them as
    extra replicated inputs. Node names otherwise agree, so keys are matched by name through a
    re-capture (`planner_graph`), the symbolic inputs' placements set aside."""
    reference = planner_graph() if planner_graph is not None else None
    choice: dict[str, Strategy] = {}
    for segment in graph.segments:
        if not segment.nodes:
            continue
        key = segment.block_type or segment.name
        keys = ops.get(key)
        if keys is None:
            raise PlanError(f"the plan has no strategies for {key}: re-plan this model")
        template = graph.block_type(segment.block_type).template if segment.block_type else segment.nodes
        theirs: list[OpNode | None] = [None] * len(template)
        if reference is not None:
            keys, theirs = _by_name(reference, key, keys, template)
        elif len(keys) != len(template):
            raise PlanError(f"plan ops for {key}: {len(keys)} strategies for {len(template)} nodes")
        by_position = {name: (wanted, ref) for name, wanted, ref in zip(template, keys, theirs)}
        for node_name, template_name in zip(segment.nodes, template):
            node = graph.node(node_name)
            wanted, ref = by_position[template_name]
            match = [s for s in strategies_for(node, n) if _key(s, ref, reference) == wanted]
            if not match:
                raise PlanError(f"plan ops for {key}: node {node.name} has no strategy {wanted} at "
                                f"tp={n} with these shapes")
            choice[node.name] = match[0]
    return choice


def _key(strategy: Strategy, ref: OpNode | None, reference: Graph | None) -> str:
    """`strategy_key` as the planner wrote it for `ref` (its symbolic inputs replicated)."""
    from mplan.planner.plan_builder import strategy_key

    if ref is None or reference is None:
        return strategy_key(strategy)
    ins, grads = iter(strategy.inputs), iter(strategy.input_grads)
    symbolic = [name in reference and not reference.node(name).outputs for name in ref.inputs]
    padded = Strategy(name=strategy.name, output=strategy.output, split=strategy.split,
                      inputs=tuple(R if sym else next(ins) for sym in symbolic),
                      input_grads=tuple(R if sym else next(grads) for sym in symbolic))
    return strategy_key(padded)


def _by_name(reference: Graph, key: str, keys: list[str],
             template: tuple[str, ...]) -> tuple[list[str], list[OpNode | None]]:
    theirs = (reference.block_type(key).template if any(b.name == key for b in reference.block_types)
              else next((s.nodes for s in reference.segments if s.name == key), ()))
    if len(theirs) != len(keys):
        raise PlanError(f"plan ops for {key}: {len(keys)} strategies, the planner's capture has "
                        f"{len(theirs)} nodes: the plan is stale, re-plan it")
    named = dict(zip(theirs, keys))
    missing = [name for name in template if name not in named]
    if missing:
        raise PlanError(f"plan ops for {key}: no strategy for nodes {missing[:5]}: re-plan")
    return [named[name] for name in template], [reference.node(name) for name in template]


def plan_hash(graph: Graph, plan: ExecutionPlan, choice: Mapping[str, Strategy]) -> str:
    """What every rank must agree on: the model's structure and shapes, the layout, the strategies."""
    nodes = [[n.name, n.op, [list(o.shape) for o in n.outputs]] for n in graph.nodes]
    doc = {"graph": graph_hash(graph), "nodes": nodes, "layout": plan.describe(),
           "global_batch": plan.global_batch,
           "choice": [f"{choice[n.name]}|{','.join(map(str, choice[n.name].input_grads))}" for n in graph.nodes]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
