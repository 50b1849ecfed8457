"""A training step's forwards and backwards replayed as one CUDA graph: the host's share of a step
(Python, autograd, every kernel's launch) paid once, at capture, instead of every step.

    graph_refusal(plan, device, *, fp8=False) -> str | None   why a plan's steps cannot be graphed
    refuse_graphs(plan, device, *, fp8=False)                 the same, raised as one line
    StepGraph(leaves, warmup=WARMUP_STEPS, backend=CudaGraphs())
        .forward_backward(micro, run) -> run(micro)'s result, from a replay once captured
        .state() -> "replaying", "warming up", or "eager: <why>"

Why: on an H100 (2026-12-06, session 13, benchmarks/results/peers_h100-2026-12-06-session13-a.json)
a 12-layer Gemma-3's step through mplan ran 36 ms of GPU kernels in a 100 ms step: the rest was
the host launching ~940 kernels through Python (autograd Functions around Triton launches, 100-250
us of host time a fused norm call), and the steps varied by 4.1% where torch.compile's, 48 ms, varied
by 0.8%. torch.compile's mode="reduce-overhead" and Megatron's full-iteration CUDA graphs remove
the same cost the same way: record the kernels once, replay them.

What is captured: every micro-batch's forward and backward, from the loss's zeroed accumulator to
the last gradient, as one graph. The optimizer step, clipping and the loss's read-back stay eager
(a few launches): a scheduler's learning rate, the optimizer's host-side tables and `state_dict`
work unchanged.

How, per step (`forward_backward`):
  - the first `warmup` steps run eagerly: Triton's autotuning, cuBLAS's and cuDNN's plans and any
    lazily built state happen there, never inside a capture; the last of them is watched for
    host synchronizations (below);
  - the next step captures: its micro-batches are copied into static input tensors, `run` is
    recorded under `torch.cuda.graph`, then replayed once to compute this step. The gradients the
    capture left on `leaves` (the tensors the program differentiates: parameters, or their compute
    copies) are kept;
  - later steps copy their batch into the static inputs, give each leaf the gradient it had at
    the capture's end, and replay.
A replay rewrites exactly the memory the capture saw. A leaf whose gradient was None when the
capture began gets it *written* by its first backward in every replay (autograd stole the
capture's buffer rather than adding to one) and later micro-batches add to it; a leaf that had a
gradient buffer then (a bucket view, zeroed by the optimizer after each step) must hold the same
buffer at every replay, else the graph is dropped and steps run eagerly. No stale gradient is ever
added.

Falls back to eager, saying why once (`state`): a batch of other shapes than the captured one
(that step only); a capture that fails, never tried again. A step that synchronizes with the host
(`.item()`, `.tolist()`, a shape read from data, as capacity-limited MoE routing's counts are)
fails its capture without saying where, so the last warm-up step is watched under torch's sync
debug mode and the failure names those places (the caller's file:line outside torch). A sync seen
there does not by itself refuse the capture: the debug mode is a prototype (it misses some waits
and flags one-off ones), and the capture is the test that counts. `graph_refusal` names what is
refused up front: no CUDA device, a plan over several ranks (collectives inside the step), FP8
(its scaling history is kept by Python between steps), zero=2 (gradient hooks in the backward),
zero=3 (gathers between the forward's units) and outer loops.

A replay reads the parameters where the capture found them: updates in place (the optimizer,
`pm.load`) are seen; a parameter given new memory drops the graph (steps run eagerly, saying so)
rather than replay on the old.

Invariants: between steps, and after a failed one, the leaves' `.grad` are what the module's
eager step leaves (None, or zeroed buckets); the static inputs and the graph's memory pool live
as long as the module: one step's activations and gradients, which the eager step also holds at
its peak.
"""
from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from mplan.planner.plan import Plan

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's sync-debug warning; not "synchroniz" alone, which also matches the notice
`set_sync_debug_mode("warn")` itself gives that the mode is a prototype: on an H100 (2026-12-06)
that notice, read as a sync, had every family's step refused."""
WARMUP_STEPS = 2
"""Eager steps before the capture: the first autotunes and builds lazy state; the second runs
the way every later step will (gradients freed and re-made as between all steps)."""

MicroBatches = list[tuple[torch.Tensor, ...]]


