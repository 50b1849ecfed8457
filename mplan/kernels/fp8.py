"""Optional FP8 linear layer through PyTorch's own `torch._scaled_mm` and one Triton cast kernel.

    fp8_linear(x [..., in], weight [out, in], bias [out] | None, state) -> [..., out] in x's dtype
    Fp8Linear()(x, weight, bias)  the same with its own scaling state (what fuse_kernels inserts)

Recipe (Transformer Engine's delayed scaling, amax history of length 1, HYBRID format):
- per-tensor scales; activations and weights in float8_e4m3fn (more mantissa), gradients in
  float8_e5m2 (more range);
- each tensor is quantized with scale = fp8_max / amax, where amax is the one recorded at the
  previous call (on the first call, the current one: a host-side flag, so nothing ever syncs),
  and the cast records the current amax for the next call; values beyond the range saturate;
- GEMMs: forward y = x W^T (+ bias in the GEMM epilogue) with fast accumulation, backward
  dx = dy W and dW = dy^T x with full-precision accumulation, as TE does; fp8 x fp8 -> the
  activation's dtype. Only the fp8 copies are saved for the backward (half of bf16's bytes).

Kernel: `_cast_kernel` reads a [rows, cols] tile once and writes it as fp8 twice, row-major and
transposed, while folding |x| into the amax with an atomic max: `_scaled_mm` wants its first
operand row-major and its second column-major, so the forward needs x and W as they are and the
backward needs x^T, W^T and dy^T; one pass makes both layouts (a max is idempotent, so the
autotuner's repeated launches leave the amax right). Elsewhere (the CPU, float64) the cast is
`_cast_reference`, the same arithmetic in torch ops; Triton's interpreter rounds fp8 wrongly
(as it does bf16), so the kernel is checked against the reference on the GPU
(benchmarks/kernel_peers/fp8.py) and its layout logic on exactly representable values under the
interpreter.

Where it runs: CUDA devices of compute capability >= 8.9 (Ada, Hopper and later) with GEMM
dimensions that are multiples of 16 (a cuBLASLt requirement). `fp8_linear` raises
`Fp8Unavailable` naming the reason anywhere else; it never falls back silently, because a
silent bf16 GEMM would make an FP8 plan's measured speed a lie. `Fp8LinearFunction` itself
computes on any device that has `torch._scaled_mm` (the CPU included), which tests use.

The scaling state is not part of a checkpoint: after a restart the first call recalibrates
from the current amax, as on the first step (history length 1 makes that one step).
Transformer Engine is the `[fp8]` extra; `transformer_engine_available()` says whether it can
be used and, if not, why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mplan.kernels.dispatch import configs, tl, triton, use_triton

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards (NVIDIA CUDA programming guide)."""

INPUT, WEIGHT, GRAD = 0, 1, 2
"""The three tensors of a linear that are quantized, each with its own scale."""


class Fp8Unavailable(RuntimeError):
    """FP8 GEMMs cannot run here; the message says why."""


@dataclass(slots=True)
class Fp8ScalingState:
    """One linear's amax history (length 1) for its input, weight and output gradient.

    Mutable on purpose (each cast replaces its entry, like TE's fp8 meta) and owned by one
    linear. `amax[i]` is a 0-d fp32 device tensor, None before the first call of role i."""

    amax: list[torch.Tensor | None] = field(default_factory=lambda: [None, None, None])

    def scaling_amax(self, role: int, tensor: torch.Tensor) -> torch.Tensor:
        """The amax `tensor` is scaled by: the recorded one, or (first call) its own."""
        amax = self.amax[role]
        return tensor.detach().abs().amax().float() if amax is None else amax


def fp8_unavailable_reason(device: torch.device, *dims: int) -> str | None:
    """Why FP8 GEMMs cannot run on `device` for these GEMM dimensions; None when they can."""
    if device.type != "cuda":
        return f"FP8 linear needs a CUDA device of compute capability >= 8.9, not {device.type}"
    if not torch.cuda.is_available():
        return "FP8 linear needs CUDA, and torch.cuda.is_available() is False"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"FP8 linear needs compute capability >= 8.9; {name} has {capability[0]}.{capability[1]}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    odd = [d for d in dims if d % 16]
    if odd:
        return f"FP8 GEMM dimensions must be multiples of 16 (cuBLASLt); got {list(dims)}"
    return None


# ---- the cast --------------------------------------------------------------------------------

_TILES = configs([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
                  for m, n, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 256, 8))],
                 triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1))


@triton.autotune(configs=_TILES, key=["n_rows", "n_cols", "TRANSPOSE"])
@triton.jit
def _cast_kernel(x_ptr, y_ptr, yt_ptr, scaling_amax_ptr, inv_scale_ptr, amax_ptr, n_rows, n_cols, fp8_max,
                 TRANSPOSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the scale, computed by every program (IEEE division: the reference's exact value)
    scale = tl.math.div_rn(fp8_max, tl.maximum(tl.load(scaling_amax_ptr), 1.1754943508222875e-38))
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    tl.store(inv_scale_ptr, tl.math.div_rn(1.0, scale), mask=first)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scaled = tl.minimum(tl.maximum(x * scale, -fp8_max), fp8_max)
    y = scaled.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], y, mask=mask)
    if TRANSPOSE:
        tl.store(yt_ptr + cols.to(tl.int64)[None, :] * n_rows + rows[:, None], y, mask=mask)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@dataclass(frozen=True, slots=True)
