"""RMSNorm fused with the residual add before it (the pre-norm transformer pattern).

    rms_norm_residual(x, residual, weight, eps) -> (normed, new_residual)
        new_residual = x + residual                       (in the promoted dtype of the two)
        normed       = new_residual * rsqrt(mean(new_residual^2, -1) + eps) * weight
    rms_norm(x, weight, eps) -> normed                    (the same without a residual)
    rms_norm_add(x, residual, weight, eps) -> residual + rmsnorm(x) * weight   (a post-norm, OLMo-2)

rms_norm_residual's `scale` multiplies x before the add (Granite's residual + h * multiplier);
rms_norm's multiplies x before the norm and returns the product too (its embedding_multiplier).

Inputs [..., hidden] in bf16/fp16/fp32 (x and residual of one shape; under autocast the
residual stream is often fp32 and the branch bf16), weight [hidden]. `normed` has the dtype
the reference returns: the promoted dtype of the inputs, or under autocast whatever the
device's autocast policy makes of the chain (fp32 on CUDA, which runs pow and rsqrt in fp32).

Kernels: the forward reads x and residual once and writes new_residual, normed and one fp32
rstd per row (one program per row, the row in registers: tens of thousands of programs keep
every SM full). The backward runs a few programs per SM, each walking tiles of ROWS
consecutive rows (its own first, then every `programs`-th tile) and accumulating its fp32
weight-gradient partial over them (one row of partials per program, summed by torch); it
reads d_normed, d_new_residual (when the residual is used later), new_residual and rstd, and
writes the input gradient once (x and residual share it). Each iteration issues the next
tile's loads before this tile's reductions, so loads stay in flight while a program computes:
without that, the H200 measured the backward at 0.37 ms for 16384 x 4096 bf16 (a third of
copy bandwidth), one program per SM waiting on each row in turn.

Row tiles: with one row per iteration the H200 measured the backward (16384 rows, bf16) at
72% of copy bandwidth (4.22 TB/s) at hidden 2048, where forward and backward took 0.154 ms
against torch.compile's 0.152, 87% at 4096 and 92% at 8192. A short row moves a few KB per
tensor per iteration: too few bytes in flight per SM, and the row reductions and the loop
control of every row dominate. So the tile height ROWS is tuned with the warps (ROWS = 1
kept; 2, 4, 8 where the doubled, prefetched tile fits in registers: `fitting_tiles`), and one
iteration moves ROWS rows and reduces them together. The taller tiles' GPU timing is pending
until the next H200 run.

Invariants: the normalisation is computed in fp32 from new_residual as stored (rounded to its
dtype), so the forward and the backward see the same values; a tile's rows past the last row
load zeros, so they add nothing to the partials and store nothing; rows longer than
`MAX_ROW_SIZE` and devices without Triton run `*_reference`, the model's own ops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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

# Forward, one row per program: only the warp count is tuned (the block is the row); 2-4 warps
# suit hidden <= 2048, 16 pay off for hidden >= 8192 on H100/H200.
_WARPS = configs([triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)], triton.Config({}, num_warps=1))
# Backward: the tile height and the warps are tuned together. ROWS = 1 with 4, 8 or 16 warps is
# the set tuned before tiles came, always offered so that no shape can get slower; the taller
# tiles only where they fit in registers (`fitting_tiles`). The interpreter's tile of 2 rows
# makes its tests run the tile code, partial last tiles included.
BACKWARD_TILES = configs([triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (4, 8, 16)],
                         triton.Config({"ROWS": 2}, num_warps=1))


def fitting_tiles(tiles: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The backward configs worth timing for a launch (Triton's `early_config_prune`): every
    one-row config, and the taller tiles whose prefetched copy does not spill registers.

    Each thread holds ROWS * BLOCK / threads elements of every input tile, twice (this tile and
    the next). Compiled for sm_90 with HAS_DSUM (tests/test_kernels_compile.py's toolchain),
    both kernels: 32 bf16 elements a thread take 218-245 registers of the 255 a thread may
    have, 16 fp32 ones 145-166 and 32 spill; at 16 warps 512 threads share the 64K registers,
    128 each, which 16 bf16 elements just fill. So a thread may hold 64 bytes of each input
    tile, 32 at 16 warps, counted in the wider of the gradient's and the stream's dtypes (they
    differ under autocast). Rows of 8192 bf16 thus get no taller tiles."""
    itemsize = max(named_args["dy_ptr"].element_size(), named_args["s_ptr"].element_size())

    def fits(tile: Any) -> bool:
        bytes_per_thread = tile.kwargs["ROWS"] * kwargs["BLOCK"] * itemsize // (32 * tile.num_warps)
        return bytes_per_thread <= (32 if tile.num_warps >= 16 else 64)

    return [tile for tile in tiles if tile.kwargs["ROWS"] == 1 or fits(tile)]


