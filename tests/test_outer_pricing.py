"""The outer loop's pricing (`planner/outer_pricing.py`) on the 70B cluster of issue 36: 2 sites of
64 DGX H100 nodes, 100 Gb/s and 10 ms between them. Predictions, not measurements.

The outer step carries a float32 pseudo-gradient across sites as hierarchical DP carries the
gradients, once every H steps: per step, the long haul's bytes and seconds are hierarchical DP's
over H (times 4 / the gradients' bytes an element: with float32 gradients, exactly 1/H)."""
from __future__ import annotations

import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.ir.mesh import MeshShape
from mplan.planner.dp_sync import dp_collective
from mplan.planner.outer_pricing import OuterLoopRefused, outer_loop_sync

PARAMS = 70e9 / 64  # a rank's parameters under tp=8, pp=8
MESH = MeshShape(dp=16, tp=8, pp=8, sites=2)


def two_sites() -> ClusterSpec:
    return ClusterSpec.preset("dgx-h100", nodes=128, sites=2, inter_site_gbps=100, inter_site_latency_ms=10)


@pytest.mark.parametrize("every", [1, 8, 32])
def test_long_haul_per_step_is_hierarchical_dps_over_h(every):
    cluster = two_sites()
    hierarchical = dp_collective(cluster, "all_reduce", PARAMS * 4, MESH)  # float32 gradients
    outer = outer_loop_sync(cluster, PARAMS * 4, PARAMS, MESH, every)
    assert outer.links.inter_site_bytes == pytest.approx(hierarchical.links.inter_site_bytes / every)
    assert outer.links.inter_site_s == pytest.approx(hierarchical.links.inter_site_s / every)
    if every > 1:  # the whole sync too: the inner all-reduce stays inside a site
        assert outer.seconds < hierarchical.seconds * 2 / every


def test_bf16_gradients_against_a_float32_pseudo_gradient():
    cluster = two_sites()
    hierarchical = dp_collective(cluster, "all_reduce", PARAMS * 2, MESH)
    outer = outer_loop_sync(cluster, PARAMS * 2, PARAMS, MESH, 8)
    assert outer.links.inter_site_bytes == pytest.approx(hierarchical.links.inter_site_bytes * 2 / 8)


def test_one_site_is_refused_in_one_line():
    with pytest.raises(OuterLoopRefused, match="needs sites > 1"):
        outer_loop_sync(two_sites(), PARAMS * 4, PARAMS, MeshShape(dp=16, tp=8, pp=8), 8)
