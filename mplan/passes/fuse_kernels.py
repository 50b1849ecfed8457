"""`fuse_kernels`: swap ATen op chains of a captured model for mplan's fused kernels.

Input: an ATen-level `torch.fx.GraphModule`, as `torch.export.export(model, ..., strict=False)
.module()` gives for mplan's models (nodes carry `meta["val"]` fake tensors). Output: the same
GraphModule, rewritten in place and recompiled, with `gm.meta["fuse_kernels"]` holding a
`FusionReport` (how often each entry fired, and which came close and why they missed).

What is fused is the fusion registry (mplan.fusion.registry.FUSIONS, in its order: each entry's
pattern, and the emitter that inserts its kernel call); `attention` joins when the program will
run on CUDA takes the fastest fused backend, FP8 linears only when asked (`fp8=True`). This module is the driver:
each entry is tried at its anchor (the chain's last node); a match names the chain's nodes, the
chain values the fused op returns, the graph values it reads, and the operands the emitter
needs. The emitter inserts the call (a `call_function` node whose target is the kernel's
dispatching op, e.g. `mplan.kernels.rms_norm_residual`, which runs the Triton autograd Function
on CUDA and the reference elsewhere), the driver reroutes every use of the returned values and
erases the chain. Then RoPE on q and k pairs into `rope_qk`, the unrotated part of a grouped
GEMM is copied out, and fused outputs are marked with their consumer for autocast.

Invariants:
- Results are unchanged (except under `fp8=True`, which rounds GEMM operands to FP8 on
  purpose): every fused op's reference is the chain's own ATen ops, so on the reference
  dispatch the fused graph computes the same function as the unfused one (bit for bit, except
  where a GEMM changes: bias+GELU moves the bias out of it, grouped projections concatenate
  weights, both rounding as float64 does; attention is the same SDPA op, run on the backend
  that times fastest, which on CUDA may round differently; the head + loss computes in chunks);
  tests hold fused and unfused forward and backward together.
- A chain is fused only when its pattern matches (intermediate values used only inside it, the
  constants and shapes a kernel assumes: mplan.fusion). Anything else is left as it is, and a
  near miss is reported with its reason.
- The fused call is placed where every value it reads is defined and before every use of a
  value it returns; a match that admits no such place is skipped (and reported).
"""
from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from mplan.fusion.entry import (HEAD_CHUNK_ROWS_KEY, NOT_MARKED, SPLIT_BACKWARD_KEY, FusionEntry, Miss, PatternMatch,
                                meta_like)
from mplan.fusion.fp8 import fp8_linear_entry
from mplan.fusion.graph_match import ATTENTION_OPS, LOSS_OPS, VIEW_OPS, is_call, sole_consumer, tensor_value, uses
from mplan.fusion.registry import MATCHED
from mplan.fusion.rope import pair_fused_ropes
from mplan.kernels import attention, cross_entropy, rope, rope_qk
from mplan.kernels.fp8 import Fp8Unavailable, fp8_unavailable_reason
from mplan.kernels.grouped_linear import grouped_linear
from mplan.kernels.head_loss import linear_cross_entropy
from mplan.passes.local_ops import VocabParallelCrossEntropy, VocabParallelHeadLoss

__all__ = ["FusionReport", "fuse_kernels"]

aten = torch.ops.aten
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FusionReport:
    """How many chains each entry replaced, which entries came close and why they missed (entry
    -> reason -> count), and how many fused outputs were marked with the op that consumes them
    (`_mark_consumers`)."""

    counts: dict[str, int] = field(default_factory=dict)
    consumer_marks: int = 0
    missed: dict[str, dict[str, int]] = field(default_factory=dict)

    def __str__(self) -> str:
        fired = ", ".join(f"{name} x{count}" for name, count in self.counts.items())
        marks = f"; {self.consumer_marks} outputs marked for autocast's casts" if self.consumer_marks else ""
        missed = "".join(f"; {name} missed x{count}: {why}" for name, reasons in self.missed.items()
                         for why, count in reasons.items())
        return f"fuse_kernels: {fired or 'no rule fired'}{marks}{missed}"


_LOSSES = (*LOSS_OPS, cross_entropy, linear_cross_entropy)
"""What computes the loss once the entries ran (the FP8 sweep comes after cross_entropy's)."""
_ATTENTION_OPS = (*ATTENTION_OPS, attention)
"""What computes attention once the entries ran (ATTENTION may have fused SDPA)."""
_LINEAR_OPS = (linear_cross_entropy, grouped_linear)
"""Fused ops whose first argument is a GEMM input, cast under autocast as F.linear casts it."""


