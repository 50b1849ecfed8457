"""Seconds a kernel takes on one device: measured tables first, a fitted roofline otherwise.

Role: the planner's price of compute: ``ComputeCostModel(cluster)`` answers ``matmul_time``,
``attention_time`` and ``memory_bound_time`` for the cluster's device.
Input: a ``ClusterSpec`` (its ``DeviceSpec`` and, when present, its profile's ``DeviceProfile``).
Output: seconds for one kernel call.

With a profile, the measured table is interpolated in log space (``log_interpolation.py``): GEMM
throughput over (m, n, k) per dtype, attention throughput over (batch*heads, sqrt(seq_q*seq_kv),
head_dim) per (dtype, causal) (the profile times seq_q == seq_kv, so the geometric mean keeps the
table a full grid), copy time over bytes. Below the table's smallest GEMM the throughput
is scaled down by the efficiency curve below (relative to the table's edge), never held flat.
Each table is read through its containment envelope first (`containment_envelope`): a kernel is
never slower than one at least as large on every axis (the same work, padded), so a measured time
above the least time of any shape containing it is the timer's glitch, not the kernel's. The H100
profile of 2026-12-05 has such glitches where its host was slow: [4096, 1024] @ [1024, 256] timed
409 us against 38 us for k = 2048, which priced Gemma-3's k and v projections ([4096, 1152] @
[1152, 256]) at 9 TFLOP/s: 8 ms of a 72 ms price for a step measured at 38 ms
(benchmarks/results/graph_price-cpu-2026-12-06.json).

Without one, a roofline: ``max(flops / (peak * gemm_efficiency * shape(m, n, k)), bytes / (bandwidth *
memory_efficiency))`` with the GEMM shape curve

    shape(m, n, k) = (W / (W + C_MN)) * (m / (m + C_T)) * (n / (n + C_T)) * (k / (k + C_K)),
    W = m n (see split-K below)

The first factor is occupancy: a small output has too few tiles to fill the SMs (it falls linearly
as m n -> 0); the middle two are tile fill: an output side narrower than a tile (n = 128 for a
per-head PV product) wastes the rest of it; the last is the K-loop's amortisation of each tile's
prologue and epilogue. C_MN = 3.24e6, C_T = 70 and C_K = 135 are fitted (GEMM_POINTS_FILES) on 17
bf16 GEMMs measured on one H200 here (k from 64 to 8192, n from 96 to 16384) by least squares in
log space with the asymptote fixed at the 788 TFLOP/s achievable rate (peak * gemm_efficiency):
RMS error 6.6%, largest 18% (k = 64). A first fit on the five large-k points alone (C_K = 394)
priced k = 128 at half its measured rate: that is why the small-k points were measured.
C_MN is about one wave of output tiles (132 SMs x a 128x160 tile), which is what "occupancy" means.
Split-K (an assumption, not fitted: all five points fill several waves): for outputs smaller than one
wave cuBLAS splits the K loop across SMs, so the occupancy factor counts ``m n max(1, k /
SPLIT_K_CHUNK)`` output work, up to one wave: ``W = max(m n, min(C_MN, m n k / SPLIT_K_CHUNK))``.
Without it a skinny [1, 8192] @ [8192, 8192] product would be priced above its memory-bound time.
Its use on other GPUs (A100, H100) assumes the same tile shapes: an assumption, not a measurement.
The `cpu` preset's GEMMs take no shape factor: priced with one wave of H200 tiles, a [128, 64] @
[64, 64] product cost 0.2 s at the preset's 20 GFLOP/s, and a 2-layer model's step 4.8 s where it
measured 0.02 s on two gloo ranks.

Attention FLOPs: forward ``4 b h sq skv d`` (QK^T and PV), times the unmasked fraction
``1 - (sq - 1) / (2 skv)`` when causal; backward ``2.5x`` forward (five matmuls against two, with
the recomputation of the scores, as FlashAttention-2 counts them). Without a profile they run at a
fixed fraction of the achievable GEMM rate: ATTENTION_FORWARD_EFFICIENCY = 0.43 and
ATTENTION_BACKWARD_EFFICIENCY = 0.37 -- FlashAttention-2 on H100 (what PyTorch SDPA's flash backend
runs), about 335 TFLOP/s forward and 290 backward at head_dim 128 on long sequences as published
in the FlashAttention-3 paper (Shah et al., 2024, figures read approximately), over 788.
Invariants: results are cached per (op, shape, dtype); all times are positive for positive shapes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.dtypes import canonical_dtype, dtype_bytes
from mplan.cost_models.log_interpolation import LogInterpolator
from mplan.cost_models.profile import DeviceProfile, usable_tables

GEMM_CURVE_C_MN = 3.24e6
"""Output elements (m*n) at which the occupancy factor is one half; fitted (see GEMM_POINTS_FILES)."""
GEMM_CURVE_C_TILE = 70.0
"""An output side (m or n) at which the tile-fill factor is one half: narrow outputs (n = 96 or 128,
attention's PV product per head) waste most of a 128-wide tile; fitted (see GEMM_POINTS_FILES)."""
GEMM_CURVE_C_K = 135.0
"""Reduction depth k at which the K-loop factor is one half; fitted (see GEMM_POINTS_FILES)."""
GEMM_POINTS_FILES = ("mplan/cost_models/reference/h200-measured-2026-11-29.json",
                     "benchmarks/results/gemm_small_k_h200-2026-11-29.json")
"""The 17 bf16 GEMMs on one H200 the curve is fitted on (k from 64 to 8192, n from 96 to 16384):
least squares in log space, asymptote fixed at 788 TFLOP/s; RMS error 6.6%, largest 18% (k = 64).
The first five alone (k >= 2048) had given C_K = 394, which priced k = 128 at half its measured rate.
`fit_gemm_curve` is that rule: on the 17 it gives C_MN = 3.19e6, C_T = 72.4, C_K = 134.6, as good a
fit as the rounded constants (6.6% RMS of the log either way). Held out (tests/test_held_out.py):
refitted on 16, the 17th predicted, for each of the 17."""
SKINNY_ROWS = 16
"""At most this many rows (or columns): priced as a memory-bound matrix-vector product; an assumption."""
SPLIT_K_CHUNK = 1024.0
"""K elements per split-K slice when a small output is spread over the SMs: an assumption, not fitted."""
H200_GEMM_POINTS: tuple[tuple[int, int, int, float], ...] = (
    (8192, 8192, 8192, 756.0e12), (16384, 6144, 2048, 645.6e12), (16384, 2048, 6144, 690.9e12),
    (16384, 1536, 2048, 587.6e12), (4096, 4096, 4096, 614.4e12))
"""(m, n, k, FLOP/s) measured here on 2026-11-29, bf16, one H200: the points the curve was fitted on
(the GEMMs of the packaged h200-measured-2026-11-29.json, ``reference_data.load_h200_gemm_points``;
a test checks the two agree)."""
ATTENTION_FORWARD_EFFICIENCY = 0.43
"""Fraction of the achievable GEMM rate SDPA forward reaches (published FlashAttention-2 on H100, see above)."""
ATTENTION_BACKWARD_EFFICIENCY = 0.37
"""Same for the backward pass."""
ATTENTION_BACKWARD_FLOP_RATIO = 2.5
"""Backward FLOPs per forward FLOP of attention (FlashAttention-2's accounting)."""


def gemm_shape_efficiency(m: float, n: float, k: float, curve: tuple[float, float, float] | None = None) -> float:
    """The shape factor in (0, 1) of the GEMM efficiency curve (module docstring); `curve` is
    (C_MN, C_T, C_K), the module's fitted constants when None."""
    c_mn, c_tile, c_k = curve or (GEMM_CURVE_C_MN, GEMM_CURVE_C_TILE, GEMM_CURVE_C_K)
    work = max(m * n, min(c_mn, m * n * k / SPLIT_K_CHUNK))
    # A side of a few rows is a matrix-vector product: cuBLAS runs a memory-bound kernel, no tiles.
    tiles = 1.0 if min(m, n) <= SKINNY_ROWS else (m / (m + c_tile)) * (n / (n + c_tile))
    return (work / (work + c_mn)) * tiles * (k / (k + c_k))


def achievable_gemm_rate(linears: Sequence[dict], min_dim: int = 2048) -> float:
    """The rule the presets' achievable bf16 GEMM rate is checked by: the median FLOP/s of the
    training GEMMs (forward, input and weight gradients) of linears whose weight is at least
    `min_dim` on both sides, given as benchmarks/models/gemm_ceiling.py's `linears` rows."""
    rates = [row["tflops"][phase] * 1e12 for row in linears if min(row["in"], row["out"]) >= min_dim
             for phase in ("forward", "input_grad", "weight_grad")]
    if not rates:
        raise ValueError(f"no linear is at least {min_dim} on both sides")
    return float(numpy.median(rates))


def fit_gemm_curve(points: Sequence[tuple[float, float, float, float]], achievable: float,
                   start: tuple[float, float, float] = (1e6, 100.0, 100.0)) -> tuple[float, float, float]:
    """(C_MN, C_T, C_K) fitted on `points`, (m, n, k, FLOP/s measured) GEMMs, by the rule the
    module's constants were fitted by: least squares on log(achievable * shape(m, n, k) / measured),
    the asymptote `achievable` fixed (788 TFLOP/s on the H200). Damped Gauss-Newton over the
    constants' logarithms (they stay positive), forward-difference Jacobian; unrounded."""
    def residuals(logs: list[float]) -> list[float]:
        curve = (math.exp(logs[0]), math.exp(logs[1]), math.exp(logs[2]))
        return [math.log(achievable * gemm_shape_efficiency(m, n, k, curve) / rate) for m, n, k, rate in points]

    def cost(r: list[float]) -> float:
        return sum(x * x for x in r)

    logs, damping, step = [math.log(c) for c in start], 1e-3, 1e-6
    r = residuals(logs)
    for _ in range(500):
        columns = []
        for i in range(3):
            shifted = list(logs)
            shifted[i] += step
            columns.append([(a - b) / step for a, b in zip(residuals(shifted), r)])
        normal = [[sum(a * b for a, b in zip(columns[i], columns[j])) for j in range(3)] for i in range(3)]
        gradient = [sum(a * b for a, b in zip(columns[i], r)) for i in range(3)]
        while True:
            damped = [[normal[i][j] * (1.0 + damping if i == j else 1.0) for j in range(3)] for i in range(3)]
            delta = [float(d) for d in numpy.linalg.solve(damped, [-g for g in gradient])]
            trial = [a + d for a, d in zip(logs, delta)]
            trial_r = residuals(trial)
            if cost(trial_r) <= cost(r):
                break
            damping *= 10.0
            if damping > 1e12:
                return tuple(math.exp(x) for x in logs)  # type: ignore[return-value]
        improved = cost(r) - cost(trial_r)
        logs, r, damping = trial, trial_r, max(damping / 10.0, 1e-12)
        if improved < 1e-15 and max(abs(d) for d in delta) < 1e-9:
            break
    return tuple(math.exp(x) for x in logs)  # type: ignore[return-value]


def containment_envelope(timed: Sequence[tuple[tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], float]]:
    """`timed` (shape, seconds) points of one kernel, each time lowered to the least time measured at
    any shape at least as large on every axis (itself included): a kernel never takes longer than
    one containing it, which does the same work padded (a larger GEMM, more heads, a longer causal
    sequence, wider heads, more bytes). A measured time above that envelope is the timer's (a
    host stall inside the timed call), and interpolating it would price every shape near it so."""
    if not timed:
        return []
    shapes = numpy.array([shape for shape, _ in timed], dtype=numpy.int64)
    seconds = numpy.array([s for _, s in timed], dtype=numpy.float64)
    return [(shape, float(seconds[(shapes >= shapes[i]).all(axis=1)].min())) for i, (shape, _) in enumerate(timed)]


def attention_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, causal: bool,
                    backward: bool) -> float:
    """FLOPs of one attention forward (or backward) pass."""
    flops = 4.0 * batch * heads * seq_q * seq_kv * head_dim
    if causal:
        flops *= max(1.0 - (seq_q - 1) / (2.0 * seq_kv), 0.0)
    return flops * (ATTENTION_BACKWARD_FLOP_RATIO if backward else 1.0)


