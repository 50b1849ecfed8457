"""The pipeline executor: one pipeline rank's action list, run through a table of handlers.

Input: the `Schedule` (`ir/schedule.py`: the one definition of every schedule, the same lists
the simulator times, `explain` draws and `check_schedule` dry-runs), this rank's index on the
pipeline axis, the `StageProgram`s it runs (`passes/split_stages.py`) with a function that gives
each stage's own inputs for a micro-batch, and the global ranks of its pipeline group.
Output: `run()` executes one training step's forwards and backwards: parameter gradients
accumulate in `.grad`; the last stage's losses are returned.

The executor has no schedule logic of its own: it walks the list and calls `HANDLERS[kind]`.
- F        run the stage on its inputs and on what RECV_F received (as leaves that require grad
           where the value is differentiable); the last stage's output is the micro-batch's loss,
           scaled by 1/num_micro_batches for backward as the one-process loop scales it.
- B        backward of that micro-batch through the stage: parameter gradients into `.grad`, and
           the gradients of its differentiable inputs kept for SEND_B.
- I, W     the same backward split in two (zero-bubble schedules, `split_backward.py`): I makes
           the input gradients only, W later the parameter gradients.
- SEND_F / RECV_F / SEND_B / RECV_B
           point-to-point transfers with the neighbouring stage's rank. Consecutive transfers of
           the list are posted together with `dist.batch_isend_irecv` (one NCCL group: a send
           and the receive paired with it in the opposite direction progress together, as
           Megatron batches send-forward-receive-backward); receives are waited for before the
           next compute action, sends only at the end of the step (the IR's execution model:
           a send is asynchronous, a receive blocks). NCCL answers a batch with one coalesced
           request, whose wait only orders the compute stream after the whole batch. Not yet run
           on NCCL here (no machine of several GPUs was lent). Shapes come from the stage cut, so a
           receive is posted before its data exists.
A micro-batch's state (its received inputs, outputs and the autograd graph they hold) lives
from its F to its B (or W), which is exactly the count of activations in flight the memory
model assumes (`ir.schedule.max_in_flight_per_stage`).

`executed` records each action as it starts when `record=True` (tests compare it with the IR's list).
`position` (`watchdog.Position`, the hang watchdog's record of where this rank is) gets each
action as it starts and each transfer before its wait: a few attribute writes per action.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mplan.ir.schedule import COMM_KINDS, Action, Schedule
from mplan.passes.split_stages import BoundaryValue, StageProgram
from mplan.runtime.split_backward import WeightGradients, backward_full, backward_input
from mplan.runtime.watchdog import Position

Feed = Callable[[int], list[torch.Tensor]]
"""Micro-batch index -> the stage's own inputs (parameters, buffers, constants, user inputs) in
the order of `StageProgram.inputs`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRunner:
    """A stage this rank runs, with where its inputs come from."""

    program: StageProgram
    feed: Feed
    params: tuple[torch.Tensor, ...]  # its trainable parameters (what W differentiates for)


@dataclass(slots=True)
class _MicroBatch:
    """One (stage, micro-batch) between its F and its B (or W)."""

    received: list[torch.Tensor] = field(default_factory=list)  # inputs from the previous stage
    outputs: tuple[torch.Tensor, ...] = ()  # sends, or the scaled loss on the last stage
    output_grads: list[torch.Tensor] = field(default_factory=list)  # from the next stage (RECV_B)
    input_grads: tuple[torch.Tensor | None, ...] = ()  # for the previous stage (SEND_B)
    weight: WeightGradients | None = None  # pending W after I
    backward_done: bool = False  # its B (or W) ran: the activations are gone
    sent_back: bool = False  # SEND_B ran (or there is no previous stage to send to)


