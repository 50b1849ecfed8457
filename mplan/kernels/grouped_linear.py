"""Several linears on one input as one GEMM, without keeping the concatenated weight.

    grouped_linear(x, weights, biases) = F.linear(x, cat(weights), cat(biases) or None)

Why: `fuse_kernels` runs the q/k/v projections (and gate/up) as one GEMM on the concatenated
weights. Written as ATen ops, the concatenation is a new tensor the GEMM saves for its backward:
an activation of 59 MiB a layer at Llama-1.1B's shape in bf16 (q/k/v 12 MiB, gate/up 44 MiB),
1.3 GiB over its 22 layers, which the H200 measured as most of mplan's peak memory above Liger
Kernel's on Hugging Face Llama (30.1 against 27.0 GiB, 2026-12-02). This op saves the weights
themselves (parameters, alive anyway) and concatenates them again in the backward: one copy of
the weights a step more, about 11 us a layer on the H200's bandwidth.

Where the weights already lie end to end in one storage, in the GEMM's dtype (the runtime places
each group's parameters so: `runtime/grouped_storage.py`), the concatenation is a view of them and
no copy is made, forward or backward: 96 copies and 3.2 ms a micro-batch on SmolLM2-1.7B's shape
(an H100, 2026-12-06), paid again for every micro-batch. Otherwise (weights apart, autocast's casts,
a caller's own tensors) it concatenates as before; the result is the same either way.

Under autocast it casts as `F.linear` does (input, weights and biases to the autocast dtype),
saves the cast input as `F.linear` would, and hands each weight its gradient in its own dtype
(what the cast's backward gives). Results are the ATen chain's: the same GEMMs on the same
operands, so bit for bit on the reference dispatch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from mplan.kernels.dispatch import CONSUMER_PROBES, autocast_result_dtype

__all__ = ["GroupedLinearFunction", "JoinedWeightsFunction", "end_to_end", "grouped_linear", "grouped_linear_reference",
           "joined", "joined_weights"]


class GroupedLinearFunction(torch.autograd.Function):
    """Forward: one GEMM on cat(weights). Saves x and the weights, never their concatenation."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gemm_dtype: torch.dtype | None, n_weights: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        weights, biases = tensors[:n_weights], tensors[n_weights:]
        if gemm_dtype is not None:
            x = x.to(gemm_dtype)
        weight = joined(weights, x.dtype)
        bias = joined(biases, x.dtype) if biases else None
        ctx.save_for_backward(x, *weights)
        ctx.bias_dtypes = [b.dtype for b in biases]
        ctx.sizes = [w.shape[0] for w in weights]
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, *weights = ctx.saved_tensors
        want_x, _, _, *want = ctx.needs_input_grad
        dy = dy.to(x.dtype)
        dx = dy @ joined(weights, x.dtype) if want_x else None
        rows, dy_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        d_weights: list[torch.Tensor | None] = [None] * len(weights)
        if any(want[:len(weights)]):
            d_weight = dy_rows.t() @ rows
            d_weights = [d.to(w.dtype) for d, w in zip(d_weight.split(ctx.sizes), weights)]
        d_biases: list[torch.Tensor | None] = [None] * len(ctx.bias_dtypes)
        if any(want[len(weights):]):
            d_bias = dy_rows.sum(0)
            d_biases = [d.to(dtype) for d, dtype in zip(d_bias.split(ctx.sizes), ctx.bias_dtypes)]
        return (dx, None, None, *d_weights, *d_biases)


def end_to_end(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` lie one after another in one storage, each contiguous with the same
    trailing shape and dtype, so that their concatenation along dim 0 is a view."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        offset += t.numel()
    return True


def joined(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """cat(t.to(dtype) for t in tensors) along dim 0: a view where they lie end to end in `dtype`."""
    if all(t.dtype == dtype for t in tensors) and end_to_end(tensors):
        first = tensors[0]
        rows = sum(t.shape[0] for t in tensors)
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    return torch.cat([t.to(dtype) for t in tensors])


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """F.linear(x, cat(weights), cat(biases)): biases all given or all None."""
    gemm_dtype = autocast_result_dtype(CONSUMER_PROBES["linear"], x, (x.dtype,))
    given = [b for b in biases if b is not None]
    if given and len(given) != len(weights):
        raise ValueError("grouped_linear: give a bias for every weight or for none")
    no_autocast = torch.autocast(x.device.type, enabled=False) if gemm_dtype is not None else contextlib.nullcontext()
    with no_autocast:
        return GroupedLinearFunction.apply(x, gemm_dtype, len(weights), *weights, *given)


class JoinedWeightsFunction(torch.autograd.Function):
    """cat(tensors) along dim 0 as an op of its own: a view where they lie end to end."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [t.shape[0] for t in tensors]
        return joined(tensors, tensors[0].dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(grad.split(ctx.sizes))


def joined_weights(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """cat(tensors) along dim 0 (one dtype), differentiable, without a copy where they lie end to end.

    Why: where the backward must stay ATen GEMMs (a zero-bubble schedule splits each GEMM's dX
    from its dW, `runtime/split_backward.py`; FP8's sweep replaces `aten.linear`), a grouped
    projection is `aten.linear` on its weights' concatenation. As `aten.cat`, that is a copy of
    the weights every forward, kept by the GEMM for its backward until W runs (an activation of
    59 MiB a layer at Llama-1.1B's shape in bf16). Here it is a view of the storage the runtime
    laid them in (`runtime/grouped_storage.py`); the gradient splits back as cat's does, the
    same values."""
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError("joined_weights: the tensors differ in dtype")
    return JoinedWeightsFunction.apply(*tensors)


def grouped_linear_reference(x: torch.Tensor, weights: Sequence[torch.Tensor],
                             biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The ATen chain the pass replaces: the concatenation, then one linear."""
    given = [b for b in biases if b is not None]
    return F.linear(x, torch.cat(list(weights)), torch.cat(given) if given else None)
