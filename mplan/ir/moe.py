"""Mixture-of-experts layers as the captured graph shows them: one `moe_experts` node each.

Capture turns every experts module it recognizes into one `mplan.moe_experts` op
(`mplan.kernels.moe`; recognition: `mplan.ir.experts_capture`), so MoE layers are found by the
graph's structure, never by parameter names: the experts are that node's stacked weights (dim 0
counts them), the top-k is its routing input's width. The planner counts experts with
`num_experts` (and prices each layer from the node's shapes: `cost_models/moe_cost.py`); the
runtime shards `expert_parameters` over the expert-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from mplan.ir.graph import Graph, OpNode
from mplan.ir.moe_router import describe, escapes, find_router
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
@dataclass(frozen=True, slots=True, kw_only=True)
class MoELayer:
    """One MoE layer as capture found it: its experts and what routes them (for `mplan inspect`;
    the router, shared expert and losses are ordinary ops every plan runs as the model wrote them)."""

    experts: ExpertsNode
    router: str | None  # the node computing the router's logits (a linear), when found
    scoring: str  # "softmax, then top-k" | "sigmoid, then top-k" | "top-k, then softmax" | "top-k of logits"
    # | "unrecognized" (`mplan.ir.moe_router`)
    normalized: bool  # the top-k weights are divided by their sum
    routing: str  # the whole router in one phrase: scoring, selection bias, group limit, renormalized, scale
    shared_expert: tuple[str, ...]  # parameters of dense layers every token runs beside the experts
    aux_loss: bool  # the router's scores feed more than the routing (load-balancing or z-loss terms)


def moe_layers(graph: Graph) -> list[MoELayer]:
    """Every MoE layer of the graph with its router, shared expert and auxiliary-loss use."""
    users: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        for name in dict.fromkeys(n.inputs):
            users.setdefault(name, []).append(n)
    layers = []
    for node in graph.nodes:
        if not is_experts(node):
            continue
        router = find_router(graph, node)
        layers.append(MoELayer(
            experts=experts_node(node), router=router.linear, scoring=router.scoring, normalized=router.normalized,
            routing=describe(router), shared_expert=_shared_expert(graph, node, router.linear),
            aux_loss=any(escapes(u, router.chain, users) for v in router.chain for u in users.get(v, []))))
    return layers


def _shared_expert(graph: Graph, experts: OpNode, router: str | None) -> tuple[str, ...]:
    """Weights of the dense GEMMs inside the experts' parent module, router aside."""
    parent = experts.module_path.rpartition(".")[0]
    names = []
    for n in graph.nodes:
        if n.name != router and op_packet(n.op) in ("linear", "mm", "matmul") and \
                n.module_path.startswith(parent + ".") and not n.module_path.startswith(experts.module_path):
            names.extend(name for _, name in n.params)
    return tuple(dict.fromkeys(names))
