"""What a training run shows and writes as it goes: metrics JSONL, TensorBoard, a progress line
with an ETA, profiler traces, a CUDA memory snapshot, the loss curve.

Input: the config's `metrics` section, this rank, the step range, the Plan. Output, from rank 0
only (every rank's metrics are its own measurements, and the loss is the same on every rank):
- `metrics.jsonl`: one JSON object per step: `step` (steps done, the first is 1), `loss`, `lr`
  (the rate the step ran at) and `pm.last_metrics`'s fields (`step_time_s`, `tokens_per_s`,
  `model_tflops_per_s`, `mfu`, `peak_memory_gib`, the plan's predictions). A resumed run first
  drops the lines of steps after the checkpoint it resumed from, so the file reads as one run;
- `metrics.tensorboard`: the same rows as TensorBoard scalars, one tag per numeric JSONL field
  (`loss`, `lr`, `step_time_s`, ...) at the row's `step`; a resumed run's event file purges the
  steps after its checkpoint (`purge_step`), as the JSONL drops them. tensorboard is optional:
  imported only when the key is set, and `Observer.preflight` refuses in one line without it;
- a line on stderr every `train.log_every` steps (the first and last always) with the ETA;
- on GPUs, a warning when a step's measured time or memory parts from the plan's prediction by
  more than 15% (once per kind, after the first two steps, whose one-time work is not the plan's);
- `metrics.plot`: the loss curve as a PNG (matplotlib, Agg), from the JSONL at the end.
Profiler traces (`metrics.profile_steps = "a:b"`, steps a to b-1) are written by every rank, each
its own (`trace-rank<r>.json` beside the JSONL, or in the working directory).
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import torch

from mplan.train.config import ConfigError, TrainConfig

PREDICTION_GAP = 0.15
STEP_WINDOW = 100
"""Steps whose median `record` holds against the plan's predicted step time."""
"""Measured against predicted step time or memory: a warning beyond this relative gap."""


def _check_writable(key: str, path: str, is_dir: bool) -> None:
    """`path` (a directory when `is_dir`, else a file) can be made: no file stands where a directory
    must go, and the nearest existing directory above it takes new entries."""
    target = os.path.abspath(path)
    if os.path.exists(target) and os.path.isdir(target) != is_dir:
        raise ConfigError(f"{key}: {path} is a {'file' if is_dir else 'directory'}, not a "
                          f"{'directory' if is_dir else 'file'}")
    parent = target if is_dir else os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}: cannot create {path}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path}: {parent} is not writable")


