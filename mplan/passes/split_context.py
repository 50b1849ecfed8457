"""Context parallelism on a rank's local program: every op holds this rank's slice of each
sequence; attention reads the whole sequence through `collectives.context_attention`.

Input: the local program of `insert_collectives`, built from a graph captured at the rank's
sequence length S / cp (`api.autoparallel` captures each rank's slice, so every view, reshape
and per-token op already has its local shape), and `ContextLowering` (the layout of the sequence
over the cp group, the group, the attention method). Output: the same program, edited in place,
that computes this rank's share of the single-device loss exactly.

What changes, and why it is exact (rules; anything else runs unchanged, per token):

    attention (`attention_forms`: SDPA, or an eager chain matmul -> scale -> soft-cap -> mask
    -> softmax -> matmul as nanoGPT and Hugging Face's eager attention write it)
        -> context_attention(q, k, v, layout, cp group, mask=rule, scale=s, softcap=c):
           this rank's query rows against every key, masked by global position; GQA as SDPA's
           enable_gqa. The rule is is_causal's, or the one `attention_forms.read_mask` reads off
           the mask tensor's own subgraph (causal, sliding window); its subgraph is then removed.
           A mask no such rule gives, dropout, or attention under a strategy other than heads- or
           batch-split (`KVReplicatedAttention`) is refused, naming the node: never guessed.
           A softmax over the slice's L tokens left after this (attention in a form not found)
           is refused too: run locally it would see only the rank's own keys.
    slice(table, d, 0, S/cp) of a buffer or constant with at least S rows along d (RoPE's
        `cos[:seq_len]`) -> index_select(table, d, positions): the rows of this rank's tokens
    arange(0, S/cp) (Hugging Face's cache_position / position ids) -> the positions themselves
    the loss: a token-mean cross-entropy L_r = sum_r / n_r over this rank's n_r counted labels
        -> L_r * n_r * cp / N, N = sum of n_r over the cp group (all-reduced, no gradient):
           sum over the cp group of these is cp times the global mean, and the runtime reduces
           losses and gradients over dp x cp ranks with a 1/(dp*cp) factor (`mesh.replicas()`),
           so each replica contributes its exact mean. L_r * n_r is sum_r up to one rounding.
    terms added to the cross-entropy that are computed from means over the tokens (an MoE
        router's load-balancing loss: each expert's share of the choices times its mean router
        probability), found by dataflow (`ir.token_statistics`)
        -> each token mean, or partial sum and its count, made the micro-batch's over the cp group
           by `ContextStatistic`, an all-reduce whose backward all-reduces the gradient. Every rank
           adds the whole term T to its share: the runtime's average over the cp ranks leaves T,
           and the backward all-reduce sums the ranks' equal cotangents, so each rank's gradient is
           cp times its tokens' part of T's and the average is T's exactly.
           A loss not linear in its cross-entropy, any other reduction over the tokens in these
           terms (`ir.token_statistics` names the op), or no `labels` input, is refused.
    pad(labels, (0, 1), value=i)[..., 1:] (Hugging Face's shift inside the loss: position p's
        target is the label at p + 1, on whichever rank holds it)
        -> the labels all-gathered over the cp group (integers, no gradient), padded with i and
           read at positions + 1. Any other move of the labels along the sequence is refused.

Positions are those of `layout.positions(rank)` (head-tail chunks for causal models, so each rank
has the same attention work). The runtime feeds inputs and labels split by the same layout.

Packed documents (`ContextBatch`): with document ids for a micro-batch, every attention also
hides keys of other documents (`ir.attention_mask`'s document rule), and the micro-batch runs
under a layout balanced for its documents' quadratic work (`context_layout.balance_attention`),
which positions, attention and the label shift all read at run time. The same lowering runs at
cp=1 when documents are asked for (one rank holds the whole sequence; no collective is issued).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from mplan.collectives.context_attention import METHODS, context_attention, local_attention
from mplan.collectives.redistribute import AxisGroup, all_reduce_no_grad, redistribute
from mplan.ir.attention_mask import AttentionMask
from mplan.ir.context_layout import ContextLayout
from mplan.ir.op_table import LOSS_CASTS
from mplan.ir.placement import P, R
from mplan.ir.sharding import UnexecutableStrategy
from mplan.ir.token_statistics import TokenStatistics, token_statistics
from mplan.passes.attention_forms import AttentionForm, find_attention, is_position_arange, is_table_slice, read_mask
from mplan.passes.local_ops import (BatchShardedCrossEntropy, KVReplicatedAttention, VocabParallelCrossEntropy,
                                    VocabParallelHeadLoss, normalized_kwargs)

aten = torch.ops.aten


@dataclass(kw_only=True, slots=True)
class ContextBatch:
    """What changes per micro-batch: its packed documents and the layout balanced for them. The
    runtime sets it before each micro-batch (`ParallelModule.train_step(..., doc_ids=)`) and
    clears it after the step; the program's context modules read it. Both None: the plan's layout,
    one document per row."""

    layout: ContextLayout | None = None
    doc_ids: torch.Tensor | None = None  # [rows, S] of the whole sequence, never decreasing along a row
    local: bool = False  # every document on one rank (`context_layout.whole_documents`): no exchange


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextLowering:
    """The plan's context parallelism as the pass takes it."""

    layout: ContextLayout  # the plan's (head-tail); a micro-batch's `batch.layout` replaces it
    axis: AxisGroup  # this rank's cp axis
    method: str = "all_gather"  # `context_attention.METHODS`
    batch: ContextBatch = field(default_factory=ContextBatch, compare=False)

    def current(self) -> ContextLayout:
        """The layout of the micro-batch running now."""
        return self.batch.layout or self.layout

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """This rank's global positions in the micro-batch running now."""
        return self.current().positions(self.axis.rank, device)


