"""`mplan bench`: several plans for one model and cluster, side by side.

Each entry of `--plans` is `auto` (the planner's choice) or a manual spec (`tp=8,pp=4`): keys it
fixes are honoured, keys it leaves out are searched. One capture and one cache of sharding solves
serve every entry. A plan that cannot run gets `error` (why) instead of figures. Figures are
predictions; `measured` is filled only by a measurement (`--measure`), with `prediction_error`
(predicted over measured, minus one: the step time, and the peak memory predicted without the
planner's fragmentation margin), or says why the runtime refused that plan (a `PlanError` or a
`ScheduleError`, raised before any collective), or that it ran out of device memory (on every
rank alike, for the symmetric plans the runtime executes). `rankings` orders the measured plans by
prediction and by measurement, which is what a planner must get right.

For an MoE model, a row whose plan uses expert parallelism (ep > 1) also carries `without_ep`: the
best plan the same spec allows with ep=1 (`resolved_spec`, `mesh`, `fits`, `predicted`, `error`,
and `slower`: its predicted step over the chosen one's, minus one), what expert parallelism buys;
`predicted` then has the all-to-all seconds of a step (`a2a_s`, busiest pipeline rank), the
experts per rank and the load imbalance priced (`moe_imbalance`, the `--moe-imbalance` option).
"""
from __future__ import annotations

import csv
import dataclasses
from typing import Any, Callable, Sequence

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.schedule import ScheduleError
from mplan.planner.evaluate import Estimate
from mplan.planner.parallel_config import PlanSpec, PlanSpecError, parse_plan_spec
from mplan.planner.plan import PlanError
from mplan.planner.plan_builder import predicted_of
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner, PlanningError
from mplan.planner.spec_check import check_before_capture

Row = dict[str, Any]


