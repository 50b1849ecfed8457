"""Activation recomputation: run each unit of the local program under activation checkpointing.

Input: one rank's local program (`insert_collectives`, after `fuse_kernels`), the captured
`Graph` (its segments: prologue, each block instance, glue, epilogue, as the planner's units),
and the plan's recompute mode. Output: the same program, edited in place, with each segment's
ops moved into a submodule that runs under `torch.utils.checkpoint` (non-reentrant), so that
memory holds what the planner priced for the mode (`planner/unit_costs.py`):

- none       the program is left as it is: every tensor an op saves for backward stays.
- full       only each unit's inputs stay; backward re-runs the unit's forward, collectives
             included, in the same order on every rank of a TP group (Megatron's full
             recomputation).
- selective  the outputs of GEMMs, attention, embeddings and FP8 GEMMs are kept (a selective
             checkpoint policy caches them); norms, activations, residual adds, casts and the
             reshards between them re-run in backward. The planner keeps the tensors GEMMs and
             attention save (their inputs) rather than their outputs; in a transformer block the
             two are the same few tensors of hidden width plus one of FFN width, so the policy
             holds what the planner prices up to that one tensor's choice.

Why segments: they are the units the planner prices memory and recomputation time by, and
they are contiguous in program order. Nodes the planner never saw (reshards, fused kernels) are
labelled as `program_segments.op_segments` says, as the pipeline cut labels them.
Exactness: checkpointing changes when values are computed, never what: the recomputed forward
is the same ops on the same inputs (RNG state preserved), so losses and gradients are bitwise
those of the plain program.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mplan.cost_models.memory_model import RECOMPUTE_MODES
from mplan.ir.graph import Graph
from mplan.passes.program_segments import op_segments

_aten = torch.ops.aten
KEPT_UNDER_SELECTIVE = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._scaled_mm.default, _aten.embedding.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
"""Ops whose outputs a selective region caches instead of recomputing (as ATen dispatches them)."""


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_UNDER_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_selective_policy)


class CheckpointedUnit(nn.Module):
    """One unit of the program; under autograd its activations are recomputed in backward.

    The first call at each input shape runs the unit once more, plainly, before the checkpointed
    call: autotuners time kernels on first use (attention's backend choice runs its own backward),
    and a backward run inside a checkpointed forward unpacks through that region's hooks, which
    then recomputes it at the wrong time (a selective region fails outright: torch counts that as
    a second backward through it)."""

    def __init__(self, unit: fx.GraphModule, mode: str) -> None:
        super().__init__()
        self.unit, self.mode = unit, mode
        self._tuned: set[tuple[Any, ...]] = set()

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # inference keeps nothing for backward anyway
            return self.unit(*args)
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        if shapes not in self._tuned:
            cuda = sorted({a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
            with torch.random.fork_rng(devices=cuda):  # a dropout here must not shift the real call's masks
                self.unit(*args)  # its graph is dropped at once; only the autotuners' choices stay
            self._tuned.add(shapes)
        if self.mode == "selective":
            return checkpoint(self.unit, *args, use_reentrant=False, context_fn=_selective_contexts)
        return checkpoint(self.unit, *args, use_reentrant=False)


def checkpoint_units(program: fx.GraphModule, graph: Graph, mode: str) -> list[str]:
    """Move each segment's ops of `program` into a `CheckpointedUnit` (in place); the unit names."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none":
        return []
    runs = _contiguous_runs(program, graph)
    names = []
    for k, (segment, nodes) in enumerate(runs):
        name = f"recompute_{k}_{segment.replace('.', '_')}"
        _extract(program, nodes, name, mode)
        names.append(name)
    program.delete_all_unused_submodules()  # the reshard and attention modules now live in units
    program.graph.lint()
    program.recompile()
    return names


def _contiguous_runs(program: fx.GraphModule, graph: Graph) -> list[tuple[str, list[fx.Node]]]:
    """The program's op nodes cut into maximal runs of one segment, in program order."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for node, label in op_segments(program, graph):
        if runs and runs[-1][0] == label:
            runs[-1][1].append(node)
        else:
            runs.append((label, [node]))
    return runs


def _extract(program: fx.GraphModule, nodes: list[fx.Node], name: str, mode: str) -> None:
    """Replace the contiguous `nodes` by one call of a `CheckpointedUnit` submodule `name`."""
    inside = set(nodes)
    outside = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
    # A higher-order op's body (a `torch.no_grad()` or autocast region) is read by a `get_attr`
    # node that torch.export may place anywhere before the op, e.g. after the unit's first op
    # (transformers' RoPE under @torch.no_grad(), mid-prologue): the unit reads its own copy, so the call
    # below takes only values defined before the unit's first op.
    bodies = [i for i in outside if i.op == "get_attr"]
    inputs = [i for i in outside if i.op != "get_attr"]
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = sub.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in bodies:
        env[node] = sub.get_attr(node.target)
    for node in nodes:
        env[node] = sub.node_copy(node, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    program.add_submodule(name, CheckpointedUnit(fx.GraphModule(program, sub), mode))
    # contiguous in program order: every op input is defined before the first node
    with program.graph.inserting_before(nodes[0]):
        call = program.graph.call_module(name, tuple(inputs))
        results = [program.graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    for old, new in zip(outputs, results):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        program.graph.erase_node(node)
    for node in bodies:
        if not node.users:
            program.graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == node.target for n in program.graph.nodes):
            # moved, not shared: the program's clean-up of unused submodules would delete the
            # nested bodies of its copy, the very objects the unit still reads
            owner, _, attr = node.target.rpartition(".")
            delattr(program.get_submodule(owner), attr)