def fuse_kernels(gm: GraphModule, entries: tuple[FusionEntry, ...] | None = None, *,
                 device: torch.device | str | None = None, fp8: bool = False,
                 split_backward: bool = False, head_chunk_rows: int | None = None) -> GraphModule:
    """Replace every chain some entry matches (first matching entry wins, nodes in graph order);
    returns `gm`, recompiled, with `gm.meta["fuse_kernels"]` = FusionReport. `entries` defaults
    to the registry's (mplan.fusion.registry.MATCHED; attention's op takes the fastest fused
    backend on CUDA, SDPA's one elsewhere). `device`: where `gm` will run. `fp8`
    then sweeps the FP8 linear entry, first raising `Fp8Unavailable` (naming why) unless `device`
    can run FP8 GEMMs. `split_backward`: a zero-bubble schedule will split the backward into
    input and weight gradients, so grouped GEMMs stay ATen ops (as under `fp8`, whose sweep then
    finds them). `head_chunk_rows`: rows per chunk of the fused head + loss, vocabulary-parallel
    or not (None: the op's default; `Plan.head_loss_chunk_rows`)."""
    gm.meta[SPLIT_BACKWARD_KEY] = split_backward or fp8
    gm.meta[HEAD_CHUNK_ROWS_KEY] = head_chunk_rows
    if entries is None:
        entries = MATCHED
    sweeps = [entries]
    if fp8:
        where = torch.device(device) if device is not None else torch.device("cpu")
        reason = fp8_unavailable_reason(where)
        if reason is not None:
            raise Fp8Unavailable(f"fuse_kernels(fp8=True): {reason}")
        sweeps.append((fp8_linear_entry(losses=_LOSSES),))
    graph = gm.graph
    counts: Counter[str] = Counter()
    missed: dict[str, Counter[str]] = {}
    erased: set[Node] = set()
    for node in list(graph.nodes):
        # export's checks that a cast's input has the traced dtype: a use no chain should count
        # (a fused op never exposes the value it checks)
        if is_call(node, aten._assert_tensor_metadata.default):
            graph.erase_node(node)
    # first: the output head it takes is then no linear that an entry (FP8's) could take
    vocab_parallel = _fuse_vocab_parallel_losses(gm)
    for sweep in sweeps:
        for node in list(graph.nodes):
            if node in erased or node.op != "call_function":
                continue
            misses: list[tuple[FusionEntry, Miss]] = []
            fired = None
            for candidate in sweep:
                if node.target not in candidate.pattern.anchors:
                    continue
                match = candidate.pattern.match(node)
                if isinstance(match, Miss):
                    misses.append((candidate, match))
                elif match is not None and _rewrite(graph, match, candidate, erased):
                    counts[candidate.name] += 1
                    fired = candidate
                    break
                elif match is not None:
                    misses.append((candidate, Miss("no place in the graph reads every input before any "
                                                   "use of an output")))
            for candidate, miss in misses:
                if fired is None or fired.name == candidate.lesser:
                    missed.setdefault(candidate.name, Counter())[miss.why] += 1
    pairs = pair_fused_ropes(graph, _ATTENTION_OPS)
    if pairs:
        counts["rope"] -= 2 * pairs
        counts["rope_qk"] = pairs
        counts = +counts  # drops a rope count paired away entirely
    _release_rotated_projections(graph)
    counts.update(vocab_parallel)
    marks = _mark_consumers(graph)
    graph.lint()
    gm.recompile()
    gm.meta["fuse_kernels"] = report = FusionReport(dict(counts), consumer_marks=marks,
                                                    missed={k: dict(v) for k, v in missed.items()})
    logger.info("%s", report)
    return gm


