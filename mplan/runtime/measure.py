"""`mplan bench --measure`: run a plan for real on this job's ranks and time its steps.

Called on every rank of a torchrun job (or alone, for a one-device plan): builds the model on the
meta device (each rank initializes only its shards), parallelizes it with `autoparallel` under the
plan (bf16 parameters on GPUs, as the planner prices them: ZeRO-1 keeps fp32 masters of them),
trains `warmup + steps` steps on synthetic tokens and returns the median step time (the
slowest rank's, all-reduced), the tokens per second and the peak device memory (CUDA only).
A plan whose world size differs from the job's fails with the plan's own clear error.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any


def measure_plan(model_spec: str, plan_spec: str, *, global_batch: int, seq_len: int | None = None,
                 steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import mplan
    from mplan.models import build_model, resolve_model

    source = resolve_model(model_spec)
    seq = seq_len or source.seq_len
    model = build_model(source, device="meta")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, source.vocab, (global_batch, seq), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    on_gpu = torch.cuda.is_available()
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=global_batch, plan=plan_spec,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            dtype=torch.bfloat16 if on_gpu else None)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    ids, labels = ids.to(device), labels.to(device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(warmup + steps):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        pm.train_step(ids, labels)
        if on_gpu:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    if dist.is_initialized():
        slowest = torch.tensor([step_s], dtype=torch.float64, device=device if on_gpu else "cpu")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step_s = float(slowest.item())
    return {"step_time_s": step_s, "tokens_per_s": global_batch * seq / step_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
            "steps": steps, "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
