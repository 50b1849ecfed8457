"""`mplan.autoparallel`: a plain PyTorch model in, one rank's parallel training program out.

Input: the user's model (on a real device, or on the meta device for models too big for one
rank), example inputs, a loss (the model's own with `labels=`, or `loss_fn(out, labels)`), an
optimizer factory, the global batch and a plan (None searches; a `Plan`; a plan.json path; a
spec string such as "tp=2,dp=2,sp=1,zero=1"). Output: a `ParallelModule` (`pm.train_step`,
`pm(inputs)`, `pm.full_state_dict()`, `pm.save/load`).

Steps, the same on every rank (under torchrun; alone when there is no torchrun environment):
1. join or create the world group (`runtime.launch`);
2. resolve the plan into an `ExecutionPlan` (`runtime.execution_plan.resolve_execution_plan`):
   local checks only, so a wrong world size or batch split fails before any collective;
3. capture the model at the micro-batch shape (one micro-batch is what each program runs);
   a Plan made for another model's graph is refused here, still before any collective;
4. choose the TP strategy of every node (`tp_choice`) and check it (`passes.check_sharding`);
5. `parallelize`: plan-hash agreement over the world, process groups, parameter shards, the
   local program (with mplan's fused kernels, `kernels`), the data-parallel optimizer.

Memory: parameters stored whole on the model's device and dtype (every one at tp=1) are the
model's own tensors, trained in place as under DDP; the returned module keeps no reference to
the model or to its exported program (inference captures a weightless copy), so deleting the
model frees whatever `pm` does not use.
"""
from __future__ import annotations

import copy
import functools
import gc
import itertools
import os
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import GroupShape
from mplan.ir.graph import Graph
from mplan.ir.graph_hash import graph_hash
from mplan.ir.trace import capture
from mplan.passes.parameter_layout import ParamLayout
from mplan.passes.verifier import check_sharding
from mplan.planner.op_cost import OpCoster
from mplan.planner.placement import R, Shard
from mplan.planner.plan import Plan
from mplan.planner.sharding_ilp import solve_graph_sharding, stream_shape
from mplan.planner.strategies import Strategy, replicated
from mplan.runtime.execution_plan import (CollectiveCountCoster, ExecutionPlan, megatron_required, plan_hash,
                                          resolve_execution_plan, tp_choice)
from mplan.runtime.launch import init_distributed_from_env
from mplan.runtime.parallel_module import ParallelModule, parallelize
from mplan.runtime.replicated_optimizer import OptimizerFactory

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def autoparallel(model: nn.Module, *, cluster: ClusterSpec | None = None,
                 example_inputs: Sequence[torch.Tensor], loss_fn: LossFn | None = None,
                 optimizer: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=3e-4),
                 global_batch: int, plan: Plan | str | None = None, micro_batch_size: int | None = None,
                 max_grad_norm: float | None = 1.0, dtype: torch.dtype | None = None,
                 autocast: torch.dtype | bool | None = None, seed: int = 0,
                 state_dict: Mapping[str, torch.Tensor] | None = None,
                 device: torch.device | str | None = None, tp_strategies: str = "megatron",
                 kernels: bool | None = None, fp8: bool = False) -> ParallelModule:
    """Parallelize `model` under `plan` on this job's ranks (see the module docstring).

    `seed` initializes a meta-device model's shards (mplan's families reproduce
    `build_model(..., seed=seed)` exactly); `state_dict` supplies the weights instead of the
    model; `dtype` is the parameters' training dtype; `autocast` (True = bfloat16) runs forward
    under torch.autocast; `tp_strategies` fills a spec string's TP degree with Megatron's
    layout ("megatron") or whatever valid mix the sharding ILP prices cheapest ("ilp");
    `kernels` swaps op chains of the local program for mplan's fused kernels
    (`passes.fuse_kernels`; None: on CUDA, where they run as Triton kernels; elsewhere they
    would only run their PyTorch references); `fp8` (or a Plan made with `fp8=True`) runs the
    linears inside the blocks as FP8 GEMMs (`kernels.fp8`, delayed scaling; the output head stays
    in the training dtype) and raises `Fp8Unavailable` naming why where they cannot run. Collective: every rank of the job
    calls it with the same arguments.
    """
    world = init_distributed_from_env()
    world_size = world.size() if world is not None else 1
    run_on = torch.device(device) if device is not None else _default_device()
    cluster = cluster or _local_cluster(world_size)
    inputs = tuple(example_inputs)

    def search(spec: Any) -> Plan:
        from mplan.planner.planning import plan as make_plan

        return make_plan(model, inputs, cluster=cluster, global_batch=global_batch, spec=spec, loss_fn=loss_fn,
                         runtime="mplan")

    resolved = resolve_execution_plan(plan, world_size=world_size, global_batch=global_batch,
                                      micro_batch_size=micro_batch_size, tp_strategies=tp_strategies,
                                      search=search)
    graph = capture_for_execution(model, inputs, resolved.micro_batch_size, loss_fn=loss_fn)
    if resolved.plan is not None:
        resolved.plan.check_runs_on(world_size=world_size, graph_hash=graph_hash(graph))
    coster_for = _coster_factory(cluster)
    choice = tp_choice(graph, resolved, coster_for, planner_graph=lambda: _planner_capture(model, inputs, loss_fn))
    check_sharding(graph, choice, resolved.mesh.tp)
    digest = plan_hash(graph, resolved, choice)
    pm = parallelize(graph=graph, choice=choice, plan=resolved, digest=digest,
                     source=state_dict if state_dict is not None else model, model=model,
                     optimizer=optimizer, device=run_on, dtype=dtype, seed=seed,
                     max_grad_norm=max_grad_norm, autocast=_autocast_dtype(autocast),
                     kernels=run_on.type == "cuda" if kernels is None else kernels,
                     fp8=fp8 or (resolved.plan is not None and resolved.plan.fp8),
                     prepare_inference=_inference_preparer(_weightless(model), resolved, coster_for))
    # torch.export leaves reference cycles that reach the model (the trace's frames and
    # closures). Collected now, `del model` frees the model's memory at once rather than at
    # Python's next full collection, which no device allocation waits for.
    del graph
    gc.collect()
    return pm


