#!/usr/bin/env bash
# Issues 7, 18, 31, 33 and 34 on one host of N H200s, in one device call: the NCCL link profile, bf16
# equivalence of plans against one GPU (ZeRO-2/3 and context parallelism included), the planner's auto
# plan against hand-written Megatron-style plans on a Llama-3-8B, expert parallelism on a Mixtral-shaped
# MoE, checkpoint save/load times, ZeRO-1 against ZeRO-3 over N GPUs, context parallelism at 32k
# tokens (all-gather and ring, cuDNN's attention) and experts carved from cp, each run for real. Prepared on
# 2026-11-29, 2026-12-02 and 2026-12-06 (the equivalence plans
# smoke-tested on 2 gloo CPU ranks: `-m benchmarks.equivalence gpus --device cpu --small --dtype float64`); run as
#     run(kind="nvidia-h200-x8", carry=[".device_wheels"],
#         command="bash benchmarks/multi_gpu_h200.sh 8")
# after `bash scripts/device_wheels.sh` here (the image lacks PuLP and HiGHS). Writes $OUT/*-xN.*
set -euo pipefail
n=${1:?number of GPUs}
out=${OUT:?the device tool sets OUT}
# NVLink multicast stays off (device README): also for every process torchrun starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
python3 -m pip install --quiet --no-index --find-links .device_wheels pulp highspy
run() { python3 -m torch.distributed.run --nproc-per-node "$n" "$@"; }

# 1. links: all-reduce, all-gather, reduce-scatter, all-to-all and p2p over message sizes
run -m mplan profile -o "$out/profile-x$n.json" 2>&1 | tail -5

# 2. bf16 against one GPU, 20 steps (tp over all GPUs; tp x dp with SP and ZeRO-1; dp with ZeRO-1;
#    on 2 GPUs, where tp x dp has no room, tp with SP instead)
half=$((n / 2))
#    and pipelines (NCCL's batched isend/irecv under 1F1B and zb-h1, the path gloo ranks test)
if [ "$n" -ge 4 ]; then
    plans="tp=$n;tp=$half,dp=2,sp=1,zero=1;dp=$n,zero=1;tp=$half,pp=2,sp=1,mbs=1;pp=$n,mbs=1,schedule=zb-h1"
    plans="$plans;dp=$n,zero=2;dp=$n,zero=3;tp=2,dp=$half,sp=1,zero=3;cp=$n;cp=2,tp=$half,sp=1"
    hand=("tp=$n,sp=1" "tp=$half,dp=2,sp=1,zero=1" "tp=2,dp=$half,sp=1,zero=1" "tp=$half,pp=2,sp=1,mbs=1")
    batch=64 seq=4096
else
    plans="tp=$n;tp=$n,sp=1,recompute=selective;dp=$n,zero=1;pp=$n,mbs=1;pp=$n,mbs=1,schedule=zb-h1"
    plans="$plans;dp=$n,zero=2;dp=$n,zero=3;cp=$n"
    hand=("tp=$n,sp=1" "dp=$n,zero=1" "tp=$n" "dp=$n,zero=1,recompute=full" "pp=$n,mbs=1" "pp=$n,mbs=1,schedule=zb-h1")
    batch=16 seq=2048  # two GPUs: a few steps of seconds each, not tens
fi
run -m benchmarks.equivalence gpus --out "$out/equivalence-x$n.json" --plans "$plans" 2>&1 | grep '^\[' || true

# 3. auto against hand-written plans on a Llama-3-8B, measured and predicted side by side
run -m mplan bench llama3-8b --cluster "$out/profile-x$n.json" --global-batch $batch --seq-len $seq \
    --plans auto "${hand[@]}" --measure --profile --out "$out/bench-llama3-8b-x$n.json" > /dev/null
tail -c 2000 "$out/bench-llama3-8b-x$n.json"

# 4. expert parallelism on NCCL: a Mixtral-shaped MoE of 2 layers, experts over every GPU (ep=N),
#    against data parallelism alone and the planner's choice, each measured beside its prediction
run -m mplan bench "moe:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,experts=8,topk=2,seq=4096,vocab=32000" \
    --cluster "$out/profile-x$n.json" --global-batch $((2 * n)) --plans "dp=$n,ep=$n" "dp=$n,ep=1" auto \
    --measure --out "$out/bench-moe-x$n.json" > /dev/null
tail -c 2000 "$out/bench-moe-x$n.json"

# 5. checkpoints on NCCL ranks (issue 31): a 1.3B Llama saved under tp=N with ZeRO-1 ranks, blocking and
#    in the background (the stall: the call's return), loaded under the same plan and resharded to
#    another; times between barriers on every rank
run -m benchmarks.ranks checkpoint --model "llama:layers=24,hidden=2048,heads=16,kv_heads=8,seq=2048,vocab=32000,ffn=5632" \
    --plan "tp=$half,dp=2,zero=1" --other "dp=$n,zero=1" --dtype bfloat16 --batch $((2 * n)) \
    --dir /tmp/mplan_ckpt -o "$out/checkpoint_time-x$n.json" 2>&1 | tail -3

# 6. ZeRO over N GPUs (issue 33): the 1.3B Llama under dp=N with ZeRO-1, -2 and -3, each measured
#    beside its prediction (the unit gathers and gradient reduce-scatters on NVLink, overlapped)
run -m mplan bench "llama:layers=24,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000" \
    --cluster "$out/profile-x$n.json" --global-batch $((4 * n)) \
    --plans "dp=$n,zero=1,mbs=2" "dp=$n,zero=2,mbs=2" "dp=$n,zero=3,mbs=2" auto \
    --measure --out "$out/bench-zero-x$n.json" > /dev/null
tail -c 1500 "$out/bench-zero-x$n.json"

# 7. context parallelism at 32k tokens (issue 34): a 4-layer Llama-3-8B-wide model on one sequence,
#    cp over every GPU against tp with SP and the planner's choice, measured beside the predictions
run -m mplan bench "llama:layers=4,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=32768,vocab=32000" \
    --cluster "$out/profile-x$n.json" --global-batch 1 --plans "cp=$n" "cp=$n,cp_method=ring" "tp=$n,sp=1" auto \
    --measure --out "$out/bench-cp-x$n.json" > /dev/null
tail -c 1500 "$out/bench-cp-x$n.json"

# 8. experts carved from cp alone (issue 34, session 15): the Mixtral-shaped MoE at 16k tokens on one
#    sequence, cp over every GPU with its experts over all of them (dp=1) against the experts whole
run -m mplan bench "moe:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,experts=8,topk=2,seq=16384,vocab=32000" \
    --cluster "$out/profile-x$n.json" --global-batch 1 --plans "dp=1,cp=$n,ep=$n" "dp=1,cp=$n,ep=1" auto \
    --measure --out "$out/bench-cp-moe-x$n.json" > /dev/null
tail -c 1500 "$out/bench-cp-moe-x$n.json"
