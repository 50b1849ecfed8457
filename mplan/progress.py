"""A word while mplan works: each phase of a long call (capture, search, lowering, first step)
shown as it runs and timed when it ends.

What: `Progress` is handed down the call (`mplan plan`, `mplan bench`, `mplan.plan`,
`mplan.autoparallel`); each stage wraps its work in `with progress.phase("capture", "llama3-8b"):`
and may pass finer news (`progress("solving the sharding ILP for tp=8")`). How it shows depends
on where stderr goes, the `mode`:

    bar     a terminal: a live line (spinner, phase, news, seconds so far); each phase leaves
            one line behind when it ends:   mplan: capture 2.31 s (llama3-8b)
    lines   a log, a pipe, CI, torchrun's captured output: only those lines, one per phase as it
            ends (news would flood a log; a terminal's live line is the place for it)
    quiet   nothing (`-q`, `progress="quiet"`, or MPLAN_PROGRESS=quiet)

`auto` picks bar or lines from `isatty()`; the environment variable MPLAN_PROGRESS overrides
auto (bar, lines or quiet), so a job script can silence or force it without code. Only rank 0
of a torchrun job speaks (RANK unset or 0): every rank runs the same phases, and eight copies of
each line say nothing more. Nothing goes to stdout, which `--json` keeps for its document.

Why a module of its own: the planner, the API and the runtime all report phases, and the
runtime must not import the planner; like `refusal`, this is a leaf every layer may use.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterator, TextIO

MODES = ("auto", "bar", "lines", "quiet")
ENV_VARIABLE = "MPLAN_PROGRESS"
"""bar, lines or quiet: overrides `auto` (a mode given explicitly in code or by `-q` wins)."""


@dataclasses.dataclass(slots=True)
class Phase:
    """A running phase: what its closing line says after the time."""

    detail: str


class Progress:
    """Phases of one long call, reported on stderr by rank 0 (see the module docstring)."""

    def __init__(self, mode: str = "auto", *, stream: TextIO | None = None,
                 forward: Callable[[str], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"progress must be one of {', '.join(MODES)}; got {mode!r}")
        self.stream = stream if stream is not None else sys.stderr
        self.mode = _resolve(mode, self.stream)
        self.forward = forward  # a caller's own callback also hears every phase and piece of news
        self.phases: list[tuple[str, float]] = []  # (phase, seconds) in the order they ended
        self._status: Any = None
        self._current = ""

    @classmethod
    def of(cls, progress: "Progress | Callable[[str], None] | str | None") -> "Progress":
        """A Progress from what a public function was given: itself, a mode name, None (auto), or
        a plain callback (`progress=print`), which hears each phase and piece of news as text."""
        if isinstance(progress, Progress):
            return progress
        if progress is None or isinstance(progress, str):
            return cls(progress or "auto")
        return cls("quiet", forward=progress)

    def __call__(self, news: str) -> None:
        """Finer news inside the running phase: the live line only (and a caller's callback)."""
        if self.forward is not None:
            self.forward(news)
        if self._status is not None:
            self._status.update(self._line(news))

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = "") -> Iterator[Phase]:
        """Time `name`; on a terminal show it live; when it ends (not when it raises: the error
        is the one line then) leave `mplan: name 1.23 s (detail)` behind. The phase yielded can
        take a new detail once its outcome is known (`phase.detail = "tp=2,pp=2"`)."""
        if self.forward is not None:
            self.forward(f"{name}{f' {detail}' if detail else ''}")
        outer, self._current = self._current, name + (f" ({detail})" if detail else "")
        running = Phase(detail)
        owns_line = self.mode == "bar" and self._status is None  # a phase inside another shares its line
        if owns_line:
            from rich.console import Console

            self._status = Console(file=self.stream).status(self._line(""), spinner="dots")
            self._status.start()
        elif self._status is not None:
            self._status.update(self._line(""))
        start = time.perf_counter()
        try:
            yield running
        finally:
            self._current = outer
            if owns_line and self._status is not None:
                self._status.stop()
                self._status = None
        seconds = time.perf_counter() - start
        self.phases.append((name, seconds))
        self.say(f"{name} {seconds:.2f} s" + (f" ({running.detail})" if running.detail else ""))

    def say(self, line: str) -> None:
        """One line that stays (bar and lines modes), prefixed `mplan: `."""
        if self.mode in ("bar", "lines"):
            print(f"mplan: {line}", file=self.stream, flush=True)

    def _line(self, news: str) -> str:
        return f"{self._current}{f': {news}' if news else ''}"


def _resolve(mode: str, stream: TextIO) -> str:
    if os.environ.get("RANK", "0") != "0":
        return "quiet"
    if mode == "auto":
        mode = os.environ.get(ENV_VARIABLE, "auto")
        if mode not in MODES:
            raise ValueError(f"{ENV_VARIABLE} must be one of bar, lines, quiet; got {mode!r}")
    if mode == "auto":
        isatty = getattr(stream, "isatty", None)
        return "bar" if callable(isatty) and isatty() else "lines"
    return mode
