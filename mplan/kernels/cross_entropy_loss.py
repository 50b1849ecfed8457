"""Softmax cross-entropy over a large vocabulary, whole or sharded over the vocabulary (TP).

    cross_entropy(logits [rows, vocab], labels [rows], ignore_index=-100) -> mean loss
    vocab_parallel_cross_entropy(local_logits [rows, vocab/tp], labels [rows], vocab_start,
                                 reductions) -> the same mean loss, on every rank of the group

Labels are global token ids; rows whose label is `ignore_index` count neither in the sum
nor in the mean (as `F.cross_entropy`). The loss has the logits' dtype; arithmetic is fp32
(float64 for float64 logits, which always take the PyTorch path).

Memory: logits are never converted to fp32 as a whole. The Triton path keeps one row block
in registers at a time (online max/sum-exp over vocabulary blocks of a row); the PyTorch path
for the sharded op walks rows in chunks of at most `TORCH_CHUNK_ELEMENTS`. What is saved for
backward is the logits (already alive) and one fp32 log-sum-exp per row.

Sharded math (Megatron-LM's vocab-parallel cross-entropy, with the max folded into one pass):
    per rank, one pass:   m_r = max_j x_j,  e_r = sum_j exp(x_j - m_r),  t_r = x_label if local else 0
    across the group:     M = allreduce_max(m_r);  [E, T] = allreduce_sum([e_r exp(m_r - M), t_r])
    per row:              lse = M + log E,  loss_row = lse - T
    backward (local):     d x_j = (exp(x_j - lse) - [j == label]) * d_loss / num_valid_rows
The backward needs no communication: every rank holds the global lse. The unsharded op is the
same with one shard and identity reductions.

Invariants: `reductions` must return the group-wide max/sum of a per-rank tensor (in place or
not); every rank must call with the same rows and labels. CPU tensors without the interpreter
run `F.cross_entropy` (unsharded) or the chunked PyTorch local math (sharded).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mplan.kernels.dispatch import configs, tl, triton, use_triton

IGNORE_INDEX = -100
"""`F.cross_entropy`'s default ignore_index (Hugging Face and Megatron pad labels with it)."""

TORCH_CHUNK_ELEMENTS = 1 << 24
"""Logit elements converted to fp32 at once by the PyTorch local math (64 MiB of fp32)."""

# One program per row, looping over vocabulary blocks; bigger blocks keep more bytes in flight.
_BLOCKS = configs(
    [triton.Config({"BLOCK_V": v}, num_warps=w) for v, w in ((4096, 8), (8192, 8), (8192, 16), (16384, 16))],
    triton.Config({"BLOCK_V": 32}, num_warps=1),
)


