"""`mplan.plan(...)`: capture a model for planning, search, and return a `Plan`.

The model is captured on the meta device in bf16 (the training dtype) with one sequence per
micro-batch and two instances per repeated block (shallow): costs are per unit, so the full depth
is never traced. A user's real-device model is copied to meta first; nothing touches its weights.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.capture import capture
from mplan.ir.graph import Graph
from mplan.ir.summary import capture_spec
from mplan.planner.parallel_config import PlanSpec, parse_plan_spec
from mplan.planner.plan import Plan
from mplan.planner.plan_builder import build_plan
from mplan.planner.search import Planner, SearchResult
from mplan.planner.sharding_ilp import StrategyFilter


def capture_for_planning(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *,
                         seq_len: int | None = None, loss_fn: Callable[..., torch.Tensor] | None = None) -> Graph:
    """A shallow bf16 meta-device capture of one sequence: what the planner prices."""
    if isinstance(model, str):
        return capture_spec(model, batch=1, seq_len=seq_len, shallow=True, dtype=torch.bfloat16)
    if not example_inputs:
        raise ValueError("planning an nn.Module needs example_inputs, e.g. (input_ids,)")
    meta = model if all(p.device.type == "meta" for p in model.parameters()) else copy.deepcopy(model).to("meta")
    inputs = tuple(x[:1].to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    ids = inputs[0]
    labels = torch.zeros_like(ids) if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None
    return capture(meta, inputs, labels=labels, loss_fn=loss_fn, dtype=torch.bfloat16, shallow=True,
                   name=type(model).__name__)


def search_plans(graph: Graph, cluster: ClusterSpec, global_batch: int, spec: PlanSpec | str = "auto", *,
                 allow: StrategyFilter | None = None, allow_cross_node_tp: bool = False,
                 progress: Callable[[str], None] | None = None) -> tuple[Planner, SearchResult]:
    if isinstance(spec, str):
        spec = parse_plan_spec(spec)
    planner = Planner(graph, cluster, allow=allow, progress=progress)
    return planner, planner.search(global_batch, spec, allow_cross_node_tp=allow_cross_node_tp)


def plan(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *, cluster: ClusterSpec,
         global_batch: int, spec: PlanSpec | str = "auto", seq_len: int | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, allow_cross_node_tp: bool = False,
         progress: Callable[[str], None] | None = None) -> Plan:
    """The fastest plan that fits, with the best rejected alternatives and why each lost."""
    start = time.perf_counter()
    graph = capture_for_planning(model, example_inputs, seq_len=seq_len, loss_fn=loss_fn)
    _, result = search_plans(graph, cluster, global_batch, spec, allow_cross_node_tp=allow_cross_node_tp,
                             progress=progress)
    made = build_plan(result, graph, cluster, global_batch)
    made.planner["total_seconds"] = round(time.perf_counter() - start, 3)
    return made
