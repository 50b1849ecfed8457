#!/usr/bin/env bash
# `mplan bench --measure` on 4 gloo CPU ranks for a mixture-of-experts model: expert-parallel plans
# (ep=2 and ep=4 carved from dp=4, ep=2 with TP2, ep=2 with PP2) beside data parallelism alone (ep=1) and
# the planner's own choice, each run for real and set beside its prediction, on the cluster file
# `mplan profile` measured on this machine (benchmarks/results/profile_cpu4-2026-12-02.json, made
# by bench_cpu_pipelines.sh; pass another as $2). Writes $1/bench_cpu4_experts.json (~4 minutes).
# One thread per rank: four ranks share this machine's cores, in the profile as in the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
profile=${2:-benchmarks/results/profile_cpu4-2026-12-02.json}
mkdir -p "$out"
export OMP_NUM_THREADS=1
.venv/bin/torchrun --nproc-per-node 4 -m mplan bench \
    "moe:layers=4,hidden=256,heads=8,kv_heads=4,ffn=512,experts=8,topk=2,seq=128,vocab=2048" \
    --cluster "$profile" --global-batch 16 \
    --plans "dp=4,ep=1" "dp=4,ep=2" "dp=4,ep=4" "tp=2,dp=2,ep=2" "pp=2,dp=2,ep=2,mbs=2" auto \
    --measure --out "$out/bench_cpu4_experts.json"
