"""Mixture-of-experts layers as the captured graph shows them: one `moe_experts` node each.

Capture turns every experts module it recognizes into one `mplan.moe_experts` op
(`mplan.kernels.moe`; recognition: `mplan.ir.experts_capture`), so MoE layers are found by the
graph's structure, never by parameter names: the experts are that node's stacked weights (dim 0
counts them), the top-k is its routing input's width. The planner counts experts with
`num_experts` (and prices each layer from the node's shapes: `cost_models/moe_cost.py`); the
runtime shards `expert_parameters` over the expert-parallel ranks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from mplan.ir.graph import Graph, OpNode
from mplan.ir.op_table import op_packet

EXPERTS_PACKET = "moe_experts"
# the op's positional arguments (mplan.kernels.moe.moe_experts)
_WEIGHT_SLOTS = {3: "w_in", 4: "w_out", 5: "w_up"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertsNode:
    """One MoE layer's routed experts, at the capture's batch."""

    node: str  # the graph node
    num_experts: int
    top_k: int
    tokens: int  # T: tokens routed per call (a micro-batch's, at the graph's batch)
    hidden: int
    ffn: int  # each expert's intermediate width
    gated: bool  # act(gate) * up, else act(up)
    activation: str
    capacity_factor: float | None  # None: dropless
    weights: dict[str, str]  # role (w_in, w_out, w_up) -> parameter name


def is_experts(node: OpNode) -> bool:
    return op_packet(node.op) == EXPERTS_PACKET


def experts_node(node: OpNode) -> ExpertsNode:
    """The facts of one `moe_experts` node (arguments as `mplan.kernels.moe.moe_experts`)."""
    x, index, w_in, w_out = node.input_metas[0], node.input_metas[1], node.input_metas[3], node.input_metas[4]
    args = node.args
    activation, gated, capacity = (args[6], args[7], args[8]) if len(args) >= 9 else ("silu", True, None)
    with_up = len(node.inputs) > 5
    ffn = w_out.shape[2]
    weights = {_WEIGHT_SLOTS[pos]: name for pos, name in node.params if pos in _WEIGHT_SLOTS}
    return ExpertsNode(node=node.name, num_experts=w_in.shape[0], top_k=index.shape[1], tokens=x.shape[0],
                       hidden=x.shape[1], ffn=ffn, gated=bool(gated) or with_up, activation=str(activation),
                       capacity_factor=None if capacity is None else float(capacity), weights=weights)


def experts_nodes(graph: Graph) -> list[ExpertsNode]:
    """Every MoE layer of the graph, in graph order."""
    return [experts_node(n) for n in graph.nodes if is_experts(n)]


def expert_parameters(graph: Graph) -> frozenset[str]:
    """Parameters that are stacked expert weights (sharded on dim 0 over expert-parallel ranks)."""
    return frozenset(name for n in graph.nodes if is_experts(n) for pos, name in n.params if pos in _WEIGHT_SLOTS)


def num_experts(graph: Graph) -> int:
    """Experts per MoE layer (the fewest where layers differ: an EP degree must divide each); 0
    for a dense model."""
    counts = [e.num_experts for e in experts_nodes(graph)]
    return min(counts) if counts else 0


# -- the layer around the experts: router, shared expert, auxiliary losses -------------------------
_PASS = frozenset({"getitem", "to", "_to_copy", "view", "reshape", "_unsafe_view", "type_as", "contiguous",
                   "clone", "squeeze", "unsqueeze", "flatten", "alias", "detach"})
"""Ops that carry a value unchanged (a cast, a reshape, one element of a tuple) on the way to the experts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoELayer:
    """One MoE layer as capture found it: its experts and what routes them (for `mplan inspect`;
    the router, shared expert and losses are ordinary ops every plan runs as the model wrote them)."""

    experts: ExpertsNode
    router: str | None  # the node computing the router's logits (a linear), when found
    scoring: str  # "softmax, then top-k" | "top-k, then softmax" | "top-k of logits" | "unrecognized"
    normalized: bool  # the top-k weights are divided by their sum
    shared_expert: tuple[str, ...]  # parameters of dense layers every token runs beside the experts
    aux_loss: bool  # the router's scores feed more than the routing (load-balancing or z-loss terms)


def moe_layers(graph: Graph) -> list[MoELayer]:
    """Every MoE layer of the graph with its router, shared expert and auxiliary-loss use."""
    by_name = {n.name: n for n in graph.nodes}
    users: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        for name in dict.fromkeys(n.inputs):
            users.setdefault(name, []).append(n)
    back = functools.partial(_producer, by_name)
    layers = []
    for node in graph.nodes:
        if not is_experts(node):
            continue
        topk = back(node.inputs[1])
        router, scoring, chain = None, "unrecognized", set()
        if topk is not None and op_packet(topk.op) == "topk":
            chain.add(topk.name)
            scores = back(topk.inputs[0])
            gate = back(node.inputs[2])
            if scores is not None and op_packet(scores.op) in ("softmax", "_softmax"):
                scoring, chain = "softmax, then top-k", chain | {scores.name}
                router = back(scores.inputs[0])
            elif gate is not None and op_packet(gate.op) in ("softmax", "_softmax"):
                scoring, router = "top-k, then softmax", scores
            else:
                scoring, router = "top-k of logits", scores
        router_name = router.name if router is not None and op_packet(router.op) in ("linear", "mm", "matmul") \
            else None
        layers.append(MoELayer(
            experts=experts_node(node), router=router_name, scoring=scoring,
            normalized=_normalized(back, node.inputs[2]),
            shared_expert=_shared_expert(graph, node, router_name),
            aux_loss=any(_escapes(u, chain, users) for v in (router_name, *chain)
                         if v is not None and op_packet(by_name[v].op) != "topk" for u in users.get(v, []))))
    return layers


def _producer(by_name: dict[str, OpNode], name: str) -> OpNode | None:
    """The first producer of `name` that is not a pass-through op."""
    node = by_name.get(name)
    while node is not None and op_packet(node.op) in _PASS and node.inputs:
        node = by_name.get(node.inputs[0])
    return node


def _normalized(back: Callable[[str], OpNode | None], gate: str) -> bool:
    """The gate is top-k weights divided by their own sum."""
    node = back(gate)
    if node is None or op_packet(node.op) != "div" or len(node.inputs) < 2:
        return False
    divisor = back(node.inputs[1])
    return divisor is not None and op_packet(divisor.op) == "sum" and back(divisor.inputs[0]) == back(node.inputs[0])


def _shared_expert(graph: Graph, experts: OpNode, router: str | None) -> tuple[str, ...]:
    """Weights of the dense GEMMs inside the experts' parent module, router aside."""
    parent = experts.module_path.rpartition(".")[0]
    names = []
    for n in graph.nodes:
        if n.name != router and op_packet(n.op) in ("linear", "mm", "matmul") and \
                n.module_path.startswith(parent + ".") and not n.module_path.startswith(experts.module_path):
            names.extend(name for _, name in n.params)
    return tuple(dict.fromkeys(names))


def _escapes(node: OpNode, chain: set[str], users: dict[str, list[OpNode]]) -> bool:
    """A consumer of the router's logits or scores computes something besides the routing (through
    pass-through ops; assertions aside)."""
    if node.name in chain or op_packet(node.op) == "_assert_tensor_metadata":
        return False
    if op_packet(node.op) in _PASS:
        return any(_escapes(u, chain, users) for u in users.get(node.name, []))
    return True
