"""Expert parallelism carved from the dp x cp replicas (issue 34): ep must divide dp x cp, not dp.

An ep group is any ep consecutive replicas (`MeshShape`: replica = cp_rank + cp * dp_rank), so the
plan grammar, the plan file and the search admit ep | dp x cp (dp=1, cp=4, ep=2: an MoE at long
context on one node) and refuse, in one line with the arithmetic, an ep that divides neither dp nor
dp x cp. One process, no process group: the runs are tests/test_cp_moe.py (dp1 x cp2 x ep2) and
tests/test_cp_ep.py (dp1 x cp4 x ep2 and ep4, dp2 x cp2 x ep4).
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from mplan.planner.parallel_config import (ModelLimits, PlanSpec, PlanSpecError, carving_refusal, enumerate_configs,
                                           parse_plan_spec)
from mplan.planner.spec_check import spec_refusal

MOE = "moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,aux=0.1,experts=8,topk=2"


def test_the_carving_rule_shows_its_arithmetic() -> None:
    assert carving_refusal(2, 1, 4) is None and carving_refusal(4, 2, 2) is None and carving_refusal(8, 1, 8) is None
    assert carving_refusal(3, 4, 1) == "ep=3 does not divide the dp=4 data-parallel ranks it is carved from (4 % 3 = 1)"
    assert carving_refusal(4, 1, 6) == ("ep=4 divides neither dp=1 nor the dp x cp = 1 x 6 = 6 replicas its groups "
                                        "are carved from (6 % 4 = 2)")


@pytest.mark.parametrize(("spec", "refused"), [
    ("dp=1,cp=4,ep=2", None),
    ("dp=1,cp=8,ep=8", None),
    ("dp=2,cp=2,ep=4", None),
    ("dp=1,tp=2,ep=4", None),  # cp left out: the other degrees leave cp up to 4, and 4 | 1 x 4
    ("dp=2,tp=4,ep=4", r"ep=4 does not divide the dp=2 data-parallel ranks .* \(2 % 4 = 2\)"),  # no room for cp
    ("dp=1,cp=2,ep=4", r"ep=4 divides neither dp=1 nor the dp x cp = 1 x 2 = 2 replicas .* \(2 % 4 = 2\)"),
    ("dp=2,tp=2,ep=8", r"ep=8 divides neither dp=2 nor the dp x cp = 2 x 2 = 4 replicas"),  # the largest cp
    ("tp=4,pp=1,cp=2,ep=4", r"ep=4 divides neither dp=1 nor the dp x cp = 1 x 2 = 2 replicas"),
])
def test_a_spec_is_refused_only_where_ep_divides_no_dp_x_cp(spec: str, refused: str | None) -> None:
    reason = spec_refusal(parse_plan_spec(spec), world_size=8, gpus_per_node=8, global_batch=8, num_experts=8)
    if refused is None:
        assert reason is None, reason
    else:
        assert reason is not None and re.search(refused, reason), reason


def test_the_search_offers_ep_carved_from_cp_at_dp_1() -> None:
    """One sequence a step: dp is 1, and every ep dividing cp (and the experts) is enumerated."""
    limits = ModelLimits(num_layers=4, num_heads=16, num_kv_heads=8, num_experts=8, seq_len=131072)
    meshes = {(c.dp, c.cp, c.ep) for c in enumerate_configs(world_size=8, gpus_per_node=8, global_batch=1,
                                                            limits=limits, spec=PlanSpec())}
    assert {(1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 8, 8), (1, 4, 4), (1, 2, 2)} <= meshes
    assert all(cp % ep == 0 for dp, cp, ep in meshes)  # dp = 1: ep only ever from cp
    two = {(c.dp, c.cp, c.ep) for c in enumerate_configs(world_size=8, gpus_per_node=8, global_batch=2,
                                                         limits=limits, spec=parse_plan_spec("dp=2,cp=2"))}
    assert {ep for _, _, ep in two} == {1, 2, 4}  # ep=4 spans both dp replicas' cp ranks


def _graph():
    from mplan.ir.trace import capture_for_training
    from mplan.models import build_model

    model = build_model(MOE, device="cpu", dtype=torch.float64, seed=0)
    return capture_for_training(model, (torch.zeros(2, 16, dtype=torch.long),))


def test_resolve_and_plan_files_apply_the_same_rule(tmp_path) -> None:
    """A spec string binds at dp=1 x cp=2 x ep=2 on 2 ranks and is refused at ep=4; a plan file
    whose mesh carves ep from cp loads, one whose ep divides neither is refused."""
    from mplan.cost_models.presets import local_cluster
    from mplan.planner.plan import Plan, PlanError
    from mplan.planner.resolve import resolve_plan

    graph, cluster = _graph(), local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(PlanSpecError, match=r"ep=4 divides neither dp=1 nor the dp x cp = 1 x 2 = 2 replicas"):
        resolve_plan("dp=1,cp=2,ep=4", graph, cluster=cluster, world_size=2, global_batch=2)
    plan = resolve_plan("dp=2,ep=2", graph, cluster=cluster, world_size=2, global_batch=2)
    doc = json.loads(plan.to_json())
    carved = {**doc, "mesh": {**doc["mesh"], "dp": 1, "cp": 2}, "num_micro_batches": 2}
    assert Plan.from_dict(carved).mesh_shape().expert_dp == 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**carved, "mesh": {**carved["mesh"], "cp": 2, "ep": 4}}))
    with pytest.raises(PlanError, match=r"mesh\.ep=4 divides neither dp=1 nor the dp x cp = 1 x 2 = 2"):
        Plan.load(str(path))
