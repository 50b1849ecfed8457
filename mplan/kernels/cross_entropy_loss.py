"""Softmax cross-entropy over a large vocabulary, whole or sharded over the vocabulary (TP).

    cross_entropy(logits [rows, vocab], labels [rows], ignore_index=-100) -> mean loss
    vocab_parallel_cross_entropy(local_logits [rows, vocab/tp], labels [rows], vocab_start,
                                 reductions) -> the same mean loss, on every rank of the group

Labels are global token ids; rows whose label is `ignore_index` count neither in the sum
nor in the mean (as `F.cross_entropy`). The loss has the logits' dtype (fp32 under autocast);
arithmetic is fp32 (float64 for float64 logits, which always take the PyTorch path).

Memory: logits are never converted to fp32 as a whole. The Triton path holds at most CHUNK
vocabulary blocks of one row per program; the PyTorch path for the sharded op walks rows in
chunks of at most `TORCH_CHUNK_ELEMENTS`. What is saved for backward is the logits (already
alive), one fp32 log-sum-exp per row and the fp32 count of rows that count.

Kernels (why: the H200 measured a program-per-row loop over the vocabulary at 67% of copy
bandwidth on 4096 x 128256 bf16 logits: 4096 programs on 132 SMs, each waiting on a block's
loads, then on two reductions, then on the next block, plus a dozen tiny torch kernels after):
    block stats   one program per (row, CHUNK consecutive vocabulary blocks of BLOCK_V): max and
                  sum of exp over them, merged online (m' = max(m, block max),
                  s' = s exp(m - m') + sum exp(x - m')), in one read of the logits; each block's
                  loads are issued before the previous block's max and exp, and tens of
                  thousands of independent programs keep every SM's loads in flight ("split-K"
                  over the vocabulary). One partial per program: cdiv(vocab, BLOCK_V * CHUNK)
                  per row
    combine       one program per 16 rows: merges the partials' (max, sum-exp), gathers the
                  label's logit; unsharded, it also writes lse and each program's loss sum and
                  row count
    mean          one program: the mean loss from those partial sums, in the loss dtype (a
                  launch of its own, not an atomic add in the combine: the loss stays
                  deterministic)
    grad          one program per (row, block): (exp(x - lse) - [j == label]) * d_loss / count,
                  written once (zeros on rows whose label is ignored)
No load of logits waits on a label: a program's lifetime is one load latency, not two (so
ignored rows are read like the others).
So the unsharded forward is three launches and reads the logits once; the backward is one
launch that reads them once and writes the gradient once.

The CHUNK loop and exp2 (why: with one block per program, CHUNK=1, the H200 measured the
forward at 82%, 79% and 84% of copy bandwidth (4.22 TB/s, the logits counted once) on bf16
logits of 4096 x 128256, 16384 x 32000 and 16384 x 128256, the backward at 98-100%: each
program issued one load, then waited on it and computed with nothing in flight). exp(x - m)
is computed as 2^(x log2(e) - m log2(e)): one FMA and one MUFU.EX2 per logit, where `tl.exp`
compiles to a subtract, a multiply and a denormal fix-up around the EX2 (sm_90 SASS: about 5
instructions per logit instead of 9). The price is rounding m log2(e): about an ulp of the
max in the log-sum-exp, the rounding lse = m + log(s) has in fp32 anyway (measured: lse within
1e-7, relative, of float64 on bf16 logits, -inf runs included); flushing terms below 2^-126
of the max changes no sum (the max's own term is 1).
Timed on the H200 (profiler kernel time, bf16, a scratch script, not yet
benchmarks/kernel_peers/fused.py), block stats kernel, best configuration at 16384 x 128256, as a
share of copy bandwidth: CHUNK=1 with exp 86%, the CHUNK loop with exp 90%, CHUNK=1 with
exp2 98%, the CHUNK loop with exp2 109% (a read-only kernel outruns a copy). Whole forward,
three launches, autotuned, before -> after:
    4096 x 128256    0.300 -> 0.240 ms   83% -> 104%
    16384 x 32000    0.298 -> 0.241 ms   83% -> 103%
    16384 x 128256   1.172 -> 0.925 ms   85% -> 108%
    4096 x 50304     0.126 -> 0.100 ms   77% -> 98%
The backward (its own kernel, unchanged) measured the same within 4%. The tuner picked
BLOCK_V=2048, CHUNK=4 with 1 or 2 warps everywhere: fewer warps, more logits per thread.

Sharded math (Megatron-LM's vocab-parallel cross-entropy, with the max folded into one pass):
    per rank, one pass:   m_r = max_j x_j,  e_r = sum_j exp(x_j - m_r),  t_r = x_label if local else 0
    across the group:     M = allreduce_max(m_r);  [E, T] = allreduce_sum([e_r exp(m_r - M), t_r])
    per row:              lse = M + log E,  loss_row = lse - T
    backward (local):     d x_j = (exp(x_j - lse) - [j == label]) * d_loss / num_valid_rows
A shard whose logits of a row are all -inf sends m_r = -inf and e_r = 0, which weigh nothing
(M is shifted to 0 where every shard's is -inf: no NaN), so no finite logit of another shard
underflows against a stand-in max. The backward needs no communication: every rank holds the
global lse. The unsharded op is the same with one shard and identity reductions (which the
Triton path finishes in its kernels).

Invariants: `reductions` must return the group-wide max/sum of a per-rank tensor (in place or
not); every rank must call with the same rows and labels. CPU tensors without the interpreter
run `F.cross_entropy` (unsharded) or the chunked PyTorch local math (sharded). Under autocast
the loss is fp32, as autocast runs `cross_entropy` (asked of the reference, see dispatch.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mplan.kernels.dispatch import (
    INTERPRET,
    autocast_result_dtype,
    configs,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

IGNORE_INDEX = -100
"""`F.cross_entropy`'s default ignore_index (Hugging Face and Megatron pad labels with it)."""

