"""The planner across sites (issue 36): every DP collective priced on the links it uses, flat
against hierarchical data parallelism, and the plan issue 36 asks for.

Flat DP on a cluster of two sites runs one ring through both: each ring enters and leaves a site,
so a site's long-haul link carries every ring's whole bus bytes. Hierarchical DP (`sites=2`)
reduce-scatters inside each site and sends only the 1/dp_local shards across, once: about half
the long-haul bytes of a flat all-reduce over two sites. All figures here are predictions from
datasheet figures and the link as given (100 Gb/s, 10 ms), not measurements.
"""
from __future__ import annotations

import argparse
import math

import pytest

import mplan
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import DEFAULT_BUCKET_BYTES, collective_time, long_haul_steps
from mplan.ir.mesh import GroupShape, MeshShape
from mplan.planner.dp_sync import cross_site_all_reduce, dp_collective
from mplan.planner.parallel_config import PlanSpec, ParallelConfig, parse_plan_spec, site_variants
from mplan.planner.plan import Plan, PlanError
from mplan.planner.spec_check import spec_refusal


def two_sites(gbps: float = 100, latency_ms: float = 10) -> ClusterSpec:
    """2 sites of 64 DGX H100 nodes (1024 GPUs)."""
    return ClusterSpec.preset("dgx-h100", nodes=128, sites=2, inter_site_gbps=gbps, inter_site_latency_ms=latency_ms)


GRADS = 2.0e9  # bytes of gradients a rank reduces


# -- pricing -----------------------------------------------------------------------------------
def test_hierarchical_sends_about_half_the_long_haul_bytes_of_a_flat_ring():
    cluster = two_sites()
    flat = dp_collective(cluster, "all_reduce", GRADS, MeshShape(dp=128, tp=8), "dp")
    hier = dp_collective(cluster, "all_reduce", GRADS, MeshShape(dp=128, tp=8, sites=2), "dp")
    # flat: 8 rings a site (512 ranks / 64 per ring), each 2 * 127/128 of the gradients across;
    # hierarchical: 512 cross-site pairs a site, each 1/64 of the gradients
    assert flat.links.inter_site_bytes == pytest.approx(8 * 2 * 127 / 128 * GRADS)
    assert hier.links.inter_site_bytes == pytest.approx(512 * GRADS / 64)
    assert flat.seconds > 1.3 * hier.seconds
    assert hier.seconds > hier.links.inter_site_s  # the link's transfer, plus a latency per bucket


def test_every_bucket_waits_its_rings_long_haul_latency_under_nccl():
    slow, fast = two_sites(latency_ms=10), two_sites(latency_ms=0)
    buckets = GRADS / DEFAULT_BUCKET_BYTES
    mesh = MeshShape(dp=16, tp=8, pp=8, sites=2)
    added = dp_collective(slow, "reduce_scatter", GRADS, mesh).seconds - \
        dp_collective(fast, "reduce_scatter", GRADS, mesh).seconds
    # NCCL runs one communicator's rings in order: each bucket's all-reduce between the two sites
    # waits its chain, two long-haul hops of 10 ms
    assert added == pytest.approx(buckets * 2 * 0.010, rel=0.05)
    flat = MeshShape(dp=128, tp=8)
    added = dp_collective(slow, "all_reduce", GRADS, flat).seconds - dp_collective(fast, "all_reduce", GRADS, flat).seconds
    # a 128-rank ring over two sites: its chain of dependent messages crosses 4 times a bucket
    assert added == pytest.approx(math.ceil(buckets) * 4 * 0.010)


def test_gloo_keeps_two_rings_waiting_at_once():
    slow, fast = _local_sites(4, 2), _local_sites(4, 2).with_sites(2, inter_site_gbps=1.0, inter_site_latency_ms=0.0)
    flat = MeshShape(dp=4)
    nbytes = 5 * DEFAULT_BUCKET_BYTES
    added = dp_collective(slow, "all_reduce", nbytes, flat).seconds - dp_collective(fast, "all_reduce", nbytes, flat).seconds
    assert added == pytest.approx(3 * 3 * 0.010)  # 5 buckets, 2 at a time: 3 waits of the 4-rank ring's 3 hops


