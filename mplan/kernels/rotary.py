"""Rotary position embedding (RoPE), rotate-half convention, as `mplan.models.layers.apply_rope`.

    rope(x, cos, sin) -> x * cos + rotate_half(x) * sin
        x: [batch, heads, seq, head_dim] (any strides with a contiguous last dim: q/k arrive as a
           transpose of [batch, seq, heads, head_dim] and are read in place, never copied)
        cos, sin: [seq, head_dim] tables (row s is position s); rotate_half(x) = [-x2, x1]
    With x = [x1, x2] split in halves: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.

The backward is the transposed map, which for the rotation tables (c1 = c2, s1 = s2) is the
inverse rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1. One kernel does both.

Interleaved layout (`interleaved=True`: GPT-J's `rotate_every_two`, Cohere's `rotate_half`, with
tables repeating each frequency twice side by side): the pairs rotated together are
(x[2i], x[2i + 1]) rather than (x[i], x[i + head_dim / 2]); the same formulas, the kernels only
address the two elements (and the two table entries) of a pair differently (`_load_pairs`,
`_store_pairs`): one contiguous load of each pair, split in registers, and one store of both. Casts (`upcast`, `dtype`): Hugging Face's `q.float()` before RoPE and
`.to(q.dtype)` after it, taken as the call's input and result dtypes: the kernels load in fp32
and store the result's dtype, so neither cast is a pass over memory (an upcast that fp32 loads do
not give, e.g. of float64, is made before the call).

Kernel: flat over the output's head vectors in its dense order (the order of x's strides):
each program takes BLOCK_R consecutive vectors, finds each one's (batch, head, position) by
divisions by the two inner sizes, compile-time constants (one compile per heads x positions
shape: a multiply and shift, not an integer division), reads its halves with x's strides and
its table row, and writes the output densely. Why this shape: on the H200 it ran 2-5% faster
than the earlier [heads, positions] tiles on a 3-D grid (0.0334 vs 0.0351 ms for the
transposed [8, 16, 2048, 128] projection, 0.0655 vs 0.0672 for contiguous [4, 32, 4096, 128];
torch.compile 0.0329 and 0.0648), because consecutive programs write consecutive memory and
small programs keep many loads in flight (benchmarks/results/kernel_variants_h200-2026-11-29.json).
With the sizes as run-time integers it lost that gain (0.069 and 0.035 ms in
kernels_h200-2026-11-29-all-shapes.json).
The tables are re-read per vector, mostly from L2; EVICT (tuned) asks L2 to keep them and let
the streamed x go first. Arithmetic is fp32. Offsets are 32-bit unless some tensor reaches 2^31
elements, and a launch whose blocks are all full runs unmasked (EVEN), Inductor's two
specializations: with them the forward went from 0.3% behind torch.compile to 0.7-0.9% ahead
(0.0642 vs 0.0648 ms, 0.0326 vs 0.0329 ms transposed; medians of 5 interleaved rounds,
benchmarks/results/kernels_h200-2026-11-29-session6.json). Unmasked, the backward runs fastest at
8 vectors on 4 warps, which the autotuner is offered since session 7: 93% -> 99% of copy
bandwidth, forward+backward 1.06x torch.compile's (kernels_h200-2026-11-29-session7.json).

Layout: the result has x's dimension order (dense, so x's strides when x is dense, e.g. the
transposed q/k projection, and [batch, seq, heads, head_dim] order when x is a slice of a grouped
q/k/v projection), so attention reads it as it would have read x, and the gradient is written in
that layout too: its transpose back to [batch, seq, heads * head_dim] is then a view, where a
contiguous [batch, heads, seq, head_dim] gradient would be copied by the projection's view
backward.

Invariants: the tables are constants (RoPE buffers): the Triton path gives them no gradient,
so tables that require grad, a non-contiguous last dim, and devices without Triton all run
`rope_reference`, the model's ops.

rope_qk(q, k, cos, sin) -> (rope(q, cos, sin), rope(k, cos, sin)), one launch each way
    q: [batch, q_heads, seq, head_dim], k: [batch, kv_heads, seq, head_dim] (GQA: any head
       counts), any strides with a contiguous last dim, read in place (HF's
       `view(b, s, h, d).transpose(1, 2)` of the projections, or slices of a grouped projection);
    cos, sin: [seq, head_dim], [1, 1, seq, head_dim] or [batch, 1, seq, head_dim] (HF after
       `unsqueeze(1)`; per-batch tables from position_ids), any dtype but float64, taken as
       stride-0 broadcast views, never expanded into copies.
Why: Liger Kernel's RoPE (q and k in one launch) took 0.64 ms on the H200 where mplan's two
`rope` calls took 1.32 ms (bf16, 16k tokens, Llama shapes, forward+backward). Kernel: a 2-D grid
(position tiles of BLOCK_T tokens, batch), no index division; each program loads its table rows
once (fp32) and rotates every q head and every k head of its tokens, [BLOCK_T, heads, head_dim/2]
blocks addressed by the (batch, head, position) strides, so both tensors stream through one
launch; the backward is the same kernel on the gradients with the transposed map. Outputs and
input gradients are dense in their input's dimension order, as `rope`'s (the gradient w.r.t. a
transposed projection view is then contiguous). Dtypes: each output is promote(x, cos, sin), the
reference chain's (bf16 q with fp32 tables gives fp32), or `consumer`'s autocast dtype; the
gradients come back in q's and k's dtypes. Falls back to the two `rope` calls (each then takes
its own path) for other table shapes, tables that require grad (their gradient then comes from
the reference ops, as with `rope`), float64, mismatched devices, or heads too wide for one
program's registers (`MAX_QK_TILE`). EVEN (positions a multiple of BLOCK_T, head counts and
head_dim / 2 powers of two) drops the masks; INDEX_64 as in `rope`.
Partial rotary (`rot_dim` < head_dim: GPT-NeoX, Phi, StableLM; tables rot_dim wide): the same
launch on q[..., :rot_dim] and k[..., :rot_dim], writing the outputs' leading columns in place,
and one ATen copy per tensor of the rest (each way), as Hugging Face's slice/rotate/cat computes
it but without the concatenation's second pass over the rotated part. `rope(..., rot_dim=)` (the
unpaired form) is `rope` on the slice and a concatenation.
Timing: not yet measured on the H200 by a benchmark (no entry in benchmarks/, no results file).
One unrecorded check (2026-12-02, bf16 q/k as transposed views): outputs and gradients within
1.7e-3 of float64 (bf16 rounding) for the three table shapes, bf16 and fp32 tables; torch.profiler
kernel time of forward + backward ([seq, head_dim] bf16 tables, 20 iterations): rope_qk 167.5 us
vs two `rope` calls 164.9 at [4, 32 | 8, 4096, 128]; 44.8 vs 47.5 at [4, 16 | 4, 4096, 64]; 152.8
vs 149.3 at [4, 32 | 4, 4096, 128]; 53.1 vs 56.0 at [2, 16 | 8, 8192, 64]: both at 93-97% of a
4.3 TB/s copy of the bytes moved. So one launch saves host time (a launch and its dispatch each
way; those loops took 0.7-1 ms of host time an iteration), not device time, and the 0.64 vs 1.32 ms
above were probably host-bound iterations. With [batch, 1, seq, head_dim] tables the kernel time
was the same, where `rope` takes such tables through the reference (forward 4x slower in wall
time). The autotuner picked 4 warps and BLOCK_T 2-4 forward, 1-4 backward; the candidates are
otherwise a first guess.
"""
from __future__ import annotations

