"""Collective cost: ring alpha-beta per link level, NCCL's flat ring (and two-node tree) across nodes,
measured fits override."""
from __future__ import annotations

import pytest

from mplan.cost_models.alpha_beta import AlphaBetaFit
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import NCCL_BASE_LATENCY_S, GroupShape, collective_time
from mplan.cost_models.collectives import COLLECTIVES, bus_factor, ring_steps
from mplan.cost_models.profile import ClusterProfile, LinkProfile

GiB = 1 << 30


def a100(nodes: int = 1) -> ClusterSpec:
    return ClusterSpec.preset("dgx-a100", nodes=nodes, measured=False)


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == bus_factor("all_to_all", 8) == 7 / 8
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0 and ring_steps("all_reduce", 8) == 14
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)


def test_one_node_all_reduce_reaches_the_measured_busbw() -> None:
    seconds = collective_time(a100(), "all_reduce", GiB, GroupShape(size=8, ranks_per_node=8))
    busbw = bus_factor("all_reduce", 8) * GiB / seconds
    assert busbw == pytest.approx(232.5e9, rel=0.005)  # 8x A100 nccl-tests, nccl-tests#175


def test_ring_formula_exactly() -> None:
    cluster = a100()
    link = cluster.links.intra_node
    n, size = 4, 64 << 20
    expected = NCCL_BASE_LATENCY_S + 3 * link.latency_s + (3 / 4) * size / link.effective_bandwidth_Bps
    assert collective_time(cluster, "all_gather", size, GroupShape(size=n, ranks_per_node=n)) == pytest.approx(expected)
    # all-reduce = reduce-scatter + all-gather in transfer and steps, one launch latency
    rs = collective_time(cluster, "reduce_scatter", size, GroupShape(size=n, ranks_per_node=n))
    ar = collective_time(cluster, "all_reduce", size, GroupShape(size=n, ranks_per_node=n))
    assert ar == pytest.approx(2 * rs - NCCL_BASE_LATENCY_S)


def test_small_messages_pay_latency_per_ring_step() -> None:
    seconds = collective_time(a100(), "all_reduce", 8, GroupShape(size=8, ranks_per_node=8))
    assert seconds == pytest.approx(NCCL_BASE_LATENCY_S + 14 * 1.9e-6, rel=1e-3)


def test_one_rank_per_node_rides_the_nic() -> None:
    cluster = a100(nodes=4)
    seconds = collective_time(cluster, "all_reduce", GiB, GroupShape(size=4, ranks_per_node=1))
    assert bus_factor("all_reduce", 4) * GiB / seconds == pytest.approx(24e9, rel=0.005)


def test_many_dgx_a100_nodes_reach_nvidias_measured_192_gbps() -> None:
    # nccl#812: "8x200Gbit/s IB cards and we measure 192GB/s" all-reduce busbw across DGX A100 nodes.
    n = 64 * 8
    seconds = collective_time(a100(nodes=64), "all_reduce", 4 * GiB, GroupShape(size=n, ranks_per_node=8))
    assert bus_factor("all_reduce", n) * 4 * GiB / seconds == pytest.approx(192e9, rel=0.05)


def test_across_nodes_one_ring_through_every_rank_is_paced_by_the_nics() -> None:
    """32 ranks on 4 DGX A100 nodes: NCCL's flat ring, its hops adding up, its two levels'
    transfers pipelined; its nccl-tests busbw is NVIDIA's measured 192 GB/s at 4 nodes as at 64
    (nccl#812), where the two-level scheme this model used to price gave 248."""
    cluster = a100(nodes=4)
    size, n, g, k = GiB, 32, 8, 4
    intra = cluster.links.intra_node.effective_bandwidth_Bps
    inter = cluster.links.inter_node.effective_bandwidth_Bps
    ar = collective_time(cluster, "all_reduce", size, GroupShape(size=n, ranks_per_node=g))
    hops = (2 * (n - 1) - 2 * (k - 1)) * 1.9e-6 + 2 * (k - 1) * 4e-6
    bus = 2 * (n - 1) / n * size
    assert ar == pytest.approx(NCCL_BASE_LATENCY_S + hops + max(bus / intra, bus / (g * inter)))
    assert bus / ar == pytest.approx(192e9, rel=0.02)
    rs = collective_time(cluster, "reduce_scatter", size, GroupShape(size=n, ranks_per_node=g))
    hops = ((n - 1) - (k - 1)) * 1.9e-6 + (k - 1) * 4e-6
    assert rs == pytest.approx(NCCL_BASE_LATENCY_S + hops + (n - 1) / n * size / (g * inter))
    # a DP group of 4 ranks a node (tp=2 inside it) has 4 NICs of each node to itself
    half = collective_time(cluster, "all_reduce", size, GroupShape(size=16, ranks_per_node=4))
    assert 2 * 15 / 16 * size / half == pytest.approx(96e9, rel=0.02)
    a2a = collective_time(cluster, "all_to_all", size, GroupShape(size=32, ranks_per_node=8))
    assert a2a == pytest.approx(NCCL_BASE_LATENCY_S + 4e-6 + size * 24 / 32 / inter)


