"""Expert parallelism trains exactly as one process: EP2, EP4, EP2xTP2, EP2xDP2 with ZeRO-1 and
EP2xPP2 on mplan's MoE family and on Hugging Face Mixtral and Qwen2-MoE (gloo, float64).

Each check trains 5 AdamW steps with active global-norm clipping under `mplan.autoparallel` and
compares every step's loss and every final parameter (routers and experts included) with the
single-device model: relative error < 1e-9.

Routing statistics are per micro-batch, as in Megatron-LM: each data-parallel (and so each
expert-parallel) rank routes its own micro-batch, and the load-balancing loss and any capacity
are computed over it. The single-device reference is therefore the model trained with gradient
accumulation over the plan's micro-batches (the global batch cut into consecutive chunks of the
micro-batch size, losses averaged), which for a dense model is the same as one pass over the
global batch. Hugging Face's experts run their eager loop in the reference and the captured
`moe_experts` op under mplan; their float32 router softmax and RMSNorm are made float64 (the
"faithful" variants, as in test_equivalence.py), so float64 is the bar everywhere.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import rel_err, run_checks
from test_equivalence import MAX_NORM, OPTIMIZER, TOL, batches, errors, family, loss_of, trained

STEPS = 5
TIMEOUT_S = 900.0  # 4 ranks on 2 cores, a dozen trainings
MOE = "moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,aux=0.1"


def moe(experts: int, topk: int, shared: int = 0, capacity: str = "none") -> Callable[[], nn.Module]:
    return family(f"{MOE},experts={experts},topk={topk},shared={shared},capacity={capacity}")


# -- Hugging Face models, float64-faithful ------------------------------------------------------
def float64_faithful(model: nn.Module, loss_function: Callable[..., torch.Tensor]) -> nn.Module:
    """`model` with Hugging Face's float32 RMSNorm and router softmax computed in float64 (the same
    functions otherwise) and `loss_function` as its loss."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif name.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_float64, module)
    model.loss_function = loss_function
    return model


def _router_float64(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mixtral's and Qwen2-MoE's top-k router with the softmax in the model's dtype."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _rms_norm_float64(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _lm_loss_float64(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **_: Any) -> torch.Tensor:
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, vocab_size), shifted.view(-1), ignore_index=-100)


def hf_moe(kind: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

        from mplan.verify import perturbed

        common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                      output_router_logits=True, router_aux_loss_coef=0.1)
        if kind == "mixtral":
            config = MixtralConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
            model_type = MixtralForCausalLM
        else:
            config = Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=True)
            model_type = Qwen2MoeForCausalLM
        config._experts_implementation = "eager"  # the reference runs transformers' loop over experts
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = model_type(config).to(torch.float64)
        return perturbed(float64_faithful(model, _lm_loss_float64))
    make.capture_key = ("hf_moe", kind)  # test_equivalence.trained captures it once per rank
    return make


# -- the comparison -----------------------------------------------------------------------------
def accumulated(make: Callable[[], nn.Module], data: list, micro_batch: int) -> tuple[list[float], dict]:
    """The single-device model trained with gradient accumulation over chunks of `micro_batch` rows."""
    model = make()
    optimizer = OPTIMIZER(model.parameters())
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        chunks = list(zip(ids.split(micro_batch), labels.split(micro_batch)))
        total = 0.0
        for chunk_ids, chunk_labels in chunks:
            loss = loss_of(model(chunk_ids, labels=chunk_labels)) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(total)
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def compare_moe(make: Callable[[], nn.Module], plan: str, global_batch: int, micro_batch: int, *,
                reference: Callable[[], nn.Module] | None = None, **options: Any) -> dict[str, Any]:
    """Train `make()` under `plan`, and `reference()` (default: the same model) on one process."""
    data = batches(global_batch)
    pm, losses, norms = trained(make, plan, data, micro_batch_size=micro_batch, **options)
    experts = [m for m in pm.program.modules() if type(m).__name__ == "RoutedExperts"]
    if pm.pipeline is not None:
        experts = [m for s in pm.pipeline.mine for m in pm.pipeline.stages[s].module.modules()
                   if type(m).__name__ == "RoutedExperts"]
    return {**errors(pm, losses, norms, accumulated(reference or make, data, micro_batch)),
            "ep": [m.ep.size for m in experts], "expert_params": sorted(pm.experts.parameters)[:2],
            "experts_strategy": sorted({str(pm.choice[m.node]).partition(":")[0] for m in experts})}


