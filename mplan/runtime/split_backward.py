"""A pipeline stage's backward for one micro-batch, whole (B) or split into I and W.

Role: zero-bubble schedules (ZB-H1, Qi et al., "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241) run a stage's backward as two actions: `I` computes only the gradients of the
stage's inputs, sent at once to the previous stage, and `W`, later, only the parameters'
gradients. `backward_input` is I and returns a `WeightGradients` whose `run()` is W;
`backward_full` is the plain `B` action, so the executor has one module for both forms.

Input: one micro-batch's stage outputs with their gradients (on the last stage its scalar loss
with `None`, meaning ones); the stage's received activations (leaves; those that require grad
are differentiated, the others ignored); its parameters (frozen ones ignored).
Output: the inputs' gradients (None where none flows); the parameters' gradients added to
`param.grad` in place where it exists (the runtime keeps `.grad` as views into flat
communication buckets, so it is never replaced), set where it is None.

How the backward is split. Call the input side E the autograd nodes, reachable from the
outputs, from which a differentiable input can be reached. I is one `autograd.grad` with
`inputs=` the inputs: the engine runs exactly the nodes of E and has each compute only its
edges into E, so a GEMM's backward does dX and skips dW. A node outside E reaches no input,
so neither does anything below it: every path from an output to a parameter leaves E at most
once, along a boundary edge F -> T with F in E (a frontier node) and T outside E, or lies
outside E altogether (from an output whose node is outside E, e.g. every output of a first
stage, whose inputs are token ids).
- I: prehooks on the frontier nodes capture the gradient flowing into each, which is complete
  there because the engine runs a node only after all its parents.
- W step 1: each frontier node is run again, alone, from its captured gradient, with its own
  boundary edges as the targets: the engine computes those edges (dW) and, unless one of the
  node's children in E can reach those targets, none of its edges into E (dX). A posthook
  records the boundary values and lets nothing flow further in this step.
- W step 2: one `autograd.grad` from the boundary targets (values summed per target) and the
  output edges outside E, down to the parameters, through nodes outside E only.

No double counting: each output-to-parameter path crosses exactly one boundary edge (or none)
and is computed once, in step 1 on that edge and in step 2 below it. A parameter read several
times (a tied embedding and head, a weight read by two ops where one feeds the other) gets
each use's path once; the uses are summed by autograd's buffers or by step 2's per-target sums.

Invariants:
- Input and parameter gradients equal one plain `torch.autograd.backward` of the same outputs,
  up to the order in which several contributions to one gradient are added (bitwise when a
  gradient sums at most two).
- The outputs' gradients are read, never modified; a gradient set into an empty `.grad` is a
  fresh tensor in the parameter's layout.
- `run()` runs once: afterwards the `WeightGradients` holds no node, tensor or parameter, so the
  micro-batch's activations are freed once the caller drops its outputs too (the executor
  holds them until W); not before: I keeps the graph that W needs (`retain_graph=True`).

Cost: I + W do the work of one backward (GEMM flops counted in the tests), plus one Python walk
over the micro-batch's autograd graph in I. Exceptions:
- a frontier node with a child in E that can reach one of its own boundary targets (a weight
  that two chained ops read directly, `(x @ w) @ w`) also recomputes that child's edge in W
  step 1 (its result is dropped by the posthook). `nn.Linear` reads its weight through a
  transpose node of its own, so this does not arise for it.
- a custom `autograd.Function`'s backward computes what its `ctx.needs_input_grad` (fixed at
  forward time) asks for, in I and again in W when it is a frontier node.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Grads = tuple[torch.Tensor | None, ...]


@dataclass(slots=True, kw_only=True)
class _Frontier:
    """A node of the input side with edges to parameter paths outside it."""

    node: Node
    boundary: tuple[tuple[int, GradientEdge], ...]  # (index in node.next_functions, edge it feeds)
    grads: Grads | None = None  # the gradient flowing into the node, captured during I

    def capture(self, grad_outputs: Grads) -> None:
        self.grads = tuple(grad_outputs)

    def boundary_values(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        """W step 1: the gradients this node sends along its boundary edges (dW, not dX)."""
        assert self.grads is not None, "checked after I"
        roots = [(GradientEdge(self.node, i), g) for i, g in enumerate(self.grads) if g is not None]
        if not roots:
            return []
        recorded: list[torch.Tensor | None] = []

        def record(grad_inputs: Grads, grad_outputs: Grads) -> Grads:
            recorded.extend(grad_inputs)
            # Below a boundary edge is step 2's work, and edges into E are I's: nothing flows on.
            return (None,) * len(grad_inputs)

        targets = list(dict.fromkeys(edge for _, edge in self.boundary))
        handle = self.node.register_hook(record)
        try:
            # Kept: another frontier node's step 1 may run this node's children, step 2 runs the
            # boundary targets.
            torch.autograd.grad([e for e, _ in roots], targets, [g for _, g in roots],
                                retain_graph=True, allow_unused=True)
        finally:
            handle.remove()
        found = [(edge, recorded[index]) for index, edge in self.boundary]
        return [(edge, value) for edge, value in found if value is not None]


class WeightGradients:
    """The pending W pass of one (stage, micro-batch) after its I pass; `run()` once."""

    __slots__ = ("_frontier", "_roots", "_params", "_owners", "_done")

    def __init__(self, *, frontier: list[_Frontier], roots: list[tuple[GradientEdge, torch.Tensor]],
                 params: list[tuple[torch.Tensor, GradientEdge]], owners: list[Node]) -> None:
        self._frontier = frontier
        self._roots = roots  # output edges outside the input side, with their gradients
        self._params = params  # the trainable parameters this micro-batch's graph reaches
        # Before torch 2.13 (pytorch#181390) a custom Function's node object did not own its C++
        # node, so a frontier or root node of that kind is kept alive through these.
        self._owners = owners
        self._done = False

    def run(self) -> None:
        """Add the micro-batch's parameter gradients into `.grad`; then release its graph."""
        if self._done:
            raise RuntimeError("WeightGradients.run() was already called for this micro-batch: its "
                               "parameter gradients are in .grad and its autograd graph is released")
        self._done = True  # also after a failure: a retry could add some gradients twice
        try:
            sums: dict[GradientEdge, torch.Tensor] = {}
            pending = [v for f in self._frontier for v in f.boundary_values()] + self._roots
            for edge, value in pending:
                sums[edge] = sums[edge] + value if edge in sums else value
            if sums:
                found = torch.autograd.grad(list(sums), [e for _, e in self._params], list(sums.values()),
                                            allow_unused=True)
                _accumulate([p for p, _ in self._params], found)
        finally:
            self._frontier, self._roots, self._params, self._owners = [], [], [], []


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[Grads, WeightGradients]:
    """I: the inputs' gradients only, and the W pass that later adds the parameters' gradients."""
    tensors, grads = _roots(outputs, grad_outputs)
    differentiable = _differentiable(inputs)
    trainable = _trainable(params)
    edges = [get_gradient_edge(t) for t in tensors]
    input_nodes = {get_gradient_edge(t).node for _, t in differentiable}
    param_edges = {p: get_gradient_edge(p) for p in trainable}
    cut = _Cut.of(edges, input_nodes, {e.node for e in param_edges.values()})

    frontier = cut.frontier()
    weight_roots = [(edge, grad) for edge, grad in zip(edges, grads)
                    if edge.node not in cut.input_side and edge.node in cut.param_side]
    found: Grads = (None,) * len(differentiable)
    if input_nodes & cut.input_side:
        handles = [f.node.register_prehook(f.capture) for f in frontier]
        try:
            # W re-runs the frontier nodes; without any, I is the last user of what it runs.
            found = torch.autograd.grad(tensors, [t for _, t in differentiable], grads,
                                        retain_graph=bool(frontier), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
    missed = [f.node.name() for f in frontier if f.grads is None]
    if missed:
        raise RuntimeError(f"frontier nodes {missed} did not run in the input-gradient pass")

    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    for (position, _), grad in zip(differentiable, found):
        input_grads[position] = grad
    used = [(p, e) for p, e in param_edges.items() if e.node in cut.param_side]
    owners = cut.owners([f.node for f in frontier] + [e.node for e, _ in weight_roots],
                        {e.node: e.ownership_token for e in edges if e.ownership_token is not None})
    return tuple(input_grads), WeightGradients(frontier=frontier, roots=weight_roots, params=used,
                                               owners=owners)


def backward_full(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                  inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> Grads:
    """B: one autograd pass for the inputs' gradients (returned) and the parameters' (into .grad)."""
    tensors, grads = _roots(outputs, grad_outputs)
    differentiable = _differentiable(inputs)
    trainable = _trainable(params)
    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    wrt = [t for _, t in differentiable] + trainable
    if not tensors or not wrt:
        return tuple(input_grads)
    found = torch.autograd.grad(tensors, wrt, grads, allow_unused=True)
    for (position, _), grad in zip(differentiable, found):
        input_grads[position] = grad
    _accumulate(trainable, found[len(differentiable):])
    return tuple(input_grads)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Cut:
    """The graph below the outputs, split into the input side and the parameter paths."""

    input_side: frozenset[Node]  # nodes that reach a differentiable input (E)
    param_side: frozenset[Node]  # nodes that reach a trainable parameter
    order: tuple[Node, ...]  # every reachable node, children before parents
    parent: dict[Node, Node]  # a parent of each non-root node, through which it was found

    @staticmethod
    def of(roots: Sequence[GradientEdge], input_nodes: set[Node], param_nodes: set[Node]) -> _Cut:
        order, parent = _post_order(e.node for e in roots)
        reaches_input: set[Node] = set()
        reaches_param: set[Node] = set()
        for node in order:
            children = [c for c, _ in node.next_functions if c is not None]
            if node in input_nodes or any(c in reaches_input for c in children):
                reaches_input.add(node)
            if node in param_nodes or any(c in reaches_param for c in children):
                reaches_param.add(node)
        return _Cut(input_side=frozenset(reaches_input), param_side=frozenset(reaches_param),
                    order=tuple(order), parent=parent)

    def frontier(self) -> list[_Frontier]:
        found = []
        for node in self.order:
            if node not in self.input_side:
                continue
            boundary = tuple((i, GradientEdge(child, nr)) for i, (child, nr) in enumerate(node.next_functions)
                             if child is not None and child not in self.input_side and child in self.param_side)
            if boundary:
                found.append(_Frontier(node=node, boundary=boundary))
        return found

    def owners(self, nodes: Iterable[Node], root_tokens: dict[Node, Node]) -> list[Node]:
        """C++ nodes whose Python objects keep `nodes` alive (a C++ node's own object does).

        `root_tokens`: for an output whose node is Python-defined, the C++ node that
        `get_gradient_edge` made to own it."""
        owners: dict[Node, None] = {}
        for node in nodes:
            while isinstance(node, torch._C._FunctionBase) and node in self.parent:
                node = self.parent[node]
            owners[root_tokens.get(node, node)] = None
        return list(owners)


def _post_order(roots: Iterable[Node]) -> tuple[list[Node], dict[Node, Node]]:
    """Reachable nodes, each after all its children (iterative: stage graphs can be deep)."""
    order: list[Node] = []
    parent: dict[Node, Node] = {}
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, edges = stack[-1]
            for child, _ in edges:
                if child is not None and child not in seen:
                    seen.add(child)
                    parent[child] = node
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order, parent


def _roots(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that require grad, with their gradients (None: ones, for a scalar only)."""
    if len(grad_outputs) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(grad_outputs)} output gradients")
    tensors, grads = [], []
    for index, (out, grad) in enumerate(zip(outputs, grad_outputs)):
        if not out.requires_grad:
            continue
        if grad is None:
            if out.numel() != 1:
                raise ValueError(f"output {index} of shape {tuple(out.shape)} has gradient None, "
                                 "which stands for ones only for a scalar (the last stage's loss)")
            grad = torch.ones_like(out)
        tensors.append(out)
        grads.append(grad)
    return tensors, grads


def _differentiable(inputs: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(position, tensor) of the inputs that require grad; they must be leaves."""
    found = [(i, t) for i, t in enumerate(inputs) if t.requires_grad]
    for position, tensor in found:
        if tensor.grad_fn is not None:
            # Its graph would continue into the previous stage's, and W would follow it there.
            raise ValueError(f"input {position} requires grad but is not a leaf "
                             f"(grad_fn {tensor.grad_fn.name()}): detach received activations")
    return found


def _trainable(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that require grad, each once (a tied weight may be listed twice)."""
    return list({id(p): p for p in params if p.requires_grad}.values())


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            if param.grad is None:
                # A copy: autograd's result may alias the output gradients, the input gradients
                # sent back, or another parameter's, or be an expanded view add_ cannot write to.
                param.grad = torch.empty_like(param).copy_(grad)
            else:
                param.grad.add_(grad)
