"""The hang watchdog names the planted fault: a pipeline rank that skips a send, a data-parallel
rank that sleeps before the gradient reduction, a rank that dies mid-step.

Each fault runs in its own group of 2 gloo ranks (a hang leaves a group unusable): a tiny
float64 GPT trains a normal step under the watchdog (it must not fire), then the fault is
planted on one rank and the next step must end on every rank with the summary line naming that
rank, either as `HangError` in the main thread or, where gloo holds the main thread in a wait
Python cannot interrupt, as the line on stderr and exit status 1. `run_to_the_end` is the
harness's `run_ranks` (tests/distributed.py) without its fail-fast: that one reports the first
rank that exits and stops the others, which would kill the survivors a dead rank's test is
about; this one waits for every rank to report or exit, and keeps each rank's stderr.

Before planting the faults the same groups time normal steps with and without the watchdog's
monitor thread (`test_overhead` prints the figures). The skipped send runs once more under
torchrun, started by MPLAN_HANG_TIMEOUT_S, where the store is the agent's. The summary's reasoning
is also checked in one process on hand-written reports (no ranks), and the per-write cost of the
position record.
"""
from __future__ import annotations

import os
import pickle
import queue
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from distributed import _CONTEXT, _rank_main
from mplan.ir.schedule import Action, build_schedule
from mplan.runtime.watchdog import (TIMEOUT_VARIABLE, HangError, Position, Report, hang_timeout, summarize)

TIMEOUT_S = 2.0
FAST = {"poll_s": 0.1, "grace_s": 1.0, "exit_s": 1.0}
"""Faster than the defaults for a 2 s timeout (poll 0.5 s, grace and exit 2 s), to keep the module short."""


# -- a harness that lets ranks die ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How one rank ended."""

    rank: int
    value: Any  # what the rank's function returned (None if it raised or died)
    error: str | None  # the traceback it raised
    exitcode: int | None
    stderr: str


def run_to_the_end(world_size: int, fn: Callable[..., Any], out_dir: str, *, timeout_s: float = 90.0) -> list[Outcome]:
    """`fn(out_dir)` on every rank of a fresh gloo group; each rank's outcome once every rank has
    reported or exited. `fn` writes its stderr to `out_dir/rank<r>.err` (`_stderr_to`)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = _CONTEXT.Queue()
    processes = [_CONTEXT.Process(target=_rank_main, args=(rank, world_size, store.port, timeout_s, results, fn,
                                                           (out_dir,)), daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    messages: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.1)
                messages[rank] = (ok, payload)
            except queue.Empty:
                if all(rank in messages or not p.is_alive() for rank, p in enumerate(processes)):
                    break
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    while True:  # what a rank sent just before it exited
        try:
            rank, ok, payload = results.get(timeout=0.2)
            messages[rank] = (ok, payload)
        except queue.Empty:
            break
    outcomes = []
    for rank, process in enumerate(processes):
        ok, payload = messages.get(rank, (False, None))
        path = os.path.join(out_dir, f"rank{rank}.err")
        stderr = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        outcomes.append(Outcome(rank=rank, value=pickle.loads(payload) if ok else None,
                                error=payload[0] if not ok and payload else None, exitcode=process.exitcode,
                                stderr=stderr))
    return outcomes


def _stderr_to(out_dir: str) -> None:
    """This rank's file descriptor 2 (where the watchdog prints) into `out_dir/rank<r>.err`."""
    path = os.path.join(out_dir, f"rank{dist.get_rank()}.err")
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)


def _build(plan: str) -> tuple[Any, torch.Tensor]:
    import mplan
    import mplan.models

    model = mplan.models.build_model("tiny-gpt", device="cpu", dtype=torch.float64)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, plan=plan, progress="quiet")
    return pm, ids


def _time_steps(pm: Any, ids: torch.Tensor, *, rounds: int = 4, steps: int = 15) -> dict[str, float]:
    """Median step time (ms) without and with a watchdog (polling every 50 ms, a worst case; the
    default polls once a second), in alternating blocks so drifts hit both alike."""
    for _ in range(3):
        pm.train_step(ids, ids)
    times: dict[str, list[float]] = {"without_ms": [], "with_ms": []}
    for _ in range(rounds):
        for key in times:
            if key == "with_ms":
                pm.watch_for_hangs(60.0, poll_s=0.05)
            for _ in range(steps):
                start = time.perf_counter()
                pm.train_step(ids, ids)
                times[key].append((time.perf_counter() - start) * 1e3)
            if pm.watchdog is not None:
                pm.watchdog.close()
                pm.watchdog = None
    return {key: statistics.median(values) for key, values in times.items()}


