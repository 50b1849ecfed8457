"""`ParallelModule`: one rank's share of a model under an execution plan, trained step by step.

Input: the captured training `Graph`, its TP choice and `ExecutionPlan`, the user's model (or a
state dict) as the source of weights, an optimizer factory, and the job's world group.
Output: `pm.train_step(inputs, labels)` runs one optimizer step over the global batch and returns
the same loss on every rank; `pm(inputs)` runs inference and returns whole logits;
`pm.full_state_dict()`, `pm.save(dir)`, `pm.load(dir)`.

Building (`parallelize`), in this order:
1. every rank all-gathers its plan hash over the world and fails, naming the ranks, unless all
   agree: this is the first collective, so a rank with another plan or model never deadlocks
   the others inside a later one;
2. the mesh's process groups (`init_process_groups`, explicit, nothing global);
3. `shard_parameters` -> this rank's leaf parameters; `insert_collectives` -> the local program,
   then `fuse_kernels` when asked (see `local_program`);
4. the data-parallel optimizer (`build_optimizer`: zero=0 bucketed all-reduce, zero=1 ZeRO-1),
   told which parameters are TP shards and which replicated ones carry partial gradients;
   under autocast (zero=0) the compute copies of the weights autocast would cast every step
   (`compute_copies.py`), which the training program then reads;
5. the plan's activation recomputation: each unit of the training program (prologue, block
   instances, epilogue) under activation checkpointing (`passes/recompute.py`).

A step: each DP replica takes its rows of the global batch (or `local=True` rows it already
holds), splits them into `num_micro_batches` micro-batches, runs forward and backward of each
with the loss scaled by 1/num_micro_batches (gradients accumulate in `.grad`, a view into the
optimizer's buckets where gradients are reduced over ranks), then the optimizer averages over
DP, sums partial gradients over TP, clips by the global norm across all shards, updates, and
zeroes the gradients (None where unbucketed, as an eager loop leaves them). The returned loss is the mean over micro-batches and replicas,
which equals the single-device loss of the global batch when every micro-batch counts the same
number of target tokens (no ignored labels, or the same number per micro-batch).

Overhead against a plain PyTorch loop on the same model (the trivial plan must cost nothing):
the local program runs the exported graph's own ATen ops as generated Python code; parameters
stored whole share the model's storage (`shard_parameters`); gradients that need no collective
live in `.grad` as in eager (`data_parallel.py`); clipping uses multi-tensor kernels; the step
keeps no exported program, and no reference to the user's model, once it is built.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from mplan.ir.graph import Graph
from mplan.planner.placement import R
from mplan.planner.strategies import Strategy
from mplan.passes.insert_collectives import INPUTS, LocalInput, insert_collectives
from mplan.passes.parameter_layout import ParamLayout, parameter_layouts
from mplan.passes.recompute import checkpoint_units
from mplan.passes.shard_parameters import ParameterSource, materialize_buffers, shard_parameters
from mplan.runtime.checkpoint import load_checkpoint, save_checkpoint
from mplan.runtime.compute_copies import ComputeCopies, autocast_cast_parameters
from mplan.runtime.data_parallel import needs_reduction
from mplan.runtime.execution_plan import ExecutionPlan
from mplan.runtime.launch import collective_device
from mplan.runtime.optimizer import DistributedOptimizer, build_optimizer
from mplan.runtime.param_placement import ParamPlacement
from mplan.runtime.process_groups import ProcessGroups, group_size, init_process_groups
from mplan.runtime.redistribute import TensorParallelAxis, apply_transition, tp_axis
from mplan.runtime.replicated_optimizer import OptimizerFactory

Batch = torch.Tensor | Sequence[torch.Tensor]
InferencePreparer = Callable[[tuple[torch.Tensor, ...], Mapping[str, ParamLayout]], tuple[Graph, dict[str, Strategy]]]


class PlanMismatch(RuntimeError):
    """Ranks of one job hold different plans (or models)."""


def check_same_plan(digest: str, world: dist.ProcessGroup | None) -> None:
    """All-gather every rank's plan hash; raise on every rank, naming the ranks, unless equal."""
    if world is None or world.size() == 1:
        return
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=collective_device(world))
    every = [torch.zeros_like(mine) for _ in range(world.size())]
    dist.all_gather(every, mine, group=world)
    by_hash: dict[int, list[int]] = {}
    for rank, value in enumerate(every):
        by_hash.setdefault(int(value.item()), []).append(rank)
    if len(by_hash) > 1:
        groups = "; ".join(f"ranks {ranks} hold plan {value:015x}" for value, ranks in by_hash.items())
        raise PlanMismatch(f"the ranks of this job do not agree on the plan or the model: {groups}. "
                           f"Every rank must call autoparallel with the same model, inputs and plan")


