"""Attention of a block of queries against a block of keys through PyTorch's fused kernels,
which return the log-sum-exp beside the output and never hold the [Sq, Sk] score matrix: what
`context_attention` runs where the block's mask is one the kernels express.

    pieces(q_spans, k_spans, causal) -> tuple[Piece, ...] | None
        the block as kernel calls; None where the mask is not causal-or-full per span pair
    kernel_dtype(device, dtype) -> dtype | None   what the kernel computes in, None: no kernel
    attend(q, k, v, pieces, scale) -> (out, lse)  out [B, Hq, Sq, Dv] (0 where a row sees
                                                   nothing), lse [B, Hq, Sq] (-inf there)
    attend_backward(q, k, v, pieces, scale, grad, out, lse) -> (dq, dk, dv)

Why spans: a rank's queries and a block's keys are unions of a layout's spans, and the spans
of a layout tile the sequence, so two spans are either the same span or disjoint. Under a
causal mask a query span then sees a key span wholly (the keys all come before), not at all
(all after) or causally on the diagonal (the same span): exactly the kernels' is_causal=False,
skip, and is_causal=True (square, so top-left and bottom-right alignment agree). Per query span
the fully visible key spans are concatenated into one call and the diagonal is a second; the
two are merged by log-sum-exp as the ring merges its blocks. Sliding windows, documents and
soft-capping have no such form (the caller keeps its reference path for them).

Backward: FlashAttention's backward of a piece, given the *merged* output and log-sum-exp of
all its row's pieces and blocks, is exactly that piece's share of dq, dk, dv (P = exp(S - lse),
delta = rowsum(dO * O)): the kernels' backward ops take out and lse as inputs, so each piece
is differentiated on its own and the shares add.

GQA: the kernels' ops want as many kv heads as q heads, so k and v are repeated per q head
(Hugging Face's repeat_kv: [S, D] per head, never [S, S]) and their gradients summed back.

Kernels: CPU `_scaled_dot_product_flash_attention_for_cpu` (float32, float64, bfloat16, float16)
and its backward, which take out and lse. CUDA is not wired yet (`kernel_dtype` says None there,
so CUDA runs the caller's reference path): its flash backward wants the forward's cum_seq and
philox tensors and the memory-efficient one an attn_bias tensor, none optional in the op schema,
and the log-sum-exp of the latter is padded; that needs a GPU run to get right, not a guess.
Inputs are in the compute dtype (the caller's upcast); the kernel accumulates in float32 or wider.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Piece", "attend", "attend_backward", "kernel_dtype", "merge", "pieces"]

Span = tuple[int, int]
aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Piece:
    """One kernel call: local query rows [rows[0], rows[1]) against the local key ranges `keys`
    (concatenated); causal: keys are the rows' own positions, seen causally."""

    rows: Span
    keys: tuple[Span, ...]
    causal: bool


def _local(spans: tuple[Span, ...]) -> list[tuple[Span, Span]]:
    """(global span, local range) of each span, local ranges in order."""
    out, at = [], 0
    for a, b in spans:
        out.append(((a, b), (at, at + b - a)))
        at += b - a
    return out


def pieces(q_spans: tuple[Span, ...], k_spans: tuple[Span, ...], causal: bool) -> tuple[Piece, ...] | None:
    """The block of queries at q_spans against keys at k_spans as kernel calls (module
    docstring); None where a key span partly overlaps a query span (no kernel mask for it)."""
    queries, keys = _local(q_spans), _local(k_spans)
    if not causal:
        rows = (0, queries[-1][1][1])
        return (Piece(rows, tuple(local for _, local in keys), False),)
    calls = []
    for (a, b), rows in queries:
        before = tuple(local for (c, d), local in keys if d <= a)
        diagonal = [local for span, local in keys if span == (a, b)]
        if any(not (d <= a or c >= b or (c, d) == (a, b)) for (c, d), _ in keys):
            return None
        if before:
            calls.append(Piece(rows, before, False))
        if diagonal:
            calls.append(Piece(rows, tuple(diagonal), True))
    return tuple(calls)


def kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the fused kernel takes on `device` for computing in `dtype`; None: none does
    (CUDA: not wired yet, module docstring)."""
    if device.type == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        return dtype
    return None


def _select(x: torch.Tensor, ranges: tuple[Span, ...]) -> torch.Tensor:
    parts = [x[:, :, lo:hi] for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return out, lse


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
    return dq, dk, dv


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse) in place (online softmax)."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.masked_fill(new_lse == -math.inf, 0.0)[..., None]
    out.copy_(out * torch.exp(lse[..., None] - finite) + block_out * torch.exp(block_lse[..., None] - finite))
    lse.copy_(new_lse)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[Piece, ...],
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, Hq, Sq, Dv] and log-sum-exp [B, Hq, Sq] of q [B, Hq, Sq, D] against k, v
    [B, Hkv, Sk, D] over the pieces, in q's dtype (the kernels accumulate wider)."""
    heads = q.shape[1]
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full(q.shape[:-1], -math.inf)
    for call in calls:
        lo, hi = call.rows
        piece_out, piece_lse = _forward(q[:, :, lo:hi].contiguous(), _repeat(_select(k, call.keys), heads).contiguous(),
                                        _repeat(_select(v, call.keys), heads).contiguous(), call.causal, scale)
        merge(out[:, :, lo:hi], lse[:, :, lo:hi], piece_out.to(out.dtype), piece_lse.to(lse.dtype))
    return out, lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[Piece, ...], scale: float,
                    grad: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """These pieces' shares of dq, dk, dv, given the merged output and log-sum-exp of q's rows
    over everything they attend to (module docstring, Backward)."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for call in calls:
        lo, hi = call.rows
        keys, values = _select(k, call.keys), _select(v, call.keys)
        dq, dk, dv = _backward(grad[:, :, lo:hi].contiguous(), q[:, :, lo:hi].contiguous(),
                               _repeat(keys, heads).contiguous(), _repeat(values, heads).contiguous(),
                               out[:, :, lo:hi].contiguous(), lse[:, :, lo:hi].contiguous(), call.causal, scale)
        grad_q[:, :, lo:hi] += dq
        dk = dk.unflatten(1, (k.shape[1], group)).sum(dim=2)
        dv = dv.unflatten(1, (k.shape[1], group)).sum(dim=2)
        at = 0
        for a, b in call.keys:
            grad_k[:, :, a:b] += dk[:, :, at:at + b - a]
            grad_v[:, :, a:b] += dv[:, :, at:at + b - a]
            at += b - a
    return grad_q, grad_k, grad_v
