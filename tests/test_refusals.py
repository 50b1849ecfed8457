"""A refused run ends as one line, once per job (`mplan/refusal.py`).

A refusal (an impossible plan, a bad spec, a corrupt file: the same on every rank) prints
`mplan: error: <cause and fix>` on rank 0 only and exits with status 2, without a Python
traceback; `MPLAN_TRACEBACK=1` keeps the traceback; any other exception (a bug) keeps Python's
report. Under torchrun, torchrun's own ChildFailedError report follows: it cannot be avoided.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mplan import refusal
from mplan.refusal import EXIT_STATUS, TRACEBACK_VARIABLE, ArgumentParser, is_refusal, report, run

ROOT = Path(__file__).resolve().parent.parent
TINY = "llama:layers=1,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64"
"""The smallest model the CPU example trains."""


def _environment(**extra: str) -> dict[str, str]:
    """The test process's environment without mplan's or torchrun's variables, plus `extra`."""
    dropped = {TRACEBACK_VARIABLE, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID"}
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, "OMP_NUM_THREADS": "1", **extra}


def _torchrun_example() -> subprocess.CompletedProcess[str]:
    """examples/train_cpu.py on 2 gloo ranks with a global batch of 0: refused by `autoparallel`
    on both ranks before anything is captured (an impossible plan, refused after the capture,
    costs each rank 5 s more CPU for the same path out: `run`; `exit_now` inside a process group
    is the last test of this section)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_cpu.py"), "--model", TINY, "--plan", "dp=2",
               "--global-batch", "0", "--micro-batch", "1", "--steps", "1"]
    return subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=240, cwd=ROOT)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("mplan: error:")]


# -- under torchrun --------------------------------------------------------------------------------
def test_a_refusal_under_torchrun_is_one_line_from_rank_zero_and_no_traceback_of_ours() -> None:
    done = _torchrun_example()
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert _error_lines(output) == [
        "mplan: error: global_batch must be a positive number of sequences, got 0 "
        f"(set {TRACEBACK_VARIABLE}=1 for the traceback)"], output
    # torchrun's own report (its agent's ChildFailedError, with its traceback) cannot be avoided;
    # no rank prints a traceback of its own
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, output
    assert str(ROOT / "mplan") not in output and "train_cpu.py\", line" not in output, output
    assert "exitcode  : 2" in output  # rank 0 ended the job with mplan's status


# -- one process -----------------------------------------------------------------------------------
def test_a_refusal_of_the_plain_cli_is_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "mplan", "plan", "gpt-17", "--global-batch", "8"],
                          env=_environment(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == EXIT_STATUS, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("mplan plan: error: unknown model 'gpt-17'"), line


def test_the_debug_variable_keeps_the_traceback(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from mplan.cli import main

    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    assert main(["plan", "gpt-17", "--global-batch", "8"]) == EXIT_STATUS
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "mplan/models/spec.py" in err, err
    assert err.splitlines()[-1].startswith("mplan plan: error: unknown model 'gpt-17'")


def test_a_refusal_inside_a_process_group_still_prints_its_line(tmp_path: Path) -> None:
    """`autoparallel` installs mplan's hook, then joins the group (`init_distributed_from_env`),
    and torch wraps the hook in one that swaps sys.stderr for a buffer: the line goes to the real
    stderr (it was once swallowed: the job ended with status 2 and no message at all)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        from mplan.runtime.launch import init_distributed_from_env
        from mplan.ir.schedule import ScheduleError
        init_distributed_from_env()
        raise ScheduleError("schedule 'zigzag': unknown; use 1f1b, interleaved or zb-h1")
    """), encoding="utf-8")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = _environment(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_STATUS, done.stderr
    assert "Traceback" not in done.stderr
    assert _error_lines(done.stderr) == [
        "mplan: error: schedule 'zigzag': unknown; use 1f1b, interleaved or zb-h1 "
        f"(set {TRACEBACK_VARIABLE}=1 for the traceback)"], done.stderr


# -- the rules, in process ---------------------------------------------------------------------------
def test_an_unexpected_exception_keeps_its_traceback() -> None:
    def buggy() -> float:
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        run(buggy)
    assert run(lambda: 7) == 7


def test_what_counts_as_a_refusal() -> None:
    from mplan.models.spec import resolve_model
    from mplan.passes.verifier import LocalGraphMismatch
    from mplan.planner.plan import PlanError

    with pytest.raises(ValueError) as spec_error:
        resolve_model("gpt:bogus=1")  # mplan refuses a model spec with a plain ValueError
    with pytest.raises(ValueError) as library_error:
        int("not a number")  # raised here, in no mplan code: not mplan's refusal
    assert is_refusal(PlanError("x")) and is_refusal(spec_error.value)
    assert not is_refusal(library_error.value)
    assert not is_refusal(LocalGraphMismatch("mplan's own check failed"))  # a bug: traceback
    assert not is_refusal(ZeroDivisionError()) and not is_refusal(KeyboardInterrupt())


def test_only_rank_zero_prints_and_the_debug_variable_adds_the_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from mplan.planner.plan import PlanError

    try:
        raise PlanError("pp=3 does not divide 2 ranks: use pp=1 or pp=2")
    except PlanError as caught:
        error = caught
    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")
    assert report(error) == EXIT_STATUS
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    report(error, prog="mplan plan", hint=False)
    assert capsys.readouterr().err == "mplan plan: error: pp=3 does not divide 2 ranks: use pp=1 or pp=2\n"
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    report(error)
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "PlanError: pp=3" in err


def test_a_usage_error_prints_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="mplan")
    parser.add_argument("--global-batch", type=int, required=True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([])
        assert exit_.value.code == EXIT_STATUS
        assert ("mplan: error: the following arguments are required" in capsys.readouterr().err) == printed


def test_under_torchrun_another_rank_waits_for_the_agent_then_names_itself(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 refusing first must not end the job before rank 0 has printed (the agent stops every
    rank as soon as one fails); if the agent never stops it, its error was its own."""
    waited: list[float] = []
    monkeypatch.setattr(refusal.time, "sleep", waited.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    report(ValueError("only rank 1 has no data file"))
    assert waited == [refusal.RANK0_GRACE_S]
    assert capsys.readouterr().err == "mplan: error: on rank 1: only rank 1 has no data file\n"