def _fuse_vocab_parallel_losses(gm: GraphModule) -> Counter[str]:
    """TP programs compute a vocabulary-sharded loss in a module (`insert_collectives`), which no
    ATen rule sees. Its mean, where the local logits come straight from the column-parallel
    output head (`_vocab_parallel_head`), runs with the head's GEMM as one chunked op that never
    makes the local logits:

        before  x, w -> aten.linear(x, w [, b]) [-> view/reshape to [rows, V/n]] [-> .to(float32)]
                     -> call_module VocabParallelCrossEntropy(mean)(logits, target)
        after   x, w -> call_module VocabParallelHeadLoss(x, w, target [, b])   (the same node)

    (`vocab_parallel_linear_cross_entropy`; the linear, view and cast are erased; a bias is the
    column split's local slice and goes along). x's gradient is the partial addend the local
    linear's was, summed over the TP group by the same `Redistribute` before it. Any other mean
    (logits from anything but such a linear, or an intermediate used elsewhere) runs mplan's
    vocabulary-parallel cross-entropy kernel on the local logits (`fused`)."""
    fused: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not (isinstance(module, VocabParallelCrossEntropy) and module.reduction == "mean"):
            continue
        head = _vocab_parallel_head(node)
        if head is None:
            module.fused = True
            fused["vocab_parallel_cross_entropy"] += 1
            continue
        (x, weight, bias), chain, upcast = head
        gm.add_submodule(node.target, VocabParallelHeadLoss(axis=module.axis, ignore_index=module.ignore_index,
                                                            upcast=upcast, node=module.node,
                                                            chunk_rows=gm.meta.get(HEAD_CHUNK_ROWS_KEY)))
        node.args = (x, weight, node.args[1]) + (() if bias is None else (bias,))
        for value in reversed(chain):  # the cast, the view, the linear: each used only on this path
            for check in [u for u in value.users if is_call(u, aten._assert_tensor_metadata.default)]:
                gm.graph.erase_node(check)
            gm.graph.erase_node(value)
        fused["vocab_parallel_linear_cross_entropy"] += 1
    return fused


def _vocab_parallel_head(loss: Node) -> tuple[tuple[Node, Node, Node | None], list[Node], bool] | None:
    """((x, w, bias or None), [linear, then the view and/or cast in data order], upcast) when the
    vocabulary-parallel loss `loss` reads `aten.linear(x, w [, bias])` through at most one view
    or reshape to [rows, V/n] and at most one `.to(float32)` (`upcast`; in either order), every
    one used only on that path (dtype assertions aside) and the rows those of `target`; else None."""
    if len(loss.args) != 2 or loss.kwargs:
        return None
    value, target = loss.args
    chain: list[Node] = []
    user, upcast, viewed = loss, False, False
    while isinstance(value, Node) and not is_call(value, aten.linear.default):
        only_here = set(uses(value)) == {user}
        if not only_here or value.kwargs or len(value.args) != 2:
            return None
        if is_call(value, *VIEW_OPS) and not viewed:
            viewed = True
        elif is_call(value, aten.to.dtype) and value.args[1] == torch.float32 and not upcast:
            upcast = True
        else:
            return None
        chain.insert(0, value)
        user, value = value, value.args[0]
    linear = value
    if not is_call(linear, aten.linear.default) or linear.kwargs or \
            set(uses(linear)) != {user}:
        return None
    x, weight, bias = (list(linear.args) + [None])[:3]
    xv, wv, out, logits, labels = (tensor_value(n) for n in (x, weight, linear, loss.args[0], target))
    if xv is None or wv is None or out is None or logits is None or labels is None or wv.dim() != 2:
        return None
    width = wv.shape[0]
    rows = xv.numel() // max(xv.shape[-1], 1)
    # the loss must read the linear's rows in their order, all of them: a flatten of its leading dims
    if out.shape[-1] != width or tuple(logits.shape) != (rows, width) or labels.numel() != rows:
        return None
    return (x, weight, bias), [linear, *chain], upcast


_PART_VIEWS = (*VIEW_OPS, aten.transpose.int, aten.permute.default, aten.unsqueeze.default)
"""Views a projection's part goes through on its way to RoPE (Hugging Face's [b, s, h, d] -> [b, h, s, d])."""


def _rotated(part: Node) -> bool:
    """Every use of `part`, through views, is the rotated input of a RoPE kernel (never its tables):
    RoPE writes a new tensor, so nothing keeps `part`'s storage once it ran."""
    frontier = [part]
    while frontier:
        value = frontier.pop()
        for user in value.users:
            if is_call(user, rope) and user.args[0] is value or is_call(user, rope_qk) and value in user.args[:2]:
                continue
            if is_call(user, *_PART_VIEWS) and user.args[0] is value:
                frontier.append(user)
                continue
            return False
    return True