class PipelineExecutor:
    """Executes `schedule.actions[pp_rank]` for one step (see the module docstring)."""

    def __init__(self, *, schedule: Schedule, pp_rank: int, stages: Mapping[int, StageRunner],
                 peers: Sequence[int], device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
                 record: bool = False, position: Position | None = None,
                 before_compute: Callable[[int], None] | None = None) -> None:
        self.schedule, self.pp_rank, self.stages, self.peers = schedule, pp_rank, stages, tuple(peers)
        self.device, self.autocast, self.record = device, autocast, record
        # called with the micro-batch before each F, B, I and W: state the stages' modules read
        # per micro-batch (packed documents' ids and layout) is set there, a recomputed forward
        # inside B included
        self.before_compute = before_compute
        self.position = position if position is not None else Position()
        self.last_stage = schedule.num_stages - 1
        mine = set(schedule.stages_of(pp_rank))
        if set(stages) != mine:
            raise ValueError(f"pipeline rank {pp_rank} runs stages {sorted(mine)}, got programs for {sorted(stages)}")
        # no GRAD_SYNC: mplan's runtime reduces gradients at the step, so its schedules carry none
        self.handlers: dict[str, Callable[[Action], object]] = {
            "F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight,
            "SEND_F": self._send_forward, "RECV_F": self._receive_forward,
            "SEND_B": self._send_backward, "RECV_B": self._receive_backward,
        }
        unknown = {a.kind for a in schedule.actions[pp_rank]} - self.handlers.keys()
        if unknown:
            raise ValueError(f"schedule {schedule.name}: no handler for action kinds {sorted(unknown)}")
        self.executed: list[Action] = []
        self._state: dict[tuple[int, int], _MicroBatch] = {}
        self._losses: list[torch.Tensor] = []
        self._ops: list[dist.P2POp] = []  # transfers posted by the current run of comm actions
        self._op_actions: list[tuple[int, Action]] = []  # the schedule action (and its index) of each
        self._receiving: list[Callable[[], None]] = []  # what to do with their received data
        # this step's send requests (or, coalesced, their tensors), kept to its end, with their
        # action, its index and the peer
        self._sends: list[tuple[object, int, Action, int]] = []

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> list[torch.Tensor]:
        """One step; the last stage's (unscaled, detached) losses, one per micro-batch."""
        self._losses = []
        actions, position = self.schedule.actions[self.pp_rank], self.position
        try:
            for index, action in enumerate(actions):
                position.pipeline_action(index, action)
                if action.kind not in COMM_KINDS:
                    self._post()
                if self.record:
                    self.executed.append(action)
                queued = len(self._ops)
                if self.before_compute is not None and action.kind not in COMM_KINDS:
                    self.before_compute(action.microbatch)
                self.handlers[action.kind](action)
                self._op_actions += [(index, action)] * (len(self._ops) - queued)
            position.pipeline_action(len(actions), None)
            self._post()
            for work, index, action, peer in self._sends:
                if not isinstance(work, torch.Tensor):
                    position.transfer(index, action, peer)
                    work.wait()  # type: ignore[attr-defined]
        finally:
            self._sends, self._state, self._ops, self._op_actions, self._receiving = [], {}, [], [], []
        return self._losses

    def _post(self) -> None:
        """Post the pending transfers as one batch and wait for its receives."""
        if not self._ops:
            return
        works = dist.batch_isend_irecv(self._ops)
        if len(works) == len(self._ops):  # a request per transfer (gloo): sends stay in flight
            for op, work, (index, action) in zip(self._ops, works, self._op_actions):
                if op.op is dist.isend:
                    self._sends.append((work, index, action, op.peer))
                else:
                    self.position.transfer(index, action, op.peer)
                    work.wait()
        else:  # one request for the coalesced batch (NCCL): waiting orders the compute stream after it
            self.position.transfer(*self._op_actions[0], self._ops[0].peer)
            for work in works:
                work.wait()
            # alive until the step ends
            self._sends += [(op.tensor, *at, op.peer) for op, at in zip(self._ops, self._op_actions) if op.op is dist.isend]
        for deliver in self._receiving:
            deliver()
        self._ops, self._op_actions, self._receiving = [], [], []

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        runner = self.stages[a.stage]
        state = self._state.setdefault((a.stage, a.microbatch), _MicroBatch())
        if a.stage > 0 and len(state.received) != len(runner.program.receives):
            raise RuntimeError(f"{a}: its inputs from stage {a.stage - 1} were not received (no RECV_F before it)")
        with self.autocast():
            out = runner.program.module(*runner.feed(a.microbatch), *state.received)
        if a.stage == self.last_stage:
            self._losses.append(out.detach())
            count = self.schedule.num_microbatches
            state.outputs = (out if count == 1 else out / count,)
        else:
            state.outputs = tuple(out)
            _check_sent(a, runner.program.sends, state.outputs)

    def _backward_args(self, a: Action) -> tuple[list[torch.Tensor], list[torch.Tensor | None], _MicroBatch]:
        state = self._state[(a.stage, a.microbatch)]
        if a.stage == self.last_stage:
            return list(state.outputs), [None], state
        sends = self.stages[a.stage].program.sends
        outputs = [o for o, v in zip(state.outputs, sends) if v.differentiable]
        if len(state.output_grads) != len(outputs):
            raise RuntimeError(f"{a}: the gradients from stage {a.stage + 1} were not received (no RECV_B before it)")
        return outputs, list(state.output_grads), state

    def _backward(self, a: Action) -> None:
        outputs, grads, state = self._backward_args(a)
        state.input_grads = backward_full(outputs, grads, state.received, self.stages[a.stage].params)
        self._release(a, state)

    def _backward_input(self, a: Action) -> None:
        outputs, grads, state = self._backward_args(a)
        state.input_grads, state.weight = backward_input(outputs, grads, state.received, self.stages[a.stage].params)

    def _backward_weight(self, a: Action) -> None:
        state = self._state[(a.stage, a.microbatch)]
        if state.weight is None:
            raise RuntimeError(f"{a}: no input-gradient pass (I) ran before it")
        state.weight.run()
        state.weight = None
        self._release(a, state)

    def _release(self, a: Action, state: _MicroBatch) -> None:
        """Drop the micro-batch's activations; the input gradients stay until SEND_B."""
        state.outputs, state.output_grads, state.received, state.backward_done = (), [], [], True
        self._forget(a, state)

    def _forget(self, a: Action, state: _MicroBatch) -> None:
        if state.backward_done and (state.sent_back or a.stage == 0):
            del self._state[(a.stage, a.microbatch)]

    # -- transfers -------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.peers[self.schedule.rank_of(stage)]

    def _send_forward(self, a: Action) -> None:
        state = self._state[(a.stage, a.microbatch)]
        peer = self._peer(a.stage + 1)
        self._ops += [dist.P2POp(dist.isend, t.detach().contiguous(), peer) for t in state.outputs]

    def _receive_forward(self, a: Action) -> None:
        values = self.stages[a.stage].program.receives
        buffers = [torch.empty(v.shape, dtype=v.dtype, device=self.device) for v in values]
        peer = self._peer(a.stage - 1)
        self._ops += [dist.P2POp(dist.irecv, b, peer) for b in buffers]

        def deliver() -> None:
            state = self._state.setdefault((a.stage, a.microbatch), _MicroBatch())
            state.received = [b.requires_grad_(v.differentiable) for b, v in zip(buffers, values)]
        self._receiving.append(deliver)

    def _send_backward(self, a: Action) -> None:
        state = self._state[(a.stage, a.microbatch)]
        values = self.stages[a.stage].program.receives
        peer = self._peer(a.stage - 1)
        for grad, value in zip(state.input_grads, values):
            if value.differentiable:
                data = grad if grad is not None else torch.zeros(value.shape, dtype=value.dtype, device=self.device)
                self._ops.append(dist.P2POp(dist.isend, data.detach().contiguous(), peer))
        state.input_grads, state.sent_back = (), True
        self._forget(a, state)

    def _receive_backward(self, a: Action) -> None:
        state = self._state[(a.stage, a.microbatch)]
        peer = self._peer(a.stage + 1)
        sent = [(o, v) for o, v in zip(state.outputs, self.stages[a.stage].program.sends) if v.differentiable]
        buffers = [torch.empty_like(o) for o, _ in sent]
        self._ops += [dist.P2POp(dist.irecv, b, peer) for b in buffers]

        def deliver() -> None:
            state.output_grads = buffers
        self._receiving.append(deliver)


def _check_sent(a: Action, values: Sequence[BoundaryValue], outputs: Sequence[torch.Tensor]) -> None:
    """What a stage returns is what its neighbour posted receives for (shape and dtype)."""
    for value, out in zip(values, outputs):
        if tuple(out.shape) != value.shape or out.dtype != value.dtype:
            raise RuntimeError(f"{a}: stage output {value.name} is {out.dtype}{list(out.shape)}, the stage cut "
                               f"expected {value.dtype}{list(value.shape)} (a dtype that autocast or dtype= changes "
                               f"cannot cross a pipeline border yet)")


__all__ = ["PipelineExecutor", "StageRunner"]
