"""RMSNorm fused with the residual add before it (the pre-norm transformer pattern).

    rms_norm_residual(x, residual, weight, eps) -> (normed, new_residual)
        new_residual = x + residual                       (in the promoted dtype of the two)
        normed       = new_residual * rsqrt(mean(new_residual^2, -1) + eps) * weight
    rms_norm(x, weight, eps) -> normed                    (the same without a residual)

Inputs [..., hidden] in bf16/fp16/fp32 (x and residual of one shape; under autocast the
residual stream is often fp32 and the branch bf16), weight [hidden]. `normed` has the dtype
the reference returns: the promoted dtype of the inputs, or under autocast whatever the
device's autocast policy makes of the chain (fp32 on CUDA, which runs pow and rsqrt in fp32).

Kernels: the forward reads x and residual once and writes new_residual, normed and one fp32
rstd per row (one program per row, the row in registers: tens of thousands of programs keep
every SM full). The backward runs a few programs per SM, each walking rows and accumulating
its fp32 weight-gradient partial (summed by torch); it reads d_normed, d_new_residual (when
the residual is used later), new_residual and rstd, and writes the input gradient once (x and
residual share it). Each iteration issues the next row's loads before this row's two
reductions, so loads stay in flight while a program computes: without that, the H200
measured the backward at 0.37 ms for 16384 x 4096 bf16 (a third of copy bandwidth), one
program per SM waiting on each row in turn.

Invariants: the normalisation is computed in fp32 from new_residual as stored (rounded to its
dtype), so the forward and the backward see the same values; rows longer than `MAX_ROW_SIZE`
and devices without Triton run `*_reference`, the model's own ops.
"""
from __future__ import annotations

from typing import Any

import torch

from mplan.kernels.dispatch import (
    MAX_ROW_SIZE,
    autocast_result_dtype,
    configs,
    next_power_of_2,
    num_row_programs,
    tl,
    triton,
    use_triton,
)

# Only the warp count is tuned (the block is the row). Forward, one row per program: 2-4 warps
# suit hidden <= 2048, 16 pay off for hidden >= 8192 on H100/H200. Backward: the prefetched row
# doubles the registers of a program (sm_90 at hidden 4096: 244 at 4 warps, 128 at 8, 83 at 16),
# so the tuner weighs warps against programs resident per SM.
_WARPS = configs([triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)], triton.Config({}, num_warps=1))
_BACKWARD_WARPS = configs([triton.Config({}, num_warps=w) for w in (4, 8, 16)], triton.Config({}, num_warps=1))


@triton.autotune(configs=_WARPS, key=["n_cols", "HAS_RESIDUAL"])
@triton.jit
def _forward_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rstd_ptr, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        # rounded to the stream's dtype first: the stored residual is what the norm sees
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=mask)
    s = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_BACKWARD_WARPS, key=["n_cols", "HAS_DSUM"])
@triton.jit
def _backward_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                     HAS_DSUM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    # row `pid` exists: the launch has at most one program per row
    offs = pid.to(tl.int64) * n_cols + cols
    dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    s_next = tl.load(s_ptr + offs, mask=mask, other=0.0)
    dsum_next = dy_next
    if HAS_DSUM:
        dsum_next = tl.load(dsum_ptr + offs, mask=mask, other=0.0)
    rstd_next = tl.load(rstd_ptr + pid)
    for row in range(pid, n_rows, step):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        dy = dy_next.to(tl.float32)
        rstd = rstd_next
        xhat = s_next.to(tl.float32) * rstd
        dsum = dsum_next.to(tl.float32)
        following = row + step
        live = following < n_rows
        next_mask = cols < tl.where(live, n_cols, 0)  # all false past the last row
        next_offs = tl.cast(following, tl.int64) * n_cols + cols
        dy_next = tl.load(dy_ptr + next_offs, mask=next_mask, other=0.0)
        s_next = tl.load(s_ptr + next_offs, mask=next_mask, other=0.0)
        if HAS_DSUM:
            dsum_next = tl.load(dsum_ptr + next_offs, mask=next_mask, other=0.0)
        rstd_next = tl.load(rstd_ptr + following, mask=live, other=0.0)
        g = dy * w
        ds = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DSUM:
            ds += dsum
        tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


class RMSNormResidualFunction(torch.autograd.Function):
    """Triton forward/backward; returns (normed, new_residual), or normed alone when
    `residual` is None. `out_dtype` is normed's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, out_dtype: torch.dtype) -> Any:
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        if residual is not None:
            res2 = residual.contiguous().view(-1, n_cols)
            new_res = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        else:
            res2 = new_res = x2
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        _forward_kernel[(n_rows,)](x2, res2, weight.contiguous(), y, new_res, rstd, n_cols, eps,
                                   HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(n_cols))
        ctx.save_for_backward(new_res, weight, rstd)
        ctx.has_residual, ctx.shape = residual is not None, shape
        ctx.set_materialize_grads(False)
        if residual is None:
            return y.view(shape)
        return y.view(shape), new_res.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dsum: torch.Tensor | None = None) -> Any:
        new_res, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = new_res.shape
        dy2 = torch.zeros_like(new_res) if dy is None else dy.contiguous().view(n_rows, n_cols)
        dsum2 = dsum.contiguous().view(n_rows, n_cols) if dsum is not None else dy2
        dx = torch.empty_like(new_res)
        programs = num_row_programs(n_rows, new_res)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=new_res.device)
        _backward_kernel[(programs,)](dy2, dsum2, new_res, weight.contiguous(), rstd, dx, dw, n_rows, n_cols,
                                      HAS_DSUM=dsum is not None, BLOCK=next_power_of_2(n_cols))
        # autograd casts dx to the dtype of x or residual where it differs (mixed-precision stream)
        dx = dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dw.sum(0).to(weight.dtype), None, None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (mplan.models.layers.RMSNorm), op for op."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    x_dtype, res_dtype, w_dtype = dtypes
    total = torch.ones(1, 2, dtype=x_dtype, device=device) + torch.ones(1, 2, dtype=res_dtype, device=device)
    return rms_norm_reference(total, torch.ones(2, dtype=w_dtype, device=device), 1e-5)


def _normed_dtype(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> torch.dtype:
    res_dtype = x.dtype if residual is None else residual.dtype
    under_autocast = autocast_result_dtype(_probe, x, (x.dtype, res_dtype, weight.dtype))
    return under_autocast or torch.promote_types(torch.promote_types(x.dtype, res_dtype), weight.dtype)


def _fusable(x: torch.Tensor) -> bool:
    return use_triton(x) and x.shape[-1] <= MAX_ROW_SIZE


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); Triton where `use_triton`, else the reference."""
    if _fusable(x) and residual.shape == x.shape:
        return RMSNormResidualFunction.apply(x, residual, weight, eps, _normed_dtype(x, residual, weight))
    return rms_norm_residual_reference(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight; Triton where `use_triton`, else the reference."""
    if _fusable(x):
        return RMSNormResidualFunction.apply(x, None, weight, eps, _normed_dtype(x, None, weight))
    return rms_norm_reference(x, weight, eps)
