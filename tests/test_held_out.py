"""Every fitted constant, judged on measurements it was not fitted on.

A constant of the cost model that was fitted to measurements names the result file it was fitted
on and the function that fits it (its rule). Each constant below is checked twice: its rule, run
on the rows it names, gives it (so the constant and these checks come from one rule); then the
rule is run on part of the rows only and the price it gives is judged on the rest. No check
judges a constant on the rows it was fitted to.

The bounds are the held-out errors these files give (measured 2026-12-02), set just above them:
they say how far each constant carries, not how far one would like it to. docs/claims.md
("Fitted constants") lists every fitted constant, its file and its check, and the ones that have
none and why. `MPLAN_ADAMW_COPY_FRACTION` and `TORCH_ADAMW_COPY_FRACTION` are judged held out in
tests/test_fused_pricing.py (one model's rows predict the other's); here only their rule.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mplan.cost_models import compute_cost
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import H200_GEMM_POINTS, ComputeCostModel, fit_gemm_curve
from mplan.planner import evaluate
from mplan.planner.evaluate import (GRAD_NORM_COPY_FRACTION, MPLAN_ADAMW_COPY_FRACTION, SPLIT_W_HOST_S,
                                    TORCH_ADAMW_COPY_FRACTION, adamw_time, fit_copy_fraction, fit_split_w_host_s,
                                    optimizer_time)
from mplan.fusion import entry
from mplan.planner.fused_pricing import (FP8_CAST_COPY_FRACTION, fit_fp8_cast_fraction,
                                         fit_kernel_copy_fraction)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MODELS = ("gpt-1.3b", "llama-1.1b")


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


# ---- the optimizer step: AdamW's and the gradient norm's shares of copy bandwidth ---------------

def _num_params() -> dict[str, int]:
    return {row["model"]: row["num_params"] for row in _load("optimizer_h200-2026-11-29.json")["rows"]}


def _lp_norm_s(result: str, model: str, system: str) -> float:
    """GPU seconds a step's `_foreach_norm` (the LpNorm multi-tensor kernel) took, from a step
    profile: clipping's global norm, one read of every gradient."""
    kernels = _load(result)["models"][model][system]["top_kernels_ms"]
    (ms,) = [ms for name, ms in kernels.items() if "multi_tensor_apply" in name and "LpNormFunctor" in name]
    return ms * 1e-3


def _grad_norm_pair(model: str, itemsize: int, seconds: float) -> tuple[float, float]:
    """(seconds the gradients' bytes take at the optimizer benchmark's copy rate, seconds measured):
    what `fit_copy_fraction` fits on (GRAD_NORM_COPY_FRACTION names that copy rate, 4.235 TB/s)."""
    copy_Bps = _load("optimizer_h200-2026-11-29.json")["copy_TBps"] * 1e12
    return _num_params()[model] * itemsize / copy_Bps, seconds


def _grad_norm_price(compute: ComputeCostModel, model: str, itemsize: int) -> float:
    """The planner's price of the gradient norm: the clipped step less its AdamW."""
    params = _num_params()[model]
    return (optimizer_time(compute, params, itemsize, mplan_adamw=True)
            - adamw_time(compute, params, itemsize, mplan_adamw=True))


def test_the_optimizer_copy_fractions_are_their_rule_on_the_rows_they_name() -> None:
    """AdamW's (both, both dtypes): `fit_copy_fraction` over GPT-1.3B's and Llama-1.1B's
    `grad_scale` rows of optimizer_h200-2026-11-29.json. The gradient norm's: bf16 over both
    models' LpNorm kernel in mplan's steps (step_profile_h200-2026-11-29-session3.json), fp32
    over GPT-1.3B's in the autocast run (step_profile_autocast_h200-2026-11-29-session4.json)."""
    report = _load("optimizer_h200-2026-11-29.json")
    rows = {(r["model"], r["dtype"]): r["timing"]["grad_scale"] for r in report["rows"]}
    for name, constants in (("mplan_device_steps", MPLAN_ADAMW_COPY_FRACTION),
                            ("torch_fused", TORCH_ADAMW_COPY_FRACTION)):
        for dtype, itemsize in (("bf16", 2), ("fp32", 4)):
            fit = fit_copy_fraction([(rows[m, dtype]["fewest_bytes_ms"], rows[m, dtype][name]["ms"]) for m in MODELS])
            assert fit == constants[itemsize], (name, dtype)
    bf16 = [_grad_norm_pair(m, 2, _lp_norm_s("step_profile_h200-2026-11-29-session3.json", m, "mplan")) for m in MODELS]
    assert fit_copy_fraction(bf16) == GRAD_NORM_COPY_FRACTION[2]
    fp32 = _lp_norm_s("step_profile_autocast_h200-2026-11-29-session4.json", "gpt-1.3b", "mplan")
    assert fit_copy_fraction([_grad_norm_pair("gpt-1.3b", 4, fp32)]) == GRAD_NORM_COPY_FRACTION[4]


