"""What routes a captured `moe_experts` node: the router's scores, top-k and weights, read off the graph.

Input: the graph and one experts node, whose arguments 1 and 2 are the routing (`index` [T, k],
`gate` [T, k]). Output: a `Router` record for `mplan inspect`. The router is never part of the
op: its ops stay ordinary ATen ops that every plan runs as the model wrote them, so whatever is
found here describes the model and changes nothing it computes. What is recognized, walking back
from the two routing inputs through pass-through ops (casts, reshapes, tuple items):

    index = topk(sel)[1]            sel = scores | scores + b (b a parameter or buffer: a bias
                                    used only to choose experts, DeepSeek-V3's
                                    e_score_correction_bias) | masked_fill(sel, mask from another
                                    top-k) (group-limited: only the best expert groups compete)
    scores = softmax(logits) | sigmoid(logits) | logits
    gate  = c * w / (sum(w) [+ eps | clamp]) | c * w      (renormalized; c: a routed scaling factor)
    w     = topk(sel)[0] | gather(scores, index) | softmax(topk(logits)[0])

`logits` is the router's linear: the nearest linear ancestor of `index`, found whatever the rest
of the routing looks like (Phi-MoE's sparse mixer is "unrecognized" but its router is still named,
so its linear is not mistaken for a shared expert).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mplan.ir.graph import Graph, OpNode
from mplan.ir.op_table import op_packet

PASS = frozenset({"getitem", "to", "_to_copy", "view", "reshape", "_unsafe_view", "type_as", "contiguous",
                  "clone", "squeeze", "unsqueeze", "flatten", "alias", "detach"})
"""Ops that carry a value unchanged (a cast, a reshape, one element of a tuple) on the way to the experts."""

_LINEAR = frozenset({"linear", "mm", "matmul"})
_SCORES = {"softmax": "softmax", "_softmax": "softmax", "sigmoid": "sigmoid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Router:
    """How one MoE layer picks and weights its experts."""

    linear: str | None  # the node computing the router's logits, when found
    scoring: str  # "softmax, then top-k" | "sigmoid, then top-k" | "top-k, then softmax" | "top-k of logits"
    # | "unrecognized"
    selection_bias: bool  # a learned bias is added to the scores to choose experts, not to weight them
    group_limited: bool  # the top-k runs over the experts of the best groups only (the others masked)
    normalized: bool  # the top-k weights are divided by their own sum
    scale: float | None  # a constant the weights are multiplied by at the end (None: 1)
    chain: frozenset[str]  # the nodes from the logits to the routing inputs (the routing itself)


def find_router(graph: Graph, experts: OpNode) -> Router:
    """The router feeding `experts` (a `moe_experts` node)."""
    by_name = {n.name: n for n in graph.nodes}

    def back(name: str) -> OpNode | None:
        node = by_name.get(name)
        while node is not None and op_packet(node.op) in PASS and node.inputs:
            node = by_name.get(node.inputs[0])
        return node

    index, gate = experts.inputs[1], experts.inputs[2]
    linear = _ancestor(by_name, index, _LINEAR)  # the router's
    scoring, selection_bias, group_limited = "unrecognized", False, False
    topk = back(index)
    if topk is not None and op_packet(topk.op) == "topk":
        sel = back(topk.inputs[0])
        if sel is not None and op_packet(sel.op) == "masked_fill" and \
                _ancestor(by_name, sel.inputs[1], frozenset({"topk"}), limit=64) is not None:
            group_limited, sel = True, back(sel.inputs[0])
        if sel is not None and op_packet(sel.op) == "add" and len(sel.inputs) == 2 and back(sel.inputs[1]) is None:
            selection_bias, sel = True, back(sel.inputs[0])
        weights, scale, normalized = _weights(back, gate)
        if sel is not None and op_packet(sel.op) in _SCORES:
            scoring = f"{_SCORES[op_packet(sel.op)]}, then top-k"
        elif weights is not None and op_packet(weights.op) in ("softmax", "_softmax"):
            scoring = "top-k, then softmax"
        else:
            scoring = "top-k of logits"
    else:
        _, scale, normalized = _weights(back, gate)
    chain = _between(graph, by_name, linear, (index, gate)) if linear is not None else frozenset()
    return Router(linear=linear.name if linear is not None else None, scoring=scoring, selection_bias=selection_bias,
                  group_limited=group_limited, normalized=normalized, scale=scale, chain=chain)


def describe(router: Router) -> str:
    """One phrase: "sigmoid, then top-k with a selection bias, group-limited, renormalized, scaled by 2.5"."""
    parts = [router.scoring + (" with a selection bias" if router.selection_bias else "")]
    parts += ["group-limited"] * router.group_limited + ["renormalized"] * router.normalized
    parts += [f"scaled by {router.scale:g}"] if router.scale is not None else []
    return ", ".join(parts)


def escapes(node: OpNode, chain: frozenset[str], users: dict[str, list[OpNode]]) -> bool:
    """A consumer of the router's logits or scores computes something besides the routing (through
    pass-through ops; assertions aside)."""
    if node.name in chain or op_packet(node.op) in ("_assert_tensor_metadata", "moe_experts"):
        return False
    if op_packet(node.op) in PASS:
        return any(escapes(u, chain, users) for u in users.get(node.name, []))
    return True


def _weights(back, gate: str) -> tuple[OpNode | None, float | None, bool]:  # noqa: ANN001 - the walk above
    """(the node the weights come from, the constant they are scaled by, renormalized?)."""
    node, scale = back(gate), None
    if node is not None and op_packet(node.op) == "mul" and len(node.inputs) == 1:
        constant = next((a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
        if constant is not None:
            scale = None if constant == 1 else float(constant)
            node = back(node.inputs[0])
    if node is None or op_packet(node.op) != "div" or len(node.inputs) < 2:
        return node, scale, False
    divisor = back(node.inputs[1])
    if divisor is not None and op_packet(divisor.op) in ("add", "clamp", "clamp_min") and len(divisor.inputs) == 1:
        divisor = back(divisor.inputs[0])  # sum + eps, or sum clamped from below: still its own sum
    numerator = back(node.inputs[0])
    normalized = divisor is not None and op_packet(divisor.op) == "sum" and back(divisor.inputs[0]) == numerator
    return numerator, scale, normalized


def _ancestor(by_name: dict[str, OpNode], start: str, packets: frozenset[str], limit: int | None = None,
              ) -> OpNode | None:
    """The first op of one of `packets` met walking back from `start`, breadth first (`start`
    itself included), looking at no more than `limit` nodes when given."""
    queue, seen = deque([start]), {start}
    while queue and (limit is None or len(seen) <= limit):
        node = by_name.get(queue.popleft())
        if node is None:
            continue
        if op_packet(node.op) in packets:
            return node
        for name in node.inputs:
            if name not in seen:
                seen.add(name)
                queue.append(name)
    return None


def _between(graph: Graph, by_name: dict[str, OpNode], source: OpNode, targets: tuple[str, ...]) -> frozenset[str]:
    """The nodes that depend on `source` and that the `targets` depend on, `source` and the
    targets included: the routing computation."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    start = position[source.name]
    upstream, stack = set(), list(targets)
    while stack:  # the graph is in execution order: nothing before the source depends on it
        name = stack.pop()
        node = by_name.get(name)
        if node is None or name in upstream or position[name] < start:
            continue
        upstream.add(name)
        if name != source.name:
            stack.extend(node.inputs)
    downstream = {source.name}
    for node in graph.nodes[start:]:
        if node.name in upstream and any(i in downstream for i in node.inputs):
            downstream.add(node.name)
    return frozenset(upstream & downstream)