class ContextAttention(nn.Module):
    """SDPA over the whole sequence for this rank's queries (`context_attention`)."""

    def __init__(self, *, lowering: ContextLowering, mask: AttentionMask, scale: float | None,
                 softcap: float | None = None, upcast: torch.dtype | None = None, node: str) -> None:
        super().__init__()
        self.lowering, self.mask, self.scale, self.softcap, self.node = lowering, mask, scale, softcap, node
        self.upcast = upcast  # the dtype the captured softmax ran in: computed in at least it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.lowering
        if c.batch.local:
            return local_attention(q, k, v, positions=c.positions(q.device), mask=self.mask, doc_ids=c.batch.doc_ids,
                                   scale=self.scale, softcap=self.softcap, upcast=self.upcast)
        return context_attention(q, k, v, layout=c.current(), group=c.axis.group if c.axis.size > 1 else None,
                                 method=c.method, mask=self.mask, doc_ids=c.batch.doc_ids,  # type: ignore[arg-type]
                                 scale=self.scale, softcap=self.softcap, upcast=self.upcast)

    def extra_repr(self) -> str:
        c = self.lowering
        capped = f", softcap {self.softcap}" if self.softcap is not None else ""
        return f"node={self.node}, {self.mask}{capped}, {c.method}, cp={c.axis.size}"


class ContextPositions(nn.Module):
    """This rank's global token positions in the micro-batch running now (`lowering.positions`),
    as a dtype the graph wants, or the rows of a table at them.

    Positions run on across packed documents (they are not restarted per document). Under RoPE
    that is exact: attention within a document sees position differences only. A learned
    absolute position table (GPT's wpe) would train each document at shifted positions, unlike
    the document alone: with documents set, positions that index such a table (`learned`, its
    name) are refused, in one line, never run shifted."""

    def __init__(self, lowering: ContextLowering, *, device: torch.device | None = None, dim: int | None = None,
                 dtype: torch.dtype | None = None, learned: str | None = None) -> None:
        super().__init__()
        self.lowering, self.device, self.dim, self.dtype, self.learned = lowering, device, dim, dtype, learned

    def forward(self, table: torch.Tensor | None = None) -> torch.Tensor:
        if self.learned is not None and self.lowering.batch.doc_ids is not None:
            raise ValueError(f"packed documents (document_mask, train_step(doc_ids=)) with learned absolute "
                             f"positions ({self.learned}): positions run on across a row's documents, so every "
                             f"document but the first would train at shifted positions; positions restarting "
                             f"per document are not built; pack without document ids or use a RoPE model")
        if table is None:
            return self.lowering.positions(self.device).to(self.dtype)
        return table.index_select(self.dim, self.lowering.positions(table.device))

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