@pytest.mark.parametrize("size, sites, kind, crossings", [
    (2, 2, "all_reduce", 2),  # one rank a site: both hops of the chain cross
    (4, 2, "all_reduce", 3),  # 0 1 | 2 3: the chain's 6 hops cross every other hop
    (128, 2, "all_reduce", 4),  # 2(n-1) hops: nearly two laps, each crossing twice
    (128, 2, "reduce_scatter", 2),  # n-1 hops: nearly one lap
    (12, 3, "all_reduce", 6),
])
def test_a_rings_chain_of_dependent_messages_sets_its_long_haul_hops(size, sites, kind, crossings):
    group = GroupShape(size=size, ranks_per_node=1, num_sites=sites)
    assert long_haul_steps(kind, group) == crossings
    assert long_haul_steps(kind, GroupShape(size=size, ranks_per_node=1)) == 0


def test_the_loss_average_over_dp_is_priced_across_the_sites():
    # the runtime all-reduces the step's loss over the whole dp group after the update: across the
    # sites in either layout, 3 one-way delays on a 4-rank ring over two sites of 2
    cluster = _local_sites(4, 2)
    slow = cluster.with_sites(2, inter_site_gbps=1.0, inter_site_latency_ms=50.0)
    graph = _tiny_graph()
    for spec in ("dp=4,sites=1", "dp=4,sites=2"):
        fast_s, slow_s = (resolve_for(spec, graph, c).predicted.step_time_s for c in (cluster, slow))
        # gradients: the 4-rank ring's chain (3) flat, the 2-rank one's (2) hierarchical; the loss: 3
        crossings = (3 if spec.endswith("1") else 2) + 3
        assert slow_s - fast_s == pytest.approx(crossings * 0.040, rel=0.02)


def test_zero_levels_shard_over_a_site_and_gather_inside_it():
    cluster, mesh = two_sites(), MeshShape(dp=16, tp=8, pp=8, sites=2)
    gather = dp_collective(cluster, "all_gather", GRADS, mesh)
    assert gather.links.inter_site_bytes == 0  # every site holds the same shards after phase 2
    scatter = dp_collective(cluster, "reduce_scatter", GRADS, mesh)
    shards = cross_site_all_reduce(cluster, GRADS / mesh.dp_local, mesh)
    assert scatter.links.inter_site_bytes == pytest.approx(shards.links.inter_site_bytes)
    assert cross_site_all_reduce(cluster, GRADS, MeshShape(dp=16, tp=8, pp=8)).seconds == 0


def test_one_site_prices_as_before_sites():
    cluster = ClusterSpec.preset("dgx-h100", nodes=8)
    mesh = MeshShape(dp=16, tp=4)
    group = mesh.group_shape("dp", 8)
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        assert dp_collective(cluster, kind, GRADS, mesh).seconds == collective_time(cluster, kind, GRADS, group)


def test_only_rings_cross_sites():
    with pytest.raises(ValueError, match="all_to_all across sites is not priced"):
        collective_time(two_sites(), "all_to_all", 1e6, MeshShape(dp=128, tp=8, sites=2).group_shape("dp", 8, 2))


# -- the search space and the grammar ------------------------------------------------------------
def test_the_search_tries_flat_and_hierarchical_where_the_mesh_allows():
    one_stage = ParallelConfig(dp=128, tp=8, pp=1)
    assert [c.sites for c in site_variants(one_stage, 2, PlanSpec())] == [2, 1]
    piped = ParallelConfig(dp=16, tp=8, pp=8)  # flat: its pipelines would cross sites
    assert [c.sites for c in site_variants(piped, 2, PlanSpec())] == [2]
    assert [c.sites for c in site_variants(one_stage, 2, parse_plan_spec("sites=1"))] == [1]
    assert site_variants(ParallelConfig(dp=3, tp=8, pp=1), 2, PlanSpec()) == []  # 2 does not divide dp=3
    assert [c.sites for c in site_variants(one_stage, 1, PlanSpec())] == [1]
    assert parse_plan_spec("tp=8,sites=2").sites == 2
    assert ParallelConfig(dp=16, tp=8, pp=8, sites=2).spec().endswith(",sites=2")


@pytest.mark.parametrize("spec, words", [
    ("sites=3", "sites=3 but the cluster has 2 site(s)"),
    ("dp=3,tp=8,pp=2,sites=2", "sites=2 does not divide dp=3"),
    ("pp=4,sites=1", "pp=4 with sites=1 on a cluster of 2 sites would run pipelines across sites"),
])
def test_a_spec_the_sites_refuse_is_one_line(spec, words):
    reason = spec_refusal(parse_plan_spec(spec), world_size=48, gpus_per_node=8, global_batch=3 * 512, num_sites=2)
    assert reason is not None and words in reason and "\n" not in reason


def test_cli_flags_make_the_sites():
    from mplan.cli import _cluster

    args = argparse.Namespace(cluster="dgx-h100", nodes=128, gpus_per_node=None, sites=2, inter_site_gbps=100.0,
                              inter_site_latency_ms=10.0)
    assert _cluster(args) == two_sites()


