"""Refusals: how an error the user can act on ends a program, once per job, as one line.

What: `run(entry)` calls an entry point (the `mplan` command, `examples/train_cpu.py`'s main)
and turns a refusal, an exception mplan raises because the input cannot run (a bad spec, an
impossible plan, an unreadable or corrupt file, a model that cannot be captured), into

    mplan: error: <the exception's message, which names the cause and the fix>

on stderr, printed by rank 0 only (no RANK variable, or RANK=0), and exit status `EXIT_STATUS`
(2, as argparse's usage errors) without a Python traceback. `report` is the printing part, for
callers that return a status themselves (`mplan.cli.main`); `install_excepthook` does the same
for a user's own script that never calls `run` (`mplan.autoparallel` installs it under torchrun);
`ArgumentParser` for argparse's usage errors (the `mplan` command's parser).
`MPLAN_TRACEBACK=1` keeps the full traceback, printed by every rank, for debugging.
Any other exception (a bug: ZeroDivisionError, AttributeError, an error raised inside torch)
keeps Python's own report.

Why: the same refusal is raised on every rank of a torchrun job (each rank plans, captures and
checks alike, before any collective), and left alone it prints one traceback per rank, then
torchrun's report: 80 to 124 lines for one mistake.

What is a refusal (`is_refusal`): an exception of a type mplan defines (PlanError,
PlanSpecError, ScheduleError, CaptureError, ClusterSpecError, ...; not AssertionError
subclasses, which report mplan's own checks failing), or a ValueError / FileNotFoundError raised
by mplan's own code (model specs refuse with plain ValueError). The same types raised inside
torch or another library are not: those are bugs until shown otherwise.

Under torchrun (TORCHELASTIC_RUN_ID set) the first rank to fail makes the agent stop every other
rank at once (SIGTERM; with --max-restarts above 0 it restarts them, and the line repeats once
per attempt); if that were a rank other than 0, rank 0 would die before printing and the
job would end with no message at all. So a rank other than 0 that refuses waits up to
`RANK0_GRACE_S` for the agent to stop it, which it does as soon as rank 0 has printed and exited;
a rank still alive after that (its error was its own: rank 0 did not fail) prints its line with
its rank and exits. Without an agent (plain RANK variables, tests) other ranks exit at once,
silently.

torchrun's own report cannot be avoided: when any worker exits non-zero the agent raises
ChildFailedError out of `torch.distributed.run`'s main, and Python prints it with its traceback
(about 40 lines: its warning that it stops the other ranks, "examples/train_cpu.py FAILED",
each rank's exit code). Neither the exit code nor
an error file (TORCHELASTIC_ERROR_FILE, written by torch's `@record`) changes that: the file only
adds the worker's traceback to the report. Exiting 0 would hide the report, but a refused job
must fail. So under torchrun a refusal prints one line from mplan, then torchrun's report.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn, TextIO

EXIT_STATUS = 2
"""Exit status of a refused run: 2, as argparse's own usage errors and `mplan`'s commands."""

TRACEBACK_VARIABLE = "MPLAN_TRACEBACK"
"""Set to 1 to print the full traceback of a refusal (on every rank) instead of one line."""

RANK0_GRACE_S = 10.0
"""How long a rank other than 0 that refuses under torchrun waits for the agent to stop it (after
rank 0 has printed the same error), before it prints its own line: the lag between ranks reaching
a job-wide error is well under a second; a longer wait only delays a rank-local error's line."""

_PACKAGE = Path(__file__).resolve().parent


def keep_traceback() -> bool:
    """Whether `MPLAN_TRACEBACK=1` asks for the full traceback."""
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


def is_refusal(error: BaseException) -> bool:
    """An exception mplan raised for the user to act on (see the module docstring)."""
    if not isinstance(error, Exception) or isinstance(error, AssertionError):
        return False
    if any(k.__module__.split(".")[0] == "mplan" for k in type(error).__mro__):
        return True
    return isinstance(error, (ValueError, FileNotFoundError)) and _raised_in_mplan(error)