from typing import Any

import torch

from mplan.kernels.dispatch import configs, consumer_cast_dtype, next_power_of_2, tl, triton, use_triton

# (head vectors per program, warps, L2 eviction hints): on the H200 8 vectors of 4 warps ran
# fastest, forward and backward, once the kernel dropped its masks (session 7: backward 0.0650 ms
# against 0.0682 at 8 x 2 warps, the autotuner's pick before 8 x 4 was offered; kernel_variants);
# 8 x 2 warps loads 16 bytes a thread at head_dim 128 and is kept for other shapes
_VECTORS = configs(
    [triton.Config({"BLOCK_R": r, "EVICT": e}, num_warps=w)
     for e in (False, True) for r, w in ((8, 2), (8, 4), (16, 4), (32, 8))],
    triton.Config({"BLOCK_R": 4, "EVICT": True}, num_warps=1),
)


@triton.jit
def _vector_index(r, n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr):
    """Dense vector index r over sizes [n0, n1, n2] -> (i0, i1, i2, the index on axis POS_AXIS)."""
    i2 = r % n2
    i1 = (r // n2) % n1
    i0 = r // (n1 * n2)
    if POS_AXIS == 0:
        pos = i0
    elif POS_AXIS == 1:
        pos = i1
    else:
        pos = i2
    return i0, i1, i2, pos


@triton.jit
def _load_f32(ptr, mask, EVEN: tl.constexpr, POLICY: tl.constexpr):
    """ptr's values in fp32, masked unless EVEN; POLICY: an L2 eviction hint ("" for none)."""
    if EVEN:
        value = tl.load(ptr, eviction_policy=POLICY)
    else:
        value = tl.load(ptr, mask=mask, other=0.0, eviction_policy=POLICY)
    return value.to(tl.float32)


@triton.jit
def _load_pairs(ptr, base, cols, mask, half, EVEN: tl.constexpr, POLICY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two elements rotated together, in fp32, of the head vectors (or table rows) at `base`:
    (v[i], v[i + half]) for i in `cols` (the halves), or (v[2i], v[2i + 1]) (interleaved: one
    contiguous load of both, split in registers; two stride-2 loads ran 3x slower on the H100)."""
    if INTERLEAVED:
        offs = tl.expand_dims(base + cols * 2, -1) + tl.arange(0, 2)
        both = _load_f32(ptr + offs, tl.expand_dims(mask, -1), EVEN, POLICY)
        first, second = tl.split(both)
    else:
        first = _load_f32(ptr + base + cols, mask, EVEN, POLICY)
        second = _load_f32(ptr + base + cols + half, mask, EVEN, POLICY)
    return first, second


@triton.jit
def _store_pairs(ptr, base, cols, first, second, mask, half, EVEN: tl.constexpr, INTERLEAVED: tl.constexpr):
    """`_load_pairs`' inverse: the pairs written back in ptr's dtype (interleaved: one store of both)."""
    if INTERLEAVED:
        offs = tl.expand_dims(base + cols * 2, -1) + tl.arange(0, 2)
        both = tl.join(first, second).to(ptr.dtype.element_ty)
        if EVEN:
            tl.store(ptr + offs, both)
        else:
            tl.store(ptr + offs, both, mask=tl.expand_dims(mask, -1))
    else:
        if EVEN:
            tl.store(ptr + base + cols, first.to(ptr.dtype.element_ty))
            tl.store(ptr + base + cols + half, second.to(ptr.dtype.element_ty))
        else:
            tl.store(ptr + base + cols, first.to(ptr.dtype.element_ty), mask=mask)
            tl.store(ptr + base + cols + half, second.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    """The two halves of a head vector rotated (forward), or rotated back (the backward's
    transpose: sin negated): y = x * cos + rotate_half(x) * sin, halves apart."""
    if BACKWARD:
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.autotune(configs=_VECTORS, key=["n_vectors", "half", "BACKWARD", "INTERLEAVED"])
@triton.heuristics({"EVEN": lambda args: args["n_vectors"] % args["BLOCK_R"] == 0 and args["half"] == args["BLOCK_HALF"]})
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                 n1: tl.constexpr, n2: tl.constexpr, BACKWARD: tl.constexpr, POS_AXIS: tl.constexpr,
                 INDEX_64: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, EVICT: tl.constexpr, EVEN: tl.constexpr):
    """Vector r of y (dense, sizes [n0, n1, n2] outermost first) is x's vector (r // (n1 n2),
    r // n2 % n1, r % n2) in that order; its table row is that index on axis POS_AXIS.
    INDEX_64: offsets in 64 bits (only where some tensor spans 2^31 elements or more);
    INTERLEAVED: the pairs rotated together are (2i, 2i + 1), not (i, i + half);
    EVEN: no vector or column out of range, so no masks."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    r = program * BLOCK_R + tl.arange(0, BLOCK_R)
    i0, i1, i2, pos = _vector_index(r, n1, n2, POS_AXIS)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    t_offs = pos[:, None] * table_stride
    x_offs = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None]
    mask = (r < n_vectors)[:, None] & (cols < half)
    table_policy: tl.constexpr = "evict_last" if EVICT else ""
    x_policy: tl.constexpr = "evict_first" if EVICT else ""
    c1, c2 = _load_pairs(cos_ptr, t_offs, cols, mask, half, EVEN, table_policy, INTERLEAVED)
    s1, s2 = _load_pairs(sin_ptr, t_offs, cols, mask, half, EVEN, table_policy, INTERLEAVED)
    x1, x2 = _load_pairs(x_ptr, x_offs, cols, mask, half, EVEN, x_policy, INTERLEAVED)
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
    _store_pairs(y_ptr, r[:, None] * (2 * half), cols, y1, y2, mask, half, EVEN, INTERLEAVED)


def _needs_64_bit_offsets(*tensors: torch.Tensor) -> bool:
    """True when some tensor addresses an element at offset 2^31 or more (storage offset included)."""
    return any(t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) >= 2**31
               for t in tensors)


