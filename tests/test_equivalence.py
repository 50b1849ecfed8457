"""Parallel training equals one process: TP2, SP, DP2, ZeRO-1, recomputation, Hugging Face Llama (gloo, 2 ranks).

Every check trains a model with `mplan.autoparallel` for 5 AdamW steps with global-norm clipping
(active: the norm exceeds the limit) and compares the loss of every step and every parameter at
the end with the same model trained on one process, in float64: relative error under 1e-9.
Parameters are perturbed first (see `mplan.verify.perturbed`) so that none sits at
exactly 0 or 1, where a relative error would compare rounding noise with rounding noise.

Hugging Face `LlamaForCausalLM` computes RMSNorm and its loss in float32 even in a float64
model; it is checked twice: with those two upcasts made float64-faithful (< 1e-9, same graph
otherwise) and stock (float32 rounding is the bar there). Two checks run with mplan's fused
kernels (`kernels=True`, reference dispatch on the CPU). All checks share one gloo group.
`trained` captures each model (`family`'s spec, `hf_llama`'s variant) once per rank and inputs
(tests/capture_cache.py): every check still builds, parallelizes and trains its own model.
"""
from __future__ import annotations

import functools
import tempfile
import types
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from capture_cache import reused_captures
from distributed import rel_err, run_checks

STEPS = 5
TOL = 1e-9
MAX_NORM = 0.3
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


# -- models and the comparison (also used by test_equivalence_world4.py) --------------------------
def family(spec: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from mplan.models import build_model
        from mplan.verify import perturbed

        return perturbed(build_model(spec, device="cpu", dtype=torch.float64, seed=0))
    make.capture_key = ("family", spec)  # the same spec builds the same module: `trained` reuses its capture
    return make


def hf_llama(*, faithful: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        from mplan.verify import perturbed

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             use_cache=False)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).to(torch.float64)
        if faithful:
            for module in model.modules():
                if type(module).__name__ == "LlamaRMSNorm":
                    module.forward = types.MethodType(_rms_norm_float64, module)
            model.loss_function = _causal_lm_loss_float64
        return perturbed(model)
    make.capture_key = ("hf_llama", faithful)
    return make


def _rms_norm_float64(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _causal_lm_loss_float64(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **_: Any) -> torch.Tensor:
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, vocab_size), shifted.view(-1), ignore_index=-100)


def batches(global_batch: int, *, steps: int = STEPS, vocab: int = 64, seq: int = 16,
            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (global_batch, seq), generator=generator),
             torch.randint(0, vocab, (global_batch, seq), generator=generator)) for _ in range(steps)]


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def single_device(make: Callable[[], nn.Module], data: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make()
    optimizer = OPTIMIZER(model.parameters())
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        loss = loss_of(model(ids, labels=labels))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def trained(make: Callable[[], nn.Module], plan: str, data: list, **options: Any) -> tuple[Any, list, list]:
    """`make()` trained under `plan` on `data` with clipping: the ParallelModule, each step's
    loss and each step's gradient norm. A `make` with a `capture_key` (`family`, `hf_llama`) is
    captured once per process and inputs (tests/capture_cache.py)."""
    import mplan

    with reused_captures(getattr(make, "capture_key", None)):
        pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER,
                                global_batch=data[0][0].shape[0], plan=plan, max_grad_norm=MAX_NORM, **options)
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels))
        norms.append(pm.last_grad_norm)
    return pm, losses, norms


