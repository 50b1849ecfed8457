"""The view/shape family against eager PyTorch, under every strategy the op registry offers.

What: view, reshape, split (int size), split_with_sizes, chunk, unbind, narrow, select, slice
(`x[:, a:b:c]`), transpose, permute, flatten, unflatten, expand, cat and stack, on random small
shapes (rank 1-4, dims 1-8, about half of them divisible by the axis size 2) with random dims,
negative ones included. For each example and each strategy `strategies_for` offers for the
captured node at n = 2, on every rank

- the op's local output is what the strategy's output placement says of the eager output, and
- the local backward, fed this rank's piece of an upstream gradient (placed as
  `grad_placement(output)`), gives input gradients placed as `strategy.input_grads` says,

where S(d) means rank r holds chunk r of dim d, R the whole tensor, and P values whose sum over
the ranks is the tensor. Comparisons are torch.equal on float64 tensors of small integers, so
every sum is exact whatever its order.

How: a tiny module feeds the op einsums of its parameters, `einsum("...k,k->...", x, w)`
contracting a dim of size 2, then multiplies each output by a user input and sums, so the op is
an inner node of the captured graph (`capture` keeps all these ops whole; a full-range slice is
recorded as `aten.alias`, which the test then checks instead). Each einsum is planned to give its
value under the placement the op's strategy reads it with: split along d for S(d), whole for R,
split along the contraction for P (each rank then holds one addend); every other node gets its
replicated strategy. `check_sharding` accepts the choice, `shard_parameters` gives each rank its
parameters and `insert_collectives` builds each rank's local program with
`AxisGroup(group=None, size=2, rank=r)`. Every strategy offered for a case is checked (the
strategy is not left to a draw: hypothesis favours the first entries of a list, and a case's
capture costs more than all its strategies' runs).

Why one process rather than one gloo group running the same derandomized draws on each rank:
nothing up to the op communicates (the einsums read parameters stored as they need them); only
what follows the op does (the program ends in a reshard to R). So the test runs each rank's
local program cut after the op: the very fx nodes the pass emitted, output replaced by the op's
value and its inputs, nodes not needed for them removed. That executes the real lowerings
(`replicated`, `local`, `reshape_local`, `expand_local`) on real shards, keeps hypothesis's
shrinking and report in one process, and pays no rank start-up. Captures are cached by case;
the draws are derandomized, so every run checks the same examples.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from mplan.collectives.redistribute import AxisGroup
from mplan.ir.graph import Graph, OpNode
from mplan.ir.op_table import op_packet
from mplan.ir.placement import P, Partial, Placement, R, S, Shard, grad_placement
from mplan.ir.sharding import check_sharding
from mplan.ir.strategy import Strategy
from mplan.ir.trace import capture
from mplan.passes.insert_collectives import INPUTS, insert_collectives
from mplan.passes.shard_parameters import shard_parameters
from mplan.planner.op_registry import REGISTRY, replicated, strategies_for

N = 2  # the tensor-parallel axis size
EXAMPLES_PER_MEMBER = 20
Value = torch.Tensor | Sequence[torch.Tensor]

# -- the family -----------------------------------------------------------------------------------
APPLY: dict[str, Callable[..., Value]] = {
    "view": lambda xs, shape: xs[0].view(shape),
    "reshape": lambda xs, shape: xs[0].reshape(shape),
    "split": lambda xs, size, dim: xs[0].split(size, dim),
    "split_with_sizes": lambda xs, sizes, dim: xs[0].split(list(sizes), dim),
    "chunk": lambda xs, chunks, dim: xs[0].chunk(chunks, dim),
    "unbind": lambda xs, dim: xs[0].unbind(dim),
    "narrow": lambda xs, dim, start, length: xs[0].narrow(dim, start, length),
    "select": lambda xs, dim, index: xs[0].select(dim, index),
    "slice": lambda xs, dim, start, stop, step: xs[0][(slice(None),) * dim + (slice(start, stop, step),)],
    "transpose": lambda xs, a, b: xs[0].transpose(a, b),
    "permute": lambda xs, dims: xs[0].permute(dims),
    "flatten": lambda xs, start, end: xs[0].flatten(start, end),
    "unflatten": lambda xs, dim, sizes: xs[0].unflatten(dim, sizes),
    "expand": lambda xs, sizes: xs[0].expand(sizes),
    "cat": lambda xs, dim: torch.cat(xs, dim),
    "stack": lambda xs, dim: torch.stack(xs, dim),
}
"""Each family member as a call on its tensor inputs `xs` and its other arguments."""

VIEW_PACKETS = frozenset(p for p, entry in REGISTRY.items()
                         if entry.rule in {REGISTRY[q].rule for q in ("view", "cat", "stack")})
"""The op packets the registry describes with its view, cat and stack rules."""


@dataclass(frozen=True, slots=True)
class Case:
    """One call of a family member: the shapes of its tensor inputs and its other arguments."""

    member: str
    shapes: tuple[tuple[int, ...], ...]
    args: tuple[Any, ...]

    def apply(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The op's outputs, as a tuple also for a single tensor."""
        out = APPLY[self.member](xs, *self.args)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    def __str__(self) -> str:
        return f"{self.member}{list(self.shapes)}{self.args}"


