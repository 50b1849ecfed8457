"""FP8 linears on one GPU: the cast kernel checked bit for bit, and FP8 against bf16 GEMMs.

1. `mplan.kernels.fp8.cast_fp8` (Triton: one read, fp8 written row-major and transposed, amax
   by atomic max) against `_cast_reference` (torch ops) on random bf16 tensors, e4m3 and e5m2:
   both layouts must be bit-identical, the inverse scale and the amax exact; GPU time and
   bandwidth (2 bytes read, 2 written per element) against the device-to-device copy measured
   in the same run.
2. A linear's forward and forward+backward at the GPT and Llama block shapes of
   benchmarks/e2e.py (16384 tokens): bf16 `F.linear` against `Fp8LinearFunction` (casts
   included), GPU kernel time (benchmarks/gpu_time.py), TFLOP/s, and FP8's relative error
   against the fp32 product.

Run on the GPU (from the repository root; under a minute):
    PYTHONPATH=. python3 benchmarks/fp8_kernels.py --out $OUT/fp8.json
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import run_header, write_report  # noqa: E402
from benchmarks.gpu_time import copy_tbps, kernel_ms  # noqa: E402
from mplan.kernels.fp8 import E4M3, E5M2, Fp8LinearFunction, Fp8ScalingState, _cast_reference, cast_fp8  # noqa: E402

TOKENS = 16384
LINEARS = {  # (in, out) of the blocks' linears
    "gpt qkv": (2048, 6144), "gpt out": (2048, 2048), "gpt fc_in": (2048, 8192), "gpt fc_out": (8192, 2048),
    "llama kv": (2048, 512), "llama gate/up": (2048, 5632), "llama down": (5632, 2048),
}


def check_cast(copy: float) -> list[dict[str, Any]]:
    rows = []
    for shape, dtype in (((16384, 2048), E4M3), ((16384, 8192), E4M3), ((16384, 6144), E5M2), ((1000, 3000), E4M3)):
        torch.manual_seed(0)
        x = (3 * torch.randn(shape, device="cuda")).to(torch.bfloat16)
        scaling_amax = torch.tensor(8.0, device="cuda")  # |x| > 8 saturates: clamping is exercised
        got = cast_fp8(x, scaling_amax, dtype, transpose=True)
        want = _cast_reference(x, scaling_amax, dtype, transpose=True)
        ms = kernel_ms(lambda: cast_fp8(x, scaling_amax, dtype, transpose=True), iters=20)
        tbps = 4 * x.numel() / ms / 1e9
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in ((got.data, want.data), (got.transposed, want.transposed)))
        rows.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "bit_identical": same,
                     "inv_scale_exact": bool(got.inv_scale == want.inv_scale), "amax_exact": bool(got.amax == want.amax),
                     "ms": round(ms, 4), "TBps": round(tbps, 3), "copy_fraction": round(tbps / copy, 3)})
        print(f"cast {shape} {dtype}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def time_linears() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (k, n) in LINEARS.items():
        torch.manual_seed(0)
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        state = Fp8ScalingState()
        fp8 = lambda: Fp8LinearFunction.apply(x, w, None, state)  # noqa: E731
        bf16 = lambda: F.linear(x, w)  # noqa: E731
        exact = F.linear(x.float(), w.float())
        flops = 2 * TOKENS * k * n
        row: dict[str, Any] = {"tokens": TOKENS, "in": k, "out": n}
        for label, fn in (("bf16", bf16), ("fp8", fp8)):
            fwd = kernel_ms(fn)
            fwd_bwd = kernel_ms(lambda fn=fn: torch.autograd.grad(fn(), (x, w), dy))
            y = fn()
            row[label] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(fwd_bwd, 4),
                          "fwd_TFLOPs": round(flops / fwd / 1e9, 1), "fwd_bwd_TFLOPs": round(3 * flops / fwd_bwd / 1e9, 1),
                          "fwd_rel_err": ((y.float() - exact).norm() / exact.norm()).item()}
        row["fp8_speedup_fwd_bwd"] = round(row["bf16"]["fwd_bwd_ms"] / row["fp8"]["fwd_bwd_ms"], 3)
        out[name] = row
        print(f"{name}: {row}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    copy = copy_tbps()
    report = {**run_header(torch.device("cuda")), "copy_TBps": round(copy, 3), "cast": check_cast(copy),
              "linears": time_linears()}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
