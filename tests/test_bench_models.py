"""benchmarks.models: the whole-model race's cases on the CPU, each run by the harness's command line
(`python -m benchmarks.models CASE --out FILE [flags]`), so that their code paths do not rot between
GPU sessions; and the `gpu-trace` case on a committed run's files."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.models.fp8_convergence import compare

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _models(case: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """`python -m benchmarks.models CASE ARGS` in a fresh process (its --out among ARGS): it must succeed."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.models", case, *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


@pytest.mark.script_smoke
def test_end_to_end_benchmark_on_tiny_models(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    _models("e2e", "--device", "cpu", "--small", "--systems", "eager,mplan,mplan_fp8", "--warmup", "2",
         "--steps", "2", "--rounds", "2", "--out", str(out))
    report = json.loads(out.read_text())
    for name, entry in report["models"].items():
        systems = entry["systems"]
        assert len(systems["mplan"]["losses"]) == len(systems["eager"]["losses"]) == 4, name
        assert len(systems["mplan"]["grad_norms"]) == len(systems["eager"]["grad_norms"]) == 4, name
        assert entry["correctness"]["mplan"]["passed"], entry["correctness"]
        first_step = entry["correctness"]["mplan"]["first_step"]
        assert first_step["passed"] and first_step["loss_rel_diff"] < 1e-3, first_step
        assert "FP8 linear needs a CUDA device" in systems["mplan_fp8"]["error"]  # refused, not faked


@pytest.mark.script_smoke
def test_fp8_convergence_benchmark_trains_toward_the_chains_floor(tmp_path: Path) -> None:
    """The smoke run learns the chain's transitions (below H(pi), the best loss without context,
    and above the batches' exact best loss); FP8 refuses the CPU and is skipped with the reason."""
    out = tmp_path / "fp8_convergence.json"
    _models("fp8-convergence", "--device", "cpu", "--small", "--out", str(out))
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"gpt-tiny", "llama-tiny"}
    for name, entry in models.items():
        chain, bf16 = entry["chain"], entry["systems"]["mplan"]
        assert len(bf16["losses"]) == len(bf16["step_s_all"]) == len(bf16["grad_norms"]) == 120, name
        assert chain["best_final_loss"] < bf16["final_loss"] < chain["context_free_loss"] < bf16["losses"][0], (
            name, chain, bf16["final_loss"])
        assert abs(chain["entropy_rate"] - chain["best_final_loss"]) < 0.15, chain
        assert "FP8 linear needs a CUDA device" in entry["systems"]["mplan_fp8"]["skipped"]
        assert "skipped" in entry["comparison"]


def test_fp8_convergence_comparison_fails_a_final_gap_over_one_percent() -> None:
    bf16 = [2.0 + 9.0 * math.exp(-step / 20) for step in range(100)]
    close = compare(bf16, [loss * 1.005 for loss in bf16], best_final_loss=1.9)
    assert close["passed"] and close["final_rel_diff"] == pytest.approx(0.005)
    final = close["final_loss_bf16"]
    assert close["final_excess_rel_diff"] == pytest.approx(0.005 * final / (final - 1.9))
    assert not compare(bf16, [loss * 1.02 for loss in bf16], best_final_loss=1.9)["passed"]
    assert not compare(bf16, bf16[:-1] + [math.nan], best_final_loss=1.9)["passed"]
    bump = compare(bf16, [loss * (1.2 if 40 <= step < 45 else 1.0) for step, loss in enumerate(bf16)], 1.9)
    assert bump["passed"] and 40 <= bump["smoothed_max_rel_gap_step"] < 55
    assert bump["smoothed_max_rel_gap"] == pytest.approx(0.1, rel=0.2)


@pytest.mark.script_smoke
def test_step_profile_on_tiny_models(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    _models("step-profile", "--device", "cpu", "--small", "--systems", "eager,mplan", "--out", str(out))
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"gpt-tiny", "llama-tiny"}
    assert all(row["wall_ms_per_step"] > 0 for rows in models.values() for row in rows.values())