def graph_refusal(plan: Plan | None, device: torch.device, *, fp8: bool = False) -> str | None:
    """Why this plan's training steps cannot be replayed as a CUDA graph, or None (`plan` None:
    what the device alone decides, before any capture)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this module runs on {device.type}"
    if plan is None:
        return None
    ranks = plan.cluster.world_size
    if ranks > 1:
        return (f"the plan {plan.spec()} spans {ranks} ranks, and a graphed step holds no collectives "
                "(gradient reductions, TP and pipeline transfers); graphs run plans of one rank")
    if fp8:
        return "FP8 linears keep their delayed-scaling history in Python between steps, which a replay skips"
    if plan.zero == 3:
        return "zero=3 gathers parameters between the forward's units"
    if plan.zero == 2:
        # replayed through the CPU stand-in, six steps at dp=1 drift from eager by 1e-7: not exact
        return "zero=2 reduce-scatters each gradient from a hook in the backward, which a replay does not run"
    if plan.outer_steps:
        return "an outer loop's steps run over sites"
    return None


def refuse_graphs(plan: Plan | None, device: torch.device, *, fp8: bool = False) -> None:
    """Raise ValueError with `graph_refusal`'s reason, where there is one: `cuda_graphs=True`'s
    one line, before the capture (`plan` None: the device alone) and when the module is built."""
    refusal = graph_refusal(plan, device, fp8=fp8)
    if refusal is not None:
        raise ValueError(f"cuda_graphs=True: {refusal}")


class GraphBackend(Protocol):
    def capture(self, record: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `record()`'s kernels; the replay callable and what `record` returned (whose
        memory every replay rewrites). Raises where the recording fails."""
        ...

    def synchronizing(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
        """`run()`, and where (file:line) it made the host wait for the device."""
        ...


class CudaGraphs:
    """`torch.cuda.CUDAGraph`, captured on a side stream of its own in a private memory pool. The
    watched warm-up step runs on that same stream, as torch's CUDA-graph notes ask: what is set
    up lazily per stream (cuBLAS's workspace, autograd's stream bookkeeping) then exists before
    the capture, which may not create it."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None

    def _side(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def capture(self, record: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph synchronizes and empties the cache first: the capture's pool then
        # reuses the eager steps' memory rather than reserving the step's activations twice
        with torch.cuda.graph(graph, stream=self._side()):
            out = record()
        return graph.replay, out

    def synchronizing(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
        """torch's sync debug mode warns at every synchronizing call (`.item()`, `nonzero`, a
        blocking copy): each warning's place names the Python line that made it."""
        side, main = self._side(), torch.cuda.current_stream()
        previous = torch.cuda.get_sync_debug_mode()
        places: list[str] = []

        def note(message: Warning | str, *_: object, **__: object) -> None:
            if SYNC_WARNING in str(message):  # called inside the warning: the stack is the sync's
                places.append(sync_place(traceback.extract_stack()[:-1]))

        side.wait_stream(main)
        with warnings.catch_warnings(), torch.cuda.stream(side):
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = run()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        main.wait_stream(side)  # the optimizer, on the main stream, reads the gradients made here
        return out, sorted(set(places))


def sync_place(stack: Sequence[traceback.FrameSummary]) -> str:
    """Where a synchronizing call came from, for a user to find: the innermost frame outside torch
    (the caller's file:line), with the torch function it went through. A C++ warning names only
    the innermost Python frame, which is torch's own wrapper (`torch.cuda.synchronize`, say)."""
    frames = [frame for frame in stack if frame.filename != warnings.__file__]  # the warning's own machinery
    outside = [i for i, frame in enumerate(frames) if not frame.filename.startswith(_TORCH_DIR)]
    if not outside:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    caller = frames[outside[-1]]
    torch_frames = frames[outside[-1] + 1:]
    via = (f" (in torch's {torch_frames[-1].name}, {os.path.relpath(torch_frames[-1].filename, _TORCH_DIR)}:"
           f"{torch_frames[-1].lineno})" if torch_frames else "")
    return f"{caller.filename}:{caller.lineno}{via}"


def _shapes(micro: MicroBatches) -> tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]:
    return tuple((tuple(t.shape), t.dtype, t.device) for one in micro for t in one)


