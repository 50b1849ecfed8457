"""Multi-process gloo harness for distributed tests on CPU ranks (test code only).

`run_ranks(world_size, fn, *args)` runs `fn(*args)` on `world_size` fresh processes joined in a
gloo process group, with float64 as the default dtype, and returns each rank's result (in rank
order) or raises `RankFailed` carrying the first failing rank's traceback.

Starting a rank is the expensive part (importing torch takes ~1.3 s per process on the 2-core
CI machine), so a test module starts ONE group and runs all its checks inside it:

    CHECKS = [check_forward, check_backward]          # zero-argument functions, module level

    @pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
    def outcomes(request):
        return run_checks(request.param, CHECKS)

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_distributed(outcomes, check):
        outcomes.assert_passed(check)

Each check runs on every rank, in list order, may assert (the message reaches the test) and
returns a picklable value per rank. After the first failing check the group is torn down
(its peers may be blocked inside a collective), so later checks report "not run".

Processes come from a `forkserver` that imports torch once: each rank is then a fork of a
process that never ran a torch op (no thread pool or CUDA state to inherit, as safe as
`spawn`), and costs milliseconds instead of a torch import. The parent owns the TCP store the
ranks rendezvous on, so there is no free-port race. Results travel pickled by value (plain
`pickle`, not torch's shared-memory reductions, whose file descriptors die with the child);
only this harness unpickles, and only what its own children sent.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
"""Whole-run limit; a deadlocked collective fails the test instead of hanging CI."""
DEADLINE_SCALE = 3.0 if os.environ.get("PYTEST_XDIST_WORKER") else 1.0
"""Every limit's factor under pytest-xdist: the other worker shares the two cores, and a limit
only guards against hangs (a 240 s group timed out at 2 workers while running in ~140 s alone)."""

_CONTEXT = multiprocessing.get_context("forkserver")
# Imported once in the forkserver, not in every rank: torch.export and dynamo, which a rank's
# first capture imports, mplan, and transformers' base with one model family (about 3.4 s of a
# rank's start on the 2-core CI machine otherwise; imports only, no torch op, so no thread pool).
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "pytest", "torch.export", "torch._dynamo", "networkx",
                                 "mplan.api", "mplan.planner.explain", "transformers.models.llama.modeling_llama"])


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""

    def __init__(self, rank: int, formatted: str, check: str | None) -> None:
        where = f" in check {check}" if check else ""
        super().__init__(f"rank {rank} failed{where}:\n{formatted}")
        self.rank, self.formatted, self.check = rank, formatted, check


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """`fn(*args)` on every rank of a fresh gloo group; per-rank results in rank order."""
    timeout_s *= DEADLINE_SCALE
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results_queue = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, timeout_s, results_queue, fn, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results_queue, time.monotonic() + timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def _collect(processes: list[Any], results_queue: Any, deadline: float) -> list[Any]:
    results: dict[int, Any] = {}
    while len(results) < len(processes):
        try:
            rank, ok, payload = results_queue.get(timeout=0.1)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank not in results and process.exitcode not in (None, 0):
                    raise RankFailed(rank, f"exited with code {process.exitcode}", None) from None
            if time.monotonic() > deadline:
                waiting = sorted(set(range(len(processes))) - set(results))
                raise TimeoutError(f"ranks {waiting} still running at the deadline") from None
            continue
        if not ok:
            formatted, check = payload
            raise RankFailed(rank, formatted, check)
        results[rank] = pickle.loads(payload)
    return [results[rank] for rank in range(len(processes))]


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, results_queue: Any,
               fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_default_dtype(torch.float64)
    # Several ranks share two cores; extra intra-op threads would only contend.
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        message = (rank, True, pickle.dumps(fn(*args)))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        message = (rank, False, (traceback.format_exc(), getattr(error, "check", None)))
    results_queue.put(message)
    # Flush before tearing down gloo: peers blocked on us then fail with "connection closed",
    # and the parent must read this rank's real error before theirs.
    results_queue.close()
    results_queue.join_thread()
    dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckOutcomes:
    """What `run_checks` saw: per-rank values of the checks that passed, else the failure."""

    values: dict[str, list[Any]]
    failure: RankFailed | None
    world_size: int

    def assert_passed(self, check: Callable[[], Any]) -> list[Any]:
        """The check's per-rank return values; raises with the rank traceback if it failed."""
        name = check.__name__
        if name in self.values:
            return self.values[name]
        if self.failure is not None and self.failure.check == name:
            raise AssertionError(str(self.failure))
        reason = f"check {self.failure.check} failed first" if self.failure else "it was not in the list"
        raise AssertionError(f"{name} did not run at world size {self.world_size}: {reason}")


class _CheckError(Exception):
    """Names the failing check for the parent; the original error is its `__cause__`."""

    def __init__(self, check: str) -> None:
        super().__init__(f"check {check} raised")
        self.check = check


def _run_check_list(checks: Sequence[Callable[[], Any]]) -> list[Any]:
    values = []
    for check in checks:
        try:
            values.append(check())
        except Exception as error:
            raise _CheckError(check.__name__) from error
        # Every rank finishes a check before any starts the next, so a failure in check k
        # proves checks 0..k-1 passed everywhere.
        dist.barrier()
    return values


def run_checks(world_size: int, checks: Sequence[Callable[[], Any]],
               timeout_s: float = DEFAULT_TIMEOUT_S) -> CheckOutcomes:
    """Run `checks` in order inside one gloo group of `world_size` ranks."""
    names = [check.__name__ for check in checks]
    try:
        per_rank = run_ranks(world_size, _run_check_list, checks, timeout_s=timeout_s)
    except RankFailed as failure:
        if failure.check is None:
            raise
        # Checks before the failing one passed on every rank (see the barrier in
        # `_run_check_list`); their values died with the torn-down group.
        done = names[: names.index(failure.check)]
        return CheckOutcomes(values={name: [] for name in done}, failure=failure,
                             world_size=world_size)
    values = {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(names)}
    return CheckOutcomes(values=values, failure=None, world_size=world_size)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (absolute error when `expected` is zero)."""
    scale = expected.norm().item()
    error = (actual - expected).norm().item()
    return error / scale if scale else error


__all__ = ["CheckOutcomes", "RankFailed", "rel_err", "run_checks", "run_ranks"]
