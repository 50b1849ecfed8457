"""Rewrite a captured graph into one rank's program: each pass a named function, checked between.

Input: a captured `Graph` (ir/) and the TP strategy of every node (planner/sharding_ilp.py).
Output: the rank's parameter shards and its local `torch.fx.GraphModule` with explicit,
autograd-aware collectives, ready for the runtime (`runtime/parallel_module.py`).

    check_sharding        verifier.py           the choice is executable (before any pass)
    parameter_layouts     parameter_layout.py   storage placement of every parameter
    shard_parameters      shard_parameters.py   this rank's shards, from a model, state dict or meta
    insert_collectives    insert_collectives.py local program: reshards, local shapes, split ops
    check_local_graph     verifier.py           the local program's shapes, on meta tensors
    (rules per op)        local_ops.py          how each op runs on shards; vocab/batch losses
    (MoE layers)          expert_parallel.py    a `moe_experts` node on one rank or dispatched over EP
    fuse_kernels          fuse_kernels.py       ATen chains -> fused Triton kernels (kernels/)

Names load on first use so importing one pass does not pull in the others.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "check_sharding": "mplan.passes.verifier",
    "check_local_graph": "mplan.passes.verifier",
    "parameter_layouts": "mplan.ir.sharding",
    "ParamLayout": "mplan.ir.sharding",
    "shard_parameters": "mplan.passes.shard_parameters",
    "materialize_buffers": "mplan.passes.shard_parameters",
    "insert_collectives": "mplan.passes.insert_collectives",
    "UnexecutableStrategy": "mplan.passes.local_ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mplan.passes' has no attribute {name!r}")