@pytest.mark.parametrize("held_out", MODELS)
def test_the_gradient_norm_fitted_on_one_model_prices_the_others(held_out: str, monkeypatch) -> None:
    """bf16: GRAD_NORM_COPY_FRACTION refitted on one model's LpNorm kernel in mplan's H200 step
    (0.541 on GPT-1.3B's 1.238 ms, 0.553 on Llama-1.1B's 0.959 ms), then the other model's kernel
    priced with it as the planner prices it (`optimizer_time` less `adamw_time`, on the h200
    profile's copy table): Llama +2.6%, GPT -2.0%. Bound 3%. The models differ in size
    (1.42e9 vs 1.12e9 parameters) and in their tensors (389 vs 201)."""
    (fitted_on,) = set(MODELS) - {held_out}
    result = "step_profile_h200-2026-11-29-session3.json"
    refit = fit_copy_fraction([_grad_norm_pair(fitted_on, 2, _lp_norm_s(result, fitted_on, "mplan"))])
    monkeypatch.setitem(evaluate.GRAD_NORM_COPY_FRACTION, 2, refit)
    compute = ComputeCostModel(ClusterSpec.preset("h200"))
    measured = _lp_norm_s(result, held_out, "mplan")
    assert _grad_norm_price(compute, held_out, 2) == pytest.approx(measured, rel=0.03), (held_out, refit)


@pytest.mark.parametrize("system", ["eager", "compile"])
def test_the_fp32_gradient_norm_fitted_on_mplans_step_prices_eagers_and_compiles(system: str) -> None:
    """fp32: GRAD_NORM_COPY_FRACTION[4] rests on one row, GPT-1.3B's LpNorm kernel in mplan's
    autocast step (1.611 ms). The only fp32 rows it was not fitted on are the same kernel over the
    same gradients in eager's (1.640 ms) and torch.compile's (1.598 ms) steps of that run: priced
    -2.0% and +0.5%. Bound 2.5%. A repeat of the measurement, not a transfer to another model:
    no fp32 run of a second model was profiled."""
    compute = ComputeCostModel(ClusterSpec.preset("h200"))
    measured = _lp_norm_s("step_profile_autocast_h200-2026-11-29-session4.json", "gpt-1.3b", system)
    assert _grad_norm_price(compute, "gpt-1.3b", 4) == pytest.approx(measured, rel=0.025)


# ---- the GEMM efficiency curve ---------------------------------------------------------------------

def _gemm_points() -> list[tuple[int, int, int, float]]:
    """The 17 bf16 GEMMs of GEMM_POINTS_FILES as (m, n, k, FLOP/s); a batched product as one of
    batch x m rows, as `matmul_time` prices it."""
    rows = _load("gemm_small_k_h200-2026-11-29.json")["rows"]
    return list(H200_GEMM_POINTS) + [(r["batch"] * r["m"], r["n"], r["k"], r["tflops"] * 1e12) for r in rows]


def _achievable() -> float:
    device = ClusterSpec.preset("h200", measured=False).device
    return device.peak_bf16 * device.gemm_efficiency  # 788 TFLOP/s, the curve's fixed asymptote


def _gemm_errors(points: list[tuple[int, int, int, float]]) -> list[float]:
    """Relative errors of the roofline's (no profile) price of each GEMM's rate, at the module's
    curve constants as they stand."""
    model = ComputeCostModel(ClusterSpec.preset("h200", measured=False))
    return [2 * m * n * k / model.matmul_time(m, n, k, "bf16") / rate - 1 for m, n, k, rate in points]


