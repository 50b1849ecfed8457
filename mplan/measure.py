"""`mplan bench --measure`: run a plan for real on this job's ranks and time its steps.

Called on every rank of a torchrun job (or alone, for a one-device plan): builds the model on the
meta device (each rank initializes only its shards), parallelizes it with `autoparallel` under the
plan (bf16 parameters on GPUs, as the planner prices them: ZeRO-1 keeps fp32 masters of them),
trains `warmup + steps` steps on synthetic tokens and returns the median step time (the
slowest rank's, all-reduced), the tokens per second and the peak device memory (CUDA only).
With `profile=True` one more step runs under torch.profiler and this rank's GPU kernel time is
reported by kind (`step_kernel_split`): NCCL, GEMM, attention and the rest, beside the step's
wall time, so that a step slower than predicted shows whether its links, its kernels or its host
(wall time the kernels do not fill) took the difference, and its largest kernels by name.
A plan whose world size differs from the job's fails with the plan's own clear error.
`cluster` is the one the plan is resolved on, the bench's (`--cluster`), so that the plan run is the
plan predicted; None: the job's own (`ClusterSpec.local()`, the device's datasheet preset).
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mplan.cost_models.cluster import ClusterSpec


KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "_scaled_mm")),
)
"""Kernel kinds by substrings of the kernel name, first match wins; anything else is "other"."""


def kernel_kind(name: str) -> str:
    """The kind (`KERNEL_KINDS`) of a GPU kernel, by its name."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other")


def step_kernel_split(step: Callable[[], Any], *, largest: int = 40) -> dict[str, Any]:
    """Wall seconds of one `step()`, this rank's GPU kernel seconds by kind (CUDA), its kernel count
    and its `largest` kernels by summed seconds (name, seconds, launches): what to compare kernel
    by kernel between two plans, e.g. micro-batch 1 against 8, when their difference is not the
    one priced."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    split: dict[str, Any] = {"wall_s": time.perf_counter() - start, **{kind: 0.0 for kind, _ in KERNEL_KINDS},
                             "other": 0.0}
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.is_user_annotation:
            continue
        split[kernel_kind(event.name)] += event.device_time / 1e6
        total = by_name.setdefault(event.name, [0.0, 0])
        total[0], total[1] = total[0] + event.device_time / 1e6, total[1] + 1
    split["launches"] = int(sum(count for _, count in by_name.values()))
    split["kernels"] = [[name, seconds, int(count)] for name, (seconds, count)
                        in sorted(by_name.items(), key=lambda item: -item[1][0])[:largest]]
    return split


def measure_plan(model_spec: str, plan_spec: str, *, global_batch: int, seq_len: int | None = None,
                 vocab: int | None = None, steps: int = 5, warmup: int = 3, profile: bool = False,
                 cluster: ClusterSpec | None = None, built: Callable[[], None] | None = None,
                 cuda_graphs: bool | None = None) -> dict[str, Any]:
    """`built`, when given, is called on every rank once the plan's program is built, before its
    first step's collectives: `mplan bench` has its ranks agree there that no rank failed. Three
    warm-up steps: a one-rank plan on CUDA captures its CUDA graph at the third (`runtime.step_graph`),
    which is no step a run repeats; `cuda_graphs` is autoparallel's (None: where the plan allows)."""
    import torch
    import torch.distributed as dist

    import mplan
    from mplan.models import build_model, resolve_model

    source = resolve_model(model_spec, vocab=vocab)  # vocab: a factory module's (--vocab)
    seq = seq_len or source.seq_len
    on_gpu = torch.cuda.is_available()
    # built in the dtype it trains in (bf16 on GPUs), so every stage's activations have the dtypes
    # the capture recorded, which pipeline plans rely on
    model = build_model(source, device="meta", dtype=torch.bfloat16 if on_gpu else torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, source.vocab, (global_batch, seq), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    pm = mplan.autoparallel(model, cluster=cluster, example_inputs=(ids,), global_batch=global_batch,
                            plan=plan_spec, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            cuda_graphs=cuda_graphs)
    if built is not None:
        built()
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
    result = {"step_time_s": step_s, "tokens_per_s": global_batch * seq / step_s,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
              "steps": steps, "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    if profile and on_gpu:
        result["step_kernel_split"] = step_kernel_split(lambda: pm.train_step(ids, labels))
    return result