@pytest.mark.script_smoke
def test_peers_races_an_own_model_one_peer_at_a_time(tmp_path: Path) -> None:
    """--own-pairs: mplan's own GPT raced against each peer in a process of its own (a model whose
    graphed pool does not fit beside two resident peers); each pair judges only its own peer."""
    out = tmp_path / "pairs.json"
    _models("peers", "--device", "cpu", "--small", "--families", "", "--own", "gpt", "--own-pairs",
         "--systems", "eager,mplan", "--out", str(out), timeout=600)
    entry = json.loads(out.read_text())["own"]["gpt"]
    assert set(entry["pairs"]) == {"eager"} and set(entry["pairs"]["eager"]["systems"]) == {"eager", "mplan"}
    assert entry["mplan_vs_eager"] == entry["pairs"]["eager"]["mplan_vs_eager"] > 0
    assert set(entry["targets"]) == {"mplan_vs_eager>=1.05", "losses_agree"} and entry["targets"]["losses_agree"]


@pytest.mark.script_smoke
def test_peers_benchmark_races_every_system_on_tiny_families(tmp_path: Path) -> None:
    """The soft-capped, packed-projection and MoE families and one Liger does not patch: mplan's
    losses agree with eager's, its fusion report says what fused, the liger slot's child protocol
    (run by the plain HF model on a CPU) reproduces eager's losses bit for bit, and the card and
    versions are in the JSON; mplan without its CUDA graphs (`mplan_eager`) runs in the same rounds
    and is compared with mplan."""
    out = tmp_path / "peers.json"
    _models("peers", "--device", "cpu", "--small", "--smoke-child", "--families", "gemma2,phi3,qwen3_moe,stablelm",
         "--systems", "eager,mplan,mplan_eager,liger", "--own", "llama", "--steady-steps", "2", "--steady-settle", "1",
         "--out", str(out), timeout=600)
    report = json.loads(out.read_text())
    assert report["gpu"] == "cpu (smoke test)" and {"torch", "triton", "transformers", "liger-kernel"} <= set(
        report["versions"])
    for name, entry in report["families"].items():
        systems = entry["systems"]
        assert len(systems["mplan"]["step_s_all"]) == len(systems["eager"]["step_s_all"]) == 2, name
        assert systems["mplan"]["step_cv"] >= 0 and len(systems["mplan"]["round_s"]) == 2, name
        assert entry["loss_agreement"]["mplan_vs_eager"]["passed"], (name, entry["loss_agreement"])
        assert len(entry["mplan_vs_eager_per_round"]) == 2 and entry["mplan_vs_best_peer"] > 0, name
        assert "linear_cross_entropy" in systems["mplan"]["fusion"]["fused"], name
        assert entry["mplan_vs_mplan_eager"] > 0 and entry["loss_agreement"]["mplan_eager_vs_eager"]["passed"], name
        assert set(entry["steady_cv"]) == set(systems) - {"liger"} | ({"liger"} if "stand_in" in systems["liger"]
                                                                        else set()), name  # each system alone too
        assert all(len(systems[s]["steady_step_s_all"]) == 2 for s in entry["steady_cv"]), name
    fused = {name: entry["systems"]["mplan"]["fusion"]["fused"] for name, entry in report["families"].items()}
    assert {"linear_group", "rope_qk", "linear_swiglu"} <= set(fused["phi3"])
    assert "linear_geglu" in fused["gemma2"]
    stand_in = report["families"]["phi3"]["systems"]["liger"]
    assert "stand_in" in stand_in and stand_in["losses"] == report["families"]["phi3"]["systems"]["eager"]["losses"]
    assert "not supported" in report["families"]["stablelm"]["systems"]["liger"]["skipped"]
    own = report["own"]["llama"]  # mplan's own Llama keeps issue 19's targets, judged beside the families
    assert own["targets"]["losses_agree"] and own["per_round"]["mplan_vs_eager"] > 0, own["targets"]
    block = report["families"]["stablelm"]["systems"]["mplan"]["fusion"]["coverage"][0]  # inspect's report
    assert block["block_type"] == "StableLmDecoderLayer" and block["fused"] and {"skipped", "left"} <= set(block)