def _launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, order: list[int],
            backward: bool, interleaved: bool) -> None:
    """dst is dense in the dimension order `order` (outermost first, the head dim last)."""
    sizes = [src.shape[d] for d in order[:3]]
    strides = [src.stride(d) for d in order[:3]]
    n_vectors = sizes[0] * sizes[1] * sizes[2]
    head_dim = src.shape[-1]

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n_vectors, meta["BLOCK_R"]),)

    _rope_kernel[grid](src, cos, sin, dst, n_vectors, *strides, head_dim // 2, cos.stride(0), n1=sizes[1], n2=sizes[2],
                       BACKWARD=backward, POS_AXIS=order.index(2), INDEX_64=_needs_64_bit_offsets(src, dst, cos, sin),
                       INTERLEAVED=interleaved, BLOCK_HALF=next_power_of_2(head_dim // 2))


def _order(x: torch.Tensor) -> list[int]:
    """x's dimensions outermost first (largest stride first, a stable sort), the head dim last."""
    return sorted(range(x.dim() - 1), key=lambda d: -x.stride(d)) + [x.dim() - 1]


def _dense_like(x: torch.Tensor, dtype: torch.dtype, order: list[int]) -> torch.Tensor:
    """An empty tensor of x's shape, dense in the dimension order `order`, even where x is not
    (q/k as a slice of a grouped q/k/v projection, [batch, seq, (q|k|v) heads * head_dim]
    transposed): torch.empty_like would fall back to contiguous [batch, heads, seq, head_dim] there."""
    base = torch.empty([x.shape[d] for d in order], dtype=dtype, device=x.device)
    return base.permute([order.index(d) for d in range(x.dim())])


class RopeFunction(torch.autograd.Function):
    """Triton forward/backward of `rope`; no gradient for the tables."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype,
                interleaved: bool) -> torch.Tensor:
        order = _order(x)
        y = _dense_like(x, out_dtype, order)
        _launch(x, cos, sin, y, order, backward=False, interleaved=interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype, ctx.order, ctx.interleaved = x.dtype, order, interleaved
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = _dense_like(dy, ctx.x_dtype, ctx.order)
        _launch(dy, cos, sin, dx, ctx.order, backward=True, interleaved=ctx.interleaved)
        return dx, None, None, None, None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] of the halves [x1, x2] of each head vector (Llama's layout)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(-x[2i + 1], x[2i]) in place of each pair (x[2i], x[2i + 1]): the interleaved layout of
    GPT-J's `rotate_every_two` and Cohere's `rotate_half`, whose tables repeat each frequency twice."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`mplan.models.layers.apply_rope`, op for op; `interleaved`: with `rotate_pairs` (Cohere's, op for op)."""
    return x * cos + (rotate_pairs(x) if interleaved else rotate_half(x)) * sin


def partial_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int,
                           interleaved: bool = False) -> torch.Tensor:
    """RoPE on x[..., :rot_dim], the rest concatenated back (Hugging Face's partial rotary, op for op)."""
    return torch.cat([rope_reference(x[..., :rot_dim], cos, sin, interleaved), x[..., rot_dim:]], dim=-1)


_EXACT_IN_FP32 = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes whose values fp32 holds exactly: their upcast to fp32 is what the kernels' fp32 loads do."""


def _cast_first(x: torch.Tensor, upcast: torch.dtype | None) -> tuple[torch.Tensor, torch.dtype | None]:
    """(x, upcast) as the kernels take them: an fp32 upcast of a 16-bit or fp32 x is left to the
    kernels' fp32 loads (no copy); any other cast is made here (None then)."""
    if upcast is None or (upcast == torch.float32 and x.dtype in _EXACT_IN_FP32):
        return x, upcast
    return x.to(upcast), None


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[-1] == x.shape[-1]
            and cos.shape[0] == x.shape[2] and cos.stride(-1) == 1 and sin.stride() == cos.stride()
            and not (cos.requires_grad or sin.requires_grad))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, consumer: str | None = None,
         rot_dim: int | None = None, *, interleaved: bool = False, upcast: torch.dtype | None = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; Triton where `use_triton` (and the layout fits), else the reference.
    `consumer`: what every use of the result is ("attention"), so that under autocast it comes out
    in the dtype autocast would cast it to there (`consumer_cast_dtype`; with fp32 tables the
    product is fp32 otherwise). `rot_dim`: rotate only x[..., :rot_dim] (tables that wide) and
    pass the rest through, `partial_rope_reference`. `interleaved`: rotate the pairs (2i, 2i + 1)
    (`rotate_pairs`: GPT-J, Cohere) rather than (i, i + head_dim / 2). `upcast`: x cast to it
    first, `dtype`: the result cast to it (Hugging Face's `q.float()` before and `.to(q.dtype)`
    after RoPE, as one call: an fp32 upcast of 16-bit x and the downcast are the kernel's loads
    and stores)."""
    x, upcast = _cast_first(x, upcast)
    if rot_dim is not None and rot_dim < x.shape[-1]:
        rotated = rope(x[..., :rot_dim], cos, sin, consumer, interleaved=interleaved, upcast=upcast, dtype=dtype)
        return torch.cat([rotated, x[..., rot_dim:].to(rotated.dtype)], dim=-1)
    cast_to = consumer_cast_dtype(consumer, x) or dtype
    if _fusable(x, cos, sin):
        return RopeFunction.apply(x, cos, sin, cast_to or torch.promote_types(upcast or x.dtype, cos.dtype),
                                  interleaved)
    y = rope_reference(x if upcast is None else x.to(upcast), cos, sin, interleaved)
    return y if cast_to is None else y.to(cast_to)


# --- rope_qk: q and k in one launch per direction ---------------------------------------------

# (tokens per program, warps): one token of all heads per program is Liger Kernel's tiling; more
# tokens per program for few or narrow heads (4 kv heads x 64 is 256 values a token). Not yet
# measured on the H200: the autotuner picks per (heads, head_dim, direction).
_QK_TILES = configs(
    [triton.Config({"BLOCK_T": t}, num_warps=w) for t, w in ((1, 4), (2, 4), (4, 4), (4, 8), (8, 8))],
    triton.Config({"BLOCK_T": 2}, num_warps=1),
)

MAX_QK_TILE = 16384
"""Most values of one token's heads (padded to powers of two) the one-launch kernel holds in
registers per tensor; wider q (or k) run as two `rope` calls."""


@triton.jit
def _rotate_heads(x_ptr, y_ptr, batch, pos, cols, token_mask, heads, sb, sh, ss, y_sb, y_sh, y_ss, half,
                  c1, c2, s1, s2, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
                  EVEN: tl.constexpr, INTERLEAVED: tl.constexpr):
    """All heads of BLOCK_T tokens of one tensor: y = rotation of x (BACKWARD: its transpose).
    pos, cols: [BLOCK_T, 1, 1] and [1, 1, BLOCK_HALF]; the tables [BLOCK_T, 1, BLOCK_HALF] in fp32."""
    h = tl.arange(0, BLOCK_H)[None, :, None]
    if INDEX_64:
        h = h.to(tl.int64)
    mask = token_mask & (h < heads)
    x1, x2 = _load_pairs(x_ptr, batch * sb + pos * ss + h * sh, cols, mask, half, EVEN, "", INTERLEAVED)
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
    _store_pairs(y_ptr, batch * y_sb + pos * y_ss + h * y_sh, cols, y1, y2, mask, half, EVEN, INTERLEAVED)


@triton.autotune(configs=_QK_TILES, key=["q_heads", "kv_heads", "half", "BACKWARD", "INTERLEAVED"])
@triton.heuristics({"EVEN": lambda args: args["seq"] % args["BLOCK_T"] == 0 and args["half"] == args["BLOCK_HALF"]
                    and args["q_heads"] == args["BLOCK_HQ"] and args["kv_heads"] == args["BLOCK_HK"]})
@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, seq, q_heads, kv_heads, half,
                    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss, t_sb, t_ss,
                    BACKWARD: tl.constexpr, INDEX_64: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, EVEN: tl.constexpr):
    """Program (i, b): positions [i BLOCK_T, (i + 1) BLOCK_T) of batch b, every q head and every
    k head; each table row is loaded once for both. Tensors are addressed by (batch, head,
    position) strides, the tables by (batch, position) strides (0 where broadcast).
    EVEN: no position, head or column out of range, so no masks."""
    block = tl.program_id(0)
    batch = tl.program_id(1)
    if INDEX_64:
        block = block.to(tl.int64)
        batch = batch.to(tl.int64)
    pos = (block * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    token_mask = (pos < seq) & (cols < half)
    t_offs = batch * t_sb + pos * t_ss
    c1, c2 = _load_pairs(cos_ptr, t_offs, cols, token_mask, half, EVEN, "", INTERLEAVED)
    s1, s2 = _load_pairs(sin_ptr, t_offs, cols, token_mask, half, EVEN, "", INTERLEAVED)
    _rotate_heads(q_ptr, q_out_ptr, batch, pos, cols, token_mask, q_heads, q_sb, q_sh, q_ss, qo_sb, qo_sh, qo_ss,
                  half, c1, c2, s1, s2, BLOCK_HQ, BACKWARD, INDEX_64, EVEN, INTERLEAVED)
    _rotate_heads(k_ptr, k_out_ptr, batch, pos, cols, token_mask, kv_heads, k_sb, k_sh, k_ss, ko_sb, ko_sh, ko_ss,
                  half, c1, c2, s1, s2, BLOCK_HK, BACKWARD, INDEX_64, EVEN, INTERLEAVED)


def _launch_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
               k_out: torch.Tensor, backward: bool, interleaved: bool) -> None:
    """One launch: q_out, k_out = the rotation (backward: its transpose) of q, k; any strides with
    a contiguous last dim; cos/sin [batch, 1, seq, head_dim] views (broadcast dims of stride 0)."""
    batch, q_heads, seq, head_dim = q.shape
    half = head_dim // 2

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(seq, meta["BLOCK_T"]), batch)

    strides = [t.stride(d) for t in (q, k, q_out, k_out) for d in range(3)]
    _rope_qk_kernel[grid](q, k, cos, sin, q_out, k_out, seq, q_heads, k.shape[1], half, *strides,
                          cos.stride(0), cos.stride(2), BACKWARD=backward,
                          INDEX_64=_needs_64_bit_offsets(q, k, q_out, k_out, cos, sin), INTERLEAVED=interleaved,
                          BLOCK_HQ=next_power_of_2(q_heads), BLOCK_HK=next_power_of_2(k.shape[1]),
                          BLOCK_HALF=next_power_of_2(half))


def _rotate_and_pass(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
                     k_out: torch.Tensor, rot_dim: int, backward: bool, interleaved: bool) -> None:
    """The one launch on the first rot_dim of each head vector, written in place into the
    outputs' leading columns (the kernel takes any output strides); the rest, where there is
    one (partial rotary), copied through: one ATen copy per tensor, nothing concatenated."""
    if rot_dim == q.shape[-1]:
        _launch_qk(q, k, cos, sin, q_out, k_out, backward, interleaved)
        return
    _launch_qk(q[..., :rot_dim], k[..., :rot_dim], cos, sin, q_out[..., :rot_dim], k_out[..., :rot_dim], backward,
               interleaved)
    q_out[..., rot_dim:].copy_(q[..., rot_dim:])
    k_out[..., rot_dim:].copy_(k[..., rot_dim:])


class RopeQKFunction(torch.autograd.Function):
    """Triton forward/backward of `rope_qk`, one launch each; no gradient for the tables."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_dtype: torch.dtype, k_dtype: torch.dtype, rot_dim: int,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q_order, k_order = _order(q), _order(k)
        q_out, k_out = _dense_like(q, q_dtype, q_order), _dense_like(k, k_dtype, k_order)
        _rotate_and_pass(q, k, cos, sin, q_out, k_out, rot_dim, backward=False, interleaved=interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes, ctx.orders, ctx.rot_dim = (q.dtype, k.dtype), (q_order, k_order), rot_dim
        ctx.interleaved = interleaved
        return q_out, k_out

    @staticmethod
    def backward(ctx: Any, dq_out: torch.Tensor, dk_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dq_out = dq_out if dq_out.stride(-1) == 1 else dq_out.contiguous()
        dk_out = dk_out if dk_out.stride(-1) == 1 else dk_out.contiguous()
        dq = _dense_like(dq_out, ctx.dtypes[0], ctx.orders[0])
        dk = _dense_like(dk_out, ctx.dtypes[1], ctx.orders[1])
        _rotate_and_pass(dq_out, dk_out, cos, sin, dq, dk, ctx.rot_dim, backward=True, interleaved=ctx.interleaved)
        return (dq if ctx.needs_input_grad[0] else None, dk if ctx.needs_input_grad[1] else None,
                None, None, None, None, None, None)


def rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      rot_dim: int | None = None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_reference` on q and on k (Hugging Face's `apply_rotary_pos_emb`, op for op); with
    `rot_dim`, `partial_rope_reference` on each."""
    if rot_dim is not None and rot_dim < q.shape[-1]:
        return (partial_rope_reference(q, cos, sin, rot_dim, interleaved),
                partial_rope_reference(k, cos, sin, rot_dim, interleaved))
    return rope_reference(q, cos, sin, interleaved), rope_reference(k, cos, sin, interleaved)


def _qk_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin as [batch, 1, seq, head_dim] views (no copy: broadcast dims get stride 0) when
    the one-launch kernel takes q, k and these tables; else None."""
    if not (q.dim() == 4 and k.dim() == 4 and all(use_triton(t) for t in (q, k, cos, sin))):
        return None
    batch, q_heads, seq, head_dim = q.shape
    if (k.shape[0] != batch or k.shape[2:] != q.shape[2:] or head_dim % 2 or q.stride(-1) != 1
            or k.stride(-1) != 1 or len({q.device, k.device, cos.device, sin.device}) != 1
            or cos.requires_grad or sin.requires_grad or cos.shape != sin.shape
            or cos.stride(-1) != 1 or sin.stride(-1) != 1
            or max(next_power_of_2(q_heads), next_power_of_2(k.shape[1])) * next_power_of_2(head_dim) > MAX_QK_TILE):
        return None
    if cos.dim() == 2 and cos.shape == (seq, head_dim):
        cos, sin = cos[None, None], sin[None, None]
    elif not (cos.dim() == 4 and cos.shape[0] in (1, batch) and cos.shape[1:] == (1, seq, head_dim)):
        return None
    cos, sin = cos.expand(batch, 1, seq, head_dim), sin.expand(batch, 1, seq, head_dim)
    return (cos, sin) if cos.stride() == sin.stride() else None


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, consumer: str | None = None,
            rot_dim: int | None = None, *, interleaved: bool = False, upcast: torch.dtype | None = None,
            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(q, cos, sin), rope(k, cos, sin)) in one Triton launch per direction where the inputs
    fit (`_qk_tables`), else those two `rope` calls. q: [batch, q_heads, seq, head_dim], k:
    [batch, kv_heads, seq, head_dim]; cos/sin: [seq, head_dim], [1, 1, seq, head_dim] or
    [batch, 1, seq, head_dim]. Each output has the reference's dtype (its input's, cos's and sin's
    promoted), or under autocast the dtype `consumer` ("attention") would cast it to. `rot_dim`
    (partial rotary: tables rot_dim wide): only q[..., :rot_dim] and k[..., :rot_dim] rotate, in
    the same launch; the rest is copied through (`rope_qk_reference`'s partial form).
    `interleaved`, `upcast`, `dtype`: as `rope`'s, the same for q and k."""
    (q, q_upcast), (k, k_upcast) = _cast_first(q, upcast), _cast_first(k, upcast)
    if q_upcast != k_upcast:  # q and k of two dtypes, one of them cast here: the other too
        q, k, q_upcast = q.to(upcast), k.to(upcast), None
    rot_dim = q.shape[-1] if rot_dim is None else rot_dim
    tables = _qk_tables(q[..., :rot_dim], k[..., :rot_dim], cos, sin) if k.shape[-1] == q.shape[-1] else None
    if tables is None:
        options = dict(interleaved=interleaved, upcast=q_upcast, dtype=dtype)
        return rope(q, cos, sin, consumer, rot_dim, **options), rope(k, cos, sin, consumer, rot_dim, **options)
    table_dtype = torch.promote_types(cos.dtype, sin.dtype)
    q_dtype, k_dtype = (consumer_cast_dtype(consumer, x) or dtype or torch.promote_types(q_upcast or x.dtype, table_dtype)
                        for x in (q, k))
    return RopeQKFunction.apply(q, k, *tables, q_dtype, k_dtype, rot_dim, interleaved)