# -- the plan issue 36 asks for -----------------------------------------------------------------
@pytest.fixture(scope="module")
def llama70b() -> Plan:
    return mplan.plan("llama3-70b", cluster=two_sites(), global_batch=512)


@pytest.mark.slow
def test_llama3_70b_on_two_sites_runs_dp_hierarchically(llama70b):
    plan = llama70b
    assert plan.mesh.sites == 2 and plan.cluster.sites == 2
    mesh, cluster = plan.mesh_shape(), two_sites()
    mesh.check_sites(2)
    for axis in ("tp", "cp", "pp"):  # never across sites
        assert all(len({cluster.site_of(r) for r in group}) == 1 for group in mesh.groups(axis))
    # what crosses the long haul: the gradients once, in shards (about 2 bytes a parameter, bf16)
    crossing = plan.predicted.dp_links.inter_site_gb
    assert 0.9 < crossing / (2 * plan.model.num_parameters / 1e9) < 1.2


@pytest.mark.slow
def test_the_flat_alternative_lost_on_the_long_haul(llama70b):
    flat = [a for a in llama70b.alternatives if ",sites=" not in a.spec and a.predicted is not None]
    assert flat, "the best flat plan is among the alternatives"
    assert flat[0].predicted.step_time_s > llama70b.predicted.step_time_s
    assert flat[0].predicted.dp_links.inter_site_gb > 1.5 * llama70b.predicted.dp_links.inter_site_gb
    assert "over the long haul" in flat[0].why


@pytest.mark.slow
def test_the_plan_json_records_sites_and_old_files_load(llama70b):
    doc = llama70b.to_dict()
    assert doc["mesh"]["sites"] == 2 and doc["cluster"]["sites"] == 2
    assert Plan.from_dict(doc) == llama70b
    for key in ("sites", "inter_site_gbps", "inter_site_latency_ms"):
        del doc["cluster"][key]
    with pytest.raises(PlanError, match="mesh.sites=2 but cluster.sites=1"):
        Plan.from_dict(doc)
    del doc["mesh"]["sites"]
    doc["predicted"].pop("dp_links")
    assert Plan.from_dict(doc).mesh.sites == 1  # a plan written before sites: flat


# -- autoparallel's bridge: a spec or a plan with sites, against the job's cluster ---------------
def _tiny_graph():
    from mplan.ir.trace import capture_for_training
    from test_equivalence import batches, family

    return capture_for_training(family("tiny-gpt")(), (batches(4, steps=1)[0][0],))


def _local_sites(world: int, sites: int) -> ClusterSpec:
    """`world` CPU ranks as `sites` nodes, one a site (as tests/test_hierarchical_dp.py runs them)."""
    import dataclasses

    from mplan.cost_models.presets import local_cluster

    base = local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    inter = dataclasses.replace(base.links.intra_node, kind="roce")
    cluster = dataclasses.replace(base, num_nodes=sites, gpus_per_node=world // sites,
                                  links=dataclasses.replace(base.links, inter_node=inter))
    return cluster if sites == 1 else cluster.with_sites(sites, inter_site_gbps=1.0, inter_site_latency_ms=10.0)


def resolve_for(spec: str, graph, cluster: ClusterSpec) -> Plan:
    from mplan.planner.resolve import resolve_plan

    return resolve_plan(spec, graph, cluster=cluster, world_size=4, global_batch=4)


def test_resolve_carries_a_specs_sites_and_refuses_what_the_cluster_cannot_hold():
    from mplan.planner.parallel_config import PlanSpecError
    from mplan.planner.resolve import resolve_plan

    graph = _tiny_graph()
    made = resolve_plan("dp=4,sites=2,zero=1", graph, cluster=_local_sites(4, 2), world_size=4, global_batch=4)
    assert made.mesh.sites == 2 and made.cluster.sites == 2 and made.predicted.dp_links.inter_site_gb > 0
    with pytest.raises(PlanSpecError, match="sites=2 but the cluster has 1 site"):
        resolve_plan("dp=4,sites=2", graph, cluster=_local_sites(4, 1), world_size=4, global_batch=4)
    with pytest.raises(PlanSpecError, match="sites=2 must divide dp=1"):
        resolve_plan("tp=2,pp=2,sites=2", graph, cluster=_local_sites(4, 2), world_size=4, global_batch=4)
    with pytest.raises(PlanSpecError, match="pp=2 groups would cross"):
        resolve_plan("dp=2,pp=2", graph, cluster=_local_sites(4, 2), world_size=4, global_batch=4)
