"""The cost model against published measured runs (Megatron-LM SC'21 on A100s): nothing is fitted
on these rows; every constant comes from datasheets, published NCCL figures or the H200 here."""
from __future__ import annotations

import os
import sys

import pytest

import mplan
from mplan.cost_models.compute_cost import H200_GEMM_POINTS
from mplan.cost_models.megatron_reference import ReferenceError, default_reference_path, load_megatron_runs
from mplan.cost_models.reference_data import REFERENCE_FILES, load_h200_gemm_points, reference_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from megatron_calibration import calibrate, own_configs  # noqa: E402


CHECKED_ROWS = ("narayanan21_t1_1.7B", "narayanan21_t1_7.5B", "narayanan21_t1_39.1B", "narayanan21_t1_1008.0B",
                "narayanan21_t2_PTD-P_174.6B_384gpu", "narayanan21_t2_PTD-P_529.6B_2240gpu")
"""Six of the 16 rows, both tables, the smallest and largest models, the worst predicted (7.5B)
and the one with the most candidates (39.1B): all 16 take minutes, too long for CI, and
`benchmarks/megatron_calibration.py` writes the whole table
(benchmarks/results/megatron-calibration-2026-12-05.json)."""


@pytest.mark.slow
def test_published_rows_are_predicted_within_15_5_percent_and_7_5_on_average_at_the_median_candidate():
    """Each row scored at its median candidate in the published layout, never its fastest (which,
    as the model predicts low, is also its closest). These six rows: 15.2% at most, 7.3% on
    average (the whole table: 15.2% / 7.3%); the bounds sit just above."""
    runs = [run for run in load_megatron_runs() if run.id in CHECKED_ROWS]
    rows = [calibrate(run, with_auto=False) for run in runs]
    errors = [abs(r["own_error"]) for r in rows]
    assert len(rows) == len(CHECKED_ROWS)
    for r in rows:
        ordered = r["candidate_errors_fastest_first"]
        assert r["own_error"] == ordered[(len(ordered) - 1) // 2], r["id"]
    assert max(errors) < 0.155, {r["id"]: round(r["own_error"], 3) for r in rows}
    assert sum(errors) / len(errors) < 0.075


def test_candidates_keep_the_published_layout():
    """Table 2's micro-batch of 1 and Table 1's interleaved schedule on pipelined rows are kept;
    only what the paper does not report (micro-batch size, virtual stages) varies."""
    runs = {r.id: r for r in load_megatron_runs()}
    table2 = own_configs(runs["narayanan21_t2_PTD-P_174.6B_1536gpu"])
    assert table2 and {c.mbs for c in table2} == {1}
    pipelined = own_configs(runs["narayanan21_t1_39.1B"])
    assert pipelined and {c.schedule for c in pipelined} == {"interleaved"}
    assert {c.mbs for c in pipelined} == {1, 2, 4, 8} and {c.vpp for c in pipelined} == {2, 3, 4, 6, 8}
    unpipelined = own_configs(runs["narayanan21_t1_1.7B"])
    assert [(c.schedule, c.mbs) for c in unpipelined] == [("1f1b", 1), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("row_id", ["narayanan21_t1_1.7B", "narayanan21_t1_39.1B"])
def test_the_planner_finds_a_plan_at_least_as_fast_as_the_published_one(row_id):
    (run,) = [r for r in load_megatron_runs() if r.id == row_id]
    row = calibrate(run)
    assert row["auto_vs_own"] >= 1.0
    assert row["auto_tp_within_node"]


def test_the_reference_file_is_read_with_its_conventions():
    runs = {r.id: r for r in load_megatron_runs()}
    gpt175 = runs["narayanan21_t2_PTD-P_174.6B_1536gpu"]
    # The paper's derived iteration time (the file's derived.iteration_time_s) from its own FLOP convention.
    assert gpt175.measured_step_s() == pytest.approx(20.83, rel=0.01)


def test_the_reference_files_are_package_data_inside_mplan():
    package = os.path.realpath(os.path.dirname(mplan.__file__))
    assert os.path.realpath(default_reference_path()) == os.path.realpath(reference_path("megatron-sc21-a100.json"))
    for name in REFERENCE_FILES:
        path = os.path.realpath(reference_path(name))
        assert os.path.commonpath([path, package]) == package, path
        assert os.path.isfile(path), path
    with pytest.raises(ReferenceError, match="unknown reference file"):
        reference_path(os.path.join("..", "megatron-sc21-a100.json"))


def test_the_fitted_gemm_points_are_those_of_the_packaged_measurement():
    assert load_h200_gemm_points() == H200_GEMM_POINTS


def test_a_malformed_reference_file_names_the_field(tmp_path):
    bad = tmp_path / "runs.json"
    bad.write_text('[{"id": "x", "model": {"layers": "many"}, "cluster": {}, "config": {"micro_batch": null}}]')
    with pytest.raises(ReferenceError, match=r"runs.json: \[0\].model.layers must be an integer"):
        load_megatron_runs(str(bad))
