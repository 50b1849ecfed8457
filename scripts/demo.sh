#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, plan a real model on a real cluster, then a real
# training run on 4 CPU ranks (gloo): the Python standard library's sources as token shards, a
# small Llama under the planner's plan until the loss has clearly fallen, a checkpoint, the job
# resumed under a hand-written Megatron-style plan, and the result exported to Hugging Face.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mplan ] || bash scripts/setup.sh
rm -rf out && mkdir -p out
echo "== mplan plan: GPT-3 175B on 128 DGX A100 nodes (1024 GPUs), global batch 1536 (predicted figures)"
.venv/bin/mplan plan gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch 1536 -o out/gpt3-175b.plan.json -q
.venv/bin/mplan explain out/gpt3-175b.plan.json --gantt out/gpt3-175b.schedule.png > out/gpt3-175b.explain.txt
sed -n 1,12p out/gpt3-175b.explain.txt; echo "   (the whole explanation: out/gpt3-175b.explain.txt)"

STDLIB=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
echo "== mplan data prepare: the standard library's own sources ($STDLIB/*.py) to token shards, a BPE trained on them"
.venv/bin/mplan data prepare "$STDLIB/*.py" -o out/tokens --vocab-size 4096 -q

echo "== mplan train on 4 CPU ranks: the planner's plan, stopped at step 70 of 120 (a job's time limit), checkpointed"
.venv/bin/torchrun --nproc-per-node 4 -m mplan train examples/train_stdlib.toml \
    --set train.steps=120 --set train.stop_at=70 2>&1 | grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*"
echo "== resumed from the checkpoint under TP2 x DP2 with sequence parallelism and ZeRO-1, then exported"
.venv/bin/torchrun --nproc-per-node 4 -m mplan train examples/train_stdlib.toml --set train.steps=120 \
    --set plan.spec=tp=2,dp=2,sp=1,zero=1 --set checkpoint.export_hf=out/hf 2>&1 | grep -v "^W[0-9]\|OMP_NUM_THREADS\|\*\*\*\*"
echo "== the export, read by transformers: a greedy continuation of 'def __init__(self' (tokenizer: out/tokens/tokenizer.json)"
.venv/bin/python - <<'PY' 2>&1 | grep -v "^Loading weights"
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM
model, tok = AutoModelForCausalLM.from_pretrained("out/hf"), Tokenizer.from_file("out/tokens/tokenizer.json")
ids = torch.tensor([tok.encode("def __init__(self").ids])
out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, repetition_penalty=1.3)
print(type(model).__name__, f"{sum(p.numel() for p in model.parameters()):,} parameters:", repr(tok.decode(out[0].tolist())))
PY
echo "written to out/: $(ls out | paste -sd " " -) (loss curve: out/loss.png, per-step metrics: out/metrics.jsonl)"
