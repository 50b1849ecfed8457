"""Compute cost: the fitted GEMM curve, roofline bounds, and interpolation of measured tables."""
from __future__ import annotations

import math

import pytest

from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError
from mplan.cost_models.compute_cost import (ATTENTION_BACKWARD_EFFICIENCY, ATTENTION_FORWARD_EFFICIENCY,
                                            H200_GEMM_POINTS, ComputeCostModel, attention_flops,
                                            gemm_shape_efficiency)
from mplan.cost_models.profile import AttentionTiming, ClusterProfile, CopyTiming, DeviceProfile, GemmTiming


def roofline(name: str = "h200") -> ComputeCostModel:
    return ComputeCostModel(ClusterSpec.preset(name, measured=False))


def _measured_gemms() -> list[tuple[int, int, int, float]]:
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "gemm_small_k_h200-2026-11-29.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    return list(H200_GEMM_POINTS) + [(r["batch"] * r["m"], r["n"], r["k"], r["tflops"] * 1e12) for r in rows]


def test_curve_reproduces_the_measured_h200_gemms() -> None:
    errors = [2 * m * n * k / roofline().matmul_time(m, n, k, "bf16") / measured - 1
              for m, n, k, measured in _measured_gemms()]
    assert len(errors) == 17
    assert max(abs(e) for e in errors) < 0.19
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.08


def test_datasheet_and_measured_h200_presets_agree_on_gemms() -> None:
    assert roofline("dgx-h200").matmul_time(8192, 8192, 8192, "bf16") == \
        pytest.approx(roofline("h200").matmul_time(8192, 8192, 8192, "bf16"))


def test_efficiency_falls_for_small_dims_and_saturates_for_large() -> None:
    sizes = [64, 256, 1024, 4096, 16384, 65536]
    effs = [gemm_shape_efficiency(s, s, s) for s in sizes]
    assert all(a < b for a, b in zip(effs, effs[1:]))
    assert effs[0] < 0.01 and effs[-1] > 0.99
    assert gemm_shape_efficiency(16384, 6144, 512) < gemm_shape_efficiency(16384, 6144, 2048)  # short K loop


def test_skinny_gemm_is_memory_bound() -> None:
    model = roofline("dgx-h100")
    n = k = 8192
    seconds = model.matmul_time(1, n, k, "bf16")
    device = model.cluster.device
    bytes_moved = (k + k * n + n) * 2
    assert seconds == pytest.approx(bytes_moved / (device.memory_bandwidth_Bps * device.memory_efficiency))


def test_a_cpu_gemm_has_no_gpu_tile_waves() -> None:
    """The shape curve is one H200 wave of output tiles; on the `cpu` preset a small GEMM is its
    plain roofline, not the 0.2 s that curve gave [128, 64] @ [64, 64]."""
    cluster = ClusterSpec.preset("cpu")
    flops = 2 * 128 * 64 * 64
    assert ComputeCostModel(cluster).matmul_time(128, 64, 64, "fp32") == pytest.approx(
        max(flops / cluster.device.peak_flops("fp32"), 4 * (128 * 64 + 64 * 64 + 128 * 64) / 1e10))


def test_batched_matmul_is_priced_like_stacked_rows() -> None:
    model = roofline()
    assert model.matmul_time(512, 1024, 1024, "bf16", batch=8) == pytest.approx(
        model.matmul_time(4096, 1024, 1024, "bf16"))


def test_dtype_peaks_scale_the_roofline() -> None:
    model = roofline("dgx-h100")
    big = (8192, 8192, 8192)
    assert model.matmul_time(*big, "fp32") / model.matmul_time(*big, "bf16") == pytest.approx(989.4 / 66.9)
    assert model.matmul_time(*big, "torch.float16") == model.matmul_time(*big, "bf16")
    with pytest.raises(ClusterSpecError, match="no fp8 peak"):
        roofline("dgx-a100").matmul_time(*big, "fp8")


