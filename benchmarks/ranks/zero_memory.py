"""Peak memory of a rank under ZeRO 0-3 on 4 gloo CPU ranks, beside the memory model's prediction.

Issue 33's memory item. One small Llama (`MODEL`, bf16: the dtype the planner prices parameters
in, `ModelFacts.param_dtype`, and the one mplan trains in on GPUs) under `dp=4,zero=Z` with two
micro-batches a replica and global-norm clipping, each level built by `mplan.autoparallel` on the
planner's own plan for that spec on the local `cpu` cluster.

Measured (`peak_of_step`): every allocation and free of the CPU allocator during a training step
(torch.profiler with `profile_memory=True`, after a warm-up step that makes the optimizer state),
added to the bytes of the storages the ParallelModule holds when the profile starts (parameters,
optimizer state, master and gradient shards, buffers: `held_bytes`); the peak is the largest
running total inside the step, from the lowest of three steps whose timelines balance; the level's
figure is its largest rank's. That counts what the memory model prices
(parameters, gradients, optimizer state, gathered units, activations, the flat gradient copies of
the reductions, an op's workspace) and what the process group's backend allocates through torch on
the rank (gloo's reduce-scatter all-reduces a copy of its input), but not the Python heap nor
gloo's own buffers. CPU ranks have no caching allocator, so there is no fragmentation to measure.
Predicted: the Plan's peak of its one stage (`plan.predicted.memory_by_stage`) without the
planner's fragmentation margin (`memory_model.FRAGMENTATION_FRACTION`): what it says the tensors
hold, which is what is measured.

Run (about 25 s on the 2-core CPU machine; the ranks keep `run_ranks`' float64 default dtype, as
the tests that run `measure_level` do):
    PYTHONPATH=. python -m benchmarks.ranks zero-memory -o benchmarks/results/zero_memory-cpu-2026-12-06.json
(that result made before the harness, by `python benchmarks/zero_memory_cpu.py` with the same flags)
tests/test_zero23_memory.py runs the same `measure_level` on every rank and holds each level to
`TOLERANCE`; tests/test_zero23_pipeline_memory.py runs `peak_of_step` under a pipeline.
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.ranks.launch import header, start_ranks

MODEL = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=256,seq=64,vocab=256"
WORLD = 4
GLOBAL_BATCH = 8
MICRO_BATCH = 1
"""Two micro-batches a replica: zero=1 accumulates whole gradients over them, zero 2 and 3
reduce-scatter in each one's backward."""
DTYPE = torch.bfloat16
LEVELS = (0, 1, 2, 3)
TOLERANCE = 0.10
"""Largest |predicted / measured - 1| the test allows at any level (issue 33: within 10%)."""
AT_PEAK_OPS = 10
"""The ops whose allocations made during the step and alive at its peak are reported (largest first)."""
GiB = float(1 << 30)
MEASURED = "zero_memory.measured_step"
"""The profiler range around the measured step (its allocations are the ones counted)."""


# -- what the module holds -------------------------------------------------------------------------
def _tensors(root: object) -> Iterator[torch.Tensor]:
    """Every real tensor `root` reaches through containers, modules, torch optimizers and mplan's
    own objects (their attributes and slots), each object once, with its gradient."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and type(obj).__module__.startswith(("torch", "mplan")) and \
                    "fake" not in type(obj).__name__.lower():
                yield obj
                stack.append(obj.grad)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, nn.Module):
            stack.extend((obj._parameters, obj._buffers, obj._modules))
        elif type(obj).__module__.startswith(("mplan", "torch.optim")) and not isinstance(obj, type):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, slot) for cls in type(obj).__mro__ for slot in getattr(cls, "__slots__", ())
                         if hasattr(obj, slot))


def held_bytes(root: object) -> int:
    """Bytes of the storages `root` holds now, each storage once (views and tied weights share)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _tensors(root)}
    return sum(storages.values())


# -- the allocator's timeline ----------------------------------------------------------------------
def allocations(prof: Any) -> tuple[list[tuple[int, int, int, str]], tuple[int, int]]:
    """(time ns, bytes: + allocated / - freed, address, the op that did it) of every CPU allocation
    event, in time order, and the measured step's (start, end)."""
    from torch._C._profiler import _EventType

    events, window = [], (0, 0)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.name == MEASURED:
            window = (event.start_time_ns, event.end_time_ns)
        elif event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            events.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr, _op_of(event)))
    events.sort(key=lambda e: e[0])
    return events, window


_ALLOCATING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
               "aten::resize_", "aten::new_empty", "aten::new_zeros")


def _op_of(event: Any) -> str:
    """The op an allocation serves: its first ancestor that is not itself an allocation op, under
    the collective it runs in, if any."""
    names = []
    parent = event.parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.parent
    collective = next((n for n in names if n.startswith("c10d::")), None)
    own = next((n for n in names if n not in _ALLOCATING), "(no op)")
    return f"{own} in {collective}" if collective and collective != own else own


