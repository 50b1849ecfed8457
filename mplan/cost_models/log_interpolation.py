"""Interpolation of measured tables in log space.

Role: ``compute_cost`` turns a profile's kernel timings (GEMM throughput over (m, n, k), attention
throughput over its shape, copy time over bytes) into a value at any shape.
Input: points ``(coords, value)`` with positive coordinates and values.
Output: ``LogInterpolator(points)(coords)``: multilinear interpolation of ``log value`` over
``log coords`` when the points form a full grid (every combination of the distinct coordinates per
axis, as ``measure_device`` writes them); otherwise inverse-distance weighting of the 2^d nearest
points in log space. Outside the grid, coordinates are clamped to its edges (the caller decides how
to extrapolate, e.g. with a shape-efficiency curve); ``clamped`` reports where that happened.
Invariants: reproduces every measured point exactly; monotone along an axis where the data are.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence


class LogInterpolator:
    __slots__ = ("_axes", "_grid", "_points", "_dims")

    def __init__(self, points: Sequence[tuple[tuple[float, ...], float]]) -> None:
        if not points:
            raise ValueError("LogInterpolator needs at least one point")
        self._dims = len(points[0][0])
        logged: dict[tuple[float, ...], list[float]] = {}
        for coords, value in points:
            if len(coords) != self._dims or min(coords) <= 0 or value <= 0:
                raise ValueError(f"LogInterpolator points need {self._dims} positive coordinates and a positive value")
            logged.setdefault(tuple(math.log(c) for c in coords), []).append(math.log(value))
        # Repeated coordinates (several measurements of one shape) are averaged in log space.
        self._points = {c: sum(v) / len(v) for c, v in logged.items()}
        self._axes = [sorted({c[d] for c in self._points}) for d in range(self._dims)]
        full = math.prod(len(axis) for axis in self._axes) == len(self._points)
        self._grid = full

    def clamped(self, coords: Sequence[float]) -> tuple[float, ...]:
        """``coords`` moved onto the grid's range, axis by axis (in linear units)."""
        return tuple(math.exp(min(max(math.log(c), axis[0]), axis[-1])) for c, axis in zip(coords, self._axes))

    def __call__(self, coords: Sequence[float]) -> float:
        x = [min(max(math.log(c), axis[0]), axis[-1]) for c, axis in zip(coords, self._axes)]
        return math.exp(self._multilinear(x) if self._grid else self._inverse_distance(x))

    def _multilinear(self, x: list[float]) -> float:
        brackets = []
        for value, axis in zip(x, self._axes):
            if len(axis) == 1:
                brackets.append(((axis[0], 1.0),))
                continue
            hi = min(max(bisect.bisect_left(axis, value), 1), len(axis) - 1)
            lo_v, hi_v = axis[hi - 1], axis[hi]
            t = (value - lo_v) / (hi_v - lo_v)
            brackets.append(((lo_v, 1.0 - t), (hi_v, t)))
        total = 0.0
        for corner in itertools.product(*brackets):
            weight = math.prod(w for _, w in corner)
            if weight:
                total += weight * self._points[tuple(c for c, _ in corner)]
        return total

    def _inverse_distance(self, x: list[float]) -> float:
        distances = sorted((math.dist(x, c), v) for c, v in self._points.items())
        nearest = distances[: 2 ** self._dims]
        if nearest[0][0] < 1e-12:
            return nearest[0][1]
        weights = [1.0 / d ** 2 for d, _ in nearest]
        return sum(w * v for w, (_, v) in zip(weights, nearest)) / sum(weights)