def test_attention_flops_and_roofline() -> None:
    full = attention_flops(2, 16, 4096, 4096, 128, causal=False, backward=False)
    assert full == 4 * 2 * 16 * 4096 * 4096 * 128
    causal = attention_flops(2, 16, 4096, 4096, 128, causal=True, backward=False)
    assert causal / full == pytest.approx(0.5, abs=1e-3)
    assert attention_flops(2, 16, 4096, 4096, 128, causal=True, backward=True) == pytest.approx(2.5 * causal)
    model = roofline()
    rate = 788e12
    assert model.attention_time(2, 16, 4096, 4096, 128, "bf16", True, False) == pytest.approx(
        causal / (rate * ATTENTION_FORWARD_EFFICIENCY))
    assert model.attention_time(2, 16, 4096, 4096, 128, "bf16", True, True) == pytest.approx(
        2.5 * causal / (rate * ATTENTION_BACKWARD_EFFICIENCY))


def _power_law(m: float, n: float, k: float) -> float:
    return 1e12 * m ** 0.1 * n ** 0.2 * k ** 0.15  # log-linear: multilinear interpolation in log space is exact


def _profiled(**tables: object) -> ComputeCostModel:
    device = DeviceProfile(name="synthetic", torch_version="2.13", measured_on="2026-11-29", **tables)
    return ComputeCostModel(ClusterSpec.preset("dgx-h100", measured=False).with_profile(ClusterProfile(device=device)))


def test_gemm_table_interpolates_in_log_space() -> None:
    dims = (1024, 4096, 16384)
    gemm = tuple(GemmTiming(m=m, n=n, k=k, dtype="bf16", seconds=2 * m * n * k / _power_law(m, n, k))
                 for m in dims for n in dims for k in dims)
    model = _profiled(gemm=gemm)
    assert model.measured
    for m, n, k in [(1024, 4096, 16384), (3000, 5000, 7000), (2048, 12000, 1500)]:
        achieved = 2 * m * n * k / model.matmul_time(m, n, k, "bf16")
        assert achieved == pytest.approx(_power_law(m, n, k), rel=1e-9)
    # beyond the largest dims the rate holds; below the smallest it falls with the efficiency curve
    assert 2 * 32768 ** 3 / model.matmul_time(32768, 32768, 32768, "bf16") == pytest.approx(
        _power_law(16384, 16384, 16384), rel=1e-9)
    small = 2 * 256 * 1024 * 1024 / model.matmul_time(256, 1024, 1024, "bf16")
    ratio = gemm_shape_efficiency(256, 1024, 1024) / gemm_shape_efficiency(1024, 1024, 1024)
    assert small == pytest.approx(_power_law(1024, 1024, 1024) * ratio, rel=1e-9)
    # dtypes the table lacks fall back to the roofline
    assert model.matmul_time(4096, 4096, 4096, "fp32") == roofline("dgx-h100").matmul_time(4096, 4096, 4096, "fp32")


def test_attention_table_reproduces_its_points() -> None:
    rows = tuple(AttentionTiming(batch=1, heads=h, seq_q=s, seq_kv=s, head_dim=128, dtype="bf16", causal=True,
                                 forward_s=1e-9 * h * s * s / 1000, forward_backward_s=3.5e-9 * h * s * s / 1000)
                 for h in (8, 32) for s in (1024, 4096))
    model = _profiled(attention=rows)
    for row in rows:
        assert model.attention_time(1, row.heads, row.seq_q, row.seq_kv, 128, "bf16", True, False) == \
            pytest.approx(row.forward_s, rel=1e-9)
        assert model.attention_time(1, row.heads, row.seq_q, row.seq_kv, 128, "bf16", True, True) == \
            pytest.approx(row.backward_s, rel=1e-9)


def test_copy_table_has_a_launch_floor_and_scales_linearly_above() -> None:
    copies = (CopyTiming(bytes_moved=1 << 16, seconds=4e-6), CopyTiming(bytes_moved=1 << 30, seconds=300e-6))
    model = _profiled(copy=copies)
    assert model.memory_bound_time(1 << 10) == pytest.approx(4e-6)
    assert model.memory_bound_time(1 << 31) == pytest.approx(600e-6)
    middle = model.memory_bound_time(1 << 23)
    expected = math.exp((math.log(4e-6) + math.log(300e-6)) / 2)  # halfway in log bytes
    assert middle == pytest.approx(expected, rel=1e-9)
    assert model.memory_bound_time(0) == 0.0


def test_results_are_cached() -> None:
    model = roofline()
    first = model.matmul_time(4096, 4096, 4096, "bf16")
    assert ("mm", 4096, 4096, 4096, "bf16", 1) in model._cache
    assert model.matmul_time(4096, 4096, 4096, "bfloat16") == first
