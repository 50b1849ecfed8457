"""Does `mplan.autoparallel` add overhead? Plain eager vs the trivial plan on one H200 (issue 5).

The 24-layer, hidden-2048, seq-2048, batch-8 GPT of shared/reference/h200-measured-2026-11-29.json,
fp32 parameters with bf16 autocast and fused AdamW, trained (a) by a plain PyTorch loop and (b)
through `mplan.autoparallel(..., plan="dp=1,tp=1,pp=1")` in the same process, alternating, each
timed with CUDA events (median of `--steps` after warm-up), with peak allocated memory.

    PYTHONPATH=. python3 benchmarks/autoparallel_h200.py --out $OUT/autoparallel.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import mplan
from mplan.models import GPTConfig, build_model, example_inputs

CONFIG = GPTConfig(name="gpt-24l-h2048", num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab=50304)
BATCH = 8
FLOPS_PER_STEP = 72 * BATCH * 2048 * 24 * 2048**2 * (1 + 2048 / (6 * 2048) + 50304 / (12 * 2048 * 24))


def timed(step, warmup: int, steps: int) -> tuple[float, float]:
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def eager(warmup: int, steps: int) -> dict:
    model = build_model(CONFIG, device="cuda", dtype=torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, labels = example_inputs(model, BATCH, CONFIG.seq_len, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s, peak = timed(step, warmup, steps)
    del model, opt
    torch.cuda.empty_cache()
    return {"step_s": step_s, "peak_gib": peak, "tflops": FLOPS_PER_STEP / step_s / 1e12}


def through_mplan(warmup: int, steps: int) -> dict:
    model = build_model(CONFIG, device="cuda", dtype=torch.float32, seed=0)
    ids, labels = example_inputs(model, BATCH, CONFIG.seq_len, device="cuda")
    start = time.perf_counter()
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=BATCH, plan="dp=1,tp=1,pp=1",
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, fused=True),
                            max_grad_norm=1.0, autocast=True, device="cuda")
    setup_s = time.perf_counter() - start
    step_s, peak = timed(lambda: pm.train_step(ids, labels), warmup, steps)
    del pm, model
    torch.cuda.empty_cache()
    return {"step_s": step_s, "peak_gib": peak, "tflops": FLOPS_PER_STEP / step_s / 1e12, "setup_s": setup_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    runs = {"eager": [], "mplan": []}
    for _ in range(2):  # alternate, so clock and thermal drift hit both alike
        runs["eager"].append(eager(args.warmup, args.steps))
        runs["mplan"].append(through_mplan(args.warmup, args.steps))
        print(runs["eager"][-1], runs["mplan"][-1], flush=True)
    best = {k: min(v, key=lambda r: r["step_s"]) for k, v in runs.items()}
    doc = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": "GPT 24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304, batch 8; fp32 params, "
                    "bf16 autocast, fused AdamW, clipping 1.0", "runs": runs, "best": best,
           "mplan_vs_eager_step": best["mplan"]["step_s"] / best["eager"]["step_s"],
           "mplan_vs_eager_peak": best["mplan"]["peak_gib"] / best["eager"]["peak_gib"]}
    print(json.dumps({k: doc[k] for k in ("best", "mplan_vs_eager_step", "mplan_vs_eager_peak")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
