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
  * ``I``/``W``: a backward split in two, as zero-bubble schedules run it (Qi et al., "Zero Bubble
    Pipeline Parallelism", arXiv 2401.10241): ``I`` computes the gradient of the stage's input (what
    stage ``s-1`` waits for: it takes ``B``'s place between ``RECV_B`` and ``SEND_B``), ``W`` the
    gradient of the stage's weights (no communication, nobody waits for it). A (stage, microbatch)
    has either one ``B``, or one ``I`` and one later ``W`` on the same rank.
  * ``GRAD_SYNC(s)``: data-parallel gradient synchronisation of stage ``s``, placed right after its
    last weight gradient, ``B`` or ``W`` (optional; the simulator overlaps it with the rank's
    remaining backward work).
  * Text form ``{stage}{kind}{microbatch}``, e.g. ``0F0 1SEND_F0 3B2 2I5 2W5 2GRAD_SYNC``.
Execution model the checker assumes: a SEND posts its message and returns (asynchronous, as
``isend``); a RECV blocks until the matching message is there; messages between one ordered pair of
ranks are matched strictly in order (as NCCL and gloo match point-to-point operations per peer).

Activations: a (stage, microbatch) holds its saved activations from its ``F`` until its weight
gradient (``B`` or ``W``): ``I`` frees nothing, since ``W`` still reads the saved inputs.

Invariants checked by ``check_schedule``: every action runs on its stage's rank; every microbatch
has exactly one F per stage and one B or one I and one W; F of stage s follows F of stage s-1 for
that microbatch, B or I of s follows F of s and the input gradient (B or I) of s+1, W follows I;
sends follow the compute that produced them and are received in order; grad sync follows the
stage's last weight gradient; and all ranks run to completion.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ACTION_KINDS: tuple[str, ...] = (*COMPUTE_KINDS, *COMM_KINDS, "GRAD_SYNC")
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "gpipe", "zb-h1")
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
            raise ScheduleError(f"cannot parse action {text!r}; expected e.g. 0F0, 2I5, 1SEND_B3, 2GRAD_SYNC")
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
        last_weight_grad = {stage: i for i, (kind, stage, _) in enumerate(order) if kind in ("B", "W")}
        out: list[Action] = []
        for i, (kind, stage, mb) in enumerate(order):
            prev_remote = stage > 0 and (stage - 1) % pp != rank
            next_remote = stage < num_stages - 1 and (stage + 1) % pp != rank
            if kind == "F":
                out += [Action(kind="RECV_F", stage=stage, microbatch=mb)] if prev_remote else []
                out.append(Action(kind="F", stage=stage, microbatch=mb))
                out += [Action(kind="SEND_F", stage=stage, microbatch=mb)] if next_remote else []
            elif kind in ("B", "I"):  # both take the next stage's gradient and hand one to the previous
                out += [Action(kind="RECV_B", stage=stage, microbatch=mb)] if next_remote else []
                out.append(Action(kind=kind, stage=stage, microbatch=mb))
                out += [Action(kind="SEND_B", stage=stage, microbatch=mb)] if prev_remote else []
            else:  # W: local work on what I left behind
                out.append(Action(kind=kind, stage=stage, microbatch=mb))
            if grad_sync and last_weight_grad.get(stage) == i:
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


def zb_h1(pp: int, m: int, *, grad_sync: bool = False) -> Schedule:
    """ZB-H1 (Qi et al., arXiv 2401.10241, sec. 3): 1F1B with each backward split into I and W.

    Rank r runs 1F1B's ``warmup = min(pp - r - 1, m)`` forwards, then ``F(k + warmup), I(k)`` for
    each steady step k, followed by ``W(k - r)`` once ``k >= r``: rank r defers up to r weight
    gradients, so the input gradients, the only backward work upstream ranks wait for, leave the
    later ranks earlier. In flight after ``F(k + warmup)``: ``warmup + 1 + min(k, r) <= pp``, never
    above 1F1B's peak (that of rank 0), which every rank now reaches: ``min(pp, m)``. Cool-down:
    each remaining ``I(k)`` is followed by the oldest pending W, which fills the wait for the next
    gradient; the W's still pending run last, oldest first.
    Simulated on uniform stages with free transfers and ``m >= pp``, each rank idles
    ``(pp-1) max(T_F + T_I - T_W, T_F, T_I)`` instead of 1F1B's ``(pp-1)(T_F + T_I + T_W)``: the
    paper's ``(pp-1)(T_F + T_I - T_W)`` while ``T_W <= T_F`` and ``T_W <= T_I``, so this placement
    of the W's needs no improvement there (tests/test_simulator.py states the law).
    """
    return _lower("zb-h1", pp, m, 1, _zb_h1_compute(pp, m), grad_sync)


