"""GPU kernel time of a callable, from the profiler: what a kernel costs inside a busy training step.

Why not CUDA events around the call: for a kernel of ~0.1 ms the host (autograd, Python
launchers) takes longer than the GPU, so events measure the host, and in a training step the
host runs ahead while GEMMs keep the GPU busy. The profiler's per-kernel device times, summed,
are what the step pays on the GPU.

    kernel_ms(fn, iters)  -> mean GPU time of fn() per call (every kernel, memset and copy it issues)
    interleaved_kernel_ms(calls, rounds, iters) -> each call's kernel_ms in rounds taken in turn
    kernel_table(prof)    -> {kernel name: total ms} of a finished profile, largest first
    host_table(prof, steps) -> where the host's time went per step: launches, waits, top ops
    copy_tbps()           -> TB/s (read + written) of a 1 GiB device-to-device copy, by the same clock
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

Key = TypeVar("Key")


def kernel_table(prof: profile) -> dict[str, float]:
    """Total device milliseconds of each kernel (and memset/memcpy) a profile recorded.

    User annotations (record_function ranges such as `Optimizer.step#AdamW.step`) also appear on
    the GPU timeline, spanning the kernels they enclose: they are skipped, or those kernels would
    count twice."""
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
"""The CUDA runtime and driver calls that launch a kernel (Triton's launcher calls the driver's)."""
WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")
"""Calls in which the host may wait for the device (a device-to-host copy waits for the stream)."""


def host_table(prof: profile, steps: int, top: int = 15) -> dict[str, Any]:
    """Per step, the host's side of a profile: kernel launches and their host milliseconds, the
    milliseconds spent in calls that may wait for the device, and the `top` CPU ops by self time.

    Why: a step whose GPU kernels take a third of its wall time is either host-bound (the host
    cannot enqueue work faster than the device runs it) or waits on the device mid-step; the
    launch count, the waits and the ops with the most host time tell which, and where."""
    launches = waits = launch_ms = wait_ms = 0.0
    ops: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        self_ms = event.self_cpu_time_total / 1e3
        if event.key in LAUNCH_CALLS:
            launches, launch_ms = launches + event.count, launch_ms + self_ms
        elif event.key in WAIT_CALLS:
            waits, wait_ms = waits + event.count, wait_ms + self_ms
        elif not event.key.startswith(("cuda", "cu", "ProfilerStep")):
            entry = ops.setdefault(event.key, [0.0, 0.0])
            entry[0] += self_ms
            entry[1] += event.count
    largest = sorted(ops.items(), key=lambda item: -item[1][0])[:top]
    return {"launches": round(launches / steps), "launch_ms": round(launch_ms / steps, 2),
            "wait_calls": round(waits / steps), "wait_ms": round(wait_ms / steps, 2),
            "top_ops_self_ms": {name[:120]: {"ms": round(ms / steps, 3), "calls": round(calls / steps)}
                                for name, (ms, calls) in largest}}


def kernel_ms(fn: Callable[[], Any], iters: int = 10) -> float:
    """Mean GPU time of one `fn()`: the device time of every kernel it launches, summed."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(kernel_table(prof).values()) / iters


def interleaved_kernel_ms(calls: Mapping[Key, Callable[[], Any]], *, rounds: int = 5,
                          iters: int = 20) -> dict[Key, list[float]]:
    """`kernel_ms` of every call, `rounds` times, the calls taken in turn within each round: the
    samples per call. Why interleaved: single samples of a ~0.03 ms kernel taken one
    implementation after another moved by up to 3% between runs of the same code (H200,
    2026-11-29), more than the gaps being judged; clock drift now falls on every call alike."""
    samples: dict[Key, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            samples[key].append(kernel_ms(call, iters))
    return samples


def copy_tbps() -> float:
    """Read + written bytes of a 1 GiB bf16 copy on the current CUDA device per second, in TB/s:
    the bandwidth the memory-bound kernels are held against."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / kernel_ms(lambda: dst.copy_(src)) / 1e9
