"""Any world size, not only powers of two: 1 to 8 ranks (3, 5, 6 and 7 included) plan and train.

Issue 30 B: `pp=3` on 3 CPU ranks was refused (`group of 2 ranks (1 per node on 2 nodes) does not
fit cluster local: 1 nodes x 3 GPUs`): the cost model placed a mesh axis's groups by an even
split of the node (gcd(group size, ranks that fit a node)), which put two pipeline neighbours
on one 3-GPU node across two nodes. Three tiers:
1. the layout arithmetic (`ir.mesh`), against the rank lists the runtime builds, on every mesh and
   node shape of worlds 1-12: each axis's `GroupShape` has the per-node count its groups really
   have (or, where they fall unevenly, a count that divides every node's share), a send/recv pair
   crosses nodes exactly when some pair of neighbouring stages does, and every collective of
   every axis is priced on the cluster without a refusal;
2. every spec (dp, tp, pp, zero 0/1) that divides a world of 1-8 resolves on `ClusterSpec.local()`
   and on dgx-h100 presets of every node shape that world fills, or is refused with the one
   reason it cannot run (a tp that does not divide the heads, more stages than units); the search
   (plan=None) fills every world; transformers' Llama resolves on uneven worlds too;
3. a sample trains exactly against one process in float64 on gloo (one group per world size):
   pp=3, dp=3 (ZeRO-1) and tp=3 on 3 ranks, dp=2 x pp=3 on 6, dp=5 with ZeRO-1 (optimizer state
   split five ways) on 5, dp=7 on 7.
The models have 6 heads and a vocabulary of 96, so tp=2, 3 and 6 divide them; the one planned has
3 layers (5 pipeline units), the one trained 1 (3 units, enough for pp=3, and each rank's capture
is what costs the time here).
"""
from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distributed import run_checks
from test_equivalence import assert_equivalent, batches, compare, family

