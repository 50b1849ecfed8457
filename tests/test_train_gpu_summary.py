"""`python -m benchmarks.calibration train-summary`: the GPU training run's files joined into one results file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.calibration.train_summary import summarize


def test_a_run_is_judged_on_its_median_step_with_the_checkpoint_stall_listed_apart(tmp_path: Path) -> None:
    (tmp_path / "gpu.txt").write_text("NVIDIA H200\n2.11.0+cu130 3.6.0 5.17.0\n")
    (tmp_path / "data.json").write_text(json.dumps({"num_tokens": 100}))
    times = [27.0, 0.40, 0.42, 0.41, 0.81, 0.41]
    rows = [{"step": i + 1, "loss": 10.0 - i, "step_time_s": t, "mfu": 0.5, "peak_memory_gib": 28.0 + (i > 0),
             "predicted_step_time_s": 0.41, "predicted_mfu": 0.6, "predicted_memory_gib": 31.9} for i, t in enumerate(times)]
    (tmp_path / "train_gpu_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = summarize(tmp_path)
    assert got["gpu"] == "NVIDIA H200" and got["torch"] == "2.11.0+cu130" and got["steps_measured"] == 5
    assert got["step_time_median_s"] == 0.41 and got["slow_steps (over 1.15x the median)"] == [(5, 0.81)]
    assert got["step_time_median_without_slow_steps_s"] == pytest.approx(0.41)
    assert got["memory_prediction_error"] == pytest.approx(31.9 / 29.0 - 1)
    assert "checkpoint_time" not in got and got["loss_first"] == 10.0
