"""The ranks harness (`python -m benchmarks.ranks CASE`): a case on gloo ranks it starts in process
repeats its committed figures, and the checkpoint case runs on the ranks of a torchrun job (the way
benchmarks/multi_gpu_h200.sh runs it on GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_OUTER_LOOP = ROOT / "benchmarks" / "results" / "outer_loop-cpu-2026-12-06.json"


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


@pytest.mark.distributed
def test_a_short_outer_loop_run_repeats_the_committed_runs_first_steps(tmp_path: Path) -> None:
    """8 steps on 4 ranks started in process: the same losses step for step as the committed 64-step
    run, made by the script the case replaced (float32 sums: to a few ulps)."""
    out = tmp_path / "outer_loop.json"
    done = _python("-m", "benchmarks.ranks", "outer-loop", "--steps", "8", "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["harness"] == "benchmarks.ranks outer-loop" and report["mplan_commit"]
    committed = json.loads(COMMITTED_OUTER_LOOP.read_text())["runs"]
    for mode in ("sync", "outer_h8"):
        got, want = report["runs"][mode]["train_loss"], committed[mode]["train_loss"][:8]
        assert got == pytest.approx(want, rel=1e-6), (mode, got, want)
    assert report["runs"]["outer_h8"]["cross_site_all_reduces"] == 1


@pytest.mark.script_smoke
def test_the_checkpoint_case_under_torchrun_reports_from_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    done = _python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "benchmarks.ranks",
                   "checkpoint", "--model", "tiny-llama", "--plan", "tp=2", "--other", "pp=2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["harness"] == "benchmarks.ranks checkpoint" and report["machine"]
    (row,) = report["rows"]
    assert row["world_size"] == 2 and row["plan"].startswith("dp=1,tp=2,") and ",pp=2," in row["other_plan"]
    assert row["checkpoint_bytes"] > 0 and all(row[k] > 0 for k in ("save_blocking_s", "load_other_plan_s"))
