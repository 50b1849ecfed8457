"""Stage cuts under floating-point rounding: a model always fits one chunk whose limit is the sum
of its unit times, whichever way that sum was rounded."""
from __future__ import annotations

import math

from mplan.planner.stage_partition import partition

# the running sum of these times rounds above their correctly rounded sum (math.fsum, and Python
# 3.12's sum()): on the H200's Python 3.12 a one-stage plan of such units was refused as "10 units
# cannot fill 1 pipeline chunks" (2026-12-02)
TIMES = [1.1428193144282783e-05, 0.0049357786646532465, 0.008676027754927809, 0.0024391087688713196,
         0.0032520436274739006, 0.008704712321086546, 0.0019106709150239056, 0.005675107406206719,
         0.002386159286152202, 0.009675402502901434]


def test_the_running_sum_of_these_times_rounds_above_their_exact_sum() -> None:
    running = 0.0
    for t in TIMES:
        running += t
    assert running > math.fsum(TIMES)


def test_one_chunk_holds_every_unit_however_the_sum_rounds(monkeypatch) -> None:
    import builtins

    monkeypatch.setattr(builtins, "sum", lambda values, start=0.0: math.fsum([start, *values]))
    cut = partition(TIMES, 1)
    assert cut is not None and cut.bounds == ((0, len(TIMES)),)
    two = partition(TIMES, 2)
    assert two is not None and two.num_chunks == 2