def _release_rotated_projections(graph: Graph) -> None:
    """Copy out the unrotated parts of a grouped GEMM whose other parts RoPE rotates.

    The q/k/v GEMM writes one packed buffer that q, k and v view. RoPE replaces q and k with new
    tensors, but attention keeps v for its backward, and as a view v kept the whole buffer: at
    Llama-1.1B's shape 80 MiB a layer more than q, k and v need, 1.7 GiB over 22 layers, found on
    the H200 as the 6.6% the memory model under-predicted the peak (29.10 GiB measured;
    benchmarks/results/memory_timeline_h200-2026-12-02-before-copy.json). A contiguous copy of v
    (16 MiB a layer there, microseconds) lets the buffer go once RoPE has run: 27.38 GiB
    (memory_timeline_h200-2026-12-02.json)."""
    for node in list(graph.nodes):
        if not (is_call(node, aten.split_with_sizes.default) and is_call(node.args[0], grouped_linear, aten.linear.default)):
            continue
        parts = sorted((u for u in node.users if is_call(u, operator.getitem)), key=lambda u: u.args[1])
        rotated = [_rotated(part) for part in parts]
        if not any(rotated) or all(rotated):
            continue
        for part in (p for p, r in zip(parts, rotated) if not r):
            with graph.inserting_after(part):
                copy = graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            value = part.meta.get("val")
            if isinstance(value, torch.Tensor):
                copy.meta["val"] = meta_like(value, value.shape)
            part.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


def _mark_consumers(graph: Graph) -> int:
    """Give each fused op whose entry marks an output (norms, RoPE: `FusionEntry.marks`) and
    whose output only feeds linears (or attention) a `consumer=` keyword: under autocast, which casts those inputs to its lower dtype, the kernel then writes
    that dtype itself (`mplan.kernels.dispatch.consumer_cast_dtype`), the same values without
    the fp32 round trip. Outside autocast the keyword changes nothing. Returns how many."""
    marked = 0
    for node in list(graph.nodes):
        index = node.meta.get("fusion_marks", NOT_MARKED) if node.op == "call_function" else NOT_MARKED
        if index == NOT_MARKED:
            continue
        if index == "all":  # every output must go to the same kind of consumer
            kinds = {sole_consumer(u, attention_ops=_ATTENTION_OPS, linear_ops=_LINEAR_OPS) for u in node.users}
            consumer = kinds.pop() if len(kinds) == 1 else None
        else:
            outputs = [node] if index is None else [u for u in node.users if is_call(u, operator.getitem)
                                                      and u.args[1] == index]
            consumer = sole_consumer(outputs[0], attention_ops=_ATTENTION_OPS, linear_ops=_LINEAR_OPS) if len(outputs) == 1 else None
        if consumer is not None:
            node.kwargs = {**node.kwargs, "consumer": consumer}
            marked += 1
    return marked


def _rewrite(graph: Graph, match: PatternMatch, fusion: FusionEntry, erased: set[Node]) -> bool:
    """Insert the entry's fused call (its node's meta["fusion"] names the entry, meta["fusion_marks"]
    holds its `marks`), reroute the
    outputs' uses, erase the chain; False if no valid place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    chain = set(match.chain)
    outside_users = [user for out in match.outputs for user in out.users if user not in chain]
    latest_input = max((order[n] for n in match.inputs if isinstance(n, Node)), default=-1)
    first_chain = min(match.chain, key=order.__getitem__)
    if latest_input < order[first_chain]:
        before = first_chain
    elif outside_users and latest_input >= min(order[user] for user in outside_users):
        return False
    else:
        before = list(graph.nodes)[latest_input + 1]
    with graph.inserting_before(before):
        fused = fusion.emit(graph, match)
        fused.meta["fusion"], fused.meta["fusion_marks"] = fusion.name, fusion.marks
        if len(match.outputs) == 1:
            results = [fused]
        else:
            results = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(match.outputs))]
    vals = [out.meta.get("val") for out in match.outputs]
    fused.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
    for out, result, val in zip(match.outputs, results, vals):
        result.meta["val"] = val
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in chain)
    dropped: list[Node] = []
    for node in sorted(match.chain, key=order.__getitem__, reverse=True):
        if not node.users:
            dropped.extend(node.all_input_nodes)
            graph.erase_node(node)
            erased.add(node)
    _erase_unused(graph, dropped, erased)
    return True


def _erase_unused(graph: Graph, nodes: list[Node], erased: set[Node]) -> None:
    """Erase what the chain read and nothing reads any more (an attention mask that the causal
    kernel replaced, and what computed it), when it is a pure ATen call: no mutation, no random
    numbers (erasing those would shift the generator's stream)."""
    while nodes:
        node = nodes.pop()
        if node in erased or node.users or node.op != "call_function" or not _pure(node.target):
            continue
        nodes.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _pure(target: Any) -> bool:
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)
