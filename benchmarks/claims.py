"""The figures README.md and docs/*.md quote, checked against the results files they cite.

    python benchmarks/report.py --check          # exit 1 on any drift; CI runs it (tests/test_claims.py)
    python benchmarks/report.py --check --list   # also every cited row's figures no claim checks yet

Input: the repository's README.md and docs/*.md, and benchmarks/results/ (or the one source file
a claim names, e.g. tests/zoo_models.py). Output: a `ClaimsReport`: `problems` (each one line
naming the doc, the figure and the file) and `unchecked` (figures in cited rows that no claim
covers: reported, not failed, so that registering the rest can go row by row).

A doc is cut into units: each table row is one, each paragraph (lines between blank lines, table
rows excluded) another, its line breaks read as spaces. A `Claim` is a regular expression whose
groups are figures; it must match in its doc, in a unit that cites its source file by name (the
figure sits next to its citation), and each group must read exactly what `figures` prints from
that file, with the doc's rounding. So a figure that drifts from its file, a file that is
renamed, or a sentence rewritten without its claim fails the check.

Also failed: a dated results file cited anywhere that benchmarks/results/ does not hold, and a
citation of a file marked `hand_assembled` from a unit that does not say "hand-assembled".
"""
from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
CITABLE = (RESULTS, "mplan/cost_models/reference")
"""Where a dated file the docs cite may live: the results, and the measurements shipped with mplan."""

HAND_ASSEMBLED = "hand_assembled"
"""The top-level key that marks a results file no script wrote whole (its value says what was done
by hand); a doc that cites such a file must say it is hand-assembled."""


