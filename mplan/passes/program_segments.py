"""Which segment of the captured model (prologue, block instance, glue, epilogue) each op of a
local program belongs to.

Input: a local program (`insert_collectives`, possibly after `fuse_kernels`) and the captured
`Graph` whose segments the planner priced and cut into units. Output: for every op node of the
program (call_function, call_module, call_method), in program order, its segment name.

Ops keep their IR node's name through the passes, so most are found directly. A node the
planner never saw (a reshard, a fused kernel, a `getitem` of a multi-output op the rewrite
emitted) belongs to the segment of the next op it precedes in program order that the planner
did see: reshards run where their consumer runs, and a fused chain where its last op ran. Nodes
after the last labelled op join the last segment. A `getitem` always stays with the op whose
tuple it reads, so a segment border never falls between a multi-output op and its elements.
Recomputation (`recompute.py`) and the pipeline cut (`split_stages.py`) read the same labels,
so a checkpointed unit never straddles a stage border.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch.fx as fx

from mplan.ir.graph import Graph

OP_KINDS = ("call_function", "call_module", "call_method")


def op_segments(program: fx.GraphModule, graph: Graph, *,
                label_of: Callable[[fx.Node], str | None] | None = None) -> list[tuple[fx.Node, str]]:
    """(op node, segment name) for every op of `program`, in program order (see module doc);
    empty when no op is labelled. `label_of` names the segment of an op the planner did not see
    (e.g. a checkpointed unit's call, by its inner ops), before the rule above applies."""
    segment_of = {name: seg.name for seg in graph.segments for name in seg.nodes}
    ops = [n for n in program.graph.nodes if n.op in OP_KINDS]
    labels: list[str | None] = [segment_of.get(n.name) or (label_of(n) if label_of else None) for n in ops]
    following: str | None = None
    for i in range(len(ops) - 1, -1, -1):
        if labels[i] is None:
            labels[i] = following
        following = labels[i]
    last = next((label for label in reversed(labels) if label is not None), None)
    if last is None:
        return []
    out: dict[fx.Node, str] = {}
    for node, label in zip(ops, labels):
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in out:
            label = out[node.args[0]]
        out[node] = label or last
    return list(out.items())
