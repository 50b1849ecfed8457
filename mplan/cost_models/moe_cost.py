"""Seconds of one mixture-of-experts layer on the busiest rank of an expert-parallel group.

Role: the planner prices every MoE layer of a model for each config it weighs (`planner/evaluate.py`,
through `planner/unit_experts.py`): the experts' GEMMs and the all-to-all that moves tokens to them.
Input: an `ExpertsLayer` (one layer as one tensor-parallel rank runs it with every expert local:
its tokens, top-k, local widths and dtype; `experts_layer` reads it off the op's argument shapes),
the EP degree, the EP group's `GroupShape`, and the load factor (`load_factor`).
Output: `ExpertsTime` (forward, backward and its weight-gradient part, seconds) for the GEMMs;
`all_to_all_time` for one dispatch or one combine.

Model (Megatron-LM's expert parallelism, `ir/mesh.py` for the rank layout):
- each EP rank routes its own micro-batch: T tokens, each to k experts, so T*k token copies; its
  E/ep experts receive, from all ep ranks, T*k copies in all under uniform routing, `load` times
  that on the busiest rank (the others wait for it at the combine);
- the expert GEMMs run grouped: E/ep experts of load*T*k*ep/E rows each, against w_in [G*F, h],
  w_up [F, h] when separate and w_out [h, F]; backward is an input-gradient and a weight-gradient
  GEMM per weight (the weight part is what zero-bubble schedules run as W); the gather of routed
  rows, the activation (act(gate) * up) and the gate-weighted combine are memory-bound, their
  backward twice the bytes (as `planner/op_cost.py` prices memory-bound ops);
- dispatch and combine are one all-to-all each of the T*k copies (nccl-tests' size: one rank's
  send buffer, `load` times that for the busiest receiver); `collective_time`'s bus factor
  (ep-1)/ep is the share that leaves the rank, over NVLink inside a node and the NICs across
  nodes. Forward runs dispatch and combine, backward their two gradients.
Invariants: ep=1 moves nothing and holds every expert; times scale with load; every time >= 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.dtypes import dtype_bytes
from mplan.ir.mesh import GroupShape

MEMORY_BOUND_BACKWARD_FACTOR = 2.0
"""Backward bytes over forward bytes of the memory-bound parts (read the output gradient and a
saved input, write the input gradient): the factor `planner/op_cost.py` uses for every such op."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertsLayer:
    """One MoE layer's routed experts on one tensor-parallel rank, every expert local (ep=1)."""

    tokens: int  # T: tokens this rank routes per micro-batch
    top_k: int
    hidden: int  # h
    in_width: int  # w_in's rows per expert: G*F (gate and up stacked) or F, local to the TP rank
    up_width: int  # w_up's rows per expert when separate, else 0 (local)
    ffn: int  # F: w_out's columns per expert (local)
    num_experts: int  # E
    dtype: str  # of the routed activations and the weights
    capacity_factor: float | None = None  # the layer's own; None: dropless

    @property
    def routed_bytes(self) -> float:
        """Bytes of the T*k token copies one dispatch (or one combine) sends from a rank."""
        return float(self.tokens * self.top_k * self.hidden * dtype_bytes(self.dtype))


def experts_layer(shapes: Sequence[tuple[int, ...]], dtype: str, capacity_factor: float | None = None) -> ExpertsLayer:
    """The layer of one `moe_experts` call whose arguments (x, index, gate, w_in, w_out[, w_up],
    `mplan.kernels.moe`) have `shapes`: the global ones, or one rank's local pieces."""
    x, index, w_in, w_out = shapes[0], shapes[1], shapes[3], shapes[4]
    return ExpertsLayer(tokens=x[0], top_k=index[1], hidden=x[1], in_width=w_in[1],
                        up_width=shapes[5][1] if len(shapes) > 5 else 0, ffn=w_out[2], num_experts=w_in[0],
                        dtype=dtype, capacity_factor=capacity_factor)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertsTime:
    """Seconds of a layer's expert GEMMs and memory-bound parts, one micro-batch, the busiest rank."""

    forward_s: float
    backward_s: float  # input and weight gradients
    weight_s: float  # the weight-gradient part of backward_s


def load_factor(*, ep: int, imbalance: float, capacity_factor: float | None) -> float:
    """Token copies the busiest rank's experts take, over T*k. With ep=1 a rank's experts take its
    own copies, all of them; with ep > 1 the busiest takes `imbalance` times its balanced share. A
    capacity factor c caps every expert at c times its balanced share of each sender's copies, so a
    rank takes at most c times its share (below one, c drops copies on every rank)."""
    if imbalance < 1:
        raise ValueError(f"the experts' load imbalance is the busiest rank's load over the mean, >= 1; "
                         f"got {imbalance}")
    load = imbalance if ep > 1 else 1.0
    return load if capacity_factor is None else min(load, capacity_factor)


def experts_time(compute: ComputeCostModel, layer: ExpertsLayer, *, ep: int, load: float) -> ExpertsTime:
    """The layer's expert GEMMs and memory-bound parts on the busiest of `ep` ranks (module docstring)."""
    if layer.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the layer's {layer.num_experts} experts")
    local = layer.num_experts // ep
    rows = load * layer.tokens * layer.top_k  # copies the busiest rank's experts take
    per_expert = max(1, math.ceil(rows / local))
    h = layer.hidden
    gemms = [(layer.in_width, h), (layer.up_width, h), (h, layer.ffn)]  # (output cols, contracted) per weight
    forward = backward = weight = 0.0
    for cols, depth in gemms:
        if cols == 0:
            continue
        forward += compute.matmul_time(per_expert, cols, depth, layer.dtype, batch=local)
        grad_w = compute.matmul_time(cols, depth, per_expert, layer.dtype, batch=local)
        backward += compute.matmul_time(per_expert, depth, cols, layer.dtype, batch=local) + grad_w
        weight += grad_w
    # gather the routed rows and scatter them back weighted (rows x h each way), the activation
    # (reads the gate and up products, writes their product: rows x 3F, or 2F ungated)
    itemsize = dtype_bytes(layer.dtype)
    activation_width = 3 * layer.ffn if layer.in_width + layer.up_width > layer.ffn else 2 * layer.ffn
    moved = rows * (4 * h + activation_width) * itemsize
    memory = compute.memory_bound_time(moved)
    return ExpertsTime(forward_s=forward + memory, backward_s=backward + MEMORY_BOUND_BACKWARD_FACTOR * memory,
                       weight_s=weight)


def all_to_all_time(cluster: ClusterSpec, layer: ExpertsLayer, group: GroupShape, *, load: float) -> float:
    """Seconds of one dispatch (or one combine) of the layer over the EP group `group`, paced by its
    busiest receiver; 0 for a group of one rank."""
    return collective_time(cluster, "all_to_all", load * layer.routed_bytes, group)
