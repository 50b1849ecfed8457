"""Is mplan's training step the fastest on the models users bring?

Each case trains whole models on one GPU, every system on the same seed-0 weights and the same
batches with fused AdamW and global-norm clipping, the systems resident together and timed in
interleaved rounds whose order rotates (timing.py), losses checked against eager's:

    peers            ten Hugging Face families from their configs (families.py), bf16: HF eager,
                     torch.compile, HF + Liger Kernel, mplan, a process per family; --own gpt,llama
                     adds mplan's own models; --profile the kernel and host tables; --gpu-trace the
                     card's clock beside the steps      results/peers-*.json, peers_h100-*.json, peers_profile*-*.json
    hf-models        the earlier race: HF Llama, Mistral, Qwen2 (and --families gpt,llama) on the same
                     systems                            results/hf_models_h200-*.json, hf_families_h200-*.json
    e2e              mplan's own GPT-1.3B and Llama-1.1B (workloads.py): eager, torch.compile, mplan, FP8
                     and the bare fused graph           results/e2e_h200-*.json
    fp8-convergence  FP8 against bf16 over hundreds of fresh batches of a Markov chain with a known
                     best loss                          results/fp8_convergence_h200-*.json
    step-profile     where a step's time goes: each system's kernels by category (kernel_profile.py)
                                                        results/step_profile*_h200-*.json
    gemm-ceiling     every GEMM and attention call of a step alone: the floor for any system built on
                     them                               results/gemm_ceiling_h200-*.json
    gpu-trace        an earlier peers run's steps beside its clock trace (trace.py), on any machine
                                                        results/peers_h100-*-trace.json, peers-*-trace.json

Shared: workloads.py (mplan's own models, the systems, e2e's checks), timing.py (warm-up and rounds),
contest.py (the race in one process), child.py (a system in a process of its own, over a pipe),
hf_step.py (a Hugging Face model's step, batches and loss checks), families.py, kernel_profile.py,
trace.py.

On the GPU, from the repository root (peers and hf-models time Liger, installed from the carried wheels):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel pulp highspy
    PYTHONPATH=. python -m benchmarks.models CASE --out $OUT/CASE.json [flags]
Each GPU case's smoke mode on a CPU (tiny models; mplan's kernels on their references):
    PYTHONPATH=. python -m benchmarks.models CASE --device cpu --small --out /tmp/CASE.json
(gemm-ceiling needs a GPU; gpu-trace reads files: `-h` on each case says how its results were made.)
"""
