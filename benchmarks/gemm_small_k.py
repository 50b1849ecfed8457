"""Batched bf16 GEMMs with small reduction depth (attention's QK^T and PV written out) on the GPU.

The GEMM efficiency curve of compute_cost.py was fitted on GEMMs with k >= 2048; attention that
materializes its scores multiplies over k = head_dim (64-128) and n = seq. This measures those
shapes so the curve's k term is fitted on data, not extrapolated.

    PYTHONPATH=. python3 benchmarks/gemm_small_k.py --out $OUT/gemm_small_k.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for batch, m, n, k in [(128, 2048, 2048, 64), (128, 2048, 2048, 96), (128, 2048, 2048, 128),
                           (64, 2048, 2048, 256), (32, 2048, 2048, 512), (128, 2048, 128, 2048),
                           (128, 2048, 96, 2048), (8, 8192, 8192, 128), (1, 16384, 16384, 128),
                           (1, 16384, 4096, 256), (1, 16384, 4096, 512), (1, 16384, 4096, 1024)]:
        a = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(batch, k, n, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: torch.bmm(a, b), warmup=10, rep=50)
        rows.append({"batch": batch, "m": m, "n": n, "k": k, "ms": ms,
                     "tflops": 2 * batch * m * n * k / (ms / 1e3) / 1e12})
        print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