class Observer:
    @staticmethod
    def preflight(config: TrainConfig) -> None:
        """What the run will need to write, checked before the minutes of building it."""
        m, c = config.metrics, config.checkpoint
        for key, path, is_dir in (("metrics.jsonl", m.jsonl, False), ("metrics.plot", m.plot, False),
                                  ("metrics.memory_snapshot", m.memory_snapshot, False),
                                  ("metrics.tensorboard", m.tensorboard, True), ("checkpoint.dir", c.dir, True),
                                  ("checkpoint.export_hf", c.export_hf, True)):
            if path:
                _check_writable(key, path, is_dir)
        if config.metrics.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError("metrics.tensorboard: tensorboard is not installed (pip install tensorboard), "
                                  "or leave the key out") from None

    def __init__(self, config: TrainConfig, *, rank: int, first_step: int, total_steps: int, stop: int,
                 plan: Any) -> None:
        self.config, self.rank, self.first, self.total, self.stop = config, rank, first_step, total_steps, stop
        m = config.metrics
        self.jsonl = m.jsonl if rank == 0 and m.jsonl else None
        self.started = time.perf_counter()
        self.warned: set[str] = set()
        self.step_times: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        """this job's latest measured step times, its first (capture, compilation) left out"""
        self.writer = None
        if m.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # `preflight` checked it is there

            # steps after first_step were run by a job that died before its next checkpoint: hidden,
            # or TensorBoard would draw them beside this run's redone steps
            self.writer = SummaryWriter(m.tensorboard, purge_step=first_step + 1)
        if self.jsonl:
            _keep_lines_up_to(self.jsonl, first_step)
        a, _, b = m.profile_steps.partition(":")
        self.profile = (int(a), int(b)) if m.profile_steps else None
        self.profiler: Any = None
        self.snapshot = m.memory_snapshot if torch.cuda.is_available() else ""
        if m.memory_snapshot and not torch.cuda.is_available() and rank == 0:
            print("mplan: metrics.memory_snapshot needs CUDA: no snapshot on this CPU run", file=sys.stderr)
        if self.snapshot:
            torch.cuda.memory._record_memory_history()
        if rank == 0:
            print(f"mplan: training {plan.spec()} from step {first_step} to {stop} of {total_steps}", file=sys.stderr)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Around step `index` (0-based, about to run): the profiler's start and stop."""
        if self.profile is not None and index == self.profile[0]:
            self.profiler = torch.profiler.profile(record_shapes=True)
            self.profiler.__enter__()
        yield
        if self.profiler is not None and index == self.profile[1] - 1:
            self.profiler.__exit__(None, None, None)
            folder = os.path.dirname(self.config.metrics.jsonl) if self.config.metrics.jsonl else "."
            self.profiler.export_chrome_trace(os.path.join(folder or ".", f"trace-rank{self.rank}.json"))
            self.profiler = None
        if self.snapshot and index == self.first:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = ""

    def record(self, pm: Any, loss: float, lr: float) -> None:
        if self.rank != 0:
            return
        m = pm.last_metrics
        row = {**m.to_dict(), "step": pm.step, "loss": loss, "lr": lr}
        if self.jsonl:
            with open(self.jsonl, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row, allow_nan=True) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, pm.step)
        done = pm.step - self.first
        if pm.step == self.first + 1 or pm.step % self.config.train.log_every == 0 or pm.step == self.stop:
            elapsed = time.perf_counter() - self.started
            eta = elapsed / done * (self.stop - pm.step) if done else 0.0  # this job's end
            figures = m.line().split(" | ", 1)[1]  # the meter counts this job's steps; the run's are pm.step
            print(f"step {pm.step}/{self.total} | {figures} | ETA {_duration(eta)}", file=sys.stderr, flush=True)
        if m.step_time_s is not None and done > 1:
            self.step_times.append(m.step_time_s)
        if done > 2 and self.step_times:
            # the median of the latest steps: one slow step (a background checkpoint's stall, a
            # compaction of the allocator) is not the cluster's figures being wrong; a window, so
            # that each step's check costs the same however long the job runs
            self._check_prediction(f"step time (the median of this job's last {STEP_WINDOW} steps)",
                                   statistics.median(self.step_times), m.predicted_step_time_s)
            self._check_prediction("memory", m.peak_memory_gib, m.predicted_memory_gib)

    def _check_prediction(self, what: str, measured: float | None, predicted: float | None) -> None:
        if measured is None or not predicted or what in self.warned:
            return
        gap = measured / predicted - 1
        if abs(gap) > PREDICTION_GAP:
            self.warned.add(what)
            print(f"mplan: warning: measured {what} {measured:.4g} is {gap:+.0%} off the plan's prediction "
                  f"{predicted:.4g} (more than {PREDICTION_GAP:.0%}): the cluster's figures may not be this "
                  f"machine's (`mplan profile` measures them)", file=sys.stderr)

    def finish(self) -> str | None:
        """Close the writers; the loss curve's PNG (rank 0, when asked), else None."""
        if self.writer is not None:
            self.writer.close()
        plot = self.config.metrics.plot
        if self.rank != 0 or not plot or not self.jsonl:
            return None
        rows = [json.loads(line) for line in open(self.jsonl, encoding="utf-8") if line.strip()]
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2)
        axis.set_xlabel("step")
        axis.set_ylabel("training loss")
        # a model spec is one long line of key=value pairs: wrapped, not cut off at the figure's edge
        title = os.path.basename(self.config.model.spec).replace(",", ", ")
        axis.set_title(textwrap.fill(title, 90, break_on_hyphens=False), fontsize=9)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(plot, dpi=120)
        plt.close(figure)
        return plot


def _keep_lines_up_to(path: str, step: int) -> None:
    """Drop the lines of steps after `step` (a resumed run rewrites what the checkpoint lost)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        kept = [line for line in handle if line.strip() and json.loads(line).get("step", math.inf) <= step]
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.writelines(kept)
    os.replace(path + ".tmp", path)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
