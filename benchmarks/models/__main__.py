"""`python -m benchmarks.models CASE --out FILE [flags]`: the harness's command line over the cases."""
from __future__ import annotations

from benchmarks import harness, models
from benchmarks.models import e2e, fp8_convergence, gemm_ceiling, gpu_trace, hf_models, peers, step_profile

CASES = {"peers": peers, "hf-models": hf_models, "e2e": e2e, "fp8-convergence": fp8_convergence,
         "step-profile": step_profile, "gemm-ceiling": gemm_ceiling, "gpu-trace": gpu_trace}

if __name__ == "__main__":
    raise SystemExit(harness.main("models", models.__doc__ or "", CASES))