@triton.autotune(configs=_WARPS, key=["n_cols", "HAS_RESIDUAL"])
@triton.jit
def _forward_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rstd_ptr, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NORM_DTYPE: tl.constexpr = None,
                    scale=1.0, HAS_SCALE: tl.constexpr = False, ADD_AFTER: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:  # Granite's residual_multiplier: the branch scaled in its own dtype, then added
        x = (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        if not HAS_RESIDUAL:  # Granite's embedding_multiplier: the scaled input is the stream
            tl.store(sum_ptr + offs, x, mask=mask)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        # rounded to the stream's dtype first: the stored residual is what the norm sees
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=mask)
    s = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = s * rstd
    if NORM_DTYPE is not None:  # Hugging Face's cast back to the input dtype before the weight
        normed = normed.to(NORM_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_AFTER:  # a post-norm (OLMo-2): residual + normed, normed rounded to y's dtype first (y unwritten)
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        y = (normed * w).to(y_ptr.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
        tl.store(sum_ptr + offs, y.to(sum_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_tile(first_row, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets and mask of the [ROWS, BLOCK] tile of rows `first_row...`; rows past the end
    are masked off, so their loads read zeros and their stores write nothing."""
    rows = first_row + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    return rows, offs, (rows[:, None] < n_rows) & (cols[None, :] < n_cols)


@triton.autotune(configs=BACKWARD_TILES, key=["n_cols", "HAS_DSUM"],
                 prune_configs_by={"early_config_prune": fitting_tiles})
@triton.jit
def _backward_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                     HAS_DSUM: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     NORM_DTYPE: tl.constexpr = None, dscaled_ptr=None, scale=1.0, HAS_SCALE: tl.constexpr = False):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    rows, offs, mask = row_tile(pid * ROWS, n_rows, n_cols, ROWS, BLOCK)
    dy_next = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    s_next = tl.load(s_ptr + offs, mask=mask, other=0.0)
    dsum_next = dy_next
    if HAS_DSUM:
        dsum_next = tl.load(dsum_ptr + offs, mask=mask, other=0.0)
    rstd_next = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    for first_row in range(pid * ROWS, n_rows, step):
        _, offs, mask = row_tile(first_row, n_rows, n_cols, ROWS, BLOCK)
        dy = dy_next.to(tl.float32)
        rstd = rstd_next[:, None]
        xhat = s_next.to(tl.float32) * rstd
        dsum = dsum_next.to(tl.float32)
        next_rows, next_offs, next_mask = row_tile(first_row + step, n_rows, n_cols, ROWS, BLOCK)
        dy_next = tl.load(dy_ptr + next_offs, mask=next_mask, other=0.0)
        s_next = tl.load(s_ptr + next_offs, mask=next_mask, other=0.0)
        if HAS_DSUM:
            dsum_next = tl.load(dsum_ptr + next_offs, mask=next_mask, other=0.0)
        rstd_next = tl.load(rstd_ptr + next_rows, mask=next_rows < n_rows, other=0.0)
        g = dy * w[None, :]
        ds = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / n_cols)[:, None])
        if HAS_DSUM:
            ds += dsum
        tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_SCALE:  # the scaled branch's gradient: the sum's, rounded as stored, times the scale
            dscaled = ds.to(dx_ptr.dtype.element_ty).to(tl.float32) * scale
            tl.store(dscaled_ptr + offs, dscaled.to(dscaled_ptr.dtype.element_ty), mask=mask)
        if NORM_DTYPE is not None:  # the weight multiplied the rounded value
            xhat = xhat.to(NORM_DTYPE).to(tl.float32)
        dw += tl.sum(dy * xhat, axis=0)  # rows past the end loaded dy = 0: they add nothing
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=cols < n_cols)


class RMSNormResidualFunction(torch.autograd.Function):
    """Triton forward/backward; returns (normed, new_residual), or normed alone when
    `residual` is None. `out_dtype` is normed's dtype; `norm_dtype` (bf16 or fp16, or None) the
    dtype the normalized value is rounded to before the weight multiplies it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, out_dtype: torch.dtype, norm_dtype: torch.dtype | None = None,
                scale: float | None = None) -> Any:
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        if residual is not None:
            res2 = residual.contiguous().view(-1, n_cols)
            new_res = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        else:
            res2 = new_res = x2 if scale is None else torch.empty_like(x2)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rounding = _tl_dtype(norm_dtype)
        _forward_kernel[(n_rows,)](x2, res2, weight.contiguous(), y, new_res, rstd, n_cols, eps,
                                   HAS_RESIDUAL=residual is not None, NORM_DTYPE=rounding,
                                   BLOCK=next_power_of_2(n_cols), scale=1.0 if scale is None else scale,
                                   HAS_SCALE=scale is not None)
        ctx.save_for_backward(new_res, weight, rstd)
        ctx.has_residual, ctx.shape, ctx.rounding = residual is not None, shape, rounding
        ctx.scale, ctx.x_dtype = scale, x.dtype
        ctx.set_materialize_grads(False)
        if residual is None and scale is None:
            return y.view(shape)
        return y.view(shape), new_res.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dsum: torch.Tensor | None = None) -> Any:
        new_res, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = new_res.shape
        dy2 = torch.zeros_like(new_res) if dy is None else dy.contiguous().view(n_rows, n_cols)
        dsum2 = dsum.contiguous().view(n_rows, n_cols) if dsum is not None else dy2
        dx = torch.empty_like(new_res)
        dscaled = dx if ctx.scale is None else torch.empty(new_res.shape, dtype=ctx.x_dtype, device=new_res.device)
        programs = num_row_programs(n_rows, new_res)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=new_res.device)
        _backward_kernel[(programs,)](dy2, dsum2, new_res, weight.contiguous(), rstd, dx, dw, n_rows, n_cols,
                                      HAS_DSUM=dsum is not None, NORM_DTYPE=ctx.rounding,
                                      BLOCK=next_power_of_2(n_cols), dscaled_ptr=dscaled,
                                      scale=1.0 if ctx.scale is None else ctx.scale, HAS_SCALE=ctx.scale is not None)
        # autograd casts dx to the dtype of x or residual where it differs (mixed-precision stream)
        dx, dscaled = dx.view(ctx.shape), dscaled.view(ctx.shape)
        return dscaled, (dx if ctx.has_residual else None), sum_partials(dw[None], weight.dtype)[0], None, None, None, None


class RMSNormAddFunction(torch.autograd.Function):
    """Triton forward/backward of `rms_norm_add`: residual + rmsnorm(x) * weight, the normed value
    never stored. The backward is RMSNorm's on x (saved) with the sum's gradient as the normed
    one's; the residual's gradient is the sum's itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                normed_dtype: torch.dtype, norm_dtype: torch.dtype | None = None) -> Any:
        shape, n_cols = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n_cols)
        n_rows = x2.shape[0]
        total = torch.empty(x2.shape, dtype=torch.promote_types(normed_dtype, residual.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rounding = _tl_dtype(norm_dtype)
        # y_ptr only names the dtype the normed value is rounded to before the add: nothing is written there
        rounds_to = torch.empty(0, dtype=normed_dtype, device=x.device)
        _forward_kernel[(n_rows,)](x2, residual.contiguous().view(-1, n_cols), weight.contiguous(), rounds_to, total,
                                   rstd, n_cols, eps, HAS_RESIDUAL=False, NORM_DTYPE=rounding,
                                   BLOCK=next_power_of_2(n_cols), ADD_AFTER=True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.rounding = shape, rounding
        return total.view(shape)

    @staticmethod
    def backward(ctx: Any, dtotal: torch.Tensor) -> Any:
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dtotal.contiguous().view(n_rows, n_cols)
        dx = torch.empty_like(x2)
        programs = num_row_programs(n_rows, x2)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        _backward_kernel[(programs,)](dy2, dy2, x2, weight.contiguous(), rstd, dx, dw, n_rows, n_cols,
                                      HAS_DSUM=False, NORM_DTYPE=ctx.rounding, BLOCK=next_power_of_2(n_cols))
        return dx.view(ctx.shape), dtotal, sum_partials(dw[None], weight.dtype)[0], None, None, None


def _tl_dtype(dtype: torch.dtype | None) -> Any:
    """Triton's dtype of the same name (tl.bfloat16 for torch.bfloat16), or None."""
    return None if dtype is None else getattr(tl, str(dtype).removeprefix("torch."))


_ROUNDED = (torch.bfloat16, torch.float16)
"""The roundings the kernels apply in registers (a cast to fp32 or wider rounds nothing there)."""


@dataclass(frozen=True, slots=True)
class NormForm:
    """How a model writes its RMSNorm around the normalization itself (Hugging Face's casts).

    The normalized value n = s * rsqrt(mean(s^2) + eps) is computed from s = x, or from
    x.to(float32) when `upcast` (Llama, Mistral, Qwen2, Gemma); n is cast to `norm_dtype`
    before the weight multiplies it (Llama's `.to(input_dtype)`); the product is cast to
    `out_dtype` (Gemma's `type_as`). The default form is mplan's own RMSNorm, no casts."""

    upcast: bool = False
    norm_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None


PLAIN = NormForm()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm = PLAIN) -> torch.Tensor:
    """RMSNorm written as `form` says, op for op (mplan.models.layers.RMSNorm by default)."""
    s = x.to(torch.float32) if form.upcast else x
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    if form.norm_dtype is not None:
        normed = normed.to(form.norm_dtype)
    y = normed * weight
    return y if form.out_dtype is None else y.to(form.out_dtype)


def rms_norm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, form: NormForm = PLAIN,
                                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`scale`: the branch x is multiplied by it before the add (Granite's residual_multiplier)."""
    new_residual = (x if scale is None else x * scale) + residual
    return rms_norm_reference(new_residual, weight, eps, form), new_residual


def rms_norm_add_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           form: NormForm = PLAIN) -> torch.Tensor:
    """residual + rmsnorm(x) * weight: a post-norm's sublayer output normed, then added (OLMo-2)."""
    return residual + rms_norm_reference(x, weight, eps, form)


@functools.cache
def _probe(form: NormForm) -> Callable[[torch.device, tuple[torch.dtype, ...]], torch.Tensor]:
    """A reference run on tiny tensors of given dtypes, one function per form (the autocast
    probe caches by function)."""
    def probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
        x_dtype, res_dtype, w_dtype = dtypes
        total = torch.ones(1, 2, dtype=x_dtype, device=device) + torch.ones(1, 2, dtype=res_dtype, device=device)
        return rms_norm_reference(total, torch.ones(2, dtype=w_dtype, device=device), 1e-5, form)
    return probe


def _normed_dtype(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, form: NormForm) -> torch.dtype:
    res_dtype = x.dtype if residual is None else residual.dtype
    dtypes = (x.dtype, res_dtype, weight.dtype)
    return autocast_result_dtype(_probe(form), x, dtypes) or _result_dtype(form, dtypes)


@functools.cache
def _result_dtype(form: NormForm, dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    """What the reference returns outside autocast (probed once per form and dtypes)."""
    with torch.no_grad():
        return _probe(form)(torch.device("meta"), dtypes).dtype


def _fusable(x: torch.Tensor, form: NormForm) -> bool:
    """Triton computes the statistics in fp32 whatever the form; it rounds the normalized value
    only to a 16-bit float (a wider `norm_dtype` is a no-op on fp32 math, so fine too)."""
    wide = form.norm_dtype in (None, torch.float32, torch.float64) or form.norm_dtype in _ROUNDED
    return use_triton(x) and x.shape[-1] <= MAX_ROW_SIZE and wide


def _form(upcast: bool, norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None) -> NormForm:
    return PLAIN if not (upcast or norm_dtype or out_dtype) else NormForm(upcast, norm_dtype, out_dtype)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      consumer: str | None = None, *, upcast: bool = False, norm_dtype: torch.dtype | None = None,
                      out_dtype: torch.dtype | None = None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); Triton where `use_triton`, else the reference.
    `consumer` as in `rms_norm`; `upcast`, `norm_dtype`, `out_dtype` the casts of `NormForm`;
    `scale`: x is the branch x * scale (in x's dtype) instead (Granite's residual_multiplier)."""
    form = _form(upcast, norm_dtype, out_dtype)
    cast_to = consumer_cast_dtype(consumer, x)
    if _fusable(x, form) and residual.shape == x.shape:
        return RMSNormResidualFunction.apply(x, residual, weight, eps, cast_to or _normed_dtype(x, residual, weight, form),
                                             _rounding(form), scale)
    normed, new_residual = rms_norm_residual_reference(x, residual, weight, eps, form, scale)
    return (normed if cast_to is None else normed.to(cast_to)), new_residual


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, upcast: bool = False,
                 norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """residual + rmsnorm(x) * weight in one launch each way; Triton where `use_triton`, else the
    reference. The normed value is rounded to the dtype the model's chain gives it (its casts,
    `NormForm`) before the add, as the chain rounds it. Under autocast with a stream wider than
    that dtype the kernel's backward reads the sum's gradient unrounded (the chain rounds it to
    the normed value's dtype first): a closer gradient, not the same bits."""
    form = _form(upcast, norm_dtype, out_dtype)
    if _fusable(x, form) and residual.shape == x.shape:
        return RMSNormAddFunction.apply(x, residual, weight, eps, _normed_dtype(x, None, weight, form), _rounding(form))
    return rms_norm_add_reference(x, residual, weight, eps, form)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, consumer: str | None = None, *,
             upcast: bool = False, norm_dtype: torch.dtype | None = None,
             out_dtype: torch.dtype | None = None, scale: float | None = None) -> Any:
    """rmsnorm(x) * weight; Triton where `use_triton`, else the reference. `consumer`: what every
    use of the result is ("linear"), so that under autocast it comes out in the dtype autocast
    would cast it to there (`consumer_cast_dtype`); `upcast`, `norm_dtype`, `out_dtype`: the
    casts a model writes around the normalization (`NormForm`). `scale`: the norm of x * scale
    (in x's dtype), returned with it, (normed, x * scale): Granite's embeddings times
    embedding_multiplier, normed and also the residual stream."""
    form = _form(upcast, norm_dtype, out_dtype)
    cast_to = consumer_cast_dtype(consumer, x)
    if _fusable(x, form):
        return RMSNormResidualFunction.apply(x, None, weight, eps, cast_to or _normed_dtype(x, None, weight, form),
                                             _rounding(form), scale)
    scaled = x if scale is None else x * scale
    normed = rms_norm_reference(scaled, weight, eps, form)
    normed = normed if cast_to is None else normed.to(cast_to)
    return normed if scale is None else (normed, scaled)


def _rounding(form: NormForm) -> torch.dtype | None:
    """The 16-bit dtype the kernel rounds the normalized value to, if the form rounds it."""
    return form.norm_dtype if form.norm_dtype in _ROUNDED else None
