"""The method every kernel case shares: check against fp32, time interleaved, measure peak, judge.

An `Op` is one operation at one shape: a factory of its inputs, its systems (mplan's variants, whose
names start with "mplan" or are named in `mine`, and its peers; each a factory, so that a missing
package or function fails that system alone) and the function run in fp32 as the reference.
`measure` checks, warms, times and measures every system of an op:
    correctness  outputs and every input gradient of one call in the benchmark's dtype against the
                 reference run in fp32 on the upcast inputs (the same upstream gradient), relative
                 error in norm; a system passes within max(1e-2, 2x the baseline's error), the
                 baseline being the reference itself run in the benchmark's dtype (eager)
    timing       two clocks: the GPU's kernel time from the profiler (benchmarks/gpu_time.py), medians
                 of `rounds` rounds over the op's systems taken in turn (fwd_ms, fwd_bwd_ms: the
                 figures judged, since in a GPU-bound step the host runs ahead), and CUDA events
                 around the call (triton.testing.do_bench medians, L2 flushed: event_fwd_ms,
                 event_fwd_bwd_ms), which for a ~0.1 ms kernel mostly measure the host's overhead
    peak         torch.cuda.max_memory_allocated during one forward+backward from a reset, above
                 what was allocated before it (every system's inputs), in MB
`versus_best_peer` is the verdict: the fastest peer's time over mplan's fastest variant's (> 1:
mplan faster). The shared flags are `--device` and `--small`: `--device cpu --small` is a case's
smoke mode, in which wall-clock time stands in for both clocks and peak is None (Triton's kernels
run under TRITON_INTERPRET=1 where the case says so).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.gpu_time import copy_tbps, interleaved_kernel_ms, kernel_table
from benchmarks.report import Clock, package_versions, run_header, write_report

MB = 2**20
Fn = Callable[..., Any]
Clocks = tuple[str, ...]


def header(device: torch.device, *packages: str) -> dict[str, Any]:
    """`report.run_header` and the versions of `packages` (None where not installed)."""
    return {**run_header(device), **package_versions(*packages)}


def save_partial(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The report so far at --out, marked partial (the harness writes the whole one at the end):
    what a run cut off by the device's time limit leaves."""
    write_report(args.out, {"partial": True, **report})


def guarded(name: str, measure: Callable[[], dict[str, Any]], clock: Clock, budget_s: float | None = None,
            summary: Callable[[dict[str, Any]], str] = lambda entry: "done") -> dict[str, Any]:
    """`measure()`, or {"error": ...} where it raised or the run is past `budget_s`: one item's
    failure must not lose the others' numbers. Logs a line either way; frees the GPU's cache."""
    if budget_s is not None and clock.elapsed() > budget_s:
        entry: dict[str, Any] = {"error": f"skipped: past the {budget_s:.0f} s budget"}
    else:
        try:
            entry = measure()
        except Exception:  # noqa: BLE001 - reported in the entry, the run goes on
            entry = {"error": traceback.format_exc()}
    clock.log(f"{name}: " + ("ERROR " + entry["error"].strip().splitlines()[-1] if "error" in entry
                             else summary(entry)))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return entry


def leaf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, scale: float = 1.0,
         shift: float = 0.0) -> torch.Tensor:
    """shift + scale * N(0, 1), drawn in fp32, cast to `dtype`, requiring grad."""
    return (shift + scale * torch.randn(shape, device=device, dtype=torch.float32)).to(dtype).requires_grad_()


def outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def leaves(inputs: list[Any]) -> list[torch.Tensor]:
    return [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]


def forward_backward(fn: Fn, inputs: list[Any], upstream: list[torch.Tensor], into_grad: bool = False) -> Any:
    """fn(*inputs) and the gradients of its inputs: returned (autograd.grad), or left in their
    .grad (cleared first) as a training step leaves them with `into_grad`."""
    if into_grad:
        for tensor in leaves(inputs):
            tensor.grad = None
        outs = outputs(fn(*inputs))
        torch.autograd.backward(outs, upstream)
        return outs, tuple(tensor.grad for tensor in leaves(inputs))
    outs = outputs(fn(*inputs))
    return outs, torch.autograd.grad(outs, leaves(inputs), upstream)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (the absolute norm where expected is zero)."""
    scale = expected.float().norm().item()
    error = (actual.float() - expected.float()).norm().item()
    return error / scale if scale else error


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation at one shape.

    make          its inputs (drawn after a seed of 0: the same values on every call); floating
                  tensors that require grad are differentiated, the rest are constants
    systems       name -> factory of the system's function (ImportError/AttributeError: unavailable)
    reference     run in fp32 on the upcast inputs: what every system's results are held against
    baseline      the system whose errors, doubled, are the tolerance
    mine          mplan's variants besides those whose names start with "mplan" (the rest are peers)
    scalar_output a loss: the backward starts from 1.0 (as in training), else from a random upstream
    own_inputs    each system gets its own inputs (some peers write into theirs), else all share one set
    into_grad     gradients go to .grad, cleared at each call: the peak excludes the previous call's
    gpu_only      systems that cannot run on a CPU (Triton GPU kernels outside mplan)
    describe      further fields of a system's row from its checked call's outputs and gradients
    """

    name: str
    make: Callable[[], list[Any]]
    systems: dict[str, Callable[[], Fn]]
    reference: Fn
    baseline: str = "eager"
    mine: tuple[str, ...] = ()
    scalar_output: bool = False
    own_inputs: bool = True
    into_grad: bool = False
    gpu_only: tuple[str, ...] = ()
    describe: Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], dict[str, Any]] | None = None

    def is_mine(self, system: str) -> bool:
        return system.startswith("mplan") or system in self.mine

    def inputs(self) -> list[Any]:
        torch.manual_seed(0)
        return self.make()


