"""The device profile's copy table, timed three ways: what rate memory-bound kernels are priced at.

The planner prices a memory-bound kernel as its bytes over the profile's copy rate at that size
(`ComputeCostModel.memory_bound_time`). The h200 profile of 2026-11-29 timed each copy with CUDA
events around ONE copy, so a launch's fixed cost (about 7 us) sits in every entry: 3.4 TB/s at
134 MB, where back-to-back kernels in a training step reach the copy rate of the kernel benchmarks
(4.24 TB/s). tests/test_held_out.py found the fused kernels priced 0-25% high from it. Per size
(the profile's, 64 KiB to 4 GiB per side):
    one_copy     median of CUDA events around one copy (measure_device.MedianTimer, the profile's
                 method until now)
    batched      CUDA events around `--batch` back-to-back copies, divided by the count (median of
                 --rounds): a kernel among others, as in a step (measure_device's method now)
    kernel       the profiler's device time of the copy kernel itself (gpu_time.kernel_ms)
and, under "profile_copy", the batched table in the profile's format. `--apply RESULT --profile
PROFILE` writes a result's batched table into a profile file as its copy table and says so in its
note (the kernel tables stay); its report says what it wrote where.

The packaged h200 profile keeps its one-copy table. Applied to a copy of it (2026-12-03), the
batched table of benchmarks/results/copy_table_h200-2026-12-02-session6.json brings the fused
kernels' prices (tests/test_held_out.py, 30 timings) from +0..+25% (RMS 9.4%) to -2.7..+10.6% (RMS
3.8%), but the unfused eager steps of benchmarks/results/h200_step-2026-11-29.json (`python -m
benchmarks.calibration steps-check`) from -2.5..-7.4% to -3.4..-10.3%: an eager step's hundreds of
small ATen ops pay a launch each, which the one-copy timings happen to include. Switching needs a
per-launch cost in the compute model first, so that neither regime is priced by the other's error.

Run on the GPU:   PYTHONPATH=. python -m benchmarks.calibration copy-table --out $OUT/copy_table.json
CPU smoke test:   PYTHONPATH=. python -m benchmarks.calibration copy-table --device cpu --out /tmp/copy.json
Into the profile: PYTHONPATH=. python -m benchmarks.calibration copy-table --apply RESULT.json \
                      --profile mplan/cost_models/profiles/h200.json --out /tmp/applied.json
(copy_table_h200-2026-12-02-session6.json was made by the old `benchmarks/copy_table.py` with the
same flags.)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import replace
from typing import Any

import torch

from benchmarks import harness
from benchmarks.calibration.gpu import device_of
from benchmarks.report import run_header
from mplan.cost_models.measure_device import MedianTimer, ProfileGrid, batched_seconds
from mplan.cost_models.profile import ClusterProfile, CopyTiming

SMALL_SIZES = (1 << 12, 1 << 16, 1 << 20)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser, small=False)
    parser.add_argument("--apply", metavar="RESULT", help="write RESULT's batched copy table into --profile")
    parser.add_argument("--profile", help="the profile file --apply rewrites")
    parser.add_argument("--batch", type=int, default=50, help="copies between the events of one batched sample")
    parser.add_argument("--rounds", type=int, default=5, help="batched samples per size (the median is kept)")


def measure(nbytes: int, device: torch.device, batch: int, rounds: int) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    for _ in range(3):
        copy()
    row: dict[str, Any] = {"bytes_moved": 2 * nbytes,
                           "one_copy_s": MedianTimer(torch, device, target_s=0.0)(copy, min_reps=20, max_reps=20),
                           "batched_s": statistics.median(batched_seconds(torch, device, copy, batch)
                                                          for _ in range(rounds))}
    if device.type == "cuda":
        from benchmarks.gpu_time import kernel_ms
        row["kernel_s"] = kernel_ms(copy, iters=batch) / 1e3
    for key in ("one_copy_s", "batched_s", "kernel_s"):
        if key in row:
            row[key.replace("_s", "_TBps")] = row["bytes_moved"] / row[key] / 1e12
    print(f"{nbytes / 2**20:10.3f} MiB: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("TBps")),
          flush=True)
    return row


def apply(result_path: str, profile_path: str) -> dict[str, Any]:
    """Replace the profile's copy table with the result's batched one; the note names the result."""
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    profile = ClusterProfile.from_json(profile_path)
    if profile.device is None:
        raise SystemExit(f"{profile_path} has no device profile to carry a copy table")
    rows = tuple(CopyTiming(bytes_moved=int(r["bytes_moved"]), seconds=float(r["seconds"]))
                 for r in result["profile_copy"])
    if not rows or any(r.bytes_moved <= 0 or not r.seconds > 0 for r in rows):
        raise SystemExit(f"{result_path}: profile_copy must be a non-empty list of positive sizes and times")
    stem = profile.note.split(" Copy table:")[0]
    note = (f"{stem} Copy table: {result['script']} on {result['gpu']} on {result['date']}, torch {result['torch']}, "
            f"back-to-back copies (its 'batched' column, {result_path.rsplit('/', 1)[-1]}).")
    ClusterProfile(version=profile.version, note=note, device=replace(profile.device, copy=rows),
                   links=profile.links).to_json(profile_path)
    print(f"wrote {len(rows)} copy rows into {profile_path}")
    return {"applied": result_path, "profile": profile_path, "copy_rows": len(rows), "note": note}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.apply or args.profile:
        if not (args.apply and args.profile):
            raise SystemExit("copy-table: --apply and --profile go together")
        return apply(args.apply, args.profile)
    device = device_of(args, "copy-table")
    sizes = ProfileGrid.transformer(quick=False, on_gpu=True).copy_bytes if device.type == "cuda" else SMALL_SIZES
    rows = [measure(n, device, args.batch, args.rounds) for n in sizes]
    return {
        **run_header(device), "script": "benchmarks.calibration copy-table",
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "method": f"per size: one_copy = median of 20 CUDA-event samples around one copy; batched = median of "
                  f"{args.rounds} samples of events around {args.batch} back-to-back copies / {args.batch}; "
                  f"kernel = profiler device time of the copy kernel, mean of {args.batch}",
        "copies": rows,
        "profile_copy": [{"bytes_moved": r["bytes_moved"], "seconds": r["batched_s"]} for r in rows],
    }