# -- how the docs print numbers ------------------------------------------------------------------
def fixed(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"


def percent(x: float, digits: int = 1, sign: bool = False) -> str:
    """0.0316 -> '3.2%' ('+3.2%' with sign)."""
    return f"{x * 100:{'+' if sign else ''}.{digits}f}%"


def sci(x: float, digits: int = 1) -> str:
    """1.06e-13 -> '1.1e-13'; digits=0: '2e-16'; 5.77e-6 -> '5.8e-06' (Python's exponent, as the tables print it)."""
    return f"{x:.{digits}e}"


def span(values: Sequence[float], fmt: Callable[[float], str], sep: str = "-") -> str:
    """The smallest and largest of `values` as the docs write a range: '704-1061'."""
    return f"{fmt(min(values))}{sep}{fmt(max(values))}"


WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def _host_factor(data: dict) -> tuple[str, ...]:
    """host_factor_fit: the seven steps measured (ms), the bare figures' worst error, the held-out
    worst with the factor, and the two 1.7B configs' micro-batch-8 errors."""
    rows = {(r["model"], r["mbs"]): r for r in data["rows"]}
    order = [("qwen2-0.5b", 1), ("qwen2-0.5b", 2), ("qwen2-0.5b", 8), ("qwen3", 1), ("qwen3", 8), ("smollm2", 1),
             ("smollm2", 8)]
    held = [r for r in data["rows"] if not r["fitted_on"]]
    return (*(fixed(rows[k]["measured_step_s"] * 1e3, 0) for k in order),
            fixed(max(abs(r["error_as_measured"]) for r in held) * 100, 0),
            percent(data["held_out_worst_error_fitted"]),
            percent(rows[("qwen3", 8)]["error_fitted"], sign=True), percent(rows[("smollm2", 8)]["error_fitted"], sign=True))


def _train_gpu(data: dict) -> tuple[str, ...]:
    """train_gpu (issue 32): the run's median step, its prediction and error, MFU, peak and their
    predictions, the spread, the slow step, the first and last losses."""
    (slow,) = data["slow_steps (over 1.15x the median)"]
    return (fixed(data["step_time_median_s"] * 1e3, 0), fixed(data["predicted_step_time_s"] * 1e3, 0),
            percent(data["step_time_prediction_error"], sign=True), percent(data["mfu_median"]),
            percent(data["predicted_mfu"]), fixed(data["peak_memory_gib"]), fixed(data["predicted_memory_gib"]),
            percent(data["memory_prediction_error"], sign=True), percent(data["step_time_cv_without_slow_steps"]),
            fixed(slow[1], 2), fixed(data["loss_first"], 2), fixed(data["loss_mean_last_10"], 2))


def _train_gpu_checkpoint(data: dict) -> tuple[str, ...]:
    row = data["checkpoint_time (issue 31, benchmarks/checkpoint_time.py)"]["rows"][0]
    return (fixed(row["checkpoint_bytes"] / 1e9), fixed(row["save_blocking_s"]), fixed(row["save_gb_per_s"], 2),
            fixed(row["background_stall_s"]), fixed(row["step_during_background_save_s"] * 1e3, 0),
            fixed(row["step_s"] * 1e3, 0), fixed(row["load_same_plan_s"]), fixed(row["load_other_plan_s"]))


def _train_gpu_zero(data: dict) -> tuple[str, ...]:
    plans = next(v for k, v in data.items() if k.startswith("zero_bench"))["plans"]
    measured = [p["measured"] for p in plans]
    return (" / ".join(fixed(m["peak_memory_gib"]) for m in measured),
            " / ".join(percent(-m["prediction_error"]["step_time"], 0) for m in measured),
            " / ".join(fixed(m["step_time_s"] * 1e3, 0) for m in measured))



def _zero_bench_h100(data: dict) -> tuple[str, ...]:
    """Each plan's measured and predicted step (ms), then its measured peak and the predicted
    tensor bytes without the allocator margin (GiB)."""
    rows = data["plans"]
    return (" / ".join(fixed(p["measured"]["step_time_s"] * 1e3) for p in rows),
            " / ".join(fixed(p["predicted"]["step_time_s"] * 1e3) for p in rows),
            " / ".join(fixed(p["measured"]["peak_memory_gib"], 2) for p in rows),
            " / ".join(fixed(p["measured"]["prediction_error"]["predicted_allocated_gib"], 2) for p in rows))


def _peers(names: tuple[str, ...]) -> Callable[[dict], tuple[str, ...]]:
    """Each named family's ratio to its fastest peer, mplan's and that peer's step (ms), then the
    spread of mplan's and compile's steps (coefficient of variation, %) over the file's families."""
    def figures(data: dict) -> tuple[str, ...]:
        out = []
        for name in names:
            f = data["families"][name]
            out += [fixed(f["mplan_vs_best_peer"], 3), fixed(f["systems"]["mplan"]["step_s"] * 1e3),
                    fixed(f["systems"][f["best_peer"]]["step_s"] * 1e3)]
        timed = [f for f in data["families"].values() if "systems" in f]
        cv = lambda system: [f["systems"][system]["step_cv"] for f in timed]  # noqa: E731
        return (*out, span(cv("mplan"), lambda v: fixed(v * 100)), span(cv("compile"), lambda v: fixed(v * 100)))
    return figures


def _traced(family: str) -> Callable[[dict], tuple[str, ...]]:
    """One family raced beside a clock trace (benchmarks/models/trace.py): the ratio to compile, mplan's
    and compile's step (ms), mplan's, compile's and eager's spread (%), the clock range over every
    system's steps (MHz), then per system (mplan, compile, eager) its mean power (W) and clock (MHz),
    then the same three's step-vs-clock correlations."""
    def figures(data: dict) -> tuple[str, ...]:
        f = data["families"][family]
        trace, order = f["gpu_trace"], ("mplan", "compile", "eager")
        low = min(trace[s]["sm_clock_mhz_range"][0] for s in trace)
        high = max(trace[s]["sm_clock_mhz_range"][1] for s in trace)
        return (fixed(f["mplan_vs_compile"], 3), fixed(f["systems"]["mplan"]["step_s"] * 1e3),
                fixed(f["systems"]["compile"]["step_s"] * 1e3),
                *(fixed(f["systems"][s]["step_cv"] * 100, 2) for s in order), fixed(low, 0), fixed(high, 0),
                *(x for s in order for x in (fixed(trace[s]["power_w_mean"], 0), fixed(trace[s]["sm_clock_mhz_mean"], 0))),
                *(fixed(trace[s]["step_vs_clock_correlation"], 2) for s in order))
    return figures


def _graphed(family: str) -> Callable[[dict], tuple[str, ...]]:
    """One family raced with mplan's CUDA graphs and without (`mplan_eager`): the ratio to the
    fastest peer, mplan's and that peer's step (ms), the ratio to mplan without graphs, then the
    spread (%) of mplan's, compile's and mplan-without-graphs' steps."""
    def figures(data: dict) -> tuple[str, ...]:
        f = data["families"][family]
        cv = lambda system: fixed(f["systems"][system]["step_cv"] * 100, 2)  # noqa: E731
        return (fixed(f["mplan_vs_best_peer"], 3), fixed(f["systems"]["mplan"]["step_s"] * 1e3),
                fixed(f["systems"][f["best_peer"]]["step_s"] * 1e3), fixed(f["mplan_vs_mplan_eager"], 3),
                cv("mplan"), cv("compile"), cv("mplan_eager"))
    return figures


def _steady(family: str) -> Callable[[dict], tuple[str, ...]]:
    """One family raced, then each system alone (`models peers --steady-steps`): the ratio to the
    fastest peer, mplan's and that peer's step (ms), mplan's and compile's spread alone (%)."""
    def figures(data: dict) -> tuple[str, ...]:
        f = data["families"][family]
        return (fixed(f["mplan_vs_best_peer"], 3), fixed(f["systems"]["mplan"]["step_s"] * 1e3),
                fixed(f["systems"][f["best_peer"]]["step_s"] * 1e3),
                *(fixed(f["systems"][s]["steady_cv"] * 100, 2) for s in ("mplan", "compile")))
    return figures


def _grouped_gemm(data: dict) -> tuple[str, ...]:
    """Milliseconds saved a micro-batch of 2048 tokens, end to end against apart, then in the ATen form."""
    rows = [data["per_model"][f"{model} x2048"] for model in ("smollm2-1.7b", "qwen3-1.7b", "gemma-2b")]
    return (*(fixed(r["saved_ms_per_micro_batch"], 2) for r in rows),
            " / ".join(fixed(r["aten_saved_ms_per_micro_batch"], 2) for r in rows))


def _own_pairs(model: str) -> Callable[[dict], tuple[str, ...]]:
    """One of mplan's own models raced against one peer at a time (`models peers --own-pairs`): per
    peer (eager, compile) the ratio, mplan's and the peer's step (ms); then per peer mplan's and
    the peer's spread (%), each from that pair's rounds."""
    def figures(data: dict) -> tuple[str, ...]:
        own = data["own"][model]
        pairs = own["pairs"]
        step = lambda peer, system: fixed(pairs[peer]["systems"][system]["step_s"] * 1e3)  # noqa: E731
        cv = lambda peer, system: fixed(pairs[peer]["systems"][system]["step_cv"] * 100, 2)  # noqa: E731
        return (*(x for peer in ("eager", "compile")
                  for x in (fixed(own[f"mplan_vs_{peer}"], 3), step(peer, "mplan"), step(peer, peer))),
                *(x for peer in ("eager", "compile") for x in (cv(peer, "mplan"), cv(peer, peer))))
    return figures


def _cp_attention(data: dict) -> tuple[str, ...]:
    """One cp rank's local attention on cuDNN's and flash's kernels (one run): cuDNN's 131072-token
    cp=2 rank 0's measured and predicted forward and backward (ms), the span of its prediction
    errors (%, as under-measurement) at 64k-128k tokens and its worst at 32k, flash's step over
    cuDNN's (range), flash's span of errors, the largest forward gap between a layout's two ranks
    (%, either backend)."""
    def rows(backend: str, smallest: int = 0) -> list[dict]:
        return [r for r in data["rows"] if r["backend"] == backend and r["seq"] >= smallest]

    def errors(backend: str, smallest: int = 0) -> list[float]:
        return [-r["prediction_error"][k] * 100 for r in rows(backend, smallest) for k in ("forward", "backward")]

    def step(r: dict) -> float:
        return r["measured_ms"]["forward"] + r["measured_ms"]["backward"]
    first = next(r for r in rows("cudnn") if r["seq"] == 131072 and r["cp"] == 2 and r["rank"] == 0)
    slower = [step(f) / step(c) for c, f in zip(rows("cudnn"), rows("flash"), strict=True)]
    pairs: dict[tuple[str, int, int], list[float]] = {}
    for r in data["rows"]:
        pairs.setdefault((r["backend"], r["seq"], r["cp"]), []).append(r["measured_ms"]["forward"])
    gap = max(max(v) / min(v) - 1 for v in pairs.values()) * 100
    return (fixed(first["measured_ms"]["forward"], 0), fixed(first["measured_ms"]["backward"], 0),
            fixed(first["predicted_ms"]["forward"], 0), fixed(first["predicted_ms"]["backward"], 0),
            f"{min(errors('cudnn', 65536)):.0f}-{max(errors('cudnn', 65536)):.0f}", fixed(max(errors("cudnn")), 0),
            f"{min(slower):.2f}-{max(slower):.2f}", f"{min(errors('flash')):.0f}-{max(errors('flash')):.0f}",
            fixed(gap, 0))


def _graph_price(data: dict) -> tuple[str, ...]:
    """The planner's graphed price of each race family against its measured step (ms, error %),
    then the eager errors (%)."""
    families = ("gemma3", "gemma2", "qwen3_moe", "granite")
    signed = lambda error: f"{error * 100:+.1f}"  # noqa: E731
    out = []
    for name in families:
        row = data["families"][name]["mplan"]
        out += [fixed(row["predicted_ms"]), fixed(row["measured_ms"]), signed(row["error"])]
    return (*out, *(signed(data["families"][name]["mplan_eager"]["error"]) for name in families))


def _hf_measure(model: str, specs: tuple[str, ...]) -> Callable[[dict], tuple[str, ...]]:
    """`mplan bench --measure` rows of one model (`calibration bench-cli`): each spec's measured step (ms), then
    each one's step-time error (%), then each one's peak-memory error (%); a positive error unsigned."""
    def figures(data: dict) -> tuple[str, ...]:
        plans = {p["spec"]: p for p in data["models"][model]["rows"]["plans"]}
        error = lambda spec, key: f"{plans[spec]['measured']['prediction_error'][key] * 100:.1f}"  # noqa: E731
        return (*(fixed(plans[spec]["measured"]["step_time_s"] * 1e3, 0) for spec in specs),
                *(error(spec, "step_time") for spec in specs), *(error(spec, "peak_memory") for spec in specs))
    return figures


def _measured_steps(model: str, specs: tuple[str, ...], digits: int = 1) -> Callable[[dict], tuple[str, ...]]:
    """`mplan bench --measure` rows of one model (`calibration bench-cli`): each spec's measured step (ms)."""
    def figures(data: dict) -> tuple[str, ...]:
        rows = data["models"][model]["rows"]
        return tuple(fixed(_plan(rows, spec)["measured"]["step_time_s"] * 1e3, digits) for spec in specs)
    return figures


def _unseen_specs() -> tuple[str, ...]:
    """The unseen set's seven plans, `calibration bench-cli`'s own (UNSEEN_PLANS), in the README's order."""
    return tuple(load_source(ROOT, "benchmarks/calibration/bench_cli.py")["UNSEEN_PLANS"])


def _unseen_latest(data: dict) -> tuple[str, ...]:
    """`bench-cli --reprice` of the whole unseen set: each model's seven step errors on the latest
    run that measured the plan (runs are given oldest first), the largest peak error over every
    measurement, the three full-recomputation peak errors, and how many of how many plans have every
    measurement within 10% on step and peak."""
    latest = {model: {row["spec"]: row for row in rows} for model, rows in data["models"].items()}
    models, specs = ("qwen3", "smollm2", "gemma"), _unseen_specs()
    every = [row for model in models for row in data["models"][model]]
    within = sum(all(abs(r["error_now"]) <= 0.10 and abs(r["peak_error_now"]) <= 0.10
                     for r in data["models"][model] if r["spec"] == spec) for model in models for spec in specs)
    return (*(f"{latest[model][spec]['error_now'] * 100:+.1f}" for model in models for spec in specs),
            f"{max(abs(r['peak_error_now']) for r in every) * 100:.1f}",
            *(f"{latest[model]['mbs=8,recompute=full']['peak_error_now'] * 100:+.1f}" for model in models),
            str(within), str(len(models) * len(specs)))


def _unseen_run(model: str) -> Callable[[dict], tuple[str, ...]]:
    """One `bench-cli --configs unseen` run of `model`: its seven step errors against the run's
    own prices and the full recomputation's peak error."""
    def figures(data: dict) -> tuple[str, ...]:
        judged = {row["spec"]: row for row in data["models"][model]["judged"]}
        return (*(f"{judged[spec]['step_time_error'] * 100:+.1f}" for spec in _unseen_specs()),
                f"{judged['mbs=8,recompute=full']['peak_memory_error'] * 100:+.1f}")
    return figures


def _repriced(model: str, specs: tuple[str, ...]) -> Callable[[dict], tuple[str, ...]]:
    """`bench-cli --reprice` rows of one model: each spec's error now (%)."""
    def figures(data: dict) -> tuple[str, ...]:
        rows = {r["spec"]: r for r in data["models"][model]}
        return tuple(f"{rows[spec]['error_now'] * 100:.1f}" for spec in specs)
    return figures


def _peer_profile(family: str) -> Callable[[dict], tuple[str, ...]]:
    """One family's profiled mplan step: GPU kernel time and wall time (ms)."""
    def figures(data: dict) -> tuple[str, ...]:
        mplan = data["families"][family]["profile"]["mplan"]
        return fixed(mplan["gpu_kernel_ms_per_step"], 0), fixed(mplan["wall_ms_per_step"], 0)
    return figures


def _own(data: dict) -> tuple[str, ...]:
    """mplan's own GPT-1.3B and Llama-1.1B against eager and compile."""
    return tuple(fixed(data["own"][kind][key], 3) for kind in ("gpt", "llama")
                 for key in ("mplan_vs_eager", "mplan_vs_compile"))


# -- the registry ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    doc: str
    """Path of the doc under the repository root (README.md, docs/claims.md)."""
    pattern: str
    """A regular expression over one unit's text; each group is one figure."""
    source: str
    """The file it comes from: a name under benchmarks/results/, or a repository path."""
    figures: Callable[[Any], tuple[str, ...]]
    """The source's content (JSON, or a .py file's module-level literals) -> each group's text."""


def _rows(data: dict, key: str = "rows") -> list[dict]:
    return data[key]


def _plan(data: dict, spec: str) -> dict:
    (row,) = [p for p in data["plans"] if p["spec"] == spec]
    return row


def _mesh(plan: dict) -> str:
    return " x ".join(f"{axis}={plan['mesh'][axis]}" for axis in ("dp", "tp", "pp") if plan["mesh"][axis] > 1)


def _experts(data: dict) -> tuple[str, ...]:
    rows = _rows(data)
    return str(len(rows)), sci(max(r["loss"] for r in rows), 0), sci(max(r["param"] for r in rows))


def _pipelines(data: dict) -> tuple[str, ...]:
    rows = _rows(data)
    params = sorted(r["param"] for r in rows)
    others = [r["param"] for r in rows if not r["worst_param"].endswith("k_proj.bias")]
    return sci(max(r["loss"] for r in rows), 0), sci(params[-1], 0), sci(max(others), 0)


def _moe_bench(data: dict) -> tuple[str, ...]:
    ep = [p for p in data["plans"] if p["mesh"]["ep"] > 1]
    measured = [p["measured"]["step_time_s"] * 1e3 for p in ep]
    errors = [p["measured"]["prediction_error"]["step_time"] for p in ep]
    (dense,) = [p for p in data["plans"] if p["mesh"]["ep"] == 1]
    return (span(measured, lambda v: fixed(v, 0)), span(errors, lambda v: percent(v, 0, sign=True), " to "),
            WORDS[len(ep)] if all(e > 0 for e in errors) else "not all",
            fixed(dense["measured"]["step_time_s"] * 1e3, 0), fixed(dense["predicted"]["step_time_s"] * 1e3, 0),
            percent(dense["measured"]["prediction_error"]["step_time"], 0, sign=True))


def _pipeline_bench(data: dict) -> tuple[str, ...]:
    errors = [p["measured"]["prediction_error"]["step_time"] for p in data["plans"]]
    dp4 = sorted(p["measured"]["step_time_s"] for p in data["plans"] if p["resolved_spec"].startswith("dp=4,tp=1,pp=1"))
    return span(errors, lambda v: percent(v, 0, sign=True), " to "), " and ".join(fixed(v, 2) for v in dp4)


def _mixtral_even(data: dict) -> tuple[str, ...]:
    auto = _plan(data, "auto")
    p, without = auto["predicted"], auto["without_ep"]
    return (_mesh(auto), str(auto["mesh"]["vpp"]), f"ep={auto['mesh']['ep']}", fixed(p["step_time_s"], 2),
            fixed(p["a2a_s"] * 1e3, 0), percent(p["a2a_s"] / p["step_time_s"]), _mesh(without),
            fixed(without["predicted"]["step_time_s"], 2), percent(without["slower"], sign=True))


def _mixtral_skewed(data: dict) -> tuple[str, ...]:
    auto, forced = _plan(data, "auto"), _plan(data, "tp=1,ep=8")
    assert auto["mesh"]["ep"] == 1, "the search kept EP"
    return _mesh(auto), fixed(auto["predicted"]["step_time_s"], 2), fixed(forced["predicted"]["step_time_s"], 2)


def _context_plans(data: dict) -> tuple[str, ...]:
    """The 8B and 405B-class plans at 131072 tokens, each beside its best plan without cp."""
    small, large = data["jobs"]["llama3-8b-shape"], data["jobs"]["llama3-405b-shape"]
    chosen, without = small["chosen"], small["best_without_cp"]
    big, big_without = large["chosen"], large["best_without_cp"]
    return (str(chosen["mesh"]["cp"]), fixed(chosen["step_time_s"]), fixed(chosen["memory_gib"]), percent(chosen["mfu"]),
            fixed(without["step_time_s"]), percent(without["step_time_s"] / chosen["step_time_s"] - 1, 0, sign=True),
            str(big["mesh"]["cp"]), str(big["mesh"]["tp"]), str(big["mesh"]["pp"]), fixed(big["step_time_s"]),
            fixed(big["memory_gib"]), percent(big["mfu"]), fixed(big_without["step_time_s"]),
            fixed(large["cp_speedup"]), percent(big_without["bubble_fraction"], 0))


def _dynamic_cp(data: dict) -> tuple[str, ...]:
    """Dynamic CP's predicted speed-up over fixed CP on Wikipedia's published mix at cp=8, 16, 32,
    and the share of its packed sequences the runtime's two-size rule deals whole (%, the most)."""
    wiki = {r["cp"]: r for r in data["rows"] if r["mix"] == "wikipedia"}
    return (*(fixed(wiki[cp]["speedup"], 2) for cp in (8, 16, 32)),
            percent(max(r["two_size_whole"] for r in wiki.values()), 0))


def _cp_aligned(data: dict) -> tuple[str, ...]:
    """The cp-aligned packing on Wikipedia's mix at cp=8, 16, 32: the windows the runtime's rule runs
    at cp=1 (%), the padding (%, one figure: the same at every cp), the speed-up per real token."""
    wiki = {r["cp"]: r for r in data["rows"] if r["mix"] == "wikipedia"}
    return (*(str(round(wiki[cp]["aligned_whole"] * 100)) for cp in (8, 16, 32)),
            fixed(wiki[8]["aligned_padding"] * 100, 1), *(fixed(wiki[cp]["aligned_speedup"], 2) for cp in (8, 16, 32)))


def _megatron(data: dict) -> tuple[str, ...]:
    rows, spread = _rows(data), data["candidate_spread"]
    return (percent(data["max_abs_error"]), percent(data["mean_abs_error"]),
            str(sum(r["own_error"] < 0 for r in rows)), str(len(rows)), str(max(r["candidates"] for r in rows)),
            percent(spread["fastest"]["max_abs_error"]), percent(spread["fastest"]["mean_abs_error"]),
            percent(spread["slowest"]["max_abs_error"]), percent(spread["slowest"]["mean_abs_error"]))


def _megatron_auto(data: dict) -> tuple[str, ...]:
    rows = _rows(data)
    assert all(r["auto_tp_within_node"] for r in rows), "a planned TP leaves the node"
    return (span([r["auto_vs_own"] for r in rows], lambda v: fixed(v, 2)),)


def _activation_probe(data: dict) -> tuple[str, ...]:
    return (percent(max(abs(r["error"]) for r in _rows(data))),)


def _activation_probe_old(data: dict) -> tuple[str, ...]:
    return (span([r["error"] for r in _rows(data)], lambda v: percent(v, 0, sign=True), " to "),)


def _zoo_ci(module: dict) -> tuple[str, ...]:
    tested = sum(len(plans) for plans in module["TESTED"].values())
    total = sum(len(plans) for plans in module["PLANS"].values())
    return WORDS[tested], WORDS[total], WORDS[total]


def _zoo_row(model: str) -> Callable[[dict], tuple[str, ...]]:
    def figures(data: dict) -> tuple[str, ...]:
        cells = [result[model]["error"] for world in ("world2", "world4") for result in data["results"][world].values()]
        return (sci(data["bounds"][model], 0), *(sci(c) for c in cells))
    return figures


def _capture(data: dict) -> tuple[str, ...]:
    full = {r["preset"]: r for r in _rows(data) if r["mode"] == "full"}
    return tuple(f for preset in ("gpt3-175b", "llama3-405b")
                 for f in (fixed(full[preset]["export_s"]), fixed(full[preset]["peak_rss_gib"], 2)))


def _checkpoint_time(data: dict) -> tuple[str, ...]:
    row = _rows(data)[0]
    return (fixed(row["save_blocking_s"]), fixed(row["save_gb_per_s"], 2), fixed(row["background_stall_s"]),
            fixed(row["step_during_background_save_s"]), fixed(row["step_s"]), fixed(row["load_same_plan_s"]),
            fixed(row["load_other_plan_s"]))


def _planning(data: dict) -> tuple[str, ...]:
    out = []
    for job in ("gpt3-175b", "llama3-8b"):
        walls = [r["wall_s"] for r in data["jobs"][job]["runs"]]
        out.append(span(walls, fixed))
    for job in ("gpt3-175b", "llama3-8b"):
        out.append(f"{data['jobs'][job]['runs'][0]['planner']['candidates']:,}")
    return tuple(out)


def _planning_fix(data: dict) -> tuple[str, ...]:
    """Before / after wall times (and gpt3's and llama3-405b's searches) of the 2026-12-06 fix."""
    jobs = data["summary"]
    out = []
    for job, search in (("gpt3-175b", True), ("llama3-8b", False), ("llama3-405b", True), ("qwen3-8b@131072", False)):
        keys = ("wall_s_min_before", "wall_s_min_after") + (("search_s_before", "search_s_after") if search else ())
        out += [fixed(jobs[job][key], 2) for key in keys]
    return tuple(out)


def _h200_step(data: dict) -> tuple[str, ...]:
    """The step errors' range as '2.5-7.4%' (all low), and the number of models."""
    errors = [abs(r["step_error"]) * 100 for r in _rows(data)]
    assert all(r["step_error"] < 0 for r in _rows(data)), "not all low"
    return f"{span(errors, fixed)}%", str(len(_rows(data)))


def _h200_memory(data: dict) -> tuple[str, ...]:
    return (percent(max(abs(r["memory_error"]) for r in _rows(data))),)


def _wide_llama(data: dict) -> tuple[str, ...]:
    """Step, then peak memory errors of the two plans, as '-6.4% / -8.1%'."""
    errors = [p["measured"]["prediction_error"] for p in data["plans"]]
    return tuple(" / ".join(percent(e[key], sign=True) for e in errors) for key in ("step_time", "peak_memory"))


def _adamw(data: dict) -> tuple[str, ...]:
    """GPT-1.3B's step with the clip coefficient folded in (grad_scale): mplan's kernel and torch's
    fused AdamW, bf16 and fp32 milliseconds, then bf16 host time, then the tensor count."""
    rows = {r["dtype"]: r["timing"]["grad_scale"] for r in _rows(data) if r["model"] == "gpt-1.3b"}
    mplan, torch_ = "mplan_device_steps", "torch_fused"
    return (*(fixed(rows[dtype][system]["ms"], 2) for dtype in ("bf16", "fp32") for system in (mplan, torch_)),
            *(fixed(rows["bf16"][system]["host_ms"], 2) for system in (mplan, torch_)))


def _fusion_survey(data: dict) -> tuple[str, ...]:
    """Families tried, how many agree of how many, the worst loss and gradient errors."""
    rows = data["families"].values()
    agree = sum(bool(row.get("agrees")) for row in rows)
    return (str(len(rows)), str(agree), str(len(rows)), sci(max(r["loss_rel_err"] for r in rows), 0),
            sci(max(r["grad_rel_err"] for r in rows), 0))


def _hf_models(data: dict) -> tuple[str, ...]:
    """mplan's step (ms) and its ratios to the fastest peer, eager and compile, its peak (GiB) and its
    ratio to the lowest peer's, each as 'llama / mistral / qwen2'; the fastest and lowest peer must be Liger."""
    models = [data["models"][name] for name in ("llama", "mistral", "qwen2")]
    assert all(m["best_peer"] == "liger" and m["lowest_peak_peer"] == "liger" for m in models), "a peer other than Liger"

    def each(value: Callable[[dict], float], digits: int, unit: str = "") -> str:
        """'1.037x / 1.033x / 1.100' for unit 'x': the last unit stays outside the group."""
        return f"{unit} / ".join(fixed(value(m), digits) for m in models)
    return (each(lambda m: m["systems"]["mplan"]["step_s"] * 1e3, 1), each(lambda m: m["mplan_vs_best_peer"], 3, "x"),
            each(lambda m: m["mplan_vs_eager"], 2, "x"), each(lambda m: m["mplan_vs_compile"], 2, "x"),
            each(lambda m: m["systems"]["mplan"]["peak_gib"], 2), each(lambda m: m["mplan_peak_vs_lowest_peer"], 3, "x"))


def _hf_models_each(data: dict, names: Sequence[str], peak_digits: int) -> tuple[str, ...]:
    """The README's HF-models sentence, quantity by quantity, each for the models in `names` (those
    the file holds): step (ms), ratios to the fastest peer, eager and compile, peak (GiB), ratio to
    the lowest peer's peak; the fastest and lowest peer must be Liger."""
    models = [data["models"][name] for name in names]
    assert all(m["best_peer"] == "liger" and m["lowest_peak_peer"] == "liger" for m in models), "a peer other than Liger"
    quantities: tuple[tuple[Callable[[dict], float], int], ...] = (
        (lambda m: m["systems"]["mplan"]["step_s"] * 1e3, 1), (lambda m: m["mplan_vs_best_peer"], 3),
        (lambda m: m["mplan_vs_eager"], 2), (lambda m: m["mplan_vs_compile"], 2),
        (lambda m: m["systems"]["mplan"]["peak_gib"], peak_digits), (lambda m: m["mplan_peak_vs_lowest_peer"], 3))
    return tuple(fixed(value(m), digits) for value, digits in quantities for m in models)


def _hf_models_setup(data: dict) -> tuple[str, ...]:
    """Tokens a step (batch x sequence, the same for every model) and Liger Kernel's version."""
    (batch,) = {m["batch"] for m in data["models"].values()}
    (seq,) = {m["seq_len"] for m in data["models"].values()}
    return str(batch), str(seq), data["liger-kernel"]


def _hf_models_earlier(data: dict) -> tuple[str, ...]:
    """The first 12-02 run: mplan's ratio to the fastest peer, then its peak's to the lowest peer's."""
    models = [data["models"][name] for name in ("llama", "mistral", "qwen2")]
    return (*(fixed(m["mplan_vs_best_peer"], 3) for m in models), *(fixed(m["mplan_peak_vs_lowest_peer"], 3) for m in models))


def _judged(data: dict, model: str) -> dict:
    (row,) = data["models"][model]["judged"]
    return row


def _hf_bench(model: str) -> Callable[[dict], tuple[str, ...]]:
    """`mplan bench --measure` of one HF model: step error, peak error, predicted and measured peak (GiB)."""
    def figures(data: dict) -> tuple[str, ...]:
        row = _judged(data, model)
        return (percent(row["step_time_error"], sign=True), percent(row["peak_memory_error"], sign=True),
                fixed(row["predicted_allocated_gib"], 2), fixed(row["measured_peak_gib"], 2))
    return figures


def _margin() -> float:
    """The planner's allocator margin, FRAGMENTATION_FRACTION of mplan/cost_models/memory_model.py. A
    predicted peak over (1 + margin) is the peak without it, to the largest workspace (exempt from
    the margin, 0.002% of HF Llama's peak in hf_price_h200-cpu-2026-12-02.json)."""
    return load_source(ROOT, "mplan/cost_models/memory_model.py")["FRAGMENTATION_FRACTION"]


def _hf_reprice_seen(data: dict) -> tuple[str, ...]:
    """HF Llama and Mistral priced again by `bench-cli --reprice` beside the H200 run: Llama's step
    now, its error, the measured step, the price then and its error, its allocated peak now and error,
    the measured peak, the allocator margin; Mistral's step now, its error and its peak error."""
    (llama,), (mistral,) = data["models"]["llama"], data["models"]["mistral"]
    return (".".join(data["transformers"].split(".")[:2]), fixed(llama["predicted_now_s"] * 1e3),
            percent(llama["error_now"], sign=True), fixed(llama["measured_step_s"] * 1e3),
            fixed(llama["predicted_then_s"] * 1e3), percent(llama["error_then"], sign=True),
            fixed(llama["predicted_allocated_gib_now"]), percent(llama["peak_error_now"], sign=True),
            fixed(llama["measured_peak_gib"]), percent(_margin(), 0), fixed(mistral["predicted_now_s"] * 1e3),
            percent(mistral["error_now"], sign=True), percent(mistral["peak_error_now"], sign=True))


def _fp8(data: dict) -> tuple[str, ...]:
    """Tokens; the 16384-row casts' share of copy bandwidth ('82-86%'); fwd+bwd speed-up over bf16
    (bf16 time over FP8's) at the block shapes, and at the narrowest output (N) with its N."""
    linears = list(data["linears"].values())
    (tokens,) = {row["tokens"] for row in linears}
    casts = [c for c in data["cast"] if c["shape"][0] == tokens]
    assert all(c["bit_identical"] for c in data["cast"]), "a cast differs from torch's"
    narrow = min(linears, key=lambda row: row["out"])
    ratio = [row["bf16"]["fwd_bwd_ms"] / row["fp8"]["fwd_bwd_ms"] for row in linears if row is not narrow]
    return (str(tokens), f"{span([c['copy_fraction'] * 100 for c in casts], lambda v: fixed(v, 0))}%",
            span(ratio, lambda v: fixed(v, 2)), fixed(narrow["bf16"]["fwd_bwd_ms"] / narrow["fp8"]["fwd_bwd_ms"], 2),
            str(narrow["out"]))


def _equivalence_gpus(data: dict) -> tuple[str, ...]:
    """GPUs, model size (B), steps; worst loss difference over the first loss, worst parameter
    difference, and the two tolerances (the same for every plan, all passed)."""
    plans = list(data["plans"].values())
    assert all(p["passed"] for p in plans), "a plan failed"
    ((loss_tol, param_tol),) = {(p["tolerance"]["loss"], p["tolerance"]["param"]) for p in plans}
    (size,) = re.findall(r"(\d+)b", data["model"])
    return (str(data["world_size"]), size, str(data["steps"]),
            percent(max(p["max_loss_diff_over_first_loss"] for p in plans), 2),
            percent(max(p["max_param_rel_diff"] for p in plans)), percent(loss_tol, 0), percent(param_tol, 0))


LINK_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _links(data: dict) -> tuple[str, ...]:
    """`mplan profile` on 2 H200s: each collective's fitted bus bandwidth (GB/s), the per-call time
    (us) of every call under 4 MiB, and the fitted lines' worst errors ('12-30%')."""
    links = data["profile"]["links"]
    fits = {f["collective"]: f for f in links["fits"]}
    small = [t["seconds"] * 1e6 for t in links["timings"] if t["nbytes"] < 4 << 20]
    return (*(fixed(fits[c]["beta_Bps"] / 1e9, 0) for c in LINK_COLLECTIVES), span(small, lambda v: fixed(v, 0)),
            f"{span([f['max_rel_error'] * 100 for f in fits.values()], lambda v: fixed(v, 0))}%")


def _llama3_h200x2(data: dict) -> tuple[str, ...]:
    """Session 7's three plans (dp=2, tp=2 + SP, tp=2 + SP + selective): the first's dp and micro-batch,
    the second's tp, the third's micro-batch, each with its measured step (s) and its prediction's error; the predicted peaks' errors with the margin ('12-30%'), then without it."""
    plans = {p["spec"]: p for p in data["plans"]}
    order = [plans[spec] for spec in ("pp=1", "tp=2,sp=1", "tp=2,sp=1,recompute=selective")]
    assert order[0]["mesh"]["dp"] == 2, "the planner's choice is not dp=2"

    def peak_error(p: dict, margin: bool) -> float:
        return p["predicted"]["memory_gib"] / (1.0 if margin else 1.0 + _margin()) / p["measured"]["peak_memory_gib"] - 1
    def step(p: dict) -> tuple[str, str]:
        return (fixed(p["measured"]["step_time_s"], 3),
                percent(p["predicted"]["step_time_s"] / p["measured"]["step_time_s"] - 1, sign=True))

    def mbs(p: dict) -> str:
        return re.search(r"mbs=(\d+)", p["resolved_spec"])[1]  # type: ignore[index]
    no_margin = [peak_error(p, False) for p in order]
    return (str(order[0]["mesh"]["dp"]), mbs(order[0]), *step(order[0]), str(order[1]["mesh"]["tp"]), *step(order[1]),
            mbs(order[2]), *step(order[2]), f"{span([peak_error(p, True) * 100 for p in order], lambda v: fixed(v, 0))}%", percent(_margin(), 0),
            percent(no_margin[0], sign=True), percent(no_margin[1], 0, sign=True), percent(no_margin[2], sign=True),
            percent(no_margin[1], 0))


def _llama3_h200x2_first(data: dict) -> tuple[str, ...]:
    """The first run's tp=2 + SP + selective plan: measured and predicted step (s), the prediction's error."""
    (plan,) = [p for p in data["plans"] if p["spec"] == "tp=2,sp=1,recompute=selective"]
    measured, predicted = plan["measured"]["step_time_s"], plan["predicted"]["step_time_s"]
    return fixed(measured, 3), fixed(predicted, 3), percent(1 - predicted / measured, 0)


def _fused_activation_bytes(data: dict) -> tuple[str, ...]:
    """How far the planner's count of one block's activations is under the fused runtime's, Llama then GPT."""
    return tuple(percent(-data["models"][m]["per_block"]["planner_vs_kernels"]) for m in ("llama", "gpt"))


def _fused_activation_bytes_exact(data: dict) -> tuple[str, ...]:
    """One block's bytes the fused runtime keeps, Llama then GPT, where the planner's count is the
    same to the byte (otherwise "planner differs", which no document says)."""
    rows = [data["models"][m]["per_block"] for m in ("llama", "gpt")]
    return tuple(f"{r['kept_with_kernels_bytes']:,}" if r["planner_saved_bytes"] == r["kept_with_kernels_bytes"]
                 else "planner differs" for r in rows)


def _fp8_convergence(data: dict) -> tuple[str, ...]:
    """Steps, the chain's best loss; each model's final FP8-over-bf16 difference with its FP8 and bf16
    final losses (GPT, then Llama); the smoothed curves' largest gap, as a range over the two."""
    gpt, llama = (data["models"][m] for m in ("gpt-1.3b", "llama-1.1b"))
    ((steps, best),) = {(len(m["systems"]["mplan"]["losses"]), m["chain"]["best_final_loss"]) for m in (gpt, llama)}

    def final(m: dict) -> tuple[str, ...]:
        c = m["comparison"]
        return percent(c["final_rel_diff"], 2, sign=True), fixed(c["final_loss_fp8"], 3), fixed(c["final_loss_bf16"], 3)
    gaps = [m["comparison"]["smoothed_max_rel_gap"] * 100 for m in (gpt, llama)]
    return str(steps), fixed(best, 3), *final(gpt), *final(llama), f"{span(gaps, lambda v: fixed(v, 0))}%"


def _fused_pricing(data: dict) -> tuple[str, ...]:
    """GPT/Llama: the predicted step's error against eager, mplan bf16 and mplan FP8, then the
    kernels' gain predicted and measured."""
    rows = [data["rows"][m] for m in ("gpt-1.3b", "llama-1.1b")]
    errors = [percent(r[key], sign=True) for key in ("unfused_error", "fused_error", "fp8_error") for r in rows]
    gains = [fixed(r[key], 3) for key in ("predicted_gain", "measured_gain") for r in rows]
    return (*errors, *gains)


ZOO_MODELS = ("llama", "mistral", "qwen2", "gpt2", "gptj", "gemma", "phi2", "opt", "falcon", "stablelm",
              "nanogpt", "einsum_lm")
FIG = r"(\S+?)"
"""A figure inside a table row: the shortest run of non-spaces."""

CLAIMS: tuple[Claim, ...] = (
    # README: the zoo
    Claim(doc="README.md", source="tests/zoo_models.py", figures=_zoo_ci,
          pattern=r"each CI run trains (\w+) of the (\w+) columns, tp=2 with SP and pp=2 .* the table's run has all (\w+)\)"),
    *(Claim(doc="README.md", source="zoo-cpu-2026-12-02.json", figures=_zoo_row(model),
            pattern=rf"^\| {model} \| " + r" \| ".join([FIG] * 10) + r" \|$") for model in ZOO_MODELS),
    # README: the figures table
    Claim(doc="README.md", source="fusion-cpu-2026-12-07.json", figures=_fusion_survey,
          pattern=r"the fusion pass on (\d+) Hugging Face families .* every fused program trains as its unfused one: "
                  r"(\d+) of (\d+) families, loss within (\S+) and every gradient within (\S+) \("),
    Claim(doc="README.md", source="hf_models_h200-2026-12-03.json", figures=_hf_models,
          pattern=r"\| mplan (\S+ / \S+ / \S+) ms a step: (\S+ / \S+ / \S+)x the fastest peer \(Liger each time\), "
                  r"(\S+ / \S+ / \S+)x eager, (\S+ / \S+ / \S+)x compile; peak (\S+ / \S+ / \S+) GiB, "
                  r"(\S+ / \S+ / \S+)x Liger's \(the lowest\)"),
    Claim(doc="README.md", source="h200_calibration-2026-11-29-session5.json", figures=lambda data: _h200_step(data)[::-1],
          pattern=r"single-GPU step time, (\d) GPT/Llama models .* predicted within (\S+) of measured \(all low\)"),
    Claim(doc="README.md", source="activation_probe_h100-2026-12-05.json", figures=_activation_probe,
          pattern=r"IR count within (\S+) of measured"),
    Claim(doc="README.md", source="activation_probe_h200-2026-11-29.json", figures=_activation_probe_old,
          pattern=r"activation_probe_h200-2026-11-29.json`, the H200's, holds that day's IR count, (\S+ to \S+)\)"),
    Claim(doc="README.md", source="pipeline-cpu-2026-12-02.json", figures=_pipelines,
          pattern=r"largest relative error (\S+) on the losses, (\S+) on the parameters \(GPT's key bias, .*"
                  r"every other parameter under (\S+)\)"),
    Claim(doc="README.md", source="bench_cpu4_pipelines-2026-12-02.json", figures=_pipeline_bench,
          pattern=r"step times predicted within (\S+ to \S+) of measured; .* the same dp=4 plan measured (\S+ and \S+) s"),
    Claim(doc="README.md", source="experts-cpu-2026-12-02.json", figures=_experts,
          pattern=r"(\d+) checks: largest relative error (\S+) on the losses, (\S+) on the parameters"),
    Claim(doc="README.md", source="bench_cpu4_experts-2026-12-02.json", figures=_moe_bench,
          pattern=r"expert-parallel plans measured (\S+) ms, predicted (\S+ to \S+) of measured \(all (\w+) high;"
                  r".* dp=4 with ep=1 measured (\d+) ms, predicted (\d+) ms \((\S+)\)"),
    Claim(doc="README.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.0-2026-12-05.json", figures=_mixtral_even,
          pattern=r"\| (dp=\d+ x pp=\d+) \(interleaved, vpp (\d+)\) with (ep=\d+), ZeRO-1, no recomputation: (\S+) s per "
                  r"step, all-to-all (\d+) ms \((\S+) of the step\); the best plan without EP \((.+?)\) (\S+) s, (\S+);"),
    Claim(doc="README.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.1-2026-12-05.json", figures=_mixtral_skewed,
          pattern=r"the search drops EP for (.+?) \((\S+) s\), where ep=8 would take (\S+) s;"),
    Claim(doc="README.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.3-2026-12-05.json",
          figures=lambda data: (fixed(_plan(data, "tp=1,ep=8")["predicted"]["step_time_s"], 2),),
          pattern=r"at 1\.3 ep=8 would take (\S+) s:"),
    Claim(doc="README.md", source="context_plans-predicted-2026-12-06-session13.json", figures=_context_plans,
          pattern=r"8B: cp=(\d+) over a ring, .*?: (\S+) s a step, (\S+) GiB and MFU (\S+) per GPU; .*? Without cp the best "
                  r"is .*?, (\S+) s \((\S+):.*? 405B: cp=(\d+) \(ring\) x tp=(\d+) x pp=(\d+), .*?: (\S+) s, (\S+) GiB, "
                  r"MFU (\S+) \(.*?: (\S+) s \((\S+)x, bubble (\S+)\)"),
    Claim(doc="README.md", source="megatron-calibration-2026-12-05-dp-pricing.json", figures=_megatron,
          pattern=r"predicted within (\S+) on every row, (\S+) on average \(low on (\d+) of (\d+)\), .* spanning up to "
                  r"(\d+) candidates\. The fastest candidate is within (\S+) / (\S+) on average, the slowest (\S+) / (\S+)\."),
    Claim(doc="README.md", source="megatron-calibration-2026-12-05-dp-pricing.json", figures=_megatron_auto,
          pattern=r"predicted (\S+)x faster than each published configuration's median candidate"),
    Claim(doc="README.md", source="bench_wide_llama_h200-2026-12-02.json", figures=_wide_llama,
          pattern=r"\| step predicted (\S+ / \S+); peak memory predicted (\S+ / \S+) of `max_memory_allocated`"),
    Claim(doc="README.md", source="optimizer_h200-2026-11-29.json", figures=_adamw,
          pattern=r"\| bf16 (\S+) vs (\S+) ms \(.*\), fp32 (\S+) vs (\S+) ms, .*; host (\S+) vs (\S+) ms \|"),
    Claim(doc="README.md", source="capture-cpu-2026-11-29.json", figures=_capture,
          pattern=r"\| (\S+) s, (\S+) GiB / (\S+) s, (\S+) GiB \|"),
    Claim(doc="README.md", source="planning_time-cpu-2026-12-03.json", figures=lambda data: _planning(data)[:2],
          pattern=r"\| (\S+) s / (\S+) s of wall time over 3 runs each"),
    Claim(doc="README.md", source="planning_time-cpu-2026-12-03.json", figures=lambda data: _planning(data)[2:],
          pattern=r"in the search \((\S+) / (\S+) candidates\)"),
    Claim(doc="README.md", source="planning_time-cpu-2026-12-06.json", figures=_planning_fix,
          pattern=r"gpt3-175b\s+(\S+) / (\S+) s \(search (\S+) / (\S+) s\), llama3-8b (\S+) / (\S+) s, llama3-405b "
                  r"(\S+) / (\S+) s \(search (\S+) / (\S+) s\),\s+the Qwen3-8B config (\S+) / (\S+) s"),
    Claim(doc="README.md", source="host_factor_fit-cpu-2026-12-05.json", figures=_host_factor,
          pattern=r"measured (\d+) / (\d+) / (\d+) ms and (\d+) / (\d+), (\d+) / (\d+) ms; with the bare ops' host "
                  r"figures predicted up to (\d+)% low at micro-batch 1 and 2; with the runtime factor fitted on the Qwen2 "
                  r"micro-batch-1 step, the six others within (\S+) \(the two 1\.7B configs at micro-batch 8: (\S+) / (\S+)\)"),
    # README: the measured GPU rows' other figures
    Claim(doc="README.md", source="hf_models_h200-2026-12-03.json", figures=_hf_models_setup,
          pattern=r"fused AdamW, (\d+) x (\d+) tokens, fresh batches; HF eager, `torch\.compile`, HF \+ Liger Kernel (\S+) \("),
    Claim(doc="README.md", source="hf_models_h200-2026-12-02-session5.json",
          figures=lambda data: _hf_models_each(data, ("llama", "mistral"), 1),
          pattern=r"the first having hit its time limit\): mplan " + r"(\S+) / (\S+) / \S+ ms a step: (\S+)x / (\S+)x / \S+x the fastest "
                  r"peer \(Liger each time\), (\S+)x / (\S+)x / \S+x eager, (\S+)x / (\S+)x / \S+x compile; peak (\S+) / (\S+) / \S+ "
                  r"GiB, (\S+)x / (\S+)x / \S+x Liger's"),
    Claim(doc="README.md", source="hf_models_h200-2026-12-02-session5-qwen2.json",
          figures=lambda data: _hf_models_each(data, ("qwen2",), 1),
          pattern=r"the first having hit its time limit\): mplan " + r"\S+ / \S+ / (\S+) ms a step: \S+x / \S+x / (\S+)x the fastest "
                  r"peer \(Liger each time\), \S+x / \S+x / (\S+)x eager, \S+x / \S+x / (\S+)x compile; peak \S+ / \S+ / (\S+) "
                  r"GiB, \S+x / \S+x / (\S+)x Liger's"),
    Claim(doc="README.md", source="hf_models_h200-2026-12-02-session4.json", figures=_hf_models_earlier,
          pattern=r"head chunks\): (\S+)x / (\S+)x / (\S+)x, peaks (\S+)x / (\S+)x / (\S+)x \|"),
    Claim(doc="README.md", source="hf_bench_h200-2026-12-02-session5.json",
          figures=lambda data: tuple(_hf_bench("llama")(data)[i] for i in (0, 1, 2, 3)),
          pattern=r"\| step predicted (\S+) / \S+ of measured; peak memory predicted (\S+) / \S+ of `max_memory_allocated` "
                  r"\((\S+) vs (\S+) GiB;"),
    Claim(doc="README.md", source="hf_bench_h200-2026-12-02-session5-qwen2.json", figures=_hf_bench("qwen2"),
          pattern=r"\| step predicted \S+ / (\S+) of measured; peak memory predicted \S+ / (\S+) of `max_memory_allocated` "
                  r"\(\S+ vs \S+ GiB; (\S+) vs (\S+)\)"),
    Claim(doc="README.md", source="hf_bench_h200-2026-12-02.json",
          figures=lambda data: (_hf_bench("llama")(data)[1], _hf_bench("mistral")(data)[1]),
          pattern=r"the peak was predicted (\S+) \(Llama\) / (\S+) \(Mistral\)"),
    Claim(doc="README.md", source="hf_reprice-cpu-2026-12-06-seen.json", figures=_hf_reprice_seen,
          pattern=r"\(transformers (\d+\.\d+) here, \S+ there\): step (\S+) ms \((\S+) of the (\S+) ms `mplan bench --measure` "
                  r"measured; (\S+) ms, (\S+), priced then\); peak (\S+) GiB allocated \((\S+) of that run's (\S+) GiB "
                  r"`max_memory_allocated`; the plan's `memory_gib` adds the (\S+) allocator margin\); Mistral (\S+) ms "
                  r"\((\S+)\), peak (\S+)"),
    Claim(doc="README.md", source="optimizer_h200-2026-11-29.json",
          figures=lambda data: tuple({str(r["num_tensors"]) for r in _rows(data) if r["model"] == "gpt-1.3b"}),
          pattern=r"AdamW on GPT-1\.3B's (\d+) tensors"),
    Claim(doc="README.md", source="fp8_h200-2026-11-29.json", figures=_fp8,
          pattern=r"vs bf16 \(H200, (\d+) tokens\) \| cast bit-identical to torch's, (\S+) of copy bandwidth; forward\+backward "
                  r"(\S+)x faster at the GPT/Llama block shapes, (\S+)x at N=(\d+) \|"),
    Claim(doc="README.md", source="equivalence_h200x2-2026-11-29.json", figures=_equivalence_gpus,
          pattern=r"vs one GPU on (\d) H200s \(NCCL, bf16, Llama (\d+)B, (\d+) steps\).* \| losses within (\S+) of the first "
                  r"loss, every parameter within (\S+) \(tolerances (\S+) and (\S+)\) \|"),
    Claim(doc="README.md", source="profile_h200x2-2026-11-29-session5.json", figures=_links,
          pattern=r"all-reduce (\d+) GB/s, all-gather (\d+), reduce-scatter (\d+), all-to-all (\d+), send/recv (\d+); ~(\S+) us "
                  r"per call below 4 MiB \(host-bound\); one alpha-beta line per collective missed the measured points above 1 MiB by (\S+) "),
    Claim(doc="README.md", source="bench_llama3-8b_h200x2-2026-11-29-session7.json", figures=_llama3_h200x2,
          pattern=r"executable plans \(dp=(\d), mbs (\d+)\) (\S+) s/step, predicted (\S+); tp=(\d) with SP (\S+) s, predicted (\S+); "
                  r"tp=\d with SP and selective recomputation \(mbs (\d+)\) (\S+) s, predicted (\S+); peak memory predicted (\S+) "
                  r"high with the planner's (\S+) fragmentation margin, (\S+), (\S+) and (\S+) of `max_memory_allocated` without "
                  r"it; the (\S+) \(tp=2 with SP, no recomputation\)"),
    Claim(doc="README.md", source="fused_activation_bytes-cpu-2026-11-29.json", figures=_fused_activation_bytes,
          pattern=r"the planner's count of one block is (\S+) \(Llama\) and (\S+) \(GPT\) under what the fused runtime keeps"),
    Claim(doc="README.md", source="fused_activation_bytes-cpu-2026-12-07.json", figures=_fused_activation_bytes_exact,
          pattern=r"one block is what the fused runtime keeps, to the byte \((\S+) bytes a Llama block, (\S+) a GPT block"),
    Claim(doc="README.md", source="bench_llama3-8b_h200x2-2026-11-29.json", figures=_llama3_h200x2_first,
          pattern=r"(\S+) s measured against the (\S+) s predicted before the run \(the prediction (\S+) low;"),
    Claim(doc="README.md", source="fp8_convergence_h200-2026-11-29.json", figures=_fp8_convergence,
          pattern=r"FP8 against bf16 training, (\d+) fresh batches of a synthetic Markov-chain language \(best loss (\S+)\) \| "
                  r"final loss (\S+) \(GPT, (\S+) vs (\S+)\), (\S+) \(Llama, (\S+) vs (\S+)\); FP8 runs a few steps behind "
                  r"mid-descent \(curves up to (\S+) apart"),
    Claim(doc="README.md", source="fused_pricing_check-cpu-2026-12-07-session7.json", figures=_fused_pricing,
          pattern=r"one H200 step predicted (\S+)/(\S+) of eager, (\S+)/(\S+) of mplan bf16, (\S+)/(\S+) of mplan FP8 \(GPT/Llama\), "
                  r"each optimizer priced as the AdamW that runs; the kernels' gain predicted (\S+)x/(\S+)x, measured (\S+)x/(\S+)x"),
    Claim(doc="README.md", source="fused_pricing_check-2026-11-29-session7.json",
          figures=lambda data: (*_fused_pricing(data)[2:4], *_fused_pricing(data)[6:8]),
          pattern=r"session 5's planner: (\S+)/(\S+) of mplan bf16, gains (\S+)x/(\S+)x\)"),
    Claim(doc="README.md", source="fused_pricing_check-cpu-2026-12-07-session7.json", figures=lambda data: _fused_pricing(data)[2:3],
          pattern=r"not on this one, which GPT misses \((\S+)\)"),
    # docs/claims.md: the same figures in the table of sources
    Claim(doc="docs/claims.md", source="h200_calibration-2026-11-29-session5.json",
          figures=lambda data: (_h200_step(data)[0], _h200_memory(data)[0], _h200_step(data)[1]),
          pattern=r"single-GPU step time within (\S+) \(all low\), peak memory within (\S+), (\d) models"),
    Claim(doc="docs/claims.md", source="activation_probe_h100-2026-12-05.json", figures=_activation_probe,
          pattern=r"IR within (\S+) of measured"),
    Claim(doc="docs/claims.md", source="pipeline-cpu-2026-12-02.json", figures=_pipelines,
          pattern=r"pipeline equivalence: (\S+) on losses, (\S+) on parameters \((\S+) but GPT's key bias\)"),
    Claim(doc="docs/claims.md", source="bench_cpu4_pipelines-2026-12-02.json", figures=_pipeline_bench,
          pattern=r"pipelines: within (\S+ to \S+), dp=4 (\S+ and \S+) s"),
    Claim(doc="docs/claims.md", source="experts-cpu-2026-12-02.json", figures=_experts,
          pattern=r"expert parallelism equivalence: (\d+) checks, (\S+) / (\S+),"),
    Claim(doc="docs/claims.md", source="bench_cpu4_experts-2026-12-02.json",
          figures=lambda data: tuple(f for i, f in enumerate(_moe_bench(data)) if i != 2),
          pattern=r"MoE: (\S+) ms within (\S+ to \S+); dp=4 ep=1 (\d+) ms measured, (\d+) ms predicted \((\S+)\)"),
    Claim(doc="docs/claims.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.0-2026-12-05.json",
          figures=lambda data: (_mixtral_even(data)[3], _mixtral_even(data)[4], _mixtral_even(data)[7]),
          pattern=r"Mixtral 8x7B on 64 H100s: (\S+) s, (\d+) ms all-to-all, (\S+) s without EP;"),
    Claim(doc="docs/claims.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.1-2026-12-05.json",
          figures=lambda data: _mixtral_skewed(data)[1:],
          pattern=r"at imbalance 1\.1 no EP \((\S+) s; ep=8 (\S+) s\)"),
    Claim(doc="docs/claims.md", source="bench_mixtral-8x7b_dgx-h100x8-imbalance1.3-2026-12-05.json",
          figures=lambda data: (fixed(_plan(data, "tp=1,ep=8")["predicted"]["step_time_s"], 2),),
          pattern=r"ep=8 (\S+) s at 1\.3"),
    Claim(doc="docs/claims.md", source="megatron-calibration-2026-12-05-dp-pricing.json",
          figures=lambda data: _megatron(data)[:2] + _megatron(data)[5:],
          pattern=r"median candidate in the published layout: (\S+) largest, (\S+) mean; fastest candidate (\S+) / (\S+), "
                  r"slowest (\S+) / (\S+)"),
    Claim(doc="docs/claims.md", source="bench_wide_llama_h200-2026-12-02.json", figures=_wide_llama,
          pattern=r"wide Llama on one H200: step (\S+ / \S+), peak (\S+ / \S+) "),
    Claim(doc="docs/claims.md", source="optimizer_h200-2026-11-29.json", figures=_adamw,
          pattern=r"AdamW: bf16 (\S+) vs (\S+) ms, fp32 (\S+) vs (\S+) ms, host (\S+) vs (\S+) ms"),
    Claim(doc="docs/claims.md", source="fp8_h200-2026-11-29.json", figures=lambda data: _fp8(data)[1:],
          pattern=r"FP8 linear: (\S+) of copy bandwidth, (\S+)x, (\S+)x at N=(\d+) \|"),
    Claim(doc="docs/claims.md", source="equivalence_h200x2-2026-11-29.json",
          figures=lambda data: (_equivalence_gpus(data)[0], *_equivalence_gpus(data)[3:5]),
          pattern=r"(\d) H200s bf16 equivalence: losses within (\S+), parameters (\S+) \|"),
    Claim(doc="docs/claims.md", source="bench_llama3-8b_h200x2-2026-11-29-session7.json",
          figures=lambda data: tuple(_llama3_h200x2(data)[i] for i in (2, 5, 8, 3, 6, 9)),
          pattern=r"Llama-3-8B on 2 H200s, session 7: (\S+) / (\S+) / (\S+) s, predicted (\S+) / (\S+) / (\S+), memory \|"),
    Claim(doc="docs/claims.md", source="fused_activation_bytes-cpu-2026-11-29.json", figures=_fused_activation_bytes,
          pattern=r"planner's count (\S+) \(Llama\) / (\S+) \(GPT\) under the fused runtime's"),
    Claim(doc="docs/claims.md", source="fused_activation_bytes-cpu-2026-12-07.json", figures=_fused_activation_bytes_exact,
          pattern=r"equals what the fused runtime keeps, (\S+) \(Llama\) / (\S+) \(GPT\) bytes"),
    Claim(doc="docs/claims.md", source="bench_llama3-8b_h200x2-2026-11-29.json",
          figures=lambda data: _llama3_h200x2_first(data)[:2],
          pattern=r"the first 2-H200 run: (\S+) s measured, (\S+) s predicted before the run"),
    Claim(doc="docs/claims.md", source="fp8_convergence_h200-2026-11-29.json",
          figures=lambda data: tuple(_fp8_convergence(data)[i] for i in (2, 5, 8)),
          pattern=r"FP8 against bf16 training: (\S+) / (\S+), (\S+) apart mid-descent"),
    Claim(doc="docs/claims.md", source="fused_pricing_check-cpu-2026-12-07-session7.json", figures=_fused_pricing,
          pattern=r"vs the session-7 run, this checkout \((\S+)/(\S+), (\S+)/(\S+), (\S+)/(\S+), gains (\S+)x/(\S+)x vs (\S+)x/(\S+)x\)"),
    Claim(doc="docs/claims.md", source="fused_pricing_check-2026-11-29-session7.json", figures=lambda data: _fused_pricing(data)[2:4],
          pattern=r"session 5's planner on it (\S+)/(\S+) of mplan bf16"),
    Claim(doc="README.md", source="checkpoint_time-cpu-2026-12-05.json", figures=_checkpoint_time,
          pattern=r"blocking save (\S+) s \((\S+) GB/s\); a background save stalls (\S+) s, and the step beside it "
                  r"takes (\S+) s against (\S+) s .*; load (\S+) s under the same plan, (\S+) s resharded"),
    Claim(doc="README.md", source="train_gpu-2026-12-06.json", figures=_train_gpu,
          pattern=r"\| (\S+) ms a step \(median\), predicted (\S+) ms \((\S+)\); MFU (\S+), predicted (\S+); peak (\S+) GiB, "
                  r"predicted (\S+) GiB \((\S+)\); steps vary by (\S+) \(coefficient of variation\), one step of (\S+) s "
                  r"after the background checkpoint; loss (\S+) at the first step, (\S+) over the last 10"),
    Claim(doc="README.md", source="train_gpu-2026-12-06.json", figures=_train_gpu_checkpoint,
          pattern=r"a 1.26B Llama in bf16 \((\S+) GB with its AdamW state\), same call \| blocking save (\S+) s \((\S+) GB/s "
                  r"to the machine's disk\); a background save stalls the job (\S+) s and the step beside it takes (\S+) ms "
                  r"against (\S+) ms; load (\S+) s under the same plan, (\S+) s under another"),
    Claim(doc="README.md", source="train_gpu-2026-12-06.json", figures=_train_gpu_zero,
          pattern=r"within 1% of `max_memory_allocated` \((\S+ / \S+ / \S+) GiB measured\); step time predicted "
                  r"(\S+ / \S+ / \S+) low \((\S+ / \S+ / \S+) ms measured\)"),
    Claim(doc="README.md", source="zero_bench_h100-2026-12-06.json", figures=_zero_bench_h100,
          pattern=r"step (\S+ / \S+ / \S+) ms measured, (\S+ / \S+ / \S+) ms predicted; peak (\S+ / \S+ / \S+) GiB "
                  r"measured, (\S+ / \S+ / \S+) GiB predicted"),
    Claim(doc="README.md", source="peers-2026-12-06.json", figures=_peers(("gemma2", "phi3", "granite")),
          pattern=r"Gemma-2 \(soft-capped logits\) (\S+)x compile \((\S+) against (\S+) ms\), Phi-3 \(packed q/k/v and "
                  r"gate/up\) (\S+)x Liger \((\S+) against (\S+) ms\), Granite (\S+)x compile \((\S+) against (\S+) ms\).*"
                  r"mplan's steps vary by (\S+)%, compile's by (\S+)%"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-a.json",
          figures=_peers(("phi3", "qwen3", "granite", "gemma2")),
          pattern=r"first call: Phi-3 (\S+)x Liger \((\S+) against (\S+) ms\), Qwen3 (\S+)x compile \((\S+) against "
                  r"(\S+) ms\), Granite (\S+)x compile \((\S+) against (\S+) ms\), Gemma-2 (\S+)x compile \((\S+) against "
                  r"(\S+) ms\); steps vary by (\S+)% \(mplan\) and (\S+)% \(compile\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-b.json",
          figures=_peers(("olmo2", "cohere", "gemma3")),
          pattern=r"second call: OLMo-2 (\S+)x compile \((\S+) against (\S+) ms\), Cohere (\S+)x compile \((\S+) against "
                  r"(\S+) ms\), Gemma-3 (\S+)x compile \((\S+) against (\S+) ms\); steps vary by (\S+)% \(mplan\) and "
                  r"(\S+)% \(compile\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-a.json",
          figures=_peers(("cohere", "gemma3", "gemma2", "granite")),
          pattern=r"call a: Cohere (\S+)x compile \((\S+) against (\S+) ms\), Gemma-3 (\S+)x compile \((\S+) against "
                  r"(\S+) ms\), Gemma-2 (\S+)x compile \((\S+) against (\S+) ms\), Granite (\S+)x compile \((\S+) against "
                  r"(\S+) ms\); steps vary by (\S+)% \(mplan\) and (\S+)% \(compile\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-b.json",
          figures=_peers(("olmo2", "qwen3", "stablelm", "llama")),
          pattern=r"call b: OLMo-2 (\S+)x compile \((\S+) against (\S+) ms\), Qwen3 (\S+)x compile \((\S+) against "
                  r"(\S+) ms\), StableLM (\S+)x compile \((\S+) against (\S+) ms\), Llama (\S+)x Liger \((\S+) against "
                  r"(\S+) ms\); steps vary by (\S+)% \(mplan\) and (\S+)% \(compile\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-c.json",
          figures=_peers(("phi3", "qwen3_moe")),
          pattern=r"call c: Phi-3 (\S+)x Liger \((\S+) against (\S+) ms\), Qwen3-MoE \(64 experts\) (\S+)x compile "
                  r"\((\S+) against (\S+) ms\); steps vary by (\S+)% \(mplan\) and (\S+)% \(compile\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-own.json", figures=_own,
          pattern=r"mplan's own GPT-1.3B (\S+)x eager and (\S+)x compile, Llama-1.1B (\S+)x eager and (\S+)x compile"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-a.json", figures=_peer_profile("gemma3"),
          pattern=r"Gemma-3 is host-bound still: (\S+) ms of GPU kernels in a (\S+) ms profiled step"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session13-c.json", figures=_peer_profile("qwen3_moe"),
          pattern=r"Qwen3-MoE's, (\S+) ms of kernels in (\S+) ms"),
    Claim(doc="README.md", source="peers_profile_h100-2026-12-06-gemma3.json", figures=_peer_profile("gemma3"),
          pattern=r"Gemma-3's step is host-bound: (\S+) ms of GPU kernels in a (\S+) ms step"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session14-a.json",
          figures=lambda data: _peers(("granite", "gemma2", "gemma3"))(data)[:-2],
          pattern=r"Granite (\S+)x compile \((\S+) against (\S+) ms\), Gemma-2 (\S+)x compile \((\S+) against (\S+) ms\), "
                  r"Gemma-3 (\S+)x compile \((\S+) against (\S+) ms\): Granite's loss is gone"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session14-b.json", figures=_graphed("gemma3"),
          pattern=r"replaying: Gemma-3 (\S+)x compile \((\S+) against (\S+) ms; (\S+)x mplan without graphs; steps vary by "
                  r"(\S+)%, compile's by (\S+)%, without graphs (\S+)%\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session14-c.json", figures=_graphed("qwen3_moe"),
          pattern=r"Qwen3-MoE \(64 experts\) (\S+)x compile \((\S+) against (\S+) ms; (\S+)x mplan without graphs; steps vary "
                  r"by (\S+)%, compile's by (\S+)%, without graphs (\S+)%\)"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session14-c.json", figures=_graphed("gemma2"),
          pattern=r"Gemma-2 (\S+)x compile \((\S+) against (\S+) ms; (\S+)x mplan without graphs; steps vary by (\S+)%, "
                  r"compile's by (\S+)%, without graphs (\S+)%\)\. "),
    Claim(doc="README.md", source="dynamic_cp-predicted-2026-12-06.json", figures=_dynamic_cp,
          pattern=r"Wikipedia's published length mix \(`dynamic_cp-predicted-2026-12-06\.json`: (\S+)x over fixed "
                  r"cp=8 within a node, (\S+)x at cp=16 and (\S+)x at cp=32 across nodes.*?deals (\S+) of those "
                  r"packed sequences whole"),
    Claim(doc="README.md", source="cp_attention_h100-2026-12-06-backends.json", figures=_cp_attention,
          pattern=r"at 131072 tokens\s+and cp=2 (\S+) \+ (\S+) ms against (\S+) \+ (\S+) ms predicted, (\S+)% under the "
                  r"measurement at 64k-128k\s+tokens and at most (\S+)% at 32k.*?flash kernel, the only\s+backend of the "
                  r"first run \(`cp_attention_h100-2026-12-06.json`\), (\S+)x slower than cuDNN's and\s+(\S+)% under "
                  r"the price.*?differ by at most (\S+)% in forward time"),
    Claim(doc="README.md", source="graph_price-cpu-2026-12-06.json", figures=_graph_price,
          pattern=r"beside the race's measured steps \| graphed: Gemma-3 (\S+) ms predicted against (\S+) ms measured \((\S+)%\), Gemma-2 (\S+) against (\S+) "
                  r"\((\S+)%\), Qwen3-MoE (\S+) against (\S+) \((\S+)%\), Granite (\S+) against (\S+) \((\S+)%\); eager "
                  r"\(host priced per op\): (\S+)%, (\S+)%, (\S+)%, (\S+)%"),
    Claim(doc="docs/claims.md", source="capture-cpu-2026-11-29.json", figures=_capture,
          pattern=r"capture of gpt3-175b / llama3-405b: (\S+) s, (\S+) GiB / (\S+) s, (\S+) GiB"),
    Claim(doc="README.md", source="graph_price-cpu-2026-12-06-graphed-profile.json", figures=_graph_price,
          pattern=r"kernels timed as CUDA-graph replays.*?graphed: Gemma-3 (\S+) ms predicted against (\S+) ms measured "
                  r"\((\S+)%\), Gemma-2 (\S+) against (\S+) \((\S+)%\), Qwen3-MoE (\S+) against (\S+) \((\S+)%\), Granite "
                  r"(\S+) against (\S+) \((\S+)%\); eager \(host priced per op\): (\S+)%, (\S+)%, (\S+)%, (\S+)%"),
    Claim(doc="README.md", source="hf_measure_h100-2026-12-06-qwen3.json",
          figures=_hf_measure("qwen3", ("mbs=1", "mbs=2", "mbs=8")),
          pattern=r"Qwen3-1.7B: micro-batch 1 / 2 / 8 measured (\S+) / (\S+) / (\S+) ms .*?predicted (\S+)% / (\S+)% / "
                  r"(\S+)%, peak memory (\S+)% / (\S+)% / (\S+)%"),
    Claim(doc="README.md", source="hf_measure_h100-2026-12-06-smollm2.json",
          figures=_hf_measure("smollm2", ("mbs=1", "mbs=2", "mbs=8")),
          pattern=r"SmolLM2-1.7B: (\S+) / (\S+) / (\S+) ms, (\S+)% / (\S+)% / (\S+)%, peak (\S+)% / (\S+)% / (\S+)%"),
    *(Claim(doc="README.md", source=f"peers_h100-2026-12-06-session15-{call}.json", figures=_graphed(family),
            pattern=rf"{name} (\S+)x {peer} \((\S+) against (\S+) ms; (\S+)x mplan without graphs; steps vary by "
                    r"(\S+)%, compile's by (\S+)%, without graphs (\S+)%\)")
      for call, family, name, peer in (("a", "olmo2", "OLMo-2", "compile"), ("a", "qwen3", "Qwen3", "compile"),
                                       ("b", "stablelm", "StableLM", "compile"), ("b", "llama", "Llama", "Liger"),
                                       ("b", "cohere", "Cohere", "compile"), ("b", "phi3", "Phi-3", "Liger"))),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session15-own.json",
          figures=lambda data: tuple(fixed(data["own"]["llama"][key], 3) for key in ("mplan_vs_eager", "mplan_vs_compile")),
          pattern=r"mplan's own Llama-1.1B with graphs: (\S+)x eager, (\S+)x compile"),
    Claim(doc="README.md", source="peers_h100-2026-12-06-session16-olmo2-trace.json", figures=_traced("olmo2"),
          pattern=r"OLMo-2 (\S+)x compile \((\S+) against (\S+) ms\); steps vary by (\S+)%, compile's by (\S+)%, eager's by "
                  r"(\S+)%\. .*?the SM clock swinging (\S+)-(\S+) MHz; mplan's graphed steps drew (\S+) W on average at "
                  r"(\S+) MHz, compile's (\S+) W at (\S+) MHz, eager's (\S+) W at (\S+) MHz.*?\(correlation (\S+) mplan, "
                  r"(\S+) compile, (\S+) eager\)"),
    *(Claim(doc="README.md", source="peers-2026-12-06-session17-gemma3-granite-trace.json", figures=_traced(family),
            pattern=rf"{name} (\S+)x compile \((\S+) against (\S+) ms\); steps vary by (\S+)%, compile's by (\S+)%, "
                    r"eager's by (\S+)%[.;].*?the SM clock swinging (\S+)-(\S+) MHz; mplan's graphed steps drew (\S+) W on "
                    r"average at (\S+) MHz, compile's (\S+) W at (\S+) MHz, eager's (\S+) W at (\S+) MHz.*?correlation (\S+) "
                    r"mplan, (\S+) compile, (\S+) eager\)")
      for family, name in (("gemma3", "Gemma-3"), ("granite", "Granite, now with graphs,"))),
    Claim(doc="README.md", source="peers-2026-12-06-session17-gemma3-granite-trace.json",
          figures=lambda data: tuple(fixed(data["families"][family]["mplan_peak_vs_lowest_peer"], 3)
                                     for family in ("gemma3", "granite")),
          pattern=r"Its peak is now (\S+)x the lowest peer's .*?; peak (\S+)x the lowest peer's\. "),
    Claim(doc="README.md", source="peers-2026-12-06-session17-own-gpt.json", figures=_own_pairs("gpt"),
          pattern=r"process per pair\): (\S+)x eager \((\S+) against (\S+) ms\), (\S+)x compile \((\S+) against (\S+) "
                  r"ms\).*?\((\S+)% against eager's (\S+)%, (\S+)% against compile's (\S+)%\)"),
    *(Claim(doc="README.md", source=f"peers-2026-12-07-steady-{call}.json", figures=_steady(family),
            pattern=rf"{name} (\S+)x {peer} \((\S+) against (\S+) ms; " + (r"steps alone vary by (\S+)%, compile's by "
                                                                        if first else r"(\S+)%, ") + r"(\S+)%\)")
      for call, family, name, peer, first in (
          ("a", "olmo2", "OLMo-2", "compile", True), ("a", "qwen3", "Qwen3", "compile", False),
          ("b", "gpt2", r"now one fused GELU\)", "compile", False), ("b", "llama", "Llama", "Liger", False),
          ("c", "cohere", "Cohere", "compile", False), ("c", "phi3", "Phi-3", "Liger", False))),
    Claim(doc="README.md", source="grouped_gemm-2026-12-07.json", figures=_grouped_gemm,
          pattern=r"SmolLM2-1\.7B (\S+) ms \(the profile's copies were 3\.2 ms\), Qwen3-1\.7B (\S+) ms, "
                  r"Gemma-2B (\S+) ms; "
                  r"in the zero-bubble / FP8 form \(`linear` on `joined_weights` against `cat` \+ `linear`\) "
                  r"(\S+ / \S+ / \S+) ms"),
    Claim(doc="README.md", source="hf_reprice-cpu-2026-12-06-l2.json",
          figures=lambda data: tuple(f"{row['error_now'] * 100:+.1f}" for model in ("qwen3", "smollm2", "gemma")
                                     for row in data["models"][model]),
          pattern=r"Qwen3 (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)%; SmolLM2 (\S+)% / (\S+)% / (\S+)%, selective "
                  r"(\S+)% / (\S+)% / (\S+)%;\s+Gemma-2B (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)% / (\S+)%, full "
                  r"(\S+)%"),
    Claim(doc="README.md", source="hf_measure_h100-2026-12-06-l2-gemma_rest.json",
          figures=_measured_steps("gemma", ("mbs=2,recompute=selective", "mbs=8,recompute=selective",
                                            "mbs=8,recompute=full"), digits=0),
          pattern=r"580 / (\S+) / (\S+) ms with selective recomputation, (\S+) ms with full at 8"),
    Claim(doc="README.md", source="hf_measure_h100-2026-12-06-l2-gemma.json",
          figures=_measured_steps("gemma", ("mbs=1", "mbs=2", "mbs=8", "mbs=1,recompute=selective"), digits=0),
          pattern=r"all seven rows: (\S+) / (\S+) / (\S+) ms at micro-batch 1 / 2 / 8, (\S+) / "),
    *(Claim(doc="README.md", source=f"hf_measure-2026-12-06-session18-all-{model}.json", figures=_unseen_run(model),
            pattern=rf"gave it there with this checkout: .*?{name} (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)% / "
                    rf"(\S+)%, full (\S+)% \(peak (\S+)%\)")
      for model, name in (("qwen3", "Qwen3"), ("smollm2", "SmolLM2"), ("gemma", "Gemma-2B"))),
    Claim(doc="README.md", source="hf_measure-2026-12-06-session18-qwen3.json",
          figures=lambda data: (*_measured_steps("qwen3", ("mbs=8,recompute=selective", "mbs=8,recompute=full"))(data),
                                percent(_plan(data["models"]["qwen3"]["rows"], "mbs=8,recompute=full")["measured"]
                                        ["prediction_error"]["peak_memory"], sign=True)),
          pattern=r"selective and full recomputation (\S+) / (\S+) ms \(peak (\S+) with full\)"),
    Claim(doc="README.md", source="hf_measure-2026-12-06-session18-smollm2.json",
          figures=_measured_steps("smollm2", ("mbs=8,recompute=full", "mbs=1", "mbs=2")),
          pattern=r"SmolLM2-1\.7B with full (\S+) ms \(peak \S+\); re-measured: SmolLM2 at micro-batch 1 / 2 (\S+) / (\S+) ms"),
    Claim(doc="README.md", source="hf_measure-2026-12-06-session18-smollm2-b.json",
          figures=_measured_steps("smollm2", ("mbs=1,recompute=selective", "mbs=2,recompute=selective")),
          pattern=r"re-measured: SmolLM2 at micro-batch 1 / 2 \S+ / \S+ ms, selective (\S+) / (\S+) ms"),
    Claim(doc="README.md", source="hf_measure-2026-12-06-session18-gemma.json",
          figures=_measured_steps("gemma", ("mbs=1", "mbs=2")),
          pattern=r"selective \S+ / \S+ ms, Gemma-2B (\S+) / (\S+) ms\. The profiled"),
    Claim(doc="README.md", source="hf_reprice-cpu-2026-12-06-session18.json", figures=_unseen_latest,
          pattern=r"each row on its latest measurement: Qwen3 (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)% / "
                  r"(\S+)%, full (\S+)%; SmolLM2 (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)% / (\S+)%, full (\S+)%; "
                  r"Gemma-2B (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)% / (\S+)%, full (\S+)%; peaks within (\S+)% "
                  r"\(full recomputation (\S+)% / (\S+)% / (\S+)%\)\. (\d+) of (\d+) within 10%"),
    Claim(doc="README.md", source="hf_reprice-cpu-2026-12-06-accumulation-qwen3.json",
          figures=_repriced("qwen3", ("mbs=1", "mbs=2", "mbs=8", "mbs=1,recompute=selective")),
          pattern=r"Qwen3 (\S+)% / (\S+)% / (\S+)% and (\S+)% with selective recomputation"),
    Claim(doc="README.md", source="hf_reprice-cpu-2026-12-06-accumulation-smollm2.json",
          figures=_repriced("smollm2", ("mbs=1", "mbs=2", "mbs=8", "mbs=1,recompute=selective",
                                        "mbs=2,recompute=selective")),
          pattern=r"SmolLM2 (\S+)% / (\S+)% / (\S+)%, selective (\S+)% / (\S+)%: every"),
    Claim(doc="README.md", source="dynamic_cp_aligned-predicted-2026-12-06.json", figures=_cp_aligned,
          pattern=r"it runs (\S+) / (\S+) / (\S+)% of Wikipedia's windows at cp=1 for cp = 8 / 16 / 32, (\S+)% padding,\s+"
                  r"predicted (\S+)x / (\S+)x / (\S+)x fixed CP per real token"),
)