def upstream_for(op: Op, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    if op.scalar_output:
        return [torch.ones_like(out) for out in outs]
    generator = torch.Generator(device=outs[0].device).manual_seed(1)
    return [torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32).to(out.dtype)
            for out in outs]


def system_fn(op: Op, name: str, device: torch.device) -> Fn | str:
    """The system's function, or why it cannot run here (a missing package or function, a GPU kernel on a CPU)."""
    try:
        fn = op.systems[name]()
    except (ImportError, AttributeError) as error:
        return f"skipped: unavailable here ({type(error).__name__}: {error})"
    if name in op.gpu_only and device.type != "cuda":
        return f"skipped: {name}'s kernels are Triton GPU kernels"
    return fn


def failure() -> dict[str, str]:
    """A system's row when it raised: the last line of the traceback, and the traceback."""
    return {"error": traceback.format_exc().strip().splitlines()[-1], "traceback": traceback.format_exc()}


def check(op: Op, fns: dict[str, Fn]) -> tuple[dict[str, dict[str, Any]], list[torch.Tensor]]:
    """Each function's errors against the fp32 reference ({out0.., grad0..: relative error}, their
    max and, where the baseline ran, whether within max(1e-2, 2x its errors); check_s: the call's
    seconds, a first call's: compiles and autotuning; or the error it raised), and the upstream."""
    inputs = op.inputs()
    upstream = upstream_for(op, outputs(op.reference(*inputs)))
    wide = [a.detach().float().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            and a.is_floating_point() else a for a in inputs]
    exact_outs, exact_grads = forward_backward(op.reference, wide, [u.float() for u in upstream])
    names = [f"out{i}" for i in range(len(exact_outs))] + [f"grad{i}" for i in range(len(exact_grads))]
    rows: dict[str, dict[str, Any]] = {}
    for name, fn in fns.items():
        try:
            start = time.perf_counter()
            outs, grads = forward_backward(fn, op.inputs(), [u.clone() for u in upstream], op.into_grad)
            seconds = time.perf_counter() - start
            errors = {key: rel(got, want)
                      for key, got, want in zip(names, (*outs, *grads), (*exact_outs, *exact_grads))}
            rows[name] = {"check_s": seconds, "errors": errors, "max_rel_error": max(errors.values()),
                          **(op.describe(outs, grads) if op.describe else {})}
        except Exception:  # noqa: BLE001 - one system's failure must not lose the others
            rows[name] = failure()
    baseline = rows.get(op.baseline, {}).get("errors")
    for row in rows.values():
        if baseline is not None and "errors" in row:
            row["passed"] = all(value <= max(1e-2, 2 * baseline[key]) for key, value in row["errors"].items())
    return rows, upstream


