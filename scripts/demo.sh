#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, plan a real model on a real cluster, then plan and
# train a small model for real on 4 CPU ranks (gloo) and check it against one process.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mplan ] || bash scripts/setup.sh
mkdir -p out
echo "== mplan plan: GPT-3 175B on 128 DGX A100 nodes (1024 GPUs), global batch 1536 (predicted figures)"
.venv/bin/mplan plan gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch 1536 -o out/gpt3-175b.plan.json
.venv/bin/mplan explain out/gpt3-175b.plan.json --gantt out/gpt3-175b.schedule.png > out/gpt3-175b.explain.txt
SMALL="llama:layers=4,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128"
echo "== mplan plan: a small Llama on 4 local CPU ranks, tensor x pipeline parallel, then that plan trained for real"
echo "   (each step logged: loss, step time, tokens/s, model FLOP/s per rank, learning rate under warmup)"
.venv/bin/mplan plan "$SMALL" --cluster cpu --gpus-per-node 4 --global-batch 8 --spec tp=2,pp=2,mbs=1 \
    -o out/small-llama.plan.json
.venv/bin/mplan explain out/small-llama.plan.json --gantt out/small-llama.schedule.png > out/small-llama.explain.txt
.venv/bin/torchrun --nproc-per-node 4 examples/train_cpu.py --model "$SMALL" --plan out/small-llama.plan.json --check
echo "== a hand-written Megatron-style plan (TP2 x DP2, sequence parallel, ZeRO-1) on the same ranks"
.venv/bin/torchrun --nproc-per-node 4 examples/train_cpu.py --plan tp=2,dp=2,sp=1,zero=1 --check \
    --steps 8 --log-every 2
echo "written to out/ (plans .plan.json, explanations .explain.txt, Gantt charts .schedule.png): $(ls out | paste -sd " " -)"
