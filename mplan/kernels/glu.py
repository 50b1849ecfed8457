"""Gated MLP activations act(gate) * up, for gate and up produced by two linears: SwiGLU
(Llama: act = silu) and GeGLU (Gemma: act = gelu_tanh, `F.gelu(gate, approximate="tanh")`).

    swiglu(gate, up) -> silu(gate) * up          gate, up: same shape, bf16/fp16/fp32
    swiglu_packed(y) -> silu(y[..., :F]) * y[..., F:]   y [..., 2F]: gate and up from ONE GEMM
    geglu(gate, up) -> gelu_tanh(gate) * up
    geglu_packed(y) -> gelu_tanh(y[..., :F]) * y[..., F:]

The packed form is what fuse_kernels uses once the gate and up projections run as one GEMM:
its backward writes d_gate and d_up straight into one [..., 2F] gradient, the layout that
GEMM's backward reads, where two separate gradients would first be concatenated (a copy).

Kernels: elementwise over the flattened tensors. The forward reads gate and up once and
writes the product (3 tensor passes, vs 4 for eager silu-then-mul); the backward recomputes
sigmoid(gate) and writes d_gate and d_up from one read of d_out, gate and up (5 passes).
Arithmetic is fp32, results are rounded once to the output dtype (the promoted input dtype).

Both activations are g * s(g) for a sigmoid s, so one set of kernels serves both, the
activation a constexpr (ACTIVATION, "silu" by default): silu is g * sigmoid(g), gelu_tanh is
g * sigmoid(z), z = 2 sqrt(2/pi) (g + 0.044715 g^3) (mplan.kernels.gelu spells out the
constants), and each derivative is s * (1 + g (1 - s) dz/dg). The silu path is the very
arithmetic it was before GeGLU joined; each activation is autotuned separately (ACTIVATION
is part of the autotune key), over the same candidates. On the H200 (2026-12-02, bf16, 16384
rows of 14336 and 16384 features, GPU kernel time in 5 interleaved rounds; an ad hoc run, not
stored under benchmarks/results) GeGLU ran at SwiGLU's speed: forward 0.322 / 0.368 ms (103%
of copy bandwidth), forward + backward 0.865 / 0.989 ms, packed alike, torch.compile of the
reference at best equal; its bf16 output was 1.7e-3 from float64 (eager bf16: 2.1e-3). The
silu results were bitwise those of the kernels before ACTIVATION (bf16 and fp32) at the same
times, and their sm_90 code has the same instructions.

Invariants: devices without Triton run `swiglu_reference`, `F.silu(gate) * up`, and
`geglu_reference`, `F.gelu(gate, approximate="tanh") * up`, op for op. Output dtypes are the
references': the promoted input dtype, under autocast too (autocast casts neither the
activation nor the product).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mplan.kernels.dispatch import configs, tl, triton, use_triton
from mplan.kernels.gelu import _gelu_sigmoid
from mplan.kernels.sigmoid import sigmoid_and_complement

SILU, GELU_TANH = "silu", "gelu_tanh"
"""the kernels' ACTIVATION values"""

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


@triton.jit
def _gate_sigmoid(g, ACTIVATION: tl.constexpr):
    """s with act(g) = g * s, in fp32."""
    if ACTIVATION == "gelu_tanh":
        s, _ = _gelu_sigmoid(g)  # sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), as bias_gelu's forward
    else:
        s = tl.sigmoid(g)
    return s


@triton.jit
def _gate_sigmoid_and_slope(g, ACTIVATION: tl.constexpr):
    """s and k with act(g) = g * s and act'(g) = s * k: k = 1 + g (1 - s) dz/dg, for s = sigmoid(z);
    1 - s comes from `sigmoid_and_complement`, accurate where s rounds to 1."""
    if ACTIVATION == "gelu_tanh":
        # z = 2 sqrt(2/pi) (g + 0.044715 g^3), dz/dg = 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2)
        s, one_minus_s = sigmoid_and_complement(g * (1.5957691216057308 + 0.07135481627260025 * g * g))
        k = 1.0 + g * one_minus_s * (1.5957691216057308 + 0.21406444881780076 * g * g)
    else:
        s, one_minus_s = sigmoid_and_complement(g)
        k = 1.0 + g * one_minus_s
    return s, k


