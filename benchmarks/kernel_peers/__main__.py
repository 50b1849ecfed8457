"""`python -m benchmarks.kernel_peers CASE --out FILE [flags]`: the harness's command line over the cases."""
from __future__ import annotations

from benchmarks import harness, kernel_peers
from benchmarks.kernel_peers import fp8, fused, gemm_duty, gemm_small_k, grouped_gemm, head_loss, hf, moe, optimizer

CASES = {"fused": fused, "hf": hf, "head-loss": head_loss, "fp8": fp8, "optimizer": optimizer, "moe": moe,
         "gemm-small-k": gemm_small_k, "gemm-duty": gemm_duty, "grouped-gemm": grouped_gemm}

if __name__ == "__main__":
    raise SystemExit(harness.main("kernel_peers", kernel_peers.__doc__ or "", CASES))
