"""What the cases share: starting their ranks, timing a call across them, and their report's header.

Ranks start one of two ways, by what the case needs:
    start_ranks(world, fn, *args)   an in-process group of `world` gloo CPU ranks (tests/distributed.py's
                                    `run_ranks`: forks of a forkserver that imported torch once, one
                                    thread each), every rank's result back in rank order
    torchrun(nproc, case)           the command of a torchrun job running a case on `nproc` ranks: a
                                    fresh process tree, for a job that must import another checkout's
                                    mplan or own the machine's GPUs
and a case started under torchrun joins its job with `join_job()` and reports from rank 0 only.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from distributed import run_ranks  # noqa: E402

from benchmarks.report import machine_header, run_header  # noqa: E402


def start_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float,
                default_dtype: torch.dtype = torch.float32) -> list[Any]:
    """`fn(*args)` on every rank of a fresh gloo group of `world` CPU ranks, under `default_dtype`
    (`run_ranks` sets the tests' float64; torch's own default is float32)."""
    return run_ranks(world, _with_default_dtype, default_dtype, fn, args, timeout_s=timeout_s)


def _with_default_dtype(dtype: torch.dtype, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    torch.set_default_dtype(dtype)
    return fn(*args)


def torchrun(nproc: int, case: list[str]) -> list[str]:
    """The command of a torchrun job of `nproc` ranks on this machine: `python -m benchmarks.ranks CASE...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "benchmarks.ranks", *case]


def join_job() -> bool:
    """Join the torchrun job this process is a rank of (gloo on CPUs, NCCL on GPUs): False outside one."""
    from mplan.runtime.launch import init_distributed_from_env

    return init_distributed_from_env() is not None


def rank() -> int:
    """This process's rank: 0 outside a group."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank of the group, if there is one."""
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """`fn()`'s seconds between barriers on every rank (the slowest rank's, on this rank's clock),
    its GPU work included, and what it returned."""
    barrier()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    barrier()
    return time.perf_counter() - start, out


def header(device: torch.device) -> dict[str, Any]:
    """A report's first keys: `report.machine_header()` (date, machine, versions, commit), and on a
    GPU the card and Triton's version (`report.run_header`)."""
    head = machine_header()
    return head if device.type == "cpu" else {**head, **run_header(device)}