def test_peers_judges_the_spread_of_each_system_run_alone_against_compiles() -> None:
    """The steady block (each system alone, after the rounds): its spread and median per system, and
    issue 35's target that mplan's spread is at most torch.compile's, judged on those blocks."""
    from benchmarks.models.peers import compare, summarize

    def row(steps: list[float], steady: list[float]) -> dict:
        made = {"step_s_all": steps, "steady_step_s_all": steady, "peak_gib": 1.0, "losses": [1.0, 1.0],
                "grad_norms": [1.0, 1.0]}
        summarize(made, 2)
        return made

    rows = {"eager": row([2.0, 2.0], [2.0, 2.0]), "compile": row([1.2, 1.2], [1.2, 1.25, 1.15]),
            "mplan": row([1.0, 1.1], [1.0, 1.02, 0.98])}
    out = compare(rows)
    assert out["steady_cv"]["mplan"] == pytest.approx(0.0163299, rel=1e-4)
    assert out["steady_cv"]["mplan"] < out["steady_cv"]["compile"] and out["targets"]["steady_cv<=compile_steady_cv"]
    assert out["mplan_vs_peers_steady"] == {"eager": 2.0, "compile": 1.2}
    rows["mplan"] = row([1.0, 1.1], [1.0, 1.2, 0.8])
    assert not compare(rows)["targets"]["steady_cv<=compile_steady_cv"]


def test_peers_benchmark_records_a_family_that_fails_and_runs_the_next(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    _models("peers", "--device", "cpu", "--small", "--families", "phi3,llama", "--family-timeout-s", "0.01",
         "--out", str(out))
    families = json.loads(out.read_text())["families"]
    assert list(families) == ["phi3", "llama"]
    assert all("ran past --family-timeout-s" in entry["error"] for entry in families.values())


def test_gpu_trace_reports_a_committed_runs_trace_as_committed(tmp_path: Path) -> None:
    """Session 16's olmo2 race and its clock trace: the case adds the committed "gpu_trace" again,
    figure for figure, and prints a line per system."""
    name = "peers_h100-2026-12-06-session16-olmo2-trace"
    committed = json.loads((RESULTS / f"{name}.json").read_text())
    report = tmp_path / "run.json"
    shutil.copy(RESULTS / f"{name}.json", report)
    out = tmp_path / "annotated.json"
    run = _models("gpu-trace", "--report", str(report), "--trace", str(RESULTS / f"{name}.csv"), "--out", str(out))
    annotated = json.loads(out.read_text())
    assert annotated.pop("harness") == "benchmarks.models gpu-trace" and annotated.pop("command")
    assert annotated == committed
    assert len(run.stdout.splitlines()) == len(committed["families"]["olmo2"]["gpu_trace"]) == 4


@pytest.mark.script_smoke
def test_hf_models_races_llama_with_the_child_protocol(tmp_path: Path) -> None:
    """The liger slot's child process (`hf-models --system eager`, standing in on a CPU) trains the
    same weights on the same batches as eager in the main process: its losses equal eager's bit for
    bit; mplan's agree with eager's and its profile has its kernel categories."""
    out = tmp_path / "hf.json"
    _models("hf-models", "--device", "cpu", "--small", "--models", "llama", "--smoke-child", "--profile",
            "--out", str(out))
    entry = json.loads(out.read_text())["models"]["llama"]
    systems = entry["systems"]
    assert set(systems) == {"eager", "mplan", "liger"} and entry["liger_weights_match"]
    assert "stand_in" in systems["liger"] and systems["liger"]["losses"] == systems["eager"]["losses"]
    assert entry["loss_agreement"]["mplan_vs_eager"]["passed"] and entry["targets"]["losses_agree_with_eager"]
    assert set(entry["profile"]) == {"eager", "mplan", "liger"}


def test_gemm_ceiling_times_the_committed_runs_linears() -> None:
    """The case needs a GPU; the linears it times, per model, are those of its committed run."""
    from benchmarks.models.gemm_ceiling import linear_shapes
    from benchmarks.models.workloads import FULL

    committed = json.loads((RESULTS / "gemm_ceiling_h200-2026-11-29.json").read_text())["models"]
    for workload in FULL:
        rows = committed[workload.name]["linears"]
        assert sorted(linear_shapes(workload).items()) == [((r["in"], r["out"], r["bias"]), r["count"]) for r in rows]
        assert committed[workload.name]["tokens"] == workload.batch * workload.config.seq_len
