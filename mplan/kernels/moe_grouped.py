"""The routed experts on one GPU through `torch._grouped_mm`: a fast path of `mplan.kernels.moe`.

    grouped_expert_mlp(rows, counts, w_in, w_out, w_up, *, activation, gated) -> [N, h]
    moe_experts_grouped(x, index, gate, w_in, w_out, w_up=None, *, activation, gated) -> [T, h]
    grouped_available(x, w_in) -> bool

Same contracts as `moe.expert_mlp` (rows already grouped by expert, `counts[e]` rows each,
sum(counts) == N) and `moe.moe_experts_reference(..., capacity_factor=None)` (dropless), up to
rounding; weight layouts as there. Why: the reference runs one GEMM chain per expert and reads
`counts` on the host; here each projection of all experts is one grouped GEMM whose group
offsets stay on the device, so nothing synchronizes with the host (the expert-parallel runtime
calls `grouped_expert_mlp` on the rows its all-to-all received).

What one call does (N = T*k routed rows, F the experts' width):
    forward   route (a stable sort of the choices, choice-major as `moe.route`; group offsets by
              searchsorted, not bincount, which reads its maximum on the host); gather x's rows;
              hidden = grouped GEMM [N, 2F] (gate and up from one GEMM when packed); act [N, F]
              by a Triton kernel; y = grouped GEMM [N, h]; combine: each token's k rows of y,
              weighted by its gate, summed in fp32 in a fixed order (deterministic, no atomics),
              one Triton kernel.
    saved     `hidden` alone (plus the inputs and the routing): not the gathered rows (gathered
              again in the backward, a copy of [N, h]), not act (recomputed inside the backward
              kernel from hidden), not y (the gate's gradient is row-dot(dA, act), dA = dY w_out:
              the same number without keeping y).
    backward  dA = grouped GEMM of the gathered output gradient; one Triton kernel reads dA and
              hidden and writes over the same buffers hidden <- d_hidden (times the row's gate)
              and dA <- act (times the row's gate; what the w_out gradient's GEMM reads), and the
              gate's gradient as fp32 partial row sums (the torch steps that replace the kernels
              elsewhere return new tensors); then the weight gradients, each one grouped GEMM
              written in the weight's own layout (no transposed copy), and the input gradient
              summed back to tokens by the combine kernel.
So beside the weights' gradients the backward holds one [N, 2F] buffer (hidden, reused), one
[N, F] buffer and [N, h]-sized row copies. Because the backward overwrites its saved `hidden`, a
second backward through the same node (retain_graph; the zero-bubble split's W pass reruns a
custom Function's backward, `mplan.runtime.split_backward`) first recomputes hidden: one more
grouped GEMM there, instead of keeping a second [N, 2F] buffer in every backward.

`torch._grouped_mm` runs bf16 on CUDA devices of compute capability 9.x/10.x (other dtypes take
a fallback that reads the offsets on the host) and float32 on the CPU, which the tests use;
`grouped_available` says whether a call is on the fast path. The elementwise kernels dispatch as
every fused kernel does (`dispatch.use_triton`); elsewhere the same steps run as torch ops.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from mplan.kernels.dispatch import INTERPRET, tl, triton, use_triton
from mplan.kernels.moe import ACTIVATIONS, check_arguments
from mplan.kernels.sigmoid import sigmoid_and_complement

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
assert set(_ACTIVATION_CODES) == set(ACTIVATIONS)

# One launch configuration per kernel, no autotuning: the backward kernel writes in place (an
# autotuner's trial launches would apply it several times), and its partial-sum columns follow
# its block width. [1, 2048] tiles on 8 warps are what the H200 ran fastest for the packed SwiGLU
# forward at 16384 x 2 x 14336 (mplan/kernels/glu.py); the interpreter gets small ragged tiles.
_ROWS, _COLS, _WARPS = (2, 16, 1) if INTERPRET else (1, 2048, 8)
_COMBINE_ROWS, _COMBINE_COLS, _COMBINE_WARPS = (2, 16, 1) if INTERPRET else (1, 1024, 4)


def grouped_available(x: torch.Tensor, w_in: torch.Tensor) -> bool:
    """True when `torch._grouped_mm` runs this layer on its fast kernel without a host sync:
    CUDA, bf16 activations and weights, compute capability 9.x or 10.x, and every row of every
    GEMM operand 16-byte aligned: x's width a multiple of 8 elements, w_in's dim 1 of 16 (so
    that the FFN width, half of it when [gate; up] are packed, is a multiple of 8 too)."""
    if not (x.is_cuda and w_in.is_cuda and x.dtype == w_in.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    return x.shape[-1] % 8 == 0 and w_in.shape[1] % 16 == 0 and w_in.data_ptr() % 16 == 0


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows [BLOCK_M, 1], columns [1, BLOCK_N], mask and column block, on a 1-D
    grid whose consecutive programs walk one row's column blocks."""
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid = tl.program_id(0)
    rows = ((pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return rows, cols, (rows < n_rows) & (cols < n_cols), pid % col_blocks


@triton.jit
def _activation(z, ACT: tl.constexpr):
    """act(z) and act'(z) in fp32 for the activation numbered as in `_ACTIVATION_CODES`."""
    if ACT == 0:  # silu: z s, s (1 + z (1 - s))
        s, one_minus_s = sigmoid_and_complement(z)
        value = z * s
        slope = s * (1.0 + z * one_minus_s)
    elif ACT == 1:  # gelu: z Phi(z), Phi(z) + z phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        value = z * cdf
        slope = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == 2:  # gelu_tanh: z sigmoid(u), u = 2 sqrt(2/pi) (z + 0.044715 z^3) (mplan/kernels/gelu.py)
        s, one_minus_s = sigmoid_and_complement(z * (1.5957691216057308 + 0.07135481627260025 * z * z))
        value = z * s
        slope = s + z * s * one_minus_s * (1.5957691216057308 + 0.21406444881780076 * z * z)
    else:  # relu
        value = tl.maximum(z, 0.0)
        slope = tl.where(z > 0.0, 1.0, 0.0)
    return value, slope


@triton.jit
def _activate_kernel(g_ptr, u_ptr, out_ptr, n_rows, n_cols, in_stride, GATED: tl.constexpr, ACT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask, _ = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(g_ptr + rows * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    value, _ = _activation(g, ACT)
    if GATED:
        value = value * tl.load(u_ptr + rows * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * n_cols + cols, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activation_backward_kernel(d_ptr, g_ptr, u_ptr, w_ptr, part_ptr, n_rows, n_cols, in_stride,
                                GATED: tl.constexpr, ACT: tl.constexpr, WEIGHTED: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """In place: g <- w dA act'(g) [u], u <- w dA act(g), dA <- w act(g) [u]; with WEIGHTED, the
    row sums of dA * act(g) [u] over this column block into part[row, column block]."""
    rows, cols, mask, col_block = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    d_offs = rows * n_cols + cols
    in_offs = rows * in_stride + cols
    da = tl.load(d_ptr + d_offs, mask=mask, other=0.0).to(tl.float32)
    value, slope = _activation(tl.load(g_ptr + in_offs, mask=mask, other=0.0).to(tl.float32), ACT)
    if GATED:
        u = tl.load(u_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
        d_g = da * slope * u
        d_u = da * value
        act = value * u
    else:
        d_g = da * slope
        act = value
    if WEIGHTED:
        tl.store(part_ptr + rows * tl.cdiv(n_cols, BLOCK_N) + col_block, tl.sum(da * act, axis=1)[:, None],
                 mask=rows < n_rows)
        w = tl.load(w_ptr + rows, mask=rows < n_rows, other=0.0).to(tl.float32)
        d_g = d_g * w
        act = act * w
        if GATED:
            d_u = d_u * w
    tl.store(g_ptr + in_offs, d_g.to(g_ptr.dtype.element_ty), mask=mask)
    if GATED:
        tl.store(u_ptr + in_offs, d_u.to(u_ptr.dtype.element_ty), mask=mask)
    tl.store(d_ptr + d_offs, act.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, n_tokens, width, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over j in order of w[j T + t] y[pos[j T + t]], in fp32."""
    tokens, cols, mask, _ = _tile(n_tokens, width, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        choice = j * n_tokens + tokens
        row = tl.load(pos_ptr + choice, mask=tokens < n_tokens, other=0)
        piece = tl.load(y_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            piece = piece * tl.load(w_ptr + choice, mask=tokens < n_tokens, other=0.0).to(tl.float32)
        acc += piece
    tl.store(out_ptr + tokens * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(n_rows: int, n_cols: int, block_m: int, block_n: int) -> tuple[int]:
    return (triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n),)


def _halves(hidden: torch.Tensor, up: torch.Tensor | None, gated: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activation's input and the up projection it multiplies (None when not gated): the
    two halves of a packed [N, 2F] `hidden`, or `hidden` and the separate `up`."""
    if up is None and gated:
        width = hidden.shape[1] // 2
        return hidden[:, :width], hidden[:, width:]
    return hidden, up


def _activate(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(gate) [* up] as a new contiguous [N, F] tensor."""
    if not use_triton(gate):
        value = ACTIVATIONS[activation](gate)
        return value * up if up is not None else value
    n_rows, n_cols = gate.shape
    out = torch.empty(n_rows, n_cols, dtype=gate.dtype, device=gate.device)
    _activate_kernel[_tiles(n_rows, n_cols, _ROWS, _COLS)](
        gate, gate if up is None else up, out, n_rows, n_cols, gate.stride(0), GATED=up is not None,
        ACT=_ACTIVATION_CODES[activation], BLOCK_M=_ROWS, BLOCK_N=_COLS, num_warps=_WARPS)
    return out


def _activation_backward(d_act: torch.Tensor, hidden: torch.Tensor, up: torch.Tensor | None,
                         row_weight: torch.Tensor | None, activation: str, gated: bool,
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Given dA = dL/d(act(gate) [* up]) per unit row weight: (d_hidden, d_up, weighted_act,
    d_row_weight): `hidden`'s and `up`'s gradients (times the row weight), row_weight *
    act(gate) [* up] (what w_out's gradient reads), and the row weights' gradient, sum(dA *
    act(gate) [* up]) per row in fp32 (None without weights). The Triton kernel writes the first
    three over hidden, up and d_act (writes autograd does not see: `_projections`); the torch
    steps return new tensors."""
    gate, up_half = _halves(hidden, up, gated)
    n_rows, n_cols = gate.shape
    if not use_triton(gate):
        with torch.enable_grad():
            leaf = gate.detach().requires_grad_()
            value = ACTIVATIONS[activation](leaf)
        (d_gate,) = torch.autograd.grad(value, leaf, d_act * up_half if up_half is not None else d_act)
        value = value.detach()
        act = value * up_half if up_half is not None else value
        d_weight = (d_act.float() * act.float()).sum(1) if row_weight is not None else None
        scale = row_weight[:, None] if row_weight is not None else 1.0
        d_gate = (d_gate * scale).to(hidden.dtype)
        d_up_half = (d_act * value * scale).to(hidden.dtype) if up_half is not None else None
        weighted = (act * scale).to(d_act.dtype)
        if up is None and gated:
            return torch.cat([d_gate, d_up_half], 1), None, weighted, d_weight
        return d_gate, d_up_half, weighted, d_weight
    partials = (torch.empty(n_rows, triton.cdiv(n_cols, _COLS), dtype=torch.float32, device=gate.device)
                if row_weight is not None else None)
    _activation_backward_kernel[_tiles(n_rows, n_cols, _ROWS, _COLS)](
        d_act, gate, gate if up_half is None else up_half, row_weight if row_weight is not None else d_act,
        partials if partials is not None else d_act, n_rows, n_cols, gate.stride(0), GATED=up_half is not None,
        ACT=_ACTIVATION_CODES[activation], WEIGHTED=row_weight is not None, BLOCK_M=_ROWS, BLOCK_N=_COLS,
        num_warps=_WARPS)
    return hidden, up, d_act, partials.sum(1) if partials is not None else None


def _combine(rows: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor | None, num_tokens: int, top_k: int,
             dtype: torch.dtype) -> torch.Tensor:
    """[T, h] in `dtype`: each token's sum over its choices j, in order, of weight[c] * rows[pos[c]]
    (c = j T + t; weight None: 1), accumulated in fp32."""
    if not use_triton(rows):
        picked = rows.index_select(0, pos).float().view(top_k, num_tokens, -1)
        if weight is not None:
            picked = picked * weight.float().view(top_k, num_tokens, 1)
        return picked.sum(0).to(dtype)
    width = rows.shape[1]
    out = torch.empty(num_tokens, width, dtype=dtype, device=rows.device)
    _combine_kernel[_tiles(num_tokens, width, _COMBINE_ROWS, _COMBINE_COLS)](
        rows, pos, weight if weight is not None else rows, out, num_tokens, width, TOP_K=top_k,
        WEIGHTED=weight is not None, BLOCK_M=_COMBINE_ROWS, BLOCK_N=_COMBINE_COLS, num_warps=_COMBINE_WARPS)
    return out


def _linear(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows[group e] @ weight[e]^T for each expert e, weight [E, out, in]: [N, out]."""
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)


def _forward(rows: torch.Tensor, offs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
             w_up: torch.Tensor | None, activation: str, gated: bool,
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(hidden, up, y): the input projection(s), kept for the backward, and the experts' output rows."""
    hidden = _linear(rows, w_in, offs)
    up = _linear(rows, w_up, offs) if w_up is not None else None
    act = _activate(*_halves(hidden, up, gated), activation)
    return hidden, up, _linear(act, w_out, offs)


def _output_backward(d_rows_out: torch.Tensor, hidden: torch.Tensor, up: torch.Tensor | None,
                     w_out: torch.Tensor, offs: torch.Tensor, row_weight: torch.Tensor | None, activation: str,
                     gated: bool, want_w_out: bool,
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """From the output rows' gradient (per unit row weight): w_out's gradient (if wanted), the
    gradients of hidden and up (`_activation_backward`: over them, on the Triton path) and the
    row weights' (None without)."""
    d_act = torch._grouped_mm(d_rows_out, w_out, offs=offs)
    d_hidden, d_up, weighted_act, d_weight = _activation_backward(d_act, hidden, up, row_weight, activation, gated)
    grad_w_out = torch._grouped_mm(d_rows_out.t(), weighted_act, offs=offs) if want_w_out else None
    return grad_w_out, d_hidden, d_up, d_weight


def _weight_grads(d_hidden: torch.Tensor, d_up: torch.Tensor | None, rows: torch.Tensor, offs: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w_in's and w_up's gradients, [E, out, in] like the weights."""
    grad_up = torch._grouped_mm(d_up.t(), rows, offs=offs) if d_up is not None else None
    return torch._grouped_mm(d_hidden.t(), rows, offs=offs), grad_up


def _row_grads(d_hidden: torch.Tensor, d_up: torch.Tensor | None, w_in: torch.Tensor, w_up: torch.Tensor | None,
               offs: torch.Tensor) -> torch.Tensor:
    """The grouped input rows' gradient, [N, h]."""
    grad = torch._grouped_mm(d_hidden, w_in, offs=offs)
    if d_up is not None:
        grad += torch._grouped_mm(d_up, w_up, offs=offs)
    return grad


def _projections(ctx: Any, hidden: torch.Tensor, up: torch.Tensor | None, rows: Callable[[], torch.Tensor],
                 w_in: torch.Tensor, w_up: torch.Tensor | None, offs: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The saved input projections, which the backward's Triton kernel overwrites with their
    gradients; on a second backward through the same node they are recomputed from `rows()`."""
    if not ctx.spent:
        ctx.spent = True
        return hidden, up
    again = rows()
    return _linear(again, w_in, offs), _linear(again, w_up, offs) if w_up is not None else None


class GroupedExpertMLPFunction(torch.autograd.Function):
    """`grouped_expert_mlp` with the backward of the module docstring (no row weights)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                w_up: torch.Tensor | None, activation: str, gated: bool) -> torch.Tensor:
        rows = rows.contiguous()
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        hidden, up, y = _forward(rows, offs, w_in, w_out, w_up, activation, gated)
        ctx.save_for_backward(rows, offs, w_in, w_out, w_up, hidden, up)
        ctx.activation, ctx.gated, ctx.spent = activation, gated, False
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, offs, w_in, w_out, w_up, hidden, up = ctx.saved_tensors
        hidden, up = _projections(ctx, hidden, up, lambda: rows, w_in, w_up, offs)
        needs = ctx.needs_input_grad
        grad_w_out, d_hidden, d_up, _ = _output_backward(grad.contiguous(), hidden, up, w_out, offs, None,
                                                         ctx.activation, ctx.gated, needs[3])
        grad_w_in, grad_w_up = _weight_grads(d_hidden, d_up, rows, offs) if needs[2] or needs[4] else (None, None)
        grad_rows = _row_grads(d_hidden, d_up, w_in, w_up, offs) if needs[0] else None
        return grad_rows, None, grad_w_in, grad_w_out, grad_w_up, None, None


def grouped_expert_mlp(rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                       w_up: torch.Tensor | None, *, activation: str, gated: bool) -> torch.Tensor:
    """The experts on `rows` [N, h] grouped by expert (`counts[e]` rows for expert e in turn,
    summing to N; an int tensor on rows' device, never read on the host): `moe.expert_mlp`'s
    contract as three grouped GEMMs, differentiable in rows and weights."""
    return GroupedExpertMLPFunction.apply(rows, counts, w_in, w_out, w_up, activation, gated)


def _route(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dropless routing as `moe.route` groups it, without a host sync: (order [N], the kept choice
    ids expert by expert, choice-major within one; offs [E] int32, the groups' ends; pos [N], each
    choice's row in `order`)."""
    expert = index.t().reshape(-1)
    sorted_expert, order = torch.sort(expert, stable=True)
    bounds = torch.arange(num_experts, device=index.device, dtype=sorted_expert.dtype)
    offs = torch.searchsorted(sorted_expert, bounds, right=True).to(torch.int32)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=index.device))
    return order, offs, pos


class GroupedMoEFunction(torch.autograd.Function):
    """`moe_experts_grouped`: route, gather, `_forward`, combine; the backward of the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, w_up: torch.Tensor | None, activation: str, gated: bool) -> torch.Tensor:
        num_tokens, top_k = index.shape
        order, offs, pos = _route(index, w_in.shape[0])
        choice_gate = gate.t().reshape(-1)
        hidden, up, y = _forward(x.index_select(0, order % num_tokens), offs, w_in, w_out, w_up, activation, gated)
        out = _combine(y, pos, choice_gate, num_tokens, top_k, x.dtype)
        ctx.save_for_backward(x, gate, w_in, w_out, w_up, hidden, up, order, offs, pos)
        ctx.activation, ctx.gated, ctx.spent = activation, gated, False
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate, w_in, w_out, w_up, hidden, up, order, offs, pos = ctx.saved_tensors
        num_tokens, top_k = x.shape[0], gate.shape[1]
        tokens = order % num_tokens
        hidden, up = _projections(ctx, hidden, up, lambda: x.index_select(0, tokens), w_in, w_up, offs)
        needs = ctx.needs_input_grad
        row_weight = gate.t().reshape(-1).index_select(0, order).float()
        grad_w_out, d_hidden, d_up, d_weight = _output_backward(
            grad.index_select(0, tokens), hidden, up, w_out, offs, row_weight, ctx.activation, ctx.gated, needs[4])
        grad_gate = d_weight.index_select(0, pos).view(top_k, num_tokens).t().to(gate.dtype) if needs[2] else None
        grad_w_in, grad_w_up = (_weight_grads(d_hidden, d_up, x.index_select(0, tokens), offs)
                                if needs[3] or needs[5] else (None, None))
        grad_x = (_combine(_row_grads(d_hidden, d_up, w_in, w_up, offs), pos, None, num_tokens, top_k, x.dtype)
                  if needs[0] else None)
        return grad_x, None, grad_gate, grad_w_in, grad_w_out, grad_w_up, None, None


def moe_experts_grouped(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                        w_out: torch.Tensor, w_up: torch.Tensor | None = None, *, activation: str = "silu",
                        gated: bool = True) -> torch.Tensor:
    """Dropless `moe.moe_experts` (module docstring): x [T, h], index and gate [T, k] -> [T, h] in
    x's dtype, differentiable in x, gate and the weights."""
    check_arguments(x, index, gate, w_in, w_out, w_up, activation, gated)
    return GroupedMoEFunction.apply(x, index, gate, w_in, w_out, w_up, activation, gated)

