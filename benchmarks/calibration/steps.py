"""Single-GPU training steps with mplan's own runtime, measured: what steps-check predicts (issue 3's check;
the question "does the cost model predict what runs?").

On the GPU (torch with CUDA, no PuLP needed): for each model (GPT and Llama shapes of 1-3B parameters,
built by `mplan.models`), trains with mplan's own single-rank runtime: bf16 parameters and activations,
gradients in a bf16 bucket, ZeRO-1 style optimizer with fp32 master weights and fused AdamW
(`mplan.runtime.build_optimizer`, zero=1 on one rank). Times the step with CUDA events (median of
`--steps` after warm-up) and records `torch.cuda.max_memory_allocated`, plus the memory after building
the model and the optimizer. Also runs the reference configuration of
mplan/cost_models/reference/h200-measured-2026-11-29.json (fp32 parameters, bf16 autocast, fused AdamW)
on its GPT, as an anchor for this run's machine. The card and torch version are in the JSON.

    PYTHONPATH=. python -m benchmarks.calibration steps --out $OUT/h200_step.json

(benchmarks/results/h200_step-2026-11-29.json was made by the old `benchmarks/step_calibration.py
measure` with the same flags, before it had the harness's `harness` and `command` keys and `triton`.)
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch

from benchmarks.calibration.gpu import GiB, event_seconds
from benchmarks.report import run_header
from mplan.ir.mesh import MeshShape
from mplan.models import GPTConfig, LlamaConfig, build_model, example_inputs
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.process_groups import init_process_groups

CONFIGS = [
    ("gpt-1.3b-b8", GPTConfig(name="gpt-1.3b", num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab=50304), 8),
    ("llama-1.1b-b8", LlamaConfig(name="llama-1.1b", num_layers=22, hidden=2048, num_heads=16, num_kv_heads=4,
                                  ffn_hidden=5632, seq_len=2048, vocab=32000), 8),
    ("gpt-2.7b-b4", GPTConfig(name="gpt-2.7b", num_layers=32, hidden=2560, num_heads=32, seq_len=2048, vocab=50304), 4),
    ("llama-3b-b4", LlamaConfig(name="llama-3b", num_layers=28, hidden=3072, num_heads=24, num_kv_heads=8,
                                ffn_hidden=8192, seq_len=2048, vocab=128256, tie_embeddings=True,
                                rope_theta=500000.0), 4),
]
CUDA = torch.device("cuda")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)


def measure_mplan_runtime(name: str, config: Any, batch: int, warmup: int, steps: int) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=0)
    after_model = torch.cuda.memory_allocated()
    groups = init_process_groups(MeshShape())
    opt = build_optimizer(list(model.parameters()), functools.partial(torch.optim.AdamW, lr=1e-4, fused=True),
                          groups, zero=1)
    after_optimizer = torch.cuda.memory_allocated()
    ids, labels = example_inputs(model, batch, config.seq_len, device="cuda")

    def step() -> None:
        loss = model(ids, labels=labels)
        loss.backward()
        opt.step(max_grad_norm=1.0)
        opt.zero_grad()

    times = event_seconds(step, CUDA, warmup, steps)
    fwd_bwd = event_seconds(lambda: model(ids, labels=labels).backward(), CUDA, 2, max(3, steps // 2))
    peak = torch.cuda.max_memory_allocated()
    num_params = sum(p.numel() for p in model.parameters())
    del model, opt
    return {"name": name, "family": config.family, "config": {k: getattr(config, k) for k in (
        "num_layers", "hidden", "num_heads", "seq_len", "vocab")} | {"kv_heads": config.kv_heads, "ffn": config.ffn,
        "tie_embeddings": config.tie_embeddings}, "batch": batch, "num_parameters": num_params,
        "step_s": statistics.median(times), "step_s_all": times, "fwd_bwd_s": statistics.median(fwd_bwd),
        "peak_allocated_gib": peak / GiB, "after_model_gib": after_model / GiB,
        "after_optimizer_gib": after_optimizer / GiB}


def measure_reference_anchor(warmup: int, steps: int) -> dict[str, Any]:
    """fp32 params + bf16 autocast + fused AdamW, as in h200-measured-2026-11-29.json."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = CONFIGS[0][1]
    model = build_model(config, device="cuda", dtype=torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, labels = example_inputs(model, 8, config.seq_len, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = event_seconds(step, CUDA, warmup, steps)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    return {"name": "anchor-gpt-1.3b-fp32-autocast-b8", "step_s": statistics.median(times),
            "peak_allocated_gib": peak / GiB}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration's step time and peak memory, and the anchor's."""
    if not torch.cuda.is_available():
        raise SystemExit("steps: measures a GPU and there is no CUDA device here (steps-check runs on a CPU)")
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name, config, batch in CONFIGS:
        t0 = time.time()
        rows.append(measure_mplan_runtime(name, config, batch, args.warmup, args.steps))
        print(f"{name}: {rows[-1]['step_s'] * 1e3:.1f} ms/step, peak {rows[-1]['peak_allocated_gib']:.2f} GiB "
              f"({time.time() - t0:.0f} s)", flush=True)
    anchor = measure_reference_anchor(args.warmup, args.steps)
    print(f"anchor: {anchor['step_s'] * 1e3:.1f} ms/step, peak {anchor['peak_allocated_gib']:.2f} GiB", flush=True)
    return {**run_header(CUDA), "runtime": "mplan single-rank: bf16 params, zero=1 fp32 master, fused AdamW, "
            "grad clipping 1.0", "rows": rows, "anchor": anchor}