class StepGraph:
    """One module's graphed forward and backward (module docstring)."""

    def __init__(self, leaves: Sequence[torch.Tensor], *, warmup: int = WARMUP_STEPS,
                 backend: GraphBackend | None = None) -> None:
        self.leaves = list(leaves)
        self.warmup = warmup
        self.backend: GraphBackend = backend if backend is not None else CudaGraphs()
        self.steps = 0
        self.refusal: str | None = None
        """Why steps run eagerly for good (a failed capture, buffers that moved); None: they need not."""
        self._replay: Callable[[], None] | None = None
        self._inputs: MicroBatches = []
        self._total: torch.Tensor | None = None
        self._shapes: tuple = ()
        self._grads: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # leaf, its gradient, had one before
        self._addresses: list[int] = []  # the leaves' memory the graph reads
        self._said_shapes = False
        self._synced: list[str] = []  # where the watched warm-up step made the host wait (file:line)

    def state(self) -> str:
        if self.refusal is not None:
            return f"eager: {self.refusal}"
        return "replaying" if self._replay is not None else "warming up"

    def forward_backward(self, micro: MicroBatches, run: Callable[[MicroBatches], torch.Tensor]) -> torch.Tensor:
        """`run(micro)` (every micro-batch's forward and backward; it returns the summed loss), from
        the graph once captured."""
        self.steps += 1
        if self.refusal is not None or self.steps < self.warmup:
            return run(micro)
        if self.steps == self.warmup:  # the last eager step: where it synchronizes, should the capture fail
            total, self._synced = self.backend.synchronizing(lambda: run(micro))
            return total
        if self._replay is None:
            return self._capture(micro, run)
        if _shapes(micro) != self._shapes:
            if not self._said_shapes:
                self._said_shapes = True
                warnings.warn(f"mplan: a step's batch has other shapes than the CUDA graph's ({_shapes(micro)} "
                              f"against {self._shapes}): such steps run eagerly", stacklevel=3)
            return run(micro)
        if [leaf.data_ptr() for leaf in self.leaves] != self._addresses:
            self._drop("parameters were given new memory since the capture (a replay would read the old)")
            return run(micro)
        moved = [leaf for leaf, grad, had in self._grads if had and (leaf.grad is None or
                                                                     leaf.grad.data_ptr() != grad.data_ptr())]
        if moved:
            self._drop(f"{len(moved)} gradient buffers moved since the capture")
            return run(micro)
        for static, one in zip(self._inputs, micro):
            for s, t in zip(static, one):
                s.copy_(t)
        for leaf, grad, had in self._grads:
            if not had:
                leaf.grad = grad
        self._replay()
        assert self._total is not None
        return self._total

    def _capture(self, micro: MicroBatches, run: Callable[[MicroBatches], torch.Tensor]) -> torch.Tensor:
        before = {id(leaf): leaf.grad for leaf in self.leaves}
        inputs = [tuple(t.clone() for t in one) for one in micro]
        try:
            replay, total = self.backend.capture(lambda: run(inputs))
        except Exception as error:  # noqa: BLE001 - whatever broke the recording, the step runs eagerly
            for leaf in self.leaves:  # a partial capture's gradients are graph memory, never the step's
                leaf.grad = before[id(leaf)]
            cause = (str(error).strip().splitlines() or [""])[0][:200]
            places = self._synced
            self._drop(f"the capture failed ({type(error).__name__}: {cause})" + (
                f"; the warm-up step synchronized with the host at {', '.join(places[:4])}"
                + (f" and {len(places) - 4} more places" if len(places) > 4 else "") if places else ""))
            return run(micro)
        self._grads = [(leaf, leaf.grad, before[id(leaf)] is not None) for leaf in self.leaves if leaf.grad is not None]
        self._replay, self._inputs, self._total, self._shapes = replay, inputs, total, _shapes(micro)
        self._addresses = [leaf.data_ptr() for leaf in self.leaves]
        replay()  # a capture records the kernels without running them: this step's own replay
        return total

    def _drop(self, why: str) -> None:
        self.refusal = why
        self._replay, self._inputs, self._total, self._grads = None, [], None, []
        warnings.warn(f"mplan: CUDA graphs off, steps run eagerly: {why} (autoparallel(cuda_graphs=False) does "
                      "not try them)", stacklevel=4)
