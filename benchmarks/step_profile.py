"""Where a training step's GPU time goes: eager, torch.compile and mplan, kernel by kernel.

For each workload of benchmarks/e2e.py and each system, after the warm-up steps, records
--steps steps under torch.profiler and reports per step: the wall time (CUDA events around the
profiled steps), the summed GPU kernel time, the time by category (GEMM, attention, norms and
other fused Triton kernels, torch.compile's generated kernels, elementwise, reductions,
optimizer, copies) and the largest kernels. This is the evidence for what to fuse next; the
headline ratios come from e2e.py, whose steps run without a profiler attached.

Run on the GPU (from the repository root; about 3 minutes with two torch.compile warm-ups):
    PYTHONPATH=. python3 benchmarks/step_profile.py --out $OUT/step_profile.json
Smoke test on a CPU (tiny models; the profiler then records no CUDA kernels):
    PYTHONPATH=. python3 benchmarks/step_profile.py --device cpu --small --out /tmp/step_profile.json
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import run_header, write_report  # noqa: E402
from benchmarks.e2e import FULL, SMALL, SYSTEMS, Setting, start_timer  # noqa: E402
from benchmarks.gpu_time import host_table, kernel_table  # noqa: E402

CATEGORIES: tuple[tuple[str, str], ...] = (
    # (category, regex on the kernel name), first match wins
    ("attention", r"flash|fmha|cudnn|attn|attention|sdpa"),
    ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|cublas|matmul|_scaled_mm"),
    ("optimizer", r"adam|multi_tensor|foreach|norm_kernel|lpnorm"),
    ("compile_triton", r"^triton_"),
    ("mplan_triton", r"_kernel$"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("reduction", r"reduce"),
    ("copy", r"copy|memcpy|memset|cat|fill"),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profiled(step: Callable[[], Any], steps: int, device: torch.device, classify: Callable[[str], str],
             *, top: int) -> dict[str, Any]:
    """`steps` calls of `step` under torch.profiler: wall time and GPU kernel time per step, the
    kernel time by `classify`'s category, the `top` kernels, and the host's side
    (`gpu_time.host_table`: launches, waits, the ops with most host time)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        elapsed = start_timer(device)
        for _ in range(steps):
            step()
        wall_s = elapsed()
    kernels = kernel_table(prof)
    by_category: dict[str, float] = {}
    for kernel, ms in kernels.items():
        label = classify(kernel)
        by_category[label] = by_category.get(label, 0.0) + ms / steps
    return {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 2),
            "gpu_kernel_ms_per_step": round(sum(kernels.values()) / steps, 2),
            "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k[:160]: round(v / steps, 3) for k, v in list(kernels.items())[:top]},
            "host": host_table(prof, steps)}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--models", default=None, help="comma-separated workload names (default: all)")
    parser.add_argument("--systems", default="eager,mplan,compile")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "autocast"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
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
    write_report(args.out, report)


if __name__ == "__main__":
    main()
