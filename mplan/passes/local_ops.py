"""How one ATen op runs on a rank's local shards under the strategy the Plan chose for it.

Input: a typed `OpNode` and its `Strategy`, whose `lowering` names the rule (the planner's op
registry set it; `planner/op_registry.py`). Output: what `insert_collectives` emits for it and,
where the op needs one, a small module that computes its local result (`VocabParallelEmbedding`,
`VocabParallelCrossEntropy`, `BatchShardedCrossEntropy`, `KVReplicatedAttention`; and
`VocabParallelHeadLoss`, which `fuse_kernels` puts in place of the output head's column-parallel
linear and the vocabulary-parallel loss after it).

The lowerings (`mplan.ir.strategy.LOWERINGS`), each saying why the local result is exact:

    replicated      every input R, output R, op not split: the single-device op, unchanged
    dropped         an assertion about the captured (global) tensors: not true of local shards;
                    its input is never read, so it is taken in whatever placement it arrives
    local           ops for which running on the shards gives the shard of the result under
                    the strategy (elementwise and masked selects, matmuls, heads- or batch-split
                    attention, norms over unsplit dims, transposes, cuts of unsharded dims, ...)
    reshape_local   view/reshape/flatten/... with a sharded output: `reshape` to the local output
                    shape; strategies only shard the outermost dim of a merged group, so local
                    row-major order is the global order restricted to the shard
    expand_local    expand with a sharded output: expand to the local output shape
    row_bias        linear with a partial output and a bias: each rank adds bias / n, so the sum
                    over ranks adds the bias once; the bias gradient is then partial, as the
                    strategy's input gradient says
    kv_replicated_attention  attention with query heads split and key/value heads whole (kv_heads
                    < tp): each rank narrows k and v to the kv heads of its query heads
    vocab_embedding embedding with a vocabulary-sharded table (output P): look up the ids this
                    rank owns, zeros elsewhere (Megatron's VocabParallelEmbedding)
    vocab_loss      cross-entropy on vocabulary-sharded logits: all-reduce the row max, the sum
                    of exponentials and the target logit; no rank holds full logits
    batch_loss      cross-entropy on row-sharded logits (output P): the local sum divided by the
                    number of counted rows over ALL ranks, so the partial values sum to the mean
    experts         a MoE layer's routed experts (`moe_experts`) on this rank's expert weights,
                    whole or split by their FFN dim (output P: each rank's FFN slice adds its
                    share, as a row-parallel linear's), dispatched over the plan's expert-parallel
                    ranks: `passes/expert_parallel.py` (any strategy of such a node runs there)

A strategy naming no rule of this list raises `UnexecutableStrategy` naming node and strategy.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mplan.collectives.redistribute import AxisGroup, all_reduce_no_grad
from mplan.ir.graph import OpNode
from mplan.ir.sharding import UnexecutableStrategy
from mplan.ir.strategy import LOWERINGS, Strategy

MODULE_LOWERINGS = frozenset({"kv_replicated_attention", "vocab_embedding", "vocab_loss", "batch_loss",
                              "experts"})
"""The lowerings that run the op through a module of this file (`attention_module`,
`embedding_module`, `loss_module`; `experts` through `expert_parallel.experts_module`); the others
emit an ATen call (`insert_collectives._emit`)."""
ATEN_LOWERINGS = frozenset({"replicated", "dropped", "local", "reshape_local", "expand_local", "row_bias"})
"""The lowerings `insert_collectives` emits as ATen calls: with `MODULE_LOWERINGS`, all of `LOWERINGS`."""


def lowering_of(node: OpNode, strategy: Strategy) -> str:
    """The strategy's lowering, checked against `LOWERINGS` (see the module docstring)."""
    if strategy.lowering not in LOWERINGS:
        raise UnexecutableStrategy(
            f"node {node.name} ({node.op}): strategy {strategy} names lowering {strategy.lowering!r}, which "
            f"mplan.passes.local_ops does not implement (it has {', '.join(sorted(LOWERINGS))})")
    return strategy.lowering


