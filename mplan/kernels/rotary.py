"""Rotary position embedding (RoPE), rotate-half convention, as `mplan.models.layers.apply_rope`.

    rope(x, cos, sin) -> x * cos + rotate_half(x) * sin
        x: [batch, heads, seq, head_dim] (any strides with a contiguous last dim: q/k arrive as a
           transpose of [batch, seq, heads, head_dim] and are read in place, never copied)
        cos, sin: [seq, head_dim] tables (row s is position s); rotate_half(x) = [-x2, x1]
    With x = [x1, x2] split in halves: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.

The backward is the transposed map, which for the rotation tables (c1 = c2, s1 = s2) is the
inverse rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1. One kernel does both.

Kernels read x (or dy) once and write a contiguous [batch, heads, seq, head_dim] result; the
tables are [seq, head_dim] and stay in L2. Arithmetic is fp32.

Invariants: the tables are constants (RoPE buffers): the Triton path gives them no gradient,
so tables that require grad, a non-contiguous last dim, and devices without Triton all run
`rope_reference`, the model's ops.
"""
from __future__ import annotations

from typing import Any

import torch

from mplan.kernels.dispatch import configs, next_power_of_2, tl, triton, use_triton

# [rows, head_dim] tiles of 2-8 K elements for head_dim 128.
_TILES = configs(
    [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((16, 4), (32, 4), (32, 8), (64, 8))],
    triton.Config({"BLOCK_R": 4}, num_warps=1),
)


@triton.autotune(configs=_TILES, key=["n_rows", "half", "BACKWARD"])
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, n_heads, seq, stride_b, stride_h, stride_s,
                 table_stride, half, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    pos = rows % seq
    head = (rows // seq) % n_heads
    batch = rows // (seq * n_heads)
    x_row = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + pos.to(tl.int64) * stride_s
    x_offs = x_row[:, None] + cols[None, :]
    t_offs = pos.to(tl.int64)[:, None] * table_stride + cols[None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_offs = rows.to(tl.int64)[:, None] * (2 * half) + cols[None, :]
    tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype,
            backward: bool) -> torch.Tensor:
    batch, heads, seq, head_dim = x.shape
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows, half = batch * heads * seq, head_dim // 2
    _rope_kernel[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]),)](
        x, cos, sin, y, n_rows, heads, seq, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), half,
        BACKWARD=backward, BLOCK_H=next_power_of_2(half))
    return y


class RopeFunction(torch.autograd.Function):
    """Triton forward/backward of `rope`; no gradient for the tables."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _launch(x, cos, sin, torch.promote_types(x.dtype, cos.dtype), backward=False)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _launch(dy, cos, sin, ctx.x_dtype, backward=True), None, None


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`mplan.models.layers.apply_rope`, op for op."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (use_triton(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[-1] == x.shape[-1]
            and cos.shape[0] == x.shape[2] and cos.stride(-1) == 1 and sin.stride() == cos.stride()
            and not (cos.requires_grad or sin.requires_grad))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; Triton where `use_triton` (and the layout fits), else the reference."""
    if _fusable(x, cos, sin):
        return RopeFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
