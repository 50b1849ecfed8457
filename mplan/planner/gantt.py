"""The Gantt chart of a plan's pipeline schedule: one row per pipeline rank, as the schedule
simulator runs the plan's own stage times (`explain.simulate_plan`); `mplan explain --gantt`.

Forward, backward (or its input- and weight-gradient halves) and DP sync bars over a grey idle
lane, virtual-stage chunks shaded lighter, micro-batch numbers where they fit, a legend; a rank of
more bars than the chart has pixels for is drawn as time bins. Drawn with one `broken_barh` per
(rank, kind, chunk) and one collection of label glyphs, so a step of thousands of bars (the
175B demo's 512 micro-batches) draws in about a second.
"""
from __future__ import annotations

from typing import Any

from mplan.planner.explain import simulate_plan
from mplan.planner.plan import Plan

GANTT_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#DD8452", "GRAD_SYNC": "#8C8C8C"}
GANTT_IDLE = "#EDEDED"
GANTT_MAX_BARS = 750
"""Compute bars per rank above which the chart aggregates (bars would average under 2 pixels): time
is cut into GANTT_BINS equal bins, each split into the time each kind (and chunk) ran in it, the
rest left idle grey."""
GANTT_BINS = 400


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _shade(color: str, chunk: int, vpp: int) -> str:
    """Virtual-stage chunk 0 in the full colour, later chunks lighter (mixed with white)."""
    if vpp <= 1 or chunk == 0:
        return color
    mix = 0.55 * chunk / (vpp - 1)
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def _label_collection(labels: list[tuple[float, int, str]], ax: Any) -> Any:
    """Micro-batch numbers as one collection of glyph outlines (one TextPath per distinct number),
    centred on their bars: hundreds of `ax.text` artists would take seconds to lay out and draw."""
    from matplotlib.collections import PathCollection
    from matplotlib.path import Path
    from matplotlib.textpath import TextPath
    from matplotlib.transforms import Affine2D

    glyphs: dict[str, Any] = {}
    for _, _, text in labels:
        if text not in glyphs:
            path = TextPath((0, 0), text, size=6)
            box = path.get_extents()
            glyphs[text] = Path(path.vertices - [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2], path.codes)
    collection = PathCollection([glyphs[t] for _, _, t in labels], offsets=[(x, y) for x, y, _ in labels],
                                offset_transform=ax.transData, facecolors="white", edgecolors="none",
                                linewidths=0, zorder=3)
    collection.set_transform(Affine2D().scale(ax.figure.dpi / 72.0))
    return collection