@triton.autotune(configs=_FORWARD_BLOCKS, key=["n_elements", "ACTIVATION"])
@triton.jit
def _forward_kernel(g_ptr, u_ptr, y_ptr, n_elements, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr = "silu"):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * _gate_sigmoid(g, ACTIVATION) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_BLOCKS, key=["n_elements", "ACTIVATION"])
@triton.jit
def _backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_elements, BLOCK: tl.constexpr,
                     ACTIVATION: tl.constexpr = "silu"):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig, slope = _gate_sigmoid_and_slope(g, ACTIVATION)
    tl.store(dg_ptr + offs, (dy * u * sig * slope).to(dg_ptr.dtype.element_ty), mask=mask)
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


@triton.autotune(configs=_TILES, key=["n_rows", "half", "ACTIVATION"])
@triton.jit
def _packed_forward_kernel(y_ptr, out_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           ACTIVATION: tl.constexpr = "silu"):
    rows, cols, mask = _tile(n_rows, half, BLOCK_M, BLOCK_N)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * _gate_sigmoid(g, ACTIVATION) * u
    tl.store(out_ptr + rows * half + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_TILES, key=["n_rows", "half", "ACTIVATION"])
@triton.jit
def _packed_backward_kernel(dout_ptr, y_ptr, dy_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            ACTIVATION: tl.constexpr = "silu"):
    rows, cols, mask = _tile(n_rows, half, BLOCK_M, BLOCK_N)
    dout = tl.load(dout_ptr + rows * half + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    sig, slope = _gate_sigmoid_and_slope(g, ACTIVATION)
    d_gate = dout * u * sig * slope
    tl.store(dy_ptr + rows * (2 * half) + cols, d_gate.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + rows * (2 * half) + half + cols, (dout * g * sig).to(dy_ptr.dtype.element_ty), mask=mask)


def _grid(n_elements: int) -> Any:
    return lambda meta: (triton.cdiv(n_elements, meta["BLOCK"]),)


def _gated_forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    _forward_kernel[_grid(gate.numel())](gate, up, y, gate.numel(), ACTIVATION=activation)
    ctx.save_for_backward(gate, up)
    ctx.activation = activation
    return y


def _gated_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = ctx.saved_tensors
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    _backward_kernel[_grid(gate.numel())](dy.contiguous(), gate, up, d_gate, d_up, gate.numel(),
                                          ACTIVATION=ctx.activation)
    return d_gate, d_up


class SwiGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `swiglu`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _gated_forward(ctx, gate, up, SILU)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _gated_backward(ctx, dy)


class GeGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `geglu`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _gated_forward(ctx, gate, up, GELU_TANH)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _gated_backward(ctx, dy)


def _tiles(n_rows: int, half: int) -> Any:
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]) * triton.cdiv(half, meta["BLOCK_N"]),)


def _packed_forward(ctx: Any, y: torch.Tensor, activation: str) -> torch.Tensor:
    y = y.contiguous()
    half = y.shape[-1] // 2
    out = torch.empty(*y.shape[:-1], half, dtype=y.dtype, device=y.device)
    n_rows = y.numel() // y.shape[-1]
    _packed_forward_kernel[_tiles(n_rows, half)](y, out, n_rows, half, ACTIVATION=activation)
    ctx.save_for_backward(y)
    ctx.activation = activation
    return out


def _packed_backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
    (y,) = ctx.saved_tensors
    dy = torch.empty_like(y)
    half, n_rows = y.shape[-1] // 2, y.numel() // y.shape[-1]
    _packed_backward_kernel[_tiles(n_rows, half)](dout.contiguous(), y, dy, n_rows, half, ACTIVATION=ctx.activation)
    return dy


class PackedSwiGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `swiglu_packed`; the gradient comes back packed like y."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return _packed_forward(ctx, y, SILU)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
        return _packed_backward(ctx, dout)


class PackedGeGLUFunction(torch.autograd.Function):
    """Triton forward/backward of `geglu_packed`; the gradient comes back packed like y."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return _packed_forward(ctx, y, GELU_TANH)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
        return _packed_backward(ctx, dout)


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


def geglu_packed_reference(y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh of the first half of the last dim times the second half."""
    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def geglu_packed(y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(y[..., :F]) * y[..., F:]; Triton where `use_triton`, else the reference."""
    if use_triton(y) and y.shape[-1] % 2 == 0:
        return PackedGeGLUFunction.apply(y)
    return geglu_packed_reference(y)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's `F.gelu(gate_proj(x), approximate="tanh") * up_proj(x)` on the two projections."""
    return F.gelu(gate, approximate="tanh") * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up; Triton where `use_triton` (and the shapes agree), else the reference."""
    if use_triton(gate) and gate.shape == up.shape:
        return GeGLUFunction.apply(gate, up)
    return geglu_reference(gate, up)
