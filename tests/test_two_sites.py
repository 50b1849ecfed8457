"""`python -m benchmarks.ranks two-sites` builds two network namespaces joined by a rate-limited veth pair, runs
gloo ranks in them (the link measured against what was set, flat and hierarchical DP trained on a
tiny Llama), and leaves nothing behind: not after a run, not after its ranks fail, not after
Ctrl-C; killed outright, it leaves no rank running and the next run removes its namespaces.
Needs root and a kernel with network namespaces (skipped with the reason otherwise)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ranks import two_sites

ROOT = Path(__file__).resolve().parents[1]

UNAVAILABLE = two_sites.netns_unavailable()
pytestmark = [pytest.mark.script_smoke, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]

TINY = "llama:layers=1,hidden=64,heads=2,kv_heads=1,ffn=128,seq=16,vocab=256"


def _start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.ranks", "two-sites", *args, "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_run_measures_the_set_link_and_removes_its_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "two_sites.json"
    run = _start(out, "--settings", "100:5", "--model", TINY, "--warmup", "1", "--steps", "1", "--rounds", "1",
                 "--intra-mb", "4", "--layouts", "flat", "hierarchical", "--timeout", "100")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-3000:]
    assert two_sites.namespaces_of(run.pid) == []
    report = json.loads(out.read_text())
    assert report["harness"] == "benchmarks.ranks two-sites"
    (row,) = report["settings"]
    probe = row["probe"]
    assert all("tbf" in line and "100Mbit" in line for line in row["qdiscs"]), row["qdiscs"]
    # the rate is the kernel's (tbf): within 10% of the payload rate it allows
    assert probe["cross_site_bandwidth"]["MBps_measured"] == pytest.approx(
        probe["cross_site_bandwidth"]["MBps_set_payload"], rel=0.1)
    # the latency is injected: the one-way time is the set 5 ms plus the veth's own and the waking of the
    # thread that posts (a few ms more only on a machine loaded many times over its cores)
    assert 0.005 <= probe["cross_site_latency"]["one_way_s_with_injection"] < 0.010
    # ranks of one site talk over their namespace's loopback: the veth carries almost nothing meanwhile
    assert probe["intra_site"]["veth_bytes_during"] < 0.01 * probe["intra_site"]["bytes"]
    assert probe["intra_site"]["MBps"] > 3 * probe["cross_site_bandwidth"]["MBps_set"]
    measured, compared = row["measured"], row["comparison"]["layouts"]
    assert measured["flat"]["sites"] == 1 and measured["hierarchical"]["sites"] == 2
    for layout in ("flat", "hierarchical"):
        assert len(measured[layout]["step_s"]) == 1
        assert all(step > injected > 0 for step, injected in zip(measured[layout]["step_s"], measured[layout]["injected_s"]))
        # the bytes a site sent over the veth are the bytes the planner prices on the long haul
        assert compared[layout]["site_sent_payload_bytes_measured"] == pytest.approx(
            compared[layout]["inter_site_bytes_predicted"], rel=0.15), (layout, compared[layout])
    # hierarchical DP sends the shards' sums across, N bytes a direction; the flat ring 1.5 N
    assert measured["hierarchical"]["site_sent_bytes_median"] < 0.8 * measured["flat"]["site_sent_bytes_median"]


def test_failing_ranks_leave_no_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "two_sites.json"
    run = _start(out, "--settings", "10:0", "--model", "nosuchfamily:layers=1", "--no-probe", "--timeout", "60")
    _, err = run.communicate(timeout=90)
    assert run.returncode != 0 and "two-sites: rank" in err, err[-3000:]
    assert two_sites.namespaces_of(run.pid) == [] and not out.exists()


def test_ctrl_c_leaves_no_namespaces(tmp_path: Path) -> None:
    run = _start(tmp_path / "two_sites.json", "--settings", "10:0", "--model", TINY, "--timeout", "60")
    deadline = time.monotonic() + 20
    while not two_sites.namespaces_of(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert two_sites.namespaces_of(run.pid), "the run never built its namespaces"
    time.sleep(1.0)  # its ranks are starting inside them
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    assert run.returncode != 0 and "namespaces are removed" in err, err[-3000:]
    assert two_sites.namespaces_of(run.pid) == []


def test_a_run_killed_outright_takes_its_ranks_along_and_the_next_run_removes_its_namespaces(tmp_path: Path) -> None:
    run = _start(tmp_path / "two_sites.json", "--settings", "10:0", "--probe-only", "--timeout", "60")
    deadline = time.monotonic() + 20
    while not two_sites.namespaces_of(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = two_sites.namespaces_of(run.pid)
    assert left, "the run never built its namespaces"
    time.sleep(1.0)
    run.kill()  # SIGKILL: no finally runs
    run.communicate(timeout=30)
    time.sleep(0.5)
    assert two_sites.namespaces_of(run.pid) == left  # left behind, as nothing could remove them
    for name in left:  # but nothing runs in them: the ranks died with the harness
        assert subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split() == []
    assert set(left) <= set(two_sites._remove_stale())  # what every run does first
    assert two_sites.namespaces_of(run.pid) == []
