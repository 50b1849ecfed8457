#!/usr/bin/env bash
# Before a device call: everything the GPU scripts depend on that this CPU machine can check.
# Device time is scarce and a fresh machine spends minutes starting; a kernel that the Triton
# interpreter accepts can still fail Triton's compiler (2026-11-29: a tuple of eviction-hint
# strings cost one H200 call), so every kernel is compiled for sm_90 here first, and each
# benchmark script's CPU smoke test runs. About 30 s.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q -x tests/test_kernels_compile.py tests/test_kernels.py tests/test_benchmarks.py tests/test_bench_*.py
