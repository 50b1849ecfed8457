"""One context-parallel rank's local attention at long context, timed against the planner's price
(issue 34's must-show: "measured on the GPU: the local attention of one CP rank at 32k-128k
tokens against the prediction").

What is timed is what the runtime runs on a rank of the all_gather method once K and V are
gathered: the rank's head-tail queries (chunks r and 2cp-1-r, S / cp tokens) against the whole
sequence's keys and values, causal, through `fused_attention` (the pieces `pieces()` makes: per
query chunk the fully visible earlier keys in one call, the diagonal in a causal one, merged by
log-sum-exp), forward (`attend`) and backward (`attend_backward`), bf16, GQA as the config says.
Ranks 0 and cp-1 (the extremes of the layout) are both timed: head-tail balance says they do the
same work, and the counted pairs say how far from equal it is.

Predicted: what `planner/context_pricing.rank_units` charges a rank for its attention, the whole
sequence's causal attention (`ComputeCostModel.attention_time`, from the card's profile) over cp.

On CUDA each backend of the fused path (cuDNN's attention, torch's flash kernel: `--backends`) is
checked, pinned and timed in turn in the same run, each row naming its backend; a backend that fails
its check gets rows that say why and time nothing (the reference path would hold [S/cp, S] scores).
The first run (2026-12-06) timed flash alone, then the only backend: 46-63% slower than the price,
which is the profile's SDPA rate, cuDNN's on an H100.

Run (GPU; from the repository root):
    PYTHONPATH=. python -m benchmarks.calibration cp-attention --out $OUT/cp_attention.json
Smoke test on the CPU (small sequences, the CPU's flash kernels, the committed H100 profile's
prices; no claim rests on its times):
    PYTHONPATH=. python -m benchmarks.calibration cp-attention --device cpu --small --out /tmp/cp_attention.json
(cp_attention_h100-2026-12-06*.json were made by the old `benchmarks/cp_attention.py` with the same flags.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.calibration.gpu import device_of, event_seconds
from benchmarks.report import run_header
from mplan.collectives import fused_attention
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.ir.context_layout import head_tail, imbalance, num_visible_pairs

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROFILE = RESULTS / "profile_h100-2026-12-05.json"
"""The card's measured profile the prediction prices from (the H100's: the card the device lends most)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 32768,65536,131072)")
    parser.add_argument("--cps", default="2,4,8", help="comma-separated cp sizes")
    parser.add_argument("--backends", default="cudnn,flash", help="CUDA backends to time, in turn (CUDA only)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3 8B's 32)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--profile", default=str(PROFILE), help="the cluster profile JSON the prediction prices from")


def rank_row(seq: int, cp: int, rank: int, args: argparse.Namespace, device: torch.device,
             compute: ComputeCostModel, backend: str) -> dict[str, Any]:
    """One rank's row, timed on `backend` ("cpu" on the CPU; on CUDA the one `run` pinned)."""
    layout = head_tail(seq, cp)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = fused_attention.kernel_dtype(device, dtype, dtype, args.head_dim)
    pairs = num_visible_pairs(layout)
    row: dict[str, Any] = {"backend": backend, "seq": seq, "cp": cp, "rank": rank,
                           "spans": [list(s) for s in layout.spans[rank]],
                           "visible_pairs": pairs[rank], "pairs_imbalance": imbalance(pairs)}
    forward_s = compute.attention_time(args.batch, args.heads, seq, seq, args.head_dim, "bfloat16", True, False) / cp
    backward_s = compute.attention_time(args.batch, args.heads, seq, seq, args.head_dim, "bfloat16", True, True) / cp
    row["predicted_ms"] = {"forward": forward_s * 1e3, "backward": backward_s * 1e3}
    if kernel is None:
        row["skipped"] = f"no fused kernel for {dtype} on {device.type} (see the warning): the reference path"
        return row
    keys = sorted(span for own in layout.spans for span in own)  # all of them, gathered, in sequence order
    calls = fused_attention.pieces(layout.spans[rank], tuple(keys), True)
    assert calls is not None, "head-tail spans always split into full and diagonal pieces"
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, seq // cp, args.head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    k, v = (torch.randn(args.batch, args.kv_heads, seq, args.head_dim, device=device, dtype=dtype,
                        generator=generator) for _ in range(2))
    grad = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    scale = args.head_dim ** -0.5
    out, lse = fused_attention.attend(q, k, v, calls, scale, kernel)
    forward = statistics.median(event_seconds(lambda: fused_attention.attend(q, k, v, calls, scale, kernel), device,
                                               args.warmup, args.iters))
    backward = statistics.median(event_seconds(
        lambda: fused_attention.attend_backward(q, k, v, calls, scale, grad, out, lse, kernel), device, args.warmup,
        args.iters))
    row["kernel_calls"] = len(calls)
    row["measured_ms"] = {"forward": forward * 1e3, "backward": backward * 1e3}
    row["prediction_error"] = {"forward": forward_s / forward - 1, "backward": backward_s / backward - 1}
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = device_of(args, "cp-attention")
    if args.seqs is None:
        args.seqs = "256,512" if args.small else "32768,65536,131072"
    if args.small:
        args.heads, args.kv_heads, args.head_dim, args.iters, args.warmup = 4, 2, 16, 2, 1
    compute = ComputeCostModel(ClusterSpec.from_json(args.profile))
    rows = []
    for backend in args.backends.split(",") if device.type == "cuda" else ("cpu",):
        why = None
        if device.type == "cuda":
            why = fused_attention.use_cuda_backend(device, torch.bfloat16, args.head_dim, backend)
        for seq in map(int, args.seqs.split(",")):
            for cp in map(int, args.cps.split(",")):
                for rank in (0, cp - 1):
                    row = rank_row(seq, cp, rank, args, device, compute, backend)
                    if why is not None:
                        row["skipped"] = f"{backend} failed its check: {why}"
                    rows.append(row)
    report = {**run_header(device), "what": "one cp rank's local attention (all_gather method), causal, head-tail",
              "dtype": "bfloat16" if device.type == "cuda" else "float32 (CPU smoke test)",
              "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
              "priced_from": os.path.basename(args.profile), "rows": rows}
    for row in rows:
        measured = row.get("measured_ms")
        print(f"{row['backend']} S={row['seq']} cp={row['cp']} rank {row['rank']}: "
              f"pairs imbalance {row['pairs_imbalance']:.4f}; "
              + (f"forward {measured['forward']:.2f} ms (predicted {row['predicted_ms']['forward']:.2f}), backward "
                 f"{measured['backward']:.2f} ms (predicted {row['predicted_ms']['backward']:.2f})"
                 if measured else row["skipped"]), file=sys.stderr)
    return report
