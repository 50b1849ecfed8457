"""Alpha-beta fits of measured collective timings: ``t = alpha + bus_bytes / beta``.

Role: turn (message size, seconds) points measured by ``measure_links.profile_links`` into the two
numbers the collective cost model uses for one (collective, level): a latency ``alpha`` (s) and a
bandwidth ``beta`` (B/s).
Input: bus bytes per point (the message size times the collective's bus factor, nccl-tests'
convention, so that ``beta`` is a bus bandwidth comparable across group sizes and with published
nccl-tests busbw figures) and the measured seconds.
Output: ``AlphaBetaFit``, one per size segment (``fit_segments``): NCCL switches protocol and
algorithm with the message size (on 2 H200s the all-reduce's time stays flat from 1 to 4 MiB,
then grows at 380 GB/s to 16 MiB and at 290 GB/s beyond), and one line missed those measured
points above 1 MiB by 12-30%; two lines, each over at least MIN_SEGMENT_POINTS sizes, came within
4-8% for four of the five collectives.
Invariants: ``alpha >= 0``, ``beta > 0``. The fit minimises weighted *relative* squared error with
weights ``sqrt(bytes / max_bytes)``: relative so microsecond-scale small messages are not drowned by
large ones, weighted so the large messages that dominate training step time are reproduced best
(a test checks points above 1 MiB come back within 10%).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEVELS: tuple[str, ...] = ("intra_node", "inter_node")
"""Link levels a fit can describe: all ranks of the group in one node, or one rank per node."""

LARGE_MESSAGE_BYTES = 1 << 20
"""Messages from this size (bytes) up are the ones the fit is judged on (``max_rel_error``)."""
MIN_SEGMENT_POINTS = 3
"""A segment's line is fitted on at least this many sizes: two would always pass through them."""
SPLIT_GAIN = 0.02
"""A second segment must lower the worst error by this much (absolute), or one line is kept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBetaFit:
    """A measured latency-bandwidth model of one collective on one link level."""

    collective: str  # one of collective_cost.COLLECTIVES
    level: str  # one of LEVELS
    alpha_s: float  # seconds: fixed cost per call
    beta_Bps: float  # bytes/second: bus bandwidth (bus bytes, nccl-tests' busbw convention)
    group_size: int  # ranks in the group the points were measured on
    num_points: int  # measured sizes the fit used
    max_rel_error: float  # worst |fit/measured - 1| over points >= LARGE_MESSAGE_BYTES (all if none)
    min_bus_bytes: float = 0.0  # the segment prices bus sizes from here up to the next segment's

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"AlphaBetaFit.level must be one of {LEVELS}, got {self.level!r}")
        if not (self.alpha_s >= 0 and self.beta_Bps > 0):
            raise ValueError(f"AlphaBetaFit needs alpha_s >= 0 and beta_Bps > 0, "
                             f"got alpha_s={self.alpha_s}, beta_Bps={self.beta_Bps}")

    def time(self, bus_bytes: float) -> float:
        """Predicted seconds for a call moving ``bus_bytes`` bus bytes."""
        return self.alpha_s + bus_bytes / self.beta_Bps


def fit_alpha_beta(bus_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_Bps)`` for ``t = alpha + x / beta``.

    Minimises ``sum_i w_i ((alpha + x_i g - t_i) / t_i)^2`` over ``alpha >= 0`` and ``g = 1/beta > 0``
    with ``w_i = sqrt(x_i / max x)``; a 2x2 normal-equation solve, then a one-parameter refit with
    ``alpha = 0`` if the unconstrained latency came out negative (measurement noise on fast links).
    """
    if len(bus_bytes) != len(seconds) or len(bus_bytes) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 (bytes, seconds) pairs of equal length, "
                         f"got {len(bus_bytes)} sizes and {len(seconds)} times")
    if min(bus_bytes) <= 0 or min(seconds) <= 0:
        raise ValueError("fit_alpha_beta needs positive sizes and times")
    x_max = max(bus_bytes)
    # Row i of the weighted system: sqrt(w_i)/t_i * [1, x_i] . [alpha, g] = sqrt(w_i).
    saa = sag = sgg = sa = sg = 0.0
    for x, t in zip(bus_bytes, seconds):
        w = (x / x_max) ** 0.5
        a, g = w ** 0.5 / t, w ** 0.5 * x / t
        rhs = w ** 0.5
        saa, sag, sgg, sa, sg = saa + a * a, sag + a * g, sgg + g * g, sa + a * rhs, sg + g * rhs
    det = saa * sgg - sag * sag
    alpha, inv_beta = (-1.0, -1.0) if det <= 0 else ((sa * sgg - sg * sag) / det, (saa * sg - sag * sa) / det)
    if alpha < 0 or inv_beta <= 0:
        alpha, inv_beta = 0.0, sg / sgg
    return alpha, 1.0 / inv_beta


def fit_segments(bus_bytes: Sequence[float], seconds: Sequence[float]) -> list[tuple[float, float, float, float]]:
    """``(min_bus_bytes, alpha_s, beta_Bps, max_rel_error)`` per segment, by size: one line, or
    two split at the measured size that makes the worse segment's error (``max_relative_error``
    on its own points: a segment of small messages only is judged on all of them) smallest, when
    that beats one line by ``SPLIT_GAIN``."""
    points = sorted(zip(bus_bytes, seconds))

    def segment(part: list[tuple[float, float]]) -> tuple[float, float, float, float]:
        xs, ts = [p[0] for p in part], [p[1] for p in part]
        fit = fit_alpha_beta(xs, ts)
        return part[0][0], fit[0], fit[1], max_relative_error(fit, xs, ts)

    best = [(0.0, *segment(points)[1:])]
    for cut in range(MIN_SEGMENT_POINTS, len(points) - MIN_SEGMENT_POINTS + 1):
        low, high = segment(points[:cut]), segment(points[cut:])
        if max(low[3], high[3]) < max(s[3] for s in best) - (SPLIT_GAIN if len(best) == 1 else 0.0):
            best = [(0.0, *low[1:]), high]
    return best


def max_relative_error(fit: tuple[float, float], bus_bytes: Sequence[float], seconds: Sequence[float]) -> float:
    """Worst ``|predicted/measured - 1|`` over points >= LARGE_MESSAGE_BYTES (over all if none are)."""
    alpha, beta = fit
    pairs = [(x, t) for x, t in zip(bus_bytes, seconds) if x >= LARGE_MESSAGE_BYTES] or list(zip(bus_bytes, seconds))
    return max(abs((alpha + x / beta) / t - 1.0) for x, t in pairs)
