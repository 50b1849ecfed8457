"""A structural hash of a captured model, equal for shallow and full captures and any batch size.

What it covers: the exact parameter count, every block type (name, instance count, the op sequence
of its template, its parameters' relative names and shapes) and the parameters outside blocks.
Activation shapes are left out on purpose: they change with the traced batch, the model does not.
A plan carries this hash so that a rank refuses a plan made for another model.
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
        ops = [n.op for n in graph.nodes_of(bt.template)]
        blocks.append([bt.name, bt.num_instances, ops, params])
    glue = sorted((name, list(p.meta.shape)) for name, p in graph.params.items() if p.block is None)
    doc = {"num_parameters": graph.num_parameters, "blocks": blocks, "glue_params": glue}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