@triton.autotune(configs=_BLOCKS, key=["n_cols"])
@triton.jit
def _stats_kernel(x_ptr, labels_ptr, max_ptr, sumexp_ptr, target_ptr, n_cols, row_stride, vocab_start,
                  ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * row_stride
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    label = tl.load(labels_ptr + row)
    local = label - vocab_start
    mine = (label != ignore_index) & (local >= 0) & (local < n_cols)
    target = tl.load(row_ptr + local, mask=mine, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_ptr + row, tl.where(mine, target, 0.0))


@triton.autotune(configs=_BLOCKS, key=["n_cols"])
@triton.jit
def _grad_kernel(x_ptr, labels_ptr, lse_ptr, scale_ptr, dx_ptr, n_cols, row_stride, vocab_start,
                 ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(label != ignore_index, tl.load(scale_ptr), 0.0)
    local = label - vocab_start
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(dx_ptr + row * n_cols + cols, grad.to(dx_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class VocabReductions:
    """How the ranks sharing the vocabulary combine per-row statistics ([rows] fp32 tensors)."""

    all_reduce_max: Callable[[torch.Tensor], torch.Tensor]
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def identity(cls) -> VocabReductions:
        """One shard holding the whole vocabulary."""
        return cls(all_reduce_max=_same, all_reduce_sum=_same)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> VocabReductions:
        """torch.distributed all-reduces over `group` (None: the default group)."""
        return cls(all_reduce_max=_all_reduce(dist.ReduceOp.MAX, group),
                   all_reduce_sum=_all_reduce(dist.ReduceOp.SUM, group))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _all_reduce(op: Any, group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=op, group=group)  # in place: the tensors are our own temporaries
        return tensor

    return reduce


def _local_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                 ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the local shard: (max, sum exp(x - max), the label's logit or 0), in fp32
    (float64 for float64 logits)."""
    n_rows, n_cols = logits.shape
    stats = torch.empty(3, n_rows, dtype=_accumulation_dtype(logits), device=logits.device)
    if use_triton(logits):
        _stats_kernel[(n_rows,)](logits, labels, stats[0], stats[1], stats[2], n_cols, logits.stride(0),
                                 vocab_start, ignore_index)
        return stats[0], stats[1], stats[2]
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_cols)
    for rows in _row_chunks(n_rows, n_cols):
        x = logits[rows].to(stats.dtype)
        stats[0, rows] = x.max(-1).values
        stats[1, rows] = (x - stats[0, rows, None]).exp().sum(-1)
        picked = x.gather(1, local[rows].clamp(0, n_cols - 1)[:, None])[:, 0]
        stats[2, rows] = torch.where(mine[rows], picked, 0.0)
    return stats[0], stats[1], stats[2]


def _local_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                vocab_start: int, ignore_index: int) -> torch.Tensor:
    """d loss / d local logits = (softmax - one_hot) * scale on rows that count, 0 elsewhere."""
    n_rows, n_cols = logits.shape
    grad = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if use_triton(logits):
        _grad_kernel[(n_rows,)](logits, labels, lse, scale, grad, n_cols, logits.stride(0), vocab_start,
                                ignore_index)
        return grad
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_cols)
    row_scale = torch.where(labels != ignore_index, scale, 0.0)
    for rows in _row_chunks(n_rows, n_cols):
        probs = (logits[rows].to(lse.dtype) - lse[rows, None]).exp()
        hit = mine[rows]
        probs[hit.nonzero()[:, 0], local[rows][hit]] -= 1.0
        grad[rows] = (probs * row_scale[rows, None]).to(grad.dtype)
    return grad


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _row_chunks(n_rows: int, n_cols: int) -> list[slice]:
    step = max(1, TORCH_CHUNK_ELEMENTS // max(n_cols, 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Forward: local stats, two group reductions, mean loss. Backward: local, no communication."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int,
                reductions: VocabReductions) -> torch.Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()
        local_max, local_sumexp, local_target = _local_stats(logits, labels, vocab_start, ignore_index)
        global_max = reductions.all_reduce_max(local_max.clone())
        sums = reductions.all_reduce_sum(torch.stack([local_sumexp * (local_max - global_max).exp(), local_target]))
        lse = global_max + sums[0].log()
        valid = labels != ignore_index
        num_valid = valid.sum()
        loss = torch.where(valid, lse - sums[1], 0.0).sum() / num_valid
        ctx.save_for_backward(logits, labels, lse, num_valid)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, d_loss: torch.Tensor) -> tuple[Any, ...]:
        logits, labels, lse, num_valid = ctx.saved_tensors
        scale = (d_loss.to(lse.dtype) / num_valid).reshape(1)
        grad = _local_grad(logits, labels, lse, scale, ctx.vocab_start, ctx.ignore_index)
        return grad, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of [rows, vocab] logits; Triton where `use_triton`, else `F.cross_entropy`."""
    if use_triton(logits) and logits.dim() == 2:
        return VocabParallelCrossEntropyFunction.apply(logits, labels, 0, ignore_index, VocabReductions.identity())
    return cross_entropy_reference(logits, labels, ignore_index)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return F.cross_entropy(logits, labels, ignore_index=ignore_index)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 reductions: VocabReductions | None = None, *,
                                 group: dist.ProcessGroup | None = None,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy when this rank holds vocabulary ids [vocab_start, vocab_start + local_logits.shape[1]).

    `reductions` defaults to all-reduces over `group`; the result is the same on every rank and
    gradients reach only the local logits."""
    if reductions is None:
        reductions = VocabReductions.from_group(group)
    return VocabParallelCrossEntropyFunction.apply(local_logits, labels, vocab_start, ignore_index, reductions)