def bench_plans(model: str, cluster: ClusterSpec, global_batch: int, specs: Sequence[str], *,
                seq_len: int | None = None, vocab: int | None = None, measure: bool = False, profile: bool = False,
                moe_imbalance: float = 1.0, progress: Callable[[str], None] | None = None,
                on_row: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """One row per spec, in order; `on_row` sees the rows so far after each one (a measured bench
    on large models takes minutes a plan: what finished survives a run that is cut short)."""
    progress = progress or (lambda _: None)
    # refusals that need no graph come before the capture: the model's own ends the bench, a row's is its error
    check_before_capture("auto", cluster=cluster, global_batch=global_batch, model=model, seq_len=seq_len)
    early = {text: _refused_before_capture(text, cluster, global_batch, model, seq_len) for text in specs}
    planner = None
    if not all(early.values()):
        progress(f"capturing {model}")
        graph = capture_for_planning(model, seq_len=seq_len)
        # priced as mplan runs them: its fused kernels on GPUs and its optimizer's memory
        planner = Planner(graph, cluster, kernels=cluster.device.name != "cpu", runtime="mplan",
                          moe_imbalance=moe_imbalance, progress=progress)
    rows: list[Row] = []
    for text in specs:
        progress(f"planning {text}")
        row: Row = {"spec": text, "mesh": None, "fits": False, "predicted": None, "error": None, "measured": None}
        try:
            if early[text]:
                raise PlanSpecError(early[text])
            spec = parse_plan_spec(text)
            best = planner.search(global_batch, spec).best
        except (PlanSpecError, PlanningError) as exc:
            row["error"] = str(exc)
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            continue
        c = best.config
        row.update(spec=text, resolved_spec=c.spec(), fits=best.fits,
                   mesh={"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "vpp": c.vpp},
                   predicted=_predicted_dict(best))
        if c.ep > 1:
            progress(f"planning {text} without expert parallelism")
            row["without_ep"] = _without_ep(planner, global_batch, spec, best)
        if measure:
            progress(f"measuring {c.spec()}")
            row["measured"] = _measure(model, cluster, best, global_batch=global_batch, seq_len=seq_len,
                                       vocab=vocab, profile=profile)
            if row["measured"].get("step_time_s"):
                allocated = planner.evaluate(c, fast=True, fragmentation=0.0)
                row["measured"]["prediction_error"] = _prediction_error(row["measured"], best, allocated)
            # out here, where nothing of the run is referenced any more (an exception's traceback
            # holds its frames' locals, the model and its module), so the next plan starts bare
            _release_device_memory()
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def _refused_before_capture(text: str, cluster: ClusterSpec, global_batch: int, model: str,
                            seq_len: int | None) -> str | None:
    """Why a row's spec cannot run, found without the graph (`spec_check`), or None."""
    try:
        check_before_capture(text, cluster=cluster, global_batch=global_batch, model=model, seq_len=seq_len)
    except PlanSpecError as exc:
        return str(exc)
    return None


def rankings(rows: Sequence[Row]) -> dict[str, list[str]]:
    """The plans measured, fastest first, by predicted and by measured step time (their specs)."""
    timed = [r for r in rows if r["predicted"] and (r.get("measured") or {}).get("step_time_s")]
    return {"predicted": [r["spec"] for r in sorted(timed, key=lambda r: r["predicted"]["step_time_s"])],
            "measured": [r["spec"] for r in sorted(timed, key=lambda r: r["measured"]["step_time_s"])]}


def _prediction_error(measured: dict[str, Any], predicted: Any, allocated: Any) -> dict[str, Any]:
    """Predicted over measured, minus one (below zero: the planner was low): the step time, and the
    peak memory as the prediction without the planner's fragmentation margin (`allocated`), the
    like of what torch.cuda.max_memory_allocated counts (None off CUDA, where no peak is measured)."""
    peak = measured.get("peak_memory_gib")
    allocated_gib = allocated.peak_memory_bytes / 2**30
    return {"step_time": predicted.step_time_s / measured["step_time_s"] - 1,
            "predicted_allocated_gib": allocated_gib,
            "peak_memory": allocated_gib / peak - 1 if peak else None}


def _measure(model: str, cluster: ClusterSpec, best: Estimate, *, global_batch: int, seq_len: int | None,
             vocab: int | None, profile: bool) -> dict[str, Any]:
    """`best` run for real on this job's ranks, resolved on the cluster it was predicted on (not the
    job's own, `ClusterSpec.local()`), or why it did not run."""
    import torch

    from mplan.measure import measure_plan

    try:
        return measure_plan(model, best.config.spec(), global_batch=global_batch, seq_len=seq_len, vocab=vocab,
                            profile=profile, cluster=cluster)
    except (PlanError, ScheduleError) as exc:  # raised alike on every rank, before any collective
        return {"error": str(exc)}
    except torch.OutOfMemoryError as exc:  # a plan predicted to fit did not
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}


def _release_device_memory() -> None:
    """What the last measured plan left: its objects (reference cycles too) and, on CUDA, the
    allocator's cached blocks, so that each plan is measured from the same empty device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _without_ep(planner: Planner, global_batch: int, spec: PlanSpec, chosen: Estimate) -> Row:
    """The best plan `spec` allows with ep=1, beside the chosen plan with ep > 1."""
    try:
        best = planner.search(global_batch, dataclasses.replace(spec, ep=1)).best
    except PlanningError as exc:
        return {"resolved_spec": None, "mesh": None, "fits": False, "predicted": None, "error": str(exc),
                "slower": None}
    c = best.config
    return {"resolved_spec": c.spec(), "mesh": {"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "vpp": c.vpp},
            "fits": best.fits, "predicted": _predicted_dict(best), "error": None,
            "slower": best.step_time_s / chosen.step_time_s - 1}


def _predicted_dict(estimate: Estimate) -> dict[str, Any]:
    p = predicted_of(estimate)
    doc = {"step_time_s": p.step_time_s, "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu,
           "tokens_per_s": p.tokens_per_s, "bubble_fraction": p.bubble_fraction, "memory_gib": p.memory_gib,
           "compute_s": p.compute_s, "comm_s": p.comm_s}
    if estimate.experts_per_rank:
        doc.update(a2a_s=estimate.a2a_s, experts_per_rank=estimate.experts_per_rank,
                   moe_imbalance=estimate.moe_imbalance)
    return doc


def write_csv(rows: list[Row], path: str) -> None:
    keys = ["step_time_s", "tflops_per_gpu", "mfu", "tokens_per_s", "bubble_fraction", "memory_gib", "a2a_s"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["spec", "resolved_spec", "dp", "tp", "pp", "vpp", "ep", "fits", *keys, "measured_step_time_s",
                    "error"])
        for r in rows:
            for spec, entry in ((r["spec"], r), (f"{r['spec']} (best with ep=1)", r.get("without_ep"))):
                if entry is None:
                    continue
                mesh, p = entry["mesh"] or {}, entry["predicted"] or {}
                measured = (entry.get("measured") or {}).get("step_time_s", "")
                w.writerow([spec, entry.get("resolved_spec") or "",
                            *(mesh.get(k, "") for k in ("dp", "tp", "pp", "vpp", "ep")),
                            entry["fits"], *(p.get(k, "") for k in keys), measured, entry["error"] or ""])