TORCH_CHUNK_ELEMENTS = 1 << 24
"""Logit elements converted to fp32 at once by the PyTorch local math (64 MiB of fp32)."""

# The gradient: one vocabulary block per program, 2-32 KB of bf16 each; the autotuner weighs
# fewer, larger programs (fewer partials, longer reductions) against more, smaller ones.
_BLOCK_WARPS = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
_BLOCKS = configs([triton.Config({"BLOCK_V": v}, num_warps=w) for v, w in _BLOCK_WARPS],
                  triton.Config({"BLOCK_V": 32}, num_warps=1))
# The block stats: those blocks one per program (CHUNK=1, the design before the loop), and
# CHUNK consecutive blocks per program: the five fastest, over four shapes, of 19 such
# configurations timed on the H200 (module docstring). The interpreter's CHUNK=2 runs the
# loop in tests.
_STATS = configs(
    [triton.Config({"BLOCK_V": v, "CHUNK": c}, num_warps=w)
     for v, c, w in [(v, 1, w) for v, w in _BLOCK_WARPS]
     + [(1024, 8, 1), (2048, 4, 1), (2048, 4, 2), (4096, 2, 4), (4096, 4, 4)]],
    triton.Config({"BLOCK_V": 32, "CHUNK": 2}, num_warps=1),
)
_MIN_PART_V = min(config.kwargs["BLOCK_V"] * config.kwargs["CHUNK"] for config in _STATS)
"""Vocabulary ids per partial in the finest configuration: the partials have room for the
most partials per row any configuration makes."""

_COMBINE_ROWS = 4 if INTERPRET else 16
"""Rows per combine program (not tuned: the combine moves well under 1% of the bytes)."""
_MEAN_BLOCK = 16 if INTERPRET else 1024
"""Partial sums the mean kernel adds per step (a few hundred at training shapes)."""


@triton.jit
def transformed_logits(z, logit_scale, softcap, CAPPED: tl.constexpr):
    """What a model does to its logits before the loss, in fp32: softcap * tanh(z * logit_scale /
    softcap) where CAPPED, else z * logit_scale. tanh(u) as 1 - 2 / (exp(2u) + 1) (exact at both
    ends: +-1 when exp overflows or vanishes): triton.language has no tanh on every version
    mplan runs on (Triton 3.6 lacks it)."""
    if CAPPED:
        u = z * (logit_scale / softcap)
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    return z * logit_scale