def parallelize(*, graph: Graph, choice: dict[str, Strategy], plan: ExecutionPlan, digest: str,
                source: ParameterSource, model: nn.Module, optimizer: OptimizerFactory,
                device: torch.device, dtype: torch.dtype | None = None, seed: int = 0,
                max_grad_norm: float | None = 1.0, autocast: torch.dtype | None = None, kernels: bool = False,
                fp8: bool = False, prepare_inference: InferencePreparer | None = None) -> ParallelModule:
    """Build this rank's `ParallelModule` (collective: every rank of the job calls it)."""
    if fp8 and plan.recompute != "none":
        # raised alike on every rank, before the first collective
        raise ValueError(f"plan {plan.source}: recompute={plan.recompute} with fp8=True: FP8's delayed scaling "
                         "records each cast's amax in forward, so a recomputed forward would quantize with "
                         "another scale than the forward it replaces; use recompute=none with fp8")
    world = dist.group.WORLD if dist.is_initialized() else None
    check_same_plan(digest, world)
    groups = init_process_groups(plan.mesh)
    axis = tp_axis(groups)
    shards = shard_parameters(graph, choice, axis.rank, axis.size, source, seed=seed, device=device, dtype=dtype)
    program = local_program(graph, choice, axis, device=device, kernels=kernels, fp8=fp8)
    buffers = [spec.name for spec in program.meta[INPUTS] if spec.kind == "BUFFER"]
    statics = materialize_buffers(graph, model, buffers, device=device)
    if dtype is not None:  # as model.to(dtype) would: floating buffers (RoPE tables) follow
        statics = {k: v.to(dtype) if v.is_floating_point() else v for k, v in statics.items()}
    for spec in program.meta[INPUTS]:
        if spec.kind == "CONSTANT_TENSOR":
            statics[spec.name] = graph.program.constants[spec.target].to(device)
    # The exported program holds the model's parameters (its state_dict): the module keeps the
    # graph's records but not the program, so deleting the model frees them.
    return ParallelModule(graph=dataclasses.replace(graph, program=None), plan=plan, choice=choice, digest=digest,
                          groups=groups, axis=axis, program=program,
                          params={k: nn.Parameter(v) for k, v in shards.items()}, statics=statics,
                          layouts=parameter_layouts(graph, choice), optimizer=optimizer, device=device,
                          max_grad_norm=max_grad_norm, autocast=autocast, kernels=kernels, fp8=fp8,
                          prepare_inference=prepare_inference)