def test_the_presets_achievable_gemm_rate_is_the_ceiling_runs_median_large_training_gemm() -> None:
    """The presets' 788 TFLOP/s (gemm_efficiency 0.796) came from a run that is not committed; the
    committed ceiling run (every GEMM of GPT-1.3B's and Llama-1.1B's training steps, timed alone)
    gives 786 by `achievable_gemm_rate` over its 24 GEMMs with both weight sides >= 2048: the
    constant is within 0.5% of it. Not fitted on that file, so this is its only check."""
    from mplan.cost_models import presets

    linears = [row for model in _load("gemm_ceiling_h200-2026-11-29.json")["models"].values()
               for row in model["linears"]]
    assert sum(min(row["in"], row["out"]) >= 2048 for row in linears) * 3 == 24
    assert presets._H200_ACHIEVABLE_BF16 == pytest.approx(compute_cost.achievable_gemm_rate(linears), rel=0.005)


def test_the_gemm_curve_is_its_rule_on_the_17_gemms() -> None:
    """`fit_gemm_curve` on the 17 GEMMs gives C_MN = 3.19e6, C_T = 72.4, C_K = 134.6; the module's
    3.24e6, 70, 135 are within 2%, 4% and 1% of them and fit as well (RMS of the log error 6.61%
    against 6.62%; relative RMS 6.8%, largest 18% at k = 64). A flat minimum, not a wrong constant."""
    points = _gemm_points()
    assert len(points) == 17
    c_mn, c_tile, c_k = fit_gemm_curve(points, _achievable())
    assert compute_cost.GEMM_CURVE_C_MN == pytest.approx(c_mn, rel=0.02)
    assert compute_cost.GEMM_CURVE_C_TILE == pytest.approx(c_tile, rel=0.04)
    assert compute_cost.GEMM_CURVE_C_K == pytest.approx(c_k, rel=0.01)

    def log_rms(curve: tuple[float, float, float]) -> float:
        return _rms([math.log(_achievable() * compute_cost.gemm_shape_efficiency(m, n, k, curve) / rate)
                     for m, n, k, rate in points])

    module = (compute_cost.GEMM_CURVE_C_MN, compute_cost.GEMM_CURVE_C_TILE, compute_cost.GEMM_CURVE_C_K)
    assert log_rms(module) == pytest.approx(log_rms((c_mn, c_tile, c_k)), abs=5e-4)


def test_the_gemm_curve_refitted_on_16_gemms_predicts_the_17th(monkeypatch) -> None:
    """Leave one out: for each of the 17 GEMMs, the curve refitted (`fit_gemm_curve`) on the other
    16 and that GEMM priced by the roofline with the refitted constants. Held-out relative errors:
    RMS 8.8% (of the log 8.4%; 6.8% and 6.6% on the fitted points), largest 24.5% at k = 64 (the
    shallowest GEMM; 18% when fitted on), next 12.7% (k = 128) and 12.2% (n = 96). Bounds 9% and
    25%: the curve carries to a GEMM it was not fitted on about as well as its fit says, except at
    the edge of the measured range."""
    points = _gemm_points()
    held_out = []
    for i, point in enumerate(points):
        c_mn, c_tile, c_k = fit_gemm_curve(points[:i] + points[i + 1:], _achievable())
        monkeypatch.setattr(compute_cost, "GEMM_CURVE_C_MN", c_mn)
        monkeypatch.setattr(compute_cost, "GEMM_CURVE_C_TILE", c_tile)
        monkeypatch.setattr(compute_cost, "GEMM_CURVE_C_K", c_k)
        held_out += _gemm_errors([point])
    assert _rms(held_out) < 0.09
    assert max(abs(e) for e in held_out) < 0.25


# ---- the fused kernels' and the FP8 cast's shares of copy bandwidth --------------------------------

KERNELS = {"rms_norm_residual": "rmsnorm+residual", "layer_norm_residual": "layernorm+residual",
           "bias_gelu": "bias+gelu", "swiglu": "swiglu", "rope": "rope", "cross_entropy": "cross_entropy"}
"""Fusion entries measured -> their kernels in the results of `python -m benchmarks.kernel_peers fused`."""


def _fraction(op: str) -> tuple[float, float]:
    return entry(op).pricing.copy_fraction