def _faulty_step(pm: Any, ids: torch.Tensor) -> str | None:
    """The step the fault hits: the HangError's summary, or None if the step returned."""
    try:
        pm.train_step(ids, ids)
    except HangError as error:
        return error.summary
    return None


# -- the faults, run on every rank --------------------------------------------------------------------
def skip_a_send(out_dir: str) -> dict[str, Any]:
    """pp=2, 1F1B over 4 micro-batches: rank 0 leaves out its SEND_F of micro-batch 3 (action 11)."""
    _stderr_to(out_dir)
    pm, ids = _build("pp=2,mbs=1")
    overhead = _time_steps(pm, ids)
    pm.watch_for_hangs(TIMEOUT_S, **FAST)
    pm.train_step(ids, ids)  # a normal step under the watchdog: nothing fires
    if dist.get_rank() == 0:
        send = pm.executor.handlers["SEND_F"]
        pm.executor.handlers["SEND_F"] = lambda a: None if a.microbatch == 3 else send(a)
    return {"hang": _faulty_step(pm, ids), "overhead": overhead}


def sleep_before_reduction(out_dir: str) -> dict[str, Any]:
    """dp=2: rank 1 sleeps 30 s before its last backward, whose hooks start the gradient reduction."""
    _stderr_to(out_dir)
    pm, ids = _build("dp=2,mbs=1")
    overhead = _time_steps(pm, ids)
    pm.watch_for_hangs(TIMEOUT_S, **FAST)
    pm.train_step(ids, ids)
    if dist.get_rank() == 1:
        arm = pm.optimizer.before_last_backward

        def late() -> None:
            time.sleep(30.0)
            arm()
        pm.optimizer.before_last_backward = late
    return {"hang": _faulty_step(pm, ids), "overhead": overhead}


def die_mid_step(out_dir: str) -> dict[str, Any]:
    """pp=2: rank 1 exits (status 3) as it starts the forward of micro-batch 2."""
    _stderr_to(out_dir)
    pm, ids = _build("pp=2,mbs=1")
    pm.watch_for_hangs(TIMEOUT_S, **FAST)
    pm.train_step(ids, ids)
    if dist.get_rank() == 1:
        forward = pm.executor.handlers["F"]

        def die(a: Action) -> None:
            if a.microbatch == 2:
                os._exit(3)
            forward(a)
        pm.executor.handlers["F"] = die
    return {"hang": _faulty_step(pm, ids)}