def assert_exact(values: list[dict[str, Any]], ep: int) -> None:
    assert values, "no per-rank results (a later check failed and tore the group down)"
    for rank, result in enumerate(values):
        assert result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
        assert result["ep"] and set(result["ep"]) == {ep}, f"rank {rank}: experts ran at ep {result['ep']}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"


def skewed(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`make`'s model with a router that sends nearly every token to expert 0: a constant
    embedding feature that expert 0's router row weighs heavily."""
    def build() -> nn.Module:
        model = make()
        with torch.no_grad():
            model.embed.weight[:, 0] = 5.0
            for layer in model.layers:
                layer.mlp.router.weight[0, 0] = 40.0
        return model
    return build


def routed_to(make: Callable[[], nn.Module], ids: torch.Tensor) -> torch.Tensor:
    """Choices per expert of the first MoE layer of `make()` on `ids` (its first forward)."""
    model, seen = make(), []
    layer = model.layers[0].mlp
    layer.experts.register_forward_hook(lambda _m, args, _out: seen.append(args[1]))
    with torch.no_grad():
        model(ids)
    return torch.bincount(seen[0].flatten(), minlength=layer.config.num_experts)


def dropped_choices(make: Callable[[], nn.Module], ids: torch.Tensor, capacity_factor: float) -> int:
    """Choices the capacity rule drops in the first MoE layer, micro-batch `ids`."""
    from mplan.kernels.moe import expert_capacity, route

    model, seen = make(), []
    model.layers[0].mlp.experts.register_forward_hook(lambda _m, args, _out: seen.append(args[1]))
    with torch.no_grad():
        model(ids)
    index = seen[0]
    experts = model.config.num_experts
    kept = route(index, experts, expert_capacity(index.shape[0], index.shape[1], experts, capacity_factor))
    return index.numel() - kept.order.numel()


# -- world of 2 -----------------------------------------------------------------------------------
def ep2_top2_e4() -> dict[str, Any]:
    return compare_moe(moe(4, 2), "dp=2,ep=2", 4, 1)


def ep2_top1_e8_shared() -> dict[str, Any]:
    return compare_moe(moe(8, 1, shared=40), "dp=2,ep=2", 4, 2)


def ep2_mixtral() -> dict[str, Any]:
    return compare_moe(hf_moe("mixtral"), "dp=2,ep=2", 4, 1)


def ep2_qwen2_moe() -> dict[str, Any]:
    return compare_moe(hf_moe("qwen2_moe"), "dp=2,ep=2", 4, 2)


def ep2_skewed_router() -> dict[str, Any]:
    """Top-1 with every token routed to expert 0: rank 0 gets both ranks' tokens, rank 1 none,
    and nothing is dropped (dropless)."""
    make = skewed(moe(4, 1))
    result = compare_moe(make, "dp=2,ep=2", 4, 1)
    result["to_expert_0"] = float(routed_to(make, batches(4)[0][0][:1])[0]) / 16
    return result


def ep2_plan_capacity() -> dict[str, Any]:
    """The plan sets capacity 1.0 on a dropless model: each rank drops, before dispatch, exactly the
    choices the rule drops on its micro-batch, as the single-device model built with that capacity
    (whose rule tests/test_models.py holds to a token-by-token loop)."""
    with_capacity = skewed(moe(4, 2, capacity="1"))
    result = compare_moe(skewed(moe(4, 2)), "dp=2,ep=2,capacity=1", 4, 1, reference=with_capacity)
    result["dropped"] = dropped_choices(with_capacity, batches(4)[0][0][:1], 1.0)
    return result


def ep2_checkpoint_and_inference() -> dict[str, float]:
    """EP2 with ZeRO-1: save after 2 steps, load into a job built from other weights, continue;
    the difference from never stopping. Then pm(ids) against the one-process model holding
    pm's full state dict (every EP rank's experts gathered)."""
    import tempfile

    import torch.distributed as dist

    import mplan
    from mplan.models import build_model

    data = batches(4)
    spec = f"{MOE},experts=4,topk=2"
    build = lambda model: mplan.autoparallel(model, example_inputs=(data[0][0],), optimizer=OPTIMIZER,  # noqa: E731
                                             global_batch=4, plan="dp=2,ep=2,zero=1", micro_batch_size=1,
                                             max_grad_norm=MAX_NORM)
    first = build(family(spec)())
    for ids, labels in data[:2]:
        first.train_step(ids, labels)
    where = [tempfile.mkdtemp(prefix="mplan_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    first.save(where[0])
    second = build(build_model(spec, device="cpu", dtype=torch.float64, seed=3))
    second.load(where[0])
    tail_a = [first.train_step(ids, labels) for ids, labels in data[2:]]
    tail_b = [second.train_step(ids, labels) for ids, labels in data[2:]]
    a, b = first.full_state_dict(), second.full_state_dict()
    resumed = max([abs(x - y) for x, y in zip(tail_a, tail_b)] + [rel_err(b[k], a[k]) for k in a])
    single = family(spec)()
    single.load_state_dict(a, strict=False)
    ids = data[0][0][:2]
    return {"resumed": resumed, "logits": rel_err(first(ids), single(ids).detach())}


WORLD2 = [ep2_top2_e4, ep2_top1_e8_shared, ep2_mixtral, ep2_qwen2_moe, ep2_skewed_router, ep2_plan_capacity]
CHECKS2 = [*WORLD2, ep2_checkpoint_and_inference]


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, CHECKS2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("check", WORLD2, ids=lambda c: c.__name__)
def test_two_ranks_match_one_process(world2, check) -> None:
    assert_exact(world2.assert_passed(check), ep=2)


def test_checkpoints_resume_and_inference_gathers_under_ep(world2) -> None:
    for result in world2.assert_passed(ep2_checkpoint_and_inference):
        assert result["resumed"] < 1e-12 and result["logits"] < 1e-12, result


def test_a_skewed_router_loses_no_token(world2) -> None:
    for result in world2.assert_passed(ep2_skewed_router):
        assert result["to_expert_0"] > 0.9, result  # nearly every token chose expert 0


def test_a_plan_capacity_drops_what_the_rule_drops(world2) -> None:
    for result in world2.assert_passed(ep2_plan_capacity):
        assert result["dropped"] > 0 and "capacity=1" in result["ran"], result


# -- world of 4 -----------------------------------------------------------------------------------
def ep4_top2_e8() -> dict[str, Any]:
    return compare_moe(moe(8, 2), "dp=4,ep=4", 8, 1)


def ep4_top1_e4_shared() -> dict[str, Any]:
    return compare_moe(moe(4, 1, shared=40), "dp=4,ep=4", 4, 1)


def ep2_tp2_top2_e4_shared() -> dict[str, Any]:
    # experts split by their FFN dim over TP as well (the "ffn" strategy), the shared expert by Megatron's
    return compare_moe(moe(4, 2, shared=40), "dp=2,tp=2,ep=2", 4, 1)


def ep2_tp2_sp_top1_e8() -> dict[str, Any]:
    return compare_moe(moe(8, 1), "dp=2,tp=2,ep=2,sp=1", 4, 2)


def ep2_dp2_zero1_top2_e8() -> dict[str, Any]:
    return compare_moe(moe(8, 2), "dp=4,ep=2,zero=1", 8, 1)


def ep2_pp2_top1_e8_shared() -> dict[str, Any]:
    return compare_moe(moe(8, 1, shared=40), "dp=2,pp=2,ep=2,schedule=zb-h1", 8, 1)


def ep4_mixtral() -> dict[str, Any]:
    return compare_moe(hf_moe("mixtral"), "dp=4,ep=4", 8, 1)


def ep2_tp2_mixtral() -> dict[str, Any]:
    return compare_moe(hf_moe("mixtral"), "dp=2,tp=2,ep=2", 4, 1)


def ep2_dp2_zero1_qwen2_moe() -> dict[str, Any]:
    return compare_moe(hf_moe("qwen2_moe"), "dp=4,ep=2,zero=1", 8, 1)


def ep2_pp2_qwen2_moe() -> dict[str, Any]:
    return compare_moe(hf_moe("qwen2_moe"), "dp=2,pp=2,ep=2", 8, 1)


def ep2_pp2_mixtral() -> dict[str, Any]:
    return compare_moe(hf_moe("mixtral"), "dp=2,pp=2,ep=2", 8, 1)


WORLD4 = {4: [ep4_top2_e8, ep4_top1_e4_shared, ep4_mixtral],
          2: [ep2_tp2_top2_e4_shared, ep2_tp2_sp_top1_e8, ep2_dp2_zero1_top2_e8, ep2_pp2_top1_e8_shared,
              ep2_tp2_mixtral, ep2_pp2_qwen2_moe]}
TABLE_ONLY_WORLD4 = {2: [ep2_dp2_zero1_qwen2_moe, ep2_pp2_mixtral]}
"""Run by python -m benchmarks.equivalence experts (docs/execution.md's table), not by CI, whose 25 minutes they
would cost about a minute: ZeRO-1 and pipelines under EP with a Hugging Face MoE layer, which
ep2_dp2_zero1_top2_e8 with ep4_mixtral and ep2_pp2_qwen2_moe cover piece by piece."""


@pytest.fixture(scope="module")
def world4():
    return run_checks(4, [check for checks in WORLD4.values() for check in checks], timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("ep", "check"), [(ep, c) for ep, checks in WORLD4.items() for c in checks],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_four_ranks_match_one_process(world4, ep, check) -> None:
    assert_exact(world4.assert_passed(check), ep=ep)


def test_experts_split_by_ffn_under_tp_where_their_weights_allow(world4) -> None:
    """mplan's experts (separate gate and up weights) split by their FFN dim over TP; Mixtral's
    stacked [gate; up] weight would need a strided split, so its experts stay whole on each TP rank."""
    for check, strategy in ((ep2_tp2_top2_e4_shared, "ffn"), (ep2_tp2_sp_top1_e8, "ffn"),
                            (ep2_tp2_mixtral, "replicate")):
        for result in world4.assert_passed(check):
            assert result["experts_strategy"] == [strategy], (check.__name__, result)


# -- bad input: one clear error, before any collective --------------------------------------------
def _graph(spec: str):
    from mplan.ir.trace import capture_for_training
    from mplan.models import build_model

    model = build_model(spec, device="cpu", dtype=torch.float64, seed=0)
    return capture_for_training(model, (torch.zeros(2, 16, dtype=torch.long),))


def _resolve(plan: str, graph, world: int, batch: int):
    from mplan.cost_models.presets import local_cluster
    from mplan.planner.resolve import resolve_plan

    cluster = local_cluster({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    return resolve_plan(plan, graph, cluster=cluster, world_size=world, global_batch=batch)


@pytest.mark.parametrize(("model", "plan", "world", "match"), [
    (f"{MOE},experts=4,topk=2", "dp=4,ep=3", 4, r"ep=3 does not divide the dp=4 data-parallel ranks"),
    (f"{MOE},experts=6,topk=2", "dp=4,ep=4", 4, r"ep=4 does not divide the 6 experts .* \(6 % 4 = 2\)"),
    ("tiny-llama", "dp=2,ep=2", 2, r"asks for ep=2 but LlamaModel has no MoE layer"),
    ("tiny-llama", "dp=2,capacity=1.25", 2, r"asks for capacity=1.25 but LlamaModel has no MoE layer"),
    (f"{MOE},experts=4,topk=2", "dp=2,ep=2,capacity=0", 2, r"capacity must be a number > 0"),
    (f"{MOE},experts=4,topk=2", "dp=2,ep=2,capacity=-1", 2, r"capacity must be a number > 0"),
    (f"{MOE},experts=4,topk=2", "dp=2,capacity=many", 2, r"capacity must be a number > 0 .* got 'many'"),
], ids=["ep-not-dividing-dp", "ep-not-dividing-experts", "ep-on-dense", "capacity-on-dense", "capacity-zero",
        "capacity-negative", "capacity-word"])
def test_bad_expert_plans_name_the_cause(model: str, plan: str, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _resolve(plan, _graph(model), world, 4 * world)


def test_a_plan_file_with_a_bad_capacity_or_unsharded_experts_is_refused(tmp_path) -> None:
    import json

    from mplan.planner.plan import Plan, PlanError

    plan = _resolve("dp=2,ep=2", _graph(f"{MOE},experts=4,topk=2"), 2, 4)
    assert plan.mesh.ep == 2 and sum(a.get("ep") == "S(0)" for a in plan.sharding.values()) == 6
    doc = json.loads(plan.to_json())
    for broken, match in (({**doc, "capacity_factor": 0}, "capacity_factor"),
                          ({**doc, "sharding": {k: {a: p for a, p in v.items() if a != "ep"}
                                                for k, v in doc["sharding"].items()}}, "split over ep")):
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanError, match=match):
            Plan.load(str(path))
    assert Plan.from_dict(doc).capacity_factor is None
