"""Are mplan's kernels faster than what a user would otherwise run, at the shapes that matter?

Each case times mplan's kernels against their peers (torch eager, torch.compile, Liger Kernel,
Hugging Face's own code, torch's fused optimizer) on one GPU, by the method of engine.py: checked
in the benchmark's dtype against an fp32 reference, timed by the GPU's kernel time in interleaved
rounds (and CUDA events), peak memory measured, mplan's best against the best peer judged.

    fused         every fused Triton kernel against torch eager and torch.compile: correctness,
                  kernel time and CUDA events, share of copy bandwidth         results/kernels_h200-*.json
    hf            RMSNorm, RoPE, SwiGLU and head + loss at the HF models' shapes against Liger
                  Kernel, compile and HF eager                                 results/hf_kernels_h200-*.json
    head-loss     the fused head + loss by chunk size against Liger's fused linear cross-entropy
                  (time and memory)                                            results/head_loss_chunks_h200-*.json
    fp8           the FP8 cast kernel bit for bit, FP8 against bf16 linears    results/fp8_h200-*.json
    optimizer     mplan's multi-tensor AdamW against torch's fused AdamW, bf16 and fp32
                                                                               results/optimizer_h200-*.json
    moe           a Mixtral MoE block: mplan's grouped experts against HF's block and its compile
                                                                               results/moe_block_h200-*.json
    gemm-small-k  batched bf16 GEMMs with small reduction depth (the compute model's k term)
                                                                               results/gemm_small_k_h200-*.json
    gemm-duty     GEMMs back to back (as a device profile times them) against GEMMs between memory-bound
                  kernels (as a step runs them), beside their price: the power cap's share of a GEMM
    grouped-gemm  the grouped q/k/v and gate/up GEMMs with their weights apart (a copy a pass) against
                  end to end in one storage (read in place), at three HF models' widths

On the GPU, from the repository root (hf and head-loss time Liger, installed from the carried wheels):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel
    PYTHONPATH=. python -m benchmarks.kernel_peers CASE --out $OUT/CASE.json [flags]
Each case's smoke mode on a CPU (tiny shapes; Triton's kernels under its interpreter, in fp32):
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.kernel_peers CASE --device cpu --small --out /tmp/CASE.json
(fused and fp8 run Triton's kernels so; the other cases run without TRITON_INTERPRET, mplan's ops taking
their PyTorch references.)
"""