class ContextStatistic(nn.Module):
    """A statistic of this rank's tokens made the micro-batch's (`ir.token_statistics`): summed
    over the cp group by an all-reduce whose backward all-reduces the gradient, then divided by
    cp where it is a mean (every rank holds as many tokens)."""

    def __init__(self, *, axis: AxisGroup, mean: bool, node: str) -> None:
        super().__init__()
        self.axis, self.mean, self.node = axis, mean, node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = redistribute(x, P, R, P, R, self.axis)
        return whole / self.axis.size if self.mean else whole

    def extra_repr(self) -> str:
        return f"node={self.node}, {'mean' if self.mean else 'sum'}, cp={self.axis.size}"


class ContextShiftedLabels(nn.Module):
    """The label at position p + 1 for each of this rank's positions p (Hugging Face's shift
    inside the loss), `fill` past the sequence's end (module docstring)."""

    def __init__(self, *, lowering: ContextLowering, fill: int, node: str) -> None:
        super().__init__()
        self.lowering, self.fill, self.node = lowering, fill, node

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        c = self.lowering
        pieces = [labels]
        if c.axis.size > 1:
            pieces = [torch.empty_like(labels) for _ in range(c.axis.size)]
            dist.all_gather(pieces, labels.contiguous(), group=c.axis.group)
        whole = c.current().unsplit(pieces, 1)
        padded = torch.nn.functional.pad(whole, (0, 1), value=self.fill)
        return padded.index_select(1, c.positions(labels.device) + 1)

    def extra_repr(self) -> str:
        return f"node={self.node}, fill={self.fill}, cp={self.lowering.axis.size}"


def split_context(program: fx.GraphModule, lowering: ContextLowering, *, labels: str | None,
                  device: torch.device | None = None,
                  tables: Mapping[str, torch.Tensor] | None = None) -> fx.GraphModule:
    """Edit `program` in place (module docstring); `labels` is the placeholder that feeds the
    labels (None: the program has none, and a training program is refused); `tables`: the values
    of the program's buffers and constants by placeholder (a mask may be built from them)."""
    layout = lowering.layout
    local, whole = layout.local_len, layout.seq_len
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

    def rows_of(node: fx.Node, dim: int) -> int | None:
        return _table_rows(program, node, dim) if _is_table(program, node) else None

    for node in graph.nodes:
        if node.op == "call_module" and isinstance(program.get_submodule(node.target), KVReplicatedAttention):
            raise UnexecutableStrategy(f"node {program.get_submodule(node.target).node}: attention with key/value "
                                       f"heads replicated over tp (kv_heads < tp) under cp={layout.cp} is not lowered "
                                       f"yet; use tp <= kv_heads")
    for form in find_attention(program):
        mask = read_mask(program, form, local_len=local, seq_len=whole, tables=tables or {}, rows_of=rows_of)
        form.output.replace_all_uses_with(add(_attention(form, mask, lowering), (form.q, form.k, form.v), form.output))
        _erase_unused([*reversed(form.chain), *([form.mask] if form.mask is not None else [])])
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.users:
            continue
        if is_position_arange(node, local):
            dtype = node.kwargs.get("dtype") or (node.meta["val"].dtype if "val" in node.meta else torch.int64)
            positions = ContextPositions(lowering, device=device, dtype=dtype, learned=_learned_table(program, node))
            node.replace_all_uses_with(add(positions, (), node))
            graph.erase_node(node)
        elif node.target is aten.slice.Tensor and _is_table(program, node.args[0]):
            dim = is_table_slice(node, rows_of, local, whole)
            if dim is not None:
                node.replace_all_uses_with(add(ContextPositions(lowering, dim=dim), (node.args[0],), node))
                graph.erase_node(node)
    _refuse_sequence_softmax(program, local, layout.cp)
    shifted = _shift_labels(program, lowering, labels, add)
    _split_loss(program, lowering, labels, counted=shifted)
    graph.lint()
    program.recompile()
    return program


