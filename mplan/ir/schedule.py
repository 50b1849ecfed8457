"""Pipeline schedules as data: per-rank action lists, their builders and a static deadlock check.

Role: the one definition of a pipeline schedule. The simulator (cost_models/simulator.py) times it,
``explain`` draws it, the runtime executes it; nobody keeps a second copy.
Input: pipeline size ``pp``, number of microbatches ``m``, virtual stages per rank ``vpp``.
Output: a ``Schedule``: for each pipeline rank, an ordered tuple of ``Action``s.

Conventions (those of torch.distributed.pipelining's action lists):
  * Global stage ``s`` in ``0 .. pp*vpp - 1``; virtual stage (model chunk) ``v`` of rank ``r`` is
    global stage ``v*pp + r``, so stage ``s`` runs on rank ``s % pp``.
  * ``F``/``B``: forward/backward of one microbatch through one stage. ``SEND_F(s, i)`` sends stage
    ``s``'s output of microbatch ``i`` to stage ``s+1``, which takes it with ``RECV_F(s+1, i)``;
    ``SEND_B(s, i)`` sends the gradient of stage ``s``'s input to stage ``s-1`` (``RECV_B(s-1, i)``).
    Communication actions appear only where consecutive stages sit on different ranks.
  * ``GRAD_SYNC(s)``: data-parallel gradient synchronisation of stage ``s``, placed right after its
    last ``B`` (optional; the simulator overlaps it with the rank's remaining backward work).
  * Text form ``{stage}{kind}{microbatch}``, e.g. ``0F0 1SEND_F0 3B2 2GRAD_SYNC``.
Execution model the checker assumes: a SEND posts its message and returns (asynchronous, as
``isend``); a RECV blocks until the matching message is there; messages between one ordered pair of
ranks are matched strictly in order (as NCCL and gloo match point-to-point operations per peer).

Invariants checked by ``check_schedule``: every action runs on its stage's rank; every microbatch
has exactly one F and one B per stage; F of stage s follows F of stage s-1 for that microbatch,
B of s follows B of s+1 and F of s; sends follow the compute that produced them and are received
in order; grad sync follows the stage's last backward; and all ranks run to completion.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

COMPUTE_KINDS: tuple[str, ...] = ("F", "B")
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ACTION_KINDS: tuple[str, ...] = (*COMPUTE_KINDS, *COMM_KINDS, "GRAD_SYNC")
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")
"""The schedules by the names plan specs, Plans and this IR use alike."""


class ScheduleError(ValueError):
    """A schedule is malformed or would deadlock; the message names the rank and the action."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One step of one rank: a compute, a point-to-point transfer, or a gradient sync."""

    kind: str  # ACTION_KINDS
    stage: int  # global stage index
    microbatch: int | None = None  # None only for GRAD_SYNC

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {', '.join(ACTION_KINDS)}")
        if (self.microbatch is None) != (self.kind == "GRAD_SYNC"):
            raise ScheduleError(f"{self.kind} {'takes no' if self.kind == 'GRAD_SYNC' else 'needs a'} microbatch")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}" + ("" if self.microbatch is None else str(self.microbatch))

    @classmethod
    def parse(cls, text: str) -> Action:
        """The inverse of ``str``: ``"3SEND_F12"`` -> Action(kind="SEND_F", stage=3, microbatch=12)."""
        head = len(text) - len(text.lstrip("0123456789"))
        rest = text[head:]
        kind = rest.rstrip("0123456789")
        tail = rest[len(kind):]
        if head == 0 or kind not in ACTION_KINDS or (kind == "GRAD_SYNC") != (tail == ""):
            raise ScheduleError(f"cannot parse action {text!r}; expected e.g. 0F0, 1SEND_B3, 2GRAD_SYNC")
        return cls(kind=kind, stage=int(text[:head]), microbatch=int(tail) if tail else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Per-rank action lists of one pipeline schedule."""

    name: str
    pp: int  # pipeline ranks
    num_microbatches: int
    num_virtual: int  # virtual stages (model chunks) per rank, vpp
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order

    def __post_init__(self) -> None:
        if self.pp < 1 or self.num_microbatches < 1 or self.num_virtual < 1:
            raise ScheduleError(f"schedule {self.name}: pp, num_microbatches and num_virtual must be >= 1, "
                                f"got {self.pp}, {self.num_microbatches}, {self.num_virtual}")
        if len(self.actions) != self.pp:
            raise ScheduleError(f"schedule {self.name}: {len(self.actions)} action lists for pp={self.pp}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.num_virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(v * self.pp + rank for v in range(self.num_virtual))

    def render(self, *, comm: bool = False) -> str:
        """One line per rank, ``rank 0: 0F0 0F1 ...``; communication actions only with ``comm``."""
        width = len(str(self.pp - 1))
        return "\n".join(
            f"rank {rank:>{width}}: " + " ".join(str(a) for a in acts if comm or a.kind in COMPUTE_KINDS)
            for rank, acts in enumerate(self.actions))

    @classmethod
    def from_text(cls, *, name: str, pp: int, num_microbatches: int, num_virtual: int = 1,
                  lines: Sequence[str]) -> Schedule:
        """Parse per-rank lines as ``render(comm=True)`` writes them (the ``rank r:`` prefix is optional)."""
        return cls(name=name, pp=pp, num_microbatches=num_microbatches, num_virtual=num_virtual,
                   actions=tuple(tuple(Action.parse(tok) for tok in line.split(":")[-1].split()) for line in lines))


# -- builders ---------------------------------------------------------------------------------------
def _lower(name: str, pp: int, m: int, vpp: int, compute: Sequence[Sequence[tuple[str, int, int]]],
           grad_sync: bool) -> Schedule:
    """Add the sends and receives each compute needs (and grad syncs) around per-rank compute orders."""
    num_stages = pp * vpp
    ranks: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute):
        last_backward = {stage: i for i, (kind, stage, _) in enumerate(order) if kind == "B"}
        out: list[Action] = []
        for i, (kind, stage, mb) in enumerate(order):
            prev_remote = stage > 0 and (stage - 1) % pp != rank
            next_remote = stage < num_stages - 1 and (stage + 1) % pp != rank
            if kind == "F":
                out += [Action(kind="RECV_F", stage=stage, microbatch=mb)] if prev_remote else []
                out.append(Action(kind="F", stage=stage, microbatch=mb))
                out += [Action(kind="SEND_F", stage=stage, microbatch=mb)] if next_remote else []
            else:
                out += [Action(kind="RECV_B", stage=stage, microbatch=mb)] if next_remote else []
                out.append(Action(kind="B", stage=stage, microbatch=mb))
                out += [Action(kind="SEND_B", stage=stage, microbatch=mb)] if prev_remote else []
                if grad_sync and last_backward[stage] == i:
                    out.append(Action(kind="GRAD_SYNC", stage=stage))
        ranks.append(tuple(out))
    return Schedule(name=name, pp=pp, num_microbatches=m, num_virtual=vpp, actions=tuple(ranks))


def _check_sizes(pp: int, m: int, vpp: int = 1) -> None:
    if pp < 1 or m < 1 or vpp < 1:
        raise ScheduleError(f"pipeline schedules need pp >= 1, num_microbatches >= 1 and vpp >= 1, "
                            f"got pp={pp}, num_microbatches={m}, vpp={vpp}")


Compute = list[list[tuple[str, int, int]]]
"""Per rank, its compute actions in order as (kind, stage, microbatch): what a builder decides;
`_lower` adds the communication around them."""


def gpipe(pp: int, m: int, *, grad_sync: bool = False) -> Schedule:
    """GPipe: all forwards, then all backwards (in microbatch order, as torch's ScheduleGPipe)."""
    return _lower("gpipe", pp, m, 1, _gpipe_compute(pp, m), grad_sync)


def _gpipe_compute(pp: int, m: int) -> Compute:
    _check_sizes(pp, m)
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, m: int, *, grad_sync: bool = False) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule).

    Rank r runs ``warmup = min(pp - r - 1, m)`` forwards, then alternates one forward and one
    backward, then drains the remaining backwards: at most ``min(pp - r, m)`` microbatches in flight.
    """
    return _lower("1f1b", pp, m, 1, _one_f_one_b_compute(pp, m), grad_sync)


def _one_f_one_b_compute(pp: int, m: int) -> Compute:
    _check_sizes(pp, m)
    compute: Compute = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", r, i + warmup), ("B", r, i)]
        order += [("B", r, i) for i in range(m - warmup, m)]
        compute.append(order)
    return compute


def interleaved_warmup(pp: int, m: int, vpp: int, rank: int) -> int:
    """Forward steps rank ``rank`` runs before its first backward in Megatron's interleaved schedule.

    ``(pp - rank - 1) * 2 + (vpp - 1) * pp``, capped at the ``m * vpp`` total, and all of them when
    ``m == pp`` (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving).
    """
    total = m * vpp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def interleaved_1f1b(pp: int, m: int, vpp: int, *, grad_sync: bool = False) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds ``vpp`` model chunks (virtual stages).

    Virtual microbatch ``k`` (0 .. m*vpp-1) of a rank runs chunk ``(k mod pp*vpp) // pp`` forward
    (chunks in reverse for backward) on microbatch ``(k // (pp*vpp)) * pp + k mod pp``: groups of
    ``pp`` microbatches go through one chunk, then the next. Requires ``m % pp == 0``, as Megatron did
    when it introduced the schedule.
    """
    return _lower("interleaved", pp, m, vpp, _interleaved_compute(pp, m, vpp), grad_sync)


