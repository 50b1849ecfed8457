"""Sites (issue 36): the mesh's arithmetic with sites, the cluster's sites and the plan key.

A mesh with `sites = S` puts the site outermost (`ir/mesh.py`): whole pipelines live inside one
site, so TP, CP, EP and PP groups never cross sites; data parallelism does, hierarchically, through
the site-local groups and the cross-site groups.
"""
from __future__ import annotations

import itertools

import pytest

from mplan.ir.mesh import GroupShape, MeshShape

MESHES = [MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sites=sites)
          for dp, tp, pp, cp, ep, sites in [(4, 2, 2, 1, 1, 2), (8, 1, 1, 1, 2, 2), (6, 2, 1, 2, 1, 3),
                                            (4, 1, 3, 1, 1, 4), (8, 2, 2, 1, 2, 2), (2, 2, 2, 2, 1, 2)]]


def site_of(mesh: MeshShape, rank: int) -> int:
    """The cluster's placement: rank r on site r // (world / sites)."""
    return rank // (mesh.size // mesh.sites)


def covers_world_once(groups: list[list[int]], size: int) -> bool:
    return sorted(itertools.chain.from_iterable(groups)) == list(range(size))


# -- the mesh --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_rank_once_per_group_family(mesh):
    for groups in [mesh.groups(axis) for axis in ("tp", "cp", "dp", "pp", "ep", "expert_dp")] + \
                  [mesh.site_dp_groups(), mesh.cross_site_dp_groups()]:
        assert covers_world_once(groups, mesh.size)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coordinates_round_trip_and_sites_are_contiguous(mesh):
    for rank in range(mesh.size):
        c = mesh.coord(rank)
        assert mesh.rank(tp=c.tp, dp=c.dp, pp=c.pp, cp=c.cp) == rank
        assert c.site == site_of(mesh, rank)  # the mesh's site is the cluster's
        assert c.dp // mesh.dp_local == c.site  # the site is dp's outermost factor


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_tp_cp_ep_pp_never_cross_sites(mesh):
    for axis in ("tp", "cp", "ep", "pp"):
        for group in mesh.groups(axis):
            assert len({site_of(mesh, r) for r in group}) == 1, (axis, group)
        assert not mesh.group_shape(axis, 2, mesh.sites).crosses_sites


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_site_groups_stay_in_a_site_and_cross_site_groups_take_one_rank_a_site(mesh):
    for group in mesh.site_dp_groups():
        assert len(group) == mesh.dp_local and len({site_of(mesh, r) for r in group}) == 1
    for group in mesh.cross_site_dp_groups():
        assert [site_of(mesh, r) for r in group] == list(range(mesh.sites))
        assert len({mesh.coord(r).dp % mesh.dp_local for r in group}) == 1
    # a whole dp group is one site-local group from each site
    site_groups = {tuple(g) for g in mesh.site_dp_groups()}
    for group in mesh.groups("dp"):
        parts = [tuple(r for r in group if site_of(mesh, r) == s) for s in range(mesh.sites)]
        assert all(part in site_groups for part in parts)


def test_group_shapes_say_what_crosses_sites():
    mesh = MeshShape(dp=32, tp=8, pp=4, sites=2)  # 1024 ranks on 8-GPU nodes
    assert mesh.group_shape("dp", 8, 2) == GroupShape(size=32, ranks_per_node=1, num_sites=2)
    assert mesh.site_group_shape("dp", 8) == GroupShape(size=16, ranks_per_node=1)
    assert mesh.cross_site_group_shape() == GroupShape(size=2, ranks_per_node=1, num_sites=2)
    assert mesh.group_shape("tp", 8, 2) == GroupShape(size=8, ranks_per_node=8)
    # flat (sites=1) on a two-site cluster: its dp ring spans both sites, priced there
    flat = MeshShape(dp=128, tp=8)
    assert flat.group_shape("dp", 8, 2).num_sites == 2 and not flat.group_shape("tp", 8, 2).crosses_sites


def test_sites_equal_one_changes_nothing():
    for dp, tp, pp, cp in [(4, 2, 2, 1), (2, 1, 2, 2)]:
        plain = MeshShape(dp=dp, tp=tp, pp=pp, cp=cp)
        assert [plain.rank(tp=c.tp, dp=c.dp, pp=c.pp, cp=c.cp) for c in map(plain.coord, range(plain.size))] == \
            list(range(plain.size))
        assert plain.rank(pp=1) == tp * cp * dp  # pp outermost, as before sites
        assert plain.site_dp_groups() == plain.groups("dp")
        assert plain.cross_site_dp_groups() == [[r] for r in range(plain.size)]