def _zb_h1_compute(pp: int, m: int) -> Compute:
    """1F1B's order with each B split: its I where the B was; a W right after it once the rank
    defers r of them (steady state) and after every I of the cool-down; the rest at the end."""
    compute: Compute = []
    for r, plain in enumerate(_one_f_one_b_compute(pp, m)):
        steady = m - min(pp - r - 1, m)  # the (F, B) pairs; the B's of later micro-batches cool down
        order: list[tuple[str, int, int]] = []
        pending: deque[int] = deque()  # microbatches whose I has run and W not, oldest first
        for kind, stage, i in plain:
            if kind == "F":
                order.append((kind, stage, i))
                continue
            order.append(("I", stage, i))
            pending.append(i)
            if i >= r or i >= steady:
                order.append(("W", stage, pending.popleft()))
        order += [("W", r, i) for i in pending]
        compute.append(order)
    return compute


def build_schedule(name: str, pp: int, m: int, vpp: int = 1, *, grad_sync: bool = False) -> Schedule:
    """A schedule by name (``SCHEDULES``; ``vpp`` only for ``interleaved``)."""
    return _lower(name, pp, m, vpp, _compute(name, pp, m, vpp), grad_sync)


def _compute(name: str, pp: int, m: int, vpp: int) -> Compute:
    one_stage_per_rank = {"gpipe": _gpipe_compute, "1f1b": _one_f_one_b_compute, "zb-h1": _zb_h1_compute}
    if name in one_stage_per_rank:
        if vpp != 1:
            raise ScheduleError(f"schedule {name!r} has one stage per rank; vpp={vpp} needs interleaved")
        return one_stage_per_rank[name](pp, m)
    if name == "interleaved":
        return _interleaved_compute(pp, m, vpp)
    raise ScheduleError(f"unknown schedule {name!r}; schedules: {', '.join(SCHEDULES)}")


def max_in_flight_by_rank(name: str, pp: int, m: int, vpp: int = 1) -> tuple[int, ...]:
    """`max_in_flight` of every rank of `build_schedule(name, pp, m, vpp)`, counted on the
    builders' compute orders (communication moves no activation in or out): the same numbers,
    without building the action lists, for a search that asks for hundreds of shapes."""
    return tuple(max(_running(kind for kind, _, _ in order), default=0) for order in _compute(name, pp, m, vpp))


IN_FLIGHT_STEP: dict[str, int] = {"F": 1, "B": -1, "I": 0, "W": -1}
"""How each compute kind changes the activations a rank holds: F saves a microbatch's, its weight
gradient (B, or W after I) frees them; I frees nothing, W still reads the saved inputs."""


def _running(kinds: Iterable[str]) -> Iterator[int]:
    live = 0
    for kind in kinds:
        live += IN_FLIGHT_STEP[kind]
        yield live


# -- analysis ---------------------------------------------------------------------------------------
def in_flight_counts(actions: Iterable[Action], stage: int | None = None) -> list[int]:
    """Running count of (stage, microbatch) pairs whose F has run and weight gradient (B or W) not,
    after each compute action."""
    return list(_running(a.kind for a in actions if a.kind in COMPUTE_KINDS and (stage is None or a.stage == stage)))


def max_in_flight(schedule: Schedule, rank: int) -> int:
    """Most microbatch activations a rank holds at once, counted in stage chunks.

    Each (chunk, microbatch) whose forward has run and weight gradient (B or W) not yet counts once;
    the memory model multiplies it by one chunk's activation bytes per microbatch. GPipe: m; 1F1B:
    min(pp - rank, m); ZB-H1: min(pp, m) on every rank (rank r holds up to r deferred W's on top of
    1F1B's pp - r); interleaved: Megatron's warm-up + 1 (all ``m * vpp`` when m == pp).
    """
    return max(in_flight_counts(schedule.actions[rank]), default=0)


def max_in_flight_per_stage(schedule: Schedule) -> tuple[int, ...]:
    """For each global stage, the most microbatches whose forward through it has run and weight gradient not."""
    return tuple(max(in_flight_counts(schedule.actions[schedule.rank_of(s)], s), default=0)
                 for s in range(schedule.num_stages))


