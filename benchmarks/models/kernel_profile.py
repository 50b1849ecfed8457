"""A step's GPU time by kernel under torch.profiler: kernels by category, the largest, the host's side.

`category` sorts a kernel name into GEMM, attention, the fused Triton kernels (mplan's and
torch.compile's), elementwise, reductions, optimizer and copies (the `step-profile` case's
categories); `kernel_category` refines what it leaves as fused/elementwise/reduction/other into
loss, norm, RoPE and SwiGLU (the `hf-models` and `peers` cases' profiles).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_time import host_table, kernel_table
from benchmarks.models.timing import start_timer
from benchmarks.models.workloads import Step

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


FINE_CATEGORIES: tuple[tuple[str, str], ...] = (
    # refinements of `category` for what it leaves as fused/elementwise/reduction/other
    ("loss", r"cross_entropy|log_?softmax|nll_loss|logsumexp|_block_stats_kernel|_combine_kernel|_grad_kernel"
             r"|_grad_in_place_kernel|_mean_kernel|element_mul_kernel"),
    ("norm", r"rms_?norm|rsqrt"),
    ("rope", r"rope|rotary"),
    ("swiglu", r"swiglu|silu|_packed_(forward|backward)_kernel"),
    # mplan's rms_norm and (unpacked) swiglu kernels share these Triton names: not told apart
    ("norm_or_swiglu", r"^_(forward|backward)_kernel$"),
)
COARSE_TO_CATEGORY = {"gemm": "gemm", "attention": "attention", "optimizer": "optimizer", "copy": "copy",
                      "elementwise": "elementwise", "reduction": "elementwise", "compile_triton": "elementwise",
                      "mplan_triton": "other", "other": "other"}


def kernel_category(name: str) -> str:
    coarse = category(name)
    if coarse in ("gemm", "attention", "optimizer"):
        return coarse
    for label, pattern in FINE_CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return COARSE_TO_CATEGORY[coarse]


def profile_steps(step: Step, steps: int, device: torch.device) -> dict[str, Any]:
    """`steps` steps under torch.profiler (`profiled`), kernels by `kernel_category`,
    the top 25."""
    return profiled(step, steps, device, kernel_category, top=25)

