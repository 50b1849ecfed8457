#!/usr/bin/env bash
# Issue 30 on one GPU, in one device call: host time per launch measured (benchmarks.calibration host,
# which also benches a Qwen2-0.5B config at micro-batch 1, 2 and 8), then `mplan bench --measure`
# on the unseen HF configs (benchmarks.calibration bench-cli --configs unseen). On an H200 the configs
# are priced on the packaged H200 kernel tables carrying the host figures just measured; on any other
# GPU the machine is profiled once first (`mplan profile`, host figures included, $OUT/profile.json),
# as a user would.
# Give each model a call of its own at first (a 256k-vocabulary model's rows took ~2 minutes each
# before models on meta were initialized on the GPU; 1.7B ones ~75 s). PLANS (space-separated specs)
# measures only those rows, e.g. the ones an earlier call's budget cut; bench-cli --reprice joins the runs.
#     bash benchmarks/hf_measure_gpu.sh [MODELS] [--skip-host]     (MODELS: qwen3,smollm2,gemma)
#     PLANS="mbs=8,recompute=selective mbs=8,recompute=full" bash benchmarks/hf_measure_gpu.sh qwen3 --skip-host
# Results (JSON, the GPU's name and versions) go to $OUT; work files stay in /tmp/r.
set -u
cd "$(dirname "$0")/.."
models=${1:-qwen3}
python3 -m pip install -q --no-index --find-links .device_wheels pulp highspy 2>&1 | tail -2
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p /tmp/r "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$gpu"; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
if [ "${2:-}" != "--skip-host" ]; then
    timeout 240 python3 -m benchmarks.calibration host --out /tmp/r/host_overhead.json 2>&1 | tail -20
    cp /tmp/r/host_overhead.json "$OUT/" 2>/dev/null
fi
cluster=()
case "$gpu" in
    *H200*) [ -f /tmp/r/host_overhead_work/cluster.json ] && cluster=(--cluster /tmp/r/host_overhead_work/cluster.json) ;;
    *)  # another card: `mplan profile` once, as a user would, for every model below (35 s on the H100),
        # not once per model inside bench-cli
        timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 -m mplan profile -o /tmp/r/cluster.json \
            --no-links -q 2>&1 | tail -3
        [ -f /tmp/r/cluster.json ] && cluster=(--cluster /tmp/r/cluster.json) && cp /tmp/r/cluster.json "$OUT/profile.json" ;;
esac
plans=()
if [ -n "${PLANS:-}" ]; then read -ra plans <<< "$PLANS"; plans=(--plans "${plans[@]}"); fi
for m in ${models//,/ }; do
    # the outer limit leaves bench-cli time to write its report after its own per-model one
    timeout 330 python3 -m benchmarks.calibration bench-cli --configs unseen --models "$m" "${cluster[@]}" \
        "${plans[@]}" --timeout-s 300 --out "/tmp/r/hf_measure_$m.json" 2>&1 | tail -3
    cp -r "/tmp/r/hf_measure_$m.json" "/tmp/r/hf_measure_${m}_work" "$OUT/" 2>/dev/null
done
