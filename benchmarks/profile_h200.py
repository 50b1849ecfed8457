"""Profile one CUDA GPU's kernels and write the packaged H200 profile.

Times a bf16 GEMM grid covering transformer training shapes (hidden 1024-8192 split by TP 1-8, MLP
up to 32768 features, 512-16384 tokens per microbatch), SDPA attention (forward, forward+backward;
batch*heads 8-128, sequences 1k-16k, head_dim 64 and 128), device copies (64 KiB to 4 GiB) and host
time per launch (``measure_device.measure_host``: ATen op, view, backward node, Triton launch, AdamW
tensor; streams of tiny ops with the GPU idle), using
``mplan.cost_models.measure_device.profile_device``; about a minute on an H200 (budget: 3 minutes).

Writes
  * ``mplan/cost_models/profiles/h200.json``: a ClusterProfile (``"format": "mplan.profile"``) with the
    device tables, which ``ClusterSpec.preset("h200" | "dgx-h200")`` attaches automatically;
  * ``benchmarks/results/profile_h200-<date>.json``: the same profile plus a summary (achieved TFLOP/s
    of a few reference GEMMs next to the figures of mplan/cost_models/reference/h200-measured-2026-11-29.json,
    and the wall time), for review.

Run on the GPU (from the repository root):
    python benchmarks/profile_h200.py
    python benchmarks/profile_h200.py -o $OUT/h200.json --results $OUT/profile_h200.json   # device tool
Smoke test on a CPU (tiny grid, seconds):
    python benchmarks/profile_h200.py --device cpu --quick -o /tmp/h200.json --results /tmp/r.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import write_report  # noqa: E402
from mplan.cost_models.compute_cost import H200_GEMM_POINTS, ComputeCostModel  # noqa: E402
from mplan.cost_models.measure_device import profile_device  # noqa: E402
from mplan.cost_models.presets import make_preset  # noqa: E402
from mplan.cost_models.profile import ClusterProfile  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device to profile (cuda, cuda:1, cpu)")
    parser.add_argument("--quick", action="store_true", help="tiny grid: a smoke test, not a profile")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated GEMM dtypes (bf16,fp16,tf32,fp32)")
    parser.add_argument("-o", "--output", default=os.path.join(ROOT, "mplan", "cost_models", "profiles", "h200.json"),
                        help="where to write the profile")
    parser.add_argument("--results", default=None,
                        help="where to write the results copy (default benchmarks/results/profile_h200-DATE.json)")
    return parser.parse_args()


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


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    device = profile_device(args.device, dtypes=tuple(args.dtypes.split(",")), quick=args.quick,
                            progress=lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr))
    wall = time.perf_counter() - start
    note = (f"Measured by benchmarks/profile_h200.py on {device.name} on {device.measured_on}, torch "
            f"{device.torch_version}; medians after warm-up (CUDA events on GPU). "
            + ("QUICK SMOKE-TEST GRID, not a real profile." if args.quick else ""))
    profile = ClusterProfile(note=note.strip(), device=device)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    profile.to_json(args.output)
    results = args.results or os.path.join(ROOT, "benchmarks", "results",
                                           f"profile_h200-{datetime.date.today().isoformat()}.json")
    write_report(results, {"summary": summary(profile, wall), "profile": profile.to_dict()})
    print(json.dumps(summary(profile, wall), indent=1))
    print(f"wrote {args.output} and {results} in {wall:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
