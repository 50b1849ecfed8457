"""Mixture-of-experts layers as the captured graph shows them: one `moe_experts` node each.

Capture turns every experts module it recognizes into one `mplan.moe_experts` op
(`mplan.kernels.moe`; recognition: `mplan.ir.experts_capture`), so MoE layers are found by the
graph's structure, never by parameter names: the experts are that node's stacked weights (dim 0
counts them), the top-k is its routing input's width. The planner counts experts and prices
their all-to-all from `experts_nodes`; the runtime shards `expert_parameters` over the
expert-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    itemsize: int  # bytes per element of the routed activations

    @property
    def routed_bytes(self) -> int:
        """Bytes of the T*k token copies one dispatch (or one combine) moves in all."""
        return self.tokens * self.top_k * self.hidden * self.itemsize

    @property
    def weight_elements(self) -> int:
        """Elements of all E experts' weights."""
        return self.num_experts * self.hidden * self.ffn * (3 if self.gated else 2)


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
                       capacity_factor=None if capacity is None else float(capacity), weights=weights,
                       itemsize=x.nbytes // max(1, x.numel))


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
