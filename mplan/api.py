"""`mplan.autoparallel`: a plain PyTorch model in, one rank's parallel training program out.

Input: the user's model (on a real device, or on the meta device for models too big for one
rank), example inputs, a loss (the model's own with `labels=`, or `loss_fn(out, labels)`), an
optimizer factory, the global batch and a plan (None searches; a `Plan`; a plan.json path; a
spec string such as "tp=2,dp=2,sp=1,zero=1"). Output: a `ParallelModule` (`pm.train_step`,
`pm(inputs)`, `pm.full_state_dict()`, `pm.save/load`).

Steps, the same on every rank (under torchrun; alone when there is no torchrun environment):
1. join or create the world group (`runtime.launch`);
2. capture the model once (`ir.trace.capture_for_training`): the graph that is planned is the
   graph that runs (a model that returns only its loss given labels has its forward captured
   too, at the first `pm(inputs)`, from a copy of it on the meta device);
3. resolve the plan argument into one complete Plan for that graph (`planner.resolve`): local
   work only, so a wrong world size, batch split or stale plan fails here, on every rank alike,
   before any collective; a search covers every mesh the runtime executes (dp, tp, sp, pp, ep);
4. `parallelize` (`runtime.parallel_module`): plan-hash agreement over the world, process groups,
   parameter shards, the local program (with mplan's fused kernels, `kernels`), the
   data-parallel optimizer. The runtime reads the Plan; it never solves or searches.

Defaults never change the arithmetic of the user's single-device loop: no clipping unless
`max_grad_norm` is given, the optimizer as given, the model's own dtypes; tied parameters stay
one parameter.

Memory: parameters stored whole on the model's device and dtype (every one at tp=1) are the
model's own tensors, trained in place as under DDP; the returned module keeps no reference to
the model or to its exported program's weights, so deleting the model frees whatever `pm` does
not use.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import os
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from mplan.cost_models.cluster import ClusterSpec, require_cluster
from mplan.ir.graph import Graph
from mplan.ir.trace import capture_for_training
from mplan.models.config import GPTConfig, LlamaConfig, MoEConfig
from mplan.planner.parallel_config import PlanSpec, PlanSpecError, parse_plan_spec
from mplan.planner.plan import Plan
from mplan.planner.resolve import check_before_capture, resolve_plan
from mplan.progress import Progress
from mplan.runtime.launch import init_distributed_from_env
from mplan.runtime.lowering import weightless_program
from mplan.runtime.outer_loop import OuterOptimizer
from mplan.runtime.parallel_module import ParallelModule, check_executable, parallelize
from mplan.runtime.replicated_optimizer import OptimizerFactory
from mplan.runtime.step_graph import graph_refusal, refuse_graphs
from mplan.runtime.watchdog import hang_timeout

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

EXECUTABLE = PlanSpec()
"""The keys a search is held to: none, since the runtime executes every mesh the planner
searches (expert parallelism included)."""


def autoparallel(model: nn.Module, *, cluster: ClusterSpec | None = None,
                 example_inputs: Sequence[torch.Tensor], loss_fn: LossFn | None = None,
                 optimizer: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=3e-4),
                 global_batch: int, plan: Plan | str | None = None, micro_batch_size: int | None = None,
                 max_grad_norm: float | None = None, dtype: torch.dtype | None = None,
                 autocast: torch.dtype | bool | None = None, seed: int = 0,
                 state_dict: Mapping[str, torch.Tensor] | None = None,
                 device: torch.device | str | None = None, tp_layout: str = "megatron",
                 kernels: bool | None = None, fp8: bool = False,
                 progress: Progress | Callable[[str], None] | str | None = None,
                 hang_timeout_s: float | None = None, document_mask: bool = False, inexact_ok: bool = False,
                 outer_optimizer: OuterOptimizer | None = None, cuda_graphs: bool | None = None) -> ParallelModule:
    """Parallelize `model` under `plan` on this job's ranks (see the module docstring).

    `max_grad_norm` clips the global gradient norm (over every shard) before each step, as
    `torch.nn.utils.clip_grad_norm_` would in the user's loop; None (the default) does not clip.
    `seed` initializes a meta-device model's shards (mplan's families reproduce
    `build_model(..., seed=seed)` exactly); `state_dict` supplies the weights instead of the
    model; `dtype` is the parameters' training dtype; `autocast` (True = bfloat16) runs forward
    under torch.autocast; `tp_layout` fills a spec string's TP degree with Megatron's layout
    ("megatron") or whatever valid mix the sharding ILP prices cheapest on the cluster ("ilp");
    `kernels` swaps op chains of the local program for mplan's fused kernels
    (`passes.fuse_kernels`; None: on CUDA, where they run as Triton kernels; elsewhere they
    would only run their PyTorch references); `fp8` (or a Plan made with `fp8=True`) runs the
    linears inside the blocks as FP8 GEMMs (`kernels.fp8`, delayed scaling; the output head stays
    in the training dtype) and raises `Fp8Unavailable` naming why where they cannot run. `progress`
    shows each phase (capture, plan, lowering, first step) with its time on rank 0's stderr: a
    live line on a terminal, one line per phase in a log, nothing with "quiet" (`mplan.progress`;
    the MPLAN_PROGRESS variable sets it for a whole job). `hang_timeout_s` starts the hang
    watchdog (`runtime.watchdog`, `pm.watch_for_hangs`): a rank with no progress inside a step for
    that many seconds makes every rank report where it is and the job stop with `HangError`
    naming the stuck ranks; None reads MPLAN_HANG_TIMEOUT_S (unset: off). `document_mask` lets
    `pm.train_step(..., doc_ids=)` tell attention where packed documents start, so no token attends
    across documents (`passes.split_context`; pipeline stages too; under cp > 1 attention
    takes documents whether or not it is set). `inexact_ok` lets a search choose an outer loop
    across sites (`outer_steps`, DiLoCo-style: sites train alone between outer steps), which does
    not compute the single-device loop's updates; off, only exact plans are searched (a plan or
    spec that sets `outer_steps` is itself the user's choice). `outer_optimizer`: that loop's
    outer SGD (`runtime.outer_loop.OuterOptimizer`; None: DiLoCo's Nesterov, lr 0.7, momentum 0.9).
    `cuda_graphs` replays each step's forwards and backwards as one CUDA graph from the third
    step on (`runtime.step_graph`: the host's launch cost paid once; a step whose capture fails
    runs eagerly, saying why). None (the default): on wherever the plan allows it (one rank on
    CUDA, no FP8, zero < 2, no outer loop), off elsewhere; True: on, refused in one line where the
    plan does not allow it; False: off. On an H100 it made the host-bound families' steps 1.1-2.2x
    faster (benchmarks/results/peers_h100-2026-12-06-session14-b.json and -c.json).
    Collective: every rank of the job calls it with the same arguments.
    """
    _check_numbers(global_batch=global_batch, micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)
    hang_timeout(hang_timeout_s)  # a bad timeout (or MPLAN_HANG_TIMEOUT_S) refused before the capture
    world = init_distributed_from_env()
    world_size = world.size() if world is not None else 1
    run_on = torch.device(device) if device is not None else _default_device()
    cluster = _local_cluster(world_size) if cluster is None else require_cluster(cluster, "autoparallel(cluster=...)")
    inputs = tuple(example_inputs)
    use_kernels = run_on.type == "cuda" if kernels is None else kernels
    if cuda_graphs:
        refuse_graphs(None, run_on)  # the device alone, before the capture's seconds
    # a spec string or plan file that cannot run on this world and batch, refused before the capture's seconds
    plan = check_before_capture(plan, world_size=world_size, global_batch=global_batch, model=model,
                                micro_batch_size=micro_batch_size, tp_layout=tp_layout)
    progress = Progress.of(progress)
    # context parallelism: each rank's program is the model at its slice of every sequence, S / cp
    # tokens, so capture that (every view and per-token op then has the rank's shapes;
    # `passes.split_context` makes positions, attention and the loss whole-sequence exact)
    captured = _context_slice(inputs, _context_degree(plan))
    _check_declared_window(model, inputs, captured)
    with progress.phase("capture", type(model).__name__):
        graph = capture_for_training(model, captured, loss_fn=loss_fn)
    with progress.phase("plan", "searching" if plan is None else "binding the plan given") as planned:
        resolved = resolve_plan(plan, graph, cluster=cluster, world_size=world_size, global_batch=global_batch,
                                micro_batch_size=micro_batch_size, tp_layout=tp_layout, within=EXECUTABLE,
                                kernels=use_kernels and cluster.device.name != "cpu", fp8=fp8, progress=progress,
                                inexact_ok=inexact_ok, cuda_graphs=cuda_graphs)
        check_executable(resolved)
        if cuda_graphs:
            refuse_graphs(resolved, run_on, fp8=resolved.fp8)
        planned.detail = _plan_words(resolved, world_size)
    with progress.phase("lowering", f"{resolved.mesh.tp}-way TP, {resolved.mesh.pp} stage"
                                    f"{'s' if resolved.mesh.pp > 1 else ''}, {'fused kernels' if use_kernels else 'ATen ops'}"):
        # a model that returns only its loss when given labels leaves no logits in the training graph
        forward_only = len(graph.program.graph_signature.output_specs) < 2
        inference = _forward_capture(model, inputs, resolved, cluster, world_size) if forward_only else None
        pm = parallelize(graph=graph, plan=resolved, source=state_dict if state_dict is not None else model,
                         model=model, optimizer=optimizer, device=run_on, dtype=dtype, seed=seed,
                         max_grad_norm=max_grad_norm, autocast=_autocast_dtype(autocast), kernels=use_kernels,
                         fp8=resolved.fp8, inference=inference, documents=document_mask,
                         outer=outer_optimizer or OuterOptimizer())
    pm.progress = progress
    if cuda_graphs or (cuda_graphs is None and graph_refusal(resolved, run_on, fp8=resolved.fp8) is None):
        pm.use_cuda_graphs()
    _say_untrained(progress, model, pm.params)
    pm.hf_config = _hf_config(model)
    pm.watch_for_hangs(hang_timeout_s)
    # torch.export leaves reference cycles that reach the model (the trace's frames and
    # closures). Collected now, `del model` frees the model's memory at once rather than at
    # Python's next full collection, which no device allocation waits for.
    del graph
    gc.collect()
    return pm


def _say_untrained(progress: Progress, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Say when parameters of the model passed in are not the tensors that train (TP shards,
    zero=3's flat shards, a copy on another device or in another dtype): the model keeps their
    initial values, and reading it after training would give them without a word."""
    own = dict(model.named_parameters())
    apart = [name for name, p in params.items() if name in own and not own[name].is_meta
             and own[name].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()]
    if apart:
        progress.say(f"{len(apart)} of {len(params)} parameters of the model passed in are not the tensors that "
                     f"train (e.g. {apart[0]}: TP or zero=3 shards, or another device or dtype), so it keeps their "
                     f"initial values: read trained weights with pm.whole_parameter(name) or pm.full_state_dict()")


def _context_degree(plan: Plan | str | None) -> int:
    if isinstance(plan, Plan):
        return plan.mesh.cp
    if isinstance(plan, str):
        return parse_plan_spec(plan).cp or 1
    return 1


def _context_slice(inputs: tuple[torch.Tensor, ...], cp: int) -> tuple[torch.Tensor, ...]:
    """The example inputs at one cp rank's sequence length, S / cp; the sequence (dim 1) must
    split into 2 * cp equal chunks (head-tail: rank r holds chunks r and 2cp - 1 - r)."""
    if cp == 1:
        return inputs
    for x in inputs:
        if x.dim() < 2 or x.shape[1] % (2 * cp):
            raise PlanSpecError(f"cp={cp} splits each sequence into 2*cp = {2 * cp} chunks (head-tail, so every "
                                f"rank has the same causal attention work), but an example input has shape "
                                f"{list(x.shape)}: its sequence dim 1 must be a multiple of {2 * cp}")
    return tuple(x[:, : x.shape[1] // cp] for x in inputs)


def _check_declared_window(model: nn.Module, inputs: tuple[torch.Tensor, ...],
                           captured: tuple[torch.Tensor, ...]) -> None:
    """Refuse a sliding window that the model's config declares and a rank's slice cannot show:
    the lowering reads masks off the captured slice of L tokens (`passes.attention_forms`), where
    a window of L <= W < S looks causal, and dropping it would be silently wrong."""
    config = getattr(model, "config", None)
    if not inputs or captured is inputs or config is None:
        return
    types = getattr(config, "layer_types", None) or ()
    local, whole = captured[0].shape[1], inputs[0].shape[1]
    for field, kind in (("sliding_window", "sliding_attention"), ("attention_chunk_size", "chunked_attention")):
        span = getattr(config, field, None)
        used = kind in types if types else getattr(config, "use_sliding_window", True) is not False
        if isinstance(span, int) and not isinstance(span, bool) and used and local <= span < whole:
            raise PlanSpecError(f"{type(model).__name__}: config.{field}={span} under cp={whole // local}: a rank's "
                                f"slice of {local} tokens cannot show a span of {span} (the mask is read off the "
                                f"slice); use a cp with S / cp > {span}, or none")


class ArgumentError(ValueError):
    """An argument of `autoparallel` that cannot run: the message names it and what it must be."""


def _check_numbers(*, global_batch: int, micro_batch_size: int | None, max_grad_norm: float | None) -> None:
    """Numbers that would reach arithmetic, refused up front with their name."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ArgumentError(f"global_batch must be a positive number of sequences, got {global_batch!r}")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ArgumentError(f"micro_batch_size must be a positive number of sequences, got {micro_batch_size!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ArgumentError(f"max_grad_norm must be positive (or None: no clipping), got {max_grad_norm!r}")


def _forward_capture(model: nn.Module, inputs: tuple[torch.Tensor, ...], plan: Plan, cluster: ClusterSpec,
                     world_size: int) -> Callable[[], tuple[Graph, Plan]]:
    """For a model whose training capture holds only its loss: what captures its forward and binds
    the Plan to it by node keys (nothing solved), which the runtime calls at the first inference
    call. A job that only trains never pays that second capture (about a second of a tiny model's
    two-and-a-half-second `autoparallel`). It captures a meta twin of the model (`_meta_twin`), so
    the closure holds none of the model's memory, which the caller may free; a model that cannot be
    copied is captured now, as before."""
    def capture(source: nn.Module) -> tuple[Graph, Plan]:
        graph = capture_for_training(source, inputs, with_loss=False)
        bound = resolve_plan(plan, graph, cluster=cluster, world_size=world_size,
                             global_batch=plan.global_batch, fp8=plan.fp8)
        return dataclasses.replace(graph, program=weightless_program(graph)), bound  # not the model's weights

    try:
        twin = _meta_twin(model)
    except Exception:  # noqa: BLE001 - whatever deepcopy raises on an object it cannot copy
        kept = capture(model)
        return lambda: kept
    return functools.partial(capture, twin)


def _meta_twin(model: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are meta tensors of their shapes,
    dtypes and ties: all a capture reads of them (the training capture of a model built on meta
    traces the same way), holding none of their memory."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _hf_config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config as JSON data (what `pm.save(dir, format="hf")` writes as
    config.json), or the matching architecture's for mplan's families; None for other models."""
    config = getattr(model, "config", None)
    if isinstance(config, (GPTConfig, LlamaConfig, MoEConfig)):  # mplan's families: their HF twin's
        from mplan.models.hf_names import NotMappable, hf_config  # imports no transformers

        try:
            return hf_config(config)
        except NotMappable:
            return None
    if config is None or not hasattr(config, "to_json_string") or not type(config).__module__.startswith("transformers"):
        return None
    return json.loads(config.to_json_string(use_diff=False))


def _plan_words(plan: Plan, world_size: int) -> str:
    """The plan in a few words, its step time and what that figure rests on (`prediction_basis`:
    a time priced from placeholder figures must not read as a forecast)."""
    from mplan.planner.explain import prediction_basis

    return (f"{plan.describe()} on {world_size} rank{'s' if world_size > 1 else ''}; step "
            f"{plan.predicted.step_time_s * 1e3:.1f} ms, {prediction_basis(plan)}")


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _autocast_dtype(autocast: torch.dtype | bool | None) -> torch.dtype | None:
    if autocast is True:
        return torch.bfloat16
    return autocast or None


def _local_cluster(world_size: int) -> ClusterSpec:
    """torchrun's cluster, or (a group made by hand, as in tests) one node of `world_size` ranks."""
    if "WORLD_SIZE" in os.environ:
        return ClusterSpec.local()
    from mplan.cost_models.presets import local_cluster

    return local_cluster({"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
