"""Context parallelism on MoE models (issue 34): cp=2 with ep=1 trains exactly as one process,
and the search weighs cp for MoE models whose loss it can split.

With ep=1 every rank holds every expert and a cp rank routes its own tokens: routing and the
experts are per token, so splitting each sequence over the cp ranks moves only where a token's
experts run. Checked as tests/test_context_parallel.py checks dense models: 3 AdamW steps with
active global-norm clipping under `mplan.autoparallel(plan="cp=2")` on 2 gloo ranks, every step's
loss and every final parameter (routers and experts included) against one process trained with
the plan's micro-batches (test_expert_parallel.accumulated), float64, relative error under 1e-9:
Hugging Face Mixtral and Qwen2-MoE (shared expert) without their router loss. With it (a
load-balancing loss, products of token means over the whole sequence), tests/test_cp_router_loss.py;
the search tries cp for both (`ModelLimits.splits_loss`). With no data parallelism at all, dp=1 x
cp=2 x ep=2 (the experts sharded over the two cp ranks, `MeshShape`'s replica coordinate) trains
as exactly (more carvings on 4 ranks: tests/test_cp_ep.py), and the search offers such plans to a
long-context Mixtral on one node.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from distributed import run_checks
from test_equivalence import TOL, batches, errors, trained
from test_expert_parallel import accumulated, hf_moe

STEPS = 3


def _compare(make: Callable[[], nn.Module], plan: str = "cp=2", global_batch: int = 2,
             micro_batch: int = 1) -> dict[str, Any]:
    data = batches(global_batch, steps=STEPS)
    pm, losses, norms = trained(make, plan, data, micro_batch_size=micro_batch)
    kinds = [type(m).__name__ for m in pm.program.modules()]
    halves = [name for name in pm.params if "experts" in name and pm.params[name].shape[0] == 2]
    return {**errors(pm, losses, norms, accumulated(make, data, micro_batch)), "dp": pm.plan.mesh.dp,
            "cp": pm.plan.mesh.cp, "ep": pm.plan.mesh.ep, "attention": kinds.count("ContextAttention"),
            "experts": kinds.count("RoutedExperts"), "experts_halved": len(halves)}


def without_router_loss(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`make`'s Hugging Face MoE model with `output_router_logits` off: its loss the LM loss alone."""
    def build() -> nn.Module:
        model = make()
        model.config.output_router_logits = False
        return model
    build.capture_key = (*make.capture_key, "no router loss")  # type: ignore[attr-defined]
    return build


def cp2_mixtral() -> dict[str, Any]:
    return _compare(without_router_loss(hf_moe("mixtral")))


def cp2_qwen2_moe() -> dict[str, Any]:
    return _compare(without_router_loss(hf_moe("qwen2_moe")))


def dp1_cp2_ep2_mixtral() -> dict[str, Any]:
    return _compare(without_router_loss(hf_moe("mixtral")), "dp=1,cp=2,ep=2")


