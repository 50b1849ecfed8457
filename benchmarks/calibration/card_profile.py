"""Profile one CUDA GPU's kernels and write the card's packaged profile, with a summary for review.

Times a bf16 GEMM grid covering transformer training shapes (hidden 1024-8192 split by TP 1-8, MLP
up to 32768 features, 512-16384 tokens per microbatch), SDPA attention (forward, forward+backward;
batch*heads 8-128, sequences 1k-16k, head_dim 64 and 128), device copies (64 KiB to 4 GiB) and host
time per launch (``measure_device.measure_host``: ATen op, view, backward node, Triton launch, AdamW
tensor; streams of tiny ops with the GPU idle), using
``mplan.cost_models.measure_device.profile_device``; about a minute on an H200 (budget: 3 minutes).

Writes
  * ``--profile`` (default ``mplan/cost_models/profiles/<--card>.json``, the H200's by default): a
    ClusterProfile (``"format": "mplan.profile"``) with the device tables, which
    ``ClusterSpec.preset("h200" | "dgx-h200")`` attaches automatically for the H200;
  * ``--out``: the same profile plus a summary (achieved TFLOP/s of a few reference GEMMs, interpolated
    from the new table, next to the H200's figures of
    mplan/cost_models/reference/h200-measured-2026-11-29.json whatever the card, and the wall time).

This case was benchmarks/profile_h200.py until 2026-12-07 (profile_h200-*.json and the packaged
h200.json were made by it: `python benchmarks/profile_h200.py`, results under
benchmarks/results/profile_h200-DATE.json). `mplan profile` measures the same tables for any card.

Run on the GPU (from the repository root):
    PYTHONPATH=. python -m benchmarks.calibration profile --out benchmarks/results/profile_h200-DATE.json
    PYTHONPATH=. python -m benchmarks.calibration profile --profile $OUT/h200.json --out $OUT/profile_h200.json
Smoke test on a CPU (tiny grid, seconds):
    PYTHONPATH=. python -m benchmarks.calibration profile --device cpu --quick --profile /tmp/h200.json \\
        --out /tmp/r.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mplan.cost_models.compute_cost import H200_GEMM_POINTS, ComputeCostModel
from mplan.cost_models.measure_device import profile_device
from mplan.cost_models.presets import make_preset
from mplan.cost_models.profile import ClusterProfile

PROFILES = Path(__file__).resolve().parents[2] / "mplan" / "cost_models" / "profiles"
"""Where the packaged profiles live (`<card>.json`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="torch device to profile (cuda, cuda:1, cpu)")
    parser.add_argument("--quick", "--small", dest="quick", action="store_true",
                        help="tiny grid: a smoke test, not a profile")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated GEMM dtypes (bf16,fp16,tf32,fp32)")
    parser.add_argument("--card", default="h200", help="the card's name: the packaged profile it writes by default")
    parser.add_argument("--profile", default=None,
                        help="where to write the profile (default mplan/cost_models/profiles/CARD.json)")


def summary(profile: ClusterProfile, wall_s: float) -> dict[str, object]:
    """Reference GEMMs as measured now, interpolated from the table, and as measured on 2026-11-29."""
    device = profile.device
    assert device is not None
    model = ComputeCostModel(make_preset("h200", measured=False).with_profile(profile))
    rows = []
    for m, n, k, reference in H200_GEMM_POINTS:
        seconds = model.matmul_time(m, n, k, "bf16")
        rows.append({"m": m, "n": n, "k": k, "table_tflops": round(2 * m * n * k / seconds / 1e12, 1),
                     "reference_2026_11_29_tflops": reference / 1e12})
    best = max(device.gemm, key=lambda t: t.flops_per_s)
    copy = max(device.copy, key=lambda t: t.bytes_moved / t.seconds) if device.copy else None
    return {"device": device.name, "torch": device.torch_version, "wall_s": round(wall_s, 1),
            "num_gemms": len(device.gemm), "num_attention": len(device.attention), "num_copies": len(device.copy),
            "best_gemm": {"m": best.m, "n": best.n, "k": best.k, "dtype": best.dtype,
                          "tflops": round(best.flops_per_s / 1e12, 1)},
            "best_copy_TBps": None if copy is None else round(copy.bytes_moved / copy.seconds / 1e12, 3),
            "host_us": None if device.host is None else {
                k: round(getattr(device.host, k) * 1e6, 2) for k in ("aten_op_s", "view_op_s", "launch_s",
                                                                     "backward_node_s", "triton_launch_s",
                                                                     "adamw_foreach_tensor_s", "adamw_fused_tensor_s")},
            "reference_gemms": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    device = profile_device(args.device, dtypes=tuple(args.dtypes.split(",")), quick=args.quick,
                            progress=lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr))
    wall = time.perf_counter() - start
    note = (f"Measured by `python -m benchmarks.calibration profile` on {device.name} on {device.measured_on}, torch "
            f"{device.torch_version}; medians after warm-up (CUDA events on GPU). "
            + ("QUICK SMOKE-TEST GRID, not a real profile." if args.quick else ""))
    profile = ClusterProfile(note=note.strip(), device=device)
    path = Path(args.profile) if args.profile else PROFILES / f"{args.card}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(str(path))
    print(json.dumps(summary(profile, wall), indent=1))
    print(f"wrote {path} in {wall:.1f} s", file=sys.stderr)
    return {"summary": summary(profile, wall), "profile": profile.to_dict()}
