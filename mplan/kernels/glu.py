"""SwiGLU activation: silu(gate) * up, for gate and up produced by two separate linears (Llama).

    swiglu(gate, up) -> silu(gate) * up          gate, up: same shape, bf16/fp16/fp32

Kernels: elementwise over the flattened tensors. The forward reads gate and up once and
writes the product (3 tensor passes, vs 4 for eager silu-then-mul); the backward recomputes
sigmoid(gate) and writes d_gate and d_up from one read of d_out, gate and up (5 passes).
Arithmetic is fp32, results are rounded once to the output dtype (the promoted input dtype).

Invariants: devices without Triton run `swiglu_reference`, `F.silu(gate) * up`, op for op.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mplan.kernels.dispatch import configs, tl, triton, use_triton
from mplan.kernels.sigmoid import sigmoid_and_complement

# Memory-bound elementwise: large blocks keep enough bytes in flight per SM; 4096 x 8 warps is
# what Inductor-like schedules settle on for 1e8-element tensors on H100-class parts.
_BLOCKS = configs(
    [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16))],
    triton.Config({"BLOCK": 128}, num_warps=1),
)


@triton.autotune(configs=_BLOCKS, key=["n_elements"])
@triton.jit
def _forward_kernel(g_ptr, u_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_BLOCKS, key=["n_elements"])
@triton.jit
def _backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig, one_minus_sig = sigmoid_and_complement(g)
    tl.store(dg_ptr + offs, (dy * u * sig * (1.0 + g * one_minus_sig)).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * g * sig).to(du_ptr.dtype.element_ty), mask=mask)


def _grid(n_elements: int) -> Any:
    return lambda meta: (triton.cdiv(n_elements, meta["BLOCK"]),)


class SwiGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `swiglu`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
        _forward_kernel[_grid(gate.numel())](gate, up, y, gate.numel())
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _backward_kernel[_grid(gate.numel())](dy.contiguous(), gate, up, d_gate, d_up, gate.numel())
        return d_gate, d_up


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's `F.silu(gate_proj(x)) * up_proj(x)` on the two projections."""
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; Triton where `use_triton` (and the shapes agree), else the reference."""
    if use_triton(gate) and gate.shape == up.shape:
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)
