"""Rotary position embedding (RoPE), rotate-half convention, as `mplan.models.layers.apply_rope`.

    rope(x, cos, sin) -> x * cos + rotate_half(x) * sin
        x: [batch, heads, seq, head_dim] (any strides with a contiguous last dim: q/k arrive as a
           transpose of [batch, seq, heads, head_dim] and are read in place, never copied)
        cos, sin: [seq, head_dim] tables (row s is position s); rotate_half(x) = [-x2, x1]
    With x = [x1, x2] split in halves: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.

The backward is the transposed map, which for the rotation tables (c1 = c2, s1 = s2) is the
inverse rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1. One kernel does both.

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


@triton.autotune(configs=_VECTORS, key=["n_vectors", "half", "BACKWARD"])
@triton.heuristics({"EVEN": lambda args: args["n_vectors"] % args["BLOCK_R"] == 0 and args["half"] == args["BLOCK_HALF"]})
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                 n1: tl.constexpr, n2: tl.constexpr, BACKWARD: tl.constexpr, POS_AXIS: tl.constexpr,
                 INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, EVICT: tl.constexpr,
                 EVEN: tl.constexpr):
    """Vector r of y (dense, sizes [n0, n1, n2] outermost first) is x's vector (r // (n1 n2),
    r // n2 % n1, r % n2) in that order; its table row is that index on axis POS_AXIS.
    INDEX_64: offsets in 64 bits (only where some tensor spans 2^31 elements or more);
    EVEN: no vector or column out of range, so no masks."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    r = program * BLOCK_R + tl.arange(0, BLOCK_R)
    i0, i1, i2, pos = _vector_index(r, n1, n2, POS_AXIS)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    t_offs = pos[:, None] * table_stride + cols
    x_offs = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None] + cols
    mask = (r < n_vectors)[:, None] & (cols < half)
    table_policy: tl.constexpr = "evict_last" if EVICT else ""
    x_policy: tl.constexpr = "evict_first" if EVICT else ""
    c1 = _load_f32(cos_ptr + t_offs, mask, EVEN, table_policy)
    c2 = _load_f32(cos_ptr + t_offs + half, mask, EVEN, table_policy)
    s1 = _load_f32(sin_ptr + t_offs, mask, EVEN, table_policy)
    s2 = _load_f32(sin_ptr + t_offs + half, mask, EVEN, table_policy)
    x1 = _load_f32(x_ptr + x_offs, mask, EVEN, x_policy)
    x2 = _load_f32(x_ptr + x_offs + half, mask, EVEN, x_policy)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_offs = r[:, None] * (2 * half) + cols
    if EVEN:
        tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty))
        tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _needs_64_bit_offsets(*tensors: torch.Tensor) -> bool:
    """True when some tensor addresses an element at offset 2^31 or more (storage offset included)."""
    return any(t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) >= 2**31
               for t in tensors)


def _launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, order: list[int],
            backward: bool) -> None:
    """dst is dense in the dimension order `order` (outermost first, the head dim last)."""
    sizes = [src.shape[d] for d in order[:3]]
    strides = [src.stride(d) for d in order[:3]]
    n_vectors = sizes[0] * sizes[1] * sizes[2]
    head_dim = src.shape[-1]

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n_vectors, meta["BLOCK_R"]),)

    _rope_kernel[grid](src, cos, sin, dst, n_vectors, *strides, head_dim // 2, cos.stride(0), n1=sizes[1], n2=sizes[2],
                       BACKWARD=backward, POS_AXIS=order.index(2), INDEX_64=_needs_64_bit_offsets(src, dst, cos, sin),
                       BLOCK_HALF=next_power_of_2(head_dim // 2))


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
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        order = _order(x)
        y = _dense_like(x, out_dtype, order)
        _launch(x, cos, sin, y, order, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype, ctx.order = x.dtype, order
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = _dense_like(dy, ctx.x_dtype, ctx.order)
        _launch(dy, cos, sin, dx, ctx.order, backward=True)
        return dx, None, None, None


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`mplan.models.layers.apply_rope`, op for op."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[-1] == x.shape[-1]
            and cos.shape[0] == x.shape[2] and cos.stride(-1) == 1 and sin.stride() == cos.stride()
            and not (cos.requires_grad or sin.requires_grad))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, consumer: str | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; Triton where `use_triton` (and the layout fits), else the reference.
    `consumer`: what every use of the result is ("attention"), so that under autocast it comes out
    in the dtype autocast would cast it to there (`consumer_cast_dtype`; with fp32 tables the
    product is fp32 otherwise)."""
    cast_to = consumer_cast_dtype(consumer, x)
    if _fusable(x, cos, sin):
        return RopeFunction.apply(x, cos, sin, cast_to or torch.promote_types(x.dtype, cos.dtype))
    y = rope_reference(x, cos, sin)
    return y if cast_to is None else y.to(cast_to)
