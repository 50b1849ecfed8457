"""Optional FP8 linear layer through PyTorch's own `torch._scaled_mm` (no Triton, no extra package).

    fp8_linear(x [..., in], weight [out, in], bias [out] | None, state) -> [..., out] in x's dtype

Recipe (Transformer Engine's delayed scaling with an amax history of length 1):
- per-tensor scales; activations and weights in float8_e4m3fn (more mantissa), gradients in
  float8_e5m2 (more range), as in TE's HYBRID format;
- each tensor is quantized with scale = fp8_max / amax, where amax is the one recorded at the
  previous step (the current one on the first step), then the current amax is recorded in the
  fp32 `Fp8ScalingState`; values beyond the range saturate. Nothing syncs with the host.
- GEMMs: forward y = x W^T, backward dx = dy W and dW = dy^T x, all as fp8 x fp8 -> x.dtype
  with fp32 accumulation (`use_fast_accum` off); the saved activations are the fp8 copies.

Where it runs: CUDA devices of compute capability >= 8.9 (Ada, Hopper and later), with GEMM
dimensions that are multiples of 16 (a cuBLASLt requirement). Anywhere else `fp8_linear`
raises `Fp8Unavailable` naming the reason; it never falls back silently, because a silent
bf16 GEMM would make an FP8 plan's measured speed a lie.

Transformer Engine is the `[fp8]` extra; `transformer_engine_available()` says whether it can
be used and, if not, why (it is not installed on this workplace's CPU machines or its H200).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards (NVIDIA CUDA programming guide)."""

_INPUT, _WEIGHT, _GRAD = 0, 1, 2


class Fp8Unavailable(RuntimeError):
    """FP8 GEMMs cannot run here; the message says why."""


@dataclass(slots=True)
class Fp8ScalingState:
    """Per-layer scaling state: the last amax of the input, weight and output gradient.

    Deliberately mutable (updated in place by every forward/backward, like TE's fp8 meta) and
    owned by one layer, never shared globally. 0 means "no history yet"."""

    amax: torch.Tensor
    """fp32 [3]: input, weight, grad_output amax of the previous step (history length 1)"""

    @classmethod
    def create(cls, device: torch.device | str) -> Fp8ScalingState:
        return cls(amax=torch.zeros(3, dtype=torch.float32, device=device))


def fp8_unavailable_reason(device: torch.device, *dims: int) -> str | None:
    """Why FP8 GEMMs cannot run on `device` for these GEMM dimensions; None when they can."""
    if device.type != "cuda":
        return f"FP8 linear needs a CUDA device of compute capability >= 8.9; the tensors are on {device.type}"
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


def _quantize(tensor: torch.Tensor, state: Fp8ScalingState, slot: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, fp32 inverse scale) by delayed scaling; records the current amax in `state`."""
    fp8_max = torch.finfo(dtype).max
    current = tensor.detach().abs().amax().float()
    previous = state.amax[slot]
    amax = torch.where(previous > 0, previous, current).clamp(min=torch.finfo(torch.float32).tiny)
    scale = fp8_max / amax
    quantized = (tensor.detach().float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    state.amax[slot] = current
    return quantized, scale.reciprocal()


def _column_major(tensor: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major: `_scaled_mm` wants its second operand so."""
    return tensor.t().contiguous().t()


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with fp8 operands; see the module docstring for the recipe."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: Fp8ScalingState) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = _quantize(x2, state, _INPUT, E4M3)
        w8, w_inv = _quantize(weight, state, _WEIGHT, E4M3)
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.state, ctx.x_shape, ctx.has_bias, ctx.w_dtype = state, x.shape, bias is not None, weight.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g8, g_inv = _quantize(dy2, ctx.state, _GRAD, E5M2)
        dx = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=dy.dtype)
        dw = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv,
                              out_dtype=ctx.w_dtype)
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


def transformer_engine_available() -> tuple[bool, str]:
    """(usable, why): whether NVIDIA Transformer Engine (the `[fp8]` extra) can run here."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return False, (f"transformer-engine is not importable ({exc}); it is the optional `mplan[fp8]` extra, "
                       "built against CUDA, and is not installed on this workplace's machines")
    if not torch.cuda.is_available():
        return False, "transformer-engine is installed but no CUDA device is visible"
    return True, "transformer-engine is importable and a CUDA device is visible"