@pytest.fixture(scope="module")
def skipped(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return run_to_the_end(2, skip_a_send, str(tmp_path_factory.mktemp("skip")))


@pytest.fixture(scope="module")
def slept(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return run_to_the_end(2, sleep_before_reduction, str(tmp_path_factory.mktemp("sleep")))


@pytest.fixture(scope="module")
def died(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return run_to_the_end(2, die_mid_step, str(tmp_path_factory.mktemp("die")))


def _summary(outcomes: list[Outcome]) -> str:
    """The one summary line, checked to be the same wherever it appears: each HangError raised,
    and the line the lowest reporting rank printed."""
    found = {o.value["hang"] for o in outcomes if o.value is not None and o.value.get("hang")}
    printed = [line.removeprefix("mplan: ") for o in outcomes for line in o.stderr.splitlines()
               if line.startswith("mplan: hang") and "summary on rank" not in line and " exits: " not in line]
    found |= set(printed)
    details = "\n".join(f"rank {o.rank}: exit {o.exitcode}, returned {o.value}, raised {o.error}\n{o.stderr}"
                        for o in outcomes)
    assert len(found) == 1, f"expected one summary line, got {found}\n{details}"
    return found.pop()


def _each_rank_ended(outcomes: list[Outcome], *, dead: int | None = None) -> None:
    """Every live rank either raised HangError (returned its summary) or printed its line and
    exited with status 1; none is left running or ended another way."""
    for o in outcomes:
        if o.rank == dead:
            assert o.exitcode == 3, o
            continue
        raised = o.value is not None and o.value["hang"] is not None
        exited = o.exitcode == 1 and "mplan: hang" in o.stderr and " exits: " in o.stderr
        assert raised or exited, o
        assert "mplan: hang" in o.stderr, o  # every rank printed where it was


# -- the planted faults, named -----------------------------------------------------------------------
def test_skipped_send_names_the_rank_and_action(skipped: list[Outcome]) -> None:
    summary = _summary(skipped)
    _each_rank_ended(skipped)
    assert re.match(r"hang in step \d+: rank 0 stuck: ", summary), summary
    assert "rank 0 went past pipeline action 11 (send F stage 0 mb 3 to rank 1) that rank 1 waits on" in summary
    assert "rank 1 waits in pipeline action 12 (recv F stage 1 mb 3 from rank 0) for rank 0" in summary
    assert "is now in pipeline action 14 (recv B stage 0 mb 3 from rank 1)" in summary


def test_sleeping_rank_is_named_the_slow_one(slept: list[Outcome]) -> None:
    summary = _summary(slept)
    _each_rank_ended(slept)
    assert re.match(r"hang in step \d+: rank 1 stuck: rank 1 in forward/backward of micro-batch 1 for ", summary), summary
    assert "rank 0 waits in the optimizer step with ranks [0, 1] for rank 1" in summary


def test_dead_rank_is_named_dead(died: list[Outcome]) -> None:
    summary = _summary(died)
    _each_rank_ended(died, dead=1)
    assert died[0].value is not None and died[0].value["hang"] == summary, died[0]  # raised, not exited
    assert summary.startswith("hang in step 1: rank 1 dead: rank 1 dead (no report within 1.0 s); rank 0 waits in "
                              "pipeline action "), summary
    assert re.search(r"from rank 1\) \(raised RuntimeError: [^()]*Connection (reset|closed) by peer[^()]*\) for rank 1$",
                     summary), summary


def test_overhead(skipped: list[Outcome], slept: list[Outcome]) -> None:
    """Step time on 2 ranks with and without the monitor thread (printed; `pytest -s` shows it).
    Loose bound only: timings share two cores with whatever else runs."""
    for name, outcomes in (("pp=2", skipped), ("dp=2", slept)):
        measured = [(o.rank, o.value["overhead"]) for o in outcomes if o.value is not None]
        assert measured, outcomes  # the rank that raised HangError returned its figures
        rank, figures = measured[0]
        print(f"{name}: step {figures['without_ms']:.2f} ms without the watchdog, {figures['with_ms']:.2f} ms "
              f"with it (medians on rank {rank})")
        assert figures["with_ms"] < 1.5 * figures["without_ms"] + 2.0, figures


# -- under torchrun ----------------------------------------------------------------------------------
TORCHRUN_SCRIPT = """
import os, sys
import torch
import mplan, mplan.models

torch.set_num_threads(1)
model = mplan.models.build_model("tiny-gpt", device="cpu", dtype=torch.float64)
ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, plan="pp=2,mbs=1", progress="quiet")
assert pm.watchdog is not None  # started by MPLAN_HANG_TIMEOUT_S
pm.train_step(ids, ids)
if os.environ["RANK"] == "0":
    send = pm.executor.handlers["SEND_F"]
    pm.executor.handlers["SEND_F"] = lambda a: None if a.microbatch == 3 else send(a)
pm.train_step(ids, ids)
"""


@pytest.mark.slow
def test_under_torchrun_the_store_is_the_agents(tmp_path: Any) -> None:
    """The skipped send again, under torchrun with MPLAN_HANG_TIMEOUT_S (autoparallel starts the
    watchdog): the side channel is the agent's store, rank 0 prints the summary and exits, and the
    agent stops rank 1, which has printed its own line."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    dropped = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    env = {**{k: v for k, v in os.environ.items() if k not in dropped}, "OMP_NUM_THREADS": "1",
           TIMEOUT_VARIABLE: "3"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in done.stderr.splitlines() if line.startswith("mplan: hang")]
    assert done.returncode != 0, done.stderr
    assert any(line.startswith("mplan: hang in step 1: rank 0 stuck: rank 0 went past pipeline action 11 (send F "
                               "stage 0 mb 3 to rank 1) that rank 1 waits on") for line in lines), done.stderr
    assert any(re.fullmatch(r"mplan: hang: rank 1 waits in pipeline action 12 \(recv F stage 1 mb 3 from rank 0\) "
                            r"for [\d.]+ s \(summary on rank 0\)", line) for line in lines), done.stderr
    assert any(line.startswith("mplan: hang: rank 0 exits: ") for line in lines), done.stderr


# -- in one process ---------------------------------------------------------------------------------
SCHEDULE = build_schedule("1f1b", 2, 4)


def _report(rank: int, **fields: Any) -> Report:
    base = dict(rank=rank, pp_rank=rank, step=4, inside=True, phase="pipeline action", index=0, action=None,
                wait=None, wait_index=0, peer=None, peers=(), for_s=2.0, error=None)
    return Report(**{**base, **fields})


def test_summary_of_a_lost_send() -> None:
    reports = {0: _report(0, index=15, action="0B3", wait="0RECV_B3", wait_index=14, peer=1),
               1: _report(1, index=13, action="1F3", wait="1RECV_F3", wait_index=12, peer=0)}
    summary, stuck = summarize(reports, world_size=2, schedule=SCHEDULE, grace_s=1.0)
    assert stuck == [0]
    assert summary == ("hang in step 4: rank 0 stuck: rank 0 went past pipeline action 11 (send F stage 0 mb 3 to "
                       "rank 1) that rank 1 waits on, and is now in pipeline action 14 (recv B stage 0 mb 3 from "
                       "rank 1) for 2.0 s; rank 1 waits in pipeline action 12 (recv F stage 1 mb 3 from rank 0) "
                       "for rank 0")


def test_summary_of_a_chain_names_its_end() -> None:
    """Rank 2 waits for rank 1 which waits for rank 0 which computes: rank 0 is the stuck one."""
    schedule = build_schedule("1f1b", 3, 4)
    reports = {0: _report(0, index=0, action="0F0", for_s=9.0),
               1: _report(1, index=1, action="1F0", wait="1RECV_F0", wait_index=0, peer=0),
               2: _report(2, index=1, action="2F0", wait="2RECV_F0", wait_index=0, peer=1)}
    summary, stuck = summarize(reports, world_size=3, schedule=schedule, grace_s=1.0)
    assert stuck == [0]
    assert summary == ("hang in step 4: rank 0 stuck: rank 0 in pipeline action 0 (F stage 0 mb 0) for 9.0 s; "
                       "rank 1 waits in pipeline action 0 (recv F stage 1 mb 0 from rank 0) for rank 0; "
                       "rank 2 waits in pipeline action 0 (recv F stage 2 mb 0 from rank 1) for rank 1")


def test_summary_of_a_collective_everyone_is_in() -> None:
    """No member behind: the collective itself made no progress, and all its ranks are named."""
    reports = {r: _report(r, phase="optimizer step", peers=(0, 1)) for r in range(2)}
    summary, stuck = summarize(reports, world_size=2, schedule=None, grace_s=1.0)
    assert stuck == [0, 1] and summary.startswith("hang in step 4: ranks [0, 1] stuck: "), summary


def test_summary_names_a_rank_outside_the_step() -> None:
    reports = {0: _report(0, phase="optimizer step", peers=(0, 1)), 1: _report(1, inside=False, step=4)}
    summary, stuck = summarize(reports, world_size=2, schedule=None, grace_s=1.0)
    assert stuck == [1] and "rank 1 is outside train_step after step 4" in summary, summary


def test_summary_of_many_ranks_stays_one_short_line() -> None:
    reports = {r: _report(r, phase="optimizer step", peers=tuple(range(64)), index=0) for r in range(1, 64)}
    summary, stuck = summarize(reports, world_size=64, schedule=None, grace_s=1.0)
    assert stuck == [0] and summary == ("hang in step 4: rank 0 dead: rank 0 dead (no report within 1.0 s); ranks "
                                        "[1-63] wait in the optimizer step with ranks [0-63] for rank 0"), summary


def test_report_round_trips_through_json() -> None:
    report = _report(3, wait="0RECV_B3", wait_index=14, peer=1, error="RuntimeError: closed")
    assert Report.from_json(report.to_json()) == report


def test_timeout_from_argument_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_VARIABLE, raising=False)
    assert hang_timeout(None) is None and hang_timeout(30) == 30.0
    monkeypatch.setenv(TIMEOUT_VARIABLE, "120")
    assert hang_timeout(None) == 120.0 and hang_timeout(5.0) == 5.0
    monkeypatch.setenv(TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_VARIABLE} must be a number of seconds, got 'soon'"):
        hang_timeout(None)
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match="hang_timeout_s must be a positive number of seconds"):
            hang_timeout(bad)


def test_autoparallel_refuses_a_bad_timeout_before_capture() -> None:
    import mplan
    import mplan.models

    model, autoparallel = mplan.models.build_model("tiny-gpt", device="cpu", dtype=torch.float64), mplan.autoparallel
    start = time.perf_counter()
    with pytest.raises(ValueError, match="hang_timeout_s must be a positive number"):
        autoparallel(model, example_inputs=(torch.zeros(4, 16, dtype=torch.long),), global_batch=4,
                           hang_timeout_s=-5, progress="quiet")
    assert time.perf_counter() - start < 1.0


def test_position_writes_cost_a_fraction_of_a_microsecond() -> None:
    """What the executor adds per schedule action (a position write and a transfer's), whether or
    not a watchdog reads it: well under a microsecond, against steps of milliseconds."""
    position, action = Position(), Action(kind="RECV_F", stage=1, microbatch=3)
    count = 200_000
    start = time.perf_counter()
    for index in range(count):
        position.pipeline_action(index, action)
        position.transfer(index, action, 0)
    per_action_ns = (time.perf_counter() - start) / count * 1e9
    print(f"position writes: {per_action_ns:.0f} ns per pipeline action (one action write and one transfer write)")
    assert per_action_ns < 2000
