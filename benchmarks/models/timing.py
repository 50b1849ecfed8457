"""How every system of the race is warmed up and timed: each built and warmed up in turn (its
set-up, first step and peak memory measured), then all resident and timed in interleaved rounds
whose order rotates (the `e2e` case's docstring says why); a step by CUDA events on a GPU."""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.models.workloads import SYSTEMS, Setting, Step, Workload

GiB = 2**30


def start_timer(device: torch.device) -> Callable[[], float]:
    """Starts a clock; the function returned gives the seconds since (CUDA events on a GPU)."""
    if device.type != "cuda":
        began = time.perf_counter()
        return lambda: time.perf_counter() - began
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()

    def elapsed() -> float:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return elapsed


@dataclass(kw_only=True, slots=True)
class Running:
    """A built, warmed-up system, resident until its workload's rounds are over."""

    step: Step
    row: dict[str, Any]


def warm_up(name: str, workload: Workload, setting: Setting, warmup: int) -> Running | dict[str, Any]:
    """Builds `name` and runs its warm-up steps, measuring set-up, first step and peak memory;
    returns the error (as the system's row) instead when it fails."""
    cuda = setting.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        step, info = SYSTEMS[name](workload, setting)
        info["setup_s"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        results = [step()]  # compiles, autotunes, allocates optimizer state
        info["first_step_s"] = round(time.perf_counter() - start, 2)
        results += [step() for _ in range(warmup - 1)]
    except Exception:  # noqa: BLE001 - one system's failure must not lose the others' numbers
        return {"error": traceback.format_exc()}
    info["losses"] = [loss for loss, _ in results]
    info["grad_norms"] = [norm for _, norm in results]
    info["peak_gib"] = (torch.cuda.max_memory_allocated() - held) / GiB if cuda else None
    info["step_s_all"] = []
    return Running(step=step, row=info)


def timed_rounds(running: dict[str, Running], setting: Setting, rounds: int, steps: int) -> None:
    """`steps` timed steps per system, spread over `rounds` rounds whose order rotates."""
    names = list(running)
    per_round = max(1, -(-steps // rounds))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            system = running[name]
            for _ in range(per_round):
                # wall clock of each step's start: lines the steps up with a GPU clock trace (peers --gpu-trace)
                system.row.setdefault("step_began_unix", []).append(round(time.time(), 3))
                elapsed = start_timer(setting.device)
                loss, norm = system.step()
                system.row["step_s_all"].append(round(elapsed(), 5))
                system.row["losses"].append(loss)
                system.row["grad_norms"].append(norm)



def steady_block(system: Running, setting: Setting, settle: int, steps: int) -> None:
    """`settle` untimed steps, then `steps` timed ones, one after another: the system alone, as a
    user's run has it, into the row's `steady_step_s_all` (and `steady_began_unix`).

    Why beside the interleaved rounds: the rounds judge systems against each other under the same
    drift of the card, but each turn starts from whatever the system before it left: a card held
    at its power cap grants a burst of clock to the first steps after a lighter program's turn and
    takes it back over the next (the graphed steps of a round ran 1.4-6.3% slower after its first,
    H100, 2026-12-06), so a spread taken over the rounds measures the turns as much as the program.
    A block of consecutive steps after the card settled on this program's power is the spread a
    run of it sees. Its losses are not checked (the rounds' are); they train on further batches."""
    for _ in range(settle):
        system.step()
    timed = system.row.setdefault("steady_step_s_all", [])
    for _ in range(steps):
        system.row.setdefault("steady_began_unix", []).append(round(time.time(), 3))
        elapsed = start_timer(setting.device)
        system.step()
        timed.append(round(elapsed(), 5))
