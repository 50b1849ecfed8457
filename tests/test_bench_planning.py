"""The planning harness (`python -m benchmarks.planning CASE`): one command line for every case, a
report that names the harness, case and command that wrote it, and a case's figures unchanged by
the harness around it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.planning", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_case_writes_its_report_with_the_command_and_checkout_that_made_it(tmp_path: Path) -> None:
    out = tmp_path / "dynamic_cp.json"
    done = _harness("dynamic-cp", "--sequences", "2", "--cp", "8,16", "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["harness"] == "benchmarks.planning dynamic-cp"
    assert report["command"] == ["dynamic-cp", "--sequences", "2", "--cp", "8,16", "-o", str(out)]
    assert report["mplan_commit"] and report["torch"]
    rows = report["rows"]
    assert [(r["mix"], r["cp"]) for r in rows] == [(m, cp) for m in ("wikipedia", "web", "long-mix") for cp in (8, 16)]
    # dynamic CP runs each document on the smallest group that holds it: never slower than fixed CP
    assert all(r["dynamic_s"] <= r["fixed_s"] * (1 + 1e-9) for r in rows), rows


def test_an_unknown_case_or_a_missing_out_is_refused_naming_the_cause() -> None:
    unknown = _harness("no-such-case", "-o", "/tmp/x.json")
    assert unknown.returncode == 2 and "invalid choice: 'no-such-case'" in unknown.stderr
    missing = _harness("context")
    assert missing.returncode == 2 and "--out" in missing.stderr


def test_a_missing_input_file_is_one_line_naming_it_and_nothing_is_written(tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    done = _harness("dynamic-cp", "--profile", str(tmp_path / "no-such-profile.json"), "-o", str(out))
    assert done.returncode == 2 and not out.exists()
    (line,) = [line for line in done.stderr.splitlines() if line and not line.startswith("USDT")]
    assert line.startswith("python -m benchmarks.planning dynamic-cp: ") and "no-such-profile.json" in line, line
