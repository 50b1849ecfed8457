"""When a fused op runs its Triton kernels and when its PyTorch reference.

Rule (`use_triton`): Triton for CUDA tensors; for CPU tensors only under `TRITON_INTERPRET=1`
(Triton's interpreter, which tests use); the plain PyTorch reference everywhere else (CPU
without the interpreter, other devices, float64, no Triton wheel), so CPU training never breaks.

Invariants:
- `INTERPRET` is read once, at import: Triton decides between compiling and interpreting when
  a kernel is decorated (and its own `tl.sum`, `tl.sigmoid`, ... are decorated when Triton is
  imported), so a process cannot switch modes after the kernel modules are imported. Tests of
  the interpreter therefore run in a subprocess started with the variable set.
- Under the interpreter every kernel gets one small fixed launch configuration (`configs`):
  autotuning there would only multiply the 100-8000x interpreter slowdown.
- Where Triton is not installed, `triton`/`tl` are a stand-in whose decorators return the
  function unchanged, so the kernel modules still import and their references still run.
- Under torch.autocast a fused op returns the dtypes its reference (the ops it replaces) would:
  custom autograd Functions are invisible to autocast, and its policy differs by device (CUDA
  runs pow, rsqrt and layer_norm in fp32, the CPU does not), so `autocast_result_dtype` asks
  the reference itself, once per device type, autocast dtype and input dtypes, on 2-element
  tensors.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton kernels run in the interpreter (CPU tensors) instead of being compiled."""

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # no Triton wheel for this platform (macOS, Windows, aarch64 CPU)
    HAVE_TRITON = False

    class _Config:
        def __init__(self, kwargs: dict[str, Any], **options: Any) -> None:
            self.kwargs, self.options = kwargs, options

    class _NoTriton:
        """Just enough of `triton` for the kernel modules' decorators to evaluate."""

        Config = _Config

        @staticmethod
        def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
            return fn

        @staticmethod
        def autotune(**_: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            return lambda fn: fn

        @staticmethod
        def heuristics(_: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            return lambda fn: fn

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the fused op on `tensor` should launch its Triton kernels.

    float64 always takes the reference: the kernels accumulate in fp32, and float64 is what
    mplan's parallel-vs-single-device correctness tests run in (1e-9 relative)."""
    if not HAVE_TRITON or tensor.dtype == torch.float64:
        return False
    if tensor.device.type == "cuda":
        return True
    return INTERPRET and tensor.device.type == "cpu"


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts to on `tensor`'s device type, or None when autocast is off there."""
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_result_dtype(probe: Callable[[torch.device, tuple[torch.dtype, ...]], torch.Tensor],
                          tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.dtype | None:
    """The dtype `probe(device, dtypes)` (a reference run on tiny tensors of `dtypes`) returns
    under the autocast in force on `tensor`'s device; None when autocast is off there."""
    cast_to = autocast_dtype(tensor)
    if cast_to is None:
        return None
    return _probe_under_autocast(probe, tensor.device, cast_to, dtypes)


@functools.cache
def _probe_under_autocast(probe: Callable[[torch.device, tuple[torch.dtype, ...]], torch.Tensor],
                          device: torch.device, cast_to: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    with torch.no_grad(), torch.autocast(device.type, dtype=cast_to):
        return probe(device, dtypes).dtype


def _linear_probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    (dtype,) = dtypes
    return torch.nn.functional.linear(torch.ones(1, 2, dtype=dtype, device=device),
                                      torch.ones(2, 2, dtype=dtype, device=device))


def _attention_probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    (dtype,) = dtypes
    q = torch.ones(1, 1, 2, 2, dtype=dtype, device=device)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


CONSUMER_PROBES: dict[str, Callable[[torch.device, tuple[torch.dtype, ...]], torch.Tensor]] = {
    "linear": _linear_probe, "attention": _attention_probe}
"""The ops a fused op's output may be marked as feeding (`consumer=`), each as a probe on tiny tensors."""


def consumer_cast_dtype(consumer: str | None, tensor: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype, when autocast is on for `tensor`'s device and casts a float32 input of
    `consumer` ("linear" or "attention") to it; else None.

    A fused op whose output feeds only such consumers (fuse_kernels marks it) then returns that
    output in this dtype itself: the consumer's cast becomes a no-op, and the values are the
    same (the kernel rounds its fp32 result once, as the cast would round the fp32 output). Under
    autocast that saves, per such output, an fp32 write, the cast's read and write, and in the
    backward the gradient's cast back to fp32 and the kernel's fp32 read of it."""
    cast_to = autocast_dtype(tensor)
    if consumer is None or cast_to is None:
        return None
    probed = _probe_under_autocast(CONSUMER_PROBES[consumer], tensor.device, cast_to, (torch.float32,))
    return cast_to if probed == cast_to else None


def configs(gpu: list[Any], interpret: Any) -> list[Any]:
    """The autotune candidates: `gpu` when compiling, the single `interpret` config otherwise
    (one config means Triton's autotuner launches it without benchmarking)."""
    return [interpret] if INTERPRET else gpu


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


MAX_ROW_SIZE = 65536
"""Longest row a one-block-per-row kernel (the norms) holds in registers; longer rows fall
back to the reference rather than spill."""


def num_row_programs(num_rows: int, tensor: torch.Tensor) -> int:
    """Programs for a kernel that loops over rows and keeps a per-program partial sum (the
    weight gradients of the norms): 4 per SM fill an H100/H200 with enough loads in flight
    while the [programs, row] fp32 partials stay ~2% of the traffic; 2 under the interpreter."""
    if tensor.device.type != "cuda":
        return max(1, min(num_rows, 2))
    return max(1, min(num_rows, 4 * _sm_count(tensor.device.index or 0)))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
