"""The terms of a training loss beside its cross-entropy that are statistics of the micro-batch's
tokens, and how context parallelism makes them exact (issue 34).

Under cp each rank's program holds B * S/cp of the B * S token rows of every per-token tensor.
The cross-entropy's token mean is made exact by `passes/split_context` (`ContextLoss`). A loss
may add terms computed from means over every token, as a MoE router's load-balancing loss
(Switch Transformer: aux = E * sum_e f_e P_e, f_e the share of the routed choices expert e got,
P_e its mean router probability): on a rank's slice those means are partial. This module reads
an exported training graph and finds, by dataflow (not by function names), every place such a
term reduces over the token rows, and says how each is made the micro-batch's:

    state of a value         what it is
    rows(start, stop, t)     its dims [start, stop) hold t token rows (B * S rows, or copies of
                             them concatenated, as every layer's router logits), features after,
                             before, or folded inside (a [T, k] choice index flattened to [T * k])
    partial sum over t rows  a sum, histc or scatter_add over all the rows' dims, or several added
    exact                    anything computed from neither (parameters, constants) or fixed below

    rule (the only reductions over the rows that are made exact)        fix, over the cp group
    mean over all the rows' dims                                         all-reduce, / cp
    partial sum over t rows / a number equal to t (the count of the      all-reduce the sum,
        rows it covers, as captured at the rank's slice)                 the count * cp
    partial sum / partial sum (a mask-weighted mean: its weights summed) all-reduce both

Why exact: every cp rank holds the same number of token rows, so the mean of the ranks' means is
the micro-batch's mean, and a count captured at the rank's slice is 1/cp of the micro-batch's.
After the fix the statistic is the single-device value on every rank. Gradients: each rank adds
the whole term to its loss share (the cross-entropy's share is scaled by cp, `ContextLoss`) and
the all-reduce's backward sums the cp ranks' equal cotangents, so the runtime's 1/(dp * cp)
average over replicas leaves exactly the term's gradient (`passes/split_context`).

Refused, in one line naming the op: any other op that reads per-token rows or a partial sum in
these terms (a max over the tokens, a sum used other than divided by its count, a reduction over
part of the rows' dims, a per-token tensor whose rows are not its leading dims), and a loss that
is not linear in its cross-entropy (casts, + and - of statistics, * and / by them).
"""
from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.fx as fx

from mplan.ir.sharding import UnexecutableStrategy

aten = torch.ops.aten

__all__ = ["TokenStatistics", "token_statistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenStatistics:
    """Where a loss's token statistics are made the micro-batch's (module docstring)."""

    means: tuple[fx.Node, ...] = ()  # token means of a rank's rows: all-reduced over cp, / cp
    sums: tuple[fx.Node, ...] = ()  # partial sums over a rank's rows: all-reduced over cp
    counts: tuple[fx.Node, ...] = ()  # divisions of a partial sum by its count: the count * cp


@dataclass(frozen=True, slots=True)
class _Rows:
    start: int
    stop: int
    tokens: int


@dataclass(frozen=True, slots=True)
class _Sum:
    tokens: int
    reductions: tuple[fx.Node, ...]  # the token reductions accumulated (named in a refusal)


_State = Union[_Rows, _Sum, None, tuple]

_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.clone.default,
          aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}
_ALONG = {aten.softmax.int: 1, aten._softmax.default: 1, aten._log_softmax.default: 1, aten.log_softmax.int: 1,
          aten._safe_softmax.default: 1, aten.topk.default: 2, aten.sort.default: 1}  # op: position of its dim
_DIM_REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean"}
_WHOLE_REDUCTIONS = {aten.sum.default: "sum", aten.mean.default: "mean", aten.histc.default: "sum"}
_ADDS = {aten.add.Tensor, aten.add_.Tensor}
_SCATTER_ADDS = {aten.scatter_add.default, aten.scatter_add_.default}
_DIVS = {aten.div.Tensor, aten.div.Scalar}
_MULS = {aten.mul.Tensor, aten.mul.Scalar}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


def token_statistics(graph: fx.Graph, *, loss: fx.Node, tokens: Collection[fx.Node], cp: int) -> TokenStatistics:
    """The statistics of `graph`'s loss beside its cross-entropy node `loss` (module docstring);
    `tokens`: the per-token inputs ([B, S] placeholders: input ids, labels, an attention mask).
    Raises `UnexecutableStrategy` naming the op where a term cannot be made exact."""
    return _Reader(graph, loss, tokens, cp).read()


