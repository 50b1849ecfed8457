"""GEMMs back to back against GEMMs between memory-bound kernels: does the power cap price a step's GEMMs high?

The device profile (`mplan profile`, `cost_models.measure_device`) times each GEMM shape as many
calls back to back. On a card held at its power cap the SM clock then sits where back-to-back GEMMs
put it; in a training step GEMMs alternate with memory-bound kernels (norms, activations, copies)
that draw less power, so the clock may run higher while they do. Gemma-2B's steps on an H100 ran
their GEMM kernels about 8% faster than the profile's table prices them (session 18), which this
would explain.

Method, per GEMM shape (`x @ w.T`, bf16, the shapes of a Gemma-2B layer and head at 2048 tokens):
two patterns, each run for `--warm-s` seconds before its last `--iters` iterations are profiled
(so the card's power state has settled on the pattern): `back_to_back` (GEMM after GEMM) and
`interleaved` (each GEMM followed by a device-to-device copy sized to take about as long as the
GEMM: the step's mix of compute- and memory-bound work). Reported: each pattern's GEMM kernel time
(the profiler's device time of the GEMM kernels alone, medians over `--rounds` rounds taken in turn),
`interleaved_over_back_to_back`, the SM clock and power nvidia-smi reads at the end of each
pattern's warm-up, and the price the cluster file (`--cluster`) gives the shape.

    PYTHONPATH=. python -m benchmarks.kernel_peers gemm-duty --cluster CLUSTER.json --out $OUT/gemm_duty.json
Smoke mode on a CPU (tiny shapes in fp32, the CPU's GEMM time from the profiler, no clock):
    PYTHONPATH=. python -m benchmarks.kernel_peers gemm-duty --device cpu --small --out /tmp/gemm_duty.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.kernel_peers import engine

GEMMA_2B = {"qkv": (2048, 2560, 2048), "o": (2048, 2048, 2048), "gate_up": (2048, 32768, 2048),
            "down": (2048, 2048, 16384), "head": (2048, 256000, 2048), "profile_row": (16384, 32768, 2048)}
"""(m, n, k) of `x[m, k] @ w[n, k].T`: Gemma-2B at 2048 tokens (hidden 2048, GeGLU 16384, q 2048 and
one kv head of 256, vocabulary 256000), and a row of the profile's table."""
SMALL = {"qkv": (64, 80, 64), "gate_up": (64, 256, 64)}
"""The smoke mode's shapes."""


def _clock(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        sm, power, reasons = [f.strip() for f in out.strip().splitlines()[0].split(",")]
        return {"sm_mhz": float(sm), "power_w": float(power), "reasons": reasons}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as err:
        return {"error": str(err)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gemm_ms(step: Any, iters: int, warm_s: float, device: torch.device) -> tuple[float, dict[str, Any]]:
    """Run `step` for `warm_s` seconds, read the clock, then profile `iters` more: the GEMM
    kernels' mean device milliseconds per step (copy kernels excluded; on a CPU, `aten::mm`'s
    own time)."""
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        for _ in range(10):
            step()
        _sync(device)
    clock = _clock(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        _sync(device)
    if cuda:
        gemm = sum(e.device_time for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
                   and "copy" not in e.name.lower() and "memcpy" not in e.name.lower())
    else:
        gemm = sum(e.self_cpu_time_total for e in prof.events() if e.name == "aten::mm")
    return gemm / 1e3 / iters, clock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--shapes", default=None, help="comma-separated, of " + ",".join(GEMMA_2B) + " (default: all)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warm-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cluster", default=None,
                        help="a cluster file (*.json) or a preset whose GEMM price to set beside each shape")
    parser.add_argument("--copy-tbps", type=float, default=3.0, help="copy bandwidth used to size the filler")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = SMALL if args.small else GEMMA_2B
    warm_s = 0.05 if args.small else args.warm_s
    compute = None
    if args.cluster:
        from mplan.cost_models.cluster import ClusterSpec
        from mplan.cost_models.compute_cost import ComputeCostModel

        cluster = (ClusterSpec.from_json(args.cluster) if args.cluster.endswith(".json")
                   else ClusterSpec.preset(args.cluster))
        compute = ComputeCostModel(cluster)
    rows = {}
    for name in args.shapes.split(",") if args.shapes else table:
        m, n, k = table[name]
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        alone, _ = _gemm_ms(lambda: torch.mm(x, w.t()), args.iters, min(warm_s, 0.2), device)
        # bytes copied (read once, written once) in about the GEMM's time; the smoke mode's CPU times say nothing
        filler = 1 << 20 if args.small else max(1 << 20, int(alone * 1e-3 * args.copy_tbps * 1e12 / 2))
        src = torch.empty(filler // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)

        def interleaved() -> None:
            torch.mm(x, w.t())
            dst.copy_(src)

        samples: dict[str, list[float]] = {"back_to_back": [], "interleaved": []}
        clocks: dict[str, list[dict[str, Any]]] = {"back_to_back": [], "interleaved": []}
        for _ in range(args.rounds):
            for pattern, step in (("back_to_back", lambda: torch.mm(x, w.t())), ("interleaved", interleaved)):
                ms, clock = _gemm_ms(step, args.iters, warm_s, device)
                samples[pattern].append(ms)
                clocks[pattern].append(clock)
        b2b, inter = statistics.median(samples["back_to_back"]), statistics.median(samples["interleaved"])
        priced = None if compute is None else round(compute.matmul_time(m, n, k, "bfloat16") * 1e3, 4)
        rows[name] = {"m": m, "n": n, "k": k, "filler_mib": round(filler / 2**20, 1),
                      "back_to_back_ms": round(b2b, 4), "interleaved_ms": round(inter, 4),
                      "interleaved_over_back_to_back": round(inter / b2b, 4),
                      "back_to_back_tflops": round(2 * m * n * k / b2b / 1e9, 1),
                      "interleaved_tflops": round(2 * m * n * k / inter / 1e9, 1),
                      "samples": samples, "clocks": clocks,
                      "priced_ms": priced}
        print(f"{name}: back to back {b2b:.3f} ms, interleaved {inter:.3f} ms ({inter / b2b:.3f}x), "
              f"priced {priced} ms; clocks {[c.get('sm_mhz') for c in clocks['back_to_back']]} / "
              f"{[c.get('sm_mhz') for c in clocks['interleaved']]}", flush=True)
        del x, w, src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**engine.header(device), "cluster": args.cluster, "rows": rows}
