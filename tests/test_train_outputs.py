"""`mplan train`'s TensorBoard output (`metrics.tensorboard`): the event file holds the metrics
JSONL's rows, field by field and step by step, also across a resume that redoes lost steps; and
tensorboard stays optional: mplan imports without it, and a config that asks for it is refused in
one line before anything is built.

The event files are read back with tensorboard's own EventAccumulator, the reader TensorBoard's
UI used for years, so a scalar it would not show fails here. Values are compared with a float32
tolerance: TensorBoard stores scalars as float32, the JSONL as float64.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_train import _config, tokens  # noqa: F401 (tokens: the stdlib-json token shards fixture)

FLOAT32 = 1e-6
"""Relative gap allowed between a JSONL value and its TensorBoard scalar (float32 holds ~7 digits)."""


def _train(config: str, overrides: list[str]) -> None:
    from mplan.train.config import load_config
    from mplan.train.run import train

    train(load_config(config, ["plan.spec=dp=1", *overrides]), progress="quiet")


def _rows(jsonl: str) -> list[dict]:
    return [json.loads(line) for line in open(jsonl, encoding="utf-8") if line.strip()]


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of `log_dir`'s event files: [(step, value), ...] as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _assert_scalars_are_rows(scalars: dict[str, list[tuple[int, float]]], rows: list[dict]) -> None:
    numeric = {key for row in rows for key, value in row.items()
               if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert {"loss", "lr", "step_time_s", "tokens_per_s"} <= numeric
    assert set(scalars) == numeric
    for key in numeric:
        expected = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
        assert [step for step, _ in scalars[key]] == [step for step, _ in expected], key
        assert [value for _, value in scalars[key]] == pytest.approx([v for _, v in expected], rel=FLOAT32), key


def test_tensorboard_scalars_are_the_jsonl_rows_step_by_step(tmp_path, tokens) -> None:  # noqa: F811
    config = _config(str(tmp_path), tokens, "run")
    board = str(tmp_path / "board")
    _train(config, ["train.steps=4", "checkpoint.dir=", f"metrics.tensorboard={board}"])
    rows = _rows(str(tmp_path / "run.jsonl"))
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["lr"] for row in rows[:2]] == [1.5e-3, 3e-3]  # the warmup: the scalars are not all alike
    _assert_scalars_are_rows(_scalars(board), rows)


def test_a_resumed_run_hides_the_steps_its_checkpoint_lost(tmp_path, tokens) -> None:  # noqa: F811
    """A job checkpoints at step 3, runs to step 5 and dies before its next checkpoint; its rerun
    resumes from step 3 and redoes 4 and 5. TensorBoard must show steps 1-6 once each, 4 and 5
    from the rerun (their step times are the rerun's JSONL rows), as the JSONL does."""
    config = _config(str(tmp_path), tokens, "job")
    board, ckpt = str(tmp_path / "board"), str(tmp_path / "job-ckpt")
    _train(config, ["train.stop_at=3", f"metrics.tensorboard={board}"])
    shutil.copytree(ckpt, str(tmp_path / "at-step-3"))
    _train(config, ["train.stop_at=5", f"metrics.tensorboard={board}"])
    assert [row["step"] for row in _rows(str(tmp_path / "job.jsonl"))] == [1, 2, 3, 4, 5]
    shutil.rmtree(ckpt)
    shutil.copytree(str(tmp_path / "at-step-3"), ckpt)  # the checkpoint of step 5 was never written
    _train(config, [f"metrics.tensorboard={board}"])
    rows = _rows(str(tmp_path / "job.jsonl"))
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert len(os.listdir(board)) == 3  # one event file per job
    _assert_scalars_are_rows(_scalars(board), rows)


def test_without_tensorboard_the_run_is_refused_in_one_line(tmp_path, tokens, monkeypatch, capsys) -> None:  # noqa: F811
    from mplan.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)  # so torch tries again
    config = _config(str(tmp_path), tokens, "run")
    board = tmp_path / "board"
    assert main(["train", config, "--set", f"metrics.tensorboard={board}", "-q"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("mplan train: error: metrics.tensorboard: tensorboard is not installed "
                            "(pip install tensorboard), or leave the key out\n")
    assert not board.exists() and not (tmp_path / "run.jsonl").exists()  # refused before anything ran


def test_mplan_imports_without_tensorboard() -> None:
    """tensorboard is a dev extra, not a dependency: nothing in mplan imports it until asked."""
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "import mplan, mplan.cli, mplan.train.run, mplan.train.observe\n"
            "assert 'torch.utils.tensorboard' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("key, where, words", [
    ("metrics.jsonl", "blocker/metrics.jsonl", "cannot create {p}: {b} is a file"),
    ("metrics.tensorboard", "blocker/board", "cannot create {p}: {b} is a file"),
    ("checkpoint.dir", "blocker", "{p} is a file, not a directory"),
    ("checkpoint.export_hf", "blocker/deeper/hf", "cannot create {p}: {b} is a file"),
    ("metrics.plot", "somedir", "{p} is a directory, not a file"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path, tokens, capsys, key: str, where: str,  # noqa: F811
                                                                    words: str) -> None:
    from mplan.cli import main

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory must go")
    (tmp_path / "somedir").mkdir()
    config = _config(str(tmp_path), tokens, "run")
    path = str(tmp_path / where)
    assert main(["train", config, "--set", f"{key}={path}", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"mplan train: error: {key}: {words.format(p=path, b=blocker)}\n"
    assert not (tmp_path / "run.jsonl").exists()  # refused before anything ran
