"""Rates and shares as the CLI, `explain` and the training log print them.

A CPU rank's 0.3 GFLOP/s printed in TFLOP/s reads "0.0 TFLOP/s", and its MFU of 0.0024% reads
"0.0%": both say nothing. A rate gets the largest unit in which it is at least 1; a small share
two significant digits.
"""
from __future__ import annotations


def flops_rate(per_s: float) -> str:
    """`per_s` FLOP/s as e.g. '585.3 TFLOP/s' or '23.6 GFLOP/s' (one decimal)."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1e3, "kFLOP/s")):
        if per_s >= scale:
            return f"{per_s / scale:.1f} {unit}"
    return f"{per_s:.0f} FLOP/s"


def percent(fraction: float) -> str:
    """`fraction` as a percentage that a small share does not round to '0.0%' ('0.0024%')."""
    return f"{fraction:.1%}" if fraction == 0 or fraction >= 0.001 else f"{fraction * 100:.2g}%"