class _Reader:
    def __init__(self, graph: fx.Graph, loss: fx.Node, tokens: Collection[fx.Node], cp: int) -> None:
        self.loss, self.cp = loss, cp
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        result = output.args[0]
        self.value = result[0] if isinstance(result, (tuple, list)) else result
        self.tokens = tokens
        self.derived = _descendants(tokens)
        self.needed = _ancestors([self.value])
        trunk = _ancestors([loss])
        self.path = {n for n in _descendants([loss]) if n in self.needed}  # the loss's way to the output
        self.terms = [n for n in graph.nodes if n in self.needed and n not in trunk and n not in self.path]
        self.states: dict[fx.Node, _State] = {}
        self.means: list[fx.Node] = []
        self.sums: dict[fx.Node, set[fx.Node]] = {}  # a partial sum made whole: the divisions that read it
        self.counts: list[fx.Node] = []

    def read(self) -> TokenStatistics:
        for node in self.terms:
            self.states[node] = self._step(node)
        for node in self.path:
            self._check_linear(node)
        for total, divisions in self.sums.items():
            others = [user for user in total.users if user in self.needed and user not in divisions]
            if others:  # made whole for its divisions, it would be whole for these too
                self._refuse(others[0], [self.states[total]])
        return TokenStatistics(means=tuple(self.means), sums=tuple(self.sums), counts=tuple(self.counts))

    # -- the states ---------------------------------------------------------------------------------
    @functools.cached_property
    def rows(self) -> int:
        """The token rows of a rank's micro-batch: B * S of its [B, S] inputs (asked only where
        the loss has terms beside the cross-entropy)."""
        counts = {math.prod(_shape(n)) for n in self.tokens if len(_shape(n)) == 2}
        if len(counts) != 1:
            raise UnexecutableStrategy(f"the per-token inputs {[n.name for n in self.tokens]} of a loss with terms "
                                       f"beside its cross-entropy hold {sorted(counts)} tokens under cp={self.cp}: "
                                       f"mplan cannot count a rank's token rows")
        return counts.pop()

    def state(self, node: Any) -> _State:
        if not isinstance(node, fx.Node):
            return None
        if node in self.states:
            return self.states[node]
        val = node.meta.get("val")
        if node not in self.derived or _is_size(val):
            return None
        if isinstance(val, (tuple, list)):
            return tuple(self._leading(node, _shape_of(v)) for v in val)
        return self._leading(node, _shape(node))

    def _leading(self, node: fx.Node, shape: tuple[int, ...]) -> _Rows:
        """A per-token value from outside the terms: its token rows are its leading dims."""
        stop = next((j for j in range(1, len(shape) + 1) if math.prod(shape[:j]) == self.rows), None)
        if stop is None:
            raise UnexecutableStrategy(f"node {node.name} (shape {shape}) holds per-token values the loss's terms "
                                       f"beside the cross-entropy read under cp={self.cp}, but not with the "
                                       f"{self.rows} token rows as its leading dims: mplan cannot find its tokens")
        return _Rows(0, stop, self.rows)

    def _step(self, node: fx.Node) -> _State:
        if _is_size(node.meta.get("val")):
            return None  # a size or a count computed from sizes (a symbolic batch's), not token values
        inputs = [self.state(n) for n in node.all_input_nodes]
        if all(s is None for s in inputs) and not (node in self.derived and node.op == "placeholder"):
            return None
        if node.op == "placeholder":
            return self.state(node)
        if node.op != "call_function":
            self._refuse(node, inputs)
        target, args = node.target, node.args
        if target is operator.getitem:
            held = self.state(args[0])
            return held[args[1]] if isinstance(held, tuple) else self._refuse(node, inputs)
        if any(isinstance(s, _Sum) for s in inputs):
            return self._on_sum(node, inputs)
        rows = self.state(args[0]) if args and isinstance(args[0], fx.Node) else None
        if target in _CASTS or target is aten.expand.default or target is aten.one_hot.default:
            # a cast keeps the dims, expand adds leading ones, one_hot a trailing one
            out_rank = len(_shape(node)) - (target is aten.one_hot.default)
            return _shifted(rows, len(_shape(args[0])), out_rank) if isinstance(rows, _Rows) and \
                all(s is None for s in inputs[1:]) else self._refuse(node, inputs)
        if _pointwise(target):
            return self._broadcast(node, inputs)
        if not isinstance(rows, _Rows) or any(s is not None for s in inputs[1:]) and target not in (
                aten.cat.default, *_SCATTER_ADDS):
            return self._on_rows(node, inputs, None)
        return self._on_rows(node, inputs, rows)

    def _on_rows(self, node: fx.Node, inputs: list[_State], rows: _Rows | None) -> _State:
        target, args = node.target, node.args
        if target is aten.cat.default:
            return self._cat(node, inputs)
        if target in _SCATTER_ADDS and self.state(args[0]) is None:
            index, source = self.state(args[2]), self.state(args[3])
            if isinstance(source, _Rows) and source == index and (source.start, source.stop) == (0, len(_shape(args[3]))):
                return _Sum(source.tokens, (node,))
        if rows is None:
            self._refuse(node, inputs)
        in_shape, out_shape = _shape(args[0]), _shape(node)
        if target is aten.linear.default and rows.stop < len(in_shape):  # per row: its features contracted
            return rows
        if target in _RESHAPES:
            return _reshaped(rows, in_shape, out_shape) or self._refuse(node, inputs)
        if target is aten.unsqueeze.default:
            dim = int(args[1]) % len(out_shape)
            return _Rows(rows.start + (dim <= rows.start), rows.stop + (dim < rows.stop), rows.tokens)
        if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            dims = _dims(args[1] if len(args) > 1 else None, len(in_shape))
            gone = [d for d in dims if in_shape[d] == 1]
            return _Rows(rows.start - sum(d < rows.start for d in gone), rows.stop - sum(d < rows.stop for d in gone),
                         rows.tokens)
        if target is aten.repeat_interleave.self_int and (args[2:3] or [node.kwargs.get("dim")])[0] is None:
            return _reshaped(rows, in_shape, (math.prod(in_shape),)) or self._refuse(node, inputs)
        if target in _ALONG:
            dim = int(args[_ALONG[target]] if len(args) > _ALONG[target] else -1) % len(in_shape)
            if not rows.start <= dim < rows.stop:
                return (rows, rows) if target in (aten.topk.default, aten.sort.default) else rows
        if target in _WHOLE_REDUCTIONS:
            return self._reduced(node, _WHOLE_REDUCTIONS[target], rows)
        if target in _DIM_REDUCTIONS:
            dims = set(_dims(args[1] if len(args) > 1 else None, len(in_shape)))
            held = set(range(rows.start, rows.stop))
            if held <= dims:
                return self._reduced(node, _DIM_REDUCTIONS[target], rows)
            if not held & dims:
                keep = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
                drop = 0 if keep else sum(d < rows.start for d in dims)
                return _Rows(rows.start - drop, rows.stop - drop, rows.tokens)
        return self._refuse(node, inputs)

    def _reduced(self, node: fx.Node, kind: str, rows: _Rows) -> _State:
        if kind == "mean":
            self.means.append(node)
            return None
        return _Sum(rows.tokens, (node,))

    def _cat(self, node: fx.Node, inputs: list[_State]) -> _State:
        parts = [self.state(n) for n in node.args[0]]
        if all(p is None for p in parts):
            return None
        dim = int(node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))
        if all(isinstance(p, _Rows) and (p.start, p.stop) == (parts[0].start, parts[0].stop) for p in parts):
            first = parts[0]
            if (first.start, first.stop) == (dim, dim + 1):
                return _Rows(dim, dim + 1, sum(p.tokens for p in parts))
            if not first.start <= dim < first.stop and all(p.tokens == first.tokens for p in parts):
                return first
        return self._refuse(node, inputs)

    def _broadcast(self, node: fx.Node, inputs: list[_State]) -> _State:
        rank = len(_shape(node))
        found = {_shifted(s, len(_shape(n)), rank) for n, s in zip(node.all_input_nodes, inputs) if s is not None}
        if len(found) == 1 and all(isinstance(s, _Rows) for s in found):
            return found.pop()
        return self._refuse(node, inputs)

    def _on_sum(self, node: fx.Node, inputs: list[_State]) -> _State:
        """A partial sum may be accumulated, cast, reshaped, scaled by an exact value, and divided
        by its count or by another partial sum; nothing else."""
        target, args = node.target, node.args
        first = self.state(args[0]) if args else None
        if target in _CASTS or target in _RESHAPES or target is aten.unsqueeze.default:
            return first if len(inputs) == 1 else self._refuse(node, inputs)
        if target in _ADDS:
            parts = [self.state(a) if isinstance(a, fx.Node) else a for a in args[:2]]
            if all(isinstance(p, _Sum) or _is_zero(a) for p, a in zip(parts, args[:2])) and "alpha" not in node.kwargs:
                sums = [p for p in parts if isinstance(p, _Sum)]
                return _Sum(sum(p.tokens for p in sums), tuple(r for p in sums for r in p.reductions))
        other = self.state(args[1]) if len(args) > 1 else None
        if target in _DIVS and isinstance(first, _Sum):
            count = args[1]
            if isinstance(other, _Sum):
                for total in (args[0], count):
                    self.sums.setdefault(total, set()).add(node)
                return None
            if other is None and _number(count) == first.tokens:
                self.sums.setdefault(args[0], set()).add(node)
                self.counts.append(node)
                return None
            if other is None:
                return first  # a partial sum scaled by a value every rank holds alike is one still
        if target in _MULS and [isinstance(first, _Sum), isinstance(other, _Sum)].count(True) == 1 and \
                None in (first, other):
            return first if isinstance(first, _Sum) else other
        return self._refuse(node, inputs)

    # -- the loss's own path ------------------------------------------------------------------------
    def _check_linear(self, node: fx.Node) -> None:
        if node is self.loss or node.target in _CASTS:
            return
        args = [a for a in node.args if isinstance(a, fx.Node)]
        on_path = [isinstance(a, fx.Node) and a in self.path for a in node.args]
        others_exact = all(self.state(a) is None for a in args if a not in self.path)
        if not others_exact:
            self._refuse(node, [self.state(a) for a in args if a not in self.path])
        linear = (node.target in _ADDS or node.target in (aten.sub.Tensor, aten.sub_.Tensor)) or \
            (node.target in (*_MULS, aten.mul_.Tensor) and sum(on_path) == 1) or \
            (node.target in _DIVS and on_path[:2] == [True, False])
        if not linear:
            raise UnexecutableStrategy(f"node {node.name} ({node.target}) combines the cross-entropy "
                                       f"({self.loss.name}) into the loss under cp={self.cp} other than linearly "
                                       f"(casts, + and - of token statistics, * and / by them): its share per cp "
                                       f"rank would not add up to the loss")

    def _refuse(self, node: fx.Node, inputs: list[_State]) -> Any:
        held = next((s for s in inputs if isinstance(s, _Sum)), None)
        what = (f"the sum over the tokens of node {held.reductions[0].name} ({held.reductions[0].target})"
                if held is not None else "per-token values")
        raise UnexecutableStrategy(f"node {node.name} ({node.target}) reads {what} of a rank's slice in the loss's "
                                   f"terms beside the cross-entropy under cp={self.cp}: mplan makes exact over the "
                                   f"cp ranks only token means (a mean over the token rows, or their sum divided "
                                   f"by its count); run it without cp")


