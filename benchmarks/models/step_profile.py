"""Where a training step's GPU time goes: eager, torch.compile and mplan, kernel by kernel.

For each workload of the `e2e` case (benchmarks/models/workloads.py) and each system, after the
warm-up steps, records --steps steps under torch.profiler and reports per step: the wall time
(CUDA events around the profiled steps), the summed GPU kernel time, the time by category (GEMM,
attention, norms and other fused Triton kernels, torch.compile's generated kernels, elementwise,
reductions, optimizer, copies; benchmarks/models/kernel_profile.py) and the largest kernels. This
is the evidence for what to fuse next; the headline ratios come from the `e2e` case, whose steps
run without a profiler attached.

Run on the GPU (from the repository root; about 3 minutes with two torch.compile warm-ups):
    PYTHONPATH=. python -m benchmarks.models step-profile --out $OUT/step_profile.json
Smoke test on a CPU (tiny models; the profiler then records no CUDA kernels):
    PYTHONPATH=. python -m benchmarks.models step-profile --device cpu --small --out /tmp/step_profile.json
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch

from benchmarks.harness import add_device_flags
from benchmarks.models.kernel_profile import category, profiled
from benchmarks.models.workloads import FULL, SMALL, SYSTEMS, Setting
from benchmarks.report import run_header


def profile_system(name: str, workload: Any, setting: Setting, warmup: int, steps: int) -> dict[str, Any]:
    step, info = SYSTEMS[name](workload, setting)
    for _ in range(warmup):
        step()
    cuda = setting.device.type == "cuda"
    result = {**profiled(step, steps, setting.device, category, top=40), "fused": info.get("fused")}
    del step
    gc.collect()
    if name == "compile":
        torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flags(parser)
    parser.add_argument("--models", default=None, help="comma-separated workload names (default: all)")
    parser.add_argument("--systems", default="eager,mplan,compile")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "autocast"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    setting = Setting(device=torch.device(args.device), precision=args.precision)
    workloads = SMALL if args.small else FULL
    if args.models:
        workloads = tuple(w for w in workloads if w.name in args.models.split(","))
    report: dict[str, Any] = {**run_header(setting.device), "steps_profiled": args.steps, "models": {}}
    for workload in workloads:
        rows = report["models"].setdefault(workload.name, {})
        for name in args.systems.split(","):
            rows[name] = profile_system(name, workload, setting, args.warmup, args.steps)
            row = rows[name]
            print(f"[{time.perf_counter() - began:6.1f}s] {workload.name} {name}: wall {row['wall_ms_per_step']} ms, "
                  f"kernels {row['gpu_kernel_ms_per_step']} ms, {row['by_category_ms']}", file=sys.stderr, flush=True)
    return report