def check_schedule(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` naming the rank and action where ``schedule`` is wrong or stalls."""
    _DryRun(schedule).run()


class _DryRun:
    """Executes all ranks' lists symbolically, advancing each rank until it blocks on a receive."""

    __slots__ = ("s", "pos", "channels", "forward_done", "input_grad_done", "weight_grad_done", "received",
                 "backward_kind")

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.pos = [0] * schedule.pp
        self.channels: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
        self.forward_done: set[tuple[int, int]] = set()
        self.input_grad_done: set[tuple[int, int]] = set()  # B or I: the gradient stage s-1 waits for
        self.weight_grad_done: set[tuple[int, int]] = set()  # B or W: what GRAD_SYNC waits for
        self.received: set[tuple[str, int, int]] = set()
        self.backward_kind: dict[tuple[int, int], str] = {}  # (stage, mb) -> "B" or "I", from the static pass

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
        seen: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> its index on its rank
        for rank, acts in enumerate(s.actions):
            for index, a in enumerate(acts):
                # the place is written only for a refusal: a large schedule has millions of actions
                if not 0 <= a.stage < s.num_stages:
                    raise ScheduleError(f"{self._where(rank, index)}: stage out of range 0..{s.num_stages - 1}")
                if a.stage % s.pp != rank:
                    raise ScheduleError(f"{self._where(rank, index)}: stage {a.stage} belongs to rank "
                                        f"{s.rank_of(a.stage)}")
                if a.microbatch is not None and not 0 <= a.microbatch < s.num_microbatches:
                    raise ScheduleError(f"{self._where(rank, index)}: microbatch out of range "
                                        f"0..{s.num_microbatches - 1}")
                if a.kind in COMPUTE_KINDS:
                    key = (a.kind, a.stage, a.microbatch or 0)
                    if key in seen:
                        raise ScheduleError(f"{self._where(rank, index)}: duplicate; {a} already ran as "
                                            f"action #{seen[key]}")
                    seen[key] = index
        for stage in range(s.num_stages):
            for mb in range(s.num_microbatches):
                self.backward_kind[(stage, mb)] = self._static_backward(stage, mb, seen)

    def _where(self, rank: int, index: int) -> str:
        return f"schedule {self.s.name}: rank {rank}, action #{index} ({self.s.actions[rank][index]})"

    def _static_backward(self, stage: int, mb: int, seen: dict[tuple[str, int, int], int]) -> str:
        """Check that (stage, mb) has one F and one B, or one I and one W; return "B" or "I"."""
        s, rank = self.s, self.s.rank_of(stage)
        has = {kind: (kind, stage, mb) in seen for kind in COMPUTE_KINDS}

        def name(kind: str) -> Action:
            return Action(kind=kind, stage=stage, microbatch=mb)

        def at(kind: str) -> str:
            return f"schedule {s.name}: rank {rank}, action #{seen[(kind, stage, mb)]} ({name(kind)})"
        if not has["F"]:
            raise ScheduleError(f"schedule {s.name}: rank {rank} never runs {name('F')}")
        if has["B"] and (has["I"] or has["W"]):
            raise ScheduleError(f"{at('I' if has['I'] else 'W')}: {name('B')} (action #{seen[('B', stage, mb)]}) "
                                f"already runs this backward; a microbatch has one B, or one I and one W")
        if has["W"] and not has["I"]:
            raise ScheduleError(f"{at('W')}: no {name('I')}: W is the weight-gradient half of a backward split "
                                f"in I and W")
        if has["I"] and not has["W"]:
            raise ScheduleError(f"{at('I')}: rank {rank} never runs {name('W')}: its weight gradient would be "
                                f"missing")
        if not has["B"] and not has["I"]:
            raise ScheduleError(f"schedule {s.name}: rank {rank} never runs {name('B')} (or {name('I')} and "
                                f"{name('W')})")
        return "I" if has["I"] else "B"

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
        elif a.kind in ("B", "I"):
            if (a.stage, mb) not in self.forward_done:
                raise self.fail(rank, f"backward before the forward {a.stage}F{mb}")
            if a.stage < last:
                self._needs_input(rank, a, ("B", a.stage, mb), (a.stage + 1, mb) in self.input_grad_done,
                                  self.backward_kind[(a.stage + 1, mb)])
            self.input_grad_done.add((a.stage, mb))
            if a.kind == "B":
                self.weight_grad_done.add((a.stage, mb))
        elif a.kind == "W":
            if (a.stage, mb) not in self.input_grad_done:
                raise self.fail(rank, f"weight gradient before its input gradient {a.stage}I{mb}")
            self.weight_grad_done.add((a.stage, mb))
        elif a.kind in ("SEND_F", "SEND_B"):
            forward = a.kind == "SEND_F"
            if (forward and a.stage == last) or (not forward and a.stage == 0):
                raise self.fail(rank, "no stage to send to")
            if (a.stage, mb) not in (self.forward_done if forward else self.input_grad_done):
                producer = "F" if forward else self.backward_kind[(a.stage, mb)]
                raise self.fail(rank, f"sends before computing {a.stage}{producer}{mb}")
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
            missing = [i for i in range(self.s.num_microbatches) if (a.stage, i) not in self.weight_grad_done]
            if missing:
                raise self.fail(rank, f"gradient sync before the last weight gradient (B or W) of stage {a.stage} "
                                      f"(microbatch {missing[0]} not done)")
        return True

    def _needs_input(self, rank: int, a: Action, message: tuple[str, int, int], producer_done: bool,
                     producer_kind: str) -> None:
        """`a` needs the output of `producer_kind` (F, or the next stage's B or I) of its microbatch:
        run before it on this rank, or received from the producer's rank."""
        forward = producer_kind == "F"
        producer = a.stage - 1 if forward else a.stage + 1
        if self.s.rank_of(producer) == rank:
            if not producer_done:
                raise self.fail(rank, f"runs before {producer}{producer_kind}{message[2]} on the same rank")
        elif message not in self.received:
            recv = "RECV_F" if forward else "RECV_B"
            raise self.fail(rank, f"no {a.stage}{recv}{message[2]} before it: its input from rank "
                                  f"{self.s.rank_of(producer)} never arrives")
