"""benchmarks.reprice: committed GPU measurements priced again with this checkout on the CPU, each
case run by the harness's command line (`python -m benchmarks.reprice CASE --out FILE`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from benchmarks.reprice.pricing import Committed, ResultError  # noqa: E402


def _command(tmp_path: Path, case: str, *args: str) -> subprocess.CompletedProcess:
    out = str(tmp_path / "out.json")
    return subprocess.run([sys.executable, "-m", "benchmarks.reprice", case, *args, "--out", out],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _reprice(tmp_path: Path, case: str, *args: str) -> dict:
    run = _command(tmp_path, case, *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["harness"] == f"benchmarks.reprice {case}"
    return report


def test_a_committed_file_without_a_field_a_case_reads_is_one_error_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"models": {"gpt-1.3b": {"systems": {"eager": {"step_s": 0.26}}}}}))
    with pytest.raises(ResultError, match=r"e2e.json: no \['models'\]\['gpt-1.3b'\]\['systems'\]\['mplan'\]"):
        Committed(path).at("models", "gpt-1.3b", "systems", "mplan")
    with pytest.raises(ResultError, match="cannot be read"):
        Committed(tmp_path / "absent.json")
    run = _command(tmp_path, "e2e", str(path))  # refused before any capture, in one line
    refusal = "python -m benchmarks.reprice e2e: e2e.json: no ['models']['gpt-1.3b']['systems']['mplan']"
    assert run.returncode == 2 and refusal in run.stderr and "Traceback" not in run.stderr


def test_adamw_share_derives_its_committed_result(tmp_path: Path) -> None:
    """Derived from committed files only: every figure as committed."""
    report = _reprice(tmp_path, "adamw-share")
    assert report["rows"] == json.loads((RESULTS / "compile_adamw_share-2026-12-02.json").read_text())["rows"]


def test_fused_kernel_prices_match_the_h200_run(tmp_path: Path) -> None:
    """Re-predicts session 4's H200 steps (e2e_h200-2026-11-29-session4.json; its committed check is
    fused_pricing_check-2026-11-29-session5.json), each system's optimizer priced as the AdamW it
    runs: mplan's (fused) step within 3% (-2.4% GPT-1.3B, -1.9% Llama-1.1B as committed; -1.5%, -0.2%
    priced by the checkout of 2026-12-07); eager's within 10% and FP8's within 12%, both predicted
    low for Llama-1.1B (-8.4%, -10.4%; GPT-1.3B -2.8%, -2.5%):
    pricing eager's ops one by one gives 50 ms more than the fused step where 70 ms were measured,
    and Llama's FP8 steps spread over 155-189 ms in that run (partly host-bound: 189-217 ms in
    three runs of GPT-1.3B).

    Not the run the README's step ratios quote: on session 7's (e2e_h200-2026-11-29-session7.json,
    fused_pricing_check-2026-11-29-session7.json) mplan's step is predicted -5.2% (GPT) and -3.5%
    (Llama), outside this 3% bar, and the README says so (-4.4%, -1.9% by the checkout of 2026-12-07);
    the bar is not widened for it."""
    report = _reprice(tmp_path, "e2e", str(RESULTS / "e2e_h200-2026-11-29-session4.json"))
    for name, row in report["rows"].items():
        assert abs(row["fused_error"]) < 0.03 and abs(row["unfused_error"]) < 0.10, (name, row)
        assert abs(row["fp8_error"]) < 0.12, (name, row)
        assert row["predicted_gain"] > 1.0


def test_one_host_factor_fitted_on_one_step_holds_out_on_the_rest(tmp_path: Path) -> None:
    """The factor this checkout fits is still the runtime's (MPLAN_RUNTIME_HOST_FACTOR, fitted on
    host_factor_fit-cpu-2026-12-05.json) within 5%, and it prices the six held-out steps within 10%
    where the bare figures miss by over half."""
    from mplan.planner.host_cost import MPLAN_RUNTIME_HOST_FACTOR

    report = _reprice(tmp_path, "host-fit")
    assert report["factor"] == pytest.approx(MPLAN_RUNTIME_HOST_FACTOR, rel=0.05)
    (fitted,) = [row for row in report["rows"] if row["fitted_on"]]
    assert abs(fitted["error_fitted"]) < 1e-3
    assert len(report["rows"]) == 7 and report["held_out_worst_error_fitted"] <= 0.10
    assert report["held_out_worst_error_as_measured"] > 0.5


def test_one_megatron_row_is_predicted_with_its_own_configuration_beside_the_committed_run(tmp_path: Path) -> None:
    """Table 1's 1.7B row (32 GPUs, dp=32) alone, from a reference file of that one row, with the
    committed run's errors set beside it (`--before`)."""
    from mplan.cost_models.megatron_reference import default_reference_path

    rows = json.loads(Path(default_reference_path()).read_text())
    reference = tmp_path / "one_row.json"
    reference.write_text(json.dumps([r for r in rows if r["id"] == "narayanan21_t1_1.7B"]))
    committed = RESULTS / "megatron-calibration-2026-12-05-dp-pricing.json"
    report = _reprice(tmp_path, "megatron", "--reference", str(reference), "--before", str(committed))
    (row,) = report["rows"]
    before = next(r for r in json.loads(committed.read_text())["rows"] if r["id"] == row["id"])
    assert row["before"]["own_error"] == before["own_error"]
    assert abs(row["own_error"]) < 0.10 and row["own_error"] == row["median_candidate_error"]
    assert row["auto_vs_own"] >= 1.0 and report["auto_never_slower"]


