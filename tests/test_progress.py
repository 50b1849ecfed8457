"""A word while mplan works: each phase (capture, search or plan, lowering, first step) is told
with its time, one line per phase in a log, nothing when quiet, never on stdout; and a step time
priced from placeholder figures never reads as a prediction."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch

import mplan
from mplan.cli import main
from mplan.models import build_model
from mplan.planner.explain import explain_data, render
from mplan.progress import Progress

SMALL = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128"
PHASE_LINE = re.compile(r"^mplan: (?P<name>[a-z0-9/ ]+?) (?P<seconds>\d+\.\d\d) s(?: \((?P<detail>.*)\))?$")


def _phases(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    found = [PHASE_LINE.match(line) for line in lines]
    assert all(found), f"lines that are not phase lines: {[l for l, m in zip(lines, found) if not m]}"
    return [m["name"] for m in found if m]


def test_a_log_gets_one_line_per_phase_with_its_time() -> None:
    log = io.StringIO()  # not a terminal: the "lines" mode
    made = mplan.plan(SMALL, cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=2), global_batch=4,
                      progress=Progress(stream=log))
    assert _phases(log.getvalue()) == ["capture", "search"]
    assert made.mesh.dp * made.mesh.tp * made.mesh.pp == 2


def test_quiet_says_nothing_and_a_callback_hears_every_phase() -> None:
    log, heard = io.StringIO(), []
    mplan.plan(SMALL, cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1), global_batch=2,
               progress=Progress("quiet", stream=log))
    assert log.getvalue() == ""
    mplan.plan(SMALL, cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1), global_batch=2,
               progress=heard.append)
    assert heard[0].startswith("capture") and any(h.startswith("search") for h in heard)


def test_ranks_other_than_zero_stay_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    log = io.StringIO()
    with Progress("lines", stream=log).phase("capture"):
        pass
    assert log.getvalue() == ""


def test_the_environment_sets_the_mode_and_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLAN_PROGRESS", "quiet")
    assert Progress(stream=io.StringIO()).mode == "quiet"
    assert Progress("lines", stream=io.StringIO()).mode == "lines"  # an explicit mode wins
    monkeypatch.setenv("MPLAN_PROGRESS", "loud")
    with pytest.raises(ValueError, match="MPLAN_PROGRESS must be one of bar, lines, quiet; got 'loud'"):
        Progress(stream=io.StringIO())


def test_a_failed_phase_leaves_no_line_claiming_it_ended() -> None:
    log = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("lines", stream=log).phase("capture"):
            raise RuntimeError("boom")
    assert log.getvalue() == ""


def test_mplan_plan_json_keeps_stdout_one_document_and_q_silences_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", SMALL, "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "4", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mesh"]
    assert _phases(err) == ["capture", "search"]
    assert main([*args, "-q"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mesh"] and err == ""


def test_autoparallel_tells_each_phase_and_the_first_step_only() -> None:
    model = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    log = io.StringIO()
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, progress=Progress("lines", stream=log))
    assert _phases(log.getvalue()) == ["capture", "plan", "lowering"]
    pm.train_step(ids, ids)
    pm.train_step(ids, ids)
    assert _phases(log.getvalue()) == ["capture", "plan", "lowering", "first step"]
    # the plan's line carries the step time and says it rests on placeholders (the cpu preset's)
    plan_line = log.getvalue().splitlines()[1]
    assert "step" in plan_line and "NOT a prediction for this machine" in plan_line
    # the coordinates a sampler needs
    assert (pm.dp_rank, pm.dp_size, pm.local_batch_size) == (0, 1, 4)


@pytest.mark.parametrize("preset, figures, words", [
    ("cpu", "nominal", "NOT a prediction for this machine"),
    ("dgx-h100", "datasheet", "predicted from datasheet figures, not measured"),
    ("h200", "measured", "predicted from measured figures"),
])
def test_every_shown_prediction_says_what_it_rests_on(preset: str, figures: str, words: str) -> None:
    made = mplan.plan(SMALL, cluster=mplan.ClusterSpec.preset(preset), global_batch=2, progress="quiet")
    assert made.cluster.figures == figures
    assert mplan.Plan.from_dict(json.loads(made.to_json())).cluster.figures == figures  # survives the file
    assert explain_data(made)["predicted"]["figures"] == figures
    from rich.console import Console

    shown = io.StringIO()
    render(made, Console(file=shown, width=400))
    assert words in shown.getvalue()


def test_a_users_own_model_and_data_loader_train_exactly_under_torchrun_with_one_word_per_phase() -> None:
    """The README's quick start as a user runs it: a hand-written model, a DataLoader with a
    DistributedSampler fed pm.dp_size / pm.dp_rank, plan=None, on 2 gloo ranks; its log (not a
    terminal) holds one line per phase, from rank 0 only, and the losses match one process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(root / "examples" / "train_your_model.py"),
                           "--check"], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MPLAN_PROGRESS": "lines"})
    assert done.returncode == 0, done.stderr[-3000:]
    phases = [line for line in done.stderr.splitlines() if line.startswith("mplan: ")]
    assert [PHASE_LINE.match(line)["name"] for line in phases] == ["capture", "plan", "lowering", "first step"]
    difference = float(done.stdout.rsplit("largest relative loss difference from one process: ", 1)[1].split()[0])
    assert difference < 1e-9


def test_bench_tells_each_row_as_it_ends_inside_its_own_phase() -> None:
    """`mplan bench` in a log: the capture, then one line per row with what it found (a refused
    row says why), then the bench as a whole."""
    log = io.StringIO()
    progress = Progress("lines", stream=log)
    with progress.phase("bench", "2 plans"):
        from mplan.bench import bench_plans

        bench_plans(SMALL, mplan.ClusterSpec.preset("cpu", gpus_per_node=2), 4, ["dp=2", "tp=3"], progress=progress)
    lines = log.getvalue().splitlines()
    assert _phases(log.getvalue()) == ["capture", "row 1/2", "row 2/2", "bench"]
    assert "dp=2: predicted" in lines[1] and "tp=3: " in lines[2]


def test_a_phase_inside_another_keeps_the_outer_live_line() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    progress = Progress(stream=Terminal())
    assert progress.mode == "bar"
    with progress.phase("bench"):
        outer = progress._status
        with progress.phase("row 1/1"):
            assert progress._status is outer
        assert progress._status is outer and progress._current == "bench"
    assert progress._status is None


def test_bench_says_what_its_predictions_rest_on(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", SMALL, "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "4", "--plans", "dp=2", "-q"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["figures"] == "nominal"
    assert main(args) == 0
    assert "NOT a prediction for this machine" in " ".join(capsys.readouterr().out.split())
