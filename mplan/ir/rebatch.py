"""Re-price a captured graph at another batch size without tracing again.

A graph captured with `dynamic_batch=True` keeps, for every tensor, the expression of each dim in
the batch symbol (`TensorMeta.sym`). `rebatch(graph, b)` evaluates them at b and recomputes
every node's FLOPs, bytes and side tensors with the same rules as capture, so planning can price
micro-batches of any size from one trace. Dims that do not depend on the batch stay as traced;
non-linear dims (an MoE capacity `ceil(1.25 * k * tokens / E)`) are evaluated exactly.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from mplan.ir.graph import BlockType, Graph, TensorMeta
from mplan.ir.op_table import op_cost, rule_for


class RebatchError(ValueError):
    """The graph was captured without a dynamic batch, so it cannot be re-priced."""


def _at(meta: TensorMeta, batch: int, cache: dict[Any, int]) -> TensorMeta:
    if meta.sym is None:
        return meta
    dims = []
    for concrete, expr in zip(meta.shape, meta.sym):
        if expr is None:
            dims.append(concrete)
            continue
        if expr not in cache:
            symbols = list(expr.free_symbols)
            cache[expr] = int(expr.subs({s: batch for s in symbols}))
        dims.append(cache[expr])
    return TensorMeta(shape=tuple(dims), dtype=meta.dtype, sym=meta.sym)


def rebatch(graph: Graph, batch: int) -> Graph:
    """The same graph with every shape evaluated at `batch` sequences."""
    if batch == graph.batch_size:
        return graph
    if not any(m.sym is not None for m in graph.graph_inputs.values()):
        raise RebatchError(f"{graph.model_name} was captured with a static batch of {graph.batch_size}; "
                           f"capture with dynamic_batch=True to price other batch sizes")
    cache: dict[Any, int] = {}
    nodes = []
    for node in graph.nodes:
        inputs = tuple(_at(m, batch, cache) for m in node.input_metas)
        outputs = tuple(_at(m, batch, cache) for m in node.outputs)
        cost = op_cost(rule_for(node.op), node.kind, inputs, outputs, node.args)
        nodes.append(replace(node, input_metas=inputs, outputs=outputs, flops=cost.flops,
                             bytes_read=cost.bytes_read, bytes_written=cost.bytes_written,
                             saved_extra_bytes=cost.saved_extra_bytes))
    out = Graph(model_name=graph.model_name, nodes=nodes,
                graph_inputs={k: _at(m, batch, cache) for k, m in graph.graph_inputs.items()},
                params=graph.params, block_types=[], segments=graph.segments, batch_size=batch,
                seq_len=graph.seq_len, has_loss=graph.has_loss, capture_seconds=graph.capture_seconds,
                shallow=graph.shallow, num_parameters=graph.num_parameters, program=graph.program,
                tied=graph.tied)
    out.block_types = [_block_at(out, bt) for bt in graph.block_types]
    return out


def _block_at(graph: Graph, bt: BlockType) -> BlockType:
    return replace(bt, forward_flops=sum(graph.node(n).flops for n in bt.template),
                   saved_bytes=graph.saved_bytes(bt.template))