def measure(op: Op, device: torch.device, *, rounds: int, iters: int, log: Callable[[str], None],
            clocks: Clocks = ("fwd", "fwd_bwd"), events: bool = True, peak: bool = True,
            profile: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Every system of `op`: checked, warmed (warmup_s: the check's call and this one, compiles and
    autotuning included), timed on `clocks` (both clocks, or the kernel time alone without
    `events`), its peak measured; `profile`: systems whose calls also get a per-kernel profile. A
    system that is unavailable or fails is reported with its error, the others go on."""
    fns: dict[str, Fn] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in op.systems:
        fn = system_fn(op, name, device)
        if isinstance(fn, str):
            rows[name] = {"error": fn}
        else:
            fns[name] = fn
    checked, upstream = check(op, fns)
    rows.update({name: row for name, row in checked.items() if "error" in row})
    shared = None if op.own_inputs else op.inputs()
    timer = event_timer(device)
    calls: dict[tuple[str, str], Callable[[], Any]] = {}
    for name, fn in fns.items():
        if name in rows:
            continue
        try:
            inputs = shared if shared is not None else op.inputs()
            grads_in = [u.clone() for u in upstream]
            start = time.perf_counter()
            forward_backward(fn, inputs, grads_in, op.into_grad)
            mine = {"fwd": lambda fn=fn, inputs=inputs: fn(*inputs),
                    "fwd_bwd": lambda fn=fn, inputs=inputs, grads_in=grads_in: forward_backward(
                        fn, inputs, grads_in, op.into_grad)}
            row = {"warmup_s": round(checked[name].pop("check_s") + time.perf_counter() - start, 2), **checked[name]}
            if events:
                row.update({f"event_{what}_ms": timer(mine[what]) for what in clocks})
            if peak:
                row["peak_mb"] = peak_mb(mine["fwd_bwd"], device)
            rows[name] = row
            calls.update({(name, what): mine[what] for what in clocks})
        except Exception:  # noqa: BLE001 - one system's failure must not lose the others
            rows[name] = failure()
    for name, row in rows.items():
        if "error" in row:
            log(f"  {op.name} {name}: {row['error']}")
    kernel_times(calls, rows, device, rounds, iters)
    for name in profile:
        if (name, "fwd_bwd") in calls and device.type == "cuda":
            rows[name].update(kernel_profile(calls[(name, "fwd_bwd")], iters))
    return {name: rows[name] for name in op.systems}


def kernel_times(calls: dict[tuple[str, str], Callable[[], Any]], rows: dict[str, dict[str, Any]],
                 device: torch.device, rounds: int, iters: int) -> None:
    """{clock}_ms: GPU kernel time, medians of interleaved rounds, with their range and the rounds
    in order (they pair with the other systems'), on CUDA; wall-clock time of one call elsewhere."""
    if device.type != "cuda":
        for (name, what), call in calls.items():
            rows[name][f"{what}_ms"] = wall_ms(call)
        return
    for (name, what), values in interleaved_kernel_ms(calls, rounds=rounds, iters=iters).items():
        rows[name][f"{what}_ms"] = statistics.median(values)
        rows[name][f"{what}_range_ms"] = [round(min(values), 5), round(max(values), 5)]
        rows[name][f"{what}_rounds_ms"] = [round(v, 5) for v in values]


def kernel_profile(call: Callable[[], Any], iters: int) -> dict[str, Any]:
    """Where a call's GPU time goes: ms per call of its 12 largest kernels, and kernels launched per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    table = kernel_table(prof)
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"kernels_ms": {k[:80]: t / iters for k, t in list(table.items())[:12]}, "launches": launches / iters}


def wall_ms(fn: Callable[[], Any]) -> float:
    """The smoke mode's stand-in for both clocks (no events on a CPU): one call after a warm one."""
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def event_timer(device: torch.device, warmup: int = 25, rep: int = 100,
                mode: str = "median") -> Callable[[Callable[[], Any]], float]:
    """CUDA events around the call (triton.testing.do_bench: L2 flushed, host included) on a GPU."""
    if device.type != "cuda":
        return wall_ms
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=mode)


def copy_bandwidth_tbps(device: torch.device) -> float:
    """gpu_time.copy_tbps (a 1 GiB copy, kernel time) on a GPU; a 64 KiB copy's wall-clock on a CPU."""
    if device.type == "cuda":
        return copy_tbps()
    src = torch.randn(1 << 15, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / wall_ms(lambda: dst.copy_(src)) / 1e9


def memory_during(call: Callable[[], Any], device: torch.device) -> dict[str, int] | None:
    """Bytes allocated before a call, at its peak (max_memory_allocated from a reset) and after it
    (its result dropped); None off CUDA."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return {"before": before, "peak": peak, "after": torch.cuda.memory_allocated()}


def peak_mb(call: Callable[[], Any], device: torch.device) -> float | None:
    """max_memory_allocated during one call above what was allocated before it, in MB."""
    memory = memory_during(call, device)
    return None if memory is None else (memory["peak"] - memory["before"]) / MB


def summary(rows: dict[str, dict[str, Any]]) -> str:
    """A log line: each timed system's fwd/fwd+bwd ms, peak MB and largest error."""
    return "; ".join(f"{name} " + (f"{row['fwd_ms']:.3f}/" if "fwd_ms" in row else "") + f"{row['fwd_bwd_ms']:.3f} ms"
                     + (f", {row['peak_mb']:.0f} MB" if row.get("peak_mb") is not None else "")
                     + f" err {row['max_rel_error']:.1e}" for name, row in rows.items() if "fwd_bwd_ms" in row)


def versus_best_peer(op: Op, rows: dict[str, dict[str, Any]], clocks: Clocks = ("fwd_bwd", "fwd"),
                     ) -> dict[str, Any]:
    """Per clock: the fastest peer's time over mplan's fastest variant's (> 1: mplan faster), which
    two those are, and the ratio for each of mplan's variants; {} where either side has no time."""
    verdict: dict[str, Any] = {}
    for what in clocks:
        timed = {name: row[f"{what}_ms"] for name, row in rows.items() if f"{what}_ms" in row}
        mine = [name for name in timed if op.is_mine(name)]
        peers = [name for name in timed if not op.is_mine(name)]
        if not mine or not peers:
            return {}
        best_mine, best_peer = min(mine, key=timed.__getitem__), min(peers, key=timed.__getitem__)
        verdict[what] = {"ratio": timed[best_peer] / timed[best_mine], "mplan": best_mine, "peer": best_peer,
                         "by_variant": {name: timed[best_peer] / timed[name] for name in mine}}
    return verdict