def _planner_capture(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn | None) -> Graph:
    from mplan.planner.planning import capture_for_planning

    return capture_for_planning(model, inputs, loss_fn=loss_fn)


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


def _coster_factory(cluster: ClusterSpec) -> Callable[[int], OpCoster]:
    def coster(n: int) -> OpCoster:
        per_node = n if n <= cluster.gpus_per_node else cluster.gpus_per_node
        return OpCoster(cluster, n, GroupShape(size=n, ranks_per_node=per_node))
    return coster


def capture_for_execution(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], rows: int, *,
                          loss_fn: LossFn | None = None, with_loss: bool = True) -> Graph:
    """The model captured at `rows` sequences (one micro-batch), with its loss unless told not
    to; token ids become the labels' template (their values do not matter to the export)."""
    batch = tuple(_rows(x, rows).to(_model_device(model)) for x in example_inputs)
    labels = torch.zeros_like(batch[0]) if with_loss else None
    return capture(model, batch, labels=labels, loss_fn=loss_fn if with_loss else None,
                   name=type(model).__name__)


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] >= rows:
        return x[:rows]
    return x.repeat(-(-rows // x.shape[0]), *([1] * (x.dim() - 1)))[:rows]


def _inference_preparer(model: nn.Module, plan: ExecutionPlan, coster_for: Callable[[int], OpCoster]):
    """For `pm(inputs)`: capture without labels at the inputs' shape, solve TP with every
    parameter held where training stores it (so the same shards serve both programs)."""
    def prepare(inputs: tuple[torch.Tensor, ...],
                layouts: Mapping[str, ParamLayout]) -> tuple[Graph, dict[str, Strategy]]:
        graph = capture(model, tuple(x.to(_model_device(model)) for x in inputs), name=type(model).__name__)
        n = plan.mesh.tp
        if n == 1:
            return graph, {node.name: replicated(node) for node in graph.nodes}
        megatron = plan.tp_strategies == "megatron"
        stream = stream_shape(graph) if plan.sequence_parallel else None
        base = megatron_required(n, stream) if megatron else None

        def allow(node: Any, strategy: Strategy) -> bool:
            if base is not None and not base(node, strategy):
                return False
            return all(strategy.inputs[slot] == layouts[name].placement
                       for slot, name in enumerate(node.inputs) if name in layouts)

        boundary = Shard(1) if plan.sequence_parallel else R
        coster = CollectiveCountCoster(n) if megatron else coster_for(n)
        return graph, dict(solve_graph_sharding(graph, coster, boundary, allow=allow).choice)
    return prepare


def _weightless(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes and
    dtypes (no data is copied): enough to capture it, without keeping its weights alive."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(meta, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(model, memo)


def _model_device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters())).device
