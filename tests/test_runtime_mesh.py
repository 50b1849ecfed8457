"""Mesh arithmetic (one process), the groups `init_process_groups` builds (gloo), and launch."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import run_checks
from mplan.runtime import launch, parallel_module
from mplan.runtime.launch import init_distributed_from_env
from mplan.ir.mesh import AXES, MeshShape, mesh_for_world
from mplan.runtime.process_groups import init_process_groups

def _mesh(dp: int, tp: int, pp: int, cp: int, sites: int, pick: int) -> MeshShape:
    """A mesh whose ep is some divisor of a site's dp x cp replicas (`pick` chooses which)."""
    sites = sites if dp % sites == 0 else 1
    choices = [ep for ep in range(1, dp * cp + 1) if (dp * cp // sites) % ep == 0]
    return MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, sites=sites, ep=choices[pick % len(choices)])


meshes = st.builds(_mesh, st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4),
                   st.integers(1, 2), st.integers(0, 7))


@settings(deadline=None)  # a loaded 2-core machine took 450 ms over one example once
@given(meshes)
def test_coordinates_round_trip_and_groups_partition_the_world(mesh: MeshShape) -> None:
    for rank in range(mesh.size):
        coord = mesh.coord(rank)
        assert mesh.rank(tp=coord.tp, dp=coord.dp, pp=coord.pp, cp=coord.cp) == rank
        # the replica mesh (dp x cp) is the same layout: its dp coordinate is cp + cp * dp
        assert mesh.replicas().coord(rank).dp == coord.cp + mesh.cp * coord.dp
        # ep and expert_dp split that replica coordinate, as the runtime's groups (built on replicas()) do
        assert coord.cp + mesh.cp * coord.dp == coord.ep + mesh.ep * coord.expert_dp
        assert (coord.ep, coord.expert_dp) == (mesh.replicas().coord(rank).ep, mesh.replicas().coord(rank).expert_dp)
    for axis in ("ep", "expert_dp"):
        assert mesh.groups(axis) == mesh.replicas().groups(axis)
        assert mesh.stride(axis) == mesh.replicas().stride(axis)
    for axis in AXES:
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        if mesh.sites == 1 or axis not in ("dp", "expert_dp"):  # those two jump from site to site
            assert all(b - a == mesh.stride(axis) for g in groups for a, b in zip(g, g[1:])), axis
        assert all(len(g) == mesh.degree(axis) for g in groups)
        # Along a group only the axis' own coordinate changes, increasing with the rank.
        for group in groups:
            assert [getattr(mesh.coord(r), axis) for r in group] == list(range(len(group)))


def test_tp_is_innermost_and_pp_outermost() -> None:
    mesh = MeshShape(dp=2, tp=2, pp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert MeshShape(dp=2, tp=2).groups("dp") == [[0, 2], [1, 3]]


def test_expert_parallel_ranks_are_adjacent_inside_data_parallel() -> None:
    mesh = MeshShape(dp=4, tp=2, ep=2)
    assert mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_context_parallel_ranks_sit_next_to_tp() -> None:
    """cp groups are the next consecutive ranks after tp (inside a node while tp * cp fits);
    gradients reduce over dp x cp, the replica mesh's dp groups, and ep groups come out of them."""
    mesh = MeshShape(dp=2, tp=2, cp=2)
    assert mesh.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.replicas().groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.group_shape("cp", gpus_per_node=8).level == "intra_node"
    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*cp = 2\*2\*1\*2 = 8 but the world size is 4"):
        mesh.check_world_size(4)
    # expert parallelism is carved out of the dp x cp replicas: here each ep group is the two cp ranks
    # of one dp replica, and an expert's replicas are the other replica's (tests/test_cp_ep.py)
    moe = MeshShape(dp=2, ep=2, cp=2).replicas()
    assert (moe.dp, moe.ep, moe.expert_dp) == (4, 2, 2) and moe.groups("ep") == [[0, 1], [2, 3]]
    assert MeshShape(dp=2, ep=2, cp=2).groups("ep") == [[0, 1], [2, 3]]  # the plan's mesh says the same


def test_expert_parallelism_needs_only_to_divide_dp_x_cp() -> None:
    """ep | dp * cp: with no data parallelism the ep groups are carved from the cp ranks (an MoE at
    long context on one node), or span dp replicas and cp ranks alike; each expert is replicated on
    dp * cp / ep ranks. An ep dividing neither is one line with the arithmetic."""
    long_context = MeshShape(dp=1, cp=4, ep=2)
    assert long_context.groups("ep") == [[0, 1], [2, 3]] and long_context.groups("expert_dp") == [[0, 2], [1, 3]]
    assert long_context.expert_dp == 2 and long_context.group_shape("ep", gpus_per_node=8).level == "intra_node"
    node = MeshShape(dp=1, cp=8, ep=8)
    assert node.groups("ep") == [list(range(8))] and node.groups("cp") == node.groups("ep") and node.expert_dp == 1
    across = MeshShape(dp=2, cp=2, ep=4, tp=2)
    assert across.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]] and across.stride("ep") == 2
    with pytest.raises(ValueError, match=r"ep must divide dp\*cp .*: dp\*cp % ep = 1\*6 % 4 = 2"):
        MeshShape(dp=1, cp=6, ep=4)
    with pytest.raises(ValueError, match=r"ep must divide dp\*cp / sites .*: 2\*2 / 2 = 2, not a multiple of ep=4"):
        MeshShape(dp=2, cp=2, ep=4, sites=2)


