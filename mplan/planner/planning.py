"""`mplan.plan(...)`: capture a model for planning, search, and return a `Plan`.

A model spec (`llama3-70b`, a config.json) is captured on the meta device in bf16 (the training
dtype) with a symbolic batch and two instances per repeated block (shallow): costs are per unit,
so the full depth is never traced. A user's `nn.Module` is captured as `autoparallel` captures it
(`ir.trace.capture_for_training`: the module as built, its dtype, its tied weights, a symbolic
batch), shallow too, so a Plan made here binds to the very graph `autoparallel` runs, op for op.
`capture_spec` captures a model named by a spec string (preset, family with numbers, Hugging
Face config.json, or package.module:factory) on the meta device (also what `mplan inspect` reads).
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from mplan.cost_models.cluster import ClusterSpec, require_cluster
from mplan.ir.graph import Graph
from mplan.ir.trace import capture, capture_for_training
from mplan.planner.parallel_config import DEFAULT_RUNTIME, PlanSpec, parse_plan_spec
from mplan.planner.plan import Plan, PlanError
from mplan.planner.plan_builder import build_plan
from mplan.planner.search import Planner, SearchResult
from mplan.planner.sharding_ilp import StrategyFilter
from mplan.planner.spec_check import check_before_capture
from mplan.progress import Progress


def capture_spec(spec: str, *, batch: int = 1, seq_len: int | None = None, shallow: bool = False,
                 dtype: torch.dtype | None = None, dynamic_batch: bool = False) -> Graph:
    """Build the model named by `spec` on the meta device and capture forward + loss."""
    from mplan.models import build_model, example_inputs, resolve_model

    source = resolve_model(spec)
    dtype = dtype or _config_dtype(source.config)  # read first: building sets the config's dtype
    model = build_model(source, device="meta")
    ids, labels = example_inputs(model, batch, seq_len or source.seq_len, device="meta")
    return capture(model, (ids,), labels=labels, dtype=dtype, shallow=shallow,
                   dynamic_batch=dynamic_batch, name=source.name)


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights are in (`dtype`, formerly `torch_dtype`),
    which decides the casts its norms and loss make; None for anything else."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def capture_for_planning(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *,
                         seq_len: int | None = None, loss_fn: Callable[..., torch.Tensor] | None = None) -> Graph:
    """A shallow bf16 meta-device capture with a symbolic batch (traced at 2 sequences, the
    smallest torch keeps symbolic): the planner re-prices it at every micro-batch size."""
    if isinstance(model, str):
        return capture_spec(model, batch=2, seq_len=seq_len, shallow=True, dtype=torch.bfloat16, dynamic_batch=True)
    if not example_inputs:
        raise ValueError("planning an nn.Module needs example_inputs, e.g. (input_ids,)")
    return capture_for_training(model, tuple(example_inputs), loss_fn=loss_fn, shallow=True)


def check_batch(global_batch: object, seq_len: object = None) -> None:
    """Refuse, naming it, a global batch (or sequence length) that is not a whole number >= 1:
    it would reach a division or a negative micro-batch count otherwise."""
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if value is None and name == "seq_len":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a whole number of {'sequences' if name == 'global_batch' else 'tokens'} "
                            f">= 1, got {value!r}")


def search_plans(graph: Graph, cluster: ClusterSpec, global_batch: int, spec: PlanSpec | str = "auto", *,
                 allow: StrategyFilter | None = None, allow_cross_node_tp: bool = False, kernels: bool = False,
                 fp8: bool = False, runtime: str = DEFAULT_RUNTIME, moe_imbalance: float = 1.0,
                 progress: Callable[[str], None] | None = None, inexact_ok: bool = False) -> tuple[Planner, SearchResult]:
    check_batch(global_batch)
    if isinstance(spec, str):
        spec = parse_plan_spec(spec)
    planner = Planner(graph, cluster, allow=allow, kernels=kernels, fp8=fp8, runtime=runtime,
                      moe_imbalance=moe_imbalance, progress=progress)
    return planner, planner.search(global_batch, spec, allow_cross_node_tp=allow_cross_node_tp, inexact_ok=inexact_ok)


def plan(model: nn.Module | str, example_inputs: Sequence[Any] | None = None, *, cluster: ClusterSpec,
         global_batch: int, spec: PlanSpec | str = "auto", seq_len: int | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, allow_cross_node_tp: bool = False,
         kernels: bool | None = None, fp8: bool = False, runtime: str = DEFAULT_RUNTIME, moe_imbalance: float = 1.0,
         progress: Progress | Callable[[str], None] | str | None = None, inexact_ok: bool = False) -> Plan:
    """The fastest plan that fits, with the best rejected alternatives and why each lost.

    `inexact_ok`: the user allows inexact training, so on a cluster of several sites the search
    also tries an outer loop across sites (`outer_steps`, DiLoCo-style), which does not compute the
    single-device loop's updates; `explain` then says so and why it won.

    `kernels`: price the memory-bound chains as mplan's fused kernels, as `autoparallel` runs
    them on CUDA (None: on for GPU clusters, off for the `cpu` preset). `fp8`: a plan whose
    block linears run as FP8 GEMMs, priced so; `autoparallel` runs such a plan in FP8.
    `runtime`: whose optimizer memory is priced, Megatron-LM's ("megatron") or mplan's ("mplan",
    as `autoparallel` plans). `moe_imbalance`: MoE models, the busiest expert-parallel rank's token
    load over the mean that the all-to-all and expert GEMMs are priced at (1.0: uniform routing).
    `progress`: how the capture and the search are shown while they run (`mplan.progress`: a
    Progress, a mode name such as "quiet", a callback, or None for a live line on a terminal and
    one line per phase in a log)."""
    check_batch(global_batch, seq_len)  # before the capture: a bad number costs nothing
    cluster = require_cluster(cluster, "mplan.plan(cluster=...)")
    if fp8 and not cluster.device.peak_fp8:
        raise PlanError(f"fp8=True: {cluster.device.name} has no FP8 tensor cores (no fp8 peak in its cluster spec)")
    start = time.perf_counter()
    # everything that needs no graph (the spec, the cluster, what the model's config states), before the capture
    checked = check_before_capture(spec, cluster=cluster, global_batch=global_batch, model=model, seq_len=seq_len,
                                   allow_cross_node_tp=allow_cross_node_tp)
    kernels = cluster.device.name != "cpu" if kernels is None else kernels
    progress = Progress.of(progress)
    with progress.phase("capture", model if isinstance(model, str) else type(model).__name__):
        graph = capture_for_planning(model, example_inputs, seq_len=seq_len, loss_fn=loss_fn)
    with progress.phase("search", f"{cluster.world_size} {cluster.device.name} ranks"):
        planner, result = search_plans(graph, cluster, global_batch, checked.spec, allow_cross_node_tp=allow_cross_node_tp,
                                 kernels=kernels, fp8=fp8, runtime=runtime, moe_imbalance=moe_imbalance,
                                 progress=progress, inexact_ok=inexact_ok)
    made = build_plan(result, graph, cluster, global_batch, runtime=runtime)
    made = dataclasses.replace(made, fp8=fp8, model=dataclasses.replace(made.model, seq_len_source=checked.seq_len_source))
    made.planner["total_seconds"] = round(time.perf_counter() - start, 3)
    made.planner["fused_kernels_priced"] = float(kernels)
    made.planner["cuda_graphs_priced"] = float(planner.graphed)
    if kernels:  # what the pass will fuse, per kernel over the whole model (`mplan explain` shows it)
        made.planner.update(fused_kernel_counts(graph))
    return made


FUSED_PREFIX = "fused."
"""Plan.planner keys `fused.<kernel>`: how many chains of the model become that kernel."""


def fused_kernel_counts(graph: Graph) -> dict[str, float]:
    """`fused.<kernel>` -> chains over the whole model: those of every captured node, and for the
    instances a shallow capture did not trace, those of the last instance traced of their block."""
    from mplan.fusion.coverage import fused_calls

    per_instance: dict[str | None, Counter[str]] = {}
    for kernel, match in fused_calls(graph):
        block = graph.node(match.anchor.name).block if match.anchor.name in graph else None
        per_instance.setdefault(block, Counter())[kernel] += 1
    counts: Counter[str] = Counter()
    for found in per_instance.values():
        counts.update(found)
    for block_type in graph.block_types:
        traced = [prefix for prefix in block_type.instances if prefix in per_instance]
        if traced:
            untraced = block_type.num_instances - len(traced)
            counts.update({kernel: n * untraced for kernel, n in per_instance[traced[-1]].items()})
    return {FUSED_PREFIX + kernel: float(n) for kernel, n in counts.items()}
