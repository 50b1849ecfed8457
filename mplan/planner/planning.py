"""`mplan.plan(...)`: capture a model for planning, search, and return a `Plan`.

The model is captured on the meta device in bf16 (the training dtype) with one sequence per
micro-batch and two instances per repeated block (shallow): costs are per unit, so the full depth
is never traced. A user's real-device model is copied to meta first; nothing touches its weights.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.trace import CaptureError, capture
from mplan.ir.graph import Graph
from mplan.ir.summary import capture_spec
from mplan.planner.parallel_config import PlanSpec, parse_plan_spec
from mplan.planner.plan import Plan, PlanError
from mplan.planner.plan_builder import build_plan
from mplan.planner.search import Planner, SearchResult
from mplan.planner.sharding_ilp import StrategyFilter


def capture_for_planning(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *,
                         seq_len: int | None = None, loss_fn: Callable[..., torch.Tensor] | None = None) -> Graph:
    """A shallow bf16 meta-device capture with a symbolic batch (traced at 2 sequences, the
    smallest torch keeps symbolic): the planner re-prices it at every micro-batch size."""
    if isinstance(model, str):
        return capture_spec(model, batch=2, seq_len=seq_len, shallow=True, dtype=torch.bfloat16, dynamic_batch=True)
    if not example_inputs:
        raise ValueError("planning an nn.Module needs example_inputs, e.g. (input_ids,)")
    # Always a copy: the bf16 cast below must not touch the caller's model (even a meta one, whose
    # dtype decides how its shards are initialized later).
    meta = copy.deepcopy(model).to("meta")
    inputs = tuple(_two_rows(x) for x in example_inputs)
    ids = inputs[0]
    labels = torch.zeros_like(ids) if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None
    name = type(model).__name__
    try:
        return capture(meta, inputs, labels=labels, loss_fn=loss_fn, dtype=torch.bfloat16, shallow=True,
                       dynamic_batch=True, name=name)
    except CaptureError:
        # Some models specialize on the batch; then plan with one sequence per micro-batch only.
        one = tuple(x[:1] if isinstance(x, torch.Tensor) else x for x in inputs)
        return capture(meta, one, labels=None if labels is None else labels[:1], loss_fn=loss_fn,
                       dtype=torch.bfloat16, shallow=True, name=name)


def _two_rows(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    x = x.to("meta")
    return torch.cat([x[:1], x[:1]]) if x.shape[0] < 2 else x[:2]


def search_plans(graph: Graph, cluster: ClusterSpec, global_batch: int, spec: PlanSpec | str = "auto", *,
                 allow: StrategyFilter | None = None, allow_cross_node_tp: bool = False, kernels: bool = False,
                 fp8: bool = False, runtime: str = "megatron",
                 progress: Callable[[str], None] | None = None) -> tuple[Planner, SearchResult]:
    if isinstance(spec, str):
        spec = parse_plan_spec(spec)
    planner = Planner(graph, cluster, allow=allow, kernels=kernels, fp8=fp8, runtime=runtime, progress=progress)
    return planner, planner.search(global_batch, spec, allow_cross_node_tp=allow_cross_node_tp)


def plan(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *, cluster: ClusterSpec,
         global_batch: int, spec: PlanSpec | str = "auto", seq_len: int | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, allow_cross_node_tp: bool = False,
         kernels: bool | None = None, fp8: bool = False, runtime: str = "megatron",
         progress: Callable[[str], None] | None = None) -> Plan:
    """The fastest plan that fits, with the best rejected alternatives and why each lost.

    `kernels`: price the memory-bound chains as mplan's fused kernels, as `autoparallel` runs
    them on CUDA (None: on for GPU clusters, off for the `cpu` preset). `fp8`: a plan whose
    block linears run as FP8 GEMMs, priced so; `autoparallel` runs such a plan in FP8.
    `runtime`: whose optimizer memory is priced, Megatron-LM's ("megatron") or mplan's ("mplan",
    as `autoparallel` plans)."""
    if fp8 and not cluster.device.peak_fp8:
        raise PlanError(f"fp8=True: {cluster.device.name} has no FP8 tensor cores (no fp8 peak in its cluster spec)")
    start = time.perf_counter()
    kernels = cluster.device.name != "cpu" if kernels is None else kernels
    graph = capture_for_planning(model, example_inputs, seq_len=seq_len, loss_fn=loss_fn)
    _, result = search_plans(graph, cluster, global_batch, spec, allow_cross_node_tp=allow_cross_node_tp,
                             kernels=kernels, fp8=fp8, runtime=runtime, progress=progress)
    made = dataclasses.replace(build_plan(result, graph, cluster, global_batch), fp8=fp8)
    made.planner["total_seconds"] = round(time.perf_counter() - start, 3)
    made.planner["fused_kernels_priced"] = float(kernels)
    return made
