"""Execution on torch.distributed: process groups, data parallelism, the parallel module.

Input: a resolved `Plan` and the captured graph it was resolved for. Output: a training step on
real ranks (NCCL on GPUs, gloo on CPUs) that computes what the single-device model computes.
Everything that communicates takes its process groups as an argument (`ProcessGroups`); nothing
here is global state, and nothing here plans: the runtime reads the Plan.

    launch.py                 join the torchrun job (init_distributed_from_env)
    process_groups.py         ProcessGroups: this rank's groups, from a DeviceMesh with named axes
    param_placement.py        per-parameter facts: TP-sharded, TP partial grads, expert (reduced
                              over expert_dp), pipeline copy
    data_parallel.py          bucketed gradient sync over DP (zero=0)
    hierarchical_reduce.py    DP across sites: reduce-scatter in the site, shards summed over the
                              sites, all-gather in the site; MPLAN_INTER_SITE_DELAY_MS (emulation)
    sharded_optimizer.py      ZeRO-1: reduce-scatter, sharded fp32 masters, all-gather; ZeRO-2:
                              a reduce-scatter per bucket in every micro-batch's backward
    fully_sharded.py          ZeRO-3: parameters as flat shards, gathered per unit, released after
    replicated_optimizer.py   zero=0: sync, clip, any torch optimizer
    optimizer.py              DistributedOptimizer interface, build_optimizer(zero=...)
    optimizer_state.py        parameter groups in, tensor-only state dicts out
    grad_clip.py              global-norm clipping across TP, DP, PP and ZeRO shards
    compute_copies.py         bf16 compute copies of fp32 weights under autocast
    lowering.py               a plan into one rank's program: layouts, lowerings, the passes in order
    parallel_module.py        ParallelModule: train_step, inference, full_state_dict (autoparallel's pm)
    step_graph.py             a step's forwards and backwards replayed as one CUDA graph
    unit_gathers.py           ZeRO-3's units of a rank program and the gather/release calls in it
    checkpoint.py             save/load through torch.distributed.checkpoint: step directories,
                              atomic commit, background saves, validation agreed over the ranks
    checkpoint_state.py       the training state as global tensors under the model's own names
    checkpoint_chunks.py      a rank's pieces of a global tensor as DCP reads and writes them
    checkpoint_storage.py     DCP's file layout with JSON metadata and per-item checksums
    hf_checkpoint.py          Hugging Face directories in and out (safetensors slices per rank)
    inspect_checkpoint.py     what `mplan checkpoint inspect` shows, from metadata alone
    watchdog.py               where each rank is; a hang named by rank, action and peer
    bisect.py                 the first op whose value or gradient differs from one device

The rank layout is `mplan.ir.mesh`; the collectives are `mplan.collectives`. The modules from
parallel_module.py on build on passes/ and are imported by their full module path (the names
below stay importable without them).
"""
from __future__ import annotations

from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES
from mplan.runtime.data_parallel import GradientSync
from mplan.runtime.grad_clip import clip_grad_norm_
from mplan.runtime.launch import init_distributed_from_env
from mplan.runtime.optimizer import DistributedOptimizer, build_optimizer
from mplan.runtime.param_placement import REPLICATED, ParamPlacement
from mplan.runtime.process_groups import ProcessGroups, init_process_groups
from mplan.runtime.replicated_optimizer import ReplicatedOptimizer
from mplan.runtime.sharded_optimizer import ShardedOptimizer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "REPLICATED",
    "DistributedOptimizer",
    "GradientSync",
    "ParamPlacement",
    "ProcessGroups",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "build_optimizer",
    "clip_grad_norm_",
    "init_distributed_from_env",
    "init_process_groups",
]