def _kernel_seconds(timing: dict) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward bytes, seconds), (backward bytes, seconds)) of the Triton kernel of one timing:
    the fewest bytes the benchmark counts and its GPU kernel time, backward as fwd+bwd less fwd."""
    triton = timing["triton"]
    forward, both = triton["fwd_ms"] * 1e-3, triton["fwd_bwd_ms"] * 1e-3
    return (timing["bytes_fwd"], forward), (timing["bytes_fwd_bwd"] - timing["bytes_fwd"], both - forward)


def test_the_fused_kernels_fractions_are_their_rule_on_the_headline_shapes() -> None:
    """`fit_kernel_copy_fraction` on each kernel's headline shape (`timing`) of
    kernels_h200-2026-11-29-session7.json gives each entry's measured copy fraction; RMSNorm alone takes RMSNorm
    + residual's (the same kernel without the residual read)."""
    kernels = _load("kernels_h200-2026-11-29-session7.json")["kernels"]
    for op, name in KERNELS.items():
        assert fit_kernel_copy_fraction(kernels[name]["timing"]) == _fraction(op), op
    assert _fraction("rms_norm") == _fraction("rms_norm_residual")


def test_the_fused_kernels_fractions_fitted_on_one_shape_price_the_others() -> None:
    """Fitted on each kernel's headline shape (16384 rows at hidden 4096 for the norms, ffn 14336
    for SwiGLU, 16384 features for bias + GELU, Llama's 4 x 32 x 4096 heads for RoPE, 4096 x 128256
    logits for cross-entropy), judged on the same run's other training shapes (`timing_more`:
    hidden 2048 and 8192, ffn 5632, 8192 features, RoPE on the projected [8, 2048, 16, 128] layout,
    vocabularies 32000 and 128256 at 16384 rows), 18 kernel times, each priced as its bytes at the
    run's copy rate (4.244 TB/s) over the fraction: RMS error 3.0%, from -6.9% (the RMSNorm backward
    at hidden 2048, 0.878 of copy bandwidth against 0.943) to +4.3% (cross-entropy forward at
    128256, which beats the copy and is capped at 1.0). Bounds 3.5% RMS, 7% largest.

    On the planner's own clock (`memory_bound_time`, the h200 profile's copy table) the same
    kernels are priced -0.1% to +25% off their time, and the headline shapes themselves +1.5% to +16%:
    the table's copies of 0.1-0.5 GB ran at 3.4-4.0 TB/s (CUDA events around one copy) where the
    fractions were taken against 4.244 TB/s. That is the price's copy rate, not these constants;
    the next test bounds it."""
    run = _load("kernels_h200-2026-11-29-session7.json")
    copy_Bps = run["copy_TBps"] * 1e12
    errors = []
    for op, name in KERNELS.items():
        forward, backward = _fraction(op)
        for timing in run["kernels"][name]["timing_more"]:
            for (nbytes, seconds), fraction in zip(_kernel_seconds(timing), (forward, backward)):
                errors.append(nbytes / (copy_Bps * fraction) / seconds - 1)
    assert len(errors) == 18
    assert _rms(errors) < 0.035
    assert max(abs(e) for e in errors) < 0.07


def test_the_planners_price_of_memory_bound_kernels_runs_high_below_a_few_gigabytes() -> None:
    """The fractions above and the FP8 cast's are shares of the benchmarks' copy rate (4.24-4.26
    TB/s); the planner multiplies them by the h200 profile's copy table, timed with CUDA events
    around one copy, which reaches 4.0 TB/s only at 0.5 GB (3.4 TB/s at 134 MB, 4.26 at 8.6 GB).
    So every fused kernel and cast of the two runs, fitted shapes and held-out ones alike, is priced
    high: fused kernels -0.1% (cross-entropy's backward, 8.4 GB) to +25.3% (RoPE's projected forward,
    0.14 GB), the headline shapes they were fitted on +1.5% to +16%; FP8 casts +9.0% to +20.7%
    (0.13-0.54 GB, at the fitted 0.84). Bounds: never low by more than 0.5%, never high by more than
    26% (kernels) and 21% (casts). Where this bites is small memory-bound kernels, not the optimizer
    (10-20 GB a step, where the table is within 1% of the benchmarks' rate)."""
    compute = ComputeCostModel(ClusterSpec.preset("h200"))
    kernels = _load("kernels_h200-2026-11-29-session7.json")["kernels"]
    errors = []
    for op, name in KERNELS.items():
        for timing in [kernels[name]["timing"], *kernels[name]["timing_more"]]:
            for (nbytes, seconds), fraction in zip(_kernel_seconds(timing), _fraction(op)):
                errors.append(compute.memory_bound_time(nbytes / fraction) / seconds - 1)
    assert len(errors) == 30
    assert -0.005 < min(errors) and max(errors) < 0.26
    casts = [c for c in _load("fp8_h200-2026-11-29.json")["cast"] if c["shape"][0] == 16384]
    cast_errors = [compute.memory_bound_time(4.0 * math.prod(c["shape"]) / FP8_CAST_COPY_FRACTION)
                   / (c["ms"] * 1e-3) - 1 for c in casts]
    assert -0.005 < min(cast_errors) and max(cast_errors) < 0.21