def _raised_in_mplan(error: BaseException) -> bool:
    """Whether the innermost frame of `error`'s traceback is mplan's code (a `raise` there, or a
    builtin such as `open` called there), not torch's or another library's."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


def rank() -> int:
    """This process's rank in the job: torchrun's RANK variable, 0 when there is none."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report(error: BaseException, *, prog: str = "mplan", hint: bool = True, stream: TextIO | None = None) -> int:
    """Print `error` as a refusal and return `EXIT_STATUS` (for callers that exit themselves).

    Rank 0 prints `{prog}: error: {error}` (with `hint`, how to see the traceback); other ranks
    print nothing, and under torchrun first wait for the agent to stop them (module docstring).
    With `MPLAN_TRACEBACK=1` every rank prints the traceback, then the line. `stream`: where to
    print (default sys.stderr; an excepthook passes the process's real stderr, since torch's
    own hook swaps sys.stderr for a buffer around the hooks it wraps)."""
    out = stream or sys.stderr
    line = f"{prog}: error: {_message(error)}"
    if hint:
        line += f" (set {TRACEBACK_VARIABLE}=1 for the traceback)"
    if keep_traceback():
        out.write("".join(traceback.format_exception(error)))
        out.write(f"{prog}: error: {_message(error)}\n")
    elif rank() == 0:
        out.write(line + "\n")
    elif not _defer_to_rank_zero(out):
        out.write(f"{prog}: error: on rank {rank()}: {_message(error)}\n")
    _flush(out)
    return EXIT_STATUS


def _defer_to_rank_zero(out: TextIO) -> bool:
    """For a refusing rank other than 0: True when it should print nothing, since rank 0 reports
    (no torchrun agent: exit at once); under torchrun it first waits `RANK0_GRACE_S` for the agent
    to stop it (rank 0 failed too), and False when it outlived the wait (its error is its own)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    _flush(out)
    time.sleep(RANK0_GRACE_S)
    return False


def _message(error: BaseException) -> str:
    """The exception's message as one line (the lines of a multi-line message joined)."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and len(error.args) == 1:
        text = str(error.args[0])  # str(KeyError('x')) is "'x'"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _flush(out: TextIO) -> None:
    for stream in (sys.stdout, out):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run(entry: Callable[..., Any], *args: Any, prog: str = "mplan", **kwargs: Any) -> Any:
    """`entry(*args, **kwargs)`, its result returned; a refusal it raises is reported (`report`)
    and ends the process with `EXIT_STATUS`, without a traceback; anything else propagates.
    Use: `if __name__ == "__main__": run(main)`."""
    try:
        return entry(*args, **kwargs)
    except Exception as error:
        if not is_refusal(error):
            raise
        status = report(error, prog=prog)
    exit_now(status)


def exit_now(status: int) -> NoReturn:
    """End the process with `status` after the exit handlers, skipping the interpreter's teardown
    (which would destroy a live process group's objects and could add warnings of its own)."""
    import atexit

    _flush(sys.stderr)
    try:
        atexit._run_exitfuncs()
    finally:
        _flush(sys.stderr)
        os._exit(status)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (usage line, then `prog: error: ...`, status 2) only
    rank 0 prints: a command line refused under torchrun is refused by every rank alike."""

    def error(self, message: str) -> NoReturn:
        if rank() != 0 and not keep_traceback() and _defer_to_rank_zero(sys.stderr):
            self.exit(EXIT_STATUS)
        super().error(message)


def install_excepthook() -> None:
    """Report a refusal that reaches the top of the script (`report`, on the real stderr) and
    exit with `EXIT_STATUS`; other exceptions go to the previous hook. Idempotent; does nothing
    with `MPLAN_TRACEBACK=1` (Python's own report then)."""
    if keep_traceback() or getattr(sys.excepthook, "mplan", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if not is_refusal(error):
            previous(kind, error, trace)
            return
        exit_now(report(error, stream=sys.__stderr__ or sys.stderr))

    hook.mplan = True  # type: ignore[attr-defined]
    sys.excepthook = hook
