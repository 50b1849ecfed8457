"""Profiles: the JSON format, alpha-beta fits, device timing on CPU, link timing on 2 gloo ranks."""
from __future__ import annotations

import json
import os
import pathlib
import random

import pytest
from distributed import run_ranks

from mplan.cost_models.alpha_beta import AlphaBetaFit, fit_alpha_beta, max_relative_error
from mplan.cost_models.collective_cost import GroupShape
from mplan.cost_models.collectives import bus_factor
from mplan.cost_models.measure_device import profile_device
from mplan.cost_models.measure_links import (MAX_BURST, MIN_BURST, burst_calls, default_group_shapes, fit_levels, group_ranks,
                                             profile_links)
from mplan.cost_models.profile import (AttentionTiming, ClusterProfile, CollectiveTiming, CopyTiming, DeviceProfile,
                                       GemmTiming, LinkProfile, ProfileError)

MiB = 1 << 20


def _full_profile() -> ClusterProfile:
    device = DeviceProfile(
        name="NVIDIA H200", torch_version="2.11.0", measured_on="2026-11-29",
        gemm=(GemmTiming(m=4096, n=4096, k=4096, dtype="bf16", seconds=2.24e-4),),
        attention=(AttentionTiming(batch=1, heads=32, seq_q=4096, seq_kv=4096, head_dim=128, dtype="bf16",
                                   causal=True, forward_s=4e-4, forward_backward_s=1.4e-3),),
        copy=(CopyTiming(bytes_moved=1 << 30, seconds=2.5e-4),))
    fit = AlphaBetaFit(collective="all_reduce", level="intra_node", alpha_s=2e-5, beta_Bps=3.7e11, group_size=8,
                       num_points=10, max_rel_error=0.03)
    large = AlphaBetaFit(collective="all_reduce", level="intra_node", alpha_s=1e-5, beta_Bps=2.9e11, group_size=8,
                         num_points=4, max_rel_error=0.05, min_bus_bytes=8 * MiB)
    links = LinkProfile(backend="nccl", world_size=16, ranks_per_node=8, measured_on="2026-11-29",
                        timings=(CollectiveTiming(collective="all_reduce", level="intra_node", group_size=8,
                                                  ranks_per_node=8, nbytes=MiB, seconds=3e-5),), fits=(fit, large))
    return ClusterProfile(note="synthetic", device=device, links=links)


def test_profile_round_trips(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.json"
    _full_profile().to_json(str(path))
    assert ClusterProfile.from_json(str(path)) == _full_profile()
    assert ClusterProfile.from_json(str(path)).device.attention[0].backward_s == pytest.approx(1e-3)


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.update(version=2), "version must be 1"),
    (lambda o: o.update(format="mplan.cluster"), 'format must be "mplan.profile"'),
    (lambda o: o["device"]["gemm"][0].update(dtype="bf17"), "device.gemm[0].dtype must be one of"),
    (lambda o: o["device"]["copy"][0].pop("seconds"), "device.copy[0].seconds is missing"),
    (lambda o: o["links"]["timings"][0].update(level="rack"), "links.timings[0].level must be one of"),
    (lambda o: o["links"]["fits"][0].update(beta_Bps=0), "links.fits[0].beta_Bps must be a positive number, got 0"),
    (lambda o: o["device"]["attention"][0].update(causal="yes"), 'attention[0].causal must be true or false, got "yes"'),
    (lambda o: o["links"].update(extra=[]), "links.extra is not a known field"),
])
def test_a_bad_profile_names_its_field(tmp_path: pathlib.Path, mutate, message: str) -> None:
    obj = _full_profile().to_dict()
    mutate(obj)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ProfileError) as info:
        ClusterProfile.from_json(str(path))
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_alpha_beta_recovers_exact_points() -> None:
    sizes = [float(1 << p) for p in range(10, 29, 2)]
    alpha, beta = fit_alpha_beta(sizes, [20e-6 + s / 10e9 for s in sizes])
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(10e9, rel=1e-6)