def local_program(graph: Graph, choice: Mapping[str, Strategy], axis: TensorParallelAxis, *,
                  device: torch.device, kernels: bool, fp8: bool = False) -> fx.GraphModule:
    """`insert_collectives`, then (`kernels`) `fuse_kernels` on the local program, and (`fp8`)
    its FP8 linears (which raise `Fp8Unavailable` naming why where FP8 GEMMs cannot run).

    Fusion is exact under TP too: it reads local shapes (`meta["val"]`), every reshard is a
    module call that no chain can span, and vocabulary- or batch-parallel losses are modules,
    never the `aten.cross_entropy_loss` the loss rule matches. Under autocast the fused ops
    follow the device's autocast policy and mixed-precision residual streams (mplan.kernels),
    so the fp32 capture's dtypes need not be the run's. `program.meta["fuse_kernels"]` reports
    what fired."""
    program = insert_collectives(graph, choice, axis, device=device)
    if kernels or fp8:
        # imported here: it loads the Triton kernels, which `import mplan` should not pay for
        from mplan.passes.fuse_kernels import fuse_kernels

        # on CUDA it also picks attention's fastest backend
        fuse_kernels(program, None if kernels else (), device=device, fp8=fp8)
    return program


class ParallelModule:
    """The `pm` of DESIGN.md: local program, local parameters, groups, optimizer."""

    def __init__(self, *, graph: Graph, plan: ExecutionPlan, choice: dict[str, Strategy], digest: str,
                 groups: ProcessGroups,
                 axis: TensorParallelAxis, program: fx.GraphModule, params: dict[str, nn.Parameter],
                 statics: dict[str, torch.Tensor], layouts: dict[str, ParamLayout],
                 optimizer: OptimizerFactory, device: torch.device, max_grad_norm: float | None,
                 autocast: torch.dtype | None, kernels: bool, prepare_inference: InferencePreparer | None,
                 fp8: bool = False) -> None:
        self.graph, self.plan, self.digest, self.groups, self.axis = graph, plan, digest, groups, axis
        self.choice = choice  # the TP strategy of every node of the training graph
        self.program, self.params, self.statics, self.layouts = program, params, statics, layouts
        self.device, self.max_grad_norm, self.autocast, self.kernels = device, max_grad_norm, autocast, kernels
        self.fp8 = fp8
        self._prepare_inference = prepare_inference
        self._inference: dict[tuple[tuple[int, ...], ...], fx.GraphModule] = {}
        placements = {params[name]: ParamPlacement(tp_sharded=layout.tp_sharded, tp_reduce=layout.grad_partial)
                      for name, layout in layouts.items()}
        self.copies = _compute_copies(program, params, placements, groups, autocast, zero=plan.zero)
        # after the copies, whose analysis reads which ops use each parameter in the flat program
        self.recomputed_units = checkpoint_units(program, graph, plan.recompute)
        self.optimizer: DistributedOptimizer = build_optimizer(
            list(params.values()), optimizer, groups, zero=plan.zero, placements=placements, copies=self.copies)
        self._last_grad_norm: torch.Tensor | None = None

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping, of the last step (None without clipping).
        Kept as a tensor until read: reading it waits for the device."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    # -- training -----------------------------------------------------------------------------
    def train_step(self, inputs: Batch, labels: torch.Tensor, *, local: bool = False) -> float:
        """One optimizer step over the global batch; the loss, equal on every rank."""
        tensors = (*_as_tuple(inputs), labels)
        replica = self.plan.global_batch // self.plan.mesh.dp
        rows = replica if local else self.plan.global_batch
        for t in tensors:
            if t.shape[0] != rows:
                where = "this replica's rows (local=True)" if local else "the global batch"
                raise ValueError(f"train_step got {t.shape[0]} rows; {where} is {rows} "
                                 f"(plan {self.plan.describe()}, global batch {self.plan.global_batch})")
        if not local:
            start = self.groups.dp_rank * replica
            tensors = tuple(t[start:start + replica] for t in tensors)
        tensors = tuple(t.to(self.device) for t in tensors)
        mbs, count = self.plan.micro_batch_size, self.plan.num_micro_batches
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for i in range(count):
                micro = tuple(t[i * mbs:(i + 1) * mbs] for t in tensors)
                with self._autocast():
                    loss = self.program(*self._feed(self.program, micro))
                if i == count - 1:
                    self.optimizer.before_last_backward()
                (loss if count == 1 else loss / count).backward()
                total += loss.detach().to(torch.float64)
            self._last_grad_norm = self.optimizer.step(max_grad_norm=self.max_grad_norm)
        finally:
            # Gradients live from the first backward to the update, as in an eager loop that
            # zeroes after stepping: none are held between steps, nor after a failed one.
            self.optimizer.zero_grad()
        total /= count * self.plan.mesh.dp
        if group_size(self.groups.dp) > 1:
            dist.all_reduce(total, group=self.groups.dp)
        return float(total)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast)

    def _feed(self, program: fx.GraphModule, user: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        specs: tuple[LocalInput, ...] = program.meta[INPUTS]
        wanted = sum(spec.kind == "USER_INPUT" for spec in specs)
        if wanted != len(user):
            raise ValueError(f"the captured program takes {wanted} inputs, got {len(user)}")
        given = iter(user)
        # the training program reads compute copies where there are (`_compute_copies`)
        copies = self.copies if program is self.program else None
        return [(self.params[s.name] if copies is None else copies.of(self.params[s.name])) if s.kind == "PARAMETER"
                else next(given) if s.kind == "USER_INPUT" else self.statics[s.name] for s in specs]

    # -- inference ----------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, inputs: Batch) -> torch.Tensor:
        """Forward only, on every rank alike; logits whole (gathered when vocabulary-sharded)."""
        tensors = tuple(t.to(self.device) for t in _as_tuple(inputs))
        key = tuple(tuple(t.shape) for t in tensors)
        if key not in self._inference:
            if self._prepare_inference is None:
                raise RuntimeError("this ParallelModule was built without a model to capture for inference")
            graph, choice = self._prepare_inference(tensors, self.layouts)
            for name, layout in parameter_layouts(graph, choice).items():
                if name in self.layouts and layout.placement != self.layouts[name].placement:
                    raise RuntimeError(f"inference sharding stores {name} as {layout.placement}, "
                                       f"training as {self.layouts[name].placement}")
            self._inference[key] = local_program(graph, choice, self.axis, device=self.device,
                                                 kernels=self.kernels, fp8=self.fp8)
        program = self._inference[key]
        with self._autocast():
            return program(*self._feed(program, tensors))

    # -- state --------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters under their original names (collective over TP: call on every rank)."""
        out: dict[str, torch.Tensor] = {}
        for name, layout in self.layouts.items():
            out[name] = apply_transition(self.params[name].detach(), layout.placement, R, self.axis).clone()
        return out

    def save(self, directory: str) -> None:
        """Per-rank tensor files and a JSON manifest (collective: call on every rank)."""
        save_checkpoint(directory, self)

    def load(self, directory: str) -> None:
        """Restore parameters and optimizer state saved by `save` under the same plan."""
        load_checkpoint(directory, self)
        if self.copies is not None:
            self.copies.refresh()


def _compute_copies(program: fx.GraphModule, params: Mapping[str, nn.Parameter],
                    placements: Mapping[nn.Parameter, ParamPlacement], groups: ProcessGroups,
                    autocast: torch.dtype | None, *, zero: int) -> ComputeCopies | None:
    """Under autocast, copies in its dtype of the wider parameters that the training program
    only feeds to inputs autocast casts (linears' weights and biases), where their gradient needs
    no collective and the optimizer is zero=0's (compute_copies.py); None where there are none."""
    if autocast is None or zero != 0:
        return None
    placeholders = {s.placeholder: s.name for s in program.meta[INPUTS] if s.kind == "PARAMETER"}
    names = sorted(n for n in autocast_cast_parameters(program, placeholders)
                   if params[n].dtype.itemsize > autocast.itemsize and params[n].requires_grad
                   and not needs_reduction(placements[params[n]], groups))
    return ComputeCopies([params[n] for n in names], autocast) if names else None


def _as_tuple(inputs: Batch) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)