def _attention(form: AttentionForm, mask: AttentionMask, lowering: ContextLowering) -> ContextAttention:
    heads = form.q.meta["val"].shape[1] if "val" in form.q.meta else None
    if lowering.method == "all_to_all" and heads is not None and heads % lowering.layout.cp:
        raise UnexecutableStrategy(f"node {form.output.name} (attention): cp_method=all_to_all splits "
                                   f"this rank's {heads} query heads over cp={lowering.layout.cp}, which does not "
                                   f"divide them; use cp_method=all_gather or ring")
    return ContextAttention(lowering=lowering, mask=mask, scale=form.scale, softcap=form.softcap,
                            upcast=form.upcast, node=form.output.name)


def _erase_unused(roots: list[fx.Node]) -> None:
    """Erase `roots` and what only they read (a replaced attention's chain, its mask's subgraph),
    with the dtype assertions export adds beside them; placeholders stay."""
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node.op != "call_function" or node.graph is None or node not in node.graph.nodes:
            continue
        if any(user.target is not aten._assert_tensor_metadata.default for user in node.users):
            continue
        for user in list(node.users):
            node.graph.erase_node(user)
        inputs = list(node.all_input_nodes)
        node.graph.erase_node(node)
        todo += inputs


_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default)


def _refuse_sequence_softmax(program: fx.GraphModule, local: int, cp: int) -> None:
    """A softmax over L tokens left after lowering is attention in a form not found: run on the
    rank's slice it would attend to the rank's own keys only."""
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in _SOFTMAX and "val" in node.meta:
            shape = node.meta["val"].shape
            if len(shape) >= 3 and shape[int(node.args[1]) % len(shape)] == local:
                raise UnexecutableStrategy(f"node {node.name} ({node.target}): a softmax over the {local} tokens "
                                           f"of a rank's slice under cp={cp} is attention in a form mplan does not "
                                           f"lower (SDPA, or matmul -> softmax -> matmul); run it without cp")


def _shift_labels(program: fx.GraphModule, lowering: ContextLowering, labels: str | None,
                  add: Any) -> fx.Node | None:
    """pad(labels, (0, 1), value=i)[..., 1:] -> `ContextShiftedLabels` (module docstring); the
    shifted labels' node, None when the model does not shift."""
    label_node = next((n for n in program.graph.nodes if n.op == "placeholder" and n.name == labels), None)
    if label_node is None:
        return None
    for pad in list(label_node.users):
        if pad.target not in (aten.pad.default, aten.constant_pad_nd.default) or len(pad.users) != 1:
            continue
        call = normalized_kwargs(pad.target, pad.args, pad.kwargs)
        cut = next(iter(pad.users))
        if list(call["pad"]) != [0, 1] or call.get("mode", "constant") != "constant" or cut.target is not aten.slice.Tensor:
            continue
        cut_call = normalized_kwargs(cut.target, cut.args, cut.kwargs)
        if cut_call["dim"] not in (1, -1) or (cut_call["start"], cut_call["step"]) != (1, 1):
            continue
        module = ContextShiftedLabels(lowering=lowering, fill=int(call.get("value") or 0), node=cut.name)
        shifted = add(module, (label_node,), cut)
        cut.replace_all_uses_with(shifted)
        program.graph.erase_node(cut)
        program.graph.erase_node(pad)
        return shifted
    return None


def _learned_table(program: fx.GraphModule, positions: fx.Node) -> str | None:
    """The parameter an embedding lookup reads at `positions` (through a few reshapes and
    casts), or None: a learned absolute position table, as GPT's wpe."""
    from mplan.passes.insert_collectives import INPUTS  # the program's input table

    parameters = {spec.placeholder: spec.name for spec in program.meta.get(INPUTS, ()) if spec.kind == "PARAMETER"}
    todo, seen = [(positions, 0)], set()
    while todo:
        node, depth = todo.pop()
        for user in node.users:
            if user.target is aten.embedding.default and user.args[1] is node:
                table = user.args[0]
                if table.op == "placeholder" and table.name in parameters:
                    return parameters[table.name]
            elif depth < 4 and user not in seen and user.op == "call_function":
                seen.add(user)
                todo.append((user, depth + 1))
    return None


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


