"""The cost model against published measured runs (Megatron-LM SC'21 on A100s): nothing is fitted
on these rows; every constant comes from datasheets, published NCCL and matmul figures, the code Megatron-LM
released with the paper, or the H200 here."""
from __future__ import annotations

import os
import sys

import pytest

import mplan
from mplan.cost_models.compute_cost import H200_GEMM_POINTS
from mplan.cost_models.megatron_reference import ReferenceError, default_reference_path, load_megatron_runs
from mplan.cost_models.reference_data import REFERENCE_FILES, load_h200_gemm_points, reference_path
from mplan.ir.mesh import GroupShape

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.reprice.megatron import calibrate, own_configs, planner_for  # noqa: E402


@pytest.mark.slow
def test_every_published_row_is_predicted_within_10_percent_and_5_on_average_at_the_median_candidate():
    """All 16 rows, each scored at its median candidate in the published layout, never its fastest
    (issue 33 item 5). The table stands at 6.9% at most, 3.6% on average
    (benchmarks/results/megatron-calibration-2026-12-05-dp.json); it stood at 15.2% / 7.5% before
    data-parallel traffic was priced as Megatron-LM ran it and the A100 took its published GEMM rate."""
    rows = [calibrate(run, with_auto=False) for run in load_megatron_runs()]
    errors = {r["id"]: round(r["own_error"], 3) for r in rows}
    assert len(rows) == 16
    for r in rows:
        ordered = r["candidate_errors_fastest_first"]
        assert r["own_error"] == ordered[(len(ordered) - 1) // 2], r["id"]
    assert max(abs(e) for e in errors.values()) < 0.10, errors
    assert sum(abs(r["own_error"]) for r in rows) / len(rows) < 0.05, errors


@pytest.mark.parametrize("row_id, nodes_per_group, nics", [("narayanan21_t1_1.7B", 4, 8), ("narayanan21_t1_7.5B", 16, 2),
                                                           ("narayanan21_t1_18.4B", 32, 1)])
def test_data_parallel_sync_is_megatrons_fp16_all_reduce_over_the_nics_its_group_owns(row_id, nodes_per_group, nics):
    """32-way DP as Megatron-LM ran it in 2021: one all-reduce of the fp16 gradients after the last
    backward, nothing overlapped, an NCCL ring over all 32 ranks whose traffic leaves each node
    through the NICs of the group's GPUs there (8 for TP 1, 2 for TP 4, 1 for TP 8): 2 x 31/32
    of the bytes at 24 GB/s a NIC, within the latency of the ring's hops."""
    (run,) = [r for r in load_megatron_runs() if r.id == row_id]
    planner = planner_for(run)
    config = own_configs(run)[0]
    estimate = planner.evaluate(config, fast=False)
    grad_bytes = estimate.memory[0].grads_bytes
    assert grad_bytes == estimate.memory[0].params_bytes  # fp16 gradients, as the fp16 parameters
    assert config.dp == 32 and GroupShape.from_mesh_axis(size=32, stride=run.tp, gpus_per_node=8) == \
        GroupShape(size=32, ranks_per_node=32 // nodes_per_group)
    ring = 2 * 31 / 32 * grad_bytes / (nics * 24e9)
    (sync,) = estimate.grad_sync_s
    assert sync == pytest.approx(ring, rel=0.01)
    assert estimate.simulation.exposed_comm_s == pytest.approx(sync)  # after the last backward: all of it


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