class OpUnderTest(nn.Module):
    """`case` applied to inputs `einsum(x{j}, w{j})` of parameters, contracting a last dim of size
    N; every output times the input `scale`, summed."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        for j, shape in enumerate(case.shapes):
            self.register_parameter(f"x{j}", nn.Parameter(torch.zeros(*shape, N, dtype=torch.float64)))
            self.register_parameter(f"w{j}", nn.Parameter(torch.zeros(N, dtype=torch.float64)))

    def op_inputs(self, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        dims = "abcd"
        return [torch.einsum(f"{dims[:len(shape)]}k,k->{dims[:len(shape)]}", params[f"x{j}"], params[f"w{j}"])
                for j, shape in enumerate(self.case.shapes)]

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        outputs = self.case.apply(*self.op_inputs(dict(self.named_parameters())))
        return sum((out * scale).sum() for out in outputs)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Captured:
    graph: Graph
    node: OpNode  # the op under test: the node reading the einsums
    producers: tuple[OpNode, ...]  # the einsum giving each of its inputs
    module: OpUnderTest


@functools.lru_cache(maxsize=None)
def captured(case: Case) -> Captured:
    module = OpUnderTest(case)
    graph = capture(module, (torch.tensor(3.0, dtype=torch.float64),))
    producers = tuple(_only(n for n in graph.nodes if n.inputs == (f"x{j}", f"w{j}")) for j in range(len(case.shapes)))
    node = _only(n for n in graph.nodes if n.inputs == tuple(p.name for p in producers))
    return Captured(graph=graph, node=node, producers=producers, module=module)


def producing(producer: OpNode, placement: Placement) -> Strategy:
    """The einsum's strategy whose output has `placement` (S(d): split along d; R: replicated; P:
    split along the contraction): its inputs are parameters, so it runs without communication."""
    return next(s for s in strategies_for(producer, N) if s.output == placement)


def _only(items: Any) -> Any:
    (item,) = items
    return item


# -- running a strategy ---------------------------------------------------------------------------
def piece(whole: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """What `rank` holds of `whole` under S(d) (chunk `rank` of dim d) or R (all of it)."""
    return whole.chunk(N, placement.dim)[rank] if isinstance(placement, Shard) else whole


def small_integers(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-4, 5, tuple(shape), generator=generator).to(torch.float64)


def cut_after_op(program: fx.GraphModule, sources: Sequence[str]) -> fx.GraphModule:
    """`program` cut after the op reading the nodes `sources` (the einsums, kept under their
    names): it returns the op's value and those inputs, and keeps only the nodes they need."""
    nodes = {n.name: n for n in program.graph.nodes}
    inputs = [nodes[name] for name in sources]
    op = _only(inputs[0].users)  # each einsum feeds the op alone
    assert op.all_input_nodes == inputs, f"{op.format_node()} does not read {sources} directly"
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(program.graph, copies)
    graph.output((copies[op], *(copies[node] for node in inputs)))
    cut = fx.GraphModule(program, graph)
    cut.graph.eliminate_dead_code()
    cut.recompile()
    return cut


@dataclass(frozen=True, slots=True)
class RankRun:
    outputs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...] | None  # None when the outputs cannot take the upstream gradient


