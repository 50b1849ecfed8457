"""Checks run between passes: the sharding a pass consumes, and the local program it produces.

`check_sharding(graph, choice, tp_size)` (before the passes): every node has a strategy with one
placement per input; every edge's forward and backward transitions exist (no R -> P); every
parameter has one storage placement; every non-replicated strategy has a local execution rule.
It raises the error the passes would raise, naming node and strategy, but before any tensor is
touched or any collective issued.

`check_local_graph(module, graph)` (after `insert_collectives`): runs the local program on meta
tensors (no data, no communication: reshards take their shape-only path) and compares every
node's shape with the local shape the pass recorded (`meta["mplan_local_shape"]`, the global
shape divided on the sharded dim). It returns the output's meta tensor. A wrong local size
argument, a missing reshard or a shard on the wrong dim shows up here, in one process.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx as fx

from mplan.ir.graph import Graph, TensorMeta
from mplan.planner.op_cost import grad_placement
from mplan.planner.placement import R, can_transition
from mplan.planner.strategies import Strategy
from mplan.passes.insert_collectives import INPUTS, LOCAL_SHAPE, LocalInput
from mplan.passes.local_ops import UnexecutableStrategy, rule_for
from mplan.passes.parameter_layout import parameter_layouts


class LocalGraphMismatch(AssertionError):
    """The local program computes a shape other than the one its placement implies."""


def check_sharding(graph: Graph, choice: Mapping[str, Strategy], tp_size: int) -> None:
    """Validate `choice` for execution on a TP axis of `tp_size` (see the module docstring)."""
    missing = [node.name for node in graph.nodes if node.name not in choice]
    if missing:
        raise UnexecutableStrategy(f"no strategy for nodes {missing[:5]}")
    layouts = parameter_layouts(graph, choice)
    produced = {node.name: choice[node.name].output for node in graph.nodes}
    for node in graph.nodes:
        strategy = choice[node.name]
        if len(strategy.inputs) != len(node.inputs) or len(strategy.input_grads) != len(node.inputs):
            raise UnexecutableStrategy(f"node {node.name}: strategy {strategy} has "
                                       f"{len(strategy.inputs)} input placements for {len(node.inputs)} inputs")
        if tp_size > 1:
            rule_for(node, strategy)
        for slot, value in enumerate(node.inputs):
            if value in layouts:
                out, grad_needed = layouts[value].placement, layouts[value].grad_placement
            else:
                out = produced.get(value, R)
                grad_needed = grad_placement(out)
            wanted, grad = strategy.inputs[slot], strategy.input_grads[slot]
            if not can_transition(out, wanted) or not can_transition(grad, grad_needed):
                raise UnexecutableStrategy(
                    f"edge {value} -> {node.name} ({strategy}): no collective turns {out} into "
                    f"{wanted} forward or {grad} into {grad_needed} backward")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_local_graph(module: fx.GraphModule, graph: Graph) -> torch.Tensor:
    """Run `module` on meta tensors of its local input shapes; raise on the first shape that
    differs from the recorded local shape; return the output (a meta tensor)."""
    inputs: tuple[LocalInput, ...] = module.meta[INPUTS]
    placeholders = {n.name: n for n in module.graph.nodes if n.op == "placeholder"}
    values = []
    for spec in inputs:
        meta: TensorMeta | None = graph.params[spec.name].meta if spec.kind == "PARAMETER" \
            else graph.graph_inputs.get(spec.name)
        if meta is None:
            raise LocalGraphMismatch(f"input {spec.name}: no metadata in the captured graph")
        shape = placeholders[spec.placeholder].meta.get(LOCAL_SHAPE, meta.shape)
        values.append(torch.empty(shape, dtype=_dtype(meta.dtype), device="meta"))
    return _ShapeChecker(module).run(*values)


class _ShapeChecker(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        expected = n.meta.get(LOCAL_SHAPE)
        if expected is not None and isinstance(result, torch.Tensor) and tuple(result.shape) != tuple(expected):
            raise LocalGraphMismatch(f"local node {n.name} ({n.target}): computes shape "
                                     f"{tuple(result.shape)}, its placement implies {tuple(expected)}")
        return result
