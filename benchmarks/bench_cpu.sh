#!/usr/bin/env bash
# `mplan bench --measure` on 4 gloo CPU ranks: each plan run for real and set beside its prediction,
# on a cluster file `mplan profile` measured on this same machine. One thread per rank: four ranks
# share this machine's cores, in the profile as in the bench.
#   benchmarks/bench_cpu.sh pipelines [OUT]
#       a Llama of 8 layers: dp=4, pp=4 (1F1B and zb-h1), pp2 x dp2, tp2 x pp2 and the planner's choice;
#       writes OUT/profile_cpu4.json (the measured cluster, ~6 minutes) and OUT/bench_cpu4_pipelines.json
#       (one row per plan: predicted, measured, prediction_error; the plans ranked both ways; ~3 minutes)
#   benchmarks/bench_cpu.sh experts [OUT] [PROFILE]
#       an MoE of 4 layers (8 experts, top-2): ep=1, 2 and 4 carved from dp=4, ep2 x tp2, ep2 x pp2 and the
#       planner's choice, on PROFILE (default benchmarks/results/profile_cpu4-2026-12-02.json, made by
#       `pipelines`); writes OUT/bench_cpu4_experts.json (~4 minutes)
# OUT defaults to out/.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:?usage: benchmarks/bench_cpu.sh pipelines|experts [OUT] [PROFILE]}
out=${2:-out}
mkdir -p "$out"
export OMP_NUM_THREADS=1
run() { .venv/bin/torchrun --nproc-per-node 4 "$@"; }
case "$which" in
  pipelines)
    run -m mplan profile -o "$out/profile_cpu4.json"
    run -m mplan bench "llama:layers=8,hidden=256,heads=8,kv_heads=4,ffn=704,seq=128,vocab=2048" \
        --cluster "$out/profile_cpu4.json" --global-batch 16 \
        --plans dp=4 "pp=4,mbs=1,schedule=1f1b" "pp=4,mbs=1,schedule=zb-h1" "pp=2,dp=2,mbs=2" "tp=2,pp=2,mbs=2" auto \
        --measure --out "$out/bench_cpu4_pipelines.json" ;;
  experts)
    profile=${3:-benchmarks/results/profile_cpu4-2026-12-02.json}
    run -m mplan bench "moe:layers=4,hidden=256,heads=8,kv_heads=4,ffn=512,experts=8,topk=2,seq=128,vocab=2048" \
        --cluster "$profile" --global-batch 16 \
        --plans "dp=4,ep=1" "dp=4,ep=2" "dp=4,ep=4" "tp=2,dp=2,ep=2" "pp=2,dp=2,ep=2,mbs=2" auto \
        --measure --out "$out/bench_cpu4_experts.json" ;;
  *) echo "benchmarks/bench_cpu.sh: unknown bench '$which' (pipelines or experts)" >&2; exit 2 ;;
esac