@triton.autotune(configs=_STATS, key=["n_cols"])
@triton.jit
def _block_stats_kernel(x_ptr, max_ptr, sumexp_ptr, n_parts_ptr, n_cols, row_stride, max_parts,
                        logit_scale, softcap, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                        TRANSFORMED: tl.constexpr = False, CAPPED: tl.constexpr = False):
    """One partial (max, sum of exp(x - max)) per CHUNK consecutive blocks of BLOCK_V of a row,
    merged online; the max is -inf (and the sum 0) where every logit of the partial is -inf.
    exp(x - max) is computed as 2^(x log2(e) - max log2(e)): one FMA and an ex2 per logit.
    TRANSFORMED: x holds the model's logits before its scale and cap (`transformed_logits`),
    applied on load, so the transformed logits are never written."""
    pid = tl.program_id(0)
    n_parts = tl.cdiv(n_cols, BLOCK_V * CHUNK)
    row = pid // n_parts
    part = pid % n_parts
    if pid == 0:  # how many partials each row has, for the combine kernel
        tl.store(n_parts_ptr, n_parts)
    x_row = x_ptr + row.to(tl.int64) * row_stride
    cols = part * (BLOCK_V * CHUNK) + tl.arange(0, BLOCK_V)
    x_next = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf"))
    log2e = 1.4426950408889634
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for i in tl.static_range(CHUNK):
        x = x_next.to(tl.float32)
        if TRANSFORMED:  # the padding stays -inf: a cap would map it to -softcap
            x = tl.where(cols < n_cols, transformed_logits(x, logit_scale, softcap, CAPPED), float("-inf"))
        if i + 1 < CHUNK:  # prefetch: the next block is in flight during this one's exp
            cols += BLOCK_V
            x_next = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new * log2e)  # only -inf so far: sum 0, no NaN
        s = s * tl.exp2(m * log2e - shift) + tl.sum(tl.exp2(x * log2e - shift), axis=0)
        m = m_new
    out = row.to(tl.int64) * max_parts + part
    tl.store(max_ptr + out, m)
    tl.store(sumexp_ptr + out, s)