@pytest.mark.parametrize("degrees, words", [
    (dict(dp=3, sites=2), "sites must divide dp"),
    (dict(dp=4, ep=4, sites=2), "ep must divide dp / sites"),
    (dict(dp=2, sites=0), "sites must be a positive int"),
])
def test_bad_meshes_are_refused_in_one_line(degrees, words):
    with pytest.raises(ValueError, match=words) as caught:
        MeshShape(**degrees)
    assert "\n" not in str(caught.value)


def test_check_sites_against_the_cluster():
    MeshShape(dp=4, sites=2).check_sites(2)
    MeshShape(dp=8, tp=2).check_sites(2)  # flat dp across two sites: allowed, priced on the long haul
    with pytest.raises(ValueError, match="sites=2 but the cluster has 1 site"):
        MeshShape(dp=4, sites=2).check_sites(1)
    with pytest.raises(ValueError, match="pp=2 groups would cross"):
        MeshShape(dp=4, pp=2).check_sites(2)  # flat layout: pp outermost would cross
    with pytest.raises(ValueError, match="tp=4 groups would cross"):
        MeshShape(dp=1, tp=4).check_sites(2)


# -- the cluster -----------------------------------------------------------------------------------
from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError  # noqa: E402


def two_sites() -> ClusterSpec:
    return ClusterSpec.preset("dgx-h100", nodes=128, sites=2, inter_site_gbps=100, inter_site_latency_ms=10)


def test_a_preset_with_sites_places_ranks_in_order():
    cluster = two_sites()
    assert (cluster.num_sites, cluster.ranks_per_site) == (2, 512)
    assert [cluster.site_of(r) for r in (0, 511, 512, 1023)] == [0, 0, 1, 1]
    assert cluster.sites.bandwidth_Bps == 12.5e9 and cluster.sites.latency_s == pytest.approx(0.010)
    assert ClusterSpec.preset("dgx-h100", nodes=4).num_sites == 1  # one site unless said


def test_cluster_file_round_trips_sites_and_old_files_have_one():
    cluster = two_sites()
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    plain = ClusterSpec.preset("dgx-h100", nodes=4).to_dict()
    assert "sites" not in plain and ClusterSpec.from_dict(plain).num_sites == 1


@pytest.mark.parametrize("sites, field", [
    ({"count": 3, "inter_site_gbps": 100, "inter_site_latency_ms": 10}, "sites.count must divide num_nodes"),
    ({"count": 0, "inter_site_gbps": 100, "inter_site_latency_ms": 10}, "sites.count must be an integer"),
    ({"count": 2, "inter_site_gbps": "fast", "inter_site_latency_ms": 10}, "sites.inter_site_gbps must be"),
    ({"count": 2, "inter_site_gbps": 0, "inter_site_latency_ms": 10}, "sites.inter_site_gbps must be"),
    ({"count": 2, "inter_site_gbps": 100, "inter_site_latency_ms": -1}, "sites.inter_site_latency_ms must be"),
    ({"count": 2, "inter_site_gbps": 100}, "sites.inter_site_latency_ms is missing"),
    ({"count": 2, "inter_site_gbps": 100, "inter_site_latency_ms": 10, "gbps": 1}, "sites.gbps is not a known"),
])
def test_a_wrong_sites_field_is_one_error_naming_it(sites, field):
    doc = two_sites().to_dict()
    doc["sites"] = sites
    with pytest.raises(ClusterSpecError, match=field) as caught:
        ClusterSpec.from_dict(doc, file="two.json")
    assert str(caught.value).startswith("two.json: ") and "\n" not in str(caught.value)


def test_presets_refuse_sites_that_do_not_split_the_nodes():
    with pytest.raises(ClusterSpecError, match="must divide the 3 nodes"):
        ClusterSpec.preset("dgx-h100", nodes=3, sites=2, inter_site_gbps=100)
    with pytest.raises(ClusterSpecError, match="inter_site_gbps must be a positive number with 2 sites"):
        ClusterSpec.preset("dgx-h100", nodes=4, sites=2)
