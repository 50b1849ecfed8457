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
and its backward, which take out and lse, in the compute dtype (the caller's upcast). CUDA, in
bfloat16 or float16 only (the inputs' own dtype, in which the single-device model's SDPA runs the
same kernels, accumulating in float32; the caller's float32 upcast of bf16 inputs is cast back,
exactly), two backends tried in this order:
  - cuDNN's attention (`_scaled_dot_product_cudnn_attention` and its backward): what torch's SDPA
    picks on Hopper, and the rate the device profile prices attention at. Measured on an H100
    (2026-12-06, `benchmarks/calibration/cp_attention.py`): torch's flash kernel below ran one cp rank's
    attention at 46-63% of the profile's price, so a cp plan paid ~2x for its attention against
    the price that chose it. Its log-sum-exp comes as [B, H, S, 1]; its backward takes no bias and
    no cum_seq tensors (None: a dense batch).
  - torch's flash kernel (`_scaled_dot_product_flash_attention` and its backward): where cuDNN's
    is missing or fails (older cards, head sizes it does not take). The backward op's cum_seq
    tensors are None (a dense batch, as the forward returns them), its max lengths the pieces'
    own, and its philox tensors unread at dropout 0.
Those conventions are torch's private op schema, so the first CUDA call per device, dtype and
head size checks each backend in turn (`_cuda_checked`: a small block of a causal and a full
piece against plain float32 math, outputs, log-sum-exp and gradients) and runs the first that
passes; where none does, a warning says why and that device runs the caller's reference path
(never a wrong result). `cuda_backend` says which runs; `use_cuda_backend` pins one (a benchmark
comparing them).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

__all__ = ["Piece", "attend", "attend_backward", "cuda_backend", "kernel_dtype", "merge", "pieces", "use_cuda_backend"]

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


_CUDA_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_CUDA_MAX_HEAD = 256
"""Flash attention's head sizes on CUDA: at most 256, a multiple of 8."""


def kernel_dtype(device: torch.device, dtype: torch.dtype, inputs: torch.dtype | None = None,
                 head_dim: int | None = None) -> torch.dtype | None:
    """The dtype the fused kernel takes on `device` for computing in `dtype` inputs of dtype
    `inputs` (default: `dtype`) and head size `head_dim`; None: none does (module docstring)."""
    if device.type == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        return dtype
    inputs = dtype if inputs is None else inputs
    if (device.type == "cuda" and inputs in _CUDA_KERNEL_DTYPES and head_dim is not None
            and head_dim % 8 == 0 and head_dim <= _CUDA_MAX_HEAD and _cuda_checked(device, inputs, head_dim)):
        return inputs
    return None


def _select(x: torch.Tensor, ranges: tuple[Span, ...]) -> torch.Tensor:
    parts = [x[:, :, lo:hi] for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        backend = _BACKEND[_key(q.device, q.dtype, q.shape[-1])]
        if backend == "cudnn":
            result = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
            out, lse = result[0], result[1].squeeze(-1)
        else:
            result = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            out, lse = result[0], result[1]
        _PHILOX.setdefault((q.device, backend), (result[6], result[7]))
        return out, lse
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return out, lse


_PHILOX: dict[tuple[torch.device, str | None], tuple[torch.Tensor, torch.Tensor]] = {}
"""A CUDA forward's philox seed and offset per device and backend: the backward ops take them; at
dropout 0 they read neither (module docstring), and a ring's backward has no forward of its own at
hand."""


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        backend = _BACKEND[_key(q.device, q.dtype, q.shape[-1])]
        seed, offset = _PHILOX[(q.device, backend)]
        if backend == "cudnn":
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                grad, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None, q.shape[2],
                k.shape[2], 0.0, causal, scale=scale)
            return dq, dk, dv
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
        return dq, dk, dv
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
    return dq, dk, dv


_CUDA_BACKENDS = ("cudnn", "flash")
"""Tried in this order (module docstring: cuDNN's is the faster on Hopper and the one priced)."""

_BACKEND: dict[tuple[torch.device, torch.dtype, int], str | None] = {}
"""The CUDA backend each device, dtype and head size runs, once checked (None: none passed, the
reference path runs); while a check runs, the backend under trial."""


def _key(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[torch.device, torch.dtype, int]:
    """`device` with its index (`cuda` and `cuda:0` are one key), dtype and head size."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype, head_dim


def _backend_failure(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str) -> str | None:
    """Why `backend` fails the check for this key (None: it passes); leaves it as the key's."""
    key = _key(device, dtype, head_dim)
    _BACKEND[key] = backend
    try:
        # whatever the caller's context: an inference call (no grad) or autocast would change the check
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            return None if _check_block(device, dtype, head_dim) else "its results differ from float32 math beyond rounding"
    except Exception as error:  # noqa: BLE001 - any failure means: the next backend, or the reference path
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def _cuda_checked(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a CUDA backend (cuDNN's, then flash) computes a small block right: a full piece and a
    causal one of 2 heads, against float32 math, forward and backward; the first that does is the
    one this device, dtype and head size run, decided once. None passing warns once and returns
    False (the caller's reference path runs)."""
    key = _key(device, dtype, head_dim)
    if key not in _BACKEND:
        failures = []
        for backend in _CUDA_BACKENDS:
            why = _backend_failure(device, dtype, head_dim, backend)
            if why is None:
                break
            failures.append(f"{backend}: {why}")
        else:
            _BACKEND[key] = None
            warnings.warn(f"mplan: context attention's CUDA kernels failed their check on {device} ({dtype}, head "
                          f"size {head_dim}): {'; '.join(failures)}; the reference path runs there (scores "
                          f"materialised)", stacklevel=3)
    return _BACKEND[key] is not None


def cuda_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The CUDA kernels context attention runs for this device, dtype and head size ("cudnn" or
    "flash"), checked on first use; None: the reference path."""
    return _BACKEND[_key(device, dtype, head_dim)] if _cuda_checked(device, dtype, head_dim) else None


def use_cuda_backend(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str) -> str | None:
    """Pin `backend` for this key after checking it; returns why it fails (then the key is left to
    the reference path) or None."""
    if backend not in _CUDA_BACKENDS:
        raise ValueError(f"unknown CUDA attention backend {backend!r}; known: {', '.join(_CUDA_BACKENDS)}")
    why = _backend_failure(device, dtype, head_dim, backend)
    if why is not None:
        _BACKEND[_key(device, dtype, head_dim)] = None
    return why


def _check_block(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, rows, head_dim, device=device, dtype=dtype, generator=generator)
                     for rows in (48, 80, 80, 48))
    calls = (Piece((0, 16), ((0, 32),), False), Piece((16, 48), ((32, 64),), True), Piece((16, 48), ((64, 80),), False))
    scale = head_dim ** -0.5
    out, lse = attend(q.float(), k.float(), v.float(), calls, scale, kernel=dtype)
    grads = attend_backward(q.float(), k.float(), v.float(), calls, scale, grad.float(), out, lse, kernel=dtype)
    # float32 math: the visible keys of each row (module docstring: a span pair is full, causal or unseen)
    seen = torch.zeros(48, 80, dtype=torch.bool, device=device)
    seen[:16, :32] = True
    seen[16:48, 32:64] = torch.ones(32, 32, dtype=torch.bool, device=device).tril()
    seen[16:48, 64:80] = True
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    scores = (leaves[0] @ leaves[1].transpose(-1, -2) * scale).masked_fill(~seen, -math.inf)
    want_lse = scores.logsumexp(-1)
    want_out = torch.softmax(scores, -1) @ leaves[2]
    want_grads = torch.autograd.grad(want_out, leaves, grad.float())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool(((got.float() - want).norm() <= tolerance * want.norm()).item())
    return (close(out, want_out) and close(lse, want_lse)
            and all(close(g, w) for g, w in zip(grads, want_grads)))


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse) in place (online softmax)."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.masked_fill(new_lse == -math.inf, 0.0)[..., None]
    out.copy_(out * torch.exp(lse[..., None] - finite) + block_out * torch.exp(block_lse[..., None] - finite))
    lse.copy_(new_lse)


def _kernel_input(x: torch.Tensor, kernel: torch.dtype | None) -> torch.Tensor:
    return (x if kernel is None else x.to(kernel)).contiguous()


def _kernel_lse(lse: torch.Tensor, inputs: torch.dtype) -> torch.Tensor:
    """The log-sum-exp as the backward op takes it beside inputs of dtype `inputs`: float64 with
    float64, else float32 (what the kernels accumulate in)."""
    return lse.to(torch.float64 if inputs == torch.float64 else torch.float32).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[Piece, ...],
           scale: float, kernel: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, Hq, Sq, Dv] and log-sum-exp [B, Hq, Sq] of q [B, Hq, Sq, D] against k, v
    [B, Hkv, Sk, D] over the pieces, in q's dtype (the kernels accumulate wider; `kernel`: the
    dtype they run in where it is not q's, `kernel_dtype`'s)."""
    heads = q.shape[1]
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full(q.shape[:-1], -math.inf)
    for call in calls:
        lo, hi = call.rows
        piece_out, piece_lse = _forward(_kernel_input(q[:, :, lo:hi], kernel),
                                        _kernel_input(_repeat(_select(k, call.keys), heads), kernel),
                                        _kernel_input(_repeat(_select(v, call.keys), heads), kernel), call.causal, scale)
        merge(out[:, :, lo:hi], lse[:, :, lo:hi], piece_out.to(out.dtype), piece_lse.to(lse.dtype))
    return out, lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[Piece, ...], scale: float,
                    grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    kernel: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """These pieces' shares of dq, dk, dv, given the merged output and log-sum-exp of q's rows
    over everything they attend to (module docstring, Backward), in q's dtype (`kernel` as for
    `attend`)."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for call in calls:
        lo, hi = call.rows
        keys, values = _select(k, call.keys), _select(v, call.keys)
        dq, dk, dv = _backward(_kernel_input(grad[:, :, lo:hi], kernel), _kernel_input(q[:, :, lo:hi], kernel),
                               _kernel_input(_repeat(keys, heads), kernel), _kernel_input(_repeat(values, heads), kernel),
                               _kernel_input(out[:, :, lo:hi], kernel), _kernel_lse(lse[:, :, lo:hi], kernel or q.dtype),
                               call.causal, scale)
        dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
        grad_q[:, :, lo:hi] += dq
        dk = dk.unflatten(1, (k.shape[1], group)).sum(dim=2)
        dv = dv.unflatten(1, (k.shape[1], group)).sum(dim=2)
        at = 0
        for a, b in call.keys:
            grad_k[:, :, a:b] += dk[:, :, at:at + b - a]
            grad_v[:, :, a:b] += dv[:, :, at:at + b - a]
            at += b - a
    return grad_q, grad_k, grad_v