def test_the_fp8_casts_fraction_refitted_on_two_shapes_prices_the_third() -> None:
    """`fit_fp8_cast_fraction` on fp8_h200-2026-11-29.json's three 16384-row casts (hidden 2048,
    8192, 6144: 0.818, 0.863, 0.860 of its 4.263 TB/s; the 1000 x 3000 cast, at the launch floor,
    is no training shape) gives FP8_CAST_COPY_FRACTION, 0.84. Leave one out: refitted on two, the
    third's time priced as 4 bytes an element (bf16 read, FP8 written in both layouts) at the run's
    copy rate: -4.9% (2048, refit 0.86), +2.8% (8192), +2.3% (6144). Bound 5%."""
    run = _load("fp8_h200-2026-11-29.json")
    casts = [c for c in run["cast"] if c["shape"][0] == 16384]
    assert len(casts) == 3
    assert fit_fp8_cast_fraction([c["copy_fraction"] for c in casts]) == FP8_CAST_COPY_FRACTION
    for i, cast in enumerate(casts):
        refit = fit_fp8_cast_fraction([c["copy_fraction"] for j, c in enumerate(casts) if j != i])
        predicted = 4.0 * math.prod(cast["shape"]) / (run["copy_TBps"] * 1e12 * refit)
        assert predicted == pytest.approx(cast["ms"] * 1e-3, rel=0.05), (cast["shape"], refit)


# ---- the host's work a split weight-gradient pass waits on -----------------------------------------

@pytest.fixture(scope="module")
def split_backward() -> dict[str, dict]:
    """split_backward_h200-2026-12-02.json's shapes, each with the parameter-reading ops of its
    blocks as the planner counts them (`num_weight_ops` of the block units of its model spec,
    captured narrow: the count is the blocks' ops, which no width changes)."""
    from mplan.planner.planning import capture_for_planning
    from mplan.planner.search import Planner

    narrow = {"hidden=2048": "hidden=64", "heads=16": "heads=4", "kv_heads=8": "kv_heads=2", "ffn=5632": "ffn=176",
              "seq=2048": "seq=64", "vocab=32000": "vocab=256"}
    shapes = _load("split_backward_h200-2026-12-02.json")["shapes"]
    ops = {}
    for spec in {shape["model"] for shape in shapes.values()}:
        small = ",".join(narrow.get(part, part) for part in spec.split(","))
        planner = Planner(capture_for_planning(small), ClusterSpec.preset("h200"))
        ops[spec] = sum(u.num_weight_ops for u in planner.units(tp=1, sp=False, mbs=1) if u.block_type is not None)
    return {name: {**shape, "ops": ops[shape["model"]]} for name, shape in shapes.items()}


def _w_wall_s(shape: dict) -> float:
    return shape["phases"]["W"]["wall_ms"] * 1e-3


def _w_price(shape: dict, host_s: float) -> float:
    """W's wall time as the planner prices a zero-bubble stage's W (evaluate.py): at least the
    host's work, `host_s` a parameter-reading op; its kernels taken as measured, so that only the
    host constant is judged."""
    return max(shape["phases"]["W"]["kernel_ms"] * 1e-3, host_s * shape["ops"])


def test_the_split_w_host_time_is_its_rule_on_the_one_sequence_rows(split_backward: dict) -> None:
    """`fit_split_w_host_s` on the two 1 x 2048 rows (the GPU waits on the host there): Llama's W
    10.36 ms for 36 ops, GPT's 10.36 ms for 32, together 0.305 ms an op, SPLIT_W_HOST_S 0.30 ms."""
    assert (split_backward["llama mbs=1"]["ops"], split_backward["gpt mbs=1"]["ops"]) == (36, 32)
    rows = [(_w_wall_s(split_backward[name]), split_backward[name]["ops"]) for name in ("llama mbs=1", "gpt mbs=1")]
    assert fit_split_w_host_s(rows) == SPLIT_W_HOST_S


