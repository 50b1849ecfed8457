"""benchmarks.calibration: the one-GPU cases' own code paths on the CPU (so they do not rot between GPU
sessions), and the planner held to the committed H200 steps, each case run by the harness's command
line (`python -m benchmarks.calibration CASE --out FILE [flags]`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _calibration(tmp_path: Path, case: str, *args: str, timeout: int = 300) -> dict:
    out = tmp_path / f"{case}.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.calibration", case, *args, "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["harness"] == f"benchmarks.calibration {case}"
    return report


@pytest.mark.slow
def test_single_h200_steps_are_predicted_within_ten_percent(tmp_path: Path) -> None:
    """Issue 3's bar on the measured H200 steps (bf16, ZeRO-1 fp32 masters, four 1-3B models):
    step time within 10% and peak memory within 5%, today's cost model against that run."""
    rows = _calibration(tmp_path, "steps-check", str(RESULTS / "h200_step-2026-11-29.json"))["rows"]
    assert len(rows) == 4
    for row in rows:
        assert abs(row["step_error"]) < 0.10 and abs(row["memory_error"]) < 0.05, row


def test_a_copy_table_run_replaces_a_profiles_copy_table_and_nothing_else(tmp_path: Path) -> None:
    """copy-table --apply: the profile's copy rows become the run's batched ones, its GEMM
    and attention tables stay, and its note names the run."""
    from mplan.cost_models.profile import ClusterProfile

    packaged = ROOT / "mplan" / "cost_models" / "profiles" / "h200.json"
    profile = tmp_path / "h200.json"
    profile.write_text(packaged.read_text())
    result = RESULTS / "copy_table_h200-2026-12-02-session6.json"
    report = _calibration(tmp_path, "copy-table", "--apply", str(result), "--profile", str(profile))
    before, after = ClusterProfile.from_json(str(packaged)), ClusterProfile.from_json(str(profile))
    assert [(c.bytes_moved, c.seconds) for c in after.device.copy] == [
        (r["bytes_moved"], r["seconds"]) for r in json.loads(result.read_text())["profile_copy"]]
    assert after.device.copy != before.device.copy
    assert (after.device.gemm, after.device.attention) == (before.device.gemm, before.device.attention)
    assert after.note.startswith(before.note) and result.name in after.note
    assert report["copy_rows"] == len(after.device.copy) and report["note"] == after.note


@pytest.mark.script_smoke
def test_split_backward_benchmark_on_tiny_stages(tmp_path: Path) -> None:
    """split-backward --device cpu (float32): every phase timed on both clocks, the planner's
    weight-gradient share beside the measured one, and the split backward (mplan's I+W, torch's
    stage_backward_input + stage_backward_weight) equal to the whole backward."""
    report = _calibration(tmp_path, "split-backward", "--device", "cpu")
    assert {"date", "gpu", "torch", "triton", "dtype", "kernel_clock", "settings", "planner_cluster"} <= set(report)
    assert report["smoke"] and report["torch_split_error"] is None and report["skipped"] == []
    assert set(report["shapes"]) == {"llama mbs=1", "llama mbs=4", "gpt mbs=1", "gpt mbs=4"}
    ratio_names = {"split_over_full", "input_over_full", "weight_over_full", "torch_split_over_full",
                   "torch_weight_over_full", "full_over_forward"}
    for key, row in report["shapes"].items():
        assert row["tokens"] == row["micro_batch"] * row["seq_len"], key
        assert set(row["phases"]) == {"forward", "B", "I", "W", "I+W", "torch_I", "torch_W", "torch_I+W"}, key
        for name, phase in row["phases"].items():
            assert phase["wall_ms"] > 0 and len(phase["wall_ms_all"]) == report["settings"]["rounds"], (key, name)
            assert isinstance(phase["kernel_ms"], float), (key, name)
            assert phase["start_mib"] is phase["peak_mib"] is phase["held_mib"] is None, (key, name)  # no CUDA
        for clock in ("wall", "kernel"):
            assert set(row["ratios"][clock]) == ratio_names, (key, clock)
            assert all(value is not None for value in row["ratios"][clock].values()), (key, clock)
        planner = row["planner"]
        assert planner["num_blocks"] == row["num_layers"] == 2, key
        assert 0.0 < planner["weight_backward_ms"] < planner["backward_ms"], (key, planner)
        assert planner["weight_share"] == pytest.approx(planner["weight_backward_ms"] / planner["backward_ms"])
        correctness = row["correctness"]
        for method in ("repeat_full", "split", "torch_split"):
            # float32 on the CPU: the same kernels on the same values, summed in the same order
            assert correctness[method]["passed"] and correctness[method]["max_rel_error"] < 1e-6, (key, correctness)


