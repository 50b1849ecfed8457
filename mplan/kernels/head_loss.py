"""The LM head's GEMM and its softmax cross-entropy as one op, in chunks of rows: the logits of
the whole batch never exist. Whole vocabulary, or sharded over it (TP).

    linear_cross_entropy(x [..., hidden], weight [vocab, hidden], labels [...], ignore_index=-100,
                         bias=None, *, chunk_rows=None, logit_scale=1.0, softcap=None) -> mean loss
    vocab_parallel_linear_cross_entropy(x [..., hidden], local_weight [vocab/tp, hidden], labels,
                                        vocab_start, reductions=None, *, bias=None, group=None,
                                        ignore_index=-100, chunk_rows=None) -> the same loss, on every rank
    linear_cross_entropy_reference(x, weight, labels, ignore_index, bias): the unfused ops
    linear_cross_entropy_bytes(rows, hidden, vocab, itemsize, chunk_rows=None, *, bias=False)
        -> LinearCrossEntropyBytes(saved, peak): what the op keeps alive, for the memory model

What: exactly `F.cross_entropy(F.linear(x, weight, bias).view(-1, vocab), labels.view(-1),
ignore_index=ignore_index)`, the mean over rows whose label is not `ignore_index`, in the dtype
F.cross_entropy gives (the logits' dtype; fp32 under autocast); labels are global token ids.
The logits may be scaled and soft-capped first, as models write them between the head and the
loss: z * logit_scale (Cohere's logit_scale, Granite's 1 / logits_scaling), then with `softcap`
c the Gemma-2 cap c * tanh(z / c); the gradient through the cap, d_z = d_y * logit_scale *
(1 - (y / c)^2), is taken from the capped logits y. Where the fused Triton kernels finish the
loss (one shard), they apply the transform in fp32 as they load z (`transformed_logits`): no
pass writes y, where three in-place ATen ops over each chunk's logits took 2.5 ms of a Gemma-2
step on the H200 (256000-token vocabulary, 4096 rows; peers_profile-2026-12-06.json); y then
carries no rounding to the logits' dtype, which the model's own ops apply (within bf16 rounding
of them). Elsewhere (CPU, float64, the vocabulary-parallel path) each chunk's logits are
transformed in their own dtype, as the model's ops round them, before the loss.

Why: unfused, a batch of 16384 tokens at a 128256-token vocabulary holds 4 GiB of bf16 logits
from the forward to the backward, and the backward adds their 4 GiB gradient (CUDA's
F.cross_entropy also saves a 4 GiB log-softmax): 11.7 GiB measured. Here at most one chunk of
logits (125 MiB at that vocabulary) exists at a time.

How: the whole backward runs in the forward, chunk by chunk (`chunk_rows` rows, the last chunk
shorter), as Liger Kernel's FusedLinearCrossEntropy does:
    count       rows whose label counts, over the whole batch: first, since it scales every gradient
    logits      x_c W^T (+ b), one GEMM in x's dtype (cuBLAS / CPU BLAS accumulate in fp32)
    loss        per row lse and the label's logit, fp32: cross_entropy_loss's block-stats and
                combine kernels (CUDA), or its chunked PyTorch local math (CPU, float64)
    d_logits    (softmax - onehot(label)) / count, 0 on ignored rows: on CUDA a kernel of this
                module writes it over the logits in place (one read, one write)
    d_x_c       d_logits W, written straight into its rows of d_x (torch.mm's out=)
    d_W, d_b    d_W += d_logits^T x_c (addmm in place), d_b += d_logits^T 1 (addmv in place); the
                first chunk writes them instead (mm, mv), so they are never zero-filled
The backward only multiplies d_x, d_W and d_b by grad_output (a scalar), in place, with a
streaming kernel that reads the scalar on the device and touches nothing when it is 1. A gradient
nobody asked for (an input that does not require grad, or grad mode off) is never computed:
no d_x GEMM for a frozen x, no d_W GEMM for a frozen head, no gradient at all under no_grad.

Precision: d_W and d_b accumulate in the parameter's dtype through addmm/addmv with beta=1,
which add the running sum in fp32 and round once per chunk: a bf16 d_W takes one bf16 rounding
per chunk (32 at 16384 rows of a 128k vocabulary) instead of the unfused op's one, each of
relative size 2^-9. An fp32 accumulator would cost vocab * hidden * 2 bytes more (1 GiB at
128k x 4096), twice the chunk's logits at every vocabulary size: the op chooses the memory, as
Liger does. Measured on the H200 (bf16, errors against float64 unfused ops, norm-relative),
8192 x 4096 x 128256 in 16 chunks: d_W 3.7e-3 and d_x 2.9e-3, where bf16 unfused ops give
4.7e-3 and 4.6e-3 (F.cross_entropy rounds its bf16 log-softmax before the gradient; here the
gradient is computed in fp32 from the logits and rounded once).

Chunk (`default_chunk_rows`): the largest power of two whose logits fit CHUNK_LOGIT_BYTES (256
MiB), but at least MIN_CHUNK_ROWS (2048); and no more rows than the head's width (a power of two,
at least WIDTH_FLOOR_ROWS, 1024), so a chunk's logits (rows x V) are never larger than the d_W
(V x H) the op keeps anyway. The width bound binds on narrow models with large vocabularies: a
Gemma-3 of hidden 1152 (262k vocabulary) held 1 GiB of logits in a 2048-row chunk and peaked 1.158x
Liger Kernel's memory on an H100 (peers_h100-2026-12-06-session14-b.json; Liger's chunks hold
about as many logits as x has elements); at 1024 rows it holds half that, for one more d_W pass
per 2048 rows (~0.4 ms there). Hidden and vocabulary do not enter the speed: each
chunk's fixed cost is reading and writing d_W (2 V H s bytes), against GEMM work of 6 rows V H
flops, so the share of that fixed cost is F s / (3 rows BW) on a device of F flop/s and BW
bytes/s, rows alone: about 5% at 2048 rows on the H200, 23% at 512. Measured forward + backward
on the H200, 16384 tokens, bf16, ms (benchmarks/results/head_loss_chunks_h200-2026-12-02.json):
    shape (hidden x vocab)   256    512   1024   2048   4096   unfused   Liger FLCE
    2048 x 32000            15.2   11.8   10.4    9.4    9.5     8.6       10.3
    2048 x 50304            22.6   17.6   15.8   14.6   14.8    13.7       15.9
    1536 x 151936           52.6   43.8   39.9   37.9   37.6    35.2       51.3
    4096 x 128256          114.6   90.5   83.8   80.3   82.2    79.0       91.0
The default (4096 rows at 32000, 2048 at the others) is within 2% of the fastest chunking at
every shape and 9-35% ahead of Liger's fused linear cross-entropy, whose chunks hold about as
many logits as x has elements (256 rows at 1536 x 151936): 250 MiB of bf16 logits at a 32000
vocabulary and 593 MiB at 151936, where Liger holds 63 and 74 MiB, and the unfused op 3 N V s
(2.9 and 13.9 GiB). A caller short of memory passes a smaller `chunk_rows` (at Liger's chunk, 256 rows at
151936, this op takes 52.6 ms against Liger's 51.3); the planner does so when the default chunk is
all that keeps the last pipeline stage over the device's memory (`Plan.head_loss_chunk_rows`).

Memory (`linear_cross_entropy_bytes`, bytes above the inputs; s = the GEMM dtype's itemsize,
N rows, H hidden, V vocabulary (the local shard's when sharded), c = min(N, chunk_rows)):
    saved = (N H + V H) s  [+ V s with a bias]      d_x and d_W (and d_b), from the forward to
                                                    the backward, in the dtype the inputs have
    peak  = saved + c (V s + stats(V))  [+ c s with a bias]
with stats(V) = 64 bytes a row (the per-row lse, max, sum and label logit) plus, unless they fit
in the chunk's rows of d_x (8 ceil(V / parts) <= H s, always at real shapes; d_x is written only
after they are read), the fp32 block-stats partials of cross_entropy_loss (8 ceil(V / parts),
`parts` vocabulary ids per partial: 2048 compiled); the bias term is the ones vector of d_b's
GEMV. Measured on the H200 within 0.1 MiB of the formula (1255.50 vs 1255.53 MiB at 16384 x 4096
x 128256, before the partials moved into d_x). The unfused
op's peak is about 3 N V s (logits, CUDA's saved log-softmax and the gradient), 11.7 GiB at
16384 x 128256 bf16, where this op's is saved (1.1 GiB at hidden 4096, gradients the unfused
backward makes too) + 125 MiB. The backward allocates nothing: it hands the gradients out as
new tensor objects on the op's buffers, so a leaf weight's AccumulateGrad adopts d_W as its .grad
rather than copying it (a rerun hands out fresh tensors). They are ctx attributes, not saved
tensors, so recomputation's checkpoint hooks never rerun the op; the op lets go of them in the
backward that does not keep the graph (as autograd frees saved tensors), so a loss tensor the
caller holds into the next step (`loss = model(...)` in a loop) keeps no d_x or d_W alive.

Autocast: where autocast is on for x's device, the op does what F.linear then F.cross_entropy
would: x, weight and bias are cast (autograd records the casts, so their gradients return in
the inputs' dtypes) to the dtype autocast gives F.linear there, the GEMMs run in it, and the
loss is computed in fp32 and returned in F.cross_entropy's autocast dtype (fp32). The cast
copies of x and the weight are the caller's memory, as unfused; `itemsize` above is the cast's.

Vocabulary-parallel (Megatron's vocab-parallel loss, each chunk fused with its GEMM): rank r
holds rows [vocab_start, vocab_start + V/tp) of the head weight (and bias) and the whole x
(replicated over the TP group). Per chunk: local logits, local (max, sum-exp, label logit) per
row, `reductions.all_reduce_max` of the max, then ONE `all_reduce_sum` of [sum-exp rescaled,
label logit] stacked (two collectives a chunk, of chunk_rows fp32 values each, as
`vocab_parallel_cross_entropy` batches them), the global lse, the loss and the local d_logits.
Gradients: d_local_weight and d_local_bias are this rank's complete gradients. d_x is PARTIAL:
the op returns d_logits_local @ local_weight, this rank's addend, and does NOT all-reduce it.
The caller must all-reduce d_x (SUM over the TP group) before it reaches whatever produced x,
the convention of a column-parallel linear in mplan: its strategy takes x replicated with a
partial gradient (`op_registry._linear`'s column split, input_grads P), and
`insert_collectives` puts a `Redistribute` before it whose backward turns that P into R with
the all-reduce (Megatron's copy_to_tensor_model_parallel_region). The loss is the same on
every rank.

Alignment: a vocabulary whose row of logits is not a multiple of 16 bytes (Granite's 49155
tokens, any odd size) gives every GEMM touching the logits a misaligned leading dimension, and
cuBLAS falls back to its slowest kernels (cutlass sm75 "align1" tiles: the three head GEMMs of a
12-layer Granite took 86 ms of a 218 ms step on the H200, benchmarks/results/peers_profile-2026-12-06.json).
Each chunk's logits are therefore a view of a buffer whose rows are padded to ROW_ALIGN_BYTES;
the padding is never read (every kernel here takes the row stride), and it costs at most 127
bytes a row of the chunk. Aligned rows did not suffice: on an H100 (2026-12-06, session 13,
benchmarks/results/peers_h100-2026-12-06-session13-a.json) the backward GEMMs still ran on
align1 tiles (62 ms of a 212 ms step), because the vocabulary is also a GEMM extent that is
contiguous in memory (d_x's reduction, d_W's rows), and an odd extent misaligns every row's last
vector. So each head GEMM is split at `aligned_vocab` (the largest multiple of 16 bytes of
columns): the aligned columns in one GEMM, the few left (at most 7 in bf16) in a tiny one.
d_x's two parts add with one rounding of the aligned part's sum (the small part first, then the
aligned one added in place by addmm, which sums in fp32); d_W's and the logits' parts are
disjoint rows and columns. Megatron pads the vocabulary itself (make_vocab_size_divisible_by),
which changes the model; this keeps the model's vocabulary and only aligns the work.

Invariants: x, weight (and bias) share a dtype outside autocast (as F.linear demands); x may
have any leading dims (they are flattened to rows; a non-contiguous x is copied once);
`reductions` must return group-wide max/sum of a per-rank tensor; every rank of a sharded
call passes the same rows, labels and chunk rows: the default chunk is derived from the local
vocabulary, so shards must be of equal width (mplan's strategies split evenly) or `chunk_rows`
given, else the ranks' collectives do not pair up. The first backward scales the gradients in
place and hands them out; a later one (retain_graph, or a zero-bubble schedule's W step, which
runs the node again) hands out the same values for the same incoming gradient, never scaling twice.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# cross_entropy_loss's kernels and local math, shared rather than copied (module docstring, How)
from mplan.kernels.cross_entropy_loss import (
    _MIN_PART_V,
    transformed_logits,
    IGNORE_INDEX,
    VocabReductions,
    _accumulation_dtype,
    _block_stats,
    _combine,
    combine_programs,
    reduced_row_losses,
)
from mplan.kernels.dispatch import CONSUMER_PROBES, INTERPRET, autocast_result_dtype, configs, tl, triton, use_triton

CHUNK_LOGIT_BYTES = 256 << 20
"""A chunk's logits fit this (256 MiB) unless MIN_CHUNK_ROWS rows are more (vocabularies over
64k tokens in bf16)."""
MIN_CHUNK_ROWS = 2048
"""Fewest rows of a default chunk on a head at least that wide: below it the per-chunk d_W read
and write costs over 5% of the GEMMs on the H200 (module docstring, Chunk)."""
WIDTH_FLOOR_ROWS = 1024
"""Fewest rows of a default chunk on a narrower head (module docstring, Chunk): about 10% of the
GEMMs in d_W traffic on the H200 (23% at 512)."""

# One vocabulary block of one row per program (the shape of cross_entropy_loss's gradient
# kernel, whose autotuner measured 98-100% of copy bandwidth on the H200). In place, so the
# autotuner restores the logits after timing each candidate.
_GRAD_BLOCKS = configs(
    [triton.Config({"BLOCK_V": v}, num_warps=w) for v, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8))],
    triton.Config({"BLOCK_V": 32}, num_warps=1),
)


@triton.autotune(configs=_GRAD_BLOCKS, key=["n_cols"], restore_value=["logits_ptr"])
@triton.jit
def _grad_in_place_kernel(logits_ptr, labels_ptr, lse_ptr, scale_ptr, n_cols, row_stride, vocab_start,
                          ignore_index, logit_scale, softcap, BLOCK_V: tl.constexpr,
                          TRANSFORMED: tl.constexpr = False, CAPPED: tl.constexpr = False, RAW: tl.constexpr = False):
    """One block of one row: logits <- (exp(logits - lse) - [col == label]) * scale, 0 on a row
    whose label is ignore_index; `TRANSFORMED` logits y = cap(z * logit_scale) also times dy/dz,
    logit_scale (1 - (y / softcap)^2) where `CAPPED`. `RAW`: the buffer holds z, and y is made
    from it on load (`transformed_logits`), else it holds y. Each element is read, then written,
    by the same program."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    row = pid // n_blocks
    cols = (pid % n_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_cols = cols < n_cols
    ptrs = logits_ptr + row.to(tl.int64) * row_stride + cols
    x = tl.load(ptrs, mask=in_cols, other=0.0).to(tl.float32)
    if RAW:
        x = transformed_logits(x, logit_scale, softcap, CAPPED)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    grad = (tl.exp(x - lse) - tl.where(cols == label - vocab_start, 1.0, 0.0)) * tl.load(scale_ptr)
    if TRANSFORMED:
        if CAPPED:
            t = x / softcap
            grad = grad * (logit_scale * (1.0 - t * t))
        else:
            grad = grad * logit_scale
    tl.store(ptrs, tl.where(label != ignore_index, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=in_cols)


_SCALE_BLOCK = 64 if INTERPRET else 4096


@triton.jit
def _scale_in_place_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """x <- x * scale, in fp32, rounded to x's dtype; nothing read or written where scale is 1
    (loss.backward() of the mean loss): the incoming gradient is a device scalar, and comparing it
    on the host would wait for the whole forward."""
    scale = tl.load(scale_ptr).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(scale != 1.0, n, 0)
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)


def _scale_in_place(grad: torch.Tensor, d_loss: torch.Tensor) -> None:
    """grad *= d_loss (a 0-dim tensor). On CUDA a streaming kernel at copy bandwidth that skips
    a gradient of 1: PyTorch's mul_ by a 0-dim device tensor takes its unvectorized path (1.6 ms
    for d_x and d_W at 16384 x 4096 x 128256 on the H200, about 1.5 TB/s,
    benchmarks/results/head_loss_chunks_h200-2026-12-02-session6-before-scale.json)."""
    if use_triton(grad) and grad.is_contiguous() and d_loss.device == grad.device:
        n = grad.numel()
        _scale_in_place_kernel[(triton.cdiv(n, _SCALE_BLOCK),)](grad, d_loss.reshape(1), n, BLOCK=_SCALE_BLOCK,
                                                               num_warps=8)
    else:
        grad.mul_(d_loss)


def default_chunk_rows(vocab: int, itemsize: int, hidden: int) -> int:
    """Rows per chunk when the caller names none: the largest power of two whose [rows, vocab]
    logits fit CHUNK_LOGIT_BYTES, at least MIN_CHUNK_ROWS, but no more than the largest power of
    two within the head's width `hidden`, at least WIDTH_FLOOR_ROWS (module docstring, Chunk)."""
    fitting = max(1, CHUNK_LOGIT_BYTES // max(1, vocab * itemsize))
    budget = max(MIN_CHUNK_ROWS, 1 << (fitting.bit_length() - 1))
    return min(budget, max(WIDTH_FLOOR_ROWS, 1 << (max(1, hidden).bit_length() - 1)))


@dataclass(frozen=True, slots=True)
class LinearCrossEntropyBytes:
    """Bytes the op keeps alive above its inputs (module docstring, Memory)."""

    saved: int
    """From the forward to the backward: d_x, d_W (and d_b) in the GEMM dtype."""
    peak: int
    """The most at once, during the forward: saved, one chunk's logits and its row statistics."""


def linear_cross_entropy_bytes(rows: int, hidden: int, vocab: int, itemsize: int, chunk_rows: int | None = None,
                               *, bias: bool = False) -> LinearCrossEntropyBytes:
    """What `linear_cross_entropy` on [rows, hidden] x and a [vocab, hidden] weight (the local
    shard's vocabulary when sharded) of `itemsize`-byte elements keeps alive, both inputs
    requiring grad; `chunk_rows` as passed to the op (None: the default)."""
    saved = (rows * hidden + vocab * hidden + (vocab if bias else 0)) * itemsize
    return LinearCrossEntropyBytes(saved=saved, peak=saved + chunk_bytes(rows, vocab, itemsize, chunk_rows, bias=bias,
                                                                         hidden=hidden))


def chunk_bytes(rows: int, vocab: int, itemsize: int, chunk_rows: int | None = None, *, bias: bool = False,
                hidden: int, x_grad: bool = True) -> int:
    """The forward's working memory beyond what the op saves: one chunk's logits (their gradient
    is written in place), its row statistics and, with a bias, its rows of the bias gradient.
    `hidden`: the head's width (the default chunk reads it); where x wants a gradient (`x_grad`)
    its rows of d_x hold the block-stats partials if they fit (module docstring, Memory), else
    they take memory of their own."""
    chunk = min(rows, chunk_rows or default_chunk_rows(vocab, itemsize, hidden))
    partials = 8 * -(-vocab // _MIN_PART_V)
    stats_per_row = 64 + (0 if x_grad and partials <= hidden * itemsize else partials)
    return chunk * (logits_row_bytes(vocab, itemsize) + stats_per_row + (itemsize if bias else 0))


@dataclass(frozen=True, slots=True)
class LogitTransform:
    """What the model does to the logits between the head and the loss (module docstring, What):
    y = softcap * tanh(z * logit_scale / softcap), or z * logit_scale without a cap."""

    logit_scale: float = 1.0
    softcap: float | None = None

    def is_identity(self) -> bool:
        return self.logit_scale == 1.0 and self.softcap is None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """The transform over one chunk's logits, in place, in their dtype."""
        if self.softcap is not None:
            return logits.mul_(self.logit_scale / self.softcap).tanh_().mul_(self.softcap)
        return logits if self.logit_scale == 1.0 else logits.mul_(self.logit_scale)


def _fused_combine(logits: torch.Tensor, reductions: VocabReductions) -> bool:
    """Whether the chunk's loss is finished by cross_entropy_loss's combine kernel."""
    return use_triton(logits) and reductions.is_identity()


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int,
                reductions: VocabReductions, loss_out: torch.Tensor, scratch: torch.Tensor | None = None,
                raw: LogitTransform | None = None) -> torch.Tensor:
    """lse per row, fp32 (float64 for float64); the chunk's loss over counted rows goes into
    `loss_out` (zeros, `combine_programs(chunk rows)` of them at least) as partial sums: no
    reduction launched per chunk, the op sums every chunk's slots once. `scratch`: memory the row
    statistics may use until this returns (`_block_stats`). `raw`: the logits are z, and the
    kernels apply this transform on load (only where `_fused_combine`)."""
    if _fused_combine(logits, reductions):
        transform = None if raw is None else (raw.logit_scale, raw.softcap)
        lse, _, _ = _combine(logits, labels, _block_stats(logits, scratch, transform), vocab_start, ignore_index,
                             finalize=True, loss_sum=loss_out[:combine_programs(logits.shape[0])],
                             transform=transform)
        return lse
    assert raw is None, "a raw chunk's transform is applied by the fused kernels only"
    lse, row_loss = reduced_row_losses(logits, labels, vocab_start, ignore_index, reductions)
    loss_out[0] = row_loss.sum()
    return lse


def _logits_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                 vocab_start: int, ignore_index: int, transform: LogitTransform, raw: bool = False) -> torch.Tensor:
    """(softmax - onehot(label)) * scale on counted rows, 0 on the others, times the transform's
    derivative (`logits` are its results; with `raw`, its inputs, Triton only), in the logits'
    dtype: written over the logits by the Triton kernel, a new tensor on the PyTorch path."""
    n_rows, n_cols = logits.shape
    if use_triton(logits):
        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (n_rows * triton.cdiv(n_cols, meta["BLOCK_V"]),)

        _grad_in_place_kernel[grid](logits, labels, lse, scale, n_cols, logits.stride(0), vocab_start, ignore_index,
                                    float(transform.logit_scale), float(transform.softcap or 1.0),
                                    TRANSFORMED=not transform.is_identity(), CAPPED=transform.softcap is not None,
                                    RAW=raw)
        return logits
    assert not raw, "raw logits are transformed by the Triton kernel only"
    local = labels - vocab_start
    counted = labels != ignore_index
    mine = counted & (local >= 0) & (local < n_cols)
    probs = (logits.to(lse.dtype) - lse[:, None]).exp()
    probs[mine.nonzero()[:, 0], local[mine]] -= 1.0
    probs *= torch.where(counted, scale, 0.0)[:, None]
    if transform.softcap is not None:
        capped = logits.to(lse.dtype) / transform.softcap
        probs *= transform.logit_scale * (1.0 - capped * capped)
    elif transform.logit_scale != 1.0:
        probs *= transform.logit_scale
    return probs.to(logits.dtype)


ROW_ALIGN_BYTES = 128
"""Row stride of a chunk's logits, in bytes: a multiple of this (module docstring, Alignment)."""


def logits_row_bytes(vocab: int, itemsize: int) -> int:
    """Bytes a row of a chunk's logits takes: vocab * itemsize, rounded up to ROW_ALIGN_BYTES
    where that is not a multiple of 16 (the leading dimension cuBLAS aligns its kernels on)."""
    row = vocab * itemsize
    return row if row % 16 == 0 else -(-row // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


def aligned_vocab(vocab: int, itemsize: int) -> int:
    """Columns of the head's GEMMs that run on cuBLAS's aligned kernels: the largest multiple of
    16 bytes of columns (the whole vocabulary where it is one, or where it is narrower than 16
    bytes); the rest, fewer than 16 bytes' worth, go to a GEMM of their own."""
    aligned = vocab - vocab % max(1, 16 // itemsize)
    return aligned or vocab


def _vocab_parts(vocab: int, itemsize: int) -> tuple[slice, ...]:
    """The vocabulary's column ranges, one GEMM each: the aligned columns, then any rest."""
    aligned = aligned_vocab(vocab, itemsize)
    return (slice(0, aligned),) if aligned == vocab else (slice(0, aligned), slice(aligned, vocab))


def _logits_buffer(rows: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """Uninitialized [rows, vocab] logits (the GEMM then writes every element) on rows of
    `logits_row_bytes`: the view's row stride is the leading dimension of the logits GEMM and of
    both backward GEMMs, which read d_logits written over the logits."""
    stride = logits_row_bytes(vocab, like.element_size()) // like.element_size()
    return torch.empty(rows, stride, dtype=like.dtype, device=like.device)[:, :vocab]


def _fused_chunk(x_c: torch.Tensor, labels_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 vocab_start: int, ignore_index: int, reductions: VocabReductions, scale: torch.Tensor,
                 grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None,
                 ones: torch.Tensor | None, upcast: bool, loss_out: torch.Tensor, first: bool,
                 transform: LogitTransform = LogitTransform()) -> None:
    """One chunk: its summed loss, as partial sums into `loss_out`; with `grads` (d_x's rows of
    this chunk, d_W, d_b, each None where not wanted) also its gradients, written (the `first`
    chunk) or accumulated there (`ones`: a chunk of ones in the bias dtype, for d_b). The chunk's
    logits die on return, before the next chunk's exist. `upcast` with float64 logits: the loss of
    their fp32 copy, as `logits.float()` gives (16- and 32-bit logits are computed in fp32 anyway)."""
    logits = _logits_buffer(x_c.shape[0], weight.shape[0], x_c)
    parts = _vocab_parts(weight.shape[0], x_c.element_size())
    for cols in parts:  # module docstring, Alignment
        if bias is None:
            torch.mm(x_c, weight[cols].t(), out=logits[:, cols])
        else:
            torch.addmm(bias[cols], x_c, weight[cols].t(), out=logits[:, cols])
    # the fused kernels apply the transform on load (the module docstring, What); elsewhere it runs
    # in the model's dtype, before any upcast, as the model's ops do
    raw = not transform.is_identity() and _fused_combine(logits, reductions)
    if not raw:
        transform.apply_(logits)
    if upcast and logits.dtype == torch.float64:
        logits = logits.float()
    # the row statistics borrow d_x's rows of this chunk, written only after they are read: at
    # Liger's chunk this op then holds no more than Liger's does (the module docstring, Memory)
    scratch = grads[0] if grads is not None else None
    lse = _chunk_loss(logits, labels_c, vocab_start, ignore_index, reductions, loss_out, scratch,
                      transform if raw else None)
    if grads is None:
        return
    d_x_c, d_w, d_b = grads
    d_logits = _logits_grad(logits, labels_c, lse, scale.to(lse.dtype), vocab_start, ignore_index,
                            transform, raw).to(x_c.dtype)
    del logits  # the PyTorch path's gradient is a new tensor: one chunk-sized buffer at a time
    if d_x_c is not None:  # the rest's few columns first, the aligned ones added with one rounding
        for i, cols in enumerate(reversed(parts)):
            if i == 0:
                torch.mm(d_logits[:, cols], weight[cols], out=d_x_c)
            else:
                d_x_c.addmm_(d_logits[:, cols], weight[cols])
    # d_W and d_b: the first chunk writes them (they start uninitialized), the others add to them
    if d_w is not None:
        for cols in parts:
            if first:
                torch.mm(d_logits[:, cols].t(), x_c, out=d_w[cols])
            else:
                d_w[cols].addmm_(d_logits[:, cols].t(), x_c)
    if d_b is not None:  # the column sums as a GEMV: sum(0, dtype=fp32) would convert the chunk to fp32 first
        if first:
            torch.mv(d_logits.t(), ones[: d_logits.shape[0]], out=d_b)
        else:
            d_b.addmv_(d_logits.t(), ones[: d_logits.shape[0]])


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph for another run (retain_graph=True, as a
    zero-bubble schedule's input-gradient pass does); True where this torch cannot say."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward: per chunk of rows the logits, the loss and every gradient. Backward: a scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                vocab_start: int, ignore_index: int, reductions: VocabReductions, chunk_rows: int,
                loss_dtype: torch.dtype, wanted: tuple[bool, bool, bool], upcast: bool = False,
                transform: LogitTransform = LogitTransform()) -> torch.Tensor:
        n_rows = x.shape[0]
        acc = _accumulation_dtype(x)
        count = (labels != ignore_index).sum().to(acc)
        scale = count.reciprocal().reshape(1)
        want_x, want_w, want_b = wanted
        d_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        d_w = torch.empty_like(weight) if want_w else None  # the first chunk writes every element
        d_b = torch.empty_like(bias) if want_b else None
        ones = torch.ones(min(chunk_rows, n_rows), dtype=bias.dtype, device=x.device) if want_b else None
        slots = combine_programs(chunk_rows)  # loss partial sums per chunk, unused ones left 0
        loss_parts = torch.zeros(triton.cdiv(n_rows, chunk_rows), slots, dtype=acc, device=x.device)
        for chunk, start in enumerate(range(0, n_rows, chunk_rows)):
            rows = slice(start, min(start + chunk_rows, n_rows))
            grads = (None if d_x is None else d_x[rows], d_w, d_b) if any(wanted) else None
            _fused_chunk(x[rows], labels[rows], weight, bias, vocab_start, ignore_index, reductions, scale, grads,
                         ones, upcast, loss_parts[chunk], first=start == 0, transform=transform)
        loss_sum = loss_parts.sum()
        # Held on ctx, not saved: a saved tensor would go through activation checkpointing's hooks,
        # which would rerun this whole op in the backward under recomputation.
        ctx.grads, ctx.scaled_by = (d_x, d_w, d_b), None
        return (loss_sum / count).to(loss_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_loss: torch.Tensor) -> tuple[Any, ...]:
        grads = ctx.grads
        if all(grad is None for grad in grads) and any(ctx.needs_input_grad):
            raise RuntimeError("linear_cross_entropy: backward through the graph a second time; pass "
                               "retain_graph=True to the first backward to run it again")
        if ctx.scaled_by is None:  # the first backward: scale the stored gradients in place
            for grad in grads:
                if grad is not None:
                    _scale_in_place(grad, d_loss)
            ctx.scaled_by = d_loss.detach().clone()
            ctx.versions = tuple(None if grad is None else grad._version for grad in grads[1:])
            # d_W and d_b handed out as new tensor objects on the same storage: ctx's reference
            # would make the weight's AccumulateGrad copy d_W (a V x H copy at the step's memory peak)
            grads = (grads[0], *(None if grad is None else grad.detach() for grad in grads[1:]))
        else:  # run again (retain_graph, a zero-bubble W step)
            if ctx.versions is not None:  # the first rerun: keep a private copy, since the first
                # hand-out may be a .grad that later backwards accumulate into
                if any(g is not None and g._version != v for g, v in zip(grads[1:], ctx.versions)):
                    raise RuntimeError("linear_cross_entropy: a gradient it handed out was modified in place "
                                       "before the graph was run again; it cannot hand out the same values")
                ctx.grads = grads = tuple(None if grad is None else grad.clone() for grad in grads)
                ctx.versions = None
            ratio = d_loss / ctx.scaled_by
            grads = tuple(None if grad is None else grad * ratio for grad in grads)
        if not _graph_kept():  # the last run: a loss tensor the caller keeps must not keep d_x and d_W
            ctx.grads = (None, None, None)
        return (*grads, None, None, None, None, None, None, None, None, None)


def _loss_probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    return F.cross_entropy(torch.zeros(1, 2, dtype=dtypes[0], device=device),
                           torch.zeros(1, dtype=torch.long, device=device))


def _apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, vocab_start: int,
           ignore_index: int, reductions: VocabReductions, chunk_rows: int | None, upcast: bool,
           transform: LogitTransform = LogitTransform()) -> torch.Tensor:
    gemm_dtype = autocast_result_dtype(CONSUMER_PROBES["linear"], x, (x.dtype,))
    no_autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    loss_dtype = x.dtype
    if gemm_dtype is not None:  # F.linear's autocast casts, recorded by autograd; F.cross_entropy's loss dtype
        x, weight = x.to(gemm_dtype), weight.to(gemm_dtype)
        bias = None if bias is None else bias.to(gemm_dtype)
        loss_dtype = autocast_result_dtype(_loss_probe, x, (gemm_dtype,)) or gemm_dtype
        no_autocast = torch.autocast(x.device.type, enabled=False)
    if upcast:  # the loss of logits.float(): the arithmetic is fp32 anyway, the loss stays fp32
        loss_dtype = torch.float32
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    wanted = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (x, weight, bias))
    chunk = chunk_rows or default_chunk_rows(weight.shape[0], rows.element_size(), weight.shape[1])
    with no_autocast:
        return LinearCrossEntropyFunction.apply(rows, weight, bias, labels.reshape(-1).contiguous(), vocab_start,
                                                ignore_index, reductions, chunk, loss_dtype, wanted, upcast, transform)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, bias: torch.Tensor | None = None, *,
                         chunk_rows: int | None = None, upcast: bool = False, logit_scale: float = 1.0,
                         softcap: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(x, weight, bias)` against `labels`, chunk by chunk of
    `chunk_rows` rows (None: `default_chunk_rows`); Triton kernels where `use_triton`. `upcast`:
    of `F.linear(...).float()` (Hugging Face's loss upcasts the logits): an fp32 loss.
    `logit_scale`, `softcap`: of the logits scaled, then soft-capped (module docstring, What)."""
    return _apply(x, weight, bias, labels, 0, ignore_index, VocabReductions.identity(), chunk_rows, upcast,
                  LogitTransform(logit_scale, softcap))


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, local_weight: torch.Tensor, labels: torch.Tensor,
                                        vocab_start: int, reductions: VocabReductions | None = None, *,
                                        bias: torch.Tensor | None = None, group: dist.ProcessGroup | None = None,
                                        ignore_index: int = IGNORE_INDEX,
                                        chunk_rows: int | None = None, upcast: bool = False) -> torch.Tensor:
    """`linear_cross_entropy` when this rank holds vocabulary ids [vocab_start, vocab_start +
    local_weight.shape[0]) of the head (and `bias`, the same slice) and x whole.

    `reductions` defaults to all-reduces over `group`. The loss is the same on every rank;
    local_weight and bias get their complete gradients, x a PARTIAL one that the caller must
    all-reduce (sum) over the group (module docstring)."""
    if reductions is None:
        reductions = VocabReductions.from_group(group)
    return _apply(x, local_weight, bias, labels, vocab_start, ignore_index, reductions, chunk_rows, upcast)


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = IGNORE_INDEX, bias: torch.Tensor | None = None,
                                   upcast: bool = False, logit_scale: float = 1.0,
                                   softcap: float | None = None) -> torch.Tensor:
    """The unfused ops: the whole [rows, vocab] logits, scaled and soft-capped as asked (`upcast`:
    then as fp32), then F.cross_entropy."""
    logits = F.linear(x, weight, bias)
    logits = logits * logit_scale if logit_scale != 1.0 else logits
    logits = torch.tanh(logits / softcap) * softcap if softcap is not None else logits
    logits = logits.float() if upcast else logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)
