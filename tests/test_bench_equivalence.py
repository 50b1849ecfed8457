"""The equivalence harness's GPU case (`python -m benchmarks.equivalence gpus`, issue 7's bf16 check)
in its float64 smoke mode on 2 gloo ranks under torchrun: every plan matches one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.script_smoke
def test_gpu_equivalence_case_on_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "equivalence.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "-m", "benchmarks.equivalence", "gpus", "--device", "cpu", "--small", "--steps", "4",
                          "--global-batch", "4", "--plans", "tp=2;dp=2,zero=1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["harness"] == "benchmarks.equivalence gpus" and report["world_size"] == 2
    plans = report["plans"]
    assert set(plans) == {"tp=2", "dp=2,zero=1"}
    assert all(row["passed"] and row["max_param_rel_diff"] < 1e-12 for row in plans.values()), plans
