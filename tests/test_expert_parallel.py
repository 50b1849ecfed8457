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
from test_equivalence import MAX_NORM, OPTIMIZER, TOL, batches, family, loss_of

STEPS = 5
MOE = "moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,aux=0.1"


def moe(experts: int, topk: int, shared: int = 0, capacity: str = "none") -> Callable[[], nn.Module]:
    return family(f"{MOE},experts={experts},topk={topk},shared={shared},capacity={capacity}")


# -- Hugging Face models, float64-faithful ------------------------------------------------------
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
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_float64, module)
            elif name.endswith("TopKRouter"):
                module.forward = types.MethodType(_router_float64, module)
        model.loss_function = _lm_loss_float64
        return perturbed(model)
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


def compare_moe(make: Callable[[], nn.Module], plan: str, global_batch: int, micro_batch: int,
                **options: Any) -> dict[str, Any]:
    import mplan

    data = batches(global_batch)
    pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=global_batch,
                            plan=plan, micro_batch_size=micro_batch, max_grad_norm=MAX_NORM, **options)
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels))
        norms.append(pm.last_grad_norm)
    state = pm.full_state_dict()
    ref_losses, ref_state = accumulated(make, data, micro_batch)
    errors = {name: rel_err(state[name], ref) for name, ref in ref_state.items()}
    worst = max(errors, key=errors.__getitem__)
    experts = [m for m in pm.program.modules() if type(m).__name__ == "RoutedExperts"]
    if pm.pipeline is not None:
        experts = [m for s in pm.pipeline.mine for m in pm.pipeline.stages[s].module.modules()
                   if type(m).__name__ == "RoutedExperts"]
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "param": errors[worst],
            "worst": worst, "clipped": max(norms) > MAX_NORM, "ran": pm.plan.describe(),
            "ep": [m.ep.size for m in experts], "expert_params": sorted(pm.experts.parameters)[:2]}


def assert_exact(values: list[dict[str, Any]], ep: int) -> None:
    assert values, "no per-rank results (a later check failed and tore the group down)"
    for rank, result in enumerate(values):
        assert result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
        assert result["ep"] and set(result["ep"]) == {ep}, f"rank {rank}: experts ran at ep {result['ep']}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"


# -- world of 2 -----------------------------------------------------------------------------------
def ep2_top2_e4() -> dict[str, Any]:
    return compare_moe(moe(4, 2), "dp=2,ep=2", 4, 1)


def ep2_top1_e8_shared() -> dict[str, Any]:
    return compare_moe(moe(8, 1, shared=40), "dp=2,ep=2", 4, 2)


def ep2_mixtral() -> dict[str, Any]:
    return compare_moe(hf_moe("mixtral"), "dp=2,ep=2", 4, 1)


def ep2_qwen2_moe() -> dict[str, Any]:
    return compare_moe(hf_moe("qwen2_moe"), "dp=2,ep=2", 4, 2)


WORLD2 = [ep2_top2_e4, ep2_top1_e8_shared, ep2_mixtral, ep2_qwen2_moe]


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, WORLD2)


@pytest.mark.parametrize("check", WORLD2, ids=lambda c: c.__name__)
def test_two_ranks_match_one_process(world2, check) -> None:
    assert_exact(world2.assert_passed(check), ep=2)