@pytest.mark.parametrize("fitted_on, held_out", [("llama mbs=1", "gpt mbs=1"), ("gpt mbs=1", "llama mbs=1")])
def test_the_split_w_host_time_fitted_on_one_model_prices_the_others(split_backward: dict, fitted_on: str,
                                                                     held_out: str) -> None:
    """Refitted on one model's 1 x 2048 row (Llama 0.29 ms an op, GPT 0.32), the other's W priced:
    GPT -10.4%, Llama +11.2%. Bound 12%: the host's work an op is not one number across models."""
    fitted, judged = split_backward[fitted_on], split_backward[held_out]
    host_s = fit_split_w_host_s([(_w_wall_s(fitted), fitted["ops"])])
    assert _w_price(judged, host_s) == pytest.approx(_w_wall_s(judged), rel=0.12), (held_out, host_s)


@pytest.mark.parametrize("held_out", ["llama mbs=4", "gpt mbs=4"])
def test_the_split_w_host_time_fitted_on_one_sequence_prices_four(split_backward: dict, held_out: str) -> None:
    """Fitted on both 1 x 2048 rows (SPLIT_W_HOST_S), judged on the 4 x 2048 rows, where W's
    kernels (4.7 and 5.9 ms) are still shorter than the host bound: Llama priced 10.8 ms against
    9.6 measured (+12.1%), GPT 9.6 against 11.2 (-14.5%). Bound 15%."""
    fitted = [(_w_wall_s(split_backward[name]), split_backward[name]["ops"]) for name in ("llama mbs=1", "gpt mbs=1")]
    judged = split_backward[held_out]
    assert _w_price(judged, fit_split_w_host_s(fitted)) == pytest.approx(_w_wall_s(judged), rel=0.15)


# ---- the links' alpha-beta fits (fitted per profile, not module constants) ---------------------------

@pytest.mark.parametrize("result, rms, largest", [
    ("profile_h200x2-2026-11-29-session5.json", 0.175, 0.37),
    ("profile_cpu4-2026-12-02.json", 0.26, 0.64)])
def test_link_fits_on_every_other_size_price_the_sizes_between(result: str, rms: float, largest: float) -> None:
    """`mplan profile` fits each collective's times (`measure_links.fit_levels`: one or two
    alpha-beta segments over bus bytes) on all the sizes it timed; the README's 4-8% (2 H200s) are
    errors on those very sizes. Held out: refitted on every other size, judged on the sizes between
    (from 1 MiB of bus bytes up, what the fit is judged on), priced by the segment
    `LinkProfile.fit` picks.
    2 H200s, NVLink (sizes 4x apart: 5 left a collective, too few for two segments, so one line):
    12 sizes, RMS 16.9%, -17.1% (send/recv at 1 MiB) to +36.2% (send/recv at 16 MiB), against 6.0%
    and 17% in-fit on the same sizes. Bounds 17.5% and 37%.
    4 gloo CPU ranks (sizes 2x apart, a 2-core machine shared with other work): 20 sizes, RMS 25.2%,
    -30.6% to +63.2% (all-gather at 8 MiB), against 12% and 24% in-fit. Bounds 26% and 64%.
    A link priced between its measured sizes is good to about 20-25%, not to the fit's 4-8%."""
    from mplan.cost_models.alpha_beta import LARGE_MESSAGE_BYTES
    from mplan.cost_models.collectives import bus_factor
    from mplan.cost_models.measure_links import fit_levels
    from mplan.cost_models.profile import CollectiveTiming, LinkProfile

    links = _load(result)["profile"]["links"]
    timings = [CollectiveTiming(**row) for row in links["timings"]]
    errors = []
    for key in dict.fromkeys((t.collective, t.level, t.group_size) for t in timings):
        sizes = sorted((t for t in timings if (t.collective, t.level, t.group_size) == key), key=lambda t: t.nbytes)
        refit = LinkProfile(backend=links["backend"], world_size=links["world_size"],
                            ranks_per_node=links["ranks_per_node"], measured_on=links["measured_on"],
                            fits=fit_levels(sizes[0::2]))
        for t in sizes[1::2]:
            bus = bus_factor(t.collective, t.group_size) * t.nbytes
            if bus >= LARGE_MESSAGE_BYTES:
                errors.append(refit.fit(t.collective, t.level, bus).time(bus) / t.seconds - 1)
    assert len(errors) == {"profile_h200x2-2026-11-29-session5.json": 12, "profile_cpu4-2026-12-02.json": 20}[result]
    assert _rms(errors) < rms
    assert max(abs(e) for e in errors) < largest