def _interleaved_compute(pp: int, m: int, vpp: int) -> Compute:
    _check_sizes(pp, m, vpp)
    if m % pp:
        raise ScheduleError(f"interleaved 1F1B needs the number of microbatches to be a multiple of the pipeline "
                            f"size (as Megatron requires): num_microbatches={m} % pp={pp} = {m % pp}")
    group = pp * vpp
    total = m * vpp

    def unit(kind: str, k: int, rank: int) -> tuple[str, int, int]:
        chunk = (k % group) // pp
        if kind == "B":
            chunk = vpp - 1 - chunk
        return (kind, chunk * pp + rank, (k // group) * pp + k % pp)

    compute: Compute = []
    for r in range(pp):
        warmup = interleaved_warmup(pp, m, vpp, r)
        order = [unit("F", k, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit("F", k + warmup, r), unit("B", k, r)]
        order += [unit("B", k, r) for k in range(total - warmup, total)]
        compute.append(order)
    return compute


def build_schedule(name: str, pp: int, m: int, vpp: int = 1, *, grad_sync: bool = False) -> Schedule:
    """A schedule by name: ``gpipe``, ``1f1b`` or ``interleaved`` (``vpp`` only for the last)."""
    return _lower(name, pp, m, vpp, _compute(name, pp, m, vpp), grad_sync)


def _compute(name: str, pp: int, m: int, vpp: int) -> Compute:
    if name == "gpipe" or name == "1f1b":
        if vpp != 1:
            raise ScheduleError(f"schedule {name!r} has one stage per rank; vpp={vpp} needs interleaved")
        return _gpipe_compute(pp, m) if name == "gpipe" else _one_f_one_b_compute(pp, m)
    if name == "interleaved":
        return _interleaved_compute(pp, m, vpp)
    raise ScheduleError(f"unknown schedule {name!r}; schedules: {', '.join(SCHEDULES)}")


def max_in_flight_by_rank(name: str, pp: int, m: int, vpp: int = 1) -> tuple[int, ...]:
    """`max_in_flight` of every rank of `build_schedule(name, pp, m, vpp)`, counted on the
    builders' compute orders (communication moves no activation in or out): the same numbers,
    without building the action lists, for a search that asks for hundreds of shapes."""
    return tuple(max(_running(order), default=0) for order in _compute(name, pp, m, vpp))


def _running(order: Sequence[tuple[str, int, int]]) -> Iterator[int]:
    live = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1
        yield live


# -- analysis ---------------------------------------------------------------------------------------
def in_flight_counts(actions: Iterable[Action], stage: int | None = None) -> list[int]:
    """Running count of (stage, microbatch) pairs whose F has run and B not, after each compute action."""
    live, counts = 0, []
    for action in actions:
        if action.kind in COMPUTE_KINDS and (stage is None or action.stage == stage):
            live += 1 if action.kind == "F" else -1
            counts.append(live)
    return counts


def max_in_flight(schedule: Schedule, rank: int) -> int:
    """Most microbatch activations a rank holds at once, counted in stage chunks.

    Each (chunk, microbatch) whose forward has run and backward not yet counts once; the memory model
    multiplies it by one chunk's activation bytes per microbatch. GPipe: m; 1F1B: min(pp - rank, m);
    interleaved: Megatron's warm-up + 1 (all ``m * vpp`` when m == pp).
    """
    return max(in_flight_counts(schedule.actions[rank]), default=0)


def max_in_flight_per_stage(schedule: Schedule) -> tuple[int, ...]:
    """For each global stage, the most microbatches whose forward through it has run and backward not."""
    return tuple(max(in_flight_counts(schedule.actions[schedule.rank_of(s)], s), default=0)
                 for s in range(schedule.num_stages))


def check_schedule(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` naming the rank and action where ``schedule`` is wrong or stalls."""
    _DryRun(schedule).run()


class _DryRun:
    """Executes all ranks' lists symbolically, advancing each rank until it blocks on a receive."""

    __slots__ = ("s", "pos", "channels", "forward_done", "backward_done", "received")

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.pos = [0] * schedule.pp
        self.channels: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
        self.forward_done: set[tuple[int, int]] = set()
        self.backward_done: set[tuple[int, int]] = set()
        self.received: set[tuple[str, int, int]] = set()

    def fail(self, rank: int, what: str) -> ScheduleError:
        action = self.s.actions[rank][self.pos[rank]]
        return ScheduleError(f"schedule {self.s.name}: rank {rank}, action #{self.pos[rank]} ({action}): {what}")

    def run(self) -> None:
        self._check_static()
        while True:
            progressed = False
            for rank in range(self.s.pp):
                while self.pos[rank] < len(self.s.actions[rank]) and self._step(rank):
                    self.pos[rank] += 1
                    progressed = True
            if all(self.pos[r] == len(self.s.actions[r]) for r in range(self.s.pp)):
                break
            if not progressed:
                stuck = [r for r in range(self.s.pp) if self.pos[r] < len(self.s.actions[r])]
                waits = "; ".join(f"rank {r} at action #{self.pos[r]} ({self.s.actions[r][self.pos[r]]}) "
                                  f"waits for rank {self._peer(self.s.actions[r][self.pos[r]])}" for r in stuck)
                raise ScheduleError(f"schedule {self.s.name}: deadlock: {waits}")
        for (src, dst), queue in self.channels.items():
            if queue:
                kind, stage, mb = queue[0]
                raise ScheduleError(f"schedule {self.s.name}: rank {src} sent {kind} for stage {stage} microbatch "
                                    f"{mb} to rank {dst}, which never receives it")

    def _check_static(self) -> None:
        s = self.s
        seen: dict[tuple[str, int, int], int] = {}
        for rank, acts in enumerate(s.actions):
            for index, a in enumerate(acts):
                where = f"schedule {s.name}: rank {rank}, action #{index} ({a})"
                if not 0 <= a.stage < s.num_stages:
                    raise ScheduleError(f"{where}: stage out of range 0..{s.num_stages - 1}")
                if s.rank_of(a.stage) != rank:
                    raise ScheduleError(f"{where}: stage {a.stage} belongs to rank {s.rank_of(a.stage)}")
                if a.microbatch is not None and not 0 <= a.microbatch < s.num_microbatches:
                    raise ScheduleError(f"{where}: microbatch out of range 0..{s.num_microbatches - 1}")
                if a.kind in COMPUTE_KINDS:
                    key = (a.kind, a.stage, a.microbatch or 0)
                    if key in seen:
                        raise ScheduleError(f"{where}: duplicate; {a} already ran as action #{seen[key]}")
                    seen[key] = index
        for stage in range(s.num_stages):
            for mb in range(s.num_microbatches):
                for kind in COMPUTE_KINDS:
                    if (kind, stage, mb) not in seen:
                        raise ScheduleError(f"schedule {s.name}: rank {s.rank_of(stage)} never runs "
                                            f"{Action(kind=kind, stage=stage, microbatch=mb)}")

    def _peer(self, a: Action) -> int:
        if a.kind in ("SEND_F", "RECV_B"):
            return self.s.rank_of(a.stage + 1)
        if a.kind in ("SEND_B", "RECV_F"):
            return self.s.rank_of(a.stage - 1)
        return self.s.rank_of(a.stage)

    def _step(self, rank: int) -> bool:
        """Execute the rank's next action; False if it must wait for a message."""
        a = self.s.actions[rank][self.pos[rank]]
        mb = a.microbatch if a.microbatch is not None else -1
        last = self.s.num_stages - 1
        if a.kind == "F":
            if a.stage > 0:
                self._needs_input(rank, a, ("F", a.stage, mb), (a.stage - 1, mb) in self.forward_done, "F")
            self.forward_done.add((a.stage, mb))
        elif a.kind == "B":
            if (a.stage, mb) not in self.forward_done:
                raise self.fail(rank, f"backward before the forward {a.stage}F{mb}")
            if a.stage < last:
                self._needs_input(rank, a, ("B", a.stage, mb), (a.stage + 1, mb) in self.backward_done, "B")
            self.backward_done.add((a.stage, mb))
        elif a.kind in ("SEND_F", "SEND_B"):
            forward = a.kind == "SEND_F"
            if (forward and a.stage == last) or (not forward and a.stage == 0):
                raise self.fail(rank, "no stage to send to")
            if (a.stage, mb) not in (self.forward_done if forward else self.backward_done):
                raise self.fail(rank, f"sends before computing {a.stage}{'F' if forward else 'B'}{mb}")
            dst_stage = a.stage + 1 if forward else a.stage - 1
            message = ("F" if forward else "B", dst_stage, mb)
            self.channels.setdefault((rank, self.s.rank_of(dst_stage)), deque()).append(message)
        elif a.kind in ("RECV_F", "RECV_B"):
            forward = a.kind == "RECV_F"
            if (forward and a.stage == 0) or (not forward and a.stage == last):
                raise self.fail(rank, "no stage to receive from")
            src = self.s.rank_of(a.stage - 1 if forward else a.stage + 1)
            queue = self.channels.get((src, rank))
            if not queue:
                return False
            expected = ("F" if forward else "B", a.stage, mb)
            if queue[0] != expected:
                kind, stage, got = queue[0]
                raise self.fail(rank, f"the next message from rank {src} is {'activations' if kind == 'F' else 'gradients'}"
                                      f" for stage {stage} microbatch {got}: sends and receives are out of order")
            queue.popleft()
            self.received.add(expected)
        else:  # GRAD_SYNC
            missing = [i for i in range(self.s.num_microbatches) if (a.stage, i) not in self.backward_done]
            if missing:
                raise self.fail(rank, f"gradient sync before the last backward of stage {a.stage} "
                                      f"(microbatch {missing[0]} not done)")
        return True

    def _needs_input(self, rank: int, a: Action, message: tuple[str, int, int], producer_done: bool,
                     kind: str) -> None:
        producer = a.stage - 1 if kind == "F" else a.stage + 1
        if self.s.rank_of(producer) == rank:
            if not producer_done:
                raise self.fail(rank, f"runs before {producer}{kind}{message[2]} on the same rank")
        elif message not in self.received:
            recv = "RECV_F" if kind == "F" else "RECV_B"
            raise self.fail(rank, f"no {a.stage}{recv}{message[2]} before it: its input from rank "
                                  f"{self.s.rank_of(producer)} never arrives")
