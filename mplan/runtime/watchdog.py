"""The hang watchdog: when a rank makes no progress inside a training step for `timeout_s`, every
rank says where it is and the job stops with one line naming the stuck ranks.

    mplan: hang in step 3: ranks [0] stuck: rank 0 went past pipeline action 9 (send F stage 0 mb 3
    to rank 1) that rank 1 waits on, and is now in pipeline action 14 (recv B stage 0 mb 3 from
    rank 1) for 2.1 s; rank 1 waits in pipeline action 12 (recv F stage 1 mb 3 from rank 0) for rank 0

Input: the `Position` a `ParallelModule` keeps (`pm.position`), the pipeline `Schedule` when the
plan has one, and the job's default c10d store. Output: `HangError` (its message is that line)
raised on every rank, or, where a rank's main thread cannot be reached, the line on stderr and
`os._exit(1)`. Start it with `pm.watch_for_hangs(timeout_s)` (`mplan.autoparallel(...,
hang_timeout_s=...)`, or the MPLAN_HANG_TIMEOUT_S variable); off by default.

Where a rank is (`Position`, written by the main thread, read by the monitor thread): the
executor writes each schedule action as it starts and each transfer before it waits for it; the
step writes its micro-batches, the stage copies' gradient sum, the optimizer step (which holds
the data-parallel gradient reduction) and the loss all-reduces, with the ranks each collective
spans. A write is a few attribute stores and a counter bump, no clock read and no system call:
the monitor times a position itself, by seeing the counter (`seq`) unchanged across its polls,
so "for 2.1 s" is right to `poll_s`.

When it fires: a rank whose position has not changed for `timeout_s` while inside `train_step`,
whether it waits or computes. Counting compute adds no false alarm in a synchronous job (a
compute that long makes its peers wait that long, and they would fire), and it catches the
collectives the position does not see, inside a tensor- or expert-parallel forward. Also when a
wait fails (a dead peer's closed connection: gloo raises at once) and when another rank fired.
Time outside `train_step` (the training loop's own code, checkpoint saves) fires nothing itself;
a rank there is reported as such when others wait for it.

Side channel: a clone of the job's default store (`_get_default_store().clone()`: its own
connection, used by the monitor thread alone), never the process group, which may be what is
stuck. It is the store the job already rendezvoused on, so it works wherever the group does:
under torchrun (the agent's TCPStore, which outlives its workers), and in tests whose harness
passes its own TCPStore to `init_process_group`; a store opened on MASTER_PORT + k would need a
free port and a host to serve it. Each monitor polls one key per `poll_s` (at most 1 s), as
ProcessGroupNCCL's heartbeat monitor polls its store for dump requests.

The exchange, under `mplan/watchdog/<n>/` (n: this watchdog's number on its rank, from a per-rank
counter in the store, so every rank's n-th watchdog shares a prefix and a later one in the same
job never reads an older one's keys): the first rank to fire sets `hang`; every monitor that
sees it publishes its `Report` (`report/<rank>`) and waits up to `grace_s` for all of them; a
rank whose report never comes is named dead. Each rank computes the summary (`summarize`) and
the first to store it (`compare_set`) sets the line every rank raises. The lowest reporting rank
prints the summary, every other rank its own position.

The summary (`summarize`) reads the reports against the schedule: a rank waiting on a transfer
from a peer that has gone past the matching action (found in the peer's action list) names the
peer (a send it skipped or lost); a peer that has not reached it is waited for; members of a
collective behind the waiter are waited for, members past it are named. The stuck ranks are the
dead, the named and those waited for that wait for nobody (a cycle of waits, or a collective
every member is in: all of them).

Stopping: `HangError` goes to the main thread at its next position write, or when its blocked
wait fails. A wait blocked inside gloo cannot be interrupted from Python: `ProcessGroupGloo`'s
`abort()` and `shutdown()` return at once and leave a blocked recv or all-reduce blocked until
the peer's connection closes (measured on torch 2.13, gloo). So a rank whose main thread has not
raised within `exit_s` prints that and leaves with `os._exit(1)`: the stuck ranks first, the
others `exit_s` later, so that the stuck ranks' closed connections fail the others' waits and
those raise `HangError` as a Python exception.

Under torchrun (checked on 2 CPU ranks with each fault of tests/test_watchdog.py): the first
rank to exit makes the agent stop the others (SIGTERM), which is why every rank prints its line
when the summary is agreed, before any exits. A worker that dies is reported by the agent itself
(it stops the survivors within its monitor interval, before their `grace_s` ends); the
watchdog's "dead" is for deaths no agent sees at once (another node's, a frozen process) and for
launchers without one. A `HangError` that escapes the script is printed once more by mplan's
refusal hook (`mplan: error: hang ...`).

Limits: on NCCL the host does not block in a transfer or a reduction (their waits only order the
device's stream), so positions are where the host waited (mostly the loss read-back); the device
side is NCCL's own watchdog and flight recorder. The optimizer step is one position (reduction,
clipping, update), and so is a micro-batch's forward and backward (tensor- and expert-parallel
collectives inside it are timed, not named). Inference, `full_state_dict` and checkpoints are not
watched. A store served by a rank that died (torchrun without its agent store) leaves each rank
only its own position. Every rank polls the store once per `poll_s` and, when one fires, reads
every rank's report: fine for hundreds of ranks; thousands would want a tree.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

import torch.distributed as dist

from mplan.ir.schedule import Action, Schedule
from mplan.runtime.process_groups import ProcessGroups

TIMEOUT_VARIABLE = "MPLAN_HANG_TIMEOUT_S"
"""Seconds without progress inside a step after which the job stops (unset or empty: off)."""

OUTSIDE = "outside train_step"
PHASES = ("step start", "micro-batch", "pipeline action", "stage copies' gradient sum", "optimizer step",
          "loss all-reduce")
"""Inside a step, in the order a step runs them: a position's progress compares by this order."""
COLLECTIVES = frozenset(PHASES[3:])