def _profiled_peak(module: object, step: Callable[[], object]) -> dict[str, Any]:
    """One `step()` under the CPU allocator's profile: its peak (bytes `module` holds at the start
    plus the running total of allocations), what was allocated in it and alive at the peak (by op),
    and `unaccounted_bytes`: what the timeline ends above the bytes `module` holds after the step."""
    gc.collect()
    start = held_bytes(module)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(MEASURED):
            step()
    end = held_bytes(module)
    events, (first, last) = allocations(prof)
    total, peak, live, at_peak = start, start, {}, {}
    for time_ns, size, address, op in events:
        if size > 0:
            live[address] = (size, op)
        else:
            live.pop(address, None)
        total += size
        if first <= time_ns <= last and total > peak:
            peak, at_peak = total, dict(live)
    by_op: dict[str, int] = {}
    for size, op in at_peak.values():
        by_op[op] = by_op.get(op, 0) + size
    return {"peak_bytes": peak, "step_start_bytes": start, "unaccounted_bytes": total - end,
            "at_peak_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:AT_PEAK_OPS])}


def peak_of_step(module: object, step: Callable[[], object], *, repeats: int = 3) -> dict[str, Any]:
    """The peak of `step()`, a collective step every rank runs alike: one unprofiled warm-up (the
    optimizer state exists from the first update on), then `repeats` profiled steps, and the lowest
    peak of those whose timeline balances (every byte allocated freed in the step or held by
    `module` after it), else of all. The profiler records what the threads it profiles allocate
    and free; gloo's worker thread sometimes drops the last reference to a finished reduce-scatter
    and frees its copy of the input unrecorded, and every sample after that reads high. A step's peak does not
    change from step to step (the same program on the same shapes), so an unbalanced one is set
    aside, not averaged in; the one returned carries its `unaccounted_bytes` (0: balanced)."""
    step()
    runs = [_profiled_peak(module, step) for _ in range(repeats)]
    return min(runs, key=lambda run: (run["unaccounted_bytes"] != 0, run["peak_bytes"]))


# -- one level -------------------------------------------------------------------------------------
def predicted(plan: Any) -> dict[str, float]:
    """The Plan's memory of its (one) stage in bytes, without the planner's fragmentation margin."""
    from mplan.cost_models.memory_model import FRAGMENTATION_FRACTION

    (stage,) = plan.predicted.memory_by_stage
    total = stage.total_gib * GiB / (1 + FRAGMENTATION_FRACTION)
    return {"params": stage.params_gib * GiB, "grads": stage.grads_gib * GiB, "optimizer": stage.optimizer_gib * GiB,
            "activations": stage.activations_gib * GiB,
            "workspace": stage.transient_gib * GiB - (stage.total_gib * GiB - total), "total": total}


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from mplan.models import resolve_model

    source = resolve_model(MODEL)
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, source.vocab, (GLOBAL_BATCH, source.seq_len), generator=generator)
                  for _ in range(2)) for _ in range(steps)]


def measure_level(zero: int) -> dict[str, Any]:
    """On every rank of a group of `WORLD`: `MODEL` under dp=WORLD at `zero`, its measured peak
    during a step (`peak_of_step`) beside the Plan's prediction (bytes)."""
    import mplan
    from mplan.models import build_model

    data = _data(2)
    pm = mplan.autoparallel(build_model(MODEL, device="cpu", dtype=DTYPE, seed=0), example_inputs=(data[0][0],),
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), global_batch=GLOBAL_BATCH,
                            plan=f"dp={WORLD},zero={zero}", micro_batch_size=MICRO_BATCH, max_grad_norm=1.0,
                            progress="quiet")
    steps = itertools.cycle(data)
    measured = peak_of_step(pm, lambda: pm.train_step(*next(steps)))
    expected = predicted(pm.plan)
    return {"zero": zero, "plan": pm.plan.spec(), **measured, "predicted": expected,
            "error": expected["total"] / measured["peak_bytes"] - 1}


def measure_levels(levels: tuple[int, ...]) -> list[dict[str, Any]]:
    return [measure_level(zero) for zero in levels]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the levels, model and world are the tests' own."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_rank = start_ranks(WORLD, measure_levels, LEVELS, timeout_s=900, default_dtype=torch.float64)
    rows = []
    for ranks in zip(*per_rank):
        worst = max(ranks, key=lambda row: row["peak_bytes"])  # the peak per rank is the largest rank's
        rows.append({**worst, "peak_bytes_by_rank": [row["peak_bytes"] for row in ranks]})
    print("| zero | measured peak (MB) | predicted (MB) | predicted / measured - 1 |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['zero']} | {row['peak_bytes'] / 1e6:.2f} | {row['predicted']['total'] / 1e6:.2f} | "
              f"{row['error']:+.1%} |")
    return {**header(torch.device("cpu")), "model": MODEL, "dtype": str(DTYPE).removeprefix("torch."),
            "world": WORLD, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "tolerance": TOLERANCE,
            "levels": rows}