def run_rank(cap: Captured, choice: Mapping[str, Strategy], state: Mapping[str, torch.Tensor],
             upstream: Sequence[torch.Tensor], rank: int) -> RankRun:
    """The op on `rank`'s shards through its local program, and its backward from `upstream`."""
    strategy = choice[cap.node.name]
    program = insert_collectives(cap.graph, choice, AxisGroup(group=None, size=N, rank=rank))
    shards = shard_parameters(cap.graph, choice, rank, N, state)
    specs = program.meta[INPUTS]
    feeds = [shards[spec.name].requires_grad_() if spec.kind == "PARAMETER" else torch.tensor(3.0)
             for spec in specs]
    value, *inputs = cut_after_op(program, cap.node.inputs)(*feeds)
    outputs = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    grad_in = [piece(g, grad_placement(strategy.output), rank) for g in upstream]
    if [o.shape for o in outputs] != [g.shape for g in grad_in]:
        return RankRun(outputs=outputs, grads=None)
    grads = torch.autograd.grad(outputs, inputs, grad_in, materialize_grads=True)
    return RankRun(outputs=outputs, grads=grads)


def misplaced(local: Sequence[torch.Tensor], whole: torch.Tensor, placement: Placement, what: str) -> list[str]:
    """How the ranks' `local` values fail to be `whole` under `placement` (empty: they are it)."""
    if isinstance(placement, Partial):
        if any(t.shape != whole.shape for t in local):
            return [f"{what}: partial values of shapes {[tuple(t.shape) for t in local]}, eager {tuple(whole.shape)}"]
        return [] if torch.equal(torch.stack(list(local)).sum(0), whole) else \
            [f"{what}: the ranks' partial values do not sum to the eager value"]
    if isinstance(placement, Shard) and whole.shape[placement.dim] % N:
        return [f"{what}: {placement} of a dim of size {whole.shape[placement.dim]}, not divisible by {N}"]
    return [f"{what} on rank {rank}: {tuple(t.shape)} {t.flatten()[:8].tolist()}, expected "
            f"{placement} of eager: {tuple(want.shape)} {want.flatten()[:8].tolist()}"
            for rank, t in enumerate(local) if not torch.equal(t, want := piece(whole, placement, rank))]


def mismatches(case: Case, strategy: Strategy, seed: int = 0) -> list[str]:
    """Where running `case` under `strategy` on N ranks differs from eager (empty: exact)."""
    cap = captured(case)
    choice = {n.name: replicated(n) for n in cap.graph.nodes}
    choice.update({p.name: producing(p, placement) for p, placement in zip(cap.producers, strategy.inputs)})
    choice[cap.node.name] = strategy
    check_sharding(cap.graph, choice)

    generator = torch.Generator().manual_seed(seed)
    state = {name: small_integers(info.meta.shape, generator) for name, info in cap.graph.params.items()}
    inputs = [x.detach().requires_grad_() for x in cap.module.op_inputs(state)]
    eager = case.apply(*inputs)
    upstream = [small_integers(out.shape, generator) for out in eager]
    eager_grads = torch.autograd.grad(eager, inputs, upstream, materialize_grads=True)

    runs = [run_rank(cap, choice, state, upstream, rank) for rank in range(N)]
    problems = [f"rank {rank} computes {len(run.outputs)} outputs, eager {len(eager)}"
                for rank, run in enumerate(runs) if len(run.outputs) != len(eager)]
    if problems:
        return problems
    for i, whole in enumerate(eager):
        problems += misplaced([run.outputs[i] for run in runs], whole, strategy.output, f"output {i}")
    if any(run.grads is None for run in runs):
        return problems + ["no backward: the local outputs do not have the upstream gradient's local shapes"]
    for j, whole in enumerate(eager_grads):
        problems += misplaced([run.grads[j] for run in runs], whole,  # type: ignore[index]
                              strategy.input_grads[j], f"gradient of input {j}")
    return problems


# -- random cases ---------------------------------------------------------------------------------
SIZES = st.sampled_from((2, 4, 6, 8, 1, 3, 5, 7))  # half of them divisible by N


@st.composite
def shapes(draw: st.DrawFn, max_rank: int = 4, sizes: st.SearchStrategy[int] = SIZES) -> tuple[int, ...]:
    """Rank 1 to `max_rank`, drawn evenly (hypothesis would favour rank 1), then each size."""
    rank = draw(st.sampled_from([*range(2, max_rank + 1), 1]))
    return tuple(draw(sizes) for _ in range(rank))


def dim_of(rank: int) -> st.SearchStrategy[int]:
    """Any dim of a rank-`rank` tensor, written non-negative or negative."""
    return st.integers(-rank, rank - 1)


@st.composite
def either_sign(draw: st.DrawFn, dim: int, rank: int) -> int:
    return dim - rank if draw(st.booleans()) else dim


