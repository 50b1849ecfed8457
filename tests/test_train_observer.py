"""What `mplan train` says about its steps against the plan's predictions (`train.observe`)."""
from __future__ import annotations

import types

import pytest

from mplan.runtime.metrics import StepMetrics
from mplan.train.config import TrainConfig
from mplan.train.observe import Observer

PREDICTED_S = 0.410


def _run(capsys: pytest.CaptureFixture[str], step_times: list[float]) -> str:
    """Rank 0's observer fed one metrics row per step time; what it printed to stderr."""
    plan = types.SimpleNamespace(spec=lambda: "dp=1")
    observer = Observer(TrainConfig(), rank=0, first_step=0, total_steps=len(step_times), stop=len(step_times),
                        plan=plan)
    for step, seconds in enumerate(step_times, start=1):
        metrics = StepMetrics(step=step, loss=1.0, step_time_s=seconds, tokens=8, tokens_per_s=8 / seconds,
                              model_tflops_per_s=None, mfu=None, peak_memory_gib=None, lr=None,
                              predicted_step_time_s=PREDICTED_S)
        observer.record(types.SimpleNamespace(last_metrics=metrics, step=step), loss=1.0, lr=0.0)
    return capsys.readouterr().err


def test_one_slow_step_among_steps_on_the_prediction_is_not_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    """The H200 run of 2026-12-06: steps at 0.41-0.42 s and one 0.81 s step after a background
    checkpoint, which warned that the cluster's figures were wrong while they were within 2%."""
    times = [27.0] + [0.415] * 58 + [0.814] + [0.418] * 60
    assert "warning" not in _run(capsys, times)


def test_steps_steadily_off_the_prediction_warn_once_naming_the_median(capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(capsys, [27.0] + [0.60] * 20)
    assert err.count("warning") == 1
    assert "step time (the median of this job's last 100 steps) 0.6 is +46% off the plan's prediction 0.41" in err