def normalized_kwargs(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of an ATen call by name, defaults filled in (from the op's schema)."""
    schema = target._schema
    bound = dict(kwargs)
    for value, argument in zip(args, schema.arguments):
        bound[argument.name] = value
    for argument in schema.arguments:
        if argument.name not in bound and argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


class VocabParallelEmbedding(nn.Module):
    """embedding(weight[V/n, H], ids) with this rank's vocabulary slice; zeros for foreign ids."""

    def __init__(self, *, axis: AxisGroup, padding_idx: int, node: str) -> None:
        super().__init__()
        self.axis, self.padding_idx, self.node = axis, padding_idx, node

    def forward(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = weight.shape[0]
        start = self.axis.rank * rows
        local = ids - start
        foreign = (local < 0) | (local >= rows)
        local = local.masked_fill(foreign, 0)
        pad = self.padding_idx - start if 0 <= self.padding_idx - start < rows else -1
        out = torch.ops.aten.embedding.default(weight, local, pad)
        return out.masked_fill(foreign.unsqueeze(-1), 0)

    def extra_repr(self) -> str:
        return f"node={self.node}, tp={self.axis.size}"


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str, axis: AxisGroup) -> torch.Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        width = z.shape[1]
        row_max = all_reduce_no_grad(z.max(dim=1).values, axis, torch.distributed.ReduceOp.MAX)
        exp = (z - row_max[:, None]).exp()
        sum_exp = all_reduce_no_grad(exp.sum(dim=1), axis)
        local = target - axis.rank * width
        owned = (local >= 0) & (local < width)
        safe = local.clamp(0, width - 1)
        target_logit = (z.gather(1, safe[:, None]).squeeze(1) - row_max) * owned
        target_logit = all_reduce_no_grad(target_logit, axis)
        valid = (target != ignore_index).to(z.dtype)
        losses = (sum_exp.log() - target_logit) * valid
        count = valid.sum()
        ctx.save_for_backward(exp, sum_exp, safe, owned, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        out = {"none": losses, "sum": losses.sum(), "mean": losses.sum() / count}[reduction]
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, safe, owned, valid, count = ctx.saved_tensors
        probs = exp / sum_exp[:, None]
        probs.scatter_add_(1, safe[:, None], -owned.to(probs.dtype)[:, None])
        grad = grad.to(probs.dtype)
        scale = grad[:, None] if ctx.reduction == "none" else (grad / count if ctx.reduction == "mean" else grad)
        rows = valid[:, None] * scale
        return (probs * rows).to(ctx.dtype), None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """cross_entropy(logits[N, V/n], target[N]) with logits sharded by vocabulary (Megatron).

    `fused` (set by `fuse_kernels` for the mean, the reduction it computes) runs
    `mplan.kernels.vocab_parallel_cross_entropy`, which keeps no fp32 copy of the logits: the
    plain path saves their fp32 exponentials, 2 GiB a micro-batch of 8k tokens at a 128k
    vocabulary over tp=2."""

    def __init__(self, *, axis: AxisGroup, ignore_index: int, reduction: str, node: str) -> None:
        super().__init__()
        self.axis, self.ignore_index, self.reduction, self.node = axis, ignore_index, reduction, node
        self.fused = False

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from mplan.kernels import vocab_parallel_cross_entropy  # loads Triton: only fused programs pay

            return vocab_parallel_cross_entropy(logits, target, self.axis.rank * logits.shape[1],
                                                group=self.axis.require_group("vocabulary-parallel loss"),
                                                ignore_index=self.ignore_index)
        return _VocabParallelCE.apply(logits, target, self.ignore_index, self.reduction, self.axis)

    def extra_repr(self) -> str:
        return f"node={self.node}, reduction={self.reduction}, tp={self.axis.size}, fused={self.fused}"


class VocabParallelHeadLoss(nn.Module):
    """The column-parallel output head and its vocabulary-parallel mean cross-entropy as one
    chunked op: `forward(x [..., H], weight [V/n, H], target [...], bias [V/n] | None)` is
    `VocabParallelCrossEntropy(mean)(linear(x, weight, bias).view(-1, V/n)[.to(float32)], target)`
    (`upcast`: with the cast, an fp32 loss), computed by `mplan.kernels.head_loss.
    vocab_parallel_linear_cross_entropy` `chunk_rows` rows at a time (None: its default), so
    the local logits [rows, V/n] never exist. `fuse_kernels` puts it in place of that chain.

    weight (and bias) are this rank's vocabulary rows [rank * V/n, (rank + 1) * V/n), as the
    column split stores them; their gradients are complete. x's gradient is this rank's PARTIAL
    addend, exactly the one the local `aten.linear` it replaces gave: the `Redistribute` that
    `insert_collectives` emits before a column-parallel linear (x replicated, gradient P) sums
    it over the TP group in backward (all-reduce; under sequence parallelism, x all-gathered
    forward, reduce-scatter backward), so the fused op needs no collective for it."""

    def __init__(self, *, axis: AxisGroup, ignore_index: int, upcast: bool, node: str,
                 chunk_rows: int | None = None) -> None:
        super().__init__()
        self.axis, self.ignore_index, self.upcast, self.node = axis, ignore_index, upcast, node
        self.chunk_rows = chunk_rows

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        # loads Triton: only fused programs pay
        from mplan.kernels.head_loss import vocab_parallel_linear_cross_entropy

        return vocab_parallel_linear_cross_entropy(
            x, weight, target, self.axis.rank * weight.shape[0], bias=bias,
            group=self.axis.require_group("vocabulary-parallel head loss"), ignore_index=self.ignore_index,
            chunk_rows=self.chunk_rows, upcast=self.upcast)

    def extra_repr(self) -> str:
        return (f"node={self.node}, tp={self.axis.size}, upcast={self.upcast}"
                + (f", chunk_rows={self.chunk_rows}" if self.chunk_rows else ""))


class BatchShardedCrossEntropy(nn.Module):
    """cross_entropy on this rank's rows; a partial value whose sum over ranks is the loss."""

    def __init__(self, *, axis: AxisGroup, ignore_index: int, reduction: str,
                 label_smoothing: float, node: str) -> None:
        super().__init__()
        self.axis, self.ignore_index, self.reduction = axis, ignore_index, reduction
        self.label_smoothing, self.node = label_smoothing, node

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = torch.ops.aten.cross_entropy_loss.default(
            logits, target, None, 2, self.ignore_index, self.label_smoothing)
        if self.reduction == "sum":
            return total
        # the mean is over the counted rows of every rank, not of this one
        count = all_reduce_no_grad((target != self.ignore_index).sum().to(total.dtype), self.axis)
        return total / count

    def extra_repr(self) -> str:
        return f"node={self.node}, reduction={self.reduction}, tp={self.axis.size}"


def loss_module(rule: str, node: OpNode, call: dict[str, Any], axis: AxisGroup) -> nn.Module:
    """The module that runs a vocabulary- or batch-sharded cross-entropy node."""
    reduction = _REDUCTIONS[int(call.get("reduction", 1))]
    ignore_index = int(call.get("ignore_index", -100))
    smoothing = float(call.get("label_smoothing", 0.0))
    if call.get("weight") is not None:
        raise UnexecutableStrategy(f"node {node.name}: class weights in a sharded cross-entropy")
    if rule == "vocab_loss":
        if smoothing:
            raise UnexecutableStrategy(f"node {node.name}: label smoothing in a vocabulary-parallel loss")
        return VocabParallelCrossEntropy(axis=axis, ignore_index=ignore_index, reduction=reduction,
                                         node=node.name)
    if reduction == "none":
        raise UnexecutableStrategy(f"node {node.name}: per-row losses (reduction='none') are "
                                   f"sharded by rows, not the partial sum the batch strategy declares")
    return BatchShardedCrossEntropy(axis=axis, ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=smoothing, node=node.name)


class KVReplicatedAttention(nn.Module):
    """SDPA on this rank's query heads and the key/value heads they read (from whole k and v)."""

    def __init__(self, *, axis: AxisGroup, query_heads: int, kv_heads: int,
                 options: dict[str, Any], node: str) -> None:
        super().__init__()
        local, group = query_heads // axis.size, query_heads // kv_heads
        self.start = axis.rank * local // group  # first kv head this rank's query heads use
        self.count = max(1, local // group)
        self.gqa = local != self.count
        self.axis, self.options, self.node = axis, options, node

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        k, v = k.narrow(1, self.start, self.count), v.narrow(1, self.start, self.count)
        # a mask broadcasts over heads (the strategy admits no other), so it applies unchanged
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, mask, **self.options,
                                                                   enable_gqa=self.gqa)

    def extra_repr(self) -> str:
        return f"node={self.node}, kv heads [{self.start}, {self.start + self.count}), tp={self.axis.size}"


def attention_module(node: OpNode, call: dict[str, Any], axis: AxisGroup) -> nn.Module:
    options = {key: call[key] for key in ("dropout_p", "is_causal", "scale") if key in call}
    return KVReplicatedAttention(axis=axis, query_heads=node.input_metas[0].shape[1],
                                 kv_heads=node.input_metas[1].shape[1], options=options, node=node.name)


def embedding_module(node: OpNode, call: dict[str, Any], axis: AxisGroup) -> nn.Module:
    if call.get("scale_grad_by_freq") or call.get("sparse"):
        raise UnexecutableStrategy(f"node {node.name}: scale_grad_by_freq/sparse embedding under "
                                   f"a vocabulary-parallel strategy")
    return VocabParallelEmbedding(axis=axis, padding_idx=int(call.get("padding_idx", -1)), node=node.name)