def _split_loss(program: fx.GraphModule, lowering: ContextLowering, labels: str | None, *,
                counted: fx.Node | None = None) -> None:
    """`ContextLoss` on the loss's cross-entropy, counting the tokens of `counted` (the labels the
    loss reads after a shift; None: the labels input), and `ContextStatistic` where the loss's
    other terms reduce over the tokens (`ir.token_statistics`)."""
    graph = program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    value = result[0] if isinstance(result, (tuple, list)) else result
    source = _cross_entropy(program, value)
    if source is None:
        what = value.target if isinstance(value, fx.Node) else value
        raise UnexecutableStrategy(f"the loss ({what}) under cp={lowering.layout.cp}: context parallelism needs a "
                                   f"token-mean cross-entropy, whose mean it can make exact over the cp group")
    label_node = next((n for n in graph.nodes if n.op == "placeholder" and n.name == labels), None)
    if label_node is None:
        raise UnexecutableStrategy(f"the loss under cp={lowering.layout.cp}: the program has no labels input to "
                                   f"count the tokens of")
    _check_labels_per_token(label_node, lowering.layout.cp)
    statistics = token_statistics(graph, loss=source, tokens=_token_inputs(program), cp=lowering.layout.cp)
    module = ContextLoss(axis=lowering.axis, ignore_index=_mean_cross_entropy(program, source), node=source.name)
    program.add_submodule("context_loss", module)
    with graph.inserting_after(source):
        scaled = graph.call_module("context_loss", (source, label_node if counted is None else counted))
    scaled.meta.update(source.meta)
    source.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    _make_whole(program, statistics, lowering.axis)


def _cross_entropy(program: fx.GraphModule, value: Any) -> fx.Node | None:
    """The loss's one token-mean cross-entropy: `value` itself (casts aside), else the only one
    among what `value` is computed from (a sum with other terms); None where there is none or
    more than one."""
    source = value
    while isinstance(source, fx.Node) and source.op == "call_function" and str(source.target) in LOSS_CASTS:
        source = source.args[0]
    if _mean_cross_entropy(program, source) is not None:
        return source
    found, todo, seen = [], [value] if isinstance(value, fx.Node) else [], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if _mean_cross_entropy(program, node) is not None:
            found.append(node)
        else:
            todo += node.all_input_nodes
    return found[0] if len(found) == 1 else None


def _token_inputs(program: fx.GraphModule) -> list[fx.Node]:
    """The program's per-token inputs (input ids, labels, an attention mask)."""
    from mplan.passes.insert_collectives import INPUTS  # the program's input table

    names = {spec.placeholder for spec in program.meta.get(INPUTS, ()) if spec.kind == "USER_INPUT"}
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]


def _make_whole(program: fx.GraphModule, statistics: TokenStatistics, axis: AxisGroup) -> None:
    """Each token statistic of `statistics` made the micro-batch's over the cp group."""
    graph = program.graph
    for n, (node, mean) in enumerate([*((m, True) for m in statistics.means),
                                      *((s, False) for s in statistics.sums)]):
        name = f"context_statistic_{n}"
        program.add_submodule(name, ContextStatistic(axis=axis, mean=mean, node=node.name))
        with graph.inserting_after(node):
            whole = graph.call_module(name, (node,))
        whole.meta.update(node.meta)
        node.replace_all_uses_with(whole, delete_user_cb=lambda user, whole=whole: user is not whole)
    for division in statistics.counts:
        count = division.args[1]
        if isinstance(count, fx.Node):
            with graph.inserting_before(division):
                count = graph.call_function(operator.mul, (count, axis.size))
        else:
            count = count * axis.size
        division.args = (division.args[0], count, *division.args[2:])


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


__all__ = ["METHODS", "ContextAttention", "ContextBatch", "ContextLoss", "ContextLowering", "ContextPositions",
           "ContextShiftedLabels", "ContextStatistic", "split_context"]
