"""Batched bf16 GEMMs with small reduction depth (attention's QK^T and PV written out) on the GPU.

The GEMM efficiency curve of compute_cost.py was fitted on GEMMs with k >= 2048; attention that
materializes its scores multiplies over k = head_dim (64-128) and n = seq. This measures those
shapes so the curve's k term is fitted on data, not extrapolated: `torch.bmm` timed by CUDA
events (triton.testing.do_bench, 10 warm-up and 50 ms of repetitions, the mean) and its TFLOP/s.

    PYTHONPATH=. python -m benchmarks.kernel_peers gemm-small-k --out $OUT/gemm_small_k.json
Smoke mode on a CPU (three tiny GEMMs in fp32, wall-clock time):
    PYTHONPATH=. python -m benchmarks.kernel_peers gemm-small-k --device cpu --small --out /tmp/gemm_small_k.json
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks import harness
from benchmarks.kernel_peers import engine

SHAPES = [(128, 2048, 2048, 64), (128, 2048, 2048, 96), (128, 2048, 2048, 128), (64, 2048, 2048, 256),
          (32, 2048, 2048, 512), (128, 2048, 128, 2048), (128, 2048, 96, 2048), (8, 8192, 8192, 128),
          (1, 16384, 16384, 128), (1, 16384, 4096, 256), (1, 16384, 4096, 512), (1, 16384, 4096, 1024)]
"""(batch, m, n, k)"""
SMALL_SHAPES = [(4, 32, 32, 8), (2, 32, 8, 32), (1, 64, 16, 16)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = engine.event_timer(device, warmup=10, rep=50, mode="mean")
    rows = []
    for batch, m, n, k in SMALL_SHAPES if args.small else SHAPES:
        a = torch.randn(batch, m, k, device=device, dtype=dtype)
        b = torch.randn(batch, k, n, device=device, dtype=dtype)
        ms = timer(lambda: torch.bmm(a, b))
        rows.append({"batch": batch, "m": m, "n": n, "k": k, "ms": ms,
                     "tflops": 2 * batch * m * n * k / (ms / 1e3) / 1e12})
        print(rows[-1], file=sys.stderr, flush=True)
    return {**engine.header(device), "rows": rows}
