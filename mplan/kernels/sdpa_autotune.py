"""Scaled dot-product attention on whichever of PyTorch's fused backends is fastest for the shape.

    attention(q, k, v, is_causal=False, scale=None, enable_gqa=False)
        = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

Why: PyTorch picks an SDPA backend by a fixed priority (FlashAttention-2 first where it
applies), not by speed, while on Hopper cuDNN's fused attention can be much faster for some
versions and shapes and slower for others, and attention is ~10-15% of a 1B-parameter model's
training step at sequence 2048. So the first call for a given (shapes, strides, dtype, flags,
grad or not, device) times each candidate backend (cuDNN, flash, memory-efficient) on random
tensors laid out like the real ones, forward and, when the call needs gradients, backward, and
every later call runs the fastest under `torch.nn.attention.sdpa_kernel`. A backend that
cannot run the case (no GQA support, a head size it lacks) is skipped; when none can, the call
is left to PyTorch's own choice.

All candidates compute exact softmax attention; they differ in rounding (as any two kernels
do), which is why the choice is made once per shape and then kept.

Invariants: only CUDA tensors are tuned; elsewhere (the CPU, the Triton interpreter) this is
`F.scaled_dot_product_attention` itself. Under autocast the candidates are timed in the dtype
autocast will run SDPA in. Tuning allocates a second set of q/k/v/output tensors for a moment,
once per shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mplan.kernels.dispatch import autocast_dtype

CANDIDATES = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
"""The fused backends (the math backend materializes the score matrix: never the fastest)."""

TIMED_CALLS = 5
"""Calls timed per candidate, after one untimed call (cuDNN builds its execution plan there)."""


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """What the choice of backend depends on: one tuning per distinct case."""

    shapes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    device: torch.device
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    backward: bool


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention without a mask or dropout, on the fastest backend (CUDA)."""
    options = {"is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **options)
    tensors = (q, k, v)
    case = AttentionCase(shapes=tuple(tuple(t.shape) for t in tensors), strides=tuple(t.stride() for t in tensors),
                         dtype=autocast_dtype(q) or q.dtype, device=q.device, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa,
                         backward=torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    backend = fastest_backend(case).backend
    if backend is None and enable_gqa:
        # no fused backend takes grouped heads here (FlashAttention does, where it applies):
        # repeat k and v over the query heads rather than fall to the math backend
        repeats = q.shape[-3] // k.shape[-3]
        k, v = (t.repeat_interleave(repeats, dim=-3) for t in (k, v))
        return attention(q, k, v, is_causal=is_causal, scale=scale)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, **options)


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: SDPBackend | None
    """the fastest candidate; None when none could run the case"""
    milliseconds: dict[str, float] = field(default_factory=dict)
    """median time of each candidate that could (forward, plus backward when the case has one)"""


_TUNED: dict[AttentionCase, BackendChoice] = {}
"""Choices made so far in this process, as Triton's autotuners keep theirs."""


def fastest_backend(case: AttentionCase) -> BackendChoice:
    """The candidate with the shortest median time on `case`, timed on first use."""
    if case not in _TUNED:
        timings = {backend: ms for backend in CANDIDATES if (ms := _time_backend(backend, case)) is not None}
        best = min(timings, key=timings.__getitem__) if timings else None
        _TUNED[case] = BackendChoice(best, {backend.name: round(ms, 4) for backend, ms in timings.items()})
    return _TUNED[case]


def tuned_cases() -> list[tuple[AttentionCase, BackendChoice]]:
    """Every case tuned in this process and what was chosen (for benchmarks' reports)."""
    return list(_TUNED.items())


def _time_backend(backend: SDPBackend, case: AttentionCase) -> float | None:
    """Median milliseconds of `backend` on random tensors of `case`; None if it cannot run it."""
    with torch.autocast(case.device.type, enabled=False), torch.enable_grad():
        q, k, v = (torch.randn(shape, dtype=case.dtype, device=case.device).as_strided(shape, stride)
                   if _dense(shape, stride) else torch.randn(shape, dtype=case.dtype, device=case.device)
                   for shape, stride in zip(case.shapes, case.strides))
        inputs = [t.requires_grad_(case.backward) for t in (q, k, v)]
        options = {"is_causal": case.is_causal, "scale": case.scale, "enable_gqa": case.enable_gqa}

        def call() -> None:
            out = F.scaled_dot_product_attention(*inputs, **options)
            if case.backward:
                torch.autograd.grad(out, inputs, torch.ones_like(out))

        try:
            with sdpa_kernel([backend]):
                call()
                times = []
                for _ in range(TIMED_CALLS):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
        except (RuntimeError, NotImplementedError):  # "No available kernel", or a backend rejecting the case
            return None
    return sorted(times)[len(times) // 2]


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when `stride` is a permutation of a contiguous layout of `shape` (as q/k/v arrive:
    transposes of [batch, seq, heads, head_dim]), so a fresh tensor can take it."""
    order = sorted(range(len(shape)), key=lambda d: stride[d])
    expected = 1
    for d in order:
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True