def test_on_two_nodes_the_all_reduce_takes_nccls_tree_where_it_is_cheaper() -> None:
    """nccl#812: on two nodes the tree sends S per node over the network where the ring sends
    2(n-1)/n S; the chain through each node reduces and broadcasts S over NVLink."""
    cluster = a100(nodes=2)
    intra = cluster.links.intra_node.effective_bandwidth_Bps
    inter = cluster.links.inter_node.effective_bandwidth_Bps
    ar = collective_time(cluster, "all_reduce", GiB, GroupShape(size=16, ranks_per_node=8))
    assert ar == pytest.approx(NCCL_BASE_LATENCY_S + 2 * (7 * 1.9e-6 + 4e-6) + max(2 * GiB / intra, GiB / (8 * inter)))
    ring = NCCL_BASE_LATENCY_S + 28 * 1.9e-6 + 2 * 4e-6 + 2 * 15 / 16 * GiB / (8 * inter)
    assert ar < ring
    # all-gather and reduce-scatter have no tree: rings
    ag = collective_time(cluster, "all_gather", GiB, GroupShape(size=16, ranks_per_node=8))
    assert ag == pytest.approx(NCCL_BASE_LATENCY_S + 14 * 1.9e-6 + 4e-6 + 15 / 16 * GiB / (8 * inter))


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_time_grows_with_size_and_vanishes_for_trivial_groups(kind: str) -> None:
    cluster = a100(nodes=2)
    shapes = [GroupShape(size=2, ranks_per_node=2), GroupShape(size=2, ranks_per_node=1),
              GroupShape(size=16, ranks_per_node=8)]
    for shape in shapes:
        times = [collective_time(cluster, kind, s, shape) for s in (1 << 10, 1 << 20, 1 << 30)]
        assert times[0] < times[1] < times[2]
    assert collective_time(cluster, kind, GiB, GroupShape(size=1, ranks_per_node=1)) == 0.0
    assert collective_time(cluster, kind, 0, GroupShape(size=8, ranks_per_node=8)) == 0.0


def test_crossing_nodes_is_slower_than_staying_inside() -> None:
    cluster = a100(nodes=2)
    inside = collective_time(cluster, "send_recv", 64 << 20, GroupShape(size=2, ranks_per_node=2))
    across = collective_time(cluster, "send_recv", 64 << 20, GroupShape(size=2, ranks_per_node=1))
    assert across / inside == pytest.approx(232.5 / 24, rel=0.05)


def test_measured_fits_override_the_analytic_model() -> None:
    fit = AlphaBetaFit(collective="all_reduce", level="intra_node", alpha_s=50e-6, beta_Bps=100e9, group_size=8,
                       num_points=6, max_rel_error=0.01)
    links = LinkProfile(backend="nccl", world_size=8, ranks_per_node=8, measured_on="2026-11-29", fits=(fit,))
    cluster = a100().with_profile(ClusterProfile(links=links))
    seconds = collective_time(cluster, "all_reduce", GiB, GroupShape(size=8, ranks_per_node=8))
    assert seconds == pytest.approx(50e-6 + 2 * 7 / 8 * GiB / 100e9)
    # no fit for all_gather: analytic, unchanged
    assert collective_time(cluster, "all_gather", GiB, GroupShape(size=8, ranks_per_node=8)) == \
        collective_time(a100(), "all_gather", GiB, GroupShape(size=8, ranks_per_node=8))


def test_group_shapes_from_mesh_axes() -> None:
    assert GroupShape.from_mesh_axis(size=8, stride=1, gpus_per_node=8) == GroupShape(size=8, ranks_per_node=8)
    assert GroupShape.from_mesh_axis(size=4, stride=8, gpus_per_node=8) == GroupShape(size=4, ranks_per_node=1)
    assert GroupShape.from_mesh_axis(size=8, stride=2, gpus_per_node=8) == GroupShape(size=8, ranks_per_node=4)
    assert GroupShape.from_mesh_axis(size=2, stride=2, gpus_per_node=8) == GroupShape(size=2, ranks_per_node=2)
    assert GroupShape(size=16, ranks_per_node=8).level == "hierarchical"
    with pytest.raises(ValueError, match="ranks_per_node dividing it"):
        GroupShape(size=6, ranks_per_node=4)


def test_a_group_larger_than_the_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit cluster dgx-a100: 1 nodes x 8 GPUs"):
        collective_time(a100(), "all_reduce", GiB, GroupShape(size=16, ranks_per_node=8))
