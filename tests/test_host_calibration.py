"""The runtime host factor `mplan profile` measures (`mplan.host_calibration`) and how the
planner takes it (`planner.host_cost.runtime_host`)."""
from __future__ import annotations

import dataclasses

import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.profile import ClusterProfile
from mplan.host_calibration import HostCalibration, calibrate, fit_factor
from mplan.planner.host_cost import MPLAN_RUNTIME_HOST_FACTOR, runtime_host

H200_PROFILE = "benchmarks/results/profile_h200-2026-12-06.json"


def test_the_factor_is_the_one_whose_price_equals_the_measured_step() -> None:
    """A host-bound step: 2 ms of device time and 0.5 ms of bare host time per unit of f."""
    got = fit_factor(lambda f: max(2e-3, 0.5e-3 * f * 8), measured_s=30e-3)
    assert got.factor == pytest.approx(7.5, rel=1e-3) and "fitted" in got.why  # far finer than a step's noise


def test_a_step_the_device_binds_fits_nothing_and_says_why() -> None:
    got = fit_factor(lambda f: 20e-3 + 1e-3 * f, measured_s=30e-3)
    assert got.factor is None and "not host-bound" in got.why


def test_a_step_no_factor_in_range_prices_fits_nothing() -> None:
    got = fit_factor(lambda f: 1e-3 * f, measured_s=1.0)
    assert got.factor is None and "no factor" in got.why


def _with_runtime_factor(cluster: ClusterSpec, factor: float | None) -> ClusterSpec:
    device = cluster.profile.device
    host = dataclasses.replace(device.host, runtime_factor=factor)
    return cluster.with_profile(dataclasses.replace(cluster.profile, device=dataclasses.replace(device, host=host)))


def test_the_planner_takes_the_measured_factor_and_the_file_keeps_it(tmp_path) -> None:
    """A profile whose host figures carry a measured factor prices mplan's runtime with it (the
    constant fitted on one H100 otherwise), Megatron's runtime at the bare figures; the factor
    survives the cluster file, and a file without it (before 2026-12-06) still loads."""
    h200 = ClusterSpec.from_json(H200_PROFILE)
    bare = h200.profile.device.host
    assert bare.runtime_factor is None
    assert runtime_host(h200, "mplan", cuda_graphs=False).aten_op_s == pytest.approx(bare.aten_op_s * MPLAN_RUNTIME_HOST_FACTOR)
    measured = _with_runtime_factor(h200, 8.0)
    assert runtime_host(measured, "mplan", cuda_graphs=False).aten_op_s == pytest.approx(bare.aten_op_s * 8.0)
    assert runtime_host(measured, "megatron").aten_op_s == bare.aten_op_s
    path = tmp_path / "cluster.json"
    measured.to_json(str(path))
    assert ClusterSpec.from_json(str(path)).profile.device.host.runtime_factor == 8.0


def test_a_cpu_calibration_runs_the_runtime_and_fits_its_own_step() -> None:
    """On this CPU (no overlap: host and kernels add up), a tiny Llama trains through mplan and the
    bisection finds the factor whose price matches its step, or says why it cannot; the planner
    ignores it on CPUs, whose figures are nominal, but the measurement path is the GPU's."""
    cpu = ClusterSpec.local()
    assert isinstance(cpu.profile, (ClusterProfile, type(None)))
    got = calibrate(cpu, model="llama:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,seq=32,vocab=64", steps=1)
    assert isinstance(got, HostCalibration) and got.measured_step_s > 0
    assert got.factor is not None or "not host-bound" in got.why or "no factor" in got.why