# -- the check -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    doc: str
    line: int
    """1-based line of the unit's first line."""
    text: str
    """The unit's lines joined by spaces."""
    context: str = ""
    """For a table row, the paragraph just above its table: where a table cites its file once."""

    def cites(self, name: str) -> bool:
        return name in self.text or name in self.context


@dataclass(slots=True, kw_only=True)
class ClaimsReport:
    problems: list[str] = field(default_factory=list)
    unchecked: list[tuple[Unit, list[str]]] = field(default_factory=list)
    checked_figures: int = 0


def units(doc: str, text: str) -> list[Unit]:
    """Table rows one by one, other lines by paragraph (module docstring)."""
    out: list[Unit] = []
    paragraph: list[str] = []
    start = 0

    def flush() -> None:
        if paragraph:
            out.append(Unit(doc=doc, line=start, text=" ".join(line.strip() for line in paragraph)))
            paragraph.clear()
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("|"):
            flush()
            above = [u for u in out if not u.text.startswith("|")]
            context = above[-1].text if above and out[-1].line >= above[-1].line else ""
            out.append(Unit(doc=doc, line=number, text=line.strip(), context=context))
        elif not line.strip():
            flush()
        else:
            if not paragraph:
                start = number
            paragraph.append(line)
    flush()
    return out