class Fp8Cast:
    """One tensor cast to fp8, with what `_scaled_mm` and the next call's scaling need."""

    data: torch.Tensor
    """the fp8 tensor, row-major"""
    transposed: torch.Tensor | None
    """the same transposed and contiguous (None unless asked)"""
    inv_scale: torch.Tensor
    """0-d fp32 amax / fp8_max: what `_scaled_mm` multiplies the product by"""
    amax: torch.Tensor
    """0-d fp32 max |x| of the input: the next call's scaling amax"""


def _cast_reference(x: torch.Tensor, scaling_amax: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Fp8Cast:
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / scaling_amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    y = (x.detach().float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return Fp8Cast(y, y.t().contiguous() if transpose else None, scale.reciprocal(), x.detach().abs().amax().float())


def cast_fp8(x: torch.Tensor, scaling_amax: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Fp8Cast:
    """x * (fp8_max / scaling_amax), saturated to fp8, for a 2-D contiguous x: one Triton pass
    (the scale computed in the kernel: no host-side launches for it) where `use_triton`, else
    the torch reference."""
    if not use_triton(x):
        return _cast_reference(x, scaling_amax, dtype, transpose)
    n_rows, n_cols = x.shape
    y = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device)
    yt = torch.empty(n_cols, n_rows, dtype=dtype, device=x.device) if transpose else y
    inv_scale = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(n_cols, meta["BLOCK_N"])

    _cast_kernel[grid](x, y, yt, scaling_amax, inv_scale, amax, n_rows, n_cols, torch.finfo(dtype).max,
                       TRANSPOSE=transpose)
    return Fp8Cast(y, yt if transpose else None, inv_scale, amax)


def _quantize(tensor: torch.Tensor, state: Fp8ScalingState, role: int, dtype: torch.dtype) -> Fp8Cast:
    """`tensor` cast by delayed scaling, both layouts; records its amax for the next call."""
    cast = cast_fp8(tensor.contiguous(), state.scaling_amax(role, tensor), dtype, transpose=True)
    state.amax[role] = cast.amax
    return cast


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with fp8 operands; see the module docstring for the recipe."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: Fp8ScalingState) -> torch.Tensor:
        x8 = _quantize(x.reshape(-1, x.shape[-1]), state, INPUT, E4M3)
        w8 = _quantize(weight, state, WEIGHT, E4M3)
        out = torch._scaled_mm(x8.data, w8.data.t(), scale_a=x8.inv_scale, scale_b=w8.inv_scale, bias=bias,
                               out_dtype=x.dtype, use_fast_accum=x.device.type == "cuda")
        ctx.save_for_backward(x8.transposed, x8.inv_scale, w8.transposed, w8.inv_scale)
        ctx.state, ctx.x_shape, ctx.has_bias, ctx.w_dtype = state, x.shape, bias is not None, weight.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x8_t, x_inv, w8_t, w_inv = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g8 = _quantize(dy2, ctx.state, GRAD, E5M2)
        # x8_t.t() and w8_t.t() are x and W laid out column-major, as _scaled_mm's second operand
        dx = torch._scaled_mm(g8.data, w8_t.t(), scale_a=g8.inv_scale, scale_b=w_inv, out_dtype=dy.dtype)
        dw = torch._scaled_mm(g8.transposed, x8_t.t(), scale_a=g8.inv_scale, scale_b=x_inv, out_dtype=ctx.w_dtype)
        d_bias = dy2.sum(0) if ctx.has_bias else None
        return dx.view(ctx.x_shape), dw, d_bias, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: Fp8ScalingState) -> torch.Tensor:
    """FP8 `F.linear`; raises `Fp8Unavailable` (with the reason) where FP8 GEMMs cannot run."""
    rows = x.numel() // x.shape[-1]
    reason = fp8_unavailable_reason(x.device, rows, x.shape[-1], weight.shape[0])
    if reason is not None:
        raise Fp8Unavailable(reason)
    return Fp8LinearFunction.apply(x, weight, bias, state)


class Fp8Linear:
    """`fp8_linear` with its own `Fp8ScalingState`: one per linear a graph pass rewrites."""

    __name__ = __qualname__ = "fp8_linear"  # what torch.fx names the call in generated code

    def __init__(self) -> None:
        self.state = Fp8ScalingState()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, bias, self.state)


def transformer_engine_available() -> tuple[bool, str]:
    """(usable, why): whether NVIDIA Transformer Engine (the `[fp8]` extra) can be used here."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return False, (f"transformer-engine is not importable ({exc}); it is the optional `mplan[fp8]` extra, "
                       "built against CUDA, and is not installed on this workplace's machines")
    if not torch.cuda.is_available():
        return False, "transformer-engine is installed but no CUDA device is visible"
    return True, "transformer-engine is importable and a CUDA device is visible"
