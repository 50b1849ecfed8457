"""`mplan profile` measures this machine and writes a cluster file that plans load."""
from __future__ import annotations

import json

import pytest

from mplan.cli import main as cli_main
from mplan.cost_models.cluster import ClusterSpec


def test_profile_writes_a_cluster_file_with_measured_tables(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    assert cli_main(["profile", "--quick", "--no-links", "-o", str(path)]) == 0
    assert "written" in capsys.readouterr().out
    cluster = ClusterSpec.from_json(str(path))
    assert cluster.profile is not None and cluster.profile.device is not None
    assert len(cluster.profile.device.gemm) > 3 and all(t.seconds > 0 for t in cluster.profile.device.gemm)
    doc = json.loads(path.read_text())
    assert doc["format"] == "mplan.cluster"
    # A plan can be made on the measured file.
    assert cli_main(["plan", "tiny-gpt", "--cluster", str(path), "--global-batch", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["world_size"] == 1


def test_verify_runs_a_plan_file_on_cpu_ranks_and_reports_json(tmp_path, capfd):
    """`mplan verify plan.json --json` in this process (the ranks it spawns write to the same file
    descriptors, so `capfd` holds all of stdout): one JSON document, the plan verified."""
    plan_path = tmp_path / "plan.json"
    assert cli_main(["plan", "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128",
                     "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "4", "--spec", "tp=2",
                     "-o", str(plan_path), "--json"]) == 0
    capfd.readouterr()
    assert cli_main(["verify", str(plan_path), "--world-size", "2", "--json"]) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["passed"] and report["max_param_rel_err"] < 1e-9 and report["world_size"] == 2


def test_bench_measure_runs_the_plan_for_real(capsys):
    assert cli_main(["bench", "tiny-llama", "--cluster", "cpu", "--global-batch", "4", "--plans", "dp=1",
                     "--measure", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    assert row["error"] is None and row["measured"]["step_time_s"] > 0
    assert row["measured"]["tokens_per_s"] == pytest.approx(4 * 16 / row["measured"]["step_time_s"])
    # the measurement set against the prediction: step time, and (on GPUs) the peak memory against
    # the prediction without the fragmentation margin, which max_memory_allocated does not see
    error = row["measured"]["prediction_error"]
    assert error["step_time"] == pytest.approx(row["predicted"]["step_time_s"] / row["measured"]["step_time_s"] - 1)
    assert 0 < error["predicted_allocated_gib"] < row["predicted"]["memory_gib"]
    assert error["peak_memory"] is None  # no device peak on the CPU


def test_bench_measures_pipeline_plans_on_cpu_ranks(tmp_path):
    """Under torchrun, `mplan bench --measure` runs each plan for real, pipelines among them, and
    orders the plans by prediction and by measurement."""
    import os
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mplan",
                          "bench", "tiny-llama", "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "4",
                          "--plans", "dp=2", "pp=2,mbs=1,schedule=1f1b", "pp=2,mbs=1,schedule=zb-h1", "--measure",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    for row in doc["plans"]:
        assert row["error"] is None and row["measured"]["step_time_s"] > 0, row
        assert "prediction_error" in row["measured"], row
    assert [row["mesh"]["pp"] for row in doc["plans"]] == [1, 2, 2]
    assert sorted(doc["ranking"]["predicted"]) == sorted(doc["ranking"]["measured"]) == sorted(
        ["dp=2", "pp=2,mbs=1,schedule=1f1b", "pp=2,mbs=1,schedule=zb-h1"])
    assert "fastest first, measured:" in run.stdout


def test_bench_writes_each_row_as_it_finishes(tmp_path, monkeypatch):
    """--out is rewritten after every plan: a measured run cut short keeps the plans it finished."""
    from mplan import bench

    out, seen = tmp_path / "rows.json", []
    real = bench.bench_plans

    def spy(*args, on_row=None, **kwargs):
        def record(rows):
            on_row(rows)
            seen.append([row["spec"] for row in json.loads(out.read_text())["plans"]])
        return real(*args, on_row=record, **kwargs)

    monkeypatch.setattr(bench, "bench_plans", spy)
    assert cli_main(["bench", "tiny-llama", "--cluster", "cpu", "--global-batch", "4", "--plans", "dp=1", "tp=3",
                     "auto", "--out", str(out)]) == 0
    assert seen == [["dp=1"], ["dp=1", "tp=3"], ["dp=1", "tp=3", "auto"]]
    assert json.loads(out.read_text())["plans"][1]["error"]  # tp=3 cannot run on one device: its row says why


def test_profiled_kernels_are_sorted_by_kind():
    """Kernel names as the H200 runs recorded them (step profiles, 2026-11-29)."""
    from mplan.measure import kernel_kind

    assert kernel_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert kernel_kind("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kernel_kind("_backward_kernel") == kernel_kind("triton_poi_fused_gelu_5") == "other"


def test_the_planners_own_plan_for_four_cpu_ranks_trains_like_one_process(tmp_path):
    """The planner and the passes agree on what a plan means: plan for a 4-rank CPU cluster with
    everything searched, then train that plan file on 4 gloo ranks under torchrun."""
    import os
    import re
    import subprocess
    import sys

    model = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128"
    plan_path = tmp_path / "plan.json"
    assert cli_main(["plan", model, "--cluster", "cpu", "--gpus-per-node", "4", "--global-batch", "8",
                     "-o", str(plan_path), "--json"]) == 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          os.path.join(root, "examples", "train_cpu.py"), "--model", model,
                          "--plan", str(plan_path), "--check", "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"largest relative loss difference from one process: ([0-9.e+-]+)", run.stdout)
    assert found and float(found.group(1)) < 1e-9, run.stdout[-2000:]
