"""How a Plan becomes one rank's program: its layouts and lowerings, and the passes in order.

    local_program(graph, choice, axis, *, device, kernels, ...) -> fx.GraphModule
        insert_collectives, then split_context (cp, or documents), then fuse_kernels (kernels, fp8)
    context_layout(plan), document_layout(plan, doc_ids)   how a sequence is split over cp ranks
    context_lowering(plan, groups), experts_lowering(plan, groups)   the plan as the passes take it
    weightless_program(graph)   what inference needs of the exported program, without the weights

Apart from `parallel_module.py`, which builds and steps a `ParallelModule` from them: the one place
where the plan's context and expert parallelism are read for the passes, so the lowering and
`train_step`'s split of a batch read the same layout.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
import torch.fx as fx

from mplan.collectives.redistribute import AxisGroup
from mplan.ir.context_layout import ContextLayout, balance_attention, head_tail, whole_documents
from mplan.ir.graph import Graph
from mplan.ir.strategy import Strategy
from mplan.passes.expert_parallel import NO_EXPERT_PARALLELISM, ExpertsLowering
from mplan.passes.insert_collectives import INPUTS, LocalInput, insert_collectives
from mplan.passes.split_context import ContextLowering, split_context
from mplan.planner.plan import Plan
from mplan.runtime.process_groups import ProcessGroups


def context_layout(plan: Plan) -> ContextLayout:
    """How the plan's sequence is split over its cp ranks: head-tail chunks (each rank the same
    causal attention work). The one choice both the lowering's positions and `train_step`'s split
    of the batch read, so they cannot disagree."""
    return head_tail(plan.model.seq_len, plan.mesh.cp)


def document_layout(plan: Plan, doc_ids: torch.Tensor) -> tuple[ContextLayout, bool]:
    """The layout of a micro-batch of packed documents (`doc_ids` [rows, S]) and whether its
    documents each run on one rank. Dynamic CP between two sizes: where whole documents deal onto
    the cp ranks with balanced work (`context_layout.whole_documents`), each document runs at
    cp=1 and no keys or values move (True); else chunks dealt so every cp rank has near-equal
    causal attention work within documents, quadratic in each document's length
    (`context_layout.balance_attention`), over the whole cp group (False)."""
    if plan.mesh.cp == 1:
        return context_layout(plan), True
    whole = whole_documents(plan.model.seq_len, plan.mesh.cp, doc_ids)
    if whole is not None:
        return whole, True
    return balance_attention(plan.model.seq_len, plan.mesh.cp, doc_ids=doc_ids), False


def context_lowering(plan: Plan, groups: ProcessGroups, *, documents: bool = False) -> ContextLowering | None:
    """The plan's context parallelism as the passes take it: `context_layout` and the plan's
    method; None at cp=1 unless attention must be told `documents`."""
    if plan.mesh.cp == 1 and not documents:
        return None
    return ContextLowering(layout=context_layout(plan), axis=groups.axis("cp"), method=plan.mesh.cp_method)


def experts_lowering(plan: Plan, groups: ProcessGroups) -> ExpertsLowering:
    """The plan's expert parallelism as the passes take it: the EP axis, the parameters its
    `sharding` splits over ep, and the capacity factor it sets."""
    names = frozenset(name for name, axes in plan.sharding.items() if axes.get("ep") == "S(0)")
    return ExpertsLowering(ep=groups.axis("ep"), parameters=names, capacity_factor=plan.capacity_factor)


def weightless_program(graph: Graph) -> object:
    """What inference needs of the exported program (its graph and signature), without the model's
    weights."""
    program = graph.program
    return _ProgramGraph(graph_module=program.graph_module, graph=program.graph,
                         graph_signature=program.graph_signature, constants=dict(program.constants))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _ProgramGraph:
    """The parts of an ExportedProgram `insert_collectives` reads, without its state dict."""

    graph_module: fx.GraphModule
    graph: fx.Graph
    graph_signature: object
    constants: dict[str, torch.Tensor]


def local_program(graph: Graph, choice: Mapping[str, Strategy], axis: AxisGroup, *,
                  device: torch.device, kernels: bool, fp8: bool = False, output: int = 0,
                  experts: ExpertsLowering = NO_EXPERT_PARALLELISM, split_backward: bool = False,
                  head_chunk_rows: int | None = None, context: ContextLowering | None = None) -> fx.GraphModule:
    """`insert_collectives`, then (`kernels`) `fuse_kernels` on the local program, and (`fp8`)
    its FP8 linears (which raise `Fp8Unavailable` naming why where FP8 GEMMs cannot run).

    Fusion is exact under TP too: it reads local shapes (`meta["val"]`), every reshard is a
    module call that no chain can span, and vocabulary- or batch-parallel losses are modules,
    never the `aten.cross_entropy_loss` the loss rule matches. Under autocast the fused ops
    follow the device's autocast policy and mixed-precision residual streams (mplan.kernels),
    so the fp32 capture's dtypes need not be the run's. `split_backward` (a zero-bubble schedule
    will split the backward into input and weight gradients) keeps grouped GEMMs ATen ops, whose
    dX and dW the split runs apart. `head_chunk_rows`: the fused head + loss's rows per chunk
    (the plan's; None: the op's default). `program.meta["fuse_kernels"]` reports what fired."""
    program = insert_collectives(graph, choice, axis, device=device, output=output, experts=experts)
    if context is not None:  # before fusion: attention becomes context attention, the loss the cp share
        labels = next((spec.placeholder for spec in program.meta[INPUTS]
                       if spec.kind == "USER_INPUT" and spec.name == "labels"), None)
        split_context(program, context, labels=labels, device=device, tables=_tables(graph, program.meta[INPUTS]))
    if kernels or fp8:
        # imported here: it loads the Triton kernels, which `import mplan` should not pay for
        from mplan.passes.fuse_kernels import fuse_kernels

        # on CUDA it also picks attention's fastest backend
        fuse_kernels(program, None if kernels else (), device=device, fp8=fp8, split_backward=split_backward,
                     head_chunk_rows=head_chunk_rows)
    return program


def _tables(graph: Graph, inputs: Sequence[LocalInput]) -> dict[str, torch.Tensor]:
    """The captured values of the program's buffers and constants by placeholder (a mask built
    from a buffer is read off them); those of a model on meta are left out."""
    program = graph.program
    found = {}
    for spec in inputs:
        if spec.kind in ("BUFFER", "CONSTANT_TENSOR"):
            value = getattr(program, "state_dict", {}).get(spec.target, program.constants.get(spec.target))
            if isinstance(value, torch.Tensor) and not value.is_meta:
                found[spec.placeholder] = value.detach().cpu()
    return found
