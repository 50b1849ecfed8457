"""What the cases that measure one GPU share beyond the device flags (`harness.add_device_flags`):

    device_of(args, case)      the device, refused where CUDA is asked for and missing
    event_seconds(fn, ...)     seconds of each call after warm-up: CUDA events around the call alone on a GPU,
                               perf_counter on the CPU
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

GiB = 2**30


def device_of(args: argparse.Namespace, case: str) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{case}: no CUDA device here; use --device cpu for the smoke test")
    return torch.device(args.device)


def event_seconds(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Each of `iters` calls' seconds after `warmup` untimed ones; on a GPU, CUDA events recorded
    around the call and read after synchronizing (the GPU's time between them)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return times