def load_source(root: Path, source: str) -> Any:
    path = root / source if "/" in source else root / RESULTS / source
    if path.suffix == ".py":
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.AnnAssign | ast.Assign)
                for target in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
                if isinstance(target, ast.Name) and _literal(node.value)}
    return json.loads(path.read_text(encoding="utf-8"))


def _literal(node: ast.AST | None) -> bool:
    try:
        ast.literal_eval(node)  # type: ignore[arg-type]
    except (ValueError, TypeError, SyntaxError):
        return False
    return True


CITED = re.compile(r"[A-Za-z][\w.-]*\d{4}-\d{2}-\d{2}[\w.-]*\.(?:jsonl|json|csv|log)(?!\w)")
"""A dated results file name, as the docs cite them (suffix forms like `-run2` are not checked)."""
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:e-?\d+)?%?")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
"""Dates are when a run was made, not a figure of it."""
CODE = re.compile(r"`[^`]*`")


def check(root: Path = ROOT, docs: dict[str, str] | None = None, claims: Sequence[Claim] = CLAIMS) -> ClaimsReport:
    """Every claim against its source, every citation against benchmarks/results/ (module docstring).
    `docs` replaces doc texts by path (tests edit a copy this way)."""
    texts = {str(p.relative_to(root)): p.read_text(encoding="utf-8")
             for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    texts.update(docs or {})
    all_units = {doc: units(doc, text) for doc, text in texts.items()}
    report = ClaimsReport()
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for claim in claims:
        _check_claim(root, claim, all_units.get(claim.doc, []), report, covered)
    for doc, doc_units in all_units.items():
        for unit in doc_units:
            cited = set(CITED.findall(unit.text))
            for name in sorted(cited):
                paths = [root / folder / name for folder in CITABLE if (root / folder / name).is_file()]
                if "*" not in name and not paths:
                    report.problems.append(f"{doc}:{unit.line}: cites {name}, which {RESULTS}/ does not hold")
                by_hand = _hand_assembled(paths[0]) if paths else None
                if by_hand and "hand-assembled" not in unit.text:
                    report.problems.append(f"{doc}:{unit.line}: cites {name} ({by_hand}) without saying it is "
                                           "hand-assembled")
            if cited:
                loose = _unchecked_figures(unit, covered.get((doc, unit.line), []))
                if loose:
                    report.unchecked.append((unit, loose))
    return report


@functools.cache
def _hand_assembled(path: Path) -> str | None:
    """What was done by hand to a results file (its `hand_assembled` key), or None."""
    if path.suffix != ".json":
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data.get(HAND_ASSEMBLED) if isinstance(data, dict) else None


def _check_claim(root: Path, claim: Claim, doc_units: list[Unit], report: ClaimsReport,
                 covered: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
    where = f"{claim.doc}: claim /{claim.pattern[:60]}.../"
    try:
        expected = claim.figures(load_source(root, claim.source))
    except (OSError, ValueError, KeyError, AssertionError) as error:
        report.problems.append(f"{where}: its source {claim.source} does not give its figures ({type(error).__name__}: {error})")
        return
    name = Path(claim.source).name
    matches = [(unit, m) for unit in doc_units for m in re.finditer(claim.pattern, unit.text)]
    if not matches:
        report.problems.append(f"{where} is not in the doc: the sentence changed; register it again")
        return
    for unit, match in matches:
        if not unit.cites(name):
            report.problems.append(f"{claim.doc}:{unit.line}: {match.group(0)[:60]!r} does not cite {name}, its source")
        if len(match.groups()) != len(expected):
            report.problems.append(f"{where}: {len(match.groups())} figures in the doc, {len(expected)} from {name}")
            continue
        for index, (said, true) in enumerate(zip(match.groups(), expected), start=1):
            if said != true:
                report.problems.append(f"{claim.doc}:{unit.line}: says {said} where {name} gives {true} "
                                       f"(figure {index} of /{claim.pattern[:50]}.../)")
        report.checked_figures += len(expected)
        covered.setdefault((claim.doc, unit.line), []).append(match.span())


def _unchecked_figures(unit: Unit, spans: list[tuple[int, int]]) -> list[str]:
    code = [m.span() for pattern in (CODE, DATE) for m in pattern.finditer(unit.text)]
    return [m.group(0) for m in NUMBER.finditer(unit.text)
            if not any(a <= m.start() < b for a, b in spans + code)]


def main(argv: Sequence[str], root: Path = ROOT) -> int:
    report = check(root)
    for problem in report.problems:
        print(problem)
    loose = sum(len(figures) for _, figures in report.unchecked)
    if "--list" in argv:
        for unit, figures in report.unchecked:
            print(f"unchecked {unit.doc}:{unit.line}: {' '.join(figures)}")
    print(f"{report.checked_figures} figures checked by {len(CLAIMS)} claims; {len(report.problems)} problems; "
          f"{loose} figures in {len(report.unchecked)} cited rows or paragraphs not yet registered (--list)")
    return 1 if report.problems else 0
