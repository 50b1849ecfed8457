"""Bias add fused with GELU (tanh approximation), the GPT MLP's activation after `fc_in`.

    bias_gelu(x, bias) -> gelu_tanh(x + bias)     x [..., features], bias [features]

gelu_tanh(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))), computed as
u * sigmoid(2 sqrt(2/pi) (u + 0.044715 u^3)) (the same function; no cancellation near 0);
the kernels spell the constants out because Triton kernels may not read Python globals:
2 sqrt(2/pi) = 1.5957691216057308, times 3 * 0.044715 = 0.21406444881780076, and times
log2(e) (2.302208198144325) and 0.044715 log2(e) (0.1029432395800235) for an exp2. The
backward's gradient is dy (s + u s (1 - s) dz/du), dz/du = 2 sqrt(2/pi) (1 + 3 * 0.044715 u^2),
written in fused multiply-adds; together with `_gelu_sigmoid` this cut the backward's
instructions by a fifth (1328 -> 1048 SASS instructions for an 8 x 512 tile) and took the
backward on the H200 from 79% to 90% of copy bandwidth at 16384 x 8192, 81% to 94% at
16384 x 16384 (benchmarks/results/kernel_variants_h200-2026-11-29-session4.json): it had
been bound by its instructions, not its bytes.

Kernels: 2-D tiles [rows, features] so the bias is indexed by column without a per-element
division. The forward reads x once and writes y (2 passes, vs 4 for eager add-then-gelu);
the backward recomputes from x and bias, writes dx, and reduces d_bias over rows inside the
kernel: each program walks a slice of rows for one column block, with the next row tile's
loads in flight while it computes this one, and writes one fp32 partial row, summed by
`sum_partials` ([splits, features], ~2% of the traffic).

Invariants: fp32 arithmetic, results rounded once; devices without Triton run
`bias_gelu_reference`, `F.gelu(x + bias, approximate="tanh")`. Under autocast the bias is
first cast to the autocast dtype, on both paths: the bias comes out of a linear (fuse_kernels
splits it off), which autocast would have run in that dtype, bias included.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mplan.kernels.dispatch import autocast_dtype, configs, tl, triton, use_triton
from mplan.kernels.partials import sum_partials

# Tiles of 4-16 K elements: wide in the contiguous feature dim for 16-byte vector loads.
_TILES = configs(
    [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
     for m, n, w in ((8, 512, 4), (16, 512, 8), (32, 256, 8), (16, 1024, 8), (8, 1024, 8), (32, 512, 16))],
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 32}, num_warps=1),
)

# The backward's tiles are shorter: it holds two tiles (this one and the next one's loads).
_BACKWARD_TILES = configs(
    [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w) for m, n, w in ((4, 512, 2), (4, 1024, 4), (8, 512, 4))],
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 32}, num_warps=1),
)

_ROW_SPLITS = 256
"""Row slices of the backward on a GPU: 4096+ programs at 8192 features. On the H200 256
slices beat 32-128 by 1-6% (benchmarks/results/kernel_variants_h200-2026-11-29-session4.json);
their fp32 d_bias partials, [256, features], are ~2% of the backward's traffic."""


@triton.jit
def _gelu_sigmoid(u):
    """s = sigmoid(z), z = 2 sqrt(2/pi) (u + 0.044715 u^3), and s (1 - s), in few instructions:
    z comes pre-scaled by log2(e) for one ex2 of -|z| (in (0, 1], no overflow), one division
    gives 1 / (1 + t) in [1/2, 1), and s (1 - s) = 1/(1+t) * t/(1+t) needs no select."""
    z_log2 = u * (2.302208198144325 + 0.1029432395800235 * u * u)
    t = tl.exp2(-tl.abs(z_log2))
    inv = 1.0 / (1.0 + t)
    small = t * inv
    return tl.where(z_log2 >= 0, inv, small), inv * small

@triton.autotune(configs=_TILES, key=["n_rows", "n_cols"])
@triton.jit
def _forward_kernel(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * n_cols + cols[None, :]
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    sig, _ = _gelu_sigmoid(u)
    tl.store(y_ptr + offs, (u * sig).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_BACKWARD_TILES, key=["n_rows", "n_cols"])
@triton.jit
def _backward_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, n_cols, rows_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_mask = cols < n_cols
    bias = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split.to(tl.int64) * rows_per_split
    end = tl.minimum(first + rows_per_split, n_rows)  # the next split owns the rows after
    rows = first + tl.arange(0, BLOCK_M)
    mask = (rows[:, None] < end) & col_mask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for start in range(0, rows_per_split, BLOCK_M):
        # this tile's math runs while the next tile's loads are in flight
        dy = dy_next.to(tl.float32)
        u = x_next.to(tl.float32) + bias[None, :]
        here, here_mask = offs, mask
        rows = first + start + BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < end) & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
        x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
        sig, sig_one_minus_sig = _gelu_sigmoid(u)
        dz_du = 1.5957691216057308 + 0.21406444881780076 * u * u
        du = dy * (sig + u * sig_one_minus_sig * dz_du)
        tl.store(dx_ptr + here, du.to(dx_ptr.dtype.element_ty), mask=here_mask)
        db += du  # 0 where masked: dy loads as 0
    tl.store(db_ptr + split.to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)


class BiasGeluFunction(torch.autograd.Function):
    """Triton forward/backward of `bias_gelu`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n_cols = x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        bias = bias.contiguous()
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, bias.dtype), device=x.device)
        _forward_kernel[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(n_cols, meta["BLOCK_N"]))](
            x2, bias, y, n_rows, n_cols)
        ctx.save_for_backward(x2, bias)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2, bias = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        splits = min(n_rows, _ROW_SPLITS if x2.is_cuda else 2)
        rows_per_split = triton.cdiv(n_rows, splits)
        dx = torch.empty_like(x2)
        db = torch.empty(splits, n_cols, dtype=torch.float32, device=x2.device)
        _backward_kernel[lambda meta: (triton.cdiv(n_cols, meta["BLOCK_N"]), splits)](
            dy.contiguous().view(n_rows, n_cols), x2, bias, dx, db, n_rows, n_cols, rows_per_split)
        return dx.view(ctx.shape), sum_partials(db[None], bias.dtype)[0]


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GPT's `F.gelu(fc_in(x), approximate="tanh")` with fc_in's bias split out."""
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias); Triton where `use_triton`, else the reference."""
    cast_to = autocast_dtype(x)
    if cast_to is not None and bias.is_floating_point():
        bias = bias.to(cast_to)
    if use_triton(x) and bias.dim() == 1 and bias.shape[0] == x.shape[-1]:
        return BiasGeluFunction.apply(x, bias)
    return bias_gelu_reference(x, bias)