@triton.jit
def _combine_kernel(max_ptr, sumexp_ptr, n_parts_ptr, x_ptr, labels_ptr, lse_ptr, loss_sum_ptr, count_ptr,
                    n_rows, n_cols, row_stride, max_parts, vocab_start, ignore_index, logit_scale, softcap,
                    FINALIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
                    TRANSFORMED: tl.constexpr = False, CAPPED: tl.constexpr = False):
    """FINALIZE (one shard): lse per row, and this program's loss sum and counted rows.
    Otherwise the local (max, sum-exp, label logit) per row, into lse_ptr's [3, n_rows]; the
    max is -inf where the shard's logits of the row all are, so it never outweighs the others."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = rows < n_rows
    slots = tl.arange(0, BLOCK_SLOTS)
    mask = in_rows[:, None] & (slots < tl.load(n_parts_ptr))[None, :]
    offs = rows.to(tl.int64)[:, None] * max_parts + slots[None, :]
    m = tl.load(max_ptr + offs, mask=mask, other=float("-inf"))
    row_max = tl.max(m, axis=1)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    sumexp = tl.sum(tl.load(sumexp_ptr + offs, mask=mask, other=0.0) * tl.exp(m - shift[:, None]), axis=1)
    labels = tl.load(labels_ptr + rows, mask=in_rows, other=ignore_index)
    local = labels - vocab_start
    counted = in_rows & (labels != ignore_index)
    mine = counted & (local >= 0) & (local < n_cols)
    target = tl.load(x_ptr + rows.to(tl.int64) * row_stride + local, mask=mine, other=0.0).to(tl.float32)
    if TRANSFORMED:  # 0 where not `mine` stays 0: both transforms fix it
        target = transformed_logits(target, logit_scale, softcap, CAPPED)
    if FINALIZE:
        lse = shift + tl.log(tl.where(in_rows, sumexp, 1.0))  # no log(0) past the last row
        tl.store(lse_ptr + rows, lse, mask=in_rows)
        tl.store(loss_sum_ptr + pid, tl.sum(tl.where(counted, lse - target, 0.0), axis=0))
        tl.store(count_ptr + pid, tl.sum(counted.to(tl.float32), axis=0))
    else:
        tl.store(lse_ptr + rows, row_max, mask=in_rows)
        tl.store(lse_ptr + n_rows + rows, sumexp, mask=in_rows)
        tl.store(lse_ptr + 2 * n_rows + rows, target, mask=in_rows)


@triton.jit
def _mean_kernel(loss_sum_ptr, count_ptr, n_parts, loss_ptr, total_count_ptr, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        parts = start + tl.arange(0, BLOCK)
        total += tl.load(loss_sum_ptr + parts, mask=parts < n_parts, other=0.0)
        count += tl.load(count_ptr + parts, mask=parts < n_parts, other=0.0)
    num_counted = tl.sum(count, axis=0)
    tl.store(loss_ptr, (tl.sum(total, axis=0) / num_counted).to(loss_ptr.dtype.element_ty))
    tl.store(total_count_ptr, num_counted)


@triton.autotune(configs=_BLOCKS, key=["n_cols"])
@triton.jit
def _grad_kernel(x_ptr, labels_ptr, lse_ptr, d_loss_ptr, count_ptr, dx_ptr, n_cols, row_stride, vocab_start,
                 ignore_index, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    row = pid // n_blocks
    cols = (pid % n_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_cols = cols < n_cols
    label = tl.load(labels_ptr + row)
    counted = label != ignore_index
    scale = tl.load(d_loss_ptr).to(tl.float32) / tl.load(count_ptr)
    lse = tl.load(lse_ptr + row)
    x = tl.load(x_ptr + row.to(tl.int64) * row_stride + cols, mask=in_cols, other=0.0).to(tl.float32)
    grad = (tl.exp(x - lse) - tl.where(cols == label - vocab_start, 1.0, 0.0)) * scale
    tl.store(dx_ptr + row.to(tl.int64) * n_cols + cols, tl.where(counted, grad, 0.0).to(dx_ptr.dtype.element_ty),
             mask=in_cols)


@dataclass(frozen=True, slots=True)
class VocabReductions:
    """How the ranks sharing the vocabulary combine per-row statistics ([rows] fp32 tensors)."""

    all_reduce_max: Callable[[torch.Tensor], torch.Tensor]
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def identity(cls) -> VocabReductions:
        """One shard holding the whole vocabulary."""
        return cls(all_reduce_max=_same, all_reduce_sum=_same)

    def is_identity(self) -> bool:
        """One shard: the reductions change nothing (the Triton path then finishes in-kernel)."""
        return self.all_reduce_max is _same and self.all_reduce_sum is _same

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


@dataclass(frozen=True, slots=True)
class _BlockStats:
    """Per (row, partial) max and sum of exp, [rows, max_parts] fp32, and the number of partials
    per row the kernel wrote (an int32 on the device: the autotuner picked BLOCK_V and CHUNK)."""

    max: torch.Tensor
    sumexp: torch.Tensor
    n_parts: torch.Tensor


def _block_stats(logits: torch.Tensor, scratch: torch.Tensor | None = None,
                 transform: tuple[float, float | None] | None = None) -> _BlockStats:
    """Per row, partial (max, sum-exp) over blocks of columns. `scratch`: a contiguous buffer on
    the same device whose bytes the partials may take if they fit (the fused head + loss lends
    the rows of d_x it writes only after the partials are read), else they get their own.
    `transform`: (logit_scale, softcap or None) applied to the logits on load (`transformed_logits`)."""
    n_rows, n_cols = logits.shape
    max_parts = triton.cdiv(n_cols, _MIN_PART_V)
    nbytes = 2 * n_rows * max_parts * 4
    if (scratch is not None and scratch.is_contiguous() and scratch.device == logits.device
            and scratch.numel() * scratch.element_size() >= nbytes and scratch.data_ptr() % 16 == 0):
        partial = scratch.view(-1).view(torch.uint8)[:nbytes].view(torch.float32).view(2, n_rows, max_parts)
    else:
        partial = torch.empty(2, n_rows, max_parts, dtype=torch.float32, device=logits.device)
    n_parts = torch.empty(1, dtype=torch.int32, device=logits.device)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (n_rows * triton.cdiv(n_cols, meta["BLOCK_V"] * meta["CHUNK"]),)

    scale, cap = transform or (1.0, None)
    _block_stats_kernel[grid](logits, partial[0], partial[1], n_parts, n_cols, logits.stride(0), max_parts,
                              float(scale), float(cap or 1.0), TRANSFORMED=transform is not None,
                              CAPPED=cap is not None)
    return _BlockStats(max=partial[0], sumexp=partial[1], n_parts=n_parts)


def combine_programs(n_rows: int) -> int:
    """Loss partial sums the finalizing combine writes for `n_rows` rows (one per program)."""
    return triton.cdiv(n_rows, _COMBINE_ROWS)


def _combine(logits: torch.Tensor, labels: torch.Tensor, stats: _BlockStats, vocab_start: int, ignore_index: int,
             *, finalize: bool, loss_sum: torch.Tensor | None = None,
             transform: tuple[float, float | None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """finalize: (lse [rows], loss sums [programs], counted rows [programs]), the loss sums
    written into `loss_sum` when given (`combine_programs(rows)` fp32 slots: a chunked caller
    sums every chunk's partials once, at the end); else: (local max, local sum-exp, local label
    logit), each [rows]."""
    n_rows, n_cols = logits.shape
    programs = combine_programs(n_rows)
    out = torch.empty(n_rows if finalize else 3 * n_rows, dtype=torch.float32, device=logits.device)
    if loss_sum is None:
        loss_sum = torch.empty(programs if finalize else 1, dtype=torch.float32, device=logits.device)
    count = torch.empty(loss_sum.shape, dtype=torch.float32, device=logits.device)
    max_parts = stats.max.shape[1]
    scale, cap = transform or (1.0, None)
    _combine_kernel[(programs,)](stats.max, stats.sumexp, stats.n_parts, logits, labels, out, loss_sum, count,
                                 n_rows, n_cols, logits.stride(0), max_parts, vocab_start, ignore_index,
                                 float(scale), float(cap or 1.0), FINALIZE=finalize, BLOCK_ROWS=_COMBINE_ROWS,
                                 BLOCK_SLOTS=next_power_of_2(max_parts), TRANSFORMED=transform is not None,
                                 CAPPED=cap is not None)
    if finalize:
        return out, loss_sum, count
    local = out.view(3, n_rows)
    return local[0], local[1], local[2]


def _mean(loss_sum: torch.Tensor, count: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss in `dtype`, total counted rows in fp32), both 0-dim."""
    loss = torch.empty((), dtype=dtype, device=loss_sum.device)
    total = torch.empty((), dtype=torch.float32, device=loss_sum.device)
    _mean_kernel[(1,)](loss_sum, count, loss_sum.numel(), loss, total, BLOCK=_MEAN_BLOCK)
    return loss, total


