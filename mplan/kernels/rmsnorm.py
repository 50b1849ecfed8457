"""RMSNorm fused with the residual add before it (the pre-norm transformer pattern).

    rms_norm_residual(x, residual, weight, eps) -> (normed, new_residual)
        new_residual = x + residual                       (in the input dtype)
        normed       = new_residual * rsqrt(mean(new_residual^2, -1) + eps) * weight
    rms_norm(x, weight, eps) -> normed                    (the same without a residual)

Inputs [..., hidden] in bf16/fp16/fp32 (x and residual of one dtype and shape), weight
[hidden]. `normed` has the promoted dtype of x and weight, as `x * ... * weight` does.

Kernels: the forward reads x and residual once and writes new_residual, normed and one fp32
rstd per row (one program per row, the row in registers). The backward reads d_normed,
d_new_residual (when the residual is used later), new_residual and rstd, writes the input
gradient once (x and residual get the same tensor), and accumulates the weight gradient in
fp32 per program; the [programs, hidden] partials are summed by torch.

Invariants: the normalisation is computed in fp32 from new_residual as stored (rounded to the
input dtype), so the forward and the backward see the same values; rows longer than
`MAX_ROW_SIZE` and devices without Triton run `*_reference`, the model's own ops.
"""
from __future__ import annotations

from typing import Any

import torch

from mplan.kernels.dispatch import MAX_ROW_SIZE, configs, next_power_of_2, num_row_programs, tl, triton, use_triton

# One row per program: only the warp count is tuned (the block is the row). 16 warps pay off
# for hidden >= 8192 on H100/H200; 4 suits hidden <= 2048.
_WARPS = configs([triton.Config({}, num_warps=w) for w in (4, 8, 16)], triton.Config({}, num_warps=1))


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
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offs, x, mask=mask)
    s = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (s * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_WARPS, key=["n_cols", "HAS_DSUM"])
@triton.jit
def _backward_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                     HAS_DSUM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        rstd = tl.load(rstd_ptr + row)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd
        g = dy * w
        ds = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DSUM:
            ds += tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


class RMSNormResidualFunction(torch.autograd.Function):
    """Triton forward/backward; returns (normed, new_residual), or normed alone when
    `residual` is None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> Any:
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        res2 = residual.contiguous().view(-1, n_cols) if residual is not None else x2
        new_res = torch.empty_like(x2) if residual is not None else x2
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
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
        dx = dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dw.sum(0).to(weight.dtype), None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (mplan.models.layers.RMSNorm), op for op."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _fusable(x: torch.Tensor) -> bool:
    return use_triton(x) and x.shape[-1] <= MAX_ROW_SIZE


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); Triton where `use_triton`, else the reference."""
    if _fusable(x):
        return RMSNormResidualFunction.apply(x, residual, weight, eps)
    return rms_norm_residual_reference(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight; Triton where `use_triton`, else the reference."""
    if _fusable(x):
        return RMSNormResidualFunction.apply(x, None, weight, eps)
    return rms_norm_reference(x, weight, eps)