@pytest.mark.script_smoke
def test_host_overhead_benchmark_measures_and_compares_every_micro_batch(tmp_path: Path) -> None:
    """host on the CPU: host figures measured, every micro-batch's plan measured by
    `mplan bench --measure` and predicted with and without the host term."""
    report = _calibration(tmp_path, "host", "--device", "cpu", "--small", timeout=420)
    assert report["host"]["aten_op_s"] > 0 and report["host"]["source"].startswith("measured")
    rows = report["comparison"]["rows"]
    assert [r["mbs"] for r in rows] == [1, 2, 8] and all(r["measured_step_s"] for r in rows), rows
    # the host term is priced: at micro-batch 1 it adds more than at 8 (the same tokens)
    assert all(r["predicted_step_s"] > r["predicted_free_host_step_s"] for r in rows), rows
    ratios = report["comparison"]["ratios"]
    assert ratios["mbs1_over_mbs8_predicted"] > ratios["mbs1_over_mbs8_predicted_free_host"], ratios


def test_cp_attention_benchmark_times_both_extreme_ranks_against_the_price(tmp_path: Path) -> None:
    """Issue 34's GPU row, its code path on the CPU's kernels: ranks 0 and cp-1 of a head-tail
    layout count the same visible pairs, each is timed forward and backward through the fused
    pieces and priced from the committed H100 profile (the CPU's times are no claim)."""
    report = _calibration(tmp_path, "cp-attention", "--device", "cpu", "--small", "--seqs", "256", "--cps", "2,4")
    assert report["gpu"] == "cpu (smoke test)" and report["priced_from"] == "profile_h100-2026-12-05.json"
    rows = report["rows"]
    assert [(r["cp"], r["rank"]) for r in rows] == [(2, 0), (2, 1), (4, 0), (4, 3)]
    for row in rows:
        assert row["pairs_imbalance"] == 0.0 and row["kernel_calls"] >= 2, row
        assert row["measured_ms"]["forward"] > 0 and row["measured_ms"]["backward"] > 0, row
        assert 0 < row["predicted_ms"]["forward"] < row["predicted_ms"]["backward"], row
    assert rows[0]["visible_pairs"] == rows[1]["visible_pairs"] == 256 * 257 // 4


def test_the_profile_case_writes_a_quick_profile_and_its_summary(tmp_path: Path) -> None:
    """profile --device cpu --quick: the profile where --profile says (not the packaged one), the
    summary beside it in the report."""
    from mplan.cost_models.profile import ClusterProfile

    written = tmp_path / "h200.json"
    report = _calibration(tmp_path, "profile", "--device", "cpu", "--quick", "--profile", str(written), timeout=120)
    profile = ClusterProfile.from_json(str(written))
    assert profile.device is not None and profile.device.name == "cpu" and "QUICK" in profile.note
    assert report["profile"] == profile.to_dict()
    assert report["summary"]["num_gemms"] == 8 and len(report["summary"]["reference_gemms"]) == 5


def test_train_summary_joins_the_committed_gpu_run_to_its_committed_figures(tmp_path: Path) -> None:
    """train-summary on the files train_gpu.sh returned on 2026-12-06 (its metrics committed, its card,
    versions and data report kept in the committed summary): every figure it computes is the committed one."""
    committed = json.loads((RESULTS / "train_gpu-2026-12-06.json").read_text())
    run = tmp_path / "run"
    run.mkdir()
    (run / "gpu.txt").write_text(f"{committed['gpu']}\n{committed['torch']} {committed['triton']} "
                                 f"{committed['transformers']}\n")
    (run / "data.json").write_text(json.dumps(committed["data"]))
    (run / "train_gpu_metrics.jsonl").write_text((RESULTS / "train_gpu_metrics-2026-12-06.jsonl").read_text())
    report = _calibration(tmp_path, "train-summary", str(run))
    figures = set(report) - {"harness", "command", "date"}
    assert "step_time_prediction_error" in figures and "memory_prediction_error" in figures
    assert {key: report[key] for key in figures} == {key: committed[key] for key in figures}


@pytest.mark.script_smoke
def test_bench_cli_measures_every_row_of_every_unseen_config(tmp_path: Path) -> None:
    """bench-cli --configs unseen: the three unseen HF configs, tiny, one gloo rank: a row without
    and one with selective recomputation each get a prediction and a measurement (no row lost to
    another's error)."""
    report = _calibration(tmp_path, "bench-cli", "--configs", "unseen", "--device", "cpu", "--small", "--plans",
                          "mbs=1", "mbs=2,recompute=selective", timeout=600)
    assert set(report["models"]) == {"qwen3", "smollm2", "gemma"}
    assert report["summary"]["rows"] == report["summary"]["measured"] == 6, report["summary"]
    # each bench's output is kept as it comes (a process killed at its timeout still says where its time went)
    log = tmp_path / "bench-cli_work" / report["models"]["gemma"]["log"]
    assert "mplan: capture" in log.read_text(), log.read_text()[-2000:]


def test_bench_cli_refuses_a_reprice_without_a_cluster(tmp_path: Path) -> None:
    out = tmp_path / "repriced.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.calibration", "bench-cli", "--reprice",
                          str(RESULTS / "hf_bench_h200-2026-12-02.json"), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and "--reprice needs --cluster" in run.stderr and not out.exists(), run.stderr