@st.composite
def factorization(draw: st.DrawFn, numel: int, max_rank: int = 4) -> tuple[int, ...]:
    """An ordered factorization of `numel` (a view's target shape), maybe with one -1."""
    factors: list[int] = []
    rest = numel
    for _ in range(draw(st.integers(0, max_rank - 1))):
        factors.append(draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0])))
        rest //= factors[-1]
    factors.append(rest)
    if draw(st.booleans()):
        factors[draw(st.integers(0, len(factors) - 1))] = -1
    return tuple(factors)


@st.composite
def reshape_cases(draw: st.DrawFn, member: str) -> Case:
    shape = draw(shapes())
    return Case(member, (shape,), (draw(factorization(math.prod(shape))),))


@st.composite
def cut_cases(draw: st.DrawFn, member: str) -> Case:
    """split, split_with_sizes, chunk, unbind, narrow, select: a cut along one dim."""
    shape = draw(shapes())
    dim = draw(dim_of(len(shape)))
    length = shape[dim]
    if member == "split":
        args: tuple[Any, ...] = (draw(st.integers(1, length + 1)), dim)
    elif member == "split_with_sizes":
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3))) if length > 1 else []
        args = (tuple(b - a for a, b in zip([0, *cuts], [*cuts, length])), dim)
    elif member == "chunk":
        args = (draw(st.integers(1, length + 1)), dim)
    elif member == "unbind":
        args = (dim,)
    elif member == "narrow":
        start = draw(st.integers(-length, length - 1))
        args = (dim, start, draw(st.integers(1, length - start % length)))
    else:
        args = (dim, draw(st.integers(-length, length - 1)))
    return Case(member, (shape,), args)


@st.composite
def slice_cases(draw: st.DrawFn) -> Case:
    """`x[:, ..., start:stop:step]` on one dim, written with None, negative or plain bounds."""
    shape = list(draw(shapes()))
    dim = draw(st.integers(0, len(shape) - 1))
    length = shape[dim]
    start = draw(st.integers(0, length - 1))
    stop = draw(st.integers(start + 1, length))
    step = draw(st.integers(1, 3))
    first = draw(st.sampled_from([start, start - length] + ([None] if start == 0 else [])))
    last = draw(st.sampled_from([stop] + ([stop - length] if stop < length else [None])))
    return Case("slice", (tuple(shape),), (dim, first, last, step))


@st.composite
def transpose_cases(draw: st.DrawFn) -> Case:
    shape = draw(shapes())
    return Case("transpose", (shape,), (draw(dim_of(len(shape))), draw(dim_of(len(shape)))))


@st.composite
def permute_cases(draw: st.DrawFn) -> Case:
    shape = draw(shapes())
    order = draw(st.permutations(range(len(shape))))
    return Case("permute", (shape,), (tuple(draw(either_sign(d, len(shape))) for d in order),))


@st.composite
def flatten_cases(draw: st.DrawFn) -> Case:
    shape = draw(shapes())
    rank = len(shape)
    start = draw(st.integers(0, rank - 1))
    end = draw(st.integers(start, rank - 1))
    return Case("flatten", (shape,), (draw(either_sign(start, rank)), draw(either_sign(end, rank))))


@st.composite
def unflatten_cases(draw: st.DrawFn) -> Case:
    shape = draw(shapes(max_rank=3))
    dim = draw(dim_of(len(shape)))
    sizes = draw(factorization(shape[dim], max_rank=3))
    return Case("unflatten", (shape,), (dim, sizes))


@st.composite
def expand_cases(draw: st.DrawFn) -> Case:
    """Size-1 dims broadcast to 1-8, others kept (as their size or -1), new leading dims up to rank 4."""
    shape = draw(shapes(sizes=st.one_of(st.just(1), SIZES)))
    lead = draw(st.lists(st.integers(1, 4), max_size=4 - len(shape)))
    sizes = [draw(st.sampled_from([-1, size] if size > 1 else [-1, 1, 2, 3, 4, 6, 8])) for size in shape]
    return Case("expand", (shape,), (tuple(lead + sizes),))


@st.composite
def join_cases(draw: st.DrawFn, member: str) -> Case:
    """cat (inputs differing along the cat dim) and stack (equal shapes) of 2-3 tensors."""
    shape = draw(shapes())
    rank = len(shape)
    count = draw(st.integers(2, 3))
    if member == "stack":
        return Case(member, (shape,) * count, (draw(dim_of(rank + 1)),))
    dim = draw(dim_of(rank))
    inputs = tuple(tuple(draw(SIZES) if d == dim % rank else size for d, size in enumerate(shape))
                   for _ in range(count))
    return Case(member, inputs, (dim,))


