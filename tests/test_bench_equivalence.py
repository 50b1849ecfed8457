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


def test_fusion_case_tells_per_family_what_fused_and_that_it_trains_as_unfused(tmp_path: Path) -> None:
    """`python -m benchmarks.equivalence fusion`: one row per Hugging Face family; a family that
    cannot be built is a row with its error, not a crash."""
    out = tmp_path / "fusion.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.equivalence", "fusion", "--families",
                          "gpt2,ernie4_5,no_such_family", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-5000:]
    report = json.loads(out.read_text())
    rows = report["families"]
    assert rows["gpt2"]["fused"]["gelu_tanh"] == 2 and rows["ernie4_5"]["fused"]["rope_qk"] == 2
    assert rows["gpt2"]["agrees"] and rows["ernie4_5"]["agrees"]
    assert rows["no_such_family"]["error"].startswith("KeyError") and not report["all_agree"]
    assert "| gpt2 | attention x2, gelu_tanh x2," in run.stdout
