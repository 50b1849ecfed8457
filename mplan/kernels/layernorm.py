"""LayerNorm fused with the residual add before it (GPT's pre-LayerNorm blocks), or alone.

    layer_norm_residual(x, residual, weight, bias, eps) -> (normed, new_residual)
        new_residual = x + residual                                   (in the input dtype)
        normed       = (new_residual - mean) * rsqrt(var + eps) * weight + bias   (over the last dim)
    layer_norm(x, weight, bias, eps) -> normed                        (the same without a residual)

`third=`: new_residual = (x + residual) + third, a parallel block's residual + attn + mlp
(Cohere, GPT-NeoX), each sum rounded to the stream's dtype as the two adds round it.

`weight=None` (and `bias=None`): a LayerNorm without parameters (OLMo-1's), normed = the
standardized row itself.

Hand-written forms (`hand_written=True`, `LayerNormForm`): a model that writes its LayerNorm as
ATen ops rather than calling F.layer_norm (Cohere: no bias, x.float(), mean, (x - mean)^2's
mean, (x - mean) * rsqrt(var + eps), weight.float() * h, .to(input_dtype)) gets the same
kernels, its casts as keywords; its reference is then that chain op for op. F.layer_norm with
casts around it (`upcast`, `out_dtype` without `hand_written`: OLMo-1's
F.layer_norm(x.to(float32), ...).to(input_dtype)) gets them as keywords too. `layer_norm` alone
is fused only in such forms: F.layer_norm alone is already one ATen kernel.

Inputs [..., hidden] in bf16/fp16/fp32 (x and residual of one shape; their dtypes may differ,
as under autocast, and new_residual takes the promoted one), weight and bias [hidden] (either
may be None). `normed` has new_residual's dtype, as `F.layer_norm` returns, or under autocast
whatever the device's policy makes of layer_norm (fp32 on CUDA).

Kernels: the forward reads x and residual once, writes new_residual, normed and two fp32
numbers per row (mean, rstd); one program per row with the row in registers. The backward
runs a few programs per SM, each walking tiles of ROWS consecutive rows, reading d_normed,
d_new_residual (when used later), new_residual, mean and rstd, writing the input gradient once
(x and residual share it) and accumulating the weight and bias gradients over the tile's rows
in fp32 ([programs, hidden] partials summed by `sum_partials`); it issues the next tile's loads
before this tile's reductions (see rmsnorm.py: a program that waits on each row in turn leaves
most of the bandwidth idle). The tiles and their tuning are rmsnorm.py's: with one row per
iteration the H200 measured this backward (16384 rows, bf16) at 58% of copy bandwidth at
hidden 2048, 77% at 4096 and 82% at 8192; with the row tiles and `sum_partials`, 85 / 91 / 90%
(benchmarks/results/kernels_h200-2026-11-29-norms-sum-partials.json).

Under autocast with `consumer="linear"` (fuse_kernels' mark: the normed output feeds only
linears) normed comes out in the autocast dtype, which the linear would cast it to anyway.

Invariants: statistics are computed in fp32 (two-pass over the register-resident row, so no
cancellation) from new_residual as stored; rows longer than `MAX_ROW_SIZE` and devices
without Triton run `layer_norm_residual_reference`, i.e. `x + residual` then `F.layer_norm`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mplan.kernels.dispatch import (
    MAX_ROW_SIZE,
    autocast_result_dtype,
    configs,
    consumer_cast_dtype,
    next_power_of_2,
    num_row_programs,
    tl,
    triton,
    use_triton,
)
from mplan.kernels.partials import sum_partials
from mplan.kernels.rmsnorm import BACKWARD_TILES, fitting_tiles, row_tile

# the forward tunes only its warp count; the backward takes rmsnorm.py's row tiles (their
# register pruning was measured on both backwards)
_WARPS = configs([triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)], triton.Config({}, num_warps=1))


@triton.autotune(configs=_WARPS, key=["n_cols", "HAS_BIAS", "HAS_RESIDUAL", "HAS_WEIGHT"])
@triton.jit
def _forward_kernel(x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr, mean_ptr, rstd_ptr, n_cols, eps,
                    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr = True,
                    third_ptr=None, HAS_THIRD: tl.constexpr = False, HAS_WEIGHT: tl.constexpr = True):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    s_stored = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        s_stored = (s_stored.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        if HAS_THIRD:
            t = tl.load(third_ptr + offs, mask=mask, other=0.0)
            s_stored = (s_stored.to(tl.float32) + t.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, s_stored, mask=mask)
    s = s_stored.to(tl.float32)
    mean = tl.sum(s, axis=0) / n_cols
    centred = tl.where(mask, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    y = centred * rstd
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=BACKWARD_TILES, key=["n_cols", "HAS_DSUM", "HAS_WEIGHT"],
                 prune_configs_by={"early_config_prune": fitting_tiles})
@triton.jit
def _backward_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                     n_rows, n_cols, HAS_DSUM: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr = True):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    cols = tl.arange(0, BLOCK)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, dtype=tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    rows, offs, mask = row_tile(pid * ROWS, n_rows, n_cols, ROWS, BLOCK)
    dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    s_next = tl.load(s_ptr + offs, mask=mask, other=0.0)
    dsum_next = dy_next
    if HAS_DSUM:
        dsum_next = tl.load(dsum_ptr + offs, mask=mask, other=0.0)
    mean_next = tl.load(mean_ptr + rows, mask=rows < n_rows, other=0.0)
    rstd_next = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    for first_row in range(pid * ROWS, n_rows, step):
        _, offs, mask = row_tile(first_row, n_rows, n_cols, ROWS, BLOCK)
        dy = dy_next.to(tl.float32)
        rstd = rstd_next[:, None]
        xhat = tl.where(mask, (s_next.to(tl.float32) - mean_next[:, None]) * rstd, 0.0)
        dsum = dsum_next.to(tl.float32)
        next_rows, next_offs, next_mask = row_tile(first_row + step, n_rows, n_cols, ROWS, BLOCK)
        dy_next = tl.load(dy_ptr + next_offs, mask=next_mask, other=0.0)
        s_next = tl.load(s_ptr + next_offs, mask=next_mask, other=0.0)
        if HAS_DSUM:
            dsum_next = tl.load(dsum_ptr + next_offs, mask=next_mask, other=0.0)
        mean_next = tl.load(mean_ptr + next_rows, mask=next_rows < n_rows, other=0.0)
        rstd_next = tl.load(rstd_ptr + next_rows, mask=next_rows < n_rows, other=0.0)
        g = dy * w[None, :]
        mean_g = tl.sum(g, axis=1)[:, None] / n_cols
        ds = rstd * (g - mean_g - xhat * (tl.sum(g * xhat, axis=1)[:, None] / n_cols))
        if HAS_DSUM:
            ds += dsum
        tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
        # rows past the end loaded dy = 0: they add nothing
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    partial = pid.to(tl.int64) * n_cols + cols
    tl.store(dw_ptr + partial, dw, mask=cols < n_cols)
    tl.store(db_ptr + partial, db, mask=cols < n_cols)


class LayerNormResidualFunction(torch.autograd.Function):
    """Triton forward/backward of `layer_norm_residual`; of `layer_norm` when `residual` is None
    (then it returns normed alone, and the backward reads x where it read new_residual). Without
    a weight or bias the kernels skip it, and no partials of its gradient are summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype, third: torch.Tensor | None = None) -> Any:
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        if residual is not None:
            res2 = residual.contiguous().view(-1, n_cols)
            new_res = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        else:
            res2 = new_res = x2
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        _forward_kernel[(n_rows,)](x2, res2, x2 if weight is None else weight.contiguous(),
                                   x2 if bias is None else bias.contiguous(), y, new_res, mean, rstd,
                                   n_cols, eps, HAS_BIAS=bias is not None, BLOCK=next_power_of_2(n_cols),
                                   HAS_RESIDUAL=residual is not None,
                                   third_ptr=x2 if third is None else third.contiguous().view(-1, n_cols),
                                   HAS_THIRD=third is not None, HAS_WEIGHT=weight is not None)
        ctx.save_for_backward(new_res, weight, mean, rstd)
        ctx.shape, ctx.has_bias, ctx.has_residual = shape, bias is not None, residual is not None
        ctx.has_third = third is not None
        ctx.param_dtype = next((p.dtype for p in (weight, bias) if p is not None), None)  # of d_weight, d_bias
        ctx.set_materialize_grads(False)
        if residual is None:
            return y.view(shape)
        return y.view(shape), new_res.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dsum: torch.Tensor | None = None) -> Any:
        new_res, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = new_res.shape
        dy2 = torch.zeros_like(new_res) if dy is None else dy.contiguous().view(n_rows, n_cols)
        dsum2 = dsum.contiguous().view(n_rows, n_cols) if dsum is not None else dy2
        dx = torch.empty_like(new_res)
        programs = num_row_programs(n_rows, new_res)
        partials = torch.empty(2, programs, n_cols, dtype=torch.float32, device=new_res.device)  # dw, db
        _backward_kernel[(programs,)](dy2, dsum2, new_res, new_res if weight is None else weight.contiguous(), mean,
                                      rstd, dx, partials[0], partials[1], n_rows, n_cols,
                                      HAS_DSUM=dsum is not None, BLOCK=next_power_of_2(n_cols),
                                      HAS_WEIGHT=weight is not None)
        # autograd casts dx to the dtype of x or residual where it differs (mixed-precision stream)
        dx = dx.view(ctx.shape)
        first, end = (0 if weight is not None else 1), (2 if ctx.has_bias else 1)  # the partials of dw, db kept
        sums = iter(sum_partials(partials[first:end], ctx.param_dtype) if first < end else ())
        d_weight = next(sums) if weight is not None else None
        d_bias = next(sums) if ctx.has_bias else None
        return (dx, (dx if ctx.has_residual else None), d_weight, d_bias, None, None, (dx if ctx.has_third else None))


