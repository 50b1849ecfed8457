"""benchmarks/models/trace.py: a clock trace lined up with each system's steps."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.models import trace

HEADER = "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active\n"


def _trace(path: Path, samples: list[tuple[str, int, float, str]]) -> str:
    path.write_text(HEADER + "".join(f"2026/12/06 17:00:{t}, {c}, {w}, 60, {r}\n" for t, c, w, r in samples)
                    + "2026/12/06 17:00:09.000, 1980\n")  # the line the stopped sampler cut
    return str(path)


def test_steps_that_slow_with_the_clock_under_a_power_cap_say_so(tmp_path: Path) -> None:
    """Each step gets the samples taken while it ran; the steps slow where the clock is low, the
    cap is on at every sample, and a system whose steps have no sample says how many it had."""
    samples = trace.read_trace(_trace(tmp_path / "t.csv", [
        ("00.050", 1965, 650.0, "0x0000000000000004"), ("01.050", 1600, 699.0, "0x0000000000000004"),
        ("02.050", 1800, 690.0, "0x0000000000000004"), ("03.050", 1500, 700.0, "0x0000000000000044")]))
    assert len(samples) == 4
    start = samples[0][0] - 0.05  # 17:00:00.000 as the steps' clock counts it
    steps = {"mplan": {"step_began_unix": [start + k for k in range(4)], "step_s_all": [0.10, 0.12, 0.11, 0.13]},
             "idle": {"step_began_unix": [start + 5.0], "step_s_all": [0.1]}}
    got = trace.by_system(steps, samples)
    mplan = got["mplan"]
    assert mplan["steps_with_samples"] == 4 and mplan["sm_clock_mhz_range"] == [1500, 1965]
    assert mplan["power_capped_share"] == 1.0 and mplan["other_reason_share"] == pytest.approx(0.25)
    assert mplan["step_vs_clock_correlation"] < -0.9
    assert got["idle"] == {"steps_with_samples": 0}


def test_a_races_steady_blocks_get_their_own_trace(tmp_path: Path) -> None:
    """annotate: the rounds' steps and each system's steady block (`peers --steady-steps`) lined up
    with the trace apart, the block's samples not mixed into the rounds'."""
    path = _trace(tmp_path / "t.csv", [(f"0{k}.050", 1900 - 50 * k, 650.0 + k, "0x0000000000000004")
                                       for k in range(8)])
    start = trace.read_trace(path)[0][0] - 0.05
    row = {"step_began_unix": [start + k for k in range(3)], "step_s_all": [0.1, 0.1, 0.1],
           "steady_began_unix": [start + 4 + k for k in range(4)], "steady_step_s_all": [0.1, 0.11, 0.12, 0.13]}
    report = trace.annotate({"families": {"olmo2": {"systems": {"mplan": row}}}}, path)
    entry = report["families"]["olmo2"]
    assert entry["gpu_trace"]["mplan"]["sm_clock_mhz_range"] == [1800, 1900]
    assert entry["gpu_trace_steady"]["mplan"]["steps_with_samples"] == 4
    assert entry["gpu_trace_steady"]["mplan"]["sm_clock_mhz_range"] == [1550, 1700]