def test_bad_meshes_show_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2\*4\*2 = 16 but the world size is 8"):
        MeshShape(dp=2, tp=4, pp=2).check_world_size(8)
    with pytest.raises(ValueError, match=r"dp % ep = 6 % 4 = 2"):
        MeshShape(dp=6, ep=4)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        MeshShape(tp=0)
    with pytest.raises(ValueError, match=r"tp\*pp = 4\*3 = 12 does not divide the world size 8"):
        mesh_for_world(8, tp=4, pp=3)
    assert mesh_for_world(8, tp=2) == MeshShape(dp=4, tp=2)


def test_one_process_without_a_group_gets_groups_of_one() -> None:
    groups = init_process_groups(MeshShape())
    assert groups.tp is None and groups.dp is None and groups.world is None
    assert groups.ranks("dp") == (0,) and groups.pp_rank == 0 and groups.device_mesh is None
    with pytest.raises(ValueError, match="but the world size is 1"):
        init_process_groups(MeshShape(dp=2))


def test_launch_without_torchrun_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed_from_env() is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"):
        init_distributed_from_env()


def test_collectives_go_on_the_device_the_backend_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL takes only CUDA tensors (a CPU tensor's all-gather failed on 2 H200s), gloo CPU ones."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert launch.collective_device(None) == device


def test_the_plan_check_all_gathers_where_collective_device_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """autoparallel's first collective, the plan-hash all-gather, takes its tensor's device from
    `collective_device` (meta stands in for a GPU this machine lacks)."""
    seen = []

    def all_gather(every: list[torch.Tensor], mine: torch.Tensor, group: object = None) -> None:
        seen.append(mine.device)

    class World:
        def size(self) -> int:
            return 2

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(parallel_module, "collective_device", lambda group: torch.device("meta"))
    with pytest.raises(RuntimeError, match="meta"):  # reading a meta tensor's value back: it went there
        parallel_module.check_same_plan("0" * 16, World())
    assert seen == [torch.device("meta")]


def _expected_ranks(mesh: MeshShape, axis: str, rank: int) -> list[int]:
    return next(g for g in mesh.groups(axis) if rank in g)


def _check_groups(mesh: MeshShape) -> None:
    groups = init_process_groups(mesh)
    rank = dist.get_rank()
    for axis in AXES:
        expected = _expected_ranks(mesh, axis, rank)
        assert list(groups.ranks(axis)) == expected, axis
        if groups.group(axis) is None:  # a group of one rank
            assert expected == [rank], axis
            continue
        assert dist.get_process_group_ranks(groups.group(axis)) == expected, axis
        # Collectives on the group really stay inside it.
        assert groups.group(axis).size() == len(expected)
    named = groups.device_mesh.mesh_dim_names  # torch's own mesh carries the same layout
    assert named == ("pp", "dp", "tp") and groups.device_mesh.mesh.flatten().tolist() == list(range(mesh.size))
    assert (groups.tp_rank, groups.dp_rank, groups.pp_rank) == (
        mesh.coord(rank).tp, mesh.coord(rank).dp, mesh.coord(rank).pp)


def check_groups_dp2_tp2() -> None:
    _check_groups(MeshShape(dp=2, tp=2))


def check_groups_dp2_tp2_ep2() -> None:
    _check_groups(MeshShape(dp=2, tp=2, ep=2))


def check_groups_dp2_tp2_pp2() -> None:
    _check_groups(MeshShape(dp=2, tp=2, pp=2))


def check_groups_dp1_cp4_ep2() -> None:
    """Under cp the runtime builds its groups on the replicas; its ep and expert_dp groups are the
    plan's mesh's (ep carved from the cp ranks), and its cp group too."""
    mesh = MeshShape(dp=1, cp=4, ep=2)
    groups, rank = init_process_groups(mesh), dist.get_rank()
    for axis in ("ep", "expert_dp"):
        assert dist.get_process_group_ranks(groups.group(axis)) == _expected_ranks(mesh, axis, rank), axis
    assert dist.get_process_group_ranks(groups.cp) == _expected_ranks(mesh, "cp", rank)
    assert (groups.ep_rank, groups.expert_dp_rank) == (mesh.coord(rank).ep, mesh.coord(rank).expert_dp)


def check_launch_reuses_the_existing_group() -> None:
    assert init_distributed_from_env() is dist.group.WORLD


def check_launch_joins_a_torchrun_environment() -> str:
    """Leave the harness' group, then join a new one the way torchrun's ranks do."""
    port = [_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    world = init_distributed_from_env()
    assert world is dist.group.WORLD and dist.get_world_size() == world_size
    total = torch.ones(())
    dist.all_reduce(total)
    assert total.item() == world_size
    return dist.get_backend()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_wrong_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="but the world size is"):
        init_process_groups(MeshShape(dp=3))


CHECKS_AT_4 = [check_groups_dp2_tp2, check_groups_dp2_tp2_ep2, check_groups_dp1_cp4_ep2,
               check_launch_reuses_the_existing_group, check_wrong_world_size_is_refused,
               check_launch_joins_a_torchrun_environment]  # last: it replaces the group


@pytest.fixture(scope="module")
def world4():
    return run_checks(4, CHECKS_AT_4)


@pytest.fixture(scope="module")
def world8():
    return run_checks(8, [check_groups_dp2_tp2_pp2])


@pytest.mark.distributed
@pytest.mark.parametrize("check", CHECKS_AT_4, ids=lambda c: c.__name__)
def test_world4(world4, check) -> None:
    world4.assert_passed(check)


@pytest.mark.distributed
def test_world8_groups_dp2_tp2_pp2(world8) -> None:
    world8.assert_passed(check_groups_dp2_tp2_pp2)