@dataclass(frozen=True, slots=True)
class _MeasuredTables:
    """One profile's kernel tables as `ComputeCostModel` reads them (module docstring)."""

    gemm: dict[str, LogInterpolator]  # FLOP/s over (m, n, k), by dtype
    attention: dict[tuple[str, bool, bool], LogInterpolator]  # FLOP/s, by (dtype, causal, backward)
    copy: LogInterpolator | None  # seconds over bytes moved


_TABLES: dict[int, tuple[DeviceProfile, _MeasuredTables]] = {}
"""Each profile's tables by the profile object (held, so that its id is not reused): `evaluate`
builds a ComputeCostModel for every config it prices, on the same few profiles."""


def _measured_tables(device: DeviceProfile) -> _MeasuredTables:
    """`device`'s tables, each through its containment envelope, built once per profile object."""
    held = _TABLES.get(id(device))
    if held is not None and held[0] is device:
        return held[1]
    usable = usable_tables(device)  # a table too thin to price a model (`mplan profile --quick`'s) is left out
    gemm = {}
    for dtype in {t.dtype for t in usable.gemm}:
        timed = containment_envelope([((t.m, t.n, t.k), t.seconds) for t in usable.gemm if t.dtype == dtype])
        gemm[dtype] = LogInterpolator([((m, n, k), 2.0 * m * n * k / s) for (m, n, k), s in timed])
    attention = {}
    for dtype, causal in {(t.dtype, t.causal) for t in usable.attention}:
        rows = [t for t in usable.attention if t.dtype == dtype and t.causal == causal]
        for backward in (False, True):
            timed = containment_envelope([((t.batch * t.heads, t.seq_q, t.seq_kv, t.head_dim),
                                           t.backward_s if backward else t.forward_s) for t in rows
                                          if (t.backward_s if backward else t.forward_s) > 0])
            if timed:
                attention[(dtype, causal, backward)] = LogInterpolator(
                    [((bh, math.sqrt(sq * skv), d), attention_flops(bh, 1, sq, skv, d, causal, backward) / s)
                     for (bh, sq, skv, d), s in timed])
    copy = LogInterpolator(containment_envelope([((t.bytes_moved,), t.seconds) for t in usable.copy])) \
        if usable.copy else None
    tables = _MeasuredTables(gemm=gemm, attention=attention, copy=copy)
    _TABLES[id(device)] = (device, tables)
    return tables


