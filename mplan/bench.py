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

One row's failure is that row's alone: anything a row raises (a bug in a pass included) becomes its
`error`, with the exception's type and where it was raised, and the next row runs. Under torchrun
(`--measure`) every rank must then agree: a row that failed on one rank (a pass that fails on one
pipeline stage only) must fail on all, or the others would wait forever in the row's first
collective. The ranks exchange their errors on a gloo group of their own (`_RowAgreement`) at
fixed points of every row: once it is planned, once its program is built (before the first step's
collectives), and at its end; a rank that failed attends the points left with its error. A rank
that fails inside a step while the others wait in one of the step's collectives cannot be rescued
in the process: it waits at the next point until the group's timeout (`AGREEMENT_TIMEOUT_S`), then
raises (its own error printed as the context), and torchrun stops the others; the rows written so
far (`--out`) stay.

For an MoE model, a row whose plan uses expert parallelism (ep > 1) also carries `without_ep`: the
best plan the same spec allows with ep=1 (`resolved_spec`, `mesh`, `fits`, `predicted`, `error`,
and `slower`: its predicted step over the chosen one's, minus one), what expert parallelism buys;
`predicted` then has the all-to-all seconds of a step (`a2a_s`, busiest pipeline rank), the
experts per rank and the load imbalance priced (`moe_imbalance`, the `--moe-imbalance` option).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import traceback
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
from mplan.progress import Progress

Row = dict[str, Any]
AGREEMENT_TIMEOUT_S = 600.0
"""How long a rank waits for the others at a row's agreement point: longer than a measured row
takes on the largest models benched (minutes), so it only ends a job whose ranks can no longer meet."""
REFUSALS = (PlanSpecError, PlanningError, PlanError, ScheduleError)
"""mplan's own refusals: their message is one line for users and says the cause already."""


def bench_plans(model: str, cluster: ClusterSpec, global_batch: int, specs: Sequence[str], *,
                seq_len: int | None = None, vocab: int | None = None, measure: bool = False, profile: bool = False,
                moe_imbalance: float = 1.0, progress: Progress | Callable[[str], None] | str | None = None,
                on_row: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """One row per spec, in order; `on_row` sees the rows so far after each one (a measured bench
    on large models takes minutes a plan: what finished survives a run that is cut short)."""
    progress = Progress.of(progress if progress is not None else "quiet")
    # refusals that need no graph come before the capture: the model's own ends the bench, a row's is its error
    check_before_capture("auto", cluster=cluster, global_batch=global_batch, model=model, seq_len=seq_len)
    early = {text: _refused_before_capture(text, cluster, global_batch, model, seq_len) for text in specs}
    planner = None
    if not all(early.values()):
        with progress.phase("capture", model):
            graph = capture_for_planning(model, seq_len=seq_len)
        # priced as mplan runs them: its fused kernels on GPUs and its optimizer's memory
        planner = Planner(graph, cluster, kernels=cluster.device.name != "cpu", runtime="mplan",
                          moe_imbalance=moe_imbalance, progress=progress)
    agreement = _RowAgreement.of_job() if measure else _RowAgreement(None)
    rows: list[Row] = []
    for number, text in enumerate(specs, start=1):
        row: Row = {"spec": text, "mesh": None, "fits": False, "predicted": None, "error": None, "measured": None}
        with progress.phase(f"row {number}/{len(specs)}", text) as told:
            _run_row(row, text, early=early[text], planner=planner, agreement=agreement, model=model,
                     cluster=cluster, global_batch=global_batch, seq_len=seq_len, vocab=vocab, measure=measure,
                     profile=profile, progress=progress)
            told.detail = f"{text}: {_row_words(row)}"
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def _run_row(row: Row, text: str, *, early: str | None, planner: Planner | None, agreement: _RowAgreement,
             model: str, cluster: ClusterSpec, global_batch: int, seq_len: int | None, vocab: int | None,
             measure: bool, profile: bool, progress: Progress) -> None:
    """Plan (and measure) one row in place; whatever it raises becomes its error."""
    agreement.begin_row()
    try:
        best = _plan_row(planner, row, text, early, global_batch, progress)
        agreement.point()  # planned
        if measure and best is not None:
            progress(f"measuring {best.config.spec()}")
            row["measured"] = _measure(model, cluster, best, global_batch=global_batch, seq_len=seq_len,
                                       vocab=vocab, profile=profile, built=agreement.point)
            if row["measured"].get("step_time_s"):
                row["measured"]["prediction_error"] = _prediction_error(row["measured"], row["predicted"])
        errors = agreement.finish(None)
    except Exception as exc:  # noqa: BLE001 - any failure is this row's, reported in it; the next row runs
        errors = agreement.finish(None if isinstance(exc, _FailedElsewhere) else _failure(exc))
    if errors:
        said = "; ".join(message for message, _ in errors)
        refused = measure and row["predicted"] is not None
        if refused:  # the runtime did not run the plan predicted
            row["measured"] = {"error": said}
        if not refused or not all(refusal for _, refusal in errors):  # a crash is the row's error too
            row["error"] = said
    if measure:
        # out here, where nothing of the run is referenced any more (an exception's traceback
        # holds its frames' locals, the model and its module), so the next plan starts bare
        _release_device_memory()


def _row_words(row: Row) -> str:
    """A finished row in a few words for its progress line: its step, measured too, or its error."""
    if row["error"]:
        return row["error"].split("\n")[0][:120]
    words = f"predicted {row['predicted']['step_time_s'] * 1e3:.1f} ms" if row["predicted"] else "not planned"
    measured = row.get("measured") or {}
    if measured.get("step_time_s"):
        words += f", measured {measured['step_time_s'] * 1e3:.1f} ms"
    elif measured.get("error"):
        words += f", not run: {measured['error'][:80]}"
    return words


def _plan_row(planner: Planner | None, row: Row, text: str, early: str | None, global_batch: int,
              progress: Progress) -> Estimate | None:
    """Fill `row`'s plan and predicted figures; None (and `error`) where the spec is refused,
    `early` when that needed no graph."""
    progress(f"planning {text}")
    try:
        if early:
            raise PlanSpecError(early)
        spec = parse_plan_spec(text)
        best = planner.search(global_batch, spec).best
    except (PlanSpecError, PlanningError) as exc:
        row["error"] = str(exc)
        return None
    c = best.config
    row.update(spec=text, resolved_spec=c.spec(), fits=best.fits,
               mesh={"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "vpp": c.vpp, "cp": c.cp, "sites": c.sites},
               predicted=_predicted_dict(best))
    # the peak without the planner's fragmentation margin: what torch.cuda.max_memory_allocated counts
    row["predicted"]["allocated_gib"] = planner.evaluate(c, fast=True, fragmentation=0.0).peak_memory_bytes / 2**30
    if c.ep > 1:
        progress(f"planning {text} without expert parallelism")
        row["without_ep"] = _without_ep(planner, global_batch, spec, best)
    return best


Failure = tuple[str, bool]
"""What a rank reports of a failed row: one line saying the cause, and whether it is a refusal
(mplan's own, or the device's memory running out) rather than a crash."""


def _failure(exc: BaseException) -> Failure:
    """A refusal's own message; anything else its type, its message's first line and the
    innermost frame that raised it (where a bug is found)."""
    import torch

    if isinstance(exc, REFUSALS):
        return str(exc), True
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):  # a plan predicted to fit did not
        return f"out of memory: {first}", True
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {first}{where}", False


class _FailedElsewhere(Exception):
    """Another rank reported an error at an agreement point: this rank abandons the row too."""


class _RowAgreement:
    """The ranks of a measured bench agree on each row's fate (module docstring).

    Each row has the same `POINTS` points on every rank: planned, built, finished. At each the
    ranks all-gather their `Failure` (None: none so far) on a gloo group used for nothing else, so
    that an agreement's message never pairs with a collective of the plan being measured. A rank
    that failed attends the points it skipped with its error (`finish`); one that learns of an
    error at a point raises `_FailedElsewhere` and does the same. Every rank ends the row with the
    same errors, each named by its rank. Without a process group (one process) it only collects."""

    POINTS = 3

    def __init__(self, group: Any) -> None:
        self.group = group
        self.attended = 0
        self.errors: list[Failure] = []

    @classmethod
    def of_job(cls) -> _RowAgreement:
        """The agreement of this torchrun job (initializing its process group, as `autoparallel`
        would), or of one process when there is no job."""
        import torch.distributed as dist

        from mplan.runtime.launch import init_distributed_from_env

        world = init_distributed_from_env()
        if world is None or dist.get_world_size() == 1:
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=AGREEMENT_TIMEOUT_S)))

    def begin_row(self) -> None:
        self.attended, self.errors = 0, []

    def point(self) -> None:
        """Meet the other ranks; raise `_FailedElsewhere` if any of them reported a failure."""
        self._meet(None)
        if self.errors:
            raise _FailedElsewhere(self.errors[0][0])

    def finish(self, failure: Failure | None) -> list[Failure]:
        """Attend the points left in this row (reporting `failure`, this rank's); the row's failures."""
        while self.attended < self.POINTS:
            self._meet(failure)
        return self.errors

    def _meet(self, failure: Failure | None) -> None:
        self.attended += 1
        if self.group is None:
            reported: list[Any] = [failure]
        else:
            import torch.distributed as dist

            reported = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(reported, failure, group=self.group)  # tuples of str and bool, from our ranks
        for rank, reported_failure in enumerate(reported):
            if reported_failure is None:
                continue
            message, refusal = reported_failure
            named = (f"rank {rank}: {message}" if self.group is not None else message, bool(refusal))
            if named not in self.errors:
                self.errors.append(named)


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


