"""The kernels harness (benchmarks/kernel_peers/) on the CPU, one smoke run per case, so that its code
paths do not rot between GPU sessions; and the GPU kernel time it rests on (benchmarks/gpu_time.py).
The optimizer case's smoke run is tests/test_kernel_adamw.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_case(case: str, tmp_path: Path, *flags: str, interpret: bool = False) -> dict[str, Any]:
    """`python -m benchmarks.kernel_peers CASE --device cpu --small` in a fresh process: its report."""
    out = tmp_path / f"{case}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_peers", case, "--device", "cpu", "--small",
                          "--out", str(out), *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**env, **({"TRITON_INTERPRET": "1"} if interpret else {})})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["harness"] == f"benchmarks.kernel_peers {case}" and report["gpu"] == "cpu (smoke test)"
    return report


@pytest.mark.script_smoke
@pytest.mark.slow
def test_fused_checks_every_kernel_under_the_interpreter(tmp_path: Path) -> None:
    kernels = run_case("fused", tmp_path, "--all-shapes", interpret=True)["kernels"]
    assert {"swiglu (packed)", "rope", "cross_entropy"} <= set(kernels)
    assert all(entry["correct"] and len(entry["timing_more"]) == 1 for entry in kernels.values()), kernels
    assert all(entry["timing"]["bytes_fwd"] > 0 and entry["timing"]["triton"]["fwd_ms"] > 0
               for entry in kernels.values())


@pytest.mark.script_smoke
def test_hf_checks_mplan_against_hugging_face_at_the_three_models(tmp_path: Path) -> None:
    models = run_case("hf", tmp_path)["models"]
    assert set(models) == {"llama", "mistral", "qwen2"}
    for model in models.values():
        assert set(model["ops"]) == {"rmsnorm", "rope", "swiglu", "swiglu_packed", "head_loss"}
        for op in model["ops"].values():
            mine = {name: row for name, row in op["systems"].items() if name.startswith("mplan")}
            assert mine and all(row["passed"] for row in mine.values()), op
            assert op["systems"]["liger"]["error"].startswith("skipped")
            assert op["mplan_vs_best_peer"]["fwd_bwd"]["peer"] == "eager"
        assert {row["op"] for row in model["table"]} == set(model["ops"])


@pytest.mark.script_smoke
def test_head_loss_agrees_on_the_loss_at_every_chunk(tmp_path: Path) -> None:
    shape = run_case("head-loss", tmp_path)["shapes"]["tiny"]
    mine = {name: row for name, row in shape["systems"].items() if name.startswith("mplan")}
    assert {"mplan chunk=64", "mplan chunk=128", "mplan unfused", "mplan at liger's chunk"} <= set(mine)
    assert all(row["passed"] and abs(row["loss_vs_default"]) < 1e-5 for row in mine.values()), mine
    assert shape["systems"]["mplan chunk=64"]["predicted_d_w_ms"] == 2 * shape["systems"]["mplan chunk=128"][
        "predicted_d_w_ms"]


@pytest.mark.script_smoke
def test_fp8_casts_and_times_the_linears_under_the_interpreter(tmp_path: Path) -> None:
    """The interpreter rounds fp8 wrongly: the bits may differ there, the scale and amax may not."""
    report = run_case("fp8", tmp_path, interpret=True)
    assert report["cast"] and all(row["inv_scale_exact"] and row["amax_exact"] for row in report["cast"])
    linear = report["linears"]["tiny"]
    assert 0 < linear["fp8"]["fwd_rel_err"] < 0.25 and linear["bf16"]["fwd_rel_err"] < 1e-6, linear


@pytest.mark.script_smoke
def test_moe_checks_mplans_experts_against_hugging_faces_block(tmp_path: Path) -> None:
    report = run_case("moe", tmp_path)
    assert all(check["passed"] for name, check in report["unit_checks"].items() if name != "shape")
    assert report["correctness"]["mplan_kernel"]["passed"] and report["variants"]["mplan_kernel"]["ms"] > 0


@pytest.mark.script_smoke
def test_gemm_small_k_times_every_shape(tmp_path: Path) -> None:
    rows = run_case("gemm-small-k", tmp_path)["rows"]
    assert len(rows) == 3 and all(row["ms"] > 0 and row["tflops"] > 0 for row in rows)


@pytest.mark.script_smoke
def test_gemm_duty_times_both_patterns_and_prices_every_shape(tmp_path: Path) -> None:
    rows = run_case("gemm-duty", tmp_path, "--cluster", "h200")["rows"]
    assert set(rows) == {"qkv", "gate_up"}
    assert all(r["back_to_back_ms"] > 0 and r["interleaved_ms"] > 0 and r["priced_ms"] > 0
               and len(r["samples"]["interleaved"]) == 3 for r in rows.values()), rows


def test_grouped_gemm_gives_the_same_bits_both_ways_and_times_each(tmp_path: Path) -> None:
    report = run_case("grouped-gemm", tmp_path)
    assert report["all_same_bits"] and [r["group"] for r in report["rows"]] == ["tiny q/k/v", "tiny gate/up"]
    assert all(set(r["ms"]) == {"apart", "end_to_end", "aten_cat_linear", "aten_joined_linear"}
               and min(r["ms"].values()) > 0 and r["aten_same_bits"] for r in report["rows"])
    assert set(report["per_model"]) == {"tiny x32"}


def test_gpu_kernel_time_counts_kernels_not_the_annotations_around_them() -> None:
    """A record_function range (Optimizer.step) spans its kernels on the GPU timeline: counting it
    too would add the optimizer's time twice to a step's kernel time."""
    from benchmarks.gpu_time import kernel_table

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="adam_kernel", device_type=cuda, device_time=3000.0, is_user_annotation=False),
              SimpleNamespace(name="adam_kernel", device_type=cuda, device_time=1000.0, is_user_annotation=False),
              SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=cuda, device_time=4100.0,
                              is_user_annotation=True),
              SimpleNamespace(name="aten::add", device_type=cpu, device_time=0.0, is_user_annotation=False)]
    assert kernel_table(SimpleNamespace(events=lambda: events)) == {"adam_kernel": 4.0}


def test_the_engine_judges_against_twice_the_baselines_error_and_the_best_peer() -> None:
    """An op whose mplan variant is exact passes and one off by 5% fails (eager's bf16 error is
    well under 1e-2); the verdict divides the fastest peer's time by mplan's fastest variant's."""
    from benchmarks.kernel_peers import engine

    op = engine.Op(name="scale", make=lambda: [engine.leaf((64, 32), torch.device("cpu"), torch.bfloat16)],
                   systems={"mplan": lambda: lambda x: 2 * x, "mplan (off)": lambda: lambda x: 2.1 * x,
                            "eager": lambda: lambda x: 2 * x, "compile": lambda: lambda x: 2 * x},
                   reference=lambda x: 2 * x)
    rows, _ = engine.check(op, {name: factory() for name, factory in op.systems.items()})
    assert rows["mplan"]["passed"] and not rows["mplan (off)"]["passed"]
    times = {"mplan": 2.0, "mplan (off)": 1.0, "eager": 4.0, "compile": 3.0}
    verdict = engine.versus_best_peer(op, {name: {"fwd_bwd_ms": ms} for name, ms in times.items()}, ("fwd_bwd",))
    assert verdict["fwd_bwd"]["ratio"] == 3.0 and verdict["fwd_bwd"]["peer"] == "compile"
    assert verdict["fwd_bwd"]["by_variant"] == {"mplan": 1.5, "mplan (off)": 3.0}
