"""Per-unit costs of a sharded model: what the pipeline partitioner and the evaluator add up.

A unit is one segment of the captured graph in execution order: the prologue (embeddings), each
block instance, glue between blocks, and the epilogue (final norm, head, loss). Given the TP
sharding solved for every segment (`GraphSharding`), each unit gets its forward and backward
seconds per micro-batch of the captured batch, the weight-gradient part of that backward (what a
zero-bubble schedule runs as W), its local parameters, the activations it keeps for backward under
each recomputation mode, and its inputs (what full recomputation checkpoints).

Weight gradients (`weight_backward_s`): every op that reads a parameter adds its forward compute
seconds (collectives left out), at most its backward's: a GEMM's weight gradient is one GEMM with
the forward's FLOPs (dW = dY^T X), so the forward time prices it; a norm's or an embedding's weight
gradient reads the output gradient and the saved input once, about the bytes its forward moved, a
small memory-bound share; a linear's bias gradient is a reduction inside that GEMM's share. The
rest of backward (input gradients, activations' backward, the collectives) is the I part.

Recomputation modes, as the planner defines them for fused-attention models:
- none: every tensor an op keeps for backward stays in memory (`sharding_ilp._saved_bytes`).
- selective: the unit's inputs and the outputs of its GEMMs, attention and embeddings stay (the
  runtime's selective checkpoint policy caches exactly those, `passes/recompute.py`); norms and
  elementwise ops (cheap, memory-bound, and the bulk of the bytes after fused attention) are
  re-run in backward.
- full: only the unit's inputs stay; the whole forward is re-run in backward.

A checkpointed unit keeps its inputs as they reach it (`_kept_inputs`): every activation its ops
read from an earlier unit, in the placement its producer left it in, since the reshards into the
unit's own layout run inside the unit (re-run in backward), each storage once per micro-batch over
the whole model: the first unit that reads a side input (a mask, RoPE's cos and sin, computed once
by the prologue for every block) keeps it for all the others. Invariant: every activation storage
of a micro-batch is counted by one unit under selective and full recomputation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mplan.ir.graph import Graph
from mplan.ir.op_table import persistent_inputs
from mplan.ir.placement import R, Shard
from mplan.ir.strategy import Strategy
from mplan.cost_models.host_queue import HostQueue, queued_makespan
from mplan.planner.fused_pricing import HeadChunking, extra_saved_bytes, head_chunking
from mplan.planner.host_cost import grad_values, op_host
from mplan.planner.op_cost import OpCoster
from mplan.planner.op_registry import shard_bytes
from mplan.planner.sharding_ilp import GraphSharding, SegmentSharding, stream_meta, value_meta

_KEEP_UNDER_SELECTIVE = ("matmul", "attention", "embedding", "loss")
_NO_DATA = ("view", "getitem", "scalar")  # kinds that compute nothing: no seconds to re-run, no tensor saved


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitCost:
    name: str  # "prologue", "layers.3", "epilogue", "glue.N"
    block_type: str | None
    forward_s: float  # one micro-batch of the captured batch, collectives included
    backward_s: float
    # the weight-gradient share of backward_s (module docstring), <= backward_s; 0.0 when not
    # priced (a backward never split: zero-bubble schedules then run it all as I)
    weight_backward_s: float = 0.0
    num_weight_ops: int = 0  # ops that read a parameter: the autograd nodes a split W pass re-runs
    comm_forward_s: float
    comm_backward_s: float
    num_params: int  # local parameters (elements) on one TP rank
    # the largest of them (elements, one tensor): a ZeRO bucket holds it alone where it outgrows one
    largest_param: int = 0
    # (name, local elements) of a glue unit's parameters: a tied embedding read by both the
    # prologue and the epilogue is held once by a rank that runs both
    glue_params: tuple[tuple[str, int], ...] = ()
    tp_grad_sync_bytes: int  # replicated parameters with partial gradients, all-reduced over TP
    saved_bytes: int  # activations kept for backward, recompute none
    selective_bytes: int  # activations kept under selective recomputation (its inputs included)
    selective_extra_s: float  # forward seconds re-run in backward under selective recomputation (collectives included)
    input_bytes: int  # the unit's inputs (local) as it keeps them: what full recomputation keeps
    # what a fused kernel's autograd context holds from forward to backward (the head + loss's
    # gradients, `FusedSave.gradients_in_forward`): kept under every recomputation, in selective_bytes too
    held_bytes: int = 0
    # forward seconds of the unit's last ops that a recomputation never re-runs: a kernel that makes
    # its gradients in forward saves no tensor, and torch's checkpoint stops once every saved one is back
    unrecomputed_forward_s: float = 0.0
    largest_op_bytes: int  # largest single op's local output: a transient bound
    # the fused head + loss, when this unit runs it: its chunk of logits is the unit's working memory
    head: HeadChunking | None = None
    # the unit's ops as the host issues them against the device (`host_cost`, `cost_models.host_queue`):
    # forward in program order, backward in reverse, each op's device time at its own price
    host_forward: HostQueue = HostQueue()
    host_backward: HostQueue = HostQueue()
    selective_host_s: float = 0.0  # host seconds of the forward ops selective recomputation re-runs
    num_param_tensors: int = 0  # parameter tensors the unit reads first (the optimizer's per-tensor work)

    @property
    def checkpoint_bytes(self) -> int:
        """What the unit keeps of a micro-batch under full recomputation: its inputs, and what a
        fused kernel's context holds whatever is recomputed (`held_bytes`)."""
        return self.input_bytes + self.held_bytes

    def working_bytes(self, head_rows: int | None = None) -> int:
        """The most a fused kernel holds while it runs beyond its saves: the head + loss's chunk of
        `head_rows` rows (None: the op's default); 0 for a unit without it."""
        return self.head.working_bytes(head_rows) if self.head is not None else 0


