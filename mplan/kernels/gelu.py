"""Bias add fused with GELU (tanh approximation), the GPT MLP's activation after `fc_in`.

    bias_gelu(x, bias) -> gelu_tanh(x + bias)     x [..., features], bias [features]

gelu_tanh(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))), computed as
u * sigmoid(2 sqrt(2/pi) (u + 0.044715 u^3)) (the same function; no cancellation near 0);
the kernels spell the constants out (2 sqrt(2/pi) = 1.5957691216057308, 3 * 0.044715 =
0.134145) because Triton kernels may not read Python globals.

Kernels: 2-D tiles [rows, features] so the bias is indexed by column without a per-element
division. The forward reads x once and writes y (2 passes, vs 4 for eager add-then-gelu);
the backward recomputes from x and bias, writes dx, and reduces d_bias over rows inside the
kernel: each program walks a slice of rows for one column block and writes one fp32 partial
row, summed by torch ([splits, features], well under 1% of the traffic).

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
from mplan.kernels.sigmoid import sigmoid_and_complement

# Tiles of 4-16 K elements: wide in the contiguous feature dim for 16-byte vector loads.
_TILES = configs(
    [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
     for m, n, w in ((8, 512, 4), (16, 512, 8), (32, 256, 8), (16, 1024, 8), (8, 1024, 8), (32, 512, 16))],
    triton.Config({"BLOCK_M": 4, "BLOCK_N": 32}, num_warps=1),
)

_ROW_SPLITS = 64
"""Row slices of the backward on a GPU: with >= 16 column blocks this is >= 1024 programs,
several per SM, while the d_bias partials stay [64, features]."""


@triton.autotune(configs=_TILES, key=["n_rows", "n_cols"])
@triton.jit
def _forward_kernel(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * n_cols + cols[None, :]
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    z = 1.5957691216057308 * (u + 0.044715 * u * u * u)
    tl.store(y_ptr + offs, (u * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_TILES, key=["n_rows", "n_cols"])
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
    for start in range(0, rows_per_split, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < end) & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        z = 1.5957691216057308 * (u + 0.044715 * u * u * u)
        sig, one_minus_sig = sigmoid_and_complement(z)
        dz_du = 1.5957691216057308 * (1.0 + 0.134145 * u * u)
        du = dy * (sig + u * sig * one_minus_sig * dz_du)
        tl.store(dx_ptr + offs, du.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.where(mask, du, 0.0)
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
