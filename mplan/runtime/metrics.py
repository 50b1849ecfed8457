"""Per-step training metrics: what a step took, against what its Plan predicted.

Input: each `ParallelModule.train_step` (its wall-clock time, its loss, the learning rate it ran
at), the Plan (its predictions and its mesh) and the training graph (the model FLOPs the planner
counts). Output: `pm.last_metrics`, a `StepMetrics` of the last step, and its one-line form for
logs (`str(metrics)` or `metrics.line()`):

    step 10 | loss 4.1234 | 812 ms (predicted 790 ms) | 10.1k tok/s | 3.2 TFLOP/s/dev | MFU 41.2% (predicted 45.0%) | peak 12.3 GiB (predicted 11.8) | lr 3.0e-04

What a step records costs nothing a user would notice: two `time.perf_counter()` calls and the
first parameter group's lr. No extra device synchronization: `train_step` already waits for the
device when it reads the loss back (`float`), which on CUDA orders after the optimizer's update
on the same stream. The rest (rates, MFU, peak memory) is computed only when `last_metrics` is
read.

The figures:
- tokens per step: the global batch (every data-parallel replica's rows) x the sequence length
  the model was captured at, which every step's input has; tokens/s is the whole job's, as the
  Plan's predicted `tokens_per_s` is.
- model TFLOP/s per device: the planner's model FLOPs (`Graph.training_flops`: forward + backward
  = 3 x forward, no recomputation, as Megatron counts them; the count behind the Plan's
  `tflops_per_gpu`) of the global batch, over the step time and the job's ranks.
- MFU: those FLOP/s over the peak of the device the Plan was made for (the bf16 dense peak, as
  the Plan's predicted MFU: peak = predicted tflops_per_gpu / predicted mfu). None on a CPU (a
  run on CPU, or a Plan made for the `cpu` cluster, whose peaks are nominal placeholders).
- peak memory: `torch.cuda.max_memory_allocated` of this rank's device, in GiB: the peak since
  the process started or since the user's last `torch.cuda.reset_peak_memory_stats()` (this
  module never resets it); None off CUDA. The Plan's `memory_gib` is its prediction.
- predicted: the Plan's step time, MFU and peak memory per GPU; None for a Plan made for the
  `cpu` cluster (gloo CPU ranks), whose device figures are nominal placeholders, not measured.
- lr: the first parameter group's learning rate during the step (a scheduler's `step()` after
  `train_step` sets the next step's).

Figures that are unknown are None, and the line leaves them out (never "MFU 0%").
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from mplan.cost_models.rates import flops_rate, percent
from mplan.ir.graph import Graph
from mplan.planner.plan import Plan


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """One training step of a `ParallelModule`, measured (on this rank) and as the Plan predicted it."""

    step: int  # steps this module has run, this one included (the first is 1)
    loss: float  # what train_step returned
    step_time_s: float  # wall clock of train_step on this rank
    tokens: int  # tokens of the global batch
    tokens_per_s: float  # tokens / step_time_s (the whole job's)
    model_tflops_per_s: float | None  # model FLOP/s per device / 1e12 (None: no FLOP count)
    mfu: float | None  # model_tflops_per_s over the Plan's device peak (None: CPU, or unknown peak)
    peak_memory_gib: float | None  # torch.cuda.max_memory_allocated (None: not CUDA)
    lr: float | None  # the first parameter group's learning rate during the step
    predicted_step_time_s: float | None = None  # the Plan's
    predicted_mfu: float | None = None  # the Plan's (None where mfu is None)
    predicted_memory_gib: float | None = None  # the Plan's peak per GPU (None where peak_memory_gib is None)

    def line(self) -> str:
        """The step in one log line; unknown figures are left out."""
        parts = [f"step {self.step}", f"loss {self.loss:.4f}",
                 _seconds(self.step_time_s) + (f" (predicted {_seconds(self.predicted_step_time_s)})"
                                               if _known(self.predicted_step_time_s) else ""),
                 f"{_count(self.tokens_per_s)} tok/s"]
        if _known(self.model_tflops_per_s):
            parts.append(f"{flops_rate(self.model_tflops_per_s * 1e12)}/dev")
        if _known(self.mfu):
            parts.append(f"MFU {percent(self.mfu)}" + (f" (predicted {percent(self.predicted_mfu)})"
                                                         if _known(self.predicted_mfu) else ""))
        if self.peak_memory_gib is not None:
            parts.append(f"peak {self.peak_memory_gib:.1f} GiB" + (f" (predicted {self.predicted_memory_gib:.1f})"
                                                                   if _known(self.predicted_memory_gib) else ""))
        if self.lr is not None:
            parts.append(f"lr {self.lr:.1e}")
        return " | ".join(parts)

    def __str__(self) -> str:
        return self.line()

    def to_dict(self) -> dict[str, Any]:
        """The fields by name (for a JSON log or a tracker such as wandb or TensorBoard)."""
        return dataclasses.asdict(self)


class StepMeter:
    """What `ParallelModule.train_step` records of each step, and the step's `StepMetrics` made
    from it when asked (`last`)."""

    def __init__(self, *, plan: Plan, graph: Graph, device: torch.device,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.plan, self.graph, self.device, self.optimizer = plan, graph, device, optimizer
        self.steps = 0
        self._start = 0.0
        self._lr: float | None = None
        self._last: tuple[int, float, float, float | None] | None = None  # step, loss, seconds, lr
        self._flops_per_sequence: float | None = None  # computed on first use

    def start(self) -> None:
        self._lr = _lr(self.optimizer)
        self._start = time.perf_counter()

    def stop(self, loss: float) -> None:
        seconds = time.perf_counter() - self._start
        self.steps += 1
        self._last = (self.steps, loss, seconds, self._lr)

    def last(self) -> StepMetrics | None:
        """The last step's metrics; None before the first step."""
        if self._last is None:
            return None
        step, loss, seconds, lr = self._last
        plan = self.plan
        # a Plan for the `cpu` cluster is priced with nominal placeholder figures: no forecast to show
        predicted = None if plan.cluster.device == "cpu" else plan.predicted
        mesh = plan.mesh
        # under cp the graph is one rank's slice of each sequence (S / cp tokens): every token is
        # counted once, on the rank that holds it; its FLOPs times cp count the attention of a
        # slice's queries against its own keys only (S^2 / cp of S^2 per sequence: a low MFU figure)
        tokens = plan.global_batch * (self.graph.seq_len or 1) * mesh.cp
        flops = self.flops_per_sequence() * plan.global_batch * mesh.cp
        ranks = mesh.dp * mesh.tp * mesh.pp * mesh.cp
        tflops = flops / seconds / ranks / 1e12 if flops > 0 and seconds > 0 else None
        peak = _peak_flops(plan, self.device)
        mfu = tflops * 1e12 / peak if tflops is not None and peak is not None else None
        memory = (torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None)
        return StepMetrics(step=step, loss=loss, step_time_s=seconds, tokens=tokens,
                           tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                           model_tflops_per_s=tflops, mfu=mfu, peak_memory_gib=memory, lr=lr,
                           predicted_step_time_s=_positive(predicted and predicted.step_time_s),
                           predicted_mfu=_positive(predicted and mfu is not None and predicted.mfu),
                           predicted_memory_gib=_positive(predicted and memory is not None and predicted.memory_gib))

    def flops_per_sequence(self) -> float:
        """The planner's model FLOPs (forward + backward) of one sequence (`search._facts`)."""
        if self._flops_per_sequence is None:
            self._flops_per_sequence = self.graph.training_flops / max(self.graph.batch_size, 1)
        return self._flops_per_sequence


def _peak_flops(plan: Plan, device: torch.device) -> float | None:
    """FLOP/s per device the Plan's MFU is against, from its own prediction; None on a CPU."""
    predicted = plan.predicted
    if device.type == "cpu" or plan.cluster.device == "cpu" or predicted.mfu <= 0 or predicted.tflops_per_gpu <= 0:
        return None
    return predicted.tflops_per_gpu * 1e12 / predicted.mfu


def _lr(optimizer: torch.optim.Optimizer | None) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    if not groups or "lr" not in groups[0]:
        return None
    return float(groups[0]["lr"])  # a tensor lr too


def _positive(value: float | bool | None) -> float | None:
    return float(value) if value and value > 0 else None


def _known(value: float | None) -> bool:
    return value is not None and value > 0


def _seconds(seconds: float) -> str:
    ms = seconds * 1e3
    if ms >= 10_000:
        return f"{seconds:.1f} s"
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _count(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


__all__ = ["StepMeter", "StepMetrics"]