def _is_size(val: Any) -> bool:
    return isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(val, bool)


def _pointwise(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _shifted(rows: _Rows | None, rank: int, out_rank: int) -> _Rows | None:
    """`rows` of an operand of `rank` dims in an output of `out_rank` (broadcast from the right)."""
    if rows is None:
        return None
    return _Rows(rows.start + out_rank - rank, rows.stop + out_rank - rank, rows.tokens)


def _reshaped(rows: _Rows, in_shape: Sequence[int], out_shape: Sequence[int]) -> _Rows | None:
    """`rows` after a reshape: the narrowest out dims whose prefix products bound them; dims taken
    in before them multiply the token rows (copies), dims after are features folded in."""
    inner = [math.prod(in_shape[:j]) for j in range(len(in_shape) + 1)]
    outer = [math.prod(out_shape[:j]) for j in range(len(out_shape) + 1)]
    starts = [j for j in range(rows.start + 1) if inner[j] in outer]
    stops = [j for j in range(rows.stop, len(in_shape) + 1) if inner[j] in outer]
    if not starts or not stops:
        return None
    first, last = starts[-1], stops[0]
    start = max(j for j, p in enumerate(outer) if p == inner[first])
    stop = min(j for j, p in enumerate(outer) if p == inner[last] and j > start) if last > first else start
    return _Rows(start, stop, rows.tokens * inner[rows.start] // inner[first])


def _dims(dims: Any, rank: int) -> list[int]:
    if dims is None or dims == []:
        return list(range(rank))
    return [int(d) % rank for d in ([dims] if isinstance(dims, int) else dims)]


def _is_zero(arg: Any) -> bool:
    if isinstance(arg, (int, float)):
        return arg == 0
    return isinstance(arg, fx.Node) and arg.target in _ZEROS


def _number(value: Any) -> float | None:
    """A count as the graph holds it: a number, or a symbolic size's example value."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        value = value.node.hint
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _shape(node: Any) -> tuple[int, ...]:
    return _shape_of(node.meta.get("val") if isinstance(node, fx.Node) else None)


def _shape_of(val: Any) -> tuple[int, ...]:
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(d if isinstance(d, int) else int(_number(d)) for d in val.shape)  # type: ignore[arg-type]


def _reach(roots: Collection[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """`roots` and every node reached from them by `step` (a node's inputs, or its users)."""
    seen, todo = set(roots), list(roots)
    while todo:
        for n in step(todo.pop()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    return _reach(roots, lambda n: n.all_input_nodes)


def _descendants(roots: Collection[fx.Node]) -> set[fx.Node]:
    return _reach(roots, lambda n: n.users)
