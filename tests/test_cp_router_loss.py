"""A MoE router's load-balancing loss under context parallelism (issue 34) is the single-device
loss exactly, and a reduction over the tokens that cp cannot make exact is refused in one line.

The load-balancing loss (Switch Transformer) is aux = E * sum_e f_e P_e, with f_e expert e's share
of the routed choices and P_e its mean router probability, both over every token of the
micro-batch; the model's loss is ce + coef * aux. A cp rank holds S/cp of each sequence's tokens,
so its means are partial: `passes/split_context` finds them by dataflow (`ir.token_statistics`)
and all-reduces each over the cp group (backward: all-reduce of the gradient), every rank adding
the whole term to its cross-entropy share.

Checked as tests/test_cp_moe.py checks the models without their router loss: 3 AdamW steps with
active clipping, every loss and every final parameter against one process trained on the plan's
micro-batches, float64, relative error under 1e-9, on Hugging Face Mixtral and Qwen2-MoE
(router_aux_loss_coef 0.1) at cp=2, and on 4 ranks at dp=2 x cp=2, dp=2 x cp=2 x ep=2 and
pp=2 x cp=2 (the aux term computed on the last stage), and mplan's
MoE family (its aux a mean over the tokens) at cp=2. transformers accumulates the loss's sums
in float32; the checks at 1e-9 give the models the same function in float64
(`float64_router_loss`), as test_expert_parallel makes their router softmax float64. transformers'
own float32 function runs too: its parameters within 1e-9, its losses within float32's rounding
of the aux term. The aux term matters: without it the parameters after 3 steps differ by far more
than 1e-9 (`test_the_router_loss_moves_the_parameters`), and left partial on each rank (the
all-reduce skipped) the same checks fail (`test_partial_statistics_fail_the_check`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import rel_err, run_checks
from test_cp_moe import without_router_loss
from test_equivalence import TOL, batches, errors, family, trained
from test_expert_parallel import MOE, accumulated, hf_moe

STEPS = 3
FLOAT32_AUX_TOL = 1e-7  # transformers' float32 sums: coef * aux * 2**-23 relative to a loss near 4


# -- the models ---------------------------------------------------------------------------------------
def _load_balancing_float64(gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
                            attention_mask: torch.Tensor | None = None) -> Any:
    """The Switch Transformer load-balancing loss as transformers 5 states it (each layer's choices
    counted by histc, its router probabilities summed over the rows, both accumulated over the
    layers and divided by the rows they cover), in the logits' dtype rather than float32."""
    if not isinstance(gate_logits, tuple):
        return 0
    assert attention_mask is None, "plain causal training passes no attention mask"
    counts = probabilities = 0
    rows = 0
    for logits in gate_logits:
        weights = logits.softmax(dim=-1)
        choices = weights.topk(top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.histc(choices.to(weights.dtype), bins=num_experts, min=0, max=num_experts)
        probabilities = probabilities + weights.sum(dim=0)
        rows += weights.shape[0]
    return num_experts * ((counts / rows) * (probabilities / rows)).sum()


@contextlib.contextmanager
def float64_router_loss() -> Iterator[None]:
    """Mixtral's and Qwen2-MoE's load-balancing loss computed in float64 while it is open."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    with mock.patch.object(modeling_mixtral, "load_balancing_loss_func", _load_balancing_float64), \
            mock.patch.object(modeling_qwen2_moe, "load_balancing_loss_func", _load_balancing_float64):
        yield


def float64_aux(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`make`, captured apart from it (its graph computes the aux term in float64)."""
    def build() -> nn.Module:
        return make()
    build.capture_key = (*make.capture_key, "float64 router loss")  # type: ignore[attr-defined]
    return build


def _compare(make: Callable[[], nn.Module], plan: str, global_batch: int, *, float64: bool = True) -> dict[str, Any]:
    data = batches(global_batch, steps=STEPS)
    with float64_router_loss() if float64 else contextlib.nullcontext():
        model = float64_aux(make) if float64 else make
        pm, losses, norms = trained(model, plan, data, micro_batch_size=1)
        reference = accumulated(model, data, 1)
    kinds = [type(m).__name__ for m in pm.program.modules()]
    return {**errors(pm, losses, norms, reference), "cp": pm.plan.mesh.cp, "dp": pm.plan.mesh.dp,
            "ep": pm.plan.mesh.ep, "statistics": kinds.count("ContextStatistic")}


# -- world 2: cp=2 ------------------------------------------------------------------------------------
def cp2_mixtral() -> dict[str, Any]:
    return _compare(hf_moe("mixtral"), "cp=2", 2)


def cp2_qwen2_moe() -> dict[str, Any]:
    return _compare(hf_moe("qwen2_moe"), "cp=2", 2)


def cp2_mplan_moe() -> dict[str, Any]:
    return _compare(family(f"{MOE},experts=4,topk=2"), "cp=2", 2, float64=False)


def cp2_mixtral_transformers_float32_aux() -> dict[str, Any]:
    return _compare(hf_moe("mixtral"), "cp=2", 2, float64=False)


def cp2_mixtral_partial() -> dict[str, Any]:
    """The statistics left partial: `ContextStatistic` skips its all-reduce, each rank taking its
    own tokens' sums as the micro-batch's (times cp, for the count the pass scaled): every rank's
    means are then over its S/cp tokens alone."""
    from mplan.passes.split_context import ContextStatistic

    with mock.patch.object(ContextStatistic, "forward", lambda self, x: x if self.mean else x * self.axis.size):
        return _compare(hf_moe("mixtral"), "cp=2", 2)


WORLD2 = [cp2_mixtral, cp2_qwen2_moe, cp2_mplan_moe, cp2_mixtral_transformers_float32_aux, cp2_mixtral_partial]


@pytest.fixture(scope="module")
def world2() -> Any:
    return run_checks(2, WORLD2, timeout_s=600)


# -- world 4: dp=2 x cp=2, with ep=2 ------------------------------------------------------------------
def dp2_cp2_mixtral() -> dict[str, Any]:
    return _compare(hf_moe("mixtral"), "dp=2,cp=2", 4)


def dp2_cp2_ep2_qwen2_moe() -> dict[str, Any]:
    return _compare(hf_moe("qwen2_moe"), "dp=2,cp=2,ep=2", 4)


def pp2_cp2_mixtral() -> dict[str, Any]:
    return _compare(hf_moe("mixtral"), "pp=2,cp=2", 4)


WORLD4 = [dp2_cp2_mixtral, dp2_cp2_ep2_qwen2_moe, pp2_cp2_mixtral]


@pytest.fixture(scope="module")
def world4() -> Any:
    return run_checks(4, WORLD4, timeout_s=600)


def _assert_exact(values: list[dict[str, Any]], mesh: tuple[int, int, int], statistics: int) -> None:
    assert values, "no per-rank results"
    for rank, result in enumerate(values):
        assert (result["dp"], result["cp"], result["ep"]) == mesh, result
        # the statistics made whole: Hugging Face's two sums (choices, probabilities) accumulated
        # over the layers, or the family's two means per layer
        assert result["statistics"] == statistics, result
        assert result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"


@pytest.mark.parametrize("check,statistics", [(cp2_mixtral, 2), (cp2_qwen2_moe, 2), (cp2_mplan_moe, 4)],
                         ids=lambda c: getattr(c, "__name__", str(c)))
def test_cp2_trains_moe_models_with_their_router_loss_exactly(world2: Any, check: Any, statistics: int) -> None:
    _assert_exact(world2.assert_passed(check), (1, 2, 1), statistics)


@pytest.mark.parametrize("check,mesh", [(dp2_cp2_mixtral, (2, 2, 1)), (dp2_cp2_ep2_qwen2_moe, (2, 2, 2)),
                                        (pp2_cp2_mixtral, (1, 2, 1))], ids=lambda c: getattr(c, "__name__", str(c)))
def test_cp2_with_dp_ep_or_pp_trains_exactly(world4: Any, check: Any, mesh: tuple[int, int, int]) -> None:
    _assert_exact(world4.assert_passed(check), mesh, 2)


def test_transformers_float32_router_loss_is_exact_but_for_its_own_rounding(world2: Any) -> None:
    for result in world2.assert_passed(cp2_mixtral_transformers_float32_aux):
        assert result["param"] < TOL and result["loss"] < FLOAT32_AUX_TOL and result["statistics"] == 2, result


def test_partial_statistics_fail_the_check(world2: Any) -> None:
    """The negative control: each rank's means over its own S/cp tokens."""
    for result in world2.assert_passed(cp2_mixtral_partial):
        assert result["statistics"] == 2, result
        assert result["loss"] > 1e3 * TOL and result["param"] > 1e3 * TOL, result


def test_the_router_loss_moves_the_parameters() -> None:
    """Without its router loss the same training ends far from the single-device model with it:
    a wrong aux term could not hide under 1e-9."""
    data = batches(2, steps=STEPS)
    make = hf_moe("mixtral")
    with float64_router_loss():
        _, with_aux = accumulated(make, data, 1)
    _, without = accumulated(without_router_loss(make), data, 1)
    router = [name for name in with_aux if name.endswith("mlp.gate.weight")]
    assert router, sorted(with_aux)
    assert min(rel_err(without[name], with_aux[name]) for name in router) > 1e-4


# -- what is refused: one process, exported toy losses -------------------------------------------------
class _ToyMoE(nn.Module):
    """Two router layers over embedded tokens and a cross-entropy; `extra` adds the loss's other
    term from the routers' logits ([B * S, E] each) and the attention mask."""

    def __init__(self, extra: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.routers = nn.ModuleList(nn.Linear(8, 4, bias=False) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.extra = extra

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        logits = tuple(router(x).reshape(-1, 4) for router in self.routers)
        loss = F.cross_entropy(self.head(x).reshape(-1, 16), labels.reshape(-1))
        return self.extra(loss, logits, attention_mask)


def _statistics(extra: Callable[..., torch.Tensor]) -> Any:
    from mplan.ir.token_statistics import token_statistics

    ids = torch.randint(0, 16, (2, 8))
    program = torch.export.export(_ToyMoE(extra), (ids, ids, torch.ones(2, 8)), strict=False)
    graph = program.graph
    loss = next(n for n in graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)
    tokens = [n for n in graph.nodes if n.op == "placeholder" and n.name in ("input_ids", "labels", "attention_mask")]
    return token_statistics(graph, loss=loss, tokens=tokens, cp=2)


def _refusal(extra: Callable[..., torch.Tensor]) -> str:
    from mplan.ir.sharding import UnexecutableStrategy

    with pytest.raises(UnexecutableStrategy) as caught:
        _statistics(extra)
    message = str(caught.value)
    assert "\n" not in message and "cp=2" in message, message
    return message


def test_the_attention_mask_path_of_transformers_load_balancing_loss_is_made_exact() -> None:
    """With an attention mask transformers weighs every sum by the mask and divides by the mask's
    sum: three partial sums whose ratios are taken, each all-reduced."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    found = _statistics(lambda loss, logits, mask: loss + 0.1 * load_balancing_loss_func(logits, 4, 2, mask))
    assert (len(found.means), len(found.sums), len(found.counts)) == (0, 3, 0), found


def test_plain_transformers_load_balancing_loss_is_two_sums_over_their_count() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    found = _statistics(lambda loss, logits, mask: loss + 0.1 * load_balancing_loss_func(logits, 4, 2))
    assert (len(found.means), len(found.sums), len(found.counts)) == (0, 2, 2), found
    assert _statistics(lambda loss, logits, mask: loss).means == ()  # the cross-entropy alone: nothing


def _means_of_concatenated_layers(loss: torch.Tensor, logits: tuple, mask: torch.Tensor) -> torch.Tensor:
    """The same loss written as transformers 4 did: the layers' logits concatenated along the rows,
    the choices one-hot, both shares a mean over dim 0."""
    weights = torch.cat(logits, dim=0).softmax(dim=-1)
    chosen = F.one_hot(weights.topk(2, dim=-1).indices, 4).to(weights.dtype)
    return loss + 0.1 * 4 * (chosen.mean(dim=0) * weights.mean(dim=0).unsqueeze(0)).sum()


def test_means_over_concatenated_layers_are_made_exact() -> None:
    found = _statistics(_means_of_concatenated_layers)
    assert (len(found.means), len(found.sums), len(found.counts)) == (2, 0, 0), found


def test_a_max_over_the_tokens_is_refused_naming_the_op() -> None:
    message = _refusal(lambda loss, logits, mask: loss + logits[0].amax(dim=0).sum())
    assert "aten.amax" in message and "token means" in message, message


def test_a_token_sum_not_divided_by_its_count_is_refused() -> None:
    message = _refusal(lambda loss, logits, mask: loss + 0.01 * logits[0].softmax(-1).sum(dim=0).square().sum())
    assert "the sum over the tokens of node sum" in message and "aten.sum.dim_IntList" in message, message


def test_a_loss_not_linear_in_its_cross_entropy_is_refused() -> None:
    message = _refusal(lambda loss, logits, mask: loss * loss + logits[0].softmax(-1).mean())
    assert "other than linearly" in message, message
