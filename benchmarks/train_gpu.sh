#!/usr/bin/env bash
# Issues 31 and 32 on one GPU, in one device call (run with carry=[".device_wheels"] after
# `bash scripts/device_wheels.sh` here; the image lacks PuLP and HiGHS):
#   1. `mplan profile` of the card (kernels, host figures), the cluster every plan below is priced on;
#   2. `mplan data prepare`: the Python standard library's sources as 32k-vocabulary BPE tokens;
#   3. `mplan train examples/train_gpu.toml`: a 1.1B Llama, bf16, the planner's plan, 120 steps with a
#      background checkpoint at step 60, TensorBoard, the loss PNG and a Hugging Face export; every
#      step's measured time and peak memory beside the plan's predictions in the JSONL;
#   4. `python -m benchmarks.ranks checkpoint`: blocking and background saves and loads of a 1.3B Llama;
#   5. issue 33: `mplan bench --measure` of the same 1.3B Llama at dp=1 under zero=0, 1 and 3 (zero=3
#      still gathers each unit and frees it, over one rank): step time and peak memory beside the
#      predictions.
#     bash benchmarks/train_gpu.sh [STEPS] [quick]     (quick: steps 1-3 only, for a short lease)
# Results (JSON, the GPU's name and versions) go to $OUT, joined into $OUT/train_gpu.json by
# `python -m benchmarks.calibration train-summary` (8 files: what the device returns); work files stay in /tmp/g.
set -u
cd "$(dirname "$0")/.."
steps=${1:-120}
quick=${2:-}
out=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --find-links .device_wheels pulp highspy 2>&1 | tail -2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/g
{ nvidia-smi --query-gpu=name --format=csv,noheader | head -1
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  df -h /tmp | tail -1; } > "$out/gpu.txt"
cat "$out/gpu.txt"
start=$(date +%s)
timeout 200 python3 -m mplan profile -o /tmp/g/cluster.json 2>&1 | tail -3
cp /tmp/g/cluster.json "$out/profile.json"
echo "profile: $(( $(date +%s) - start )) s"
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
timeout 200 python3 -m mplan data prepare "$stdlib/**/*.py" --exclude '*/site-packages/*' --vocab-size 32000 \
    -o /tmp/g/tokens-32k -q --json > "$out/data.json" 2>&1
tail -c 600 "$out/data.json"; echo
echo "data: $(( $(date +%s) - start )) s"
cd /tmp/g
timeout 330 python3 -m torch.distributed.run --nproc-per-node 1 -m mplan train "$OLDPWD/examples/train_gpu.toml" \
    --set cluster.name=/tmp/g/cluster.json --set data.path=/tmp/g/tokens-32k --set train.steps="$steps" \
    2>&1 | tee /tmp/g/train.log | tail -25
cd "$OLDPWD"
cp /tmp/g/out/metrics-gpu.jsonl "$out/train_gpu_metrics.jsonl" 2>/dev/null
cp /tmp/g/out/loss-gpu.png "$out/train_gpu_loss.png" 2>/dev/null
ls /tmp/g/out/tb-gpu /tmp/g/out/hf-gpu /tmp/g/out/ckpt-gpu 2>&1 | head -20
echo "train: $(( $(date +%s) - start )) s"
summary() { python3 -m benchmarks.calibration train-summary "$out" -o "$out/train_gpu.json" 2>&1 | tail -3; }
summary
[ "$quick" = quick ] && exit 0
timeout 200 python3 -m benchmarks.ranks checkpoint --plan dp=1 --other dp=1,recompute=full --dtype bfloat16 \
    --model "llama:layers=24,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000" --batch 4 \
    --dir /tmp/g/ckpt-time -o "$out/checkpoint_time.json" 2>&1 | tail -30
echo "checkpoint_time: $(( $(date +%s) - start )) s"
timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 -m mplan bench \
    "llama:layers=24,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000" --cluster /tmp/g/cluster.json \
    --global-batch 8 --plans dp=1,mbs=2 dp=1,zero=1,mbs=2 dp=1,zero=3,mbs=2 --measure --out "$out/zero_bench.json" \
    2>&1 | tail -12 | cut -c1-220
echo "zero bench: $(( $(date +%s) - start )) s"
summary
