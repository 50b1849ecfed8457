"""A profile too thin to price a model (issue 30, "the quick profile is a trap"): `mplan profile
--quick` writes GEMMs of 32-64 per side, and a Llama step planned on that file was priced at
11,359 s against 0.383 s measured. Such tables are left to the device's datasheet, and the plan,
its explanation and the command line say so; a full profile prices as before."""
from __future__ import annotations

import json

import pytest

import mplan
from mplan.cli import main
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.profile import AttentionTiming, ClusterProfile, CopyTiming, DeviceProfile, GemmTiming, thin_tables
from mplan.planner.explain import render

MODEL = "llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=2816,seq=1024,vocab=32000"


def _quick_profile() -> ClusterProfile:
    """What `mplan profile --quick` measures (`ProfileGrid.transformer(quick=True)`), at launch-bound
    rates: 8 GEMMs of 32-64 per side, attention up to 64 tokens, copies up to 64 KiB."""
    gemm = tuple(GemmTiming(m=m, n=n, k=k, dtype="bf16", seconds=12e-6)
                 for m in (32, 64) for n in (32, 64) for k in (32, 64))
    attention = tuple(AttentionTiming(batch=1, heads=2, seq_q=s, seq_kv=s, head_dim=16, dtype="bf16", causal=True,
                                      forward_s=20e-6, forward_backward_s=60e-6) for s in (32, 64))
    copy = tuple(CopyTiming(bytes_moved=2 * b, seconds=5e-6) for b in (1 << 12, 1 << 16))
    return ClusterProfile(note="measured by mplan profile --quick",
                          device=DeviceProfile(name="NVIDIA H100 80GB HBM3", torch_version="2.13", measured_on="2026-12-05",
                                               gemm=gemm, attention=attention, copy=copy))


@pytest.fixture(scope="module")
def plans():  # noqa: ANN201 - the same model planned on the datasheet preset and on the quick file
    datasheet = ClusterSpec.preset("dgx-h100", measured=False)
    quick = datasheet.with_profile(_quick_profile())
    return (mplan.plan(MODEL, cluster=datasheet, global_batch=8, spec="dp=8"),
            mplan.plan(MODEL, cluster=quick, global_batch=8, spec="dp=8"))


def test_a_quick_profile_prices_the_model_as_its_datasheet_does(plans) -> None:
    """Its GEMMs, attention and copies are priced from the H100's datasheet, not held at a 64^3
    kernel's rate (before: thousands of times slower than the datasheet)."""
    datasheet, quick = plans
    assert quick.predicted.step_time_s == pytest.approx(datasheet.predicted.step_time_s, rel=1e-9)


def test_the_plan_and_its_explanation_say_the_profile_was_completed(plans) -> None:
    _, quick = plans
    assert json.loads(quick.to_json())["cluster"]["figures"] == "completed"
    from rich.console import Console

    console = Console(width=400, record=True)
    render(quick, console)
    assert "predicted from a measured profile too thin to price a model" in console.export_text()


def test_the_command_line_says_so_on_stderr(tmp_path, capsys) -> None:
    path = tmp_path / "quick.json"
    ClusterSpec.preset("dgx-h100", measured=False).with_profile(_quick_profile()).to_json(str(path))
    assert main(["plan", MODEL, "--cluster", str(path), "--global-batch", "8", "--spec", "dp=8", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["cluster"]["figures"] == "completed"
    assert (f"mplan: {path}: the profile of NVIDIA H100 80GB HBM3 measured on 2026-12-05 is too thin to price a "
            "model (GEMMs up to 64 per side (a model needs 1024+); attention up to 64 tokens (a model needs 512+); "
            "copies up to 131072 bytes (a model needs 16777216+))") in err


def test_a_full_profile_prices_from_its_tables_as_before() -> None:
    """The packaged H200 profile (`mplan profile` without --quick): nothing thin, a measured GEMM
    is priced at its measured time, and plans made with it say "measured"."""
    cluster = ClusterSpec.preset("h200")
    device = cluster.profile.device
    assert thin_tables(device) == {}
    assert cluster.figures == "measured"
    costs = ComputeCostModel(cluster)
    point = max(device.gemm, key=lambda t: t.m * t.n * t.k)
    assert costs.matmul_time(point.m, point.n, point.k, point.dtype) == pytest.approx(point.seconds, rel=1e-9)
