"""The race within one process: each system warmed up in turn, then all timed in interleaved,
rotating rounds, a child process's system (`child.PipeChild`) taking its turn like the rest; and
mplan's own models raced through it with issue 19's targets (`race_own_model`).

The `hf-models` case races its Hugging Face models and mplan's own GPT and Llama through it; the
`peers` case its own models (`--own`).
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.models.child import PipeChild
from benchmarks.models.kernel_profile import profile_steps
from benchmarks.models.timing import Running, steady_block, timed_rounds, warm_up
from benchmarks.models.workloads import Setting, Workload, compare, initial_model, model_flops
from benchmarks.report import Clock

FAMILY_TARGET_VS_EAGER = {"gpt": 1.05, "llama": 1.3}
"""issue 19: mplan's own families keep these speed-ups over eager (and are no slower than compile)"""
PROFILE_STEPS = 2
"""steps of each system run under torch.profiler after the timing (--profile)"""


def per_round(args: argparse.Namespace) -> int:
    """Timed steps per system in each round: --steps spread over --rounds, rounded up."""
    return max(1, -(-args.steps // args.rounds))


def contest(starts: dict[str, Callable[[], Running | dict[str, Any]]], child: PipeChild | None,
            setting: Setting, args: argparse.Namespace, clock: Clock, label: str
            ) -> tuple[dict[str, dict[str, Any]], dict[str, Running]]:
    """Warms up each system in turn (skipping any not started within the budget), then times them
    in rotating interleaved rounds, the liger child (if any) taking its turn like the rest."""
    rows: dict[str, dict[str, Any]] = {}
    running: dict[str, Running] = {}
    for name, start in starts.items():
        if clock.elapsed() > args.budget_s:
            rows[name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            clock.log(f"{label} {name}: skipped (time budget)")
            continue
        if name == "liger" and child is not None:
            release_cache(setting)
            answer = child.ask("warmup")
            rows[name] = answer if "error" in answer else {**answer, "process": "child"}
        else:
            result = start()
            if isinstance(result, Running):
                running[name] = result
            rows[name] = result.row if isinstance(result, Running) else result
        clock.log(f"{label} {name}: {_warmed(rows[name])}")
    turns = list(running)
    if child is not None and "step_s_all" in rows.get("liger", {}):
        turns.append("liger")
    rotating_rounds(turns, running, child, rows, setting, args.rounds, per_round(args))
    for name, row in rows.items():
        if row.get("step_s_all"):
            row["step_s"] = statistics.median(row["step_s_all"])
    return rows, running


def rotating_rounds(turns: list[str], running: dict[str, Running], child: PipeChild | None,
                    rows: dict[str, dict[str, Any]], setting: Setting, rounds: int, steps: int) -> None:
    """`rounds` rounds of `steps` timed steps per system of `turns`, the order rotating each round;
    "liger" is the child's turn (its row replaced by its answer)."""
    for r in range(rounds if turns else 0):
        for name in turns[r % len(turns):] + turns[:r % len(turns)]:
            if name == "liger":
                release_cache(setting)
                answer = child.ask(f"run {steps}")  # type: ignore[union-attr]
                rows["liger"] = answer if "error" in answer else {**answer, "process": "child"}
            else:
                timed_rounds({name: running[name]}, setting, 1, steps)


def steady_blocks(turns: list[str], running: dict[str, Running], child: PipeChild | None,
                  rows: dict[str, dict[str, Any]], setting: Setting, settle: int, steps: int) -> None:
    """Each system of `turns` alone in turn: `timing.steady_block`, the child's through its pipe."""
    for name in turns:
        release_cache(setting)
        if name == "liger":
            answer = child.ask(f"steady {settle} {steps}")  # type: ignore[union-attr]
            rows["liger"] = answer if "error" in answer else {**answer, "process": "child"}
        else:
            steady_block(running[name], setting, settle, steps)


def _warmed(row: dict[str, Any]) -> str:
    if "error" in row:
        return "ERROR " + row["error"].strip().splitlines()[-1]
    peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
    return f"warmed up, setup {row['setup_s']} s, first step {row['first_step_s']} s, peak {peak}"


def release_cache(setting: Setting) -> None:
    """Frees what the last system left (collected, and the CUDA cache) before the next one's turn."""
    gc.collect()
    if setting.device.type == "cuda":
        torch.cuda.empty_cache()


def finish(rows: dict[str, dict[str, Any]], flops: float, label: str, log: Callable[[str], None]) -> None:
    for name, row in rows.items():
        if "step_s" in row:
            row["tflops"] = flops / row["step_s"] / 1e12
            peak = f", peak {row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else ""
            log(f"{label} {name}: step {row['step_s'] * 1e3:.1f} ms, {row['tflops']:.1f} TFLOP/s{peak}, "
                f"losses {[round(x, 4) for x in row['losses']]}")


def profile_all(running: dict[str, Running], child: PipeChild | None, rows: dict[str, dict[str, Any]],
                 setting: Setting) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, system in running.items():
        try:
            out[name] = profile_steps(system.step, PROFILE_STEPS, setting.device)
        except Exception:  # noqa: BLE001 - the timing already taken must not be lost
            out[name] = {"error": traceback.format_exc()}
    if child is not None and "step_s" in rows.get("liger", {}):
        release_cache(setting)
        out["liger"] = child.ask(f"profile {PROFILE_STEPS}")
    return out


def race_own_model(workload: Workload, names: list[str], args: argparse.Namespace, setting: Setting,
               clock: Clock) -> dict[str, Any]:
    """One of mplan's own models through e2e's systems and compare, with issue 19's targets."""
    starts = {name: functools.partial(warm_up, name, workload, setting, args.warmup) for name in names}
    rows, running = contest(starts, None, setting, args, clock, workload.name)
    flops = model_flops(workload, initial_model(workload, setting.param_dtype))  # e2e's seed-0 CPU model
    finish(rows, flops, workload.name, clock.log)
    entry: dict[str, Any] = {"batch": workload.batch, "flops_per_step": flops,
                             "batches": "e2e's one memorized batch", "systems": rows}
    if args.profile and clock.elapsed() <= args.budget_s:
        entry["profile"] = profile_all(running, None, rows, setting)
    entry.update(compare(rows))
    kind = workload.name.split("-")[0]
    entry["e2e_targets"] = entry.pop("targets")
    entry["targets"] = {
        f"mplan_vs_eager>={FAMILY_TARGET_VS_EAGER[kind]}": (entry.get("mplan_vs_eager", 0.0)
                                                          >= FAMILY_TARGET_VS_EAGER[kind]),
        "mplan_vs_compile>=1": entry.get("mplan_vs_compile", 0.0) >= 1.0,
        "losses_agree": entry["correctness"].get("mplan", {}).get("passed", False),
    }
    clock.log(f"{workload.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
                                               if k.startswith("mplan_") and isinstance(v, float))
              + f"; targets {entry['targets']}")
    running.clear()
    return entry