def dp1_cp2_ep2_checkpoint_reshards_to_ep1() -> dict[str, Any]:
    """A checkpoint of dp1 x cp2 x ep2 (each cp rank its half of the experts) loaded under cp=2
    with ep=1 (every expert on both): the next step's loss and the parameters after it agree."""
    import tempfile

    import torch.distributed as dist

    from distributed import rel_err
    from test_equivalence import MAX_NORM, OPTIMIZER

    import mplan

    make, data = without_router_loss(hf_moe("mixtral")), batches(2, steps=STEPS)
    pm, _, _ = trained(make, "dp=1,cp=2,ep=2", data[:2], micro_batch_size=1)
    where = [tempfile.mkdtemp(prefix="mplan_cp_ep_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    pm.save(where[0])
    other = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=2,
                               plan="cp=2", micro_batch_size=1, max_grad_norm=MAX_NORM)
    other.load(where[0])
    ids, labels = data[2]
    loss = abs(pm.train_step(ids, labels) - other.train_step(ids, labels))
    a, b = pm.full_state_dict(), other.full_state_dict()
    return {"loss": loss, "param": max(rel_err(b[k], a[k]) for k in a), "ep": (pm.plan.mesh.ep, other.plan.mesh.ep)}


CHECKS = [cp2_mixtral, cp2_qwen2_moe, dp1_cp2_ep2_mixtral, dp1_cp2_ep2_checkpoint_reshards_to_ep1]


@pytest.fixture(scope="module")
def world2() -> Any:
    return run_checks(2, CHECKS, timeout_s=600)


@pytest.mark.parametrize("check", [cp2_mixtral, cp2_qwen2_moe], ids=lambda c: c.__name__)
def test_cp2_with_ep1_trains_moe_models_exactly(world2: Any, check: Any) -> None:
    values = world2.assert_passed(check)
    assert values, "no per-rank results"
    for rank, result in enumerate(values):
        # both layers' attention split over cp, both layers' experts routed locally (ep=1)
        assert (result["cp"], result["ep"], result["attention"], result["experts"]) == (2, 1, 2, 2), result
        assert result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"


def test_dp1_cp2_ep2_shards_the_experts_over_the_cp_ranks_exactly(world2: Any) -> None:
    """No data parallelism: the two cp ranks are the ep group, each holding 2 of the 4 experts
    of both layers (gate_up and down: 4 tensors), each expert on one rank (expert_dp = 1)."""
    values = world2.assert_passed(dp1_cp2_ep2_mixtral)
    for rank, result in enumerate(values):
        assert (result["dp"], result["cp"], result["ep"], result["attention"]) == (1, 2, 2, 2), result
        assert result["experts_halved"] == 4, f"rank {rank}: experts not split over the cp ranks: {result}"
        assert result["loss"] < TOL and result["param"] < TOL and result["clipped"], f"rank {rank}: {result}"


def test_a_dp1_cp2_ep2_checkpoint_loads_under_ep1(world2: Any) -> None:
    for result in world2.assert_passed(dp1_cp2_ep2_checkpoint_reshards_to_ep1):
        assert result["ep"] == (2, 1) and result["loss"] < 1e-12 and result["param"] < 1e-12, result


# -- the search (one process) -------------------------------------------------------------------------
MIXTRAL_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                  "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
                  "intermediate_size": 3584, "num_local_experts": 8, "num_experts_per_tok": 2,
                  "max_position_embeddings": 131072, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": False, "output_router_logits": False, "torch_dtype": "bfloat16"}
"""A Mixtral-style model of 4 layers, hidden 1024, 8 experts (top 2), its loss the LM loss alone."""


@pytest.fixture(scope="module")
def mixtral_graph(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import json

    from mplan.planner.planning import capture_for_planning

    where = tmp_path_factory.mktemp("mixtral")
    (where / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    return capture_for_planning(str(where), seq_len=131072)


def test_the_search_weighs_cp_for_an_moe_model_and_picks_it_at_long_sequences(mixtral_graph: Any) -> None:
    """At 131072 tokens, 2 sequences a step on 8 H100s: cp with ep=1 beats every plan without cp,
    and a cp rank's experts are priced at its own tokens (1/cp of the sequence's)."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.context_pricing import rank_experts, splits_loss
    from mplan.planner.parallel_config import PlanSpec
    from mplan.planner.search import Planner

    assert splits_loss(mixtral_graph)
    planner = Planner(mixtral_graph, ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    best = planner.search(2).best
    without = planner.search(2, PlanSpec(cp=1)).best
    assert best.config.cp > 1 and best.config.ep == 1 and best.experts_per_rank == 8, best.config.short()
    assert best.step_time_s < without.step_time_s, (best.config.short(), without.config.short())
    whole = [e for e in planner.sharded(1, False).experts[1] if e is not None]
    ranked = [e for e in rank_experts(planner.sharded(1, False).experts[1], 1 / 4) if e is not None]
    assert len(whole) == len(ranked) == 4
    for held, rank in zip(whole, ranked):
        assert [layer.tokens for layer in held.layers] == [131072] and [layer.tokens for layer in rank.layers] == [32768]
        assert rank.held_forward_s == pytest.approx(held.held_forward_s / 4)
        assert rank.expert_params == held.expert_params  # every expert on every cp rank


def test_moe_models_with_a_load_balancing_loss_get_the_cp_search(tmp_path: Any) -> None:
    """The aux term's token means are made exact under cp (tests/test_cp_router_loss.py): mplan's
    MoE family (its aux loss added even at aux=0) and Mixtral with its router loss are offered cp;
    a loss with a reduction over the tokens cp cannot make exact is not."""
    import json

    from mplan.planner.context_pricing import splits_loss
    from mplan.planner.parallel_config import ModelLimits, PlanSpec, context_degrees
    from mplan.planner.planning import capture_for_planning

    moe = "moe:layers=2,hidden=64,heads=4,kv_heads=2,seq=4096,vocab=64,ffn=48,experts=4,topk=2,aux=0"
    dense = "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=4096,vocab=64,ffn=48"
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_CONFIG, "output_router_logits": True}))
    assert splits_loss(capture_for_planning(moe, seq_len=4096))
    assert splits_loss(capture_for_planning(dense, seq_len=4096))
    routed = capture_for_planning(str(tmp_path), seq_len=4096)
    assert splits_loss(routed)
    limits = ModelLimits(num_layers=4, num_heads=16, num_kv_heads=8, num_experts=8, seq_len=4096,
                         splits_loss=splits_loss(routed))
    assert context_degrees(8, limits, PlanSpec()) == [1, 2, 4, 8]


def test_a_loss_cp_cannot_make_exact_gets_no_cp_search() -> None:
    """A max over the tokens beside the cross-entropy: `split_context` would refuse it."""
    from mplan.ir.trace import capture
    from mplan.planner.context_pricing import splits_loss

    class MaxRouted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.router, self.head = nn.Embedding(16, 8), nn.Linear(8, 4), nn.Linear(8, 16)

        def forward(self, input_ids: Any, labels: Any) -> Any:
            x = self.embed(input_ids)
            loss = nn.functional.cross_entropy(self.head(x).reshape(-1, 16), labels.reshape(-1))
            return loss + self.router(x).amax(dim=1).mean()

    ids = torch.randint(0, 16, (2, 8))
    assert not splits_loss(capture(MaxRouted(), (ids,), labels=ids))


def test_a_capacity_factor_keeps_cp_out_and_is_refused_with_it() -> None:
    """A capacity counts a whole micro-batch's tokens (docs/execution.md): under cp each rank would
    count its own share and drop other tokens than one process does. So a model whose MoE layers
    keep a capacity, or a spec that sets one, is searched at cp=1 only; asking for both is one
    line, before the capture for a spec, at binding for a model's own capacity."""
    import dataclasses

    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.parallel_config import ModelLimits, PlanSpec, PlanSpecError, context_degrees, parse_plan_spec
    from mplan.planner.planning import PlanError, capture_for_planning, plan
    from mplan.planner.resolve import resolve_plan
    from mplan.planner.search import Planner

    limits = ModelLimits(num_layers=4, num_heads=16, num_kv_heads=8, num_experts=8, seq_len=4096)
    assert context_degrees(8, limits, PlanSpec()) == [1, 2, 4, 8]
    assert context_degrees(8, limits, parse_plan_spec("capacity=1.25")) == [1]
    assert context_degrees(8, dataclasses.replace(limits, capacity_limited=True), PlanSpec()) == [1]
    moe = "moe:layers=2,hidden=64,heads=4,kv_heads=2,seq=4096,vocab=64,ffn=48,experts=4,topk=2,aux=0"
    cluster = ClusterSpec.preset("dgx-h100", nodes=1)
    with pytest.raises(PlanSpecError, match=r"cp=2 with capacity=1\.25: a capacity counts the tokens of a whole "
                                            r"micro-batch"):
        plan(moe, cluster=cluster, global_batch=8, spec="cp=2,capacity=1.25", progress="quiet")
    own = capture_for_planning(moe + ",capacity=1.25", seq_len=4096)
    assert Planner(own, cluster).limits.capacity_limited
    assert not Planner(capture_for_planning(moe, seq_len=4096), cluster).limits.capacity_limited
    with pytest.raises(PlanError, match=r"cp=2 with its MoE layers' own capacity factor 1\.25"):
        resolve_plan("dp=4,cp=2", own, cluster=cluster, world_size=8, global_batch=8)


def test_the_search_prices_cp_with_ep_over_the_replicas_the_runtime_carves(mixtral_graph: Any) -> None:
    """cp with ep > 1 is searched (tests/test_cp_ep.py runs it exactly): a cp rank is priced as one
    of the dp x cp replicas, its ep group carved from them as the runtime carves it, so at ep=2
    each rank holds half the experts, pays an all-to-all of its own tokens and holds less than its
    ep=1 twin; the search ranks such configs beside the others."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.parallel_config import parse_plan_spec
    from mplan.planner.search import Planner

    planner = Planner(mixtral_graph, ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    result = planner.search(2)
    assert any(e.config.cp > 1 and e.config.ep > 1 for e in result.ranked), [e.config.short() for e in result.ranked]
    carved = planner.search(2, parse_plan_spec("dp=2,cp=4,ep=2")).best
    twin = planner.search(2, parse_plan_spec("dp=2,cp=4,ep=1")).best
    assert (carved.config.cp, carved.config.ep, carved.experts_per_rank) == (4, 2, 4)
    assert carved.a2a_s > 0 == twin.a2a_s
    assert carved.peak_memory_bytes < twin.peak_memory_bytes


def test_one_long_sequence_on_one_node_is_offered_experts_carved_from_cp(mixtral_graph: Any) -> None:
    """One sequence of 131072 tokens a step on 8 H100s: dp is 1, so ep > 1 exists only carved from
    the cp ranks (ep | dp x cp). The search ranks such plans; dp=1 x cp=8 x ep=8 holds one expert
    a rank and pays an all-to-all, for less memory than its ep=1 twin."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.parallel_config import parse_plan_spec
    from mplan.planner.search import Planner

    planner = Planner(mixtral_graph, ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    ranked = planner.search(1).ranked
    carved = {(e.config.cp, e.config.ep) for e in ranked if e.config.dp == 1 and e.config.cp > 1 and e.config.ep > 1}
    assert carved, [e.config.short() for e in ranked]
    one = planner.search(1, parse_plan_spec("dp=1,cp=8,ep=8")).best
    twin = planner.search(1, parse_plan_spec("dp=1,cp=8,ep=1")).best
    assert (one.config.dp, one.config.cp, one.config.ep, one.experts_per_rank) == (1, 8, 8, 1)
    assert one.a2a_s > 0 == twin.a2a_s
    assert one.peak_memory_bytes < twin.peak_memory_bytes