def errors(pm: Any, losses: list, norms: list, reference: tuple[list, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The largest relative errors of the losses and of any parameter against the one-process
    `reference` (its losses and final parameters), whether clipping engaged, and what ran."""
    state = pm.full_state_dict()
    ref_losses, ref_state = reference
    by_name = {name: rel_err(state[name], ref) for name, ref in ref_state.items()}
    worst = max(by_name, key=by_name.__getitem__)
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "param": by_name[worst],
            "worst": worst, "clipped": max(norms) > MAX_NORM, "ran": pm.plan.describe()}


def compare(make: Callable[[], nn.Module], plan: str, global_batch: int, **options: Any) -> dict[str, Any]:
    """Train under `plan` and on one process; the largest relative errors and what ran."""
    data = batches(global_batch, vocab=options.pop("vocab", 64))
    pm, losses, norms = trained(make, plan, data, **options)
    fused = pm.program.meta.get("fuse_kernels")
    return {**errors(pm, losses, norms, single_device(make, data)),
            "recomputed_units": len(pm.recomputed_units),
            "strategies": sorted({s.name for s in pm.choice.values()}),
            "strategy_texts": {str(s) for s in pm.choice.values()},
            "fused": dict(fused.counts) if fused is not None else {}}


def assert_equivalent(values: list[dict[str, Any]], tol: float = TOL) -> None:
    assert values, "no per-rank results (a later check failed and tore the group down)"
    for rank, result in enumerate(values):
        assert result["loss"] < tol and result["param"] < tol, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"


# -- checks (each runs on both ranks) ---------------------------------------------------------------
def tp2_gpt() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "tp=2", 4)


def tp2_sp_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "tp=2,sp=1", 4, micro_batch_size=2)


def tp2_sp_gpt() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "tp=2,sp=1", 4)


def dp2_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "dp=2", 8, micro_batch_size=2)


def dp2_zero1_gpt() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "dp=2,zero=1", 4)


def tp2_sp_llama_kernels() -> dict[str, Any]:
    return compare(family("tiny-llama"), "tp=2,sp=1", 4, micro_batch_size=2, kernels=True)


def tp2_sp_gpt_kernels() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "tp=2,sp=1", 4, kernels=True)


def tp2_sp_llama_recompute_full() -> dict[str, Any]:
    """Full recomputation re-runs each unit's forward in backward, its TP collectives included."""
    return compare(family("tiny-llama"), "tp=2,sp=1,recompute=full", 4, micro_batch_size=2, kernels=True)


def tp2_sp_gpt_recompute_selective() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "tp=2,sp=1,recompute=selective", 4, kernels=True)


def hf_tp2_sp_float64() -> dict[str, Any]:
    return compare(hf_llama(faithful=True), "tp=2,sp=1", 4)


def hf_tp2_stock() -> dict[str, Any]:
    return compare(hf_llama(faithful=False), "tp=2", 4, micro_batch_size=2)


def inference_logits() -> float:
    """pm(ids) gathers vocabulary-sharded logits; equal to the model's own forward."""
    import mplan

    make = family("tiny-llama")
    ids = batches(3, steps=1)[0][0]
    with reused_captures(make.capture_key):
        pm = mplan.autoparallel(make(), example_inputs=(ids,), global_batch=4, plan="tp=2,sp=1")
    return rel_err(pm(ids), make()(ids).detach())


def meta_model_shards() -> dict[str, Any]:
    """A meta-device model is initialized shard by shard; it equals the CPU model of that seed."""
    import mplan
    from mplan.models import build_model

    data = batches(4, steps=2)
    pm = mplan.autoparallel(build_model("tiny-llama", device="meta", dtype=torch.float64),
                            example_inputs=(data[0][0],), global_batch=4, plan="tp=2,sp=1", seed=7)
    full = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=7)
    init = max(rel_err(v, dict(full.named_parameters())[k].detach()) for k, v in pm.full_state_dict().items())
    keys_match = sorted(pm.full_state_dict()) == sorted(full.state_dict())
    return {"init": init, "keys_match": keys_match}


