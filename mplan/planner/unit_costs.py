"""Per-unit costs of a sharded model: what the pipeline partitioner and the evaluator add up.

A unit is one segment of the captured graph in execution order: the prologue (embeddings), each
block instance, glue between blocks, and the epilogue (final norm, head, loss). Given the TP
sharding solved for every segment (`GraphSharding`), each unit gets its forward and backward
seconds per micro-batch of the captured batch, its local parameters, the activations it keeps for
backward under each recomputation mode, and its input (what full recomputation checkpoints).

Recomputation modes, as the planner defines them for fused-attention models:
- none: every tensor an op keeps for backward stays in memory.
- selective: the unit's input and the outputs of its GEMMs, attention and embeddings stay (the
  runtime's selective checkpoint policy caches exactly those, `passes/recompute.py`); norms and
  elementwise ops (cheap, memory-bound, and the bulk of the bytes after fused attention) are
  re-run in backward.
- full: only the unit's input stays; the whole forward is re-run in backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mplan.ir.graph import Graph
from mplan.planner.op_cost import OpCoster
from mplan.ir.placement import Shard
from mplan.planner.sharding_ilp import GraphSharding, SegmentSharding, stream_meta, value_meta
from mplan.planner.op_registry import shard_bytes

_KEEP_UNDER_SELECTIVE = ("matmul", "attention", "embedding", "loss")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitCost:
    name: str  # "prologue", "layers.3", "epilogue", "glue.N"
    block_type: str | None
    forward_s: float  # one micro-batch of the captured batch, collectives included
    backward_s: float
    comm_forward_s: float
    comm_backward_s: float
    num_params: int  # local parameters (elements) on one TP rank
    # (name, local elements) of a glue unit's parameters: a tied embedding read by both the
    # prologue and the epilogue is held once by a rank that runs both
    glue_params: tuple[tuple[str, int], ...] = ()
    tp_grad_sync_bytes: int  # replicated parameters with partial gradients, all-reduced over TP
    saved_bytes: int  # activations kept for backward, recompute none
    selective_bytes: int  # activations kept under selective recomputation
    selective_extra_s: float  # forward seconds re-run in backward under selective recomputation (collectives included)
    input_bytes: int  # the unit's input activation (local): what full recomputation keeps
    largest_op_bytes: int  # largest single op's local output: a transient bound


def segment_unit(graph: Graph, name: str, block_type: str | None, nodes: tuple[str, ...],
                 sharding: SegmentSharding, coster: OpCoster) -> UnitCost:
    """Costs of one segment under its solved sharding."""
    n = sharding.axis_size
    selective_saved: set[str] = set()
    kept_extra = 0
    extra = 0.0
    largest = 0
    seen_params: set[str] = set()
    num_params = 0
    glue: list[tuple[str, int]] = []
    for node in graph.nodes_of(nodes):
        s = sharding.choice[node.name]
        if node.kind in _KEEP_UNDER_SELECTIVE:
            selective_saved.add(graph.storage_root(node.name))
            kept_extra += node.saved_extra_bytes  # attention's logsumexp
        elif node.kind not in ("view", "getitem", "scalar"):
            extra += coster.op(node, s).forward_s
        if node.outputs:
            largest = max(largest, shard_bytes(node.output, s.output, n))
        for _, param in node.params:
            if param in seen_params:
                continue
            seen_params.add(param)
            placement = sharding.choice[node.name].inputs[node.inputs.index(param)]
            numel = graph.params[param].meta.numel // (n if isinstance(placement, Shard) else 1)
            num_params += numel
            glue.append((param, numel))
    stream = stream_meta(graph)
    input_bytes = 0 if stream is None else shard_bytes(stream, sharding.boundary, n)
    selective_bytes = input_bytes + kept_extra // n + sum(
        shard_bytes(value_meta(graph, r), sharding.choice[r].output if r in sharding.choice else sharding.boundary, n)
        for r in selective_saved if r not in graph.params and value_meta(graph, r) is not None)
    return UnitCost(name=name, block_type=block_type, forward_s=sharding.forward_s, backward_s=sharding.backward_s,
                    comm_forward_s=sharding.comm_forward_s, comm_backward_s=sharding.comm_backward_s,
                    num_params=num_params, glue_params=tuple(glue) if block_type is None else (),
                    tp_grad_sync_bytes=sharding.tp_grad_sync_bytes,
                    saved_bytes=sharding.saved_bytes, selective_bytes=min(selective_bytes, sharding.saved_bytes),
                    # the reshards' collectives re-run too: the runtime's policy caches no collective
                    selective_extra_s=extra + sharding.comm_forward_s, input_bytes=input_bytes,
                    largest_op_bytes=largest)


def unit_costs(graph: Graph, sharding: GraphSharding, coster: OpCoster) -> list[UnitCost]:
    """Every unit of the model in execution order (untraced block instances included)."""
    per_type: dict[str, UnitCost] = {}
    for bt in graph.block_types:
        per_type[bt.name] = segment_unit(graph, bt.name, bt.name, bt.template, sharding.segments[bt.name], coster)
    units = []
    for segment in graph.segments:
        if segment.block_type is not None:
            template = per_type[segment.block_type]
            units.append(replace(template, name=segment.name))
        elif segment.nodes:
            units.append(segment_unit(graph, segment.name, None, segment.nodes,
                                      sharding.segments[segment.name], coster))
    return units
