"""FP8 linears on one GPU: the cast kernel checked bit for bit, and FP8 against bf16 GEMMs.

1. `mplan.kernels.fp8.cast_fp8` (Triton: one read, fp8 written row-major and transposed, amax
   by atomic max) against `_cast_reference` (torch ops) on random bf16 tensors, e4m3 and e5m2:
   both layouts must be bit-identical, the inverse scale and the amax exact; GPU kernel time and
   bandwidth (2 bytes read, 2 written per element) against the device-to-device copy measured
   in the same run.
2. A linear's forward and forward+backward at the GPT and Llama block shapes of
   benchmarks/models/e2e.py (16384 tokens): bf16 `F.linear` against `Fp8LinearFunction` (casts
   included), by the engine (engine.py) in one round: GPU kernel time (gpu_time.kernel_ms of 10
   calls), TFLOP/s, peak MB, and the relative errors against the fp32 product (fwd_rel_err: the
   output's; `errors`: the gradients' too).

Run on the GPU (from the repository root; under a minute):
    PYTHONPATH=. python -m benchmarks.kernel_peers fp8 --out $OUT/fp8.json
Smoke mode on a CPU (tiny shapes, fp32 inputs, wall-clock times; under Triton's interpreter, which
rounds fp8 wrongly, the cast need not be bit-identical there):
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.kernel_peers fp8 --device cpu --small --out /tmp/fp8.json
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.gpu_time import kernel_ms
from benchmarks.kernel_peers import engine
from benchmarks.report import Clock
from mplan.kernels.fp8 import E4M3, E5M2, Fp8LinearFunction, Fp8ScalingState, _cast_reference, cast_fp8

TOKENS, SMALL_TOKENS = 16384, 64
LINEARS = {  # (in, out) of the blocks' linears
    "gpt qkv": (2048, 6144), "gpt out": (2048, 2048), "gpt fc_in": (2048, 8192), "gpt fc_out": (8192, 2048),
    "llama kv": (2048, 512), "llama gate/up": (2048, 5632), "llama down": (5632, 2048),
}
SMALL_LINEARS = {"tiny": (32, 48)}
CASTS = (((16384, 2048), E4M3), ((16384, 8192), E4M3), ((16384, 6144), E5M2), ((1000, 3000), E4M3))
SMALL_CASTS = (((64, 32), E4M3), ((48, 80), E5M2), ((10, 30), E4M3))


def check_cast(casts: tuple[tuple[tuple[int, int], torch.dtype], ...], device: torch.device, dtype: torch.dtype,
               timer: Callable[[Callable[[], Any]], float], copy: float, log: Callable[[str], None]
               ) -> list[dict[str, Any]]:
    rows = []
    for shape, fp8 in casts:
        torch.manual_seed(0)
        x = (3 * torch.randn(shape, device=device)).to(dtype)
        scaling_amax = torch.tensor(8.0, device=device)  # |x| > 8 saturates: clamping is exercised
        got = cast_fp8(x, scaling_amax, fp8, transpose=True)
        want = _cast_reference(x, scaling_amax, fp8, transpose=True)
        ms = timer(lambda: cast_fp8(x, scaling_amax, fp8, transpose=True))
        tbps = 4 * x.numel() / ms / 1e9
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in ((got.data, want.data), (got.transposed, want.transposed)))
        rows.append({"shape": list(shape), "dtype": str(fp8).removeprefix("torch."), "bit_identical": same,
                     "inv_scale_exact": bool(got.inv_scale == want.inv_scale),
                     "amax_exact": bool(got.amax == want.amax),
                     "ms": round(ms, 4), "TBps": round(tbps, 3), "copy_fraction": round(tbps / copy, 3)})
        log(f"cast {shape} {fp8}: {rows[-1]}")
    return rows


def linear_op(name: str, k: int, n: int, tokens: int, device: torch.device, dtype: torch.dtype) -> engine.Op:
    """x [tokens, k] times W [n, k]: bf16 `F.linear` and `Fp8LinearFunction` (its own scaling state)."""
    return engine.Op(name=name, make=lambda: [engine.leaf((tokens, k), device, dtype),
                                              engine.leaf((n, k), device, dtype, k**-0.5)],
                     systems={"bf16": lambda: F.linear, "fp8": lambda: (lambda state: lambda x, w: (
                         Fp8LinearFunction.apply(x, w, None, state)))(Fp8ScalingState())},
                     reference=F.linear, baseline="bf16", mine=("fp8",))


def time_linears(linears: dict[str, tuple[int, int]], tokens: int, device: torch.device, dtype: torch.dtype,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Each linear by the engine in one round of 10 calls (gpu_time.kernel_ms of each call), no events."""
    out: dict[str, Any] = {}
    for name, (k, n) in linears.items():
        rows = engine.measure(linear_op(name, k, n, tokens, device, dtype), device, rounds=1, iters=10, log=log,
                              events=False)
        flops = 2 * tokens * k * n
        row: dict[str, Any] = {"tokens": tokens, "in": k, "out": n}
        for label, found in rows.items():
            row[label] = {"fwd_ms": round(found["fwd_ms"], 4), "fwd_bwd_ms": round(found["fwd_bwd_ms"], 4),
                          "fwd_TFLOPs": round(flops / found["fwd_ms"] / 1e9, 1),
                          "fwd_bwd_TFLOPs": round(3 * flops / found["fwd_bwd_ms"] / 1e9, 1),
                          "fwd_rel_err": found["errors"]["out0"], "errors": found["errors"],
                          "peak_mb": found["peak_mb"]}
        row["fp8_speedup_fwd_bwd"] = round(row["bf16"]["fwd_bwd_ms"] / row["fp8"]["fwd_bwd_ms"], 3)
        out[name] = row
        log(f"{name}: {row}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, clock = torch.device(args.device), Clock()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = (lambda fn: kernel_ms(fn, iters=20)) if device.type == "cuda" else engine.wall_ms
    copy = engine.copy_bandwidth_tbps(device)
    return {**engine.header(device), "copy_TBps": round(copy, 3),
            "cast": check_cast(SMALL_CASTS if args.small else CASTS, device, dtype, timer, copy, clock.log),
            "linears": time_linears(SMALL_LINEARS if args.small else LINEARS, SMALL_TOKENS if args.small else TOKENS,
                                    device, dtype, clock.log)}
