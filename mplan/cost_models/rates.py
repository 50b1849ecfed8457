"""A FLOP rate in the unit that shows it: what the CLI, `explain` and the training log print.

A CPU rank's 0.3 GFLOP/s printed in TFLOP/s reads "0.0 TFLOP/s", which says nothing; each figure
gets the largest unit in which it is at least 1.
"""
from __future__ import annotations


def flops_rate(per_s: float) -> str:
    """`per_s` FLOP/s as e.g. '585.3 TFLOP/s' or '23.6 GFLOP/s' (one decimal)."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1e3, "kFLOP/s")):
        if per_s >= scale:
            return f"{per_s / scale:.1f} {unit}"
    return f"{per_s:.0f} FLOP/s"
