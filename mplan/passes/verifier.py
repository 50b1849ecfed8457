"""The check run after `insert_collectives`: the local program computes the shapes its placements
imply. (The check before the passes, `check_sharding`, is the IR's: `mplan/ir/sharding.py`.)

`check_local_graph(module, graph)` (after `insert_collectives`): runs the local program on meta
tensors (no data, no communication: reshards take their shape-only path) and compares every
node's shape with the local shape the pass recorded (`meta["mplan_local_shape"]`, the global
shape divided on the sharded dim). It returns the output's meta tensor. A wrong local size
argument, a missing reshard or a shard on the wrong dim shows up here, in one process.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from mplan.ir.graph import Graph, TensorMeta
from mplan.passes.insert_collectives import INPUTS, LOCAL_SHAPE, LocalInput


class LocalGraphMismatch(AssertionError):
    """The local program computes a shape other than the one its placement implies."""


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