def _torch_local_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                       ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the local shard: (max, sum exp(x - max), the label's logit or 0), in fp32
    (float64 for float64 logits); a row of -inf logits has max -inf and sum 0."""
    n_rows, n_cols = logits.shape
    stats = torch.empty(3, n_rows, dtype=_accumulation_dtype(logits), device=logits.device)
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_cols)
    for rows in _row_chunks(n_rows, n_cols):
        x = logits[rows].to(stats.dtype)
        stats[0, rows] = x.max(-1).values
        stats[1, rows] = (x - _finite(stats[0, rows, None])).exp().sum(-1)
        picked = x.gather(1, local[rows].clamp(0, n_cols - 1)[:, None])[:, 0]
        stats[2, rows] = torch.where(mine[rows], picked, 0.0)
    return stats[0], stats[1], stats[2]


def _local_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, d_loss: torch.Tensor,
                count: torch.Tensor, vocab_start: int, ignore_index: int) -> torch.Tensor:
    """d loss / d local logits = (softmax - one_hot) * d_loss / count on rows that count, 0 elsewhere."""
    n_rows, n_cols = logits.shape
    grad = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if use_triton(logits):
        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (n_rows * triton.cdiv(n_cols, meta["BLOCK_V"]),)

        _grad_kernel[grid](logits, labels, lse, d_loss, count, grad, n_cols, logits.stride(0), vocab_start,
                           ignore_index)
        return grad
    local = labels - vocab_start
    mine = (labels != ignore_index) & (local >= 0) & (local < n_cols)
    row_scale = torch.where(labels != ignore_index, d_loss.to(lse.dtype) / count, 0.0)
    for rows in _row_chunks(n_rows, n_cols):
        probs = (logits[rows].to(lse.dtype) - lse[rows, None]).exp()
        hit = mine[rows]
        probs[hit.nonzero()[:, 0], local[rows][hit]] -= 1.0
        grad[rows] = (probs * row_scale[rows, None]).to(grad.dtype)
    return grad


def _finite(row_max: torch.Tensor) -> torch.Tensor:
    """The shift for exp(x - shift): the max, or 0 where it is -inf (every exp is then 0, not NaN)."""
    return torch.where(row_max == float("-inf"), 0.0, row_max)


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _row_chunks(n_rows: int, n_cols: int) -> list[slice]:
    step = max(1, TORCH_CHUNK_ELEMENTS // max(n_cols, 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    return F.cross_entropy(torch.zeros(1, 2, dtype=dtypes[0], device=device), torch.zeros(1, dtype=torch.long,
                                                                                          device=device))


def reduced_row_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int,
                       reductions: VocabReductions) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp per row, loss per row, 0 where the label is ignored) of this rank's logits
    for vocabulary ids [vocab_start, ...): local statistics (Triton or PyTorch), then the group's
    max and one sum of [rescaled sum-exp, target logit] (`reductions`)."""
    if use_triton(logits):
        local = _combine(logits, labels, _block_stats(logits), vocab_start, ignore_index, finalize=False)
    else:
        local = _torch_local_stats(logits, labels, vocab_start, ignore_index)
    local_max, local_sumexp, local_target = local
    global_max = _finite(reductions.all_reduce_max(local_max.clone()))
    sums = reductions.all_reduce_sum(torch.stack([local_sumexp * (local_max - global_max).exp(), local_target]))
    lse = global_max + sums[0].log()
    return lse, torch.where(labels != ignore_index, lse - sums[1], 0.0)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Forward: local stats, two group reductions, mean loss. Backward: local, no communication."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int,
                reductions: VocabReductions, upcast: bool = False) -> torch.Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()
        out_dtype = torch.float32 if upcast else autocast_result_dtype(_probe, logits, (logits.dtype,)) or logits.dtype
        triton_path = use_triton(logits)
        if triton_path and reductions.is_identity():
            stats = _block_stats(logits)
            lse, loss_sum, count = _combine(logits, labels, stats, vocab_start, ignore_index, finalize=True)
            loss, count = _mean(loss_sum, count, out_dtype)
        else:
            lse, row_loss = reduced_row_losses(logits, labels, vocab_start, ignore_index, reductions)
            count = (labels != ignore_index).sum().to(lse.dtype)
            loss = (row_loss.sum() / count).to(out_dtype)
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        return loss

    @staticmethod
    def backward(ctx: Any, d_loss: torch.Tensor) -> tuple[Any, ...]:
        logits, labels, lse, count = ctx.saved_tensors
        grad = _local_grad(logits, labels, lse, d_loss.contiguous(), count, ctx.vocab_start, ctx.ignore_index)
        return grad, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  upcast: bool = False) -> torch.Tensor:
    """Mean cross-entropy of [rows, vocab] logits; Triton where `use_triton`, else `F.cross_entropy`.
    `upcast`: the loss of `logits.float()` (Hugging Face's loss upcasts bf16 logits first), with
    the fp32 copy never made: the kernels compute in fp32 anyway and write the gradient in the
    logits' dtype, as the cast's backward would round it."""
    if use_triton(logits) and logits.dim() == 2:
        return VocabParallelCrossEntropyFunction.apply(logits, labels, 0, ignore_index, VocabReductions.identity(),
                                                       upcast)
    return cross_entropy_reference(logits, labels, ignore_index, upcast)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = IGNORE_INDEX, upcast: bool = False) -> torch.Tensor:
    return F.cross_entropy(logits.float() if upcast else logits, labels, ignore_index=ignore_index)


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
