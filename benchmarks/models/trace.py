"""The card's clock and power beside each timed step: is a system's step spread the card's doing?

`sampling(path)` runs nvidia-smi while a benchmark runs, writing the SM clock, the power draw, the
temperature and the active clock-event reasons every GPU_TRACE_MS ms to a CSV. `by_system(steps,
trace)` lines the samples up with the steps (each step's wall-clock start, `step_began_unix`, and
its time) and says, per system: the SM clock and power while its steps ran, the share of samples
the card was held back by its software power cap (clock-event reason 0x4: the driver lowering the
clock to stay under the board's power limit) or by anything else, and the correlation of a step's
time with the clock sampled during it. A spread that follows the clock (a negative correlation,
steps slow where the clock is low) under a power cap that is active throughout is the card's power
management, not the program: the densest program draws the most power and is throttled most.

Why it exists (issue 35): mplan's graphed steps spread 1.3-3.3% against torch.compile's 0.6-1.7%
on the same models, and replays run the same kernels every step, so the question was whether the
card or mplan moves the step. Run by the `peers` case's `--gpu-trace TRACE.csv` (the JSON gains
"gpu_trace" per family); the `gpu-trace` case does the same on an earlier run's files.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from typing import Any

GPU_TRACE_MS = 100
GPU_TRACE_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
SW_POWER_CAP = 0x4
"""nvidia-smi's clock-event reason bit: the software power cap (NVML's clocksEventReasonSwPowerCap)"""
MARGIN_S = 0.05
"""a sample this close to a step's start or end counts for it (samples are GPU_TRACE_MS apart)"""


@contextlib.contextmanager
def sampling(path: str | None) -> Iterator[None]:
    """nvidia-smi sampling the card into `path` (CSV, GPU_TRACE_FIELDS) while the block runs."""
    if path is None:
        yield
        return
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={GPU_TRACE_FIELDS}", "--format=csv,nounits",
                                f"--loop-ms={GPU_TRACE_MS}", "-f", path])
    try:
        yield
    finally:
        sampler.terminate()
        sampler.wait()


def read_trace(path: str) -> list[tuple[float, float, float, int]]:
    """(unix seconds, SM clock MHz, power W, clock-event reasons) per sample; nvidia-smi's timestamps
    are the machine's local time, which is UTC on the device machines (as `time.time()` counts)."""
    samples = []
    with open(path, encoding="utf-8") as handle:
        rows = csv.reader(handle)
        next(rows)  # the header
        for row in rows:
            if len(row) < 5:
                continue  # a line cut when the sampler was stopped
            moment = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            samples.append((moment.replace(tzinfo=datetime.timezone.utc).timestamp(), float(row[1]), float(row[2]),
                            int(row[4].strip(), 16)))
    return samples


def by_system(steps: dict[str, dict[str, Any]], samples: Sequence[tuple[float, float, float, int]]) -> dict[str, Any]:
    """Per system of one family (its row: step_began_unix, step_s_all): the card while its steps ran."""
    out: dict[str, Any] = {}
    for name, row in steps.items():
        began, times = row.get("step_began_unix") or [], row.get("step_s_all") or []
        clocks, powers, reasons, timed = [], [], [], []
        for start, seconds in zip(began, times):
            during = [s for s in samples if start - MARGIN_S <= s[0] <= start + seconds + MARGIN_S]
            if not during:
                continue
            clocks.append(statistics.fmean(s[1] for s in during))
            powers.extend(s[2] for s in during)
            reasons.extend(s[3] for s in during)
            timed.append(seconds)
        if len(timed) < 3:
            out[name] = {"steps_with_samples": len(timed)}
            continue
        out[name] = {
            "steps_with_samples": len(timed), "sm_clock_mhz_mean": statistics.fmean(clocks),
            "sm_clock_mhz_range": [min(clocks), max(clocks)], "power_w_mean": statistics.fmean(powers),
            "power_capped_share": sum(bool(r & SW_POWER_CAP) for r in reasons) / len(reasons),
            "other_reason_share": sum(bool(r & ~SW_POWER_CAP) for r in reasons) / len(reasons),
            "step_vs_clock_correlation": statistics.correlation(clocks, timed)
            if len(set(clocks)) > 1 and len(set(timed)) > 1 else None}
    return out


def annotate(report: dict[str, Any], trace: str) -> dict[str, Any]:
    """`report` (the `peers` case's) with "gpu_trace" added to each family that ran, from the CSV
    `trace`, and "gpu_trace_steady" for the systems' steady blocks (`--steady-steps`)."""
    samples = read_trace(trace)
    for table in (report.get("families", {}), report.get("own", {})):
        for entry in table.values():
            if "systems" in entry:
                entry["gpu_trace"] = by_system(entry["systems"], samples)
                steady = {name: {"step_began_unix": row["steady_began_unix"], "step_s_all": row["steady_step_s_all"]}
                          for name, row in entry["systems"].items() if row.get("steady_step_s_all")}
                if steady:
                    entry["gpu_trace_steady"] = by_system(steady, samples)
    return report