def test_a_race_family_is_priced_graphed_and_eager_beside_its_measured_steps(tmp_path: Path) -> None:
    """Granite (its graphs were refused in the race: both rows eager steps) within 10%, the price by
    kernel category beside the race's profile of the same step."""
    pytest.importorskip("transformers")
    family = _reprice(tmp_path, "races", "--families", "granite")["families"]["granite"]
    for system in ("mplan", "mplan_eager"):
        assert abs(family[system]["error"]) < 0.10, family[system]
    assert family["mplan"]["predicted_ms"] <= family["mplan_eager"]["predicted_ms"]  # no host time per op graphed
    assert {"gemm", "attention", "optimizer"} <= set(family["device_ms"]["predicted"])
    assert family["device_ms"]["measured_in"] == "peers_h100-2026-12-06-session14-a.json"


def test_the_planner_counts_what_the_fused_kernels_of_a_block_keep() -> None:
    """The planner's count of one block's saved activations (tp=1, fused kernels priced) is what the
    kernels kept when measured (`fused_activation_bytes-cpu-2026-12-07.json`, the Triton
    interpreter's run): byte for byte on both models. Counting the ATen ops' saves instead gives
    the references' bytes, 31% more on Llama (a fused norm keeps its input and rstd, a fused SwiGLU
    gate and up)."""
    from benchmarks.reprice.activation_bytes import MODELS, planner_saved_bytes

    measured = json.loads((RESULTS / "fused_activation_bytes-cpu-2026-12-07.json").read_text())["models"]
    for name, template in MODELS.items():
        two, four = (planner_saved_bytes(template.format(layers=layers)) for layers in (2, 4))
        assert (four - two) // 2 == measured[name]["per_block"]["kept_with_kernels_bytes"], name


@pytest.mark.script_smoke
def test_the_fused_kernels_of_a_block_keep_no_more_than_their_references(tmp_path: Path) -> None:
    """The whole case (the kernels run by the Triton interpreter: 4-5 minutes on 2 cores, so out of
    CI): the planner's count is what the kernels keep, and they keep no more than the references
    (Llama's fused norm and SwiGLU 24% less, GPT's the same)."""
    report = _reprice(tmp_path, "activation-bytes")
    for name, entry in report["models"].items():
        row = entry["per_block"]
        assert row["planner_saved_bytes"] == row["kept_with_kernels_bytes"], (name, row)
        assert row["kept_with_kernels_bytes"] <= row["kept_with_references_bytes"], (name, row)