def _prediction_error(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Predicted over measured, minus one (below zero: the planner was low): the step time, and the
    peak memory as the prediction without the planner's fragmentation margin (`allocated_gib`), the
    like of what torch.cuda.max_memory_allocated counts (None off CUDA, where no peak is measured)."""
    peak = measured.get("peak_memory_gib")
    allocated_gib = predicted["allocated_gib"]
    return {"step_time": predicted["step_time_s"] / measured["step_time_s"] - 1,
            "predicted_allocated_gib": allocated_gib,
            "peak_memory": allocated_gib / peak - 1 if peak else None}


def _measure(model: str, cluster: ClusterSpec, best: Estimate, *, global_batch: int, seq_len: int | None,
             vocab: int | None, profile: bool, built: Callable[[], None]) -> dict[str, Any]:
    """`best` run for real on this job's ranks, resolved on the cluster it was predicted on (not the
    job's own, `ClusterSpec.local()`); a failure, a refusal or not, is raised for the row's
    agreement to report. `built` is called once the plan's program is built."""
    from mplan.measure import measure_plan

    return measure_plan(model, best.config.spec(), global_batch=global_batch, seq_len=seq_len, vocab=vocab,
                        profile=profile, cluster=cluster, built=built)


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
    return {"resolved_spec": c.spec(), "mesh": {"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "vpp": c.vpp, "cp": c.cp,
                                                 "sites": c.sites},
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
