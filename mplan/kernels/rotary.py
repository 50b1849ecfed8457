"""Rotary position embedding (RoPE), rotate-half convention, as `mplan.models.layers.apply_rope`.

    rope(x, cos, sin) -> x * cos + rotate_half(x) * sin
        x: [batch, heads, seq, head_dim] (any strides with a contiguous last dim: q/k arrive as a
           transpose of [batch, seq, heads, head_dim] and are read in place, never copied)
        cos, sin: [seq, head_dim] tables (row s is position s); rotate_half(x) = [-x2, x1]
    With x = [x1, x2] split in halves: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.

The backward is the transposed map, which for the rotation tables (c1 = c2, s1 = s2) is the
inverse rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1. One kernel does both.

Kernel: each program takes a [heads, positions, head_dim / 2] tile pair of one batch element
(grid: position blocks x head groups x batch, so no index is ever divided), loads its four
table tiles once and applies them to every head of the group. Why this shape: the H200
measured a row-per-program version at 52% of copy bandwidth (torch.compile: 93%), paying a
runtime integer division per row for (batch, head, position) and re-reading the tables from L2
for every head, twice the x bytes. All loads of a tile are issued together, 16-byte vectors
along head_dim. Arithmetic is fp32.

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

from mplan.kernels.dispatch import configs, next_power_of_2, tl, triton, use_triton

# [heads, positions] per program, for head_dim 128 (64-wide halves): 2-8 K elements in all;
# more heads per program reuse the tables more, more positions make longer runs. Larger tiles
# were left out: at 16 K elements sm_90 needs 200 registers a thread (one program per SM), and
# fewer than 16 positions make the compiler shuffle the tile through shared memory.
_TILES = configs(
    [triton.Config({"BLOCK_HEADS": h, "BLOCK_S": s}, num_warps=w)
     for h, s, w in ((1, 32, 4), (1, 64, 4), (2, 16, 4), (2, 32, 4), (4, 16, 4), (2, 64, 8),
                     (4, 32, 8))],
    triton.Config({"BLOCK_HEADS": 2, "BLOCK_S": 4}, num_warps=1),
)


@triton.autotune(configs=_TILES, key=["n_heads", "seq", "half", "BACKWARD"])
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, seq, half, x_stride_b, x_stride_h, x_stride_s,
                 y_stride_b, y_stride_h, y_stride_s, table_stride,
                 BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    table_mask = (pos < seq)[:, None] & (cols < half)[None, :]
    t_offs = pos.to(tl.int64)[:, None] * table_stride + cols[None, :]
    c1 = tl.load(cos_ptr + t_offs, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    c2 = tl.load(cos_ptr + t_offs + half, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    s1 = tl.load(sin_ptr + t_offs, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    s2 = tl.load(sin_ptr + t_offs + half, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    mask = (heads < n_heads)[:, None, None] & table_mask[None, :, :]
    head64 = heads.to(tl.int64)[:, None, None]
    pos64 = pos.to(tl.int64)[None, :, None]
    x_offs = batch * x_stride_b + head64 * x_stride_h + pos64 * x_stride_s + cols[None, None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_offs = batch * y_stride_b + head64 * y_stride_h + pos64 * y_stride_s + cols[None, None, :]
    tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, backward: bool) -> None:
    batch, heads, seq, head_dim = src.shape

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return triton.cdiv(seq, meta["BLOCK_S"]), triton.cdiv(heads, meta["BLOCK_HEADS"]), batch

    _rope_kernel[grid](src, cos, sin, dst, heads, seq, head_dim // 2, *src.stride()[:3], *dst.stride()[:3],
                       cos.stride(0), BACKWARD=backward, BLOCK_HALF=next_power_of_2(head_dim // 2))


def _dense_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of x's shape with x's dimension order, dense even where x is not (q/k as a
    slice of a grouped q/k/v projection, [batch, seq, (q|k|v) heads * head_dim] transposed):
    torch.empty_like would fall back to contiguous [batch, heads, seq, head_dim] there."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first (a stable sort)
    base = torch.empty([x.shape[d] for d in order], dtype=dtype, device=x.device)
    return base.permute([order.index(d) for d in range(x.dim())])


class RopeFunction(torch.autograd.Function):
    """Triton forward/backward of `rope`; no gradient for the tables."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = _dense_like(x, torch.promote_types(x.dtype, cos.dtype))
        _launch(x, cos, sin, y, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype, ctx.layout = x.dtype, y.stride()
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty_strided(dy.shape, ctx.layout, dtype=ctx.x_dtype, device=dy.device)
        _launch(dy, cos, sin, dx, backward=True)
        return dx, None, None


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`mplan.models.layers.apply_rope`, op for op."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and x.shape[0] < 65536 and x.shape[1] < 65536  # CUDA grid limits on axes 1 and 2
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[-1] == x.shape[-1]
            and cos.shape[0] == x.shape[2] and cos.stride(-1) == 1 and sin.stride() == cos.stride()
            and not (cos.requires_grad or sin.requires_grad))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; Triton where `use_triton` (and the layout fits), else the reference."""
    if _fusable(x, cos, sin):
        return RopeFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
