"""Numbers that would reach arithmetic are refused up front, each with one line naming it; output
that is no terminal keeps every value whole."""
from __future__ import annotations

import pytest

import mplan
from mplan.cli import main
from mplan.planner.plan import PlanError


@pytest.mark.parametrize("argv,named", [
    (["plan", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "0"], "--global-batch"),
    (["bench", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "-5", "--plans", "auto"], "--global-batch"),
    (["plan", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "8", "--nodes", "0"], "--nodes"),
    (["plan", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "8", "--seq-len", "x"], "--seq-len"),
    (["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--global-batch", "8", "--moe-imbalance", "0.5"],
     "--moe-imbalance"),
    (["inspect", "llama3-8b", "--batch", "0"], "--batch"),
])
def test_the_cli_refuses_a_bad_number_in_one_line_naming_it(argv: list[str], named: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {named}: must be" in last and "Traceback" not in last


@pytest.mark.parametrize("global_batch", [0, -5, 2.5, True])
def test_plan_refuses_a_bad_global_batch_before_capturing_anything(global_batch: object,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import mplan.planner.planning as planning

    monkeypatch.setattr(planning, "capture_for_planning", lambda *a, **k: pytest.fail("captured first"))
    with pytest.raises(PlanError, match=rf"global_batch must be a whole number of sequences >= 1, got {global_batch!r}"):
        mplan.plan("llama3-8b", cluster=mplan.ClusterSpec.preset("dgx-h100", nodes=1), global_batch=global_batch)


def test_piped_tables_keep_every_value_whole(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    """Output that is no terminal (a file, a pipe, a CI log) is not cut to 80 columns: no value
    ends in an ellipsis, and each alternative's spec is printed whole."""
    import json

    written = tmp_path / "plan.json"
    assert main(["plan", "tiny-llama", "--cluster", "dgx-h100", "--global-batch", "16", "-o", str(written)]) == 0
    printed = capsys.readouterr().out
    assert "…" not in printed
    alternatives = json.loads(written.read_text())["alternatives"]
    assert alternatives and all(a["spec"] in printed for a in alternatives)
    _plan_and_bench_agree(written, printed, capsys)


def _plan_and_bench_agree(written, printed: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`plan` and `bench --plans auto` price the same runtime by default (once `plan` priced
    Megatron-LM's and `bench` mplan's: one said llama3-70b needs 3x the devices, the other that
    it fits), so on the same job they choose the same plan at the same predicted step and memory;
    the Plan records the runtime and both outputs name it."""
    import json

    made = json.loads(written.read_text())
    assert made["runtime"] == "mplan" and "memory priced for mplan's runtime" in printed
    assert main(["bench", "tiny-llama", "--cluster", "dgx-h100", "--global-batch", "16", "--plans", "auto",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    assert row["resolved_spec"] == mplan.Plan.load(str(written)).spec()
    assert row["predicted"]["step_time_s"] == pytest.approx(made["predicted"]["step_time_s"], rel=1e-9)
    assert row["predicted"]["memory_gib"] == pytest.approx(made["predicted"]["memory_gib"], rel=1e-9)


def test_the_cpu_example_trains_a_hugging_face_config(tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`examples/train_cpu.py --model CONFIG.json` takes any model spec (it once read `.vocab`
    off the config, which transformers' configs do not have)."""
    import runpy
    import sys
    from pathlib import Path

    import torch

    transformers = pytest.importorskip("transformers")
    transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=16).save_pretrained(tmp_path)
    example = Path(__file__).resolve().parent.parent / "examples" / "train_cpu.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--model", str(tmp_path), "--plan", "dp=1", "--steps", "2",
                                      "--global-batch", "2", "--micro-batch", "1"])
    default_dtype = torch.get_default_dtype()
    try:
        runpy.run_path(str(example), run_name="__main__")
    finally:
        torch.set_default_dtype(default_dtype)  # the example trains in float64
    assert "step 1 | loss" in capsys.readouterr().out
