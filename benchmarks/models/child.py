"""A system in a process of its own, driven over a pipe: the parent's `PipeChild` and the child's
`answer_commands`.

Liger Kernel patches transformers' modules globally, so the `hf-models` and `peers` cases run it
in a child process (each case's command with `--system liger`), which builds the same seed-0 model,
waits for one command a line on stdin (`warmup`, `run K`, `steady S K`, `profile K`, `quit`) and answers each
with one JSON line.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.models.kernel_profile import profile_steps
from benchmarks.models.timing import Running, steady_block, timed_rounds
from benchmarks.models.workloads import Setting

CHILD_TIMEOUT_S = {"warmup": 400.0, "run": 180.0, "steady": 300.0, "profile": 180.0, "quit": 60.0}


class PipeChild:
    """A system in its own process (the module docstring says why), driven over a pipe: one
    command a line in (`warmup`, `run K`, `steady S K`, `profile K`, `quit`), one JSON line out; `command`
    starts it (the `hf-models` or the `peers` case in its child mode)."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.error: str | None = None

    def ask(self, command: str) -> dict[str, Any]:
        """Sends `command`; its answer, or {"error": ...} when the child fails, dies or times out."""
        if self.error is not None:
            return {"error": self.error}
        timeout = CHILD_TIMEOUT_S[command.split()[0]]
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.kill()
            self.error = (f"liger child: no answer to {command!r} within {timeout:.0f} s" if self.proc.poll() is None
                          else f"liger child exited with code {self.proc.wait()} (its traceback is in the log)")
            self.proc.wait()
            return {"error": self.error}
        answer = json.loads(line)
        if "error" in answer:
            self.error = answer["error"]
        return answer

    def close(self) -> None:
        if self.proc.poll() is None and self.error is None:
            self.ask("quit")
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def answer_commands(answers: Any, setting: Setting, warm: Callable[[], Running | dict[str, Any]],
                    weights: Callable[[], str]) -> None:
    """A child's side of `PipeChild`'s protocol, until `quit`: `warmup` (`warm()`: the system
    built and warmed up, the row carrying `weights()`, its initial weights' fingerprint), `run N`
    (N timed steps), `steady S N` (S untimed steps, then N timed: `timing.steady_block`), `profile N`;
    one JSON line to `answers` per command, an error as its row. Between answers the device's
    cached blocks are released for the parent's systems' turn."""
    running: Running | None = None
    while line := sys.stdin.readline():
        command, *rest = line.split()
        try:
            if command == "warmup":
                result = warm()
                if isinstance(result, Running):
                    running = result
                    result.row["weights_fingerprint"] = weights()
                answer = result.row if isinstance(result, Running) else result
            elif command == "run":
                assert running is not None, "run before a successful warmup"
                timed_rounds({"child": running}, setting, 1, int(rest[0]))
                answer = running.row
            elif command == "steady":
                assert running is not None, "steady before a successful warmup"
                steady_block(running, setting, int(rest[0]), int(rest[1]))
                answer = running.row
            elif command == "profile":
                assert running is not None, "profile before a successful warmup"
                answer = profile_steps(running.step, int(rest[0]), setting.device)
            else:
                answer = {}
        except Exception:  # noqa: BLE001 - the parent records it as the system's error
            answer = {"error": traceback.format_exc()}
        if setting.device.type == "cuda":
            torch.cuda.empty_cache()  # the parent's systems take the next turn
        answers.write(json.dumps(answer) + "\n")
        if command == "quit":
            break
