"""`python -m benchmarks.calibration bench-cli --reprice`: rows measured on a GPU, priced again by this
checkout on a CPU, each as the plan that ran. The README's unseen-set and HF Llama price rows rest on it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.calibration import bench_cli

REPO = Path(__file__).resolve().parent.parent

PROFILE = str(REPO / "benchmarks" / "results" / "profile_h100-2026-12-06-l2.json")  # one H100, what the runs used
RAN = "dp=1,tp=1,pp=1,vpp=1,ep=1,mbs=1,sp=0,zero=0,recompute=full,schedule=1f1b"
"""What an `auto` row resolved to when it ran: not what a search on this tiny model picks."""


def _price(config: Path, spec: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "mplan", "bench", str(config), "--cluster", PROFILE,
                           "--global-batch", "2", "--seq-len", "32", "--plans", spec, "--json"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    (row,) = json.loads(done.stdout)["plans"]
    return row


def test_a_row_is_priced_as_the_plan_that_ran_beside_its_measurement(tmp_path) -> None:
    """An `auto` row is priced as the plan it resolved to then, not searched again (a search today may
    settle otherwise: it did on this model), and its errors are this price against the measurement."""
    config = bench_cli.write_config("smollm2", tmp_path, small=True)
    searched = _price(config, "auto")
    assert searched["resolved_spec"] != RAN
    measured = {"step_time_s": 0.5, "peak_memory_gib": 0.25, "prediction_error": {"peak_memory": 0.1}}
    run = {"global_batch": 2, "seq_len": 32, "gpu": "a test's", "models": {"smollm2": {
        "config": json.loads(config.read_text()),
        "rows": {"plans": [{"spec": "auto", "resolved_spec": RAN, "predicted": {"step_time_s": 0.4},
                            "measured": measured}]}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    (row,) = bench_cli.reprice([path], PROFILE)["models"]["smollm2"]
    now = _price(config, RAN)["predicted"]
    assert row["resolved_spec"] == RAN
    assert row["predicted_now_s"] == now["step_time_s"] != searched["predicted"]["step_time_s"]
    assert row["error_now"] == pytest.approx(now["step_time_s"] / 0.5 - 1)
    assert row["error_then"] == pytest.approx(0.4 / 0.5 - 1)
    assert row["peak_error_now"] == pytest.approx(now["allocated_gib"] / 0.25 - 1)
    assert row["peak_error_then"] == 0.1


def test_runs_of_one_model_at_other_shapes_do_not_join(tmp_path) -> None:
    """Several runs of a model join (a later call measuring what an earlier one's budget cut) only at
    one global batch and sequence length: a row is priced at the shape it was measured at."""
    config = json.loads(bench_cli.write_config("smollm2", tmp_path, small=True).read_text())
    runs = []
    for name, seq in (("a.json", 32), ("b.json", 16)):
        runs.append(tmp_path / name)
        runs[-1].write_text(json.dumps({"global_batch": 2, "seq_len": seq, "models": {"smollm2": {"config": config}}}))
    with pytest.raises(ValueError, match="b.json: global batch 2 and sequence 16, where a.json has 2 and 32"):
        bench_cli.reprice(runs, PROFILE)