def segment_unit(graph: Graph, name: str, block_type: str | None, nodes: tuple[str, ...],
                 sharding: SegmentSharding, coster: OpCoster, input_bytes: int,
                 needs_grad: frozenset[str] | None = None) -> UnitCost:
    """Costs of one segment under its solved sharding, keeping `input_bytes` of inputs when
    checkpointed; `needs_grad`: `host_cost.grad_values(graph)`, computed when not given."""
    n = sharding.axis_size
    needs_grad = grad_values(graph) if needs_grad is None else needs_grad
    host = coster.host
    forward_ops: list[HostQueue] = []
    backward_ops: list[HostQueue] = []
    selective_host = 0.0
    inside = set(nodes)
    # A kept output that a later unit reads is kept there, as that unit's input (`_kept_inputs`):
    # the prologue's embedding output is the first block's input.
    read_outside = {graph.storage_root(a) for v in graph.nodes if v.name not in inside for a in v.inputs}
    selective_saved: set[str] = set()
    kept_extra = 0
    extra = 0.0
    largest = 0
    head: HeadChunking | None = None
    weight_grad = 0.0
    weight_ops = 0
    seen_params: set[str] = set()
    num_params = largest_param = 0
    glue: list[tuple[str, int]] = []
    held = 0
    trailing = 0.0  # forward seconds since the last op that saves a tensor for autograd
    for node in graph.nodes_of(nodes):
        s = sharding.choice[node.name]
        fused = coster.saves.get(node.name)
        # the fused head's logits are never whole: one chunk at a time, inside its kernel, which saves none
        if node.kind in _KEEP_UNDER_SELECTIVE and not (fused is not None and fused.chunked):
            selective_saved.add(graph.storage_root(node.name))
            kept_extra += node.saved_extra_bytes // (n if s.split else 1)  # attention's logsumexp
        if fused is not None and fused.gradients_in_forward and not fused.inside:
            held += extra_saved_bytes(graph, fused) // (n if s.split else 1)
        chunks = -(-head.rows // head.default_rows) if head is not None and fused is not None and \
            fused.kernel == "linear_cross_entropy" else 1
        op_cost, op_host_s = coster.op(node, s), op_host(node, host, fused=fused, needs_grad=needs_grad,
                                                          head_chunks=chunks)
        forward_ops.append(HostQueue.op(op_host_s.forward_s, op_cost.forward_s))
        # nothing for autograd: a kernel that made its gradients in forward, a view, or an op no gradient
        # flows through (the labels' shift between the head and the loss)
        saves_nothing = (fused is not None and fused.gradients_in_forward) or node.kind in _NO_DATA \
            or not any(a in needs_grad for a in node.inputs)
        trailing = trailing + op_cost.forward_s if saves_nothing else 0.0
        backward_ops.append(HostQueue.op(op_host_s.backward_s, op_cost.backward_s))
        if node.kind not in _KEEP_UNDER_SELECTIVE and node.kind not in _NO_DATA:
            extra += op_cost.forward_s
            selective_host += op_host_s.forward_s
        if node.outputs and not (fused is not None and fused.inside):  # a fused chain's inside is never made
            largest = max(largest, shard_bytes(node.output, s.output, n))
        elif fused is not None and fused.chunked and node.outputs:
            head = head_chunking(node, s.output, n)
        if node.params:
            cost, own = coster.op(node, s), coster.op_comm(s)
            weight_grad += max(0.0, min(cost.forward_s, cost.backward_s) - own)
            weight_ops += 1
        for _, param in node.params:
            if param in seen_params:
                continue
            seen_params.add(param)
            placement = sharding.choice[node.name].inputs[node.inputs.index(param)]
            numel = graph.params[param].meta.numel // (n if isinstance(placement, Shard) else 1)
            num_params += numel
            largest_param = max(largest_param, numel)
            glue.append((param, numel))
    selective_bytes = input_bytes + held + kept_extra + sum(
        shard_bytes(meta, sharding.choice[r].output if r in sharding.choice else sharding.boundary, n)
        for r in selective_saved - read_outside if r not in graph.params and (meta := value_meta(graph, r)) is not None)
    return UnitCost(name=name, block_type=block_type, forward_s=sharding.forward_s, backward_s=sharding.backward_s,
                    weight_backward_s=min(weight_grad, sharding.backward_s), num_weight_ops=weight_ops,
                    comm_forward_s=sharding.comm_forward_s, comm_backward_s=sharding.comm_backward_s,
                    num_params=num_params, largest_param=largest_param,
                    glue_params=tuple(glue) if block_type is None else (),
                    tp_grad_sync_bytes=sharding.tp_grad_sync_bytes, saved_bytes=sharding.saved_bytes,
                    selective_bytes=selective_bytes,
                    # the reshards' collectives re-run too: the runtime's policy caches no collective
                    selective_extra_s=extra + sharding.comm_forward_s, input_bytes=input_bytes,
                    held_bytes=held, unrecomputed_forward_s=trailing,
                    largest_op_bytes=largest, head=head,
                    host_forward=HostQueue.sequence(forward_ops), host_backward=HostQueue.sequence(reversed(backward_ops)),
                    selective_host_s=selective_host, num_param_tensors=len(seen_params))


def _kept_inputs(graph: Graph, nodes: tuple[str, ...], choice: dict[str, Strategy], n: int,
                 counted: set[str]) -> int:
    """Local bytes of what a checkpointed unit of `nodes` keeps as its inputs, adding each storage
    to `counted` (the storages earlier units keep: a storage is kept once whoever reads it). Each
    input is held in its producer's placement (the stream at the first block under SP arrives
    whole or partial, as the prologue made it, and is split inside the unit); parameters and
    buffers are not activations."""
    inside = set(nodes)
    persistent = persistent_inputs(graph)
    total = 0
    for node in graph.nodes_of(nodes):
        for name in node.inputs:
            root = graph.storage_root(name)
            if name in inside or root in counted or root in graph.params or root in persistent or \
                    (meta := value_meta(graph, root)) is None:
                continue
            counted.add(root)
            total += shard_bytes(meta, choice[root].output if root in choice else R, n)
    return total


def unit_costs(graph: Graph, sharding: GraphSharding, coster: OpCoster) -> list[UnitCost]:
    """Every unit of the model in execution order (untraced block instances included)."""
    n = sharding.axis_size
    # a block type is priced once without inputs; each instance adds the inputs it keeps
    needs_grad = grad_values(graph)
    per_type = {bt.name: segment_unit(graph, bt.name, bt.name, bt.template, sharding.segments[bt.name], coster, 0,
                                      needs_grad) for bt in graph.block_types}
    stream = stream_meta(graph)
    # an untraced instance reads the residual stream from the block before it, in the boundary placement
    untraced_input = 0 if stream is None else shard_bytes(stream, sharding.boundary, n)
    counted: set[str] = set()
    units = []
    for segment in graph.segments:
        if segment.block_type is None and not segment.nodes:
            continue
        inputs = _kept_inputs(graph, segment.nodes, sharding.choice, n, counted) if segment.nodes else untraced_input
        if segment.block_type is not None:
            template = per_type[segment.block_type]
            units.append(replace(template, name=segment.name, input_bytes=inputs,
                                 selective_bytes=template.selective_bytes + inputs))
        else:
            units.append(segment_unit(graph, segment.name, None, segment.nodes, sharding.segments[segment.name],
                                      coster, inputs, needs_grad))
    return units


def chunk_forward_s(units: Sequence[UnitCost], device_s: Sequence[float], bounds: tuple[int, int], *,
                    serial: bool) -> float:
    """Seconds of one micro-batch's forward through units [a, b) of a pipeline chunk: their ops
    queued on the host against `device_s` (each unit's device seconds as the evaluator prices
    them: collectives, re-priced experts) from an idle device (`cost_models.host_queue`)."""
    a, b = bounds
    return queued_makespan([u.host_forward for u in units[a:b]], device_s[a:b], serial=serial)


def chunk_backward_s(units: Sequence[UnitCost], device_s: Sequence[float], bounds: tuple[int, int], *,
                     recompute: str, serial: bool) -> float:
    """The same for the backward (units in reverse), `device_s` with recomputation's re-run
    forward included, whose host time is issued before each unit's backward: the whole forward's
    under full recomputation, the re-run ops' (`selective_host_s`) under selective."""
    a, b = bounds
    chunk = units[a:b][::-1]
    if recompute == "none":
        rerun = [0.0] * len(chunk)
    elif recompute == "selective":
        rerun = [u.selective_host_s for u in chunk]
    elif recompute == "full":
        rerun = [u.host_forward.host_s for u in chunk]
    else:
        raise KeyError(recompute)
    return queued_makespan([u.host_backward for u in chunk], device_s[a:b][::-1], rerun, serial=serial)


def param_tensors(units: Sequence[UnitCost], indices: Sequence[int]) -> int:
    """Parameter tensors a rank holding units `indices` steps: blocks add up, glue parameters
    count once by name (a tied embedding)."""
    glue = {name for u in indices for name, _ in units[u].glue_params}
    return len(glue) + sum(units[u].num_param_tensors for u in indices if not units[u].glue_params)