class ComputeCostModel:
    """Kernel times on ``cluster.device``; measured where the cluster's profile has data."""

    __slots__ = ("cluster", "_cache", "_gemm", "_attention", "_copy")

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self._cache: dict[tuple[object, ...], float] = {}
        tables = _measured_tables(cluster.profile.device) if cluster.profile is not None else None
        self._gemm: dict[str, LogInterpolator] = tables.gemm if tables is not None else {}
        self._attention: dict[tuple[str, bool, bool], LogInterpolator] = tables.attention if tables is not None else {}
        self._copy: LogInterpolator | None = tables.copy if tables is not None else None

    @property
    def measured(self) -> bool:
        """Whether any kernel table backs this model (else everything is roofline)."""
        return bool(self._gemm or self._attention or self._copy)

    def _cached(self, key: tuple[object, ...], compute: Callable[[], float]) -> float:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    # -- GEMM -------------------------------------------------------------------------------------
    def matmul_time(self, m: int, n: int, k: int, dtype: object, batch: int = 1) -> float:
        """Seconds for ``batch`` independent ``[m, k] @ [k, n]`` products.

        A batched product is priced at the efficiency of one ``[batch*m, k] @ [k, n]`` GEMM: the
        batch fills the SMs as extra rows would.
        """
        name = canonical_dtype(dtype)
        return self._cached(("mm", m, n, k, name, batch), lambda: self._matmul(m, n, k, name, batch))

    def _matmul(self, m: int, n: int, k: int, dtype: str, batch: int) -> float:
        if min(m, n, k, batch) <= 0:
            raise ValueError(f"matmul dims must be positive, got m={m}, n={n}, k={k}, batch={batch}")
        flops = 2.0 * batch * m * n * k
        rows = batch * m
        memory = self.memory_bound_time(float(batch * (m * k + k * n + m * n) * dtype_bytes(dtype)))
        table = self._gemm.get(dtype)
        if table is not None:
            edge = table.clamped((rows, n, k))
            rate = table((rows, n, k)) * min(1.0, gemm_shape_efficiency(rows, n, k) / gemm_shape_efficiency(*edge))
            return max(flops / rate, memory)
        device = self.cluster.device
        # the shape curve describes a GPU's waves of output tiles; a CPU has none (cpu preset)
        shape = 1.0 if device.name == "cpu" else gemm_shape_efficiency(rows, n, k)
        rate = device.peak_flops(dtype) * device.gemm_efficiency * shape
        return max(flops / rate, memory)

    # -- attention --------------------------------------------------------------------------------
    def attention_time(self, batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, dtype: object,
                       causal: bool, backward: bool) -> float:
        """Seconds for one fused attention forward pass, or its backward pass alone (``backward=True``)."""
        name = canonical_dtype(dtype)
        key = ("attn", batch, heads, seq_q, seq_kv, head_dim, name, causal, backward)
        return self._cached(key, lambda: self._attention_time(batch, heads, seq_q, seq_kv, head_dim, name,
                                                              causal, backward))

    def _attention_time(self, batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, dtype: str,
                        causal: bool, backward: bool) -> float:
        if min(batch, heads, seq_q, seq_kv, head_dim) <= 0:
            raise ValueError("attention dims must be positive")
        flops = attention_flops(batch, heads, seq_q, seq_kv, head_dim, causal, backward)
        # q, k, v read and o written; the backward also reads o and dO and writes dq, dk, dv.
        tensors = 2 * seq_q + 2 * seq_kv if not backward else 4 * seq_q + 4 * seq_kv
        memory = self.memory_bound_time(float(batch * heads * head_dim * tensors * dtype_bytes(dtype)))
        table = self._attention.get((dtype, causal, backward))
        if table is not None:
            return max(flops / table((batch * heads, math.sqrt(seq_q * seq_kv), head_dim)), memory)
        device = self.cluster.device
        efficiency = ATTENTION_BACKWARD_EFFICIENCY if backward else ATTENTION_FORWARD_EFFICIENCY
        return max(flops / (device.peak_flops(dtype) * device.gemm_efficiency * efficiency), memory)

    # -- memory-bound kernels ---------------------------------------------------------------------
    def memory_bound_time(self, nbytes: float) -> float:
        """Seconds for a kernel that moves ``nbytes`` (read plus written) and does little arithmetic.

        From the profile's copy table when present: below its smallest size the smallest time (the
        launch floor), above its largest the time scales linearly with bytes.
        """
        return self._cached(("mem", nbytes), lambda: self._memory_bound(nbytes))

    def _memory_bound(self, nbytes: float) -> float:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return 0.0
        if self._copy is not None:
            (edge,) = self._copy.clamped((nbytes,))
            return self._copy((nbytes,)) * max(1.0, nbytes / edge)
        device = self.cluster.device
        return nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency)