CASES: dict[str, st.SearchStrategy[Case]] = {
    "view": reshape_cases("view"), "reshape": reshape_cases("reshape"),
    **{m: cut_cases(m) for m in ("split", "split_with_sizes", "chunk", "unbind", "narrow", "select")},
    "slice": slice_cases(), "transpose": transpose_cases(), "permute": permute_cases(),
    "flatten": flatten_cases(), "unflatten": unflatten_cases(), "expand": expand_cases(),
    "cat": join_cases("cat"), "stack": join_cases("stack"),
}
assert CASES.keys() == APPLY.keys()

EXERCISED: dict[str, dict[str, set[Strategy]]] = defaultdict(lambda: defaultdict(set))
"""member -> captured op packet -> the strategies checked on it."""


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", list(CASES))
@settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES_PER_MEMBER,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_offered_strategy_matches_eager(member: str, data: st.DataObject) -> None:
    case = data.draw(CASES[member], label="case")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    node = captured(case).node
    assert op_packet(node.op) in VIEW_PACKETS, f"{case} was captured as {node.op}, outside the view family"
    for strategy in strategies_for(node, N):
        EXERCISED[member][op_packet(node.op)].add(strategy)
        problems = mismatches(case, strategy, seed)
        assert not problems, f"{case} ({node.op}) under {strategy}:\n  " + "\n  ".join(problems)


def test_every_member_ran_as_a_view_family_op_under_split_strategies() -> None:
    for member in CASES.keys() - EXERCISED.keys():  # run alone: exercise the family first
        test_every_offered_strategy_matches_eager(member)
    checked = {member: set().union(*packets.values()) for member, packets in EXERCISED.items()}
    for member in CASES:
        assert EXERCISED[member] and EXERCISED[member].keys() <= VIEW_PACKETS, (member, EXERCISED[member].keys())
        assert any(s.split for s in checked[member]), f"{member}: no split strategy was checked"
        if member not in ("cat", "stack"):  # the registry offers joins no partial strategy
            assert any(P in s.inputs for s in checked[member]), f"{member}: no partial input was checked"
    outputs = {type(s.output) for strategies in checked.values() for s in strategies}
    assert outputs == {Shard, type(R), Partial}


def test_checker_reports_a_split_sharded_along_the_dim_it_cuts() -> None:
    case = Case("split", ((8, 2),), (4, 0))
    wrong = Strategy(name="wrong", inputs=(S(0),), output=S(0), input_grads=(S(0),), split=True)
    assert wrong not in strategies_for(captured(case).node, N)
    assert mismatches(case, wrong) == ["rank 0 computes 1 outputs, eager 2", "rank 1 computes 1 outputs, eager 2"]


def test_checker_reports_a_cat_sharded_along_its_dim() -> None:
    """Same local shapes as the right answer, wrong values: rank 0 holds halves of both inputs
    where chunk 0 of the result is the first input whole."""
    case = Case("cat", ((2, 4), (2, 4)), (1,))
    wrong = Strategy(name="wrong", inputs=(S(1), S(1)), output=S(1), input_grads=(S(1), S(1)), split=True)
    assert wrong not in strategies_for(captured(case).node, N)
    problems = mismatches(case, wrong)
    assert any(p.startswith("output 0 on rank 0") for p in problems)
    assert any(p.startswith("gradient of input 1 on rank 0") for p in problems)


def test_checker_reports_partial_values_taken_for_whole_ones() -> None:
    """A partial input is one addend per rank: the right strategy passes, a P -> R claim does not."""
    case = Case("transpose", ((2, 3),), (0, 1))
    partial = next(s for s in strategies_for(captured(case).node, N) if s.inputs == (P,))
    assert partial.output == P and partial.input_grads == (R,)
    assert mismatches(case, partial) == []
    wrong = Strategy(name="wrong", inputs=(P,), output=R, input_grads=(R,), split=False)
    assert mismatches(case, wrong)[0].startswith("output 0 on rank 0")


def test_cat_keeps_a_one_dim_empty_input_whole() -> None:
    """torch.cat skips 1-D empty inputs whatever the others' rank (outside the random shapes, whose
    dims are at least 1): the registry keeps them R while the others split, exactly."""
    case = Case("cat", ((4, 2), (0,), (4, 6)), (-1,))
    offered = strategies_for(captured(case).node, N)
    assert Strategy(name="shard(0)", inputs=(S(0), R, S(0)), output=S(0), input_grads=(S(0), R, S(0)),
                    split=True) in offered
    assert all(mismatches(case, strategy) == [] for strategy in offered)
