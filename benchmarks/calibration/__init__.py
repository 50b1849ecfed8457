"""Does the planner predict what ONE GPU measures? Each case runs on one GPU (or, for steps-check,
train-summary, bench-cli's --reprice and the IR side of activation-probe, on a CPU) and holds what it
measures against the planner's price.

    steps             single-GPU training steps of four 1-3B models with mplan's runtime, and an anchor
                                                                          results/h200_step-*.json
    steps-check       a steps run's rows predicted by the planner's evaluator (on a CPU)
                                                                          results/h200_calibration-*.json
    host              host seconds per launch, and the step times they predict at micro-batch 1, 2 and 8
                                                                          results/host_overhead_h100-*.json
    memory-timeline   what is alive at the peak of one mplan step, against the memory model
                                                                          results/memory_timeline_h200-*.json
    activation-probe  the activations one block keeps for backward, against the IR's saved bytes
                                                                          results/activation_probe_h*-*.json
    split-backward    the zero-bubble split of a stage's backward (I + W) against the whole one (B)
                                                                          results/split_backward_h200-*.json
    copy-table        the profile's copy table timed three ways; --apply writes one into a profile
                                                                          results/copy_table_h200-*.json
    cp-attention      one context-parallel rank's local attention at 32k-128k tokens against its price
                                                                          results/cp_attention_h100-*.json
    bench-cli         `mplan bench CONFIG --measure` as a user runs it, on HF configs seen and unseen;
                      --reprice prices earlier runs again on a CPU     results/hf_bench_h200-*.json,
                                                          results/hf_measure*.json, results/hf_reprice-*.json
    profile           a card's kernel tables: writes its packaged profile (--card, default h200) and a summary
                                                                          results/profile_h200-*.json
    train-summary     what benchmarks/train_gpu.sh wrote, joined: `mplan train`'s steps against the plan
                                                                          results/train_gpu-*.json

On the GPU, from the repository root:
    PYTHONPATH=. python -m benchmarks.calibration CASE --out $OUT/CASE.json [flags]
Each GPU case's smoke mode on a CPU (tiny shapes; no claim rests on its figures):
    PYTHONPATH=. python -m benchmarks.calibration CASE --device cpu --small --out /tmp/CASE.json
(copy-table and split-backward take `--device cpu` alone; activation-probe measures where CUDA is and
only prices on a CPU; train-summary reads a folder: `train-summary $OUT`.) Each case's docstring (`-h`)
gives its method and the command of each cited result; `gpu` is what the GPU cases share (the device
flags, the CUDA-event timer, GiB).
"""
