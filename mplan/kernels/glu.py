"""SwiGLU activation: silu(gate) * up, for gate and up produced by two linears (Llama).

    swiglu(gate, up) -> silu(gate) * up          gate, up: same shape, bf16/fp16/fp32
    swiglu_packed(y) -> silu(y[..., :F]) * y[..., F:]   y [..., 2F]: gate and up from ONE GEMM

The packed form is what fuse_kernels uses once the gate and up projections run as one GEMM:
its backward writes d_gate and d_up straight into one [..., 2F] gradient, the layout that
GEMM's backward reads, where two separate gradients would first be concatenated (a copy).

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

# The forward runs one 16-byte vector per thread and tensor, 1024 elements on 4 warps, as
# Inductor's pointwise kernel does: on the H200 every other block size was 0.4-5% slower at both
# Llama widths in three runs, and offering them let the autotuner's single samples pick 2048 x 4
# (0.7% behind torch.compile at F 5632,
# benchmarks/results/kernels_h200-2026-11-29-session7-first.json).
_FORWARD_BLOCKS = configs([triton.Config({"BLOCK": 1024}, num_warps=4)], triton.Config({"BLOCK": 128}, num_warps=1))
# The backward (three loads, two stores) is tuned over larger blocks as well.
_BLOCKS = configs(
    [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16))],
    triton.Config({"BLOCK": 128}, num_warps=1),
)


@triton.autotune(configs=_FORWARD_BLOCKS, key=["n_elements"])
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


# [rows, columns] tiles of the packed halves, on a 1-D grid whose consecutive programs walk
# one row's columns (one row's gate and up runs are F apart). The H200 measured this order
# 3-4% faster than rows on grid axis 0 (consecutive programs 2F apart): 0.320 vs 0.333 ms for
# the 16384 x 2 x 14336 bf16 forward, equal to torch.compile's 0.320
# (benchmarks/results/kernel_variants_h200-2026-11-29.json). Its best tiles are listed first.
_TILES = configs(
    [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w)
     for m, n, w in ((1, 2048, 8), (1, 1024, 4), (1, 4096, 8), (2, 2048, 8), (4, 512, 4), (8, 512, 8))],
    triton.Config({"BLOCK_M": 2, "BLOCK_N": 16}, num_warps=1),
)


@triton.jit
def _tile(n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows [BLOCK_M, 1], columns [1, BLOCK_N] and mask: column blocks vary fastest."""
    col_blocks = tl.cdiv(half, BLOCK_N)
    pid = tl.program_id(0)
    rows = ((pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return rows, cols, (rows < n_rows) & (cols < half)


@triton.autotune(configs=_TILES, key=["n_rows", "half"])
@triton.jit
def _packed_forward_kernel(y_ptr, out_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, half, BLOCK_M, BLOCK_N)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * half + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_TILES, key=["n_rows", "half"])
@triton.jit
def _packed_backward_kernel(dout_ptr, y_ptr, dy_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, half, BLOCK_M, BLOCK_N)
    dout = tl.load(dout_ptr + rows * half + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    sig, one_minus_sig = sigmoid_and_complement(g)
    d_gate = dout * u * sig * (1.0 + g * one_minus_sig)
    tl.store(dy_ptr + rows * (2 * half) + cols, d_gate.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + rows * (2 * half) + half + cols, (dout * g * sig).to(dy_ptr.dtype.element_ty), mask=mask)


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


def _tiles(n_rows: int, half: int) -> Any:
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]) * triton.cdiv(half, meta["BLOCK_N"]),)


class PackedSwiGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `swiglu_packed`; the gradient comes back packed like y."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        half = y.shape[-1] // 2
        out = torch.empty(*y.shape[:-1], half, dtype=y.dtype, device=y.device)
        n_rows = y.numel() // y.shape[-1]
        _packed_forward_kernel[_tiles(n_rows, half)](y, out, n_rows, half)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        dy = torch.empty_like(y)
        half, n_rows = y.shape[-1] // 2, y.numel() // y.shape[-1]
        _packed_backward_kernel[_tiles(n_rows, half)](dout.contiguous(), y, dy, n_rows, half)
        return dy


def swiglu_packed_reference(y: torch.Tensor) -> torch.Tensor:
    """silu of the first half of the last dim times the second half."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_packed(y: torch.Tensor) -> torch.Tensor:
    """silu(y[..., :F]) * y[..., F:]; Triton where `use_triton`, else the reference."""
    if use_triton(y) and y.shape[-1] % 2 == 0:
        return PackedSwiGLUFunction.apply(y)
    return swiglu_packed_reference(y)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's `F.silu(gate_proj(x)) * up_proj(x)` on the two projections."""
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; Triton where `use_triton` (and the shapes agree), else the reference."""
    if use_triton(gate) and gate.shape == up.shape:
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)