def test_alpha_beta_reproduces_noisy_points_above_one_mib() -> None:
    rng = random.Random(7)
    sizes = [float(1 << p) for p in range(10, 29)]
    times = [(35e-6 + s / 180e9) * rng.uniform(0.93, 1.07) for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    for s, t in zip(sizes, times):
        if s >= MiB:
            assert (fit[0] + s / fit[1]) / t == pytest.approx(1.0, abs=0.10)
    assert max_relative_error(fit, sizes, times) < 0.10
    assert fit[1] == pytest.approx(180e9, rel=0.05)


def test_alpha_beta_never_returns_a_negative_latency() -> None:
    sizes = [1e3, 1e6, 1e8]
    alpha, beta = fit_alpha_beta(sizes, [s / 5e9 * f for s, f in zip(sizes, (0.5, 1.0, 1.0))])
    assert alpha == 0.0 and beta == pytest.approx(5e9, rel=0.05)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([1.0], [1.0])


def test_fits_are_per_collective_and_level_on_bus_bytes() -> None:
    timings = tuple(CollectiveTiming(collective="all_gather", level="intra_node", group_size=4, ranks_per_node=4,
                                     nbytes=s, seconds=1e-5 + bus_factor("all_gather", 4) * s / 100e9)
                    for s in (MiB, 16 * MiB, 256 * MiB))
    (fit,) = fit_levels(timings)
    assert (fit.collective, fit.level, fit.group_size, fit.num_points) == ("all_gather", "intra_node", 4, 3)
    assert fit.beta_Bps == pytest.approx(100e9, rel=1e-6) and fit.max_rel_error < 1e-9


def _two_regimes() -> tuple[CollectiveTiming, ...]:
    """A protocol switch at 8 MiB: latency-bound below, a slower bus bandwidth above."""
    return tuple(CollectiveTiming(collective="all_reduce", level="intra_node", group_size=2, ranks_per_node=2,
                                  nbytes=s, seconds=(30e-6 + s / 600e9) if s < 8 * MiB else (10e-6 + s / 250e9))
                 for s in (1 << p for p in range(10, 29)))


def test_a_protocol_switch_gets_a_segment_of_its_own() -> None:
    low, high = fit_levels(_two_regimes())
    assert (low.min_bus_bytes, high.min_bus_bytes) == (0.0, 8 * MiB)
    assert low.num_points + high.num_points == 19
    assert high.beta_Bps == pytest.approx(250e9, rel=1e-6) and max(low.max_rel_error, high.max_rel_error) < 1e-6
    links = LinkProfile(backend="nccl", world_size=2, ranks_per_node=2, measured_on="2026-11-29",
                        timings=_two_regimes(), fits=(low, high))
    assert links.fit("all_reduce", "intra_node", 1 * MiB) is low
    assert links.fit("all_reduce", "intra_node", 64 * MiB) is high
    assert links.fit("all_gather", "intra_node", MiB) is None


def test_one_regime_stays_one_line() -> None:
    rng = random.Random(3)
    timings = tuple(CollectiveTiming(collective="all_gather", level="intra_node", group_size=2, ranks_per_node=2,
                                     nbytes=s, seconds=(25e-6 + s / 240e9) * rng.uniform(0.98, 1.02))
                    for s in (1 << p for p in range(10, 29)))
    (fit,) = fit_levels(timings)
    assert fit.num_points == 19 and fit.max_rel_error < 0.05


def test_two_h200s_measured_links_are_reproduced_above_one_mib() -> None:
    """Refitted on the committed 2-H200 NCCL timings (2026-11-29, sizes in steps of 4x): every
    collective but send/recv within 10% above 1 MiB (one line per collective: 12-30%); send/recv
    (4-256 MiB grow at two rates, and steps of 4x leave one segment too few points) 23%."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/profile_h200x2-2026-11-29-session5.json"
    links = ClusterProfile.from_dict(json.loads(path.read_text())["profile"]).links
    worst: dict[str, float] = {}
    for fit in fit_levels(links.timings):
        worst[fit.collective] = max(worst.get(fit.collective, 0.0), fit.max_rel_error)
    assert all(error < 0.10 for kind, error in worst.items() if kind != "send_recv"), worst
    assert worst["send_recv"] < 0.25, worst


def test_group_ranks_tile_a_node_major_world() -> None:
    assert group_ranks(GroupShape(size=4, ranks_per_node=4), 8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(GroupShape(size=2, ranks_per_node=1), 8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(GroupShape(size=4, ranks_per_node=2), 8, 4) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert default_group_shapes(16, 8) == [GroupShape(size=8, ranks_per_node=8), GroupShape(size=2, ranks_per_node=1),
                                           GroupShape(size=16, ranks_per_node=8)]
    with pytest.raises(ValueError, match="does not tile"):
        group_ranks(GroupShape(size=3, ranks_per_node=3), 8, 4)


def test_small_messages_are_timed_in_bursts_that_every_rank_agrees_on() -> None:
    # A host synchronisation per call would add tens of microseconds to every small message on NCCL.
    assert burst_calls(1 << 10) == burst_calls(4 * MiB) == MAX_BURST
    assert burst_calls(16 * MiB) == 16
    assert burst_calls(64 * MiB) == burst_calls(256 * MiB) == MIN_BURST
    sizes = [1 << p for p in range(10, 29)]
    assert [burst_calls(n) for n in sizes] == sorted((burst_calls(n) for n in sizes), reverse=True)


def test_profile_device_quick_on_cpu() -> None:
    profile = profile_device("cpu", quick=True)
    assert profile.name == "cpu" and len(profile.gemm) == 8 and len(profile.attention) == 2 and len(profile.copy) == 2
    assert {(g.m, g.n, g.k) for g in profile.gemm} == {(m, n, k) for m in (32, 64) for n in (32, 64) for k in (32, 64)}
    assert all(g.seconds > 0 and g.dtype == "fp32" for g in profile.gemm)
    assert all(a.forward_backward_s > a.forward_s > 0 for a in profile.attention)
    assert (profile.timing, profile.eager_fallbacks) == ("wall_clock", ())  # no launch to hide on a CPU
    assert ClusterProfile.from_dict(ClusterProfile(device=profile).to_dict()).device == profile


def _links_on_two_ranks(sizes: list[int]) -> list[dict]:
    out = []
    for local in ("2", "1"):  # one node of two ranks, then two nodes of one rank
        os.environ["LOCAL_WORLD_SIZE"] = local
        out.append(ClusterProfile(links=profile_links(sizes=sizes, iters=3, warmup=1)).to_dict())
    return out


@pytest.mark.distributed
def test_profile_links_on_two_gloo_ranks() -> None:
    # 16 MiB against 1 KiB: the order of their times survives a loaded 2-core machine (1 MiB did not).
    sizes = [1 << 10, 1 << 14, 16 * MiB]
    per_rank = run_ranks(2, _links_on_two_ranks, sizes, timeout_s=120)
    assert per_rank[0] == per_rank[1]  # the slowest rank's median, agreed by all
    intra, inter = (ClusterProfile.from_dict(d).links for d in per_rank[0])
    for links, level, per_node in ((intra, "intra_node", 2), (inter, "inter_node", 1)):
        assert (links.backend, links.world_size, links.ranks_per_node) == ("gloo", 2, per_node)
        kinds = {t.collective for t in links.timings}
        assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
        assert len(links.timings) == 5 * len(sizes)
        assert {t.level for t in links.timings} == {level}
        assert {t.nbytes for t in links.timings} == set(sizes)
        assert {f.collective for f in links.fits} == kinds and {f.level for f in links.fits} == {level}
        reduce = sorted((t.nbytes, t.seconds) for t in links.timings if t.collective == "all_reduce")
        assert reduce[-1][1] > reduce[0][1]  # 16 MiB takes longer than 1 KiB