_TRANSFER_WORDS = {"SEND_F": ("send F", "to"), "RECV_F": ("recv F", "from"),
                   "SEND_B": ("send B", "to"), "RECV_B": ("recv B", "from")}
_MATCHING = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}
"""A transfer's other end: its kind and the stage it runs on, relative to this one."""


class HangError(RuntimeError):
    """The watchdog stopped the job: a rank made no progress for its timeout, or a peer died. The
    message is the one-line summary, the same on every rank; `reports` holds every rank's."""

    def __init__(self, summary: str, reports: Mapping[int, Report] | None = None) -> None:
        super().__init__(summary)
        self.summary, self.reports = summary, dict(reports or {})

    def __reduce__(self) -> tuple[type, tuple[str, dict[int, Report]]]:
        return HangError, (self.summary, self.reports)


@dataclass(slots=True, eq=False)
class Position:
    """Where this rank is: written by the main thread at every point a step may block, read by
    the monitor thread. Mutable on purpose (the one record rewritten in place, a few times per
    schedule action); a monitor reads a `Report` of it."""

    rank: int = 0
    pp_rank: int = 0
    collective_peers: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Global ranks each collective phase spans (its name, with the loss's axis: "loss all-reduce pp")."""
    step: int = 0  # steps finished before the current one (pm.step)
    seq: int = 0  # bumped at every write: the monitor's sign of progress
    inside: bool = False  # inside train_step
    phase: str = OUTSIDE
    index: int = 0  # the schedule action (pipeline), the micro-batch (flat) or the collective's number
    action: Action | None = None  # the schedule action running (None at the end of the list)
    wait: Action | None = None  # the transfer waited for, its action index and peer (global rank)
    wait_index: int = 0
    peer: int | None = None
    peers: tuple[int, ...] = ()  # the collective's ranks
    error: str | None = None  # what escaped the last step
    halt: HangError | None = None  # set by the monitor once it fired: raised at the next write
    raised: bool = False  # the main thread raised `halt` (the monitor need not end the process)
    on_error: weakref.WeakMethod | None = None  # Watchdog._stop_on_error, weakly (no cycle via pm)

    @classmethod
    def of(cls, groups: ProcessGroups, *, clipping: bool) -> Position:
        """A rank's position under its process groups: who each collective of the step waits for
        (the optimizer step: its data-parallel and tensor-parallel peers, and the pipeline's when
        clipping takes the global norm over it)."""
        dp, tp, pp = groups.ranks("dp"), groups.ranks("tp"), groups.ranks("pp")
        optimizer = tuple(sorted({*dp, *tp, *(pp if clipping else ())}))
        return cls(rank=groups.rank, pp_rank=groups.pp_rank,
                   collective_peers={"stage copies' gradient sum": pp, "optimizer step": optimizer,
                                     "loss all-reduce pp": pp, "loss all-reduce dp": dp})

    # -- the main thread's writes (the hot path: attribute stores only) -----------------------
    def stepping(self, step: int) -> Position:
        """`with position.stepping(pm.step):` around a step's body."""
        self.step = step
        return self

    def __enter__(self) -> Position:
        if self.halt is not None:
            self.raised = True
            raise self.halt
        self.inside, self.error, self.phase, self.index, self.action, self.wait, self.peers = (
            True, None, PHASES[0], 0, None, None, ())
        self.seq += 1
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        if error is None:
            self.inside, self.phase, self.step, self.wait = False, OUTSIDE, self.step + 1, None
            self.seq += 1
            return
        self.error = first_line(error)
        hang = self.halt
        if isinstance(error, HangError):
            hang = None
        elif hang is None and self.on_error is not None and self.communicating():
            stop = self.on_error()
            hang = stop(error) if stop is not None else None
        self.inside = False
        self.seq += 1
        if isinstance(error, HangError) or hang is not None:
            self.raised = True
        if hang is not None:
            raise hang from error

    def pipeline_action(self, index: int, action: Action | None) -> None:
        if self.halt is not None:
            self.raised = True
            raise self.halt
        self.phase, self.index, self.action, self.wait = PHASES[2], index, action, None
        self.seq += 1

    def transfer(self, index: int, action: Action, peer: int) -> None:
        """About to wait for the transfer of schedule action `index` with global rank `peer`."""
        self.wait, self.wait_index, self.peer = action, index, peer
        self.seq += 1

    def micro_batch(self, index: int) -> None:
        if self.halt is not None:
            self.raised = True
            raise self.halt
        self.phase, self.index = PHASES[1], index
        self.seq += 1

    def collective(self, phase: str, axis: str = "") -> None:
        """About to enter one of the step's collectives (`COLLECTIVES`; the loss's names its axis)."""
        if self.halt is not None:
            self.raised = True
            raise self.halt
        self.peers = self.collective_peers[f"{phase} {axis}" if axis else phase]
        self.phase, self.index, self.wait = phase, 1 if axis == "dp" else 0, None
        self.seq += 1

    def communicating(self) -> bool:
        return self.wait is not None or self.phase in COLLECTIVES


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """A rank's position as it published it (JSON through the store)."""

    rank: int
    pp_rank: int
    step: int
    inside: bool
    phase: str
    index: int
    action: str | None  # `Action` text ("0F3"), pipeline phase only
    wait: str | None  # the transfer waited for, as action text
    wait_index: int
    peer: int | None
    peers: tuple[int, ...]
    for_s: float  # seconds at this position (to the monitor's poll interval)
    error: str | None

    @classmethod
    def of(cls, p: Position, *, for_s: float) -> Report:
        return cls(rank=p.rank, pp_rank=p.pp_rank, step=p.step, inside=p.inside, phase=p.phase, index=p.index,
                   action=None if p.action is None else str(p.action), wait=None if p.wait is None else str(p.wait),
                   wait_index=p.wait_index, peer=p.peer, peers=p.peers, for_s=round(for_s, 2), error=p.error)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Report:
        data = json.loads(text)
        return cls(**{**data, "peers": tuple(data["peers"])})

    def progress(self) -> tuple[int, int, int, int]:
        """Orders positions along a step: earlier steps, then the phases in `PHASES` order."""
        if not self.inside:
            return (self.step, 0, 0, 0)
        return (self.step, 1, PHASES.index(self.phase), self.index)

    def waiting(self) -> bool:
        return self.inside and (self.wait is not None or self.phase in COLLECTIVES)

    def where(self) -> str:
        """'pipeline action 12 (recv F stage 1 mb 3 from rank 0)', 'the optimizer step with ranks [0, 1]'."""
        failed = f" (raised {self.error})" if self.error else ""
        if not self.inside:
            return f"outside train_step after step {self.step}{failed}"
        if self.phase == PHASES[2]:
            if self.wait is not None:
                return f"pipeline action {self.wait_index} ({action_words(Action.parse(self.wait), self.peer)}){failed}"
            if self.action is None:
                return f"the end of its pipeline schedule{failed}"
            return f"pipeline action {self.index} ({action_words(Action.parse(self.action), None)}){failed}"
        if self.phase == PHASES[1]:
            return f"forward/backward of micro-batch {self.index}{failed}"
        if self.phase in COLLECTIVES:
            return f"the {self.phase} with ranks {rank_list(self.peers)}{failed}"
        return f"the {self.phase}{failed}"


def first_line(error: BaseException) -> str:
    """'RuntimeError: Read error [127.0.0.1]:63380: Connection reset by peer': an error's type and
    the first sentence of its message, without the source location gloo starts it with."""
    text = str(error).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.splitlines()[0].split(". ")[0][:160] if text else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def action_words(action: Action, peer: int | None) -> str:
    """'send F stage 0 mb 3 to rank 2', 'B stage 1 mb 0'."""
    if action.kind in _TRANSFER_WORDS:
        words, direction = _TRANSFER_WORDS[action.kind]
        return f"{words} stage {action.stage} mb {action.microbatch} {direction} rank {peer}"
    return f"{action.kind} stage {action.stage} mb {action.microbatch}"


def matching_action(action: Action) -> Action:
    """A transfer's other end: SEND_F of stage s is RECV_F of stage s + 1, and so on."""
    kind, offset = _MATCHING[action.kind]
    return Action(kind=kind, stage=action.stage + offset, microbatch=action.microbatch)


# -- the summary ----------------------------------------------------------------------------------
def summarize(reports: Mapping[int, Report], *, world_size: int, schedule: Schedule | None,
              grace_s: float, max_clauses: int = 12) -> tuple[str, list[int]]:
    """The one-line summary (without the "mplan: " prefix) and the stuck ranks, from every rank's
    report (a missing one: a dead rank). See the module docstring for how ranks are named."""
    dead = [r for r in range(world_size) if r not in reports]
    waits: dict[int, set[int]] = {r: set() for r in reports}
    named: dict[int, str] = {}  # a rank that went past what another waits for -> why
    for r, report in reports.items():
        for peer, why in _waited_for(report, reports, schedule):
            waits[r].add(peer)
            if why is not None:
                named.setdefault(peer, why)
    targets = set().union(*waits.values()) if waits else set()
    idle = {m for m in targets if m in reports and not waits[m] and m not in named}
    stuck = set(dead) | set(named) | idle
    if not stuck:  # a cycle of waits, or one collective every member is in
        stuck = {r for r, w in waits.items() if w} or {r for r, rep in reports.items() if rep.waiting()}
    clauses = []
    for s in sorted(stuck):
        if s in dead:
            clauses.append(f"rank {s} dead (no report within {grace_s:.1f} s)")
        elif s in named:
            rep = reports[s]
            clauses.append(f"{named[s]}, and is now in {rep.where()} for {rep.for_s:.1f} s")
        else:
            rep = reports[s]
            verb = "waits in" if rep.waiting() else "in" if rep.inside else "is"
            clauses.append(f"rank {s} {verb} {rep.where()} for {rep.for_s:.1f} s")
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for r in sorted(set(reports) - stuck):
        rep = reports[r]
        groups.setdefault((f"{'waits in' if rep.waiting() else 'in' if rep.inside else 'is'} {rep.where()}",
                           tuple(sorted(waits[r]))), []).append(r)
    for (where, behind), ranks in groups.items():
        who = _ranks_words(ranks)
        verb = where if len(ranks) == 1 else where.replace("waits in", "wait in", 1)
        clauses.append(f"{who} {verb}" + (f" for {_ranks_words(behind)}" if behind else ""))
    if len(clauses) > max_clauses:
        shown = clauses[:max_clauses]
        shown.append(f"{len(clauses) - max_clauses} more groups of ranks not shown")
        clauses = shown
    steps = sorted({rep.step for rep in reports.values() if rep.inside})
    when = f" in step {steps[0]}" if len(steps) == 1 else ""
    head = f"hang{when}: {_ranks_words(stuck)} {'dead' if stuck <= set(dead) else 'stuck'}"
    return f"{head}: " + "; ".join(clauses), sorted(stuck)


def _waited_for(report: Report, reports: Mapping[int, Report],
                schedule: Schedule | None) -> list[tuple[int, str | None]]:
    """(rank, None) for each rank this one legitimately waits for; (rank, why) for a rank that went
    past the point this one waits at."""
    if not report.waiting():
        return []
    me = report.rank
    if report.wait is not None and report.peer is not None:
        peer = reports.get(report.peer)
        if peer is None or schedule is None:
            return [(report.peer, None)]
        other = matching_action(Action.parse(report.wait))
        actions = schedule.actions[peer.pp_rank]
        if other not in actions:
            return [(report.peer, None)]
        j = actions.index(other)
        if peer.progress() > (report.step, 1, PHASES.index(PHASES[2]), j):
            return [(report.peer, f"rank {report.peer} went past pipeline action {j} ({action_words(other, me)}) "
                                  f"that rank {me} waits on")]
        return [(report.peer, None)]
    out: list[tuple[int, str | None]] = []
    mine = report.progress()
    for m in report.peers:
        member = reports.get(m)
        if m == me:
            continue
        if member is None or member.progress() < mine:
            out.append((m, None))
        elif member.progress() > mine:
            out.append((m, f"rank {m} went past the {report.phase} of step {report.step} that rank {me} waits in"))
    return out


def _ranks_words(ranks: set[int] | tuple[int, ...] | list[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_list(ordered)}"


def rank_list(ranks: tuple[int, ...] | list[int]) -> str:
    """'[0, 1]', '[0-63]', '[0-3, 8-11]': runs of three or more consecutive ranks as ranges."""
    parts, ordered, i = [], sorted(ranks), 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts += [f"{ordered[i]}-{ordered[j]}"] if j - i >= 2 else [str(r) for r in ordered[i:j + 1]]
        i = j + 1
    return f"[{', '.join(parts)}]"


# -- the monitor ----------------------------------------------------------------------------------
def hang_timeout(value: float | None) -> float | None:
    """The timeout a caller asked for, else MPLAN_HANG_TIMEOUT_S, else None (off); refused unless
    a positive number of seconds."""
    where = "hang_timeout_s"
    if value is None:
        text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
        if not text:
            return None
        where = TIMEOUT_VARIABLE
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_VARIABLE} must be a number of seconds, got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where} must be a positive number of seconds (or None: no watchdog), got {value!r}")
    return float(value)


