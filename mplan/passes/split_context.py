"""Context parallelism on a rank's local program: every op holds this rank's slice of each
sequence; attention reads the whole sequence through `collectives.context_attention`.

Input: the local program of `insert_collectives`, built from a graph captured at the rank's
sequence length S / cp (`api.autoparallel` captures each rank's slice, so every view, reshape
and per-token op already has its local shape), and `ContextLowering` (the layout of the sequence
over the cp group, the group, the attention method). Output: the same program, edited in place,
that computes this rank's share of the single-device loss exactly.

What changes, and why it is exact (rules; anything else runs unchanged, per token):

    sdpa(q, k, v, attn_mask=None, dropout_p=0, is_causal=c, scale=s)
        -> context_attention(q, k, v, layout, cp group, mask=causal if c else bidirectional, scale=s):
           this rank's query rows against every key, masked by global position; GQA as SDPA's
           enable_gqa. An attn_mask tensor (its values are of local positions, and nothing says
           what rule built them), dropout, or attention under a strategy other than heads- or
           batch-split (`KVReplicatedAttention`) is refused, naming the node: never guessed.
    slice(table, d, 0, S/cp) of a buffer or constant with at least S rows along d (RoPE's
        `cos[:seq_len]`) -> index_select(table, d, positions): the rows of this rank's tokens
    arange(0, S/cp) (Hugging Face's cache_position / position ids) -> the positions themselves
    the loss: a token-mean cross-entropy L_r = sum_r / n_r over this rank's n_r counted labels
        -> L_r * n_r * cp / N, N = sum of n_r over the cp group (all-reduced, no gradient):
           sum over the cp group of these is cp times the global mean, and the runtime reduces
           losses and gradients over dp x cp ranks with a 1/(dp*cp) factor (`mesh.replicas()`),
           so each replica contributes its exact mean. L_r * n_r is sum_r up to one rounding.
           A loss that is not such a cross-entropy, or no `labels` input, is refused.

Positions are those of `layout.positions(rank)` (head-tail chunks for causal models, so each rank
has the same attention work). The runtime feeds inputs and labels split by the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from mplan.collectives.context_attention import METHODS, context_attention
from mplan.collectives.redistribute import AxisGroup, all_reduce_no_grad
from mplan.ir.attention_mask import CAUSAL, AttentionMask
from mplan.ir.context_layout import ContextLayout
from mplan.ir.sharding import UnexecutableStrategy
from mplan.passes.local_ops import (BatchShardedCrossEntropy, KVReplicatedAttention, VocabParallelCrossEntropy,
                                    VocabParallelHeadLoss, normalized_kwargs)

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.clone.default)


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextLowering:
    """The plan's context parallelism as the pass takes it."""

    layout: ContextLayout
    axis: AxisGroup  # this rank's cp axis
    method: str = "all_gather"  # `context_attention.METHODS`


class ContextAttention(nn.Module):
    """SDPA over the whole sequence for this rank's queries (`context_attention`)."""

    def __init__(self, *, lowering: ContextLowering, mask: AttentionMask, scale: float | None, node: str) -> None:
        super().__init__()
        self.lowering, self.mask, self.scale, self.node = lowering, mask, scale, node

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.lowering
        return context_attention(q, k, v, layout=c.layout, group=c.axis.group, method=c.method,  # type: ignore[arg-type]
                                 mask=self.mask, scale=self.scale)

    def extra_repr(self) -> str:
        c = self.lowering
        return f"node={self.node}, {self.mask}, {c.method}, cp={c.axis.size}"


