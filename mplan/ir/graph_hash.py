"""A hash of the model a graph captured, equal for shallow and full captures, any batch size,
any dtype and a static or symbolic batch.

What it covers: the exact parameter count, every block type (name, instance count, its parameters'
relative names and shapes), the parameters outside blocks and the tied names. Activation shapes
and the op sequence are left out on purpose: they change with the traced batch (a symbolic batch
adds `sym_size` and `slice` nodes) and the dtype (an upcast to float32 is a no-op in float32), the
model does not. A plan carries this hash so that a rank refuses a plan made for another model;
the ops themselves are matched by their stable keys (`OpNode.key`).
"""
from __future__ import annotations

import hashlib
import json

from mplan.ir.blocks import relative_name
from mplan.ir.graph import Graph


def graph_hash(graph: Graph) -> str:
    blocks = []
    for bt in graph.block_types:
        prefix = bt.instances[0]
        params = sorted((relative_name(name, prefix), list(p.meta.shape)) for name, p in graph.params.items()
                        if name.startswith(prefix + "."))
        blocks.append([bt.name, bt.num_instances, params])
    glue = sorted((name, list(p.meta.shape)) for name, p in graph.params.items() if p.block is None)
    doc = {"num_parameters": graph.num_parameters, "blocks": blocks, "glue_params": glue,
           "tied": sorted(graph.tied.items())}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
