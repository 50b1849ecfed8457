"""Event-driven simulation of one training step of a pipeline schedule.

Role: turn a ``Schedule`` (mplan/ir/schedule.py) and per-stage costs into the step time, the bubble
and the timeline the planner ranks plans by and ``explain`` draws.
Input: ``simulate(schedule, costs)`` with ``PipelineCosts``: per global stage the forward and
backward seconds of one microbatch, the weight-gradient part of that backward (needed only by
schedules that split backward into I and W) and its data-parallel gradient-sync seconds; per stage
boundary the seconds to move one microbatch's activations (or their gradients) across it; the
optimizer step.
Output: ``SimResult``.

Model:
  * Each rank runs its actions in order on one compute stream. F and B take their stage's time;
    a split backward takes ``backward_s - weight_s`` for I and ``weight_s`` for W, so I + W = B.
  * A SEND is asynchronous: the rank goes on at once and the message arrives ``p2p_s[boundary]``
    later; a RECV waits for its message (the rank idles). Transfers do not contend.
  * Gradient sync of a stage starts at its GRAD_SYNC action, where the schedule has one (a runtime
    that reduces a chunk as soon as its last B or W is done), else when the rank's last compute
    ends: Megatron-LM's DDP of the SC'21 runs reduces every model chunk's gradients once the
    pipeline schedule has returned (`allreduce_gradients()` per chunk after `forward_backward_func`
    in `train_step`, megatron/training.py at 8cfef1b, April 2021), and mplan's runtime at the step.
    Syncs run on a separate communication stream of the rank, one at a time; a rank's sync hides
    behind what its own later compute and the other ranks' drain still take, and only the tail
    past the pipeline's end is exposed.
  * Step time = max over ranks of (end of compute and grad sync) + optimizer step.
  * Bubble fraction, as Megatron defines the pipeline bubble: on the critical (busiest) rank, idle
    compute time over the pipeline's total time (first action to the last compute of any rank):
    ``1 - busy / pipeline_time``; for uniform GPipe and 1F1B with free transfers it is exactly
    ``(p-1)/(m+p-1)``; ZB-H1 fills part of it with deferred W's. ``bubble_ratio`` is idle / busy,
    Megatron's ``(p-1)/m`` form (``(p-1)/(v m)`` for interleaving, Narayanan et al. SC'21 eq. 1-2).
Invariants: deterministic; the schedule is checked (``check_schedule``) first; per-stage peak
in-flight counts equal ``max_in_flight_per_stage``.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mplan.ir.schedule import COMPUTE_KINDS, IN_FLIGHT_STEP, Action, Schedule, check_schedule


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineCosts:
    """Seconds per microbatch per global stage, per stage boundary, and per step."""

    forward_s: tuple[float, ...]  # [stage]: one microbatch's forward
    backward_s: tuple[float, ...]  # [stage]: one microbatch's backward (B; I + W when split)
    p2p_s: tuple[float, ...]  # [boundary s -> s+1]: activations forward, gradients back (num_stages - 1)
    grad_sync_s: tuple[float, ...]  # [stage]: DP gradient synchronisation of the stage's parameters
    optimizer_s: float = 0.0  # optimizer step, after the last grad sync of the rank
    # [stage]: the weight-gradient part of backward_s (a W; I takes the rest). None: not known, and
    # then a schedule with I and W actions is refused rather than timed with a guessed split.
    weight_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        stages = len(self.forward_s)
        if len(self.backward_s) != stages or len(self.grad_sync_s) != stages or len(self.p2p_s) != max(stages - 1, 0) \
                or (self.weight_s is not None and len(self.weight_s) != stages):
            raise ValueError(f"PipelineCosts: forward_s, backward_s, grad_sync_s (and weight_s, if given) need one "
                             f"entry per stage and p2p_s one per boundary; got {len(self.forward_s)}, "
                             f"{len(self.backward_s)}, {len(self.grad_sync_s)}"
                             f"{'' if self.weight_s is None else f', {len(self.weight_s)}'} and {len(self.p2p_s)}")
        if min((*self.forward_s, *self.backward_s, *self.p2p_s, *self.grad_sync_s, *(self.weight_s or ()),
                self.optimizer_s)) < 0:
            raise ValueError("PipelineCosts: times must be >= 0")
        if self.weight_s is not None:
            over = [s for s, (w, b) in enumerate(zip(self.weight_s, self.backward_s)) if w > b]
            if over:
                raise ValueError(f"PipelineCosts: weight_s[{over[0]}] = {self.weight_s[over[0]]} s is more than the "
                                 f"whole backward_s[{over[0]}] = {self.backward_s[over[0]]} s it is part of")

    @classmethod
    def uniform(cls, num_stages: int, *, forward_s: float, backward_s: float, p2p_s: float = 0.0,
                grad_sync_s: float = 0.0, optimizer_s: float = 0.0, weight_s: float | None = None) -> PipelineCosts:
        return cls(forward_s=(forward_s,) * num_stages, backward_s=(backward_s,) * num_stages,
                   p2p_s=(p2p_s,) * (num_stages - 1), grad_sync_s=(grad_sync_s,) * num_stages,
                   optimizer_s=optimizer_s, weight_s=None if weight_s is None else (weight_s,) * num_stages)

    def duration(self, action: Action) -> float:
        """Seconds of one compute action (F, B, I or W) on the compute stream."""
        if action.kind == "F":
            return self.forward_s[action.stage]
        if action.kind == "B":
            return self.backward_s[action.stage]
        if self.weight_s is None:
            raise ValueError(f"PipelineCosts: action {action} splits backward into I and W, but weight_s (the "
                             f"weight-gradient seconds of each stage's backward) was not given")
        weight = self.weight_s[action.stage]
        return weight if action.kind == "W" else self.backward_s[action.stage] - weight


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    """One interval of a Gantt chart."""

    rank: int
    action: Action  # F, B, I, W or GRAD_SYNC (p2p transfers are not drawn: they run beside compute)
    start_s: float
    end_s: float
    stream: str  # "compute" or "comm"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStats:
    rank: int
    busy_s: float  # seconds of F, B, I and W
    idle_s: float  # pipeline_time_s - busy_s: bubble and waits on transfers
    compute_end_s: float  # end of the rank's last compute (F, B, I or W)
    grad_sync_s: float  # seconds of gradient sync issued (overlapped or not)
    grad_sync_end_s: float  # end of the rank's last grad sync (0 without)
    peak_in_flight: int  # most (chunk, microbatch) activations held at once


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    step_time_s: float  # one optimizer step over all microbatches
    pipeline_time_s: float  # first action to the last compute of any rank
    bubble_fraction: float  # idle / pipeline_time on the critical rank
    bubble_ratio: float  # idle / busy on the critical rank (Megatron's (p-1)/m form)
    critical_rank: int  # the busiest rank
    compute_s: float  # busy seconds of the critical rank
    comm_s: float  # seconds of p2p transfer and grad sync the critical rank issued, overlapped or not
    exposed_comm_s: float  # step_time - optimizer - pipeline_time: grad-sync tail nothing hides
    ranks: tuple[RankStats, ...]
    stage_peak_in_flight: tuple[int, ...]  # [global stage]
    timeline: tuple[TimelineEvent, ...]


def simulate(schedule: Schedule, costs: PipelineCosts, *, check: bool = True) -> SimResult:
    """Time one step of ``schedule`` under ``costs`` (see the module docstring for the model).
    ``check=False`` skips the deadlock check for a schedule the caller has already checked."""
    if check:
        check_schedule(schedule)
    if len(costs.forward_s) != schedule.num_stages:
        raise ValueError(f"costs cover {len(costs.forward_s)} stages, schedule {schedule.name} has "
                         f"{schedule.num_stages}")
    run = _Run(schedule, costs)
    run.execute()
    return run.result()


class _Run:
    __slots__ = ("s", "c", "clock", "pos", "arrivals", "timeline", "busy", "sent", "sync_at", "live", "peak_rank",
                 "peak_stage", "stages")

    def __init__(self, schedule: Schedule, costs: PipelineCosts) -> None:
        self.s, self.c = schedule, costs
        self.clock = [0.0] * schedule.pp
        self.pos = [0] * schedule.pp
        self.arrivals: dict[tuple[int, int], deque[float]] = {}  # (src, dst) -> arrival times, in send order
        self.timeline: list[TimelineEvent] = []
        self.busy = [0.0] * schedule.pp
        self.sent = [0.0] * schedule.pp  # p2p seconds issued per rank
        self.sync_at: dict[int, float] = {}  # stage -> time its GRAD_SYNC action was reached
        self.live = [0] * schedule.num_stages
        self.peak_rank = [0] * schedule.pp
        self.peak_stage = [0] * schedule.num_stages
        self.stages = tuple(schedule.stages_of(r) for r in range(schedule.pp))  # read at every compute action

    def execute(self) -> None:
        # check_schedule has shown every rank completes, so round-robin until all lists are done;
        # a rank's times depend only on its own order and on arrivals, not on this visiting order.
        while any(self.pos[r] < len(self.s.actions[r]) for r in range(self.s.pp)):
            for rank in range(self.s.pp):
                while self.pos[rank] < len(self.s.actions[rank]) and self._step(rank):
                    self.pos[rank] += 1

    def _step(self, rank: int) -> bool:
        a = self.s.actions[rank][self.pos[rank]]
        if a.kind in COMPUTE_KINDS:
            duration = self.c.duration(a)
            start = self.clock[rank]
            self.clock[rank] = start + duration
            self.busy[rank] += duration
            self.timeline.append(TimelineEvent(rank=rank, action=a, start_s=start, end_s=start + duration,
                                               stream="compute"))
            self.live[a.stage] += IN_FLIGHT_STEP[a.kind]
            self.peak_stage[a.stage] = max(self.peak_stage[a.stage], self.live[a.stage])
            on_rank = sum(self.live[s] for s in self.stages[rank])
            self.peak_rank[rank] = max(self.peak_rank[rank], on_rank)
        elif a.kind in ("SEND_F", "SEND_B"):
            boundary = a.stage if a.kind == "SEND_F" else a.stage - 1
            dst = self.s.rank_of(a.stage + 1 if a.kind == "SEND_F" else a.stage - 1)
            transfer = self.c.p2p_s[boundary]
            self.sent[rank] += transfer
            self.arrivals.setdefault((rank, dst), deque()).append(self.clock[rank] + transfer)
        elif a.kind in ("RECV_F", "RECV_B"):
            src = self.s.rank_of(a.stage - 1 if a.kind == "RECV_F" else a.stage + 1)
            queue = self.arrivals.get((src, rank))
            if not queue:
                return False
            self.clock[rank] = max(self.clock[rank], queue.popleft())
        else:  # GRAD_SYNC: marks where the sync is issued
            self.sync_at[a.stage] = self.clock[rank]
        return True

    def _grad_syncs(self, rank: int) -> tuple[float, float]:
        """Issue the rank's grad syncs on its comm stream; (seconds issued, end time)."""
        issued, free = 0.0, 0.0
        starts = sorted((self.sync_at.get(stage, self.clock[rank]), stage) for stage in self.stages[rank])
        for ready, stage in starts:
            duration = self.c.grad_sync_s[stage]
            if duration <= 0:
                continue
            start = max(ready, free)
            free = start + duration
            issued += duration
            self.timeline.append(TimelineEvent(rank=rank, action=Action(kind="GRAD_SYNC", stage=stage),
                                               start_s=start, end_s=free, stream="comm"))
        return issued, free

    def result(self) -> SimResult:
        pipeline_time = max(self.clock)
        stats = []
        for rank in range(self.s.pp):
            issued, sync_end = self._grad_syncs(rank)
            stats.append(RankStats(rank=rank, busy_s=self.busy[rank], idle_s=pipeline_time - self.busy[rank],
                                   compute_end_s=self.clock[rank], grad_sync_s=issued, grad_sync_end_s=sync_end,
                                   peak_in_flight=self.peak_rank[rank]))
        step = max(max(r.compute_end_s, r.grad_sync_end_s) for r in stats) + self.c.optimizer_s
        critical = max(range(self.s.pp), key=lambda r: (self.busy[r], -r))
        busy = self.busy[critical]
        idle = pipeline_time - busy
        self.timeline.sort(key=lambda e: (e.start_s, e.rank, e.stream))
        return SimResult(
            step_time_s=step, pipeline_time_s=pipeline_time,
            bubble_fraction=idle / pipeline_time if pipeline_time > 0 else 0.0,
            bubble_ratio=idle / busy if busy > 0 else 0.0, critical_rank=critical, compute_s=busy,
            comm_s=self.sent[critical] + stats[critical].grad_sync_s,
            exposed_comm_s=max(step - self.c.optimizer_s - pipeline_time, 0.0), ranks=tuple(stats),
            stage_peak_in_flight=tuple(self.peak_stage), timeline=tuple(self.timeline))


def uniform_bubble_fraction(pp: int, m: int, vpp: int = 1) -> float:
    """Megatron's closed form as idle / total: ``(p-1) / (v m + p - 1)`` (SC'21 eq. 1-2)."""
    return (pp - 1) / (vpp * m + pp - 1)


def critical_path_summary(result: SimResult, stage_names: Sequence[str] | None = None) -> str:
    """A one-line human summary for ``explain``."""
    names = stage_names or [str(s) for s in range(len(result.stage_peak_in_flight))]
    peaks = ", ".join(f"{n}:{p}" for n, p in zip(names, result.stage_peak_in_flight))
    return (f"step {result.step_time_s * 1e3:.2f} ms, pipeline {result.pipeline_time_s * 1e3:.2f} ms, "
            f"bubble {result.bubble_fraction:.1%} (rank {result.critical_rank}), exposed comm "
            f"{result.exposed_comm_s * 1e3:.2f} ms, peak in-flight per stage {peaks}")
