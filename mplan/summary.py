"""What `mplan inspect` reports about a captured graph, as plain data.

`summarize(graph)` gives the JSON document of docs/contract.md (`num_parameters`, `num_layers`,
`flops_per_token` {forward, training}, `block_types`, `capture_seconds`) plus the fusion
coverage of each block type (`mplan.fusion.coverage`: what fused, which entries came close and
why they missed, what memory-bound work is left) and a per-op table of one block instance. The
graph comes from `mplan.planner.planning.capture_spec` (a model spec) or any capture.
"""
from __future__ import annotations

from typing import Any

from mplan.fusion.coverage import fusion_coverage
from mplan.ir.graph import Graph
from mplan.ir.moe import moe_layers


def op_rows(graph: Graph, node_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per op of a block instance: what it is, its cost and what it keeps."""
    rows = []
    for node in graph.nodes_of(node_names):
        rows.append({
            "name": node.name,
            "op": node.op,
            "kind": node.kind,
            "output": str(node.output) if node.outputs else "",
            "flops": node.flops,
            "bytes": node.bytes_read + node.bytes_written,
            "saved_bytes": graph.saved_bytes([node.name]),
            "params": [p for _, p in node.params],
            "known": node.known,
        })
    return rows


def summarize(graph: Graph, *, per_op: bool = True) -> dict[str, Any]:
    """The `mplan inspect --json` document."""
    tokens = graph.tokens()
    blocks = []
    for bt in graph.block_types:
        blocks.append({
            "name": bt.name,
            "container": bt.container,
            "instances": bt.num_instances,
            "captured_instances": bt.captured_instances,
            "num_ops": len(bt.template),
            "params_per_instance": bt.num_params,
            "forward_flops_per_instance": bt.forward_flops,
            "saved_bytes_per_instance": bt.saved_bytes,
        })
    doc: dict[str, Any] = {
        "model": graph.model_name,
        "num_parameters": graph.num_parameters,
        "num_layers": graph.num_layers,
        "batch_size": graph.batch_size,
        "seq_len": graph.seq_len,
        "flops_per_token": {
            "forward": graph.forward_flops / tokens,
            "training": graph.training_flops / tokens,
        },
        "flops_per_iteration": {"forward": graph.forward_flops, "training": graph.training_flops},
        "block_types": blocks,
        "num_ops": len(graph.nodes),
        "unknown_ops": graph.unknown_ops(),
        "capture_seconds": round(graph.capture_seconds, 3),
        "shallow": graph.shallow,
    }
    layers = moe_layers(graph)
    if layers:
        doc["moe_layers"] = [{
            "node": m.experts.node, "num_experts": m.experts.num_experts, "top_k": m.experts.top_k,
            "ffn": m.experts.ffn, "activation": m.experts.activation, "gated": m.experts.gated,
            "capacity_factor": m.experts.capacity_factor, "router": m.router, "scoring": m.scoring,
            "normalized": m.normalized, "routing": m.routing, "shared_expert": list(m.shared_expert),
            "aux_loss": m.aux_loss,
        } for m in layers]
    if graph.declined_experts:
        doc["moe_declined"] = [{"module": module, "why": why} for module, why in graph.declined_experts.items()]
    doc["fusion"] = [{
        "block_type": c.block_type, "instances": c.instances,
        "fused": [{"kernel": f.kernel, "count": f.count, "ops": list(f.ops)} for f in c.fused],
        "skipped": [{"kernel": s.kernel, "count": s.count, "why": s.why} for s in c.skipped],
        "left": [{"op": op.op, "count": op.count, "bytes": op.bytes, "why": op.why} for op in c.left],
        "left_bytes": c.left_bytes,
    } for c in fusion_coverage(graph)]
    if per_op and graph.block_types:
        main = max(graph.block_types, key=lambda b: b.num_instances)
        doc["block_ops"] = {"block_type": main.name, "instance": main.instances[0],
                            "ops": op_rows(graph, main.template)}
    return doc
