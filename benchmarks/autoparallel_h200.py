"""Does `mplan.autoparallel` add overhead? Plain eager vs the trivial plan on one H200 (issue 5).

The 24-layer, hidden-2048, seq-2048, batch-8 GPT of mplan/cost_models/reference/h200-measured-2026-11-29.json,
fp32 parameters with bf16 autocast and fused AdamW, clipping at 1.0, trained three ways in one
process: (a) a plain PyTorch loop, (b) `mplan.autoparallel(..., plan="dp=1,tp=1,pp=1",
kernels=False)`, the same ATen ops (the requirement: within 3% of (a) in step time and 2% in
peak memory), (c) the same with mplan's fused Triton kernels (`kernels=True`, the CUDA default).
Rounds alternate the variants so clock and thermal drift hit all alike; each variant starts
from a collected heap and an emptied cache and checks that it leaves nothing allocated.

Per run: median step time (CUDA events, after warm-up), `peak_gib` (max allocated from model
construction on: setup, warm-up and timed steps), `steady_peak_gib` (max allocated over the
timed steps only, counters reset after warm-up), `held_gib` (allocated right after setup: the
model, plus for mplan whatever autoparallel kept), `left_gib` (still allocated once the variant
deleted everything and collected; should be 0), `setup_s`.

    PYTHONPATH=. python3 benchmarks/autoparallel_h200.py --out $OUT/autoparallel.json
    python benchmarks/autoparallel_h200.py --device cpu --small --out /tmp/autoparallel.json   # smoke
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
import traceback
from typing import Any, Callable

import torch

import mplan
from mplan.models import GPTConfig, build_model, example_inputs

CONFIG = GPTConfig(name="gpt-24l-h2048", num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab=50304)
BATCH = 8
SMALL = GPTConfig(name="gpt-2l-h256", num_layers=2, hidden=256, num_heads=4, seq_len=128, vocab=1024)
SMALL_BATCH = 2
GiB = 2**30
VARIANTS = ("eager", "mplan", "mplan_kernels")


def model_flops(config: GPTConfig, batch: int) -> float:
    """Megatron's model FLOPs per training step (no recomputation)."""
    s, h, layers, v = config.seq_len, config.hidden, config.num_layers, config.vocab
    return 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * h * layers))


class Device:
    """Synchronization, timing and allocator statistics of the device under test."""

    def __init__(self, kind: str) -> None:
        self.type = kind
        self.cuda = kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def clear(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def allocated_gib(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / GiB
        every = (o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in every
                    if t.device.type == "cpu"}
        return sum(storages.values()) / GiB

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GiB if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def step_seconds(self, step: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            step()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def optimizer_factory(device: Device) -> functools.partial:
    # fused AdamW on the GPU, as the reference run; foreach on the CPU smoke run
    fused = {"fused": True} if device.cuda else {"foreach": True}
    return functools.partial(torch.optim.AdamW, lr=1e-4, **fused)


def build(variant: str, config: GPTConfig, batch: int, device: Device) -> tuple[Callable[[], Any], list[Any]]:
    """The variant's step function and the objects to delete afterwards."""
    model = build_model(config, device=device.type, dtype=torch.float32, seed=0)
    ids, labels = example_inputs(model, batch, config.seq_len, device=device.type)
    if variant == "eager":
        optimizer = optimizer_factory(device)(model.parameters())

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(ids, labels=labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, [model, optimizer]
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=batch, plan="dp=1,tp=1,pp=1",
                            optimizer=optimizer_factory(device), max_grad_norm=1.0, autocast=True,
                            device=device.type, kernels=variant == "mplan_kernels")
    return (lambda: pm.train_step(ids, labels)), [pm, model]


def run(variant: str, config: GPTConfig, batch: int, device: Device, warmup: int, steps: int) -> dict[str, Any]:
    device.clear()
    before = device.allocated_gib()
    start = time.perf_counter()
    step, owned = build(variant, config, batch, device)
    device.sync()
    result: dict[str, Any] = {"setup_s": time.perf_counter() - start, "held_gib": device.allocated_gib() - before}
    if variant != "eager":
        fused = owned[0].program.meta.get("fuse_kernels")
        result["fused"] = dict(fused.counts) if fused is not None else {}
    for _ in range(warmup):
        step()
    device.sync()
    result["peak_gib"] = device.peak_gib()
    device.reset_peak()
    times = [device.step_seconds(step) for _ in range(steps)]
    result.update(step_s=statistics.median(times), steady_peak_gib=device.peak_gib(),
                  tflops=model_flops(config, batch) / statistics.median(times) / 1e12)
    if result["peak_gib"] is not None:
        result["peak_gib"] = max(result["peak_gib"], result["steady_peak_gib"])
    del step, owned
    device.clear()
    result["left_gib"] = device.allocated_gib() - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    parser.add_argument("--small", action="store_true", help="a 2-layer hidden-256 GPT, batch 2 (smoke runs)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run, first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every variant, alternating")
    args = parser.parse_args()
    device = Device(args.device)
    config, batch = (SMALL, SMALL_BATCH) if args.small else (CONFIG, BATCH)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            try:
                runs[variant].append(run(variant, config, batch, device, args.warmup, args.steps))
            except Exception as error:  # one broken variant must not lose the others' figures
                traceback.print_exc()
                runs[variant].append({"error": f"{type(error).__name__}: {error}"})
                device.clear()
            print(variant, json.dumps(runs[variant][-1]), flush=True)
    best = {v: min((r for r in rs if "step_s" in r), key=lambda r: r["step_s"], default=None) for v, rs in runs.items()}
    ratios = {}
    for variant in VARIANTS[1:]:
        if best[variant] and best["eager"]:
            ratios[f"{variant}_vs_eager_step"] = best[variant]["step_s"] / best["eager"]["step_s"]
            for key in ("peak_gib", "steady_peak_gib"):
                if best[variant][key] is not None:
                    ratios[f"{variant}_vs_eager_{key[:-4]}"] = best[variant][key] / best["eager"][key]
    doc = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.cuda else "cpu",
           "torch": torch.__version__,
           "model": f"GPT {config.num_layers} layers, hidden {config.hidden}, {config.num_heads} heads, seq "
                    f"{config.seq_len}, vocab {config.vocab}, batch {batch}; fp32 params, bf16 autocast, "
                    f"{'fused' if device.cuda else 'foreach'} AdamW, clipping 1.0",
           "runs": runs, "best": best, **ratios}
    print(json.dumps({"best": best, **ratios}, indent=1))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
