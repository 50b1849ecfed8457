"""`ParallelModule`: one rank's share of a model under a Plan, trained step by step.

Input: the captured training `Graph` (the one the Plan was resolved for: `planner.resolve`), the
`Plan` (read, never solved: every op's strategy comes from `Plan.op_strategies`), the user's
model (or a state dict) as the source of weights, an optimizer factory, and the job's world group.
Output: `pm.train_step(inputs, labels)` runs one optimizer step over the global batch and returns
the same loss on every rank (`pm.last_metrics`: that step's time, tokens/s, TFLOP/s, MFU and peak
memory against the Plan's prediction, `metrics.py`); `pm(inputs)` runs inference and returns
whole logits; `pm.full_state_dict()`, `pm.save(dir)`, `pm.load(dir)`. A learning-rate scheduler
takes `pm.optimizer.optimizer`, the torch optimizer whose parameter groups every step reads.
`pm.params` are this rank's local parameters; under zero=3 their storage is released between steps
and they are `ReleasedParameter`s there: shape, dtype and gradient read as usual, anything that
reads their values raises one line naming `pm.whole_parameter(name)` and `pm.full_state_dict()`
(`released_parameters.py`).

Building (`parallelize`), in this order:
1. every rank all-gathers its plan hash over the world and fails, naming the ranks, unless all
   agree: this is the first collective, so a rank with another plan or model never deadlocks
   the others inside a later one;
2. the mesh's process groups (`init_process_groups`: a torch DeviceMesh with named axes);
3. `shard_parameters` -> this rank's leaf parameters (a tied weight is one parameter, read under
   each of its names); `insert_collectives` on the graph at the plan's micro-batch -> the local
   program, then `fuse_kernels` when asked (see `local_program`);
4. the data-parallel optimizer (`build_optimizer`: zero=0 bucketed all-reduce, zero=1 ZeRO-1,
   zero=2 gradients sharded too, zero=3 parameters too: gathered per unit of the final programs,
   `unit_gathers.py`), told which parameters are TP shards and which replicated ones carry
   partial gradients;
   under autocast (zero=0) the compute copies of the weights autocast would cast every step
   (`compute_copies.py`), which the training program then reads;
5. the plan's activation recomputation: each unit of the training program (prologue, block
   instances, epilogue) under activation checkpointing (`passes/recompute.py`).

A step: each DP replica takes its rows of the global batch (or `local=True` rows it already
holds), splits them into `num_micro_batches` micro-batches, runs forward and backward of each
with the loss scaled by 1/num_micro_batches (gradients accumulate in `.grad`, a view into the
optimizer's buckets where gradients are reduced over ranks), then the optimizer averages over
DP, sums partial gradients over TP, clips by the global norm across all shards when asked
(`max_grad_norm`; never by default, as the user's own loop does not), updates, and zeroes the
gradients (None where unbucketed, as an eager loop leaves them). The returned loss is the mean
over micro-batches and replicas, which equals the single-device loss of the global batch when
every micro-batch counts the same number of target tokens (no ignored labels, or the same number
per micro-batch). With `pm.use_cuda_graphs()` (`autoparallel(..., cuda_graphs=True)`, plans of one
rank on CUDA) the forwards and backwards of a step replay as one CUDA graph from the third step on,
the optimizer staying eager (`step_graph.py`).

Under an outer loop across sites (`plan.outer_steps = H`, inexact, `outer_loop.py`): the optimizer
is built on the site's groups alone (`data_parallel.inner_only`), so gradients are averaged over
the site's replicas and nothing crosses sites in a step; every H steps the outer step averages the
sites' parameters' change over `cross_site_dp`. The loss returned is the site's (its replicas'
mean): between outer steps each site trains its own copy. Clipping is refused there (its global
norm would cross sites every step), and so are `save` and `load` (the outer loop's anchor and
momentum are not in the checkpoint format).

Inference (`pm(inputs)`) runs the training graph's own program up to the model's output (the
logits the capture keeps beside the loss), rebuilt for the inputs' batch under the same Plan;
a model that returns only its loss when given labels gets its inference graph from the caller
(`inference`: its forward captured and bound to the Plan by node keys at the first inference call,
never solved, and kept without the model's weights).

Overhead against a plain PyTorch loop on the same model (the trivial plan must cost nothing):
the local program runs the exported graph's own ATen ops as generated Python code; parameters
stored whole share the model's storage (`shard_parameters`); gradients that need no collective
live in `.grad` as in eager (`data_parallel.py`); clipping uses multi-tensor kernels; the step
keeps no exported program, and no reference to the user's model, once it is built.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from concurrent.futures import Future
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from mplan.collectives.flat import broadcast_tensor
from mplan.collectives.redistribute import AxisGroup, apply_transition
from mplan.ir.attention_mask import document_ids
from mplan.ir.context_layout import ContextLayout
from mplan.ir.graph import Graph
from mplan.ir.placement import R, Shard
from mplan.ir.rebatch import rebatch
from mplan.ir.sharding import ParamLayout, parameter_layouts
from mplan.ir.strategy import Strategy
from mplan.passes.expert_parallel import NO_EXPERT_PARALLELISM, ExpertsLowering
from mplan.passes.insert_collectives import INPUTS, LocalInput
from mplan.passes.recompute import checkpoint_units
from mplan.passes.shard_parameters import ParameterSource, materialize_buffers, shard_parameters
from mplan.passes.split_context import ContextLowering
from mplan.passes.split_stages import StageProgram, split_stages
from mplan.planner.plan import Plan, PlanError
from mplan.progress import Progress
from mplan.runtime.checkpoint import Stateful, is_hf_directory, load_checkpoint, save_checkpoint
from mplan.runtime.compute_copies import ComputeCopies, autocast_cast_parameters
from mplan.runtime.data_parallel import inner_only, needs_reduction, unique_trainable
from mplan.runtime.grouped_storage import place_end_to_end, weight_groups
from mplan.runtime.launch import collective_device
from mplan.runtime.lowering import (
    context_layout,
    context_lowering,
    document_layout,
    experts_lowering,
    local_program,
    weightless_program,
)
from mplan.runtime.metrics import StepMeter, StepMetrics
from mplan.runtime.optimizer import DistributedOptimizer, build_optimizer
from mplan.runtime.outer_loop import OuterLoop, OuterOptimizer
from mplan.runtime.param_placement import ParamPlacement
from mplan.runtime.pipeline_executor import PipelineExecutor, StageRunner
from mplan.runtime.pipeline_stages import RankStages, pipeline_schedule, rank_stages
from mplan.runtime.process_groups import ProcessGroups, group_size, init_process_groups
from mplan.runtime.released_parameters import guard, unguarded
from mplan.runtime.replicated_optimizer import OptimizerFactory
from mplan.runtime.step_graph import StepGraph, refuse_graphs
from mplan.runtime.unit_gathers import insert_unit_gathers, unit_parameters
from mplan.runtime.watchdog import Position, Watchdog, watch

Batch = torch.Tensor | Sequence[torch.Tensor]
Inference = Callable[[], tuple[Graph, Plan]]
"""Makes the model's forward (captured without labels, symbolic batch; its program without the
model's weights) and the Plan bound to it, for models whose training graph holds only their loss;
called at the first inference call, so a job that only trains never pays the capture (about as long
as the training capture's)."""


class PlanMismatch(RuntimeError):
    """Ranks of one job hold different plans (or models)."""


def check_executable(plan: Plan) -> None:
    """Refuse a pipeline plan whose schedule this runtime cannot run (an unknown name, a shape the
    micro-batches do not fit), raised alike on every rank, before any collective."""
    m = plan.mesh
    if m.pp > 1 or len(plan.stages) > 1:
        pipeline_schedule(plan)  # an unknown schedule or a shape it cannot run: ScheduleError, here


def plan_hash(graph: Graph, plan: Plan) -> str:
    """What every rank must agree on: the model's ops and shapes, and the plan that runs them
    (its search statistics, which differ from rank to rank, left out)."""
    nodes = [[n.name, n.op, [list(o.shape) for o in n.outputs]] for n in graph.nodes]
    doc = {**plan.to_dict(), "planner": None, "nodes": nodes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


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


def at_batch(graph: Graph, rows: int) -> Graph:
    """`graph` with its shapes at `rows` sequences (a symbolic-batch capture is re-priced; a
    static one runs only at the batch it was traced at)."""
    if rows == graph.batch_size:
        return graph
    if not any(m.sym is not None for m in graph.graph_inputs.values()):
        raise PlanError(f"{graph.model_name} was captured at a fixed batch of {graph.batch_size} sequences "
                        f"(it specializes on the batch size); it cannot run {rows}")
    return rebatch(graph, rows)


def parallelize(*, graph: Graph, plan: Plan, source: ParameterSource, model: nn.Module, optimizer: OptimizerFactory,
                device: torch.device, dtype: torch.dtype | None = None, seed: int = 0,
                max_grad_norm: float | None = None, autocast: torch.dtype | None = None, kernels: bool = False,
                fp8: bool = False, inference: Inference | None = None, documents: bool = False,
                outer: OuterOptimizer = OuterOptimizer()) -> ParallelModule:
    """Build this rank's `ParallelModule` (collective: every rank of the job calls it).
    `documents`: attention can be told packed documents' boundaries (`train_step(..., doc_ids=)`).
    `outer`: the outer loop's optimizer, read only where the plan has `outer_steps`."""
    check_executable(plan)
    if plan.outer_steps and max_grad_norm is not None:  # raised alike on every rank, before any collective
        raise ValueError(f"plan {plan.spec()}: max_grad_norm with outer_steps: the global norm would cross sites "
                         f"every step, which the outer loop exists to avoid; clip without it or drop outer_steps")
    if fp8 and plan.recompute != "none":
        # raised alike on every rank, before the first collective
        raise ValueError(f"plan {plan.spec()}: recompute={plan.recompute} with fp8=True: FP8's delayed scaling "
                         "records each cast's amax in forward, so a recomputed forward would quantize with "
                         "another scale than the forward it replaces; use recompute=none with fp8")
    if len(plan.stages) > 1 and dtype is not None:
        other = sorted({p.meta.dtype for p in graph.params.values()} - {str(dtype).removeprefix("torch.")})
        if other:  # raised alike on every rank, before the first collective
            raise PlanError(f"plan {plan.spec()}: a pipeline sends each stage's activations in the dtypes the "
                            f"capture recorded, and dtype={dtype} would change them (the model holds {other}): "
                            f"build the model in the dtype it trains in (model.to({dtype})) and leave dtype unset")
    program_graph = at_batch(graph, plan.micro_batch_size)
    choice = plan.op_strategies(program_graph)
    digest = plan_hash(program_graph, plan)
    world = dist.group.WORLD if dist.is_initialized() else None
    check_same_plan(digest, world)
    groups = init_process_groups(plan.mesh_shape())
    axis = groups.axis("tp")
    experts = experts_lowering(plan, groups)
    context = context_lowering(plan, groups, documents=documents)
    program = local_program(program_graph, choice, axis, device=device, kernels=kernels, fp8=fp8, experts=experts,
                            split_backward=len(plan.stages) > 1 and plan.schedule == "zb-h1",
                            head_chunk_rows=plan.head_loss_chunk_rows, context=context)
    pipeline = rank_stages(program, program_graph, plan, groups) if len(plan.stages) > 1 else None
    inputs = pipeline.inputs if pipeline is not None else program.meta[INPUTS]
    shards = shard_parameters(graph, choice, axis.rank, axis.size, source, seed=seed, device=device, dtype=dtype,
                              names=pipeline.parameters if pipeline is not None else None,
                              experts=experts.parameters, ep_rank=experts.ep.rank, ep_size=experts.ep.size)
    if kernels and plan.zero != 3:  # each grouped GEMM's weights in one storage (zero=3 gathers its own)
        own = dict(source.named_parameters(remove_duplicate=False)) if isinstance(source, nn.Module) else None
        place_end_to_end(weight_groups(program), shards, own)
    buffers = [spec.name for spec in inputs if spec.kind == "BUFFER"]
    statics = materialize_buffers(graph, model, buffers, device=device,
                                  state_dict=None if isinstance(source, nn.Module) else source)
    if dtype is not None:  # as model.to(dtype) would: floating buffers (RoPE tables) follow
        statics = {k: v.to(dtype) if v.is_floating_point() else v for k, v in statics.items()}
    for spec in inputs:
        if spec.kind == "CONSTANT_TENSOR":
            statics[spec.name] = graph.program.constants[spec.target].to(device)
    # The exported program holds the model's parameters (its state_dict): the module keeps the
    # graph's records (and the program's graph, without its weights) but not the program itself,
    # so deleting the model frees them.
    keep = graph.program is not None and len(graph.program.graph_signature.output_specs) > 1
    return ParallelModule(graph=dataclasses.replace(program_graph, program=weightless_program(graph) if keep else None),
                          plan=plan,
                          choice=choice, digest=digest, groups=groups, axis=axis, program=program,
                          params={k: nn.Parameter(v) for k, v in shards.items()}, statics=statics,
                          layouts=parameter_layouts(graph, choice), optimizer=optimizer, device=device,
                          max_grad_norm=max_grad_norm, autocast=autocast, kernels=kernels, fp8=fp8,
                          inference=inference, pipeline=pipeline, experts=experts, context=context, outer=outer)


class ParallelModule:
    """The `pm` of the public contract: local program, local parameters, groups, optimizer."""

    def __init__(self, *, graph: Graph, plan: Plan, choice: dict[str, Strategy], digest: str,
                 groups: ProcessGroups, axis: AxisGroup, program: fx.GraphModule, params: dict[str, nn.Parameter],
                 statics: dict[str, torch.Tensor], layouts: dict[str, ParamLayout],
                 optimizer: OptimizerFactory, device: torch.device, max_grad_norm: float | None,
                 autocast: torch.dtype | None, kernels: bool, inference: Inference | None,
                 fp8: bool = False, pipeline: RankStages | None = None,
                 experts: ExpertsLowering = NO_EXPERT_PARALLELISM, context: ContextLowering | None = None,
                 outer: OuterOptimizer = OuterOptimizer()) -> None:
        self.graph, self.plan, self.digest, self.groups, self.axis = graph, plan, digest, groups, axis
        self.choice = choice  # the TP strategy of every node of the training graph
        self.program, self.params, self.statics, self.layouts = program, params, statics, layouts
        self.device, self.max_grad_norm, self.autocast, self.kernels = device, max_grad_norm, autocast, kernels
        self.fp8, self.experts = fp8, experts
        self.step_graph: StepGraph | None = None  # `use_cuda_graphs`
        self.context = context  # its `batch` is set per micro-batch of packed documents
        self.last_context_sizes: list[int] = []  # the cp size each micro-batch of the last document step ran at
        self.pipeline = pipeline  # None: one stage, the flat program runs each micro-batch
        self._capture_forward = inference  # called once, by the first inference call (`_forward_graph`)
        # by rows: the local program, or under a pipeline plan the stages of it
        self._inference: dict[int, fx.GraphModule | tuple[StageProgram, ...]] = {}
        shared = pipeline.copies if pipeline is not None else None
        placements = {param: ParamPlacement(tp_sharded=layouts[name].tp_sharded, tp_reduce=layouts[name].grad_partial,
                                            expert=name in experts.parameters and experts.ep.size > 1,
                                            pp_copy=shared is not None and shared.copy_here(name))
                      for name, param in params.items()}
        # Compute copies are an optimization of the flat program (autocast's casts done once a
        # step); a pipeline lets autocast cast as it runs, which computes the same values.
        self.copies = (_compute_copies(program, params, placements, groups, autocast, zero=plan.zero)
                       if pipeline is None else None)
        # after the copies, whose analysis reads which ops use each parameter in the flat program
        self.recomputed_units = (checkpoint_units(program, graph, plan.recompute) if pipeline is None
                                 else list(pipeline.recomputed_units))
        # zero=3 (fully_sharded.py): parameters gathered per unit of the final programs, recomputed
        # units included; once per step under a pipeline or where the plan keeps the weights
        programs = [program] if pipeline is None else [pipeline.stages[s].module for s in pipeline.mine]
        units = unit_parameters(programs, graph, params) if plan.zero == 3 else None
        keep = pipeline is not None or getattr(plan, "zero3_keep_weights", False)
        # what data parallelism reduces over in a step: the mesh's replicas, or under an outer loop the site's
        self.replicas = inner_only(groups) if plan.outer_steps else groups
        self.optimizer: DistributedOptimizer = build_optimizer(
            list(params.values()), optimizer, self.replicas, zero=plan.zero, placements=placements, copies=self.copies,
            summed_first=[params[n] for n in shared.groups] if shared is not None else (), units=units,
            keep_gathered=keep)
        for module in programs if units is not None else ():
            insert_unit_gathers(module, graph, params, self.optimizer, keep=keep)
        if units is not None:  # between steps their storage is released: reading one raises, naming how to
            guard(params)
        self.outer_loop = OuterLoop(unique_trainable(params.values()), groups.cross_site_dp, plan.outer_steps, outer,
                                    site_group=groups.site_dp) if plan.outer_steps else None
        self._last_grad_norm: torch.Tensor | None = None
        # the step's micro-batches, filled in place for the stages' feeds (which hold this list, the
        # parameters and the buffers, never the module: deleting pm frees it without a collection)
        self._micro: list[tuple[torch.Tensor, ...]] = []
        self._documents: list[tuple[ContextLayout, torch.Tensor, bool]] = []  # a document step's (`_select_documents`)
        # where this rank is inside a step, for the hang watchdog (`watch_for_hangs`; off by default)
        self.position = Position.of(groups, clipping=max_grad_norm is not None)
        self.watchdog: Watchdog | None = None
        self.executor = self._executor() if pipeline is not None else None
        self._meter = StepMeter(plan=plan, graph=graph, device=device, optimizer=self.optimizer.optimizer)
        # `autoparallel` hands its Progress over: the first step is the last phase it reports
        # (it pays for the kernels' compilation and the allocator's warm-up), then it is dropped.
        self.progress: Progress | None = None
        self.hf_file_split: dict[str, str] | None = None
        """Which file of the Hugging Face directory it was loaded from holds each tensor: what
        `save(format="hf")` keeps (`hf_checkpoint.py`)."""
        self.hf_config: dict | None = None
        """The model's Hugging Face config (`config.to_dict()`), where it has one: `save(format="hf")`
        writes it, and checkpoints carry it so `mplan checkpoint convert` can."""
        self.step = 0
        """Optimizer steps taken (restored by `load`): the step a checkpoint is saved as."""
        self._saving: Future[str] | None = None  # a background save still writing
        self._checkpoint_group: dist.ProcessGroup | None = None

    def _executor(self) -> PipelineExecutor:
        pipeline = self.pipeline
        assert pipeline is not None
        runners = {}
        for s in pipeline.mine:
            stage = pipeline.stages[s]
            params = tuple(dict.fromkeys(self.params[n] for n in stage.parameters if self.params[n].requires_grad))
            runners[s] = StageRunner(program=stage, feed=self._stage_feed(stage.inputs), params=params)
        return PipelineExecutor(schedule=pipeline.schedule, pp_rank=self.groups.pp_rank, stages=runners,
                                peers=self.groups.ranks("pp"), device=self.device, position=self.position,
                                autocast=functools.partial(_autocast_context, self.device, self.autocast),
                                before_compute=self._select_documents if self.context is not None else None)

    def _select_documents(self, i: int) -> None:
        """Micro-batch i's packed documents (layout, ids) on the context modules, before its
        forward (and, under a pipeline, before each action that computes it: `_document_step`);
        nothing in a step without documents."""
        if self._documents:
            assert self.context is not None
            self.context.batch.layout, self.context.batch.doc_ids, self.context.batch.local = self._documents[i]

    def _stage_feed(self, specs: tuple[LocalInput, ...]) -> Callable[[int], list[torch.Tensor]]:
        """A stage's own inputs for micro-batch i of the current step (`_micro`)."""
        users = [s.placeholder for s in self.program.meta[INPUTS] if s.kind == "USER_INPUT"]
        position = {name: k for k, name in enumerate(users)}
        params, statics, micro_batches = self.params, self.statics, self._micro

        def feed(i: int) -> list[torch.Tensor]:
            micro = micro_batches[i]
            return [params[s.name] if s.kind == "PARAMETER" else micro[position[s.placeholder]]
                    if s.kind == "USER_INPUT" else statics[s.name] for s in specs]
        return feed

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping, of the last step (None without clipping).
        Kept as a tensor until read: reading it waits for the device."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def last_metrics(self) -> StepMetrics | None:
        """The last step's metrics, measured on this rank (`metrics.py`; `str()` is a log line);
        None before the first step."""
        return self._meter.last()

    # -- the data-parallel coordinates a user's data loader needs -------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica, 0 .. dp_size - 1: a sampler's `rank`
        (`DistributedSampler(data, num_replicas=pm.dp_size, rank=pm.dp_rank)`). Ranks that differ
        only in TP, PP, EP or CP share it: they must read the same rows."""
        return self.groups.data_rank

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (the plan's dp): a sampler's `num_replicas`."""
        return self.plan.mesh.dp

    @property
    def local_batch_size(self) -> int:
        """Rows of one replica's slice of the global batch: what `train_step(..., local=True)` takes."""
        return self.plan.global_batch // self.plan.mesh.dp

    # -- training -----------------------------------------------------------------------------
    def train_step(self, inputs: Batch, labels: torch.Tensor, *, local: bool = False,
                   doc_ids: torch.Tensor | None = None) -> float:
        """One optimizer step over the global batch; the loss, equal on every rank. Timed for
        `last_metrics` (the loss's read-back already waits for the device). `doc_ids` [rows, S]
        (the rows `inputs` has): packed documents, numbered in order along each row; no token
        attends to another document's (a module built with `documents=True`)."""
        first, self.progress = self.progress, None
        with first.phase("first step", "later steps: pm.last_metrics") if first else contextlib.nullcontext():
            self._meter.start()
            with self.position.stepping(self.step), self._unguarded():
                loss = self._step(inputs, labels, local=local, doc_ids=doc_ids)
            self._meter.stop(loss)
        self.step += 1
        return loss

    def _step(self, inputs: Batch, labels: torch.Tensor, *, local: bool, doc_ids: torch.Tensor | None = None) -> float:
        if doc_ids is not None:
            return self._document_step(inputs, labels, local=local, doc_ids=doc_ids)
        tensors = (*_as_tuple(inputs), labels)
        replica = self.plan.global_batch // self.plan.mesh.dp
        rows = replica if local else self.plan.global_batch
        for t in tensors:
            if t.shape[0] != rows:
                where = "this replica's rows (local=True)" if local else "the global batch"
                raise ValueError(f"train_step got {t.shape[0]} rows; {where} is {rows} "
                                 f"(plan {self.plan.describe()}, global batch {self.plan.global_batch})")
        if not local:
            start = self.groups.data_rank * replica
            tensors = tuple(t[start:start + replica] for t in tensors)
        if self.plan.mesh.cp > 1:  # this rank's tokens of every sequence
            layout = context_layout(self.plan)
            for t in tensors:
                if t.dim() < 2 or t.shape[1] != layout.seq_len:
                    raise ValueError(f"train_step under cp={layout.cp} takes [rows, {layout.seq_len}, ...] "
                                     f"tensors (the plan's sequence length), got {list(t.shape)}")
            tensors = tuple(layout.split(t, 1, self.groups.cp_rank) for t in tensors)
        tensors = tuple(t.to(self.device) for t in tensors)
        mbs, count = self.plan.micro_batch_size, self.plan.num_micro_batches
        micro = [tuple(t[i * mbs:(i + 1) * mbs] for t in tensors) for i in range(count)]
        if self.executor is not None:
            return self._pipeline_step(micro)
        return self._flat_step(micro)

    def _document_step(self, inputs: Batch, labels: torch.Tensor, *, local: bool, doc_ids: torch.Tensor) -> float:
        """`_step` for packed documents: each micro-batch runs under its own layout, balanced for
        its documents, with its document ids set on the program's context modules, and at the cp
        size `document_layout` chooses for it (`last_context_sizes`)."""
        if self.context is None:
            raise ValueError("train_step(doc_ids=...) needs a module whose attention takes documents "
                             "(autoparallel(..., document_mask=True), or any cp > 1)")
        tensors = (*_as_tuple(inputs), labels, doc_ids)
        replica = self.plan.global_batch // self.plan.mesh.dp
        rows, seq_len = (replica if local else self.plan.global_batch), self.plan.model.seq_len
        for t in tensors:
            if t.dim() < 2 or tuple(t.shape[:2]) != (rows, seq_len):
                raise ValueError(f"train_step takes [{rows}, {seq_len}, ...] tensors with doc_ids (the "
                                 f"{'replica' if local else 'global'} batch at the plan's sequence length), got "
                                 f"{list(t.shape)}")
        document_ids(doc_ids, seq_len)  # integers, numbered in order: one line if not
        if not local:
            start = self.groups.data_rank * replica
            tensors = tuple(t[start:start + replica] for t in tensors)
        mbs, count = self.plan.micro_batch_size, self.plan.num_micro_batches
        micro, batches = [], []
        for i in range(count):
            *own, docs = (t[i * mbs:(i + 1) * mbs] for t in tensors)
            layout, local = document_layout(self.plan, docs)
            micro.append(tuple(layout.split(t, 1, self.groups.cp_rank).to(self.device) for t in own))
            batches.append((layout, docs.to(self.device), local))
        self.last_context_sizes = [1 if local else self.plan.mesh.cp for _, _, local in batches]
        self._documents[:] = batches
        try:
            return self._pipeline_step(micro) if self.executor is not None else self._flat_step(micro)
        finally:
            self._documents.clear()
            self.context.batch.layout = self.context.batch.doc_ids = None
            self.context.batch.local = False

    def _flat_step(self, micro: list[tuple[torch.Tensor, ...]]) -> float:
        """The step of a plan without pipeline stages over its micro-batches (with packed
        documents: each one's layout and documents, `_documents`)."""
        count = len(micro)
        try:
            if self.step_graph is not None and not self._documents:
                total = self.step_graph.forward_backward(micro, self._forward_backward)
            else:
                total = self._forward_backward(micro)
            self.position.collective("optimizer step")
            self._last_grad_norm = self.optimizer.step(max_grad_norm=self.max_grad_norm)
            self._after_inner_step()
        finally:
            # Gradients live from the first backward to the update, as in an eager loop that
            # zeroes after stepping: none are held between steps, nor after a failed one.
            self.optimizer.zero_grad()
        # over dp x cp ranks under context parallelism (each cp rank's loss is its share, scaled by
        # cp); under an outer loop, the site's (out of place: a graphed step's total is its graph's)
        total = total / (count * self.replicas.mesh.dp)
        if group_size(self.replicas.dp) > 1:
            self.position.collective("loss all-reduce", "dp")
            dist.all_reduce(total, group=self.replicas.dp)
        return float(total)

    def _forward_backward(self, micro: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """Every micro-batch's forward and backward, gradients accumulated; their summed loss
        (float64, on the device). What a `StepGraph` records and replays."""
        count = len(micro)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, one in enumerate(micro):
            self.position.micro_batch(i)
            self._select_documents(i)
            with self._autocast():
                loss = self.program(*self._feed(self.program, one))
            if i == count - 1:
                self.optimizer.before_last_backward()
            (loss if count == 1 else loss / count).backward()
            total += loss.detach().to(torch.float64)
        return total

    def use_cuda_graphs(self) -> None:
        """Replay each step's forwards and backwards as one CUDA graph from the third step on
        (`runtime.step_graph`); raises ValueError naming why where this module's plan cannot."""
        refuse_graphs(self.plan, self.device, fp8=self.fp8)
        copies = self.copies
        self.step_graph = StepGraph([p if copies is None else copies.of(p) for p in self.params.values()])

    def _pipeline_step(self, micro: list[tuple[torch.Tensor, ...]]) -> float:
        """`train_step` under a pipeline plan: the executor runs this rank's actions; stage copies
        of shared parameters add up their gradients; the loss comes from the last stage."""
        assert self.executor is not None and self.pipeline is not None
        self._micro[:] = micro
        try:
            losses = self.executor.run()
            self.position.collective("stage copies' gradient sum")
            self.pipeline.copies.sum_gradients(self.params)
            self.position.collective("optimizer step")
            self._last_grad_norm = self.optimizer.step(max_grad_norm=self.max_grad_norm)
            self._after_inner_step()
        finally:
            self._micro.clear()
            self.optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.to(torch.float64)
        total /= len(micro) * self.replicas.mesh.dp  # dp x cp ranks under context parallelism (see `_flat_step`)
        # the last stage's sum, then over replicas
        for axis, group in (("pp", self.groups.pp), ("dp", self.replicas.dp)):
            if group_size(group) > 1:
                self.position.collective("loss all-reduce", axis)
                dist.all_reduce(total, group=group)
        return float(total)

    def _after_inner_step(self) -> None:
        """Under an outer loop, count the step and, every `outer_steps`, take the outer step over the
        sites (`outer_loop.py`); what the optimizer keeps of the parameters is then re-derived. (The
        hang watchdog reads it as part of the optimizer step.)"""
        if self.outer_loop is not None:
            if self.outer_loop.after_inner_step():
                self.optimizer.params_loaded()

    def _refuse_checkpoint_under_outer_loop(self, what: str) -> None:
        if self.outer_loop is not None:
            raise NotImplementedError(f"pm.{what} under outer_steps={self.plan.outer_steps}: the outer loop's anchor "
                                      f"and momentum are not in mplan's checkpoints yet, and a resume without them "
                                      f"would silently restart the outer optimizer")

    def watch_for_hangs(self, timeout_s: float | None = None, **options: float) -> Watchdog | None:
        """Start the hang watchdog (`watchdog.py`): a rank with no progress inside a step for
        `timeout_s` seconds makes every rank report where it is, and every rank raise `HangError`
        naming the stuck ones (or exit, where a blocked wait cannot be interrupted). None reads
        MPLAN_HANG_TIMEOUT_S (unset: off). Call on every rank alike; replaces an earlier one."""
        if self.watchdog is not None:
            self.watchdog.close()
        schedule = self.pipeline.schedule if self.pipeline is not None else None
        self.watchdog = watch(self.position, timeout_s, schedule=schedule, **options)
        return self.watchdog

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        # a CUDA graph's capture must not keep autocast's cast weights across its ops (torch.cuda.graph)
        return _autocast_context(self.device, self.autocast, cache=self.step_graph is None)

    def _unguarded(self) -> contextlib.AbstractContextManager[None]:
        """zero=3: the parameters plain inside a step or an inference call, whose ops then pay nothing
        for the guard that refuses reads of them between steps (`released_parameters.py`)."""
        return unguarded(self.params) if self.plan.zero == 3 else contextlib.nullcontext()

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
        """Forward only, on every rank alike; logits whole (gathered when vocabulary-sharded, sent
        from the last pipeline stage to every rank under a pipeline plan)."""
        if self.plan.mesh.cp > 1:
            raise NotImplementedError(f"forward-only calls under cp={self.plan.mesh.cp} are not lowered yet "
                                      f"(train_step is); run inference under a plan without cp")
        tensors = tuple(t.to(self.device) for t in _as_tuple(inputs))
        rows = tensors[0].shape[0]
        if rows not in self._inference:
            self._inference[rows] = self._inference_program(rows)
        program = self._inference[rows]
        with self._autocast(), self._unguarded():
            if isinstance(program, tuple):
                with self.optimizer.parameters_whole():  # zero=3: the units of this rank's stages
                    return self._pipeline_forward(program, tensors)
            return program(*self._feed(program, tensors))

    def _inference_program(self, rows: int) -> fx.GraphModule | tuple[StageProgram, ...]:
        """The model's forward at `rows` sequences under this Plan: the local program, or under a
        pipeline plan its stages (run by `_pipeline_forward`)."""
        if self.graph.program is not None:
            graph, plan, output = self.graph, self.plan, 1  # the training capture kept the model's output
        elif self._forward_graph is not None:
            (graph, plan), output = self._forward_graph, 0
        else:
            raise RuntimeError("this ParallelModule has no graph of the model's forward to run inference with")
        graph = at_batch(graph, rows)
        choice = plan.op_strategies(graph)
        for name, layout in parameter_layouts(graph, choice).items():
            if name in self.layouts and layout.placement != self.layouts[name].placement:
                raise RuntimeError(f"inference sharding stores {name} as {layout.placement}, "
                                   f"training as {self.layouts[name].placement}")
        program = local_program(graph, choice, self.axis, device=self.device, kernels=self.kernels, fp8=self.fp8,
                                output=output, experts=self.experts, head_chunk_rows=plan.head_loss_chunk_rows)
        if self.pipeline is not None:
            return split_stages(program, graph, [s.units for s in self.plan.stages])
        if self.plan.zero == 3:
            insert_unit_gathers(program, graph, self.params, self.optimizer, keep=False)  # type: ignore[arg-type]
        return program

    @functools.cached_property
    def _forward_graph(self) -> tuple[Graph, Plan] | None:
        """The loss-only model's forward graph and its Plan, captured at the first inference call
        (None for a model whose training graph keeps its output)."""
        return None if self._capture_forward is None else self._capture_forward()

    def _pipeline_forward(self, stages: tuple[StageProgram, ...], tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Forward through the stages: each rank runs its own in order, receiving from the stage
        before and sending to the next (a chain, so blocking transfers cannot deadlock); the last
        stage's rank then broadcasts the output over the pipeline group."""
        assert self.pipeline is not None
        schedule, peers, last = self.pipeline.schedule, self.groups.ranks("pp"), len(stages) - 1
        self._micro[:], result = [tensors], None
        try:
            for s in self.pipeline.mine:
                received = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in stages[s].receives]
                for buffer in received:
                    dist.recv(buffer, src=peers[schedule.rank_of(s - 1)])
                out = stages[s].module(*self._stage_feed(stages[s].inputs)(0), *received)
                if s == last:
                    result = out
                else:
                    for value in out:
                        dist.send(value.contiguous(), dst=peers[schedule.rank_of(s + 1)])
        finally:
            self._micro.clear()
        return broadcast_tensor(result, src=peers[schedule.rank_of(last)], group=self.groups.pp, device=self.device)

    # -- state --------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters under their original names, tied ones under each of their names
        (collective: call on every rank; under a pipeline plan each parameter is sent from the
        pipeline rank that owns it)."""
        out: dict[str, torch.Tensor] = {}
        with self.optimizer.parameters_whole():  # zero=3: gathered once for them all
            for name in self.layouts:
                whole = self.whole_parameter(name).clone()
                for alias in self.graph.names_of(name):
                    out[alias] = whole
        return out

    @torch.no_grad()
    def whole_parameter(self, name: str) -> torch.Tensor:
        """Parameter `name` whole on every rank (collective): gathered over TP and EP on the
        pipeline rank that owns it, then sent to the others. May share the local tensor's storage
        where nothing was gathered: clone it to keep it."""
        owner = self.pipeline.owner(name) if self.pipeline is not None else self.groups.pp_rank
        whole = None
        if owner == self.groups.pp_rank:
            with self.optimizer.parameters_whole():  # zero=3: gathered over DP for the while
                whole = apply_transition(self.params[name].detach(), self.layouts[name].placement, R, self.axis)
                if name in self.experts.parameters:  # every EP rank's experts, in rank order
                    whole = apply_transition(whole, Shard(0), R, self.experts.ep)
                if self.plan.zero == 3:  # the gathered storage is released on leaving
                    whole = whole.clone()
        if self.pipeline is not None:
            whole = broadcast_tensor(whole, src=self.groups.ranks("pp")[owner], group=self.groups.pp,
                                     device=self.device)
        assert whole is not None
        return whole

    def save(self, directory: str, *, background: bool = False, keep_latest: int | None = None,
             format: str = "mplan", extras: Mapping[str, Stateful] | None = None) -> str:
        """Save the training state as `directory/step-<self.step>` (collective: call on every rank):
        parameters, optimizer state, step, random generators, the Plan and `extras` (objects with
        a JSON `state_dict()`, e.g. a learning-rate scheduler), each rank writing its own pieces
        (`checkpoint.py`). Loads under any plan and world size. `background=True` returns once the
        state is copied to CPU memory and writes while training goes on (`wait_for_save()`);
        `keep_latest=k` keeps the newest k checkpoints. `format="hf"` writes a Hugging Face
        directory instead (`hf_checkpoint.py`). Returns the checkpoint's directory."""
        self._refuse_checkpoint_under_outer_loop("save")
        self.wait_for_save()
        if format == "hf":
            if background or keep_latest is not None or extras:
                raise ValueError("format='hf' writes the weights only: no background, keep_latest or extras")
            from mplan.runtime.hf_checkpoint import save_hf  # safetensors, only when asked
            with self.optimizer.parameters_whole():  # zero=3: gathered once for every tensor
                save_hf(directory, self)
            return directory
        if format != "mplan":
            raise ValueError(f"format must be 'mplan' or 'hf', got {format!r}")
        future = save_checkpoint(directory, self, background=background, keep_latest=keep_latest, extras=extras)
        if background:
            self._saving = future
        return future.result() if not background else os.path.join(directory, f"step-{self.step:08d}")

    def wait_for_save(self) -> str | None:
        """Wait for a background save to be committed; its directory (None if there was none).
        A failure of the background save is raised here."""
        saving, self._saving = self._saving, None
        return None if saving is None else saving.result()

    def load(self, directory: str, *, extras: Mapping[str, Stateful] | None = None) -> str:
        """Load a checkpoint saved under any plan and world size (collective), resharding it to
        this one: a checkpoint root (its newest step), one step's directory, or a Hugging Face
        model directory (config.json + safetensors: the weights only). Returns what it loaded."""
        self._refuse_checkpoint_under_outer_loop("load")
        self.wait_for_save()
        if is_hf_directory(directory):
            from mplan.runtime.hf_checkpoint import load_hf  # safetensors, only when asked

            with self.optimizer.parameters_whole():  # zero=3: written whole, taken into the shards
                load_hf(directory, self)
            return directory
        return load_checkpoint(directory, self, extras=extras)

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group over the world for background saves (created on first use, collectively),
        so their collectives run beside training's instead of inside its communicator."""
        if dist.is_initialized() and self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group


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


def _autocast_context(device: torch.device, dtype: torch.dtype | None,
                      cache: bool = True) -> contextlib.AbstractContextManager[None]:
    return (contextlib.nullcontext() if dtype is None
            else torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache))


def _as_tuple(inputs: Batch) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)