MODEL = "gpt:layers=3,hidden=48,heads=6,seq=16,vocab=96"
TRAINED_MODEL = "gpt:layers=1,hidden=48,heads=6,seq=16,vocab=96"
HEADS, UNITS = 6, 5  # the model's attention heads; its pipeline units (prologue, 3 layers, epilogue)
AXES = ("tp", "dp", "pp", "ep", "expert_dp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def node_shapes(world: int) -> list[tuple[int, int]]:
    """Every (nodes, gpus_per_node) a world of `world` ranks fills exactly."""
    return [(world // g, g) for g in divisors(world)]


def meshes(world: int):
    from mplan.ir.mesh import MeshShape

    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for ep in divisors(dp):
                yield MeshShape(dp=dp, tp=tp, pp=pp, ep=ep)


# -- 1. the layout arithmetic ------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 12), data=st.data())
def test_every_axis_is_priced_as_its_groups_fall_on_the_nodes(world: int, data: Any) -> None:
    from mplan.cost_models.collective_cost import check_group_fits, collective_time
    from mplan.cost_models.presets import make_preset

    mesh = data.draw(st.sampled_from(list(meshes(world))), label="mesh")
    nodes, gpn = data.draw(st.sampled_from(node_shapes(world)), label="nodes x gpus")
    cluster = make_preset("dgx-h100", nodes=nodes, gpus_per_node=gpn, measured=False)
    for axis in AXES:
        shape = mesh.group_shape(axis, gpn)
        counts = {n for group in mesh.groups(axis) for n in Counter(r // gpn for r in group).values()}
        if len(counts) == 1:  # every group holds as many ranks on each node it touches: exact
            assert shape.ranks_per_node == counts.pop(), (mesh, axis, gpn, shape)
        else:  # uneven: no node holds fewer of a group's ranks than priced
            assert all(c % shape.ranks_per_node == 0 for c in counts), (mesh, axis, gpn, shape, counts)
        assert (shape.num_nodes > 1) == any(len({r // gpn for r in g}) > 1 for g in mesh.groups(axis))
        check_group_fits(cluster, shape)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            assert collective_time(cluster, kind, 2**20, shape) >= 0
    pairs = [(a, b) for group in mesh.groups("pp") for a, b in zip(group, group[1:])]
    p2p = mesh.p2p_shape(gpn)
    assert (p2p.num_nodes == 2) == any(a // gpn != b // gpn for a, b in pairs), (mesh, gpn, p2p)
    assert collective_time(cluster, "send_recv", 2**20, p2p) >= 0


def test_two_pipeline_neighbours_on_one_node_are_never_priced_across_two() -> None:
    """The issue's case: pp=3 on one 3-GPU node (an even split put the pair on two nodes)."""
    from mplan.ir.mesh import GroupShape, MeshShape

    assert MeshShape(pp=3).p2p_shape(3) == GroupShape(size=2, ranks_per_node=2)
    assert MeshShape(dp=2, pp=3).p2p_shape(6) == GroupShape(size=2, ranks_per_node=2)
    assert MeshShape(dp=2, pp=3).p2p_shape(3) == GroupShape(size=2, ranks_per_node=1)  # ranks 2 -> 4 cross
    # tp=3 on 2-GPU nodes: ranks 0,1 | 2 and 3 | 4,5: uneven, priced one rank per node
    assert MeshShape(dp=2, tp=3).group_shape("tp", 2) == GroupShape(size=3, ranks_per_node=1)


# -- 2. every spec of every world resolves, or is refused for its one reason ------------------------
@functools.lru_cache(maxsize=None)
def graph():
    from mplan.ir.trace import capture_for_training

    return capture_for_training(family(MODEL)(), (batches(2, steps=1, vocab=96)[0][0],))


def specs(world: int) -> list[tuple[int, int, int, int]]:
    return [(world // (tp * pp), tp, pp, zero) for tp in divisors(world) for pp in divisors(world // tp)
            for zero in (0, 1)]


def clusters(world: int):
    from mplan.cost_models.presets import local_cluster, make_preset

    yield local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    for nodes, gpn in node_shapes(world):
        yield make_preset("dgx-h100", nodes=nodes, gpus_per_node=gpn, measured=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 8), data=st.data())
def test_every_spec_of_every_world_size_resolves_or_says_why_not(world: int, data: Any) -> None:
    from mplan.planner.parallel_config import PlanSpecError
    from mplan.planner.resolve import resolve_plan

    dp, tp, pp, zero = data.draw(st.sampled_from(specs(world)), label="spec")
    cluster = data.draw(st.sampled_from(list(clusters(world))), label="cluster")
    spec = f"dp={dp},tp={tp},pp={pp},zero={zero}"
    batch = 2 * dp * pp  # every stage gets micro-batches
    if HEADS % tp:
        with pytest.raises(PlanSpecError, match=rf"tp={tp} does not divide the {HEADS} attention heads"):
            resolve_plan(spec, graph(), cluster=cluster, world_size=world, global_batch=batch)
    elif pp > UNITS:
        with pytest.raises(PlanSpecError, match=rf"pp\*vpp = {pp} pipeline stages but .* has {UNITS} units"):
            resolve_plan(spec, graph(), cluster=cluster, world_size=world, global_batch=batch)
    else:
        plan = resolve_plan(spec, graph(), cluster=cluster, world_size=world, global_batch=batch)
        assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.zero) == (dp, tp, pp, zero)
        assert len(plan.stages) == pp and plan.predicted.step_time_s > 0, plan.spec()


def test_the_issues_pipeline_and_uneven_worlds_resolve_on_local() -> None:
    """The cases the issue names, on `ClusterSpec.local()` (one node of `world` ranks)."""
    from mplan.cost_models.presets import local_cluster
    from mplan.planner.resolve import resolve_plan

    for world, spec in ((3, "pp=3"), (6, "dp=2,pp=3"), (6, "tp=3,pp=2"), (5, "pp=5"), (7, "dp=7,zero=1")):
        cluster = local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
        plan = resolve_plan(spec, graph(), cluster=cluster, world_size=world, global_batch=2 * world)
        assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp == world, plan.spec()


@pytest.mark.parametrize("world", range(1, 9))
def test_the_search_plans_every_world_size(world: int) -> None:
    """plan=None on one node of `world` ranks and on `world` one-GPU nodes: a plan that fills the world."""
    from mplan.cost_models.presets import local_cluster, make_preset
    from mplan.planner.resolve import resolve_plan

    for cluster in (local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}),
                    make_preset("dgx-h100", nodes=world, gpus_per_node=1, measured=False)):
        plan = resolve_plan(None, graph(), cluster=cluster, world_size=world, global_batch=6 * world)
        assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp == world, (cluster.name, plan.spec())


def test_a_hugging_face_llama_resolves_on_uneven_worlds() -> None:
    """transformers' Llama (6 heads, 3 KV heads, 3 layers): the same arithmetic on a model mplan did not write."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mplan.cost_models.presets import local_cluster, make_preset
    from mplan.ir.trace import capture_for_training
    from mplan.planner.parallel_config import PlanSpecError
    from mplan.planner.resolve import resolve_plan

    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=16, use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float64)
    hf = capture_for_training(model, (batches(2, steps=1, vocab=96)[0][0],))
    for world, spec, cluster in (
            (3, "pp=3", local_cluster({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})),
            (3, "tp=3", local_cluster({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})),
            (6, "dp=2,pp=3", make_preset("dgx-h100", nodes=2, gpus_per_node=3, measured=False)),
            (6, "dp=2,tp=3", make_preset("dgx-h100", nodes=3, gpus_per_node=2, measured=False)),
            (5, "pp=5", make_preset("dgx-h100", nodes=1, gpus_per_node=5, measured=False))):
        plan = resolve_plan(spec, hf, cluster=cluster, world_size=world, global_batch=4 * world)
        assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp == world, plan.spec()
    with pytest.raises(PlanSpecError, match="tp=4 does not divide the 6 attention heads of LlamaForCausalLM"):
        resolve_plan("tp=4", hf, cluster=make_preset("dgx-h100", measured=False), world_size=8, global_batch=8)


# -- 3. a sample trains exactly ------------------------------------------------------------------------
def run(plan: str, global_batch: int) -> dict[str, Any]:
    return compare(family(TRAINED_MODEL), plan, global_batch, vocab=96)


def pp3() -> dict[str, Any]:
    return run("pp=3", 6)


def dp3_zero1() -> dict[str, Any]:
    return run("dp=3,zero=1", 6)


def tp3() -> dict[str, Any]:
    return run("tp=3", 6)


def dp2_pp3() -> dict[str, Any]:
    return run("dp=2,pp=3", 12)


def dp5_zero1() -> dict[str, Any]:
    return run("dp=5,zero=1", 5)


def dp7() -> dict[str, Any]:
    return run("dp=7", 7)


TRAINED = {3: [pp3, dp3_zero1, tp3], 6: [dp2_pp3], 5: [dp5_zero1], 7: [dp7]}
MESH = {pp3: "dp=1,tp=1,pp=3", dp3_zero1: "dp=3,tp=1,pp=1", tp3: "dp=1,tp=3,pp=1", dp2_pp3: "dp=2,tp=1,pp=3",
        dp5_zero1: "dp=5,tp=1,pp=1", dp7: "dp=7,tp=1,pp=1"}  # what each check must have run


@pytest.fixture(scope="module")
def group_at():
    """One gloo group per world size, started by the first test that asks for it."""
    return functools.cache(lambda world: run_checks(world, TRAINED[world]))


@pytest.mark.parametrize("world,check", [(w, c) for w, checks in TRAINED.items() for c in checks],
                         ids=lambda v: v.__name__ if callable(v) else f"world{v}")
def test_trains_exactly(group_at, world: int, check) -> None:
    values = group_at(world).assert_passed(check)
    assert_equivalent(values)
    assert all(v["ran"].startswith(MESH[check]) for v in values), [v["ran"] for v in values]


def test_a_micro_batch_that_is_no_power_of_two_is_searched_and_taken() -> None:
    """A replica's share of 6 sequences splits in 3s: `mbs=3` is a valid spec and the search
    tries it (it enumerated 1, 2, 4, 8, 16 only, so `mbs=3` was refused as fitting nothing)."""
    from mplan.cost_models.presets import local_cluster
    from mplan.planner.parallel_config import ModelLimits, PlanSpec, enumerate_configs
    from mplan.planner.resolve import resolve_plan

    cluster = local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    plan = resolve_plan("dp=2,mbs=3", graph(), cluster=cluster, world_size=2, global_batch=12)
    assert (plan.micro_batch_size, plan.num_micro_batches) == (3, 2)
    limits = ModelLimits(num_heads=4, num_kv_heads=4, num_layers=2, num_experts=0, seq_len=16)
    sizes = {c.mbs for c in enumerate_configs(world_size=1, gpus_per_node=1, global_batch=12, limits=limits,
                                              spec=PlanSpec())}
    assert sizes == {1, 2, 3, 4, 6}