def draw_gantt(plan: Plan, path: str) -> None:
    """The simulated schedule, one row per pipeline rank: forward, backward (or its input- and
    weight-gradient halves) and DP sync bars over a grey idle lane, virtual-stage chunks shaded,
    micro-batch numbers where they fit, and a legend. One `broken_barh` per (rank, kind, chunk),
    so a step of thousands of bars draws in about a second; above GANTT_MAX_BARS bars on a rank
    the row is aggregated into time bins (said in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim = simulate_plan(plan)
    pp, vpp = plan.mesh.pp, max(plan.mesh.vpp, 1)
    step_ms = max(sim.step_time_s * 1e3, 1e-9)
    width_in, dpi = 13.0, 130
    left, right = 0.09, 0.985
    fig_h = 1.9 + 0.55 * pp
    fig, ax = plt.subplots(figsize=(width_in, fig_h), dpi=dpi)
    fig.subplots_adjust(left=left, right=right, top=1 - 0.55 / fig_h, bottom=0.85 / fig_h)
    px_per_ms = width_in * dpi * (right - left) / (step_ms * 1.02)

    compute: dict[int, list] = {r: [] for r in range(pp)}
    bars: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for ev in sim.timeline:
        if ev.stream == "comm":
            bars.setdefault(("comm", ev.rank, GANTT_COLORS["GRAD_SYNC"]), []).append(
                (ev.start_s * 1e3, (ev.end_s - ev.start_s) * 1e3))
        else:
            compute[ev.rank].append(ev)
    aggregated = False
    labels: list[tuple[float, int, str]] = []
    for rank, events in compute.items():
        if len(events) > GANTT_MAX_BARS:
            aggregated = True
            bin_ms = step_ms / GANTT_BINS
            share: dict[int, dict[str, float]] = {}
            for ev in events:
                color = _shade(GANTT_COLORS.get(ev.action.kind, "#C44E52"), ev.action.stage // pp, vpp)
                a, b = ev.start_s * 1e3, ev.end_s * 1e3
                i = int(a / bin_ms)
                while i * bin_ms < b and i < GANTT_BINS:
                    lo, hi = max(a, i * bin_ms), min(b, (i + 1) * bin_ms)
                    cell = share.setdefault(i, {})
                    cell[color] = cell.get(color, 0.0) + max(hi - lo, 0.0)
                    i += 1
            for i, cell in share.items():  # the bin's time per kind side by side, its idle part left grey
                x = i * bin_ms
                for color, busy in sorted(cell.items()):
                    bars.setdefault(("compute", rank, color), []).append((x, busy))
                    x += busy
            continue
        for ev in events:
            start, dur = ev.start_s * 1e3, (ev.end_s - ev.start_s) * 1e3
            color = _shade(GANTT_COLORS.get(ev.action.kind, "#C44E52"), ev.action.stage // pp, vpp)
            bars.setdefault(("compute", rank, color), []).append((start, dur))
            text = str(ev.action.microbatch)
            if dur * px_per_ms >= 5.5 * len(text) + 4:
                labels.append((start + dur / 2, rank, text))
    # white outlines part the bars only where they are wide: on bars of a few pixels they would hide them
    durations = sorted(ev.end_s - ev.start_s for events in compute.values() for ev in events)
    outlined = not aggregated and bool(durations) and durations[len(durations) // 2] * 1e3 * px_per_ms >= 6
    for rank in range(pp):
        ax.broken_barh([(0.0, sim.pipeline_time_s * 1e3)], (rank - 0.3, 0.6), facecolors=GANTT_IDLE, linewidth=0)
    for (stream, rank, color), spans in bars.items():
        y, h = (rank + 0.32, 0.2) if stream == "comm" else (rank - 0.3, 0.6)
        edge = dict(edgecolor="white", linewidth=0.4) if stream == "compute" and outlined else dict(linewidth=0)
        ax.broken_barh(spans, (y, h), facecolors=color, **edge)
    if labels:
        ax.add_collection(_label_collection(labels, ax), autolim=False)

    ax.set_xlim(0, step_ms * 1.02)
    ax.set_ylim(pp - 0.4, -0.6)
    ax.set_yticks(range(pp))
    idle = {r.rank: r.idle_s / sim.pipeline_time_s if sim.pipeline_time_s > 0 else 0.0 for r in sim.ranks}
    ax.set_yticklabels([f"rank {r}\nidle {idle[r]:.0%}" for r in range(pp)], fontsize=8)
    ax.set_xlabel("time (ms)")
    split = any(ev.action.kind == "W" for ev in sim.timeline)
    handles = [Patch(facecolor=GANTT_COLORS["F"], label="F forward")]
    handles += ([Patch(facecolor=GANTT_COLORS["I"], label="I input grad"),
                 Patch(facecolor=GANTT_COLORS["W"], label="W weight grad")] if split else
                [Patch(facecolor=GANTT_COLORS["B"], label="B backward")])
    handles += [Patch(facecolor=GANTT_COLORS["GRAD_SYNC"], label="DP grad sync (comm stream)"),
                Patch(facecolor=GANTT_IDLE, edgecolor="#BBBBBB", label="idle (bubble, waits for p2p)")]
    if vpp > 1:
        handles += [Patch(facecolor=_shade("#606060", c, vpp), label=f"vpp chunk {c}")
                    for c in sorted({0, vpp - 1} | ({vpp // 2} if vpp > 2 else set()))]
    note = (f"aggregated: {GANTT_BINS} time bins per rank, each split by the time each kind ran in it" if aggregated
            else "numbers: micro-batch (where they fit)")
    handles.append(Patch(facecolor="none", edgecolor="none", label=note))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 9),
               fontsize=7.5, frameon=False, handlelength=1.4, columnspacing=1.2)
    ax.set_title(f"{_short(plan.model.name)}: {plan.schedule}, pp={pp}, vpp={vpp}, "
                 f"{plan.num_micro_batches} micro-batches, step {step_ms:.0f} ms, "
                 f"bubble {sim.bubble_fraction:.1%} (rank {sim.critical_rank})", fontsize=9)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