@dataclass(frozen=True, slots=True)
class LayerNormForm:
    """A LayerNorm with the casts a model writes around it: s = x.to(float32) when `upcast`,
    else x; then, `hand_written` (as ATen ops, no bias), n = (s - mean) * rsqrt(mean((s - mean)^2)
    + eps) and y = w * n, w = weight.to(float32) when `weight_upcast`; else y = F.layer_norm(s, ...,
    weight, bias, eps); y.to(`out_dtype`) when given."""

    upcast: bool = False
    weight_upcast: bool = False
    out_dtype: torch.dtype | None = None
    hand_written: bool = True


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                         form: LayerNormForm | None = None) -> torch.Tensor:
    """`F.layer_norm` over the last dim (`form` None), or the chain `form` describes, op for op."""
    if form is None:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    s = x.to(torch.float32) if form.upcast else x
    if form.hand_written:
        mean = s.mean(-1, keepdim=True)
        variance = (s - mean).pow(2).mean(-1, keepdim=True)
        y = (weight.to(torch.float32) if form.weight_upcast else weight) * ((s - mean) * torch.rsqrt(variance + eps))
        if bias is not None:
            y = y + bias
    else:
        y = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return y if form.out_dtype is None else y.to(form.out_dtype)


def layer_norm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                  bias: torch.Tensor | None, eps: float, form: LayerNormForm | None = None,
                                  third: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + residual` (`+ third`), then the LayerNorm over the last dim: the unfused graph, op for op."""
    new_residual = x + residual
    if third is not None:
        new_residual = new_residual + third
    return layer_norm_reference(new_residual, weight, bias, eps, form), new_residual


@functools.cache
def _probe(form: LayerNormForm | None,
           weighted: bool = True) -> Callable[[torch.device, tuple[torch.dtype, ...]], torch.Tensor]:
    """A reference run on tiny tensors of given dtypes, one function per form, with a weight or
    without (the autocast probe caches by function)."""
    def probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
        x_dtype, res_dtype, w_dtype = dtypes
        total = torch.ones(1, 2, dtype=x_dtype, device=device) + torch.ones(1, 2, dtype=res_dtype, device=device)
        weight = torch.ones(2, dtype=w_dtype, device=device) if weighted else None
        return layer_norm_reference(total, weight, None if form else weight, 1e-5, form)
    return probe


@functools.cache
def _result_dtype(form: LayerNormForm | None, weighted: bool, dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    """What the reference returns outside autocast (probed once per form and dtypes, on meta)."""
    with torch.no_grad():
        return _probe(form, weighted)(torch.device("meta"), dtypes).dtype


def _form(hand_written: bool, upcast: bool, weight_upcast: bool, out_dtype: torch.dtype | None) -> LayerNormForm | None:
    """The form the keywords describe; None for F.layer_norm without casts."""
    if not (hand_written or upcast or weight_upcast or out_dtype is not None):
        return None
    return LayerNormForm(upcast, weight_upcast, out_dtype, hand_written)


def _normed_dtype(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  form: LayerNormForm | None) -> torch.dtype:
    dtypes = (x.dtype, x.dtype if residual is None else residual.dtype, x.dtype if weight is None else weight.dtype)
    probe = _probe(form, weight is not None)
    if form is None:  # F.layer_norm returns its input's dtype outside autocast
        return autocast_result_dtype(probe, x, dtypes) or torch.promote_types(*dtypes[:2])
    return autocast_result_dtype(probe, x, dtypes) or _result_dtype(form, weight is not None, dtypes)


def layer_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float, consumer: str | None = None, *, hand_written: bool = False,
                        upcast: bool = False, weight_upcast: bool = False, out_dtype: torch.dtype | None = None,
                        third: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(x + residual), x + residual); Triton where `use_triton`, else the reference.
    `consumer`: what every use of the normed output is ("linear"), so that under autocast it
    comes out in the dtype autocast would cast it to there (`consumer_cast_dtype`).
    `hand_written`: the model writes the norm as ATen ops; `upcast`, `weight_upcast` (hand-written
    only), `out_dtype`: the casts around it (`LayerNormForm`). `third`: a third addend, added to the sum
    (Triton only where its shape and dtype are x's and residual's)."""
    form = _form(hand_written, upcast, weight_upcast, out_dtype)
    cast_to = consumer_cast_dtype(consumer, x)
    third_fits = third is None or (third.shape == x.shape and third.dtype == x.dtype == residual.dtype)
    if use_triton(x) and x.shape[-1] <= MAX_ROW_SIZE and residual.shape == x.shape and third_fits:
        return LayerNormResidualFunction.apply(x, residual, weight, bias, eps,
                                               cast_to or _normed_dtype(x, residual, weight, form), third)
    normed, new_residual = layer_norm_residual_reference(x, residual, weight, bias, eps, form, third)
    return (normed if cast_to is None else normed.to(cast_to)), new_residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               consumer: str | None = None, *, hand_written: bool = False, upcast: bool = False,
               weight_upcast: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """layernorm(x) over the last dim; Triton where `use_triton`, else the reference. Keywords as
    for `layer_norm_residual`."""
    form = _form(hand_written, upcast, weight_upcast, out_dtype)
    cast_to = consumer_cast_dtype(consumer, x)
    if use_triton(x) and x.shape[-1] <= MAX_ROW_SIZE:
        return LayerNormResidualFunction.apply(x, None, weight, bias, eps, cast_to or _normed_dtype(x, None, weight, form))
    normed = layer_norm_reference(x, weight, bias, eps, form)
    return normed if cast_to is None else normed.to(cast_to)
