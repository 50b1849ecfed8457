#!/usr/bin/env bash
# `mplan bench --measure` on 4 gloo CPU ranks: pipeline plans (1F1B, zb-h1, interleaved), data and
# tensor parallelism and the planner's own choice, each run for real and set beside its prediction,
# on a cluster file `mplan profile` measured on this same machine. Writes, under $1 (default out/):
#   profile_cpu4.json           the measured cluster (kernels and gloo links; ~6 minutes)
#   bench_cpu4_pipelines.json   one row per plan (predicted, measured, prediction_error) and the
#                               ranking of the plans by prediction and by measurement (~3 minutes)
# One thread per rank: four ranks share this machine's cores, in the profile as in the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
export OMP_NUM_THREADS=1
run() { .venv/bin/torchrun --nproc-per-node 4 "$@"; }
run -m mplan profile -o "$out/profile_cpu4.json"
run -m mplan bench "llama:layers=8,hidden=256,heads=8,kv_heads=4,ffn=704,seq=128,vocab=2048" \
    --cluster "$out/profile_cpu4.json" --global-batch 16 \
    --plans dp=4 "pp=4,mbs=1,schedule=1f1b" "pp=4,mbs=1,schedule=zb-h1" "pp=2,dp=2,mbs=2" "tp=2,pp=2,mbs=2" auto \
    --measure --out "$out/bench_cpu4_pipelines.json"