class Watchdog:
    """A monitor thread watching one rank's `Position` (see the module docstring). `close()` stops
    it; it also stops once its ParallelModule is gone."""

    def __init__(self, position: Position, *, timeout_s: float, store: dist.Store, world_size: int,
                 schedule: Schedule | None = None, poll_s: float | None = None, grace_s: float | None = None,
                 exit_s: float | None = None, stream: TextIO | None = None) -> None:
        self.position, self.timeout_s, self.world_size, self.schedule = position, timeout_s, world_size, schedule
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, timeout_s / 4))
        self.grace_s = grace_s if grace_s is not None else max(1.0, 4 * self.poll_s)
        """How long a rank that fired waits for the others' reports (they see `hang` within a poll)."""
        self.exit_s = exit_s if exit_s is not None else self.grace_s
        """How long after the summary a main thread may take to raise before its process exits."""
        self._stream = stream  # None: sys.stderr when printing (a test may redirect it)
        number = store.add(f"mplan/watchdog/made/{position.rank}", 1)
        self.store = dist.PrefixStore(f"mplan/watchdog/{number}", store)
        self.fired: HangError | None = None
        self._seen, self._since = -1, time.monotonic()
        self._failure: str | None = None  # set by the main thread when a wait failed
        self._answered = threading.Event()
        self._stop = threading.Event()
        position.on_error = weakref.WeakMethod(self._stop_on_error)
        self._thread = threading.Thread(target=_monitor, args=(weakref.ref(self), self._stop, self.poll_s),
                                        name=f"mplan-watchdog-{position.rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the thread ends within one poll)."""
        self._stop.set()
        if self.position.on_error is not None and self.position.on_error() == self._stop_on_error:
            self.position.on_error = None

    def _stop_on_error(self, error: BaseException) -> HangError | None:
        """The main thread's wait failed (a peer's connection closed): report now, and return the
        `HangError` to raise from it (None if the monitor is gone)."""
        if self.fired is None and self._thread.is_alive():
            self._failure = first_line(error)
            self._answered.wait(2 * self.poll_s + self.grace_s + 5.0)
        return self.fired

    def _check(self) -> bool:
        """One poll; True once it fired (the thread ends)."""
        now, position = time.monotonic(), self.position
        if position.seq != self._seen:
            self._seen, self._since = position.seq, now
        stalled = position.inside and now - self._since > self.timeout_s
        if self._failure is None and not stalled and not self._triggered():
            return False
        self._fire(now)
        return True

    def _triggered(self) -> bool:
        try:
            return self.store.check(["hang"])
        except dist.DistError:  # the store's server is gone: only this rank's own timeout is left
            return False

    def _fire(self, now: float) -> None:
        mine = Report.of(self.position, for_s=now - self._since)
        rank = mine.rank
        try:
            reports, summary, stuck = self._exchange(mine)
        except dist.DistError as error:
            reports = {rank: mine}
            summary = (f"hang: the job's store is unreachable ({str(error).splitlines()[0]}), so only this "
                       f"rank's position is known: rank {rank} {'waits in' if mine.waiting() else 'in'} "
                       f"{mine.where()} for {mine.for_s:.1f} s")
            stuck = [rank]
        printer = min(reports)
        line = summary if rank == printer else (
            f"hang: rank {rank} {'waits in' if mine.waiting() else 'in' if mine.inside else 'is'} {mine.where()} "
            f"for {mine.for_s:.1f} s (summary on rank {printer})")
        self._print(f"mplan: {line}")
        self.fired = self.position.halt = HangError(summary, reports)
        self._answered.set()
        # The job stops: the stuck ranks' processes first, so that their closed connections fail
        # the others' blocked waits, which then raise HangError in their own main threads.
        deadline = time.monotonic() + self.exit_s * (1 if rank in stuck else 2)
        while time.monotonic() < deadline:
            if self.position.raised:
                return
            time.sleep(0.02)
        self._print(f"mplan: hang: rank {rank} exits: its main thread is still in {mine.where()} after "
                    f"{self.exit_s:.1f} s (a call blocked outside Python, such as a process group's wait, "
                    f"cannot be interrupted)")
        os._exit(1)

    def _exchange(self, mine: Report) -> tuple[dict[int, Report], str, list[int]]:
        """Publish this rank's report, gather everyone's (up to `grace_s`), agree on one summary."""
        store, rank = self.store, mine.rank
        store.add("hang", 1)
        store.set(f"report/{rank}", mine.to_json())
        store.add("reported", 1)
        deadline = time.monotonic() + self.grace_s
        while store.add("reported", 0) < self.world_size and time.monotonic() < deadline:
            time.sleep(min(0.05, self.poll_s))
        present = [r for r in range(self.world_size) if r == rank or store.check([f"report/{r}"])]
        values = store.multi_get([f"report/{r}" for r in present])
        reports = {r: Report.from_json(v) for r, v in zip(present, values)}
        summary, stuck = summarize(reports, world_size=self.world_size, schedule=self.schedule, grace_s=self.grace_s)
        agreed = json.loads(store.compare_set("summary", "", json.dumps([summary, stuck])))
        return reports, agreed[0], agreed[1]

    def _print(self, line: str) -> None:
        stream = self._stream or sys.stderr
        print(line, file=stream, flush=True)


def _monitor(ref: weakref.ref[Watchdog], stop: threading.Event, poll_s: float) -> None:
    """The monitor thread: polls until it fired, was closed, or its watchdog is gone."""
    while not stop.wait(poll_s):
        dog = ref()
        if dog is None:
            return
        try:
            if dog._check():
                return
        except Exception as error:  # noqa: BLE001 - a broken monitor must say so once, not kill the job
            dog._print(f"mplan: hang watchdog on rank {dog.position.rank} stopped: {type(error).__name__}: {error}")
            return
        del dog


def watch(position: Position, timeout_s: float | None = None, *, schedule: Schedule | None = None,
          **options: float) -> Watchdog | None:
    """Start a `Watchdog` over `position` on this rank (`timeout_s` None: MPLAN_HANG_TIMEOUT_S, and
    unset is off); None when off or alone (one process has no peer to hang on). Call it on every
    rank alike. `options`: poll_s, grace_s, exit_s (defaults from the timeout)."""
    seconds = hang_timeout(timeout_s)
    if seconds is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    try:
        store = store.clone()  # a connection of its own, for the monitor thread
    except RuntimeError:  # a store without clone (FileStore): shared with the main thread, which rarely uses it
        pass
    return Watchdog(position, timeout_s=seconds, store=store, world_size=dist.get_world_size(), schedule=schedule,
                    **options)


__all__ = ["HangError", "Position", "Report", "TIMEOUT_VARIABLE", "Watchdog", "action_words", "hang_timeout",
           "matching_action", "summarize", "watch"]