def resumed_difference(plan: str, *, resumed_under: str | None = None, **options: Any) -> float:
    """tiny-gpt under `plan`: save after 2 steps, load into a fresh job (built from other weights;
    under the plan `resumed_under` if given), continue; the largest difference from never
    stopping (losses and parameters)."""
    import mplan
    from mplan.models import build_model

    data = batches(4)
    build = functools.partial(mplan.autoparallel, example_inputs=(data[0][0],), optimizer=OPTIMIZER,
                              global_batch=4, plan=plan, max_grad_norm=MAX_NORM, **options)
    with reused_captures(family("tiny-gpt").capture_key):
        first = build(family("tiny-gpt")())
    for ids, labels in data[:2]:
        first.train_step(ids, labels)
    where = [tempfile.mkdtemp(prefix="mplan_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    first.save(where[0])
    second = build(build_model("tiny-gpt", device="cpu", dtype=torch.float64, seed=3),
                   **({"plan": resumed_under} if resumed_under else {}))
    second.load(where[0])
    tail_a = [first.train_step(ids, labels) for ids, labels in data[2:]]
    tail_b = [second.train_step(ids, labels) for ids, labels in data[2:]]
    a, b = first.full_state_dict(), second.full_state_dict()
    return max([abs(x - y) for x, y in zip(tail_a, tail_b)] + [rel_err(b[k], a[k]) for k in a])


def checkpoint_round_trip() -> float:
    """save, load into a fresh job and continue: under the same plan bit-identical to never
    stopping; under another ZeRO level (0 -> 1: the optimizer state resharded over DP) equal
    within float64 rounding (the gradients are reduced in another order)."""
    return {"same plan": resumed_difference("tp=2,sp=1,zero=0"),
            "zero 0 -> 1": resumed_difference("tp=2,sp=1,zero=0", resumed_under="tp=2,sp=1,zero=1")}


def local_rows() -> float:
    """train_step(local=True) with each replica's own rows equals the global-batch call."""
    import mplan

    data = batches(4, steps=2)
    rank = dist.get_rank()
    make = family("tiny-llama")
    kwargs = dict(optimizer=OPTIMIZER, global_batch=4, plan="dp=2", max_grad_norm=MAX_NORM)
    with reused_captures(make.capture_key):
        whole = mplan.autoparallel(make(), example_inputs=(data[0][0],), **kwargs)
        mine = mplan.autoparallel(make(), example_inputs=(data[0][0],), **kwargs)
    a = [whole.train_step(x, y) for x, y in data]
    b = [mine.train_step(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], local=True) for x, y in data]
    return max(abs(x - y) for x, y in zip(a, b))


def bf16_runs() -> list[float]:
    """bf16 parameters (ZeRO-1 keeps fp32 masters), and fp32 parameters under bf16 autocast, train;
    losses stay within bf16 rounding of the float64 run."""
    import mplan

    data = batches(4, steps=3)
    ref_losses, _ = single_device(family("tiny-llama"), data)
    out = []
    for options in ({"dtype": torch.bfloat16, "plan": "dp=2,zero=1"},
                    {"dtype": torch.float32, "autocast": True, "plan": "tp=2,sp=1"}):
        with reused_captures(family("tiny-llama").capture_key):
            pm = mplan.autoparallel(family("tiny-llama")(), example_inputs=(data[0][0],), optimizer=OPTIMIZER,
                                    global_batch=4, max_grad_norm=MAX_NORM, **options)
        losses = [pm.train_step(x, y) for x, y in data]
        out.append(max(abs(a - b) / b for a, b in zip(losses, ref_losses)))
    return out


def ranks_disagree() -> str:
    """Rank 1 asks for ZeRO-1, rank 0 not: both fail at the plan-hash check, naming the ranks."""
    import mplan
    from mplan.runtime.parallel_module import PlanMismatch

    ids = batches(4, steps=1)[0][0]
    plan = "dp=2,zero=1" if dist.get_rank() == 1 else "dp=2"
    with pytest.raises(PlanMismatch) as caught:
        mplan.autoparallel(family("tiny-gpt")(), example_inputs=(ids,), global_batch=4, plan=plan)
    return str(caught.value)


CHECKS = [tp2_gpt, tp2_sp_llama, tp2_sp_gpt, dp2_llama, dp2_zero1_gpt,
          tp2_sp_llama_kernels, tp2_sp_gpt_kernels, tp2_sp_llama_recompute_full, tp2_sp_gpt_recompute_selective,
          hf_tp2_sp_float64, hf_tp2_stock, inference_logits,
          meta_model_shards, checkpoint_round_trip, local_rows, bf16_runs, ranks_disagree]
EQUIVALENCE = [tp2_gpt, tp2_sp_llama, tp2_sp_gpt, dp2_llama, dp2_zero1_gpt,
               tp2_sp_llama_kernels, tp2_sp_gpt_kernels, tp2_sp_llama_recompute_full, tp2_sp_gpt_recompute_selective,
               hf_tp2_sp_float64]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(2, CHECKS, timeout_s=240)


@pytest.mark.parametrize("check", EQUIVALENCE, ids=lambda c: c.__name__)
def test_matches_one_process(outcomes, check) -> None:
    assert_equivalent(outcomes.assert_passed(check))


def test_recomputation_ran_under_tp(outcomes) -> None:
    """Prologue, both blocks and the epilogue ran as checkpointed units (their equivalence is above)."""
    for check, mode in ((tp2_sp_llama_recompute_full, "full"), (tp2_sp_gpt_recompute_selective, "selective")):
        for result in outcomes.assert_passed(check):
            assert f"recompute={mode}" in result["ran"] and result["recomputed_units"] == 4, result


def test_fused_kernels_are_exact_under_tp(outcomes) -> None:
    """fuse_kernels on TP programs (reference dispatch): the rules fire on local shards (the
    local q/k/v column shards, all reading the gathered sequence, become one GEMM), and the run
    matches one process as closely as the unfused one does."""
    # the loss is vocabulary-parallel there: a module, which with the output head before it runs
    # as one chunked op (the head's GEMM and the vocabulary-parallel loss)
    expected = {tp2_sp_llama_kernels: (tp2_sp_llama, {"rms_norm": 1, "linear_group": 2, "rms_norm_residual": 4,
                                                      "rope_qk": 2, "attention": 2, "linear_swiglu": 2,
                                                      "vocab_parallel_linear_cross_entropy": 1}),
                tp2_sp_gpt_kernels: (tp2_sp_gpt, {"linear_group": 2, "layer_norm_residual": 4, "attention": 2, "bias_gelu": 2,
                                                  "vocab_parallel_linear_cross_entropy": 1})}
    for check, (unfused, fired) in expected.items():
        for a, b in zip(outcomes.assert_passed(check), outcomes.assert_passed(unfused)):
            assert a["fused"] == fired
            assert a["loss"] <= 2 * b["loss"] + 1e-15 and a["param"] <= 2 * b["param"] + 1e-15, (a, b)


def test_hugging_face_stock_matches_to_float32(outcomes) -> None:
    # HF's float32 RMSNorm and loss round differently once the vocabulary is split over ranks
    assert_equivalent(outcomes.assert_passed(hf_tp2_stock), tol=1e-5)


def test_inference_gathers_logits(outcomes) -> None:
    assert max(outcomes.assert_passed(inference_logits)) < 1e-12


def test_meta_model_initialized_per_shard(outcomes) -> None:
    for result in outcomes.assert_passed(meta_model_shards):
        assert result["init"] == 0.0 and result["keys_match"], result


def test_checkpoint_round_trip(outcomes) -> None:
    for result in outcomes.assert_passed(checkpoint_round_trip):
        assert result["same plan"] == 0.0 and result["zero 0 -> 1"] < TOL, result


def test_local_rows(outcomes) -> None:
    assert max(outcomes.assert_passed(local_rows)) == 0.0


def test_bf16_parameters_and_autocast_train(outcomes) -> None:
    assert max(max(v) for v in outcomes.assert_passed(bf16_runs)) < 2e-2  # bf16 rounding


def test_ranks_with_different_plans_fail_fast(outcomes) -> None:
    for message in outcomes.assert_passed(ranks_disagree):
        assert "ranks [0]" in message and "ranks [1]" in message, message