class ContextPositions(nn.Module):
    """This rank's global token positions (`layout.positions(rank)`), as a dtype the graph wants,
    or the rows of a table at them."""

    def __init__(self, positions: torch.Tensor, *, dim: int | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.register_buffer("positions", positions, persistent=False)
        self.dim, self.dtype = dim, dtype

    def forward(self, table: torch.Tensor | None = None) -> torch.Tensor:
        if table is None:
            return self.positions.to(self.dtype)
        return table.index_select(self.dim, self.positions.to(table.device))

    def extra_repr(self) -> str:
        return f"dim={self.dim}" if self.dim is not None else f"dtype={self.dtype}"


class ContextLoss(nn.Module):
    """A token-mean loss of this rank's tokens rescaled to its share of the cp group's mean
    (module docstring)."""

    def __init__(self, *, axis: AxisGroup, ignore_index: int, node: str) -> None:
        super().__init__()
        self.axis, self.ignore_index, self.node = axis, ignore_index, node

    def forward(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mine = (labels != self.ignore_index).sum().to(torch.float64)
        total = all_reduce_no_grad(mine.clone(), self.axis)
        return loss * (mine * self.axis.size / total).to(loss.dtype)

    def extra_repr(self) -> str:
        return f"node={self.node}, ignore_index={self.ignore_index}, cp={self.axis.size}"


def split_context(program: fx.GraphModule, lowering: ContextLowering, *, labels: str | None,
                  device: torch.device | None = None) -> fx.GraphModule:
    """Edit `program` in place (module docstring); `labels` is the placeholder that feeds the
    labels (None: the program has none, and a training program is refused)."""
    layout = lowering.layout
    local, whole = layout.local_len, layout.seq_len
    positions = layout.positions(lowering.axis.rank, device)
    graph = program.graph
    count = 0

    def add(module: nn.Module, args: tuple[Any, ...], like: fx.Node) -> fx.Node:
        nonlocal count
        name = f"context_{count}"
        count += 1
        program.add_submodule(name, module)
        with graph.inserting_before(like):
            new = graph.call_module(name, args)
        new.meta.update(like.meta)
        return new

    for node in list(graph.nodes):
        if node.op == "call_module" and isinstance(program.get_submodule(node.target), KVReplicatedAttention):
            raise UnexecutableStrategy(f"node {program.get_submodule(node.target).node}: attention with key/value "
                                       f"heads replicated over tp (kv_heads < tp) under cp={layout.cp} is not lowered "
                                       f"yet; use tp <= kv_heads")
        if node.op != "call_function":
            continue
        if node.target is _SDPA:
            node.replace_all_uses_with(add(_attention(node, lowering), tuple(node.args[:3]), node))
            graph.erase_node(node)
        elif node.target in _ARANGES:
            call = normalized_kwargs(node.target, node.args, node.kwargs)
            start, end, step = call.get("start", 0), call.get("end"), call.get("step", 1)
            if (start, end, step) == (0, local, 1):
                dtype = call.get("dtype") or (node.meta["val"].dtype if "val" in node.meta else torch.int64)
                node.replace_all_uses_with(add(ContextPositions(positions, dtype=dtype), (), node))
                graph.erase_node(node)
        elif node.target is aten.slice.Tensor and _is_table(program, node.args[0]):
            call = normalized_kwargs(node.target, node.args, node.kwargs)
            dim, start, end, step = call["dim"], call["start"], call["end"], call["step"]
            rows = _table_rows(program, node.args[0], dim)
            if start in (0, None) and end == local and step == 1 and rows is not None and rows >= whole:
                node.replace_all_uses_with(add(ContextPositions(positions, dim=dim), (node.args[0],), node))
                graph.erase_node(node)
    _split_loss(program, lowering, labels)
    graph.lint()
    program.recompile()
    return program


def _attention(node: fx.Node, lowering: ContextLowering) -> ContextAttention:
    call = normalized_kwargs(node.target, node.args, node.kwargs)
    if call.get("attn_mask") is not None:
        raise UnexecutableStrategy(f"node {node.name} (scaled_dot_product_attention): an attn_mask tensor under "
                                   f"cp={lowering.layout.cp}: its values are of local positions and no rule says "
                                   f"what built them; context parallelism runs is_causal or unmasked attention only")
    if call.get("dropout_p", 0.0):
        raise UnexecutableStrategy(f"node {node.name} (scaled_dot_product_attention): attention dropout "
                                   f"p={call['dropout_p']} under cp={lowering.layout.cp} is not lowered")
    heads = node.args[0].meta["val"].shape[1] if "val" in node.args[0].meta else None
    if lowering.method == "all_to_all" and heads is not None and heads % lowering.layout.cp:
        raise UnexecutableStrategy(f"node {node.name} (scaled_dot_product_attention): cp_method=all_to_all splits "
                                   f"this rank's {heads} query heads over cp={lowering.layout.cp}, which does not "
                                   f"divide them; use cp_method=all_gather or ring")
    mask = CAUSAL if call.get("is_causal") else AttentionMask(causal=False)
    return ContextAttention(lowering=lowering, mask=mask, scale=call.get("scale"), node=node.name)


def _is_table(program: fx.GraphModule, node: Any) -> bool:
    """A buffer or constant (a placeholder the runtime feeds whole, or a get_attr)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    from mplan.passes.insert_collectives import INPUTS  # the program's input table

    kinds = {spec.placeholder: spec.kind for spec in program.meta.get(INPUTS, ())}
    return kinds.get(node.name) in ("BUFFER", "CONSTANT_TENSOR")


def _table_rows(program: fx.GraphModule, node: fx.Node, dim: int) -> int | None:
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        val = getattr(program, node.target)  # type: ignore[arg-type]
    return None if val is None else int(val.shape[dim])


def _split_loss(program: fx.GraphModule, lowering: ContextLowering, labels: str | None) -> None:
    graph = program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    value = result[0] if isinstance(result, (tuple, list)) else result
    source = value
    while isinstance(source, fx.Node) and source.op == "call_function" and source.target in _CASTS:
        source = source.args[0]
    ignore_index = _mean_cross_entropy(program, source)
    if ignore_index is None:
        what = source.target if isinstance(source, fx.Node) else source
        raise UnexecutableStrategy(f"the loss ({what}) under cp={lowering.layout.cp}: context parallelism needs a "
                                   f"token-mean cross-entropy, whose mean it can make exact over the cp group")
    label_node = next((n for n in graph.nodes if n.op == "placeholder" and n.name == labels), None)
    if label_node is None:
        raise UnexecutableStrategy(f"the loss under cp={lowering.layout.cp}: the program has no labels input to "
                                   f"count the tokens of")
    _check_labels_per_token(label_node, lowering.layout.cp)
    module = ContextLoss(axis=lowering.axis, ignore_index=ignore_index, node=source.name)
    program.add_submodule("context_loss", module)
    with graph.inserting_before(output):
        scaled = graph.call_module("context_loss", (value, label_node))
    scaled.meta.update(value.meta)
    output.args = ((scaled, *result[1:]),) if isinstance(result, (tuple, list)) else (scaled,)


_MOVES = {aten.constant_pad_nd.default, aten.pad.default, aten.roll.default, aten.cat.default, aten.narrow.default,
          aten.slice.Tensor, aten.select.int, aten.index_select.default, aten.flip.default}


def _check_labels_per_token(labels: fx.Node, cp: int) -> None:
    """Refuse labels moved along the sequence inside the model (Hugging Face's shift by one:
    pad and slice): on a rank's slice that reads a neighbour's token, which only the whole
    sequence has. Cuts of the batch dim (a symbolic batch's slices) move nothing."""
    seen, todo = set(), [labels]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in _MOVES and not (user.target is aten.slice.Tensor and (user.args[1:2] or (0,))[0] == 0):
                raise UnexecutableStrategy(
                    f"node {user.name} ({user.target}) moves the labels along the sequence under cp={cp} (a shift "
                    f"by one inside the model reads the next rank's token): shift the labels in the data and "
                    f"give the model targets per token")
            if user.target not in (aten.cross_entropy_loss.default,):
                todo.append(user)


def _mean_cross_entropy(program: fx.GraphModule, node: Any) -> int | None:
    """The ignore_index of a token-mean cross-entropy node, else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is aten.cross_entropy_loss.default:
        call = normalized_kwargs(node.target, node.args, node.kwargs)
        return int(call.get("ignore_index", -100)) if int(call.get("reduction", 1)) == 1 else None
    if node.op == "call_module":
        module = program.get_submodule(node.target)
        if isinstance(module, VocabParallelHeadLoss):
            return module.ignore_index
        if isinstance(module, (VocabParallelCrossEntropy, BatchShardedCrossEntropy)) and module.reduction == "mean":
            return module.ignore_index
    return None


__all__ = ["METHODS", "ContextAttention", "ContextLoss", "ContextLowering", "ContextPositions", "split_context"]
