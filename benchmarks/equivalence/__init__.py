"""Equivalence: does every parallel layout train exactly like one device?

    pipelines  every check of tests/test_pipeline.py (schedules, TP, SP, DP, ZeRO-1, uneven stages,
               tied heads, Hugging Face Llama and Mistral) on 2, 4 and 8 gloo CPU ranks, float64,
               against the plain one-process loop; 5 AdamW steps with active clipping (about 6
               minutes on 2 cores)
    experts    every check of tests/test_expert_parallel.py (EP2, EP4, EP2xTP2 with and without SP,
               EP2xDP2 with ZeRO-1, EP2xPP2 under 1f1b and zb-h1, a skewed router, a plan's capacity
               factor; mplan's MoE family, Hugging Face Mixtral and Qwen2-MoE) on 2 and 4 ranks,
               against the one-process model with gradient accumulation over the same micro-batches
               (about 4 minutes)
    zoo        every outside model of tests/zoo_models.py under every plan of tests/test_zoo.py, 3
               AdamW steps, with the bound the test holds each model to and the layout that ran or
               the error that refused it (the README's table; about 8 minutes)
    gpus       plans against one GPU in the training dtype over NCCL (under torchrun)
    fusion     what the fusion pass fuses in each of 42 Hugging Face families (tiny configs, float64)
               and whether each fused program trains exactly as its unfused one (about a minute)

The three tables run the very functions their tests run, keep the worst rank's loss and parameter
errors and the layout that ran, and print the markdown table the docs carry.

    PYTHONPATH=. python -m benchmarks.equivalence pipelines -o benchmarks/results/pipeline-cpu-2026-12-02.json
    PYTHONPATH=. python -m benchmarks.equivalence experts -o benchmarks/results/experts-cpu-2026-12-02.json
    PYTHONPATH=. python -m benchmarks.equivalence zoo -o benchmarks/results/zoo-cpu-2026-12-02.json
(those results made before the harness, by `python benchmarks/equivalence_tables.py TABLE`)
"""
