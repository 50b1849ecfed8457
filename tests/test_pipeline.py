"""Pipeline plans train exactly as one process does, under every schedule and with TP, SP, DP
and ZeRO-1 around them; the executor runs the IR's action lists and nothing else.

Each equivalence check trains 5 AdamW steps with active global-norm clipping in float64 and
compares every step's loss and every final parameter (by every name, tied ones included) with
the plain one-process loop: relative error under 1e-9. One gloo group per world size (2, 4 and
8 ranks) runs all of that size's checks.

Beyond equivalence, on the same ranks:
- the actions each rank executed, recorded at run time, are the IR's list for that rank;
- the micro-batches whose activations are alive at once per stage, measured with saved-tensor
  hooks (a saved tensor counts until autograd frees it), equal `max_in_flight_per_stage`, what
  the memory model assumes, for every schedule;
- `pm(ids)`, `pm.full_state_dict()` and a checkpoint round trip work under a pipeline plan;
- a tied embedding and output head on different pipeline ranks stay one parameter.
Each model is captured once per rank and inputs (tests/capture_cache.py).
"""
from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from capture_cache import reused_captures
from distributed import run_checks
from test_equivalence import (OPTIMIZER, assert_equivalent, batches, compare, family, hf_llama, rel_err,
                              resumed_difference)

LLAMA3 = "llama:layers=3,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64"
LLAMA5 = "llama:layers=5,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64"
LLAMA7 = "llama:layers=7,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64,tie=1"
GPT2_TIED = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,tie=1"  # the head reads the embedding
GPT4 = "gpt:layers=4,hidden=32,heads=4,seq=16,vocab=64,tie=1"


def hf_mistral() -> torch.nn.Module:
    """Hugging Face's Mistral from a small config (sliding window and all), float64 throughout."""
    import types

    from transformers import MistralConfig, MistralForCausalLM

    from mplan.verify import perturbed
    from test_equivalence import _causal_lm_loss_float64, _rms_norm_float64

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           sliding_window=8, use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MistralForCausalLM(config).to(torch.float64)
    for module in model.modules():
        if type(module).__name__ == "MistralRMSNorm":
            module.forward = types.MethodType(_rms_norm_float64, module)
    model.loss_function = _causal_lm_loss_float64
    return perturbed(model)


hf_mistral.capture_key = "hf_mistral"  # test_equivalence.trained captures it once per rank


# -- world 2 ------------------------------------------------------------------------------------
def pp2_gpipe_gpt() -> dict[str, Any]:  # tied embedding and head on different ranks
    return compare(family(GPT2_TIED), "pp=2,schedule=gpipe", 4, micro_batch_size=1)


def pp2_1f1b_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "pp=2,schedule=1f1b", 4, micro_batch_size=1)


def pp2_interleaved_vpp2_gpt() -> dict[str, Any]:
    return compare(family(GPT4), "pp=2,vpp=2,schedule=interleaved", 4, micro_batch_size=1)


def pp2_zb_h1_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "pp=2,schedule=zb-h1", 4, micro_batch_size=1)


def pp2_uneven_llama5() -> dict[str, Any]:  # 7 units (embedding, 5 layers, head) on 2 stages
    return compare(family(LLAMA5), "pp=2", 4, micro_batch_size=2)


def pp2_recompute_selective_gpt() -> dict[str, Any]:
    return compare(family("tiny-gpt"), "pp=2,recompute=selective", 4, micro_batch_size=1)


def pp2_fused_kernels_llama3() -> dict[str, Any]:
    # a residual add fused with the next block's norm may straddle the border; it runs where it ended
    return compare(family(LLAMA3), "pp=2", 4, micro_batch_size=1, kernels=True)


def pp2_hf_llama() -> dict[str, Any]:
    return compare(hf_llama(faithful=True), "pp=2", 4, micro_batch_size=1)


def pp2_hf_mistral() -> dict[str, Any]:
    return compare(hf_mistral, "pp=2,schedule=gpipe", 4, micro_batch_size=1)


SCHEDULES = {"gpipe": "pp=2,schedule=gpipe", "1f1b": "pp=2,schedule=1f1b", "zb-h1": "pp=2,schedule=zb-h1",
             "interleaved": "pp=2,vpp=2,schedule=interleaved"}


def executed_as_listed() -> dict[str, Any]:
    """Per schedule: did this rank execute exactly its IR list, and how many micro-batches did each
    of its stages hold at once (measured), against `max_in_flight_per_stage`."""
    import mplan
    from mplan.ir.schedule import max_in_flight_per_stage

    data = batches(8, steps=1)
    out = {}
    for name, plan in SCHEDULES.items():
        with reused_captures(family(GPT4).capture_key):  # one capture for the four schedules
            pm = mplan.autoparallel(family(GPT4)(), example_inputs=(data[0][0],), optimizer=OPTIMIZER,
                                    global_batch=8, plan=plan, micro_batch_size=2)
        executor = pm.executor
        executor.record = True
        measured = _measure_in_flight(pm, *data[0])
        schedule = pm.pipeline.schedule
        expected = max_in_flight_per_stage(schedule)
        out[name] = {"same_order": executor.executed == list(schedule.actions[pm.groups.pp_rank]),
                     "measured": {s: measured.get(s, 0) for s in pm.pipeline.mine},
                     "expected": {s: expected[s] for s in pm.pipeline.mine}}
    return out


def _measure_in_flight(pm: Any, ids: torch.Tensor, labels: torch.Tensor) -> dict[int, int]:
    """Train one step; after every action, the (stage, micro-batch) pairs that still have a tensor
    saved for backward alive; the most per stage."""
    live: dict[tuple[int, int], int] = {}
    most: dict[int, int] = {}

    class Saved:  # what autograd keeps in place of a saved tensor: freed with the micro-batch's graph
        def __init__(self, tensor: torch.Tensor, key: tuple[int, int]) -> None:
            self.tensor = tensor
            live[key] = live.get(key, 0) + 1
            weakref.finalize(self, lambda: live.__setitem__(key, live[key] - 1))

    def pack(tensor: torch.Tensor) -> Saved:
        action = pm.executor.executed[-1]
        return Saved(tensor.detach(), (action.stage, action.microbatch))  # no cycle through its grad_fn

    def sample(handler: Any) -> Any:
        def run(action: Any) -> None:
            handler(action)
            for stage in {s for (s, _), n in live.items() if n}:
                most[stage] = max(most.get(stage, 0), sum(1 for (s, _), n in live.items() if s == stage and n))
        return run

    executor = pm.executor
    executor.handlers = {kind: sample(handler) for kind, handler in executor.handlers.items()}
    executor.executed.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        pm.train_step(ids, labels)
    return most


def inference_and_state() -> dict[str, float]:
    """pm(ids) returns the model's logits on every rank; full_state_dict has every name."""
    import mplan

    make = family("tiny-gpt")
    ids = batches(3, steps=1)[0][0]
    with reused_captures(make.capture_key):
        pm = mplan.autoparallel(make(), example_inputs=(ids,), global_batch=4, plan="pp=2", micro_batch_size=2)
    state = pm.full_state_dict()
    reference = make()
    return {"logits": rel_err(pm(ids), reference(ids).detach()),
            "state": max(rel_err(state[k], v.detach()) for k, v in reference.state_dict().items()),
            "names": float(sorted(state) == sorted(dict(reference.named_parameters(remove_duplicate=False))))}


def checkpoint_under_pipeline() -> float:
    """save after 2 steps, load into a fresh job, continue: identical to never stopping."""
    return resumed_difference("pp=2", micro_batch_size=1)


def tied_copies() -> dict[str, Any]:
    """The tied GPT's head reads the embedding: both pipeline ranks hold it, rank 0 owns it."""
    import mplan

    ids = batches(4, steps=1)[0][0]
    with reused_captures(family(GPT2_TIED).capture_key):
        pm = mplan.autoparallel(family(GPT2_TIED)(), example_inputs=(ids,), global_batch=4, plan="pp=2")
    copies = pm.pipeline.copies
    return {"shared": sorted(copies.groups), "owned": sorted(copies.owned), "held": sorted(pm.params)}


WORLD2 = [pp2_gpipe_gpt, pp2_1f1b_llama, pp2_interleaved_vpp2_gpt, pp2_zb_h1_llama, pp2_uneven_llama5,
          pp2_recompute_selective_gpt, pp2_fused_kernels_llama3, pp2_hf_llama, pp2_hf_mistral]
WORLD2_OTHER = [executed_as_listed, inference_and_state, checkpoint_under_pipeline, tied_copies]


# -- world 4 ------------------------------------------------------------------------------------
def pp4_gpipe_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "pp=4,schedule=gpipe", 8, micro_batch_size=1)


def pp4_1f1b_gpt() -> dict[str, Any]:  # the embedding on rank 0, the head that reads it on rank 3
    return compare(family(GPT2_TIED), "pp=4,schedule=1f1b", 8, micro_batch_size=1)


def pp4_uneven_llama7() -> dict[str, Any]:  # 9 units on 4 stages, tied
    return compare(family(LLAMA7), "pp=4", 8, micro_batch_size=2)


def tp2_pp2_sp_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "tp=2,pp=2,sp=1", 4, micro_batch_size=1)


def pp2_dp2_zero1_gpt() -> dict[str, Any]:
    return compare(family(GPT2_TIED), "pp=2,dp=2,zero=1", 8, micro_batch_size=1)


def tp2_pp2_hf_llama() -> dict[str, Any]:
    return compare(hf_llama(faithful=True), "tp=2,pp=2,schedule=zb-h1", 4, micro_batch_size=1)


WORLD4 = [pp4_gpipe_llama, pp4_1f1b_gpt, pp4_uneven_llama7, tp2_pp2_sp_llama, pp2_dp2_zero1_gpt, tp2_pp2_hf_llama]


# -- world 8 ------------------------------------------------------------------------------------
def tp2_pp2_dp2_sp_llama() -> dict[str, Any]:
    return compare(family("tiny-llama"), "tp=2,pp=2,dp=2,sp=1,zero=1", 8, micro_batch_size=1)


WORLD8 = [tp2_pp2_dp2_sp_llama]


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, WORLD2 + WORLD2_OTHER, timeout_s=600)


@pytest.fixture(scope="module")
def world4():
    return run_checks(4, WORLD4, timeout_s=600)


@pytest.fixture(scope="module")
def world8():
    return run_checks(8, WORLD8, timeout_s=600)


@pytest.mark.parametrize("check", WORLD2, ids=lambda c: c.__name__)
def test_two_ranks_match_one_process(world2, check) -> None:
    results = world2.assert_passed(check)
    assert_equivalent(results)
    assert "pp=2" in results[0]["ran"]


@pytest.mark.parametrize("check", WORLD4, ids=lambda c: c.__name__)
def test_four_ranks_match_one_process(world4, check) -> None:
    assert_equivalent(world4.assert_passed(check))


@pytest.mark.parametrize("check", WORLD8, ids=lambda c: c.__name__)
def test_eight_ranks_match_one_process(world8, check) -> None:
    results = world8.assert_passed(check)
    assert_equivalent(results)
    assert "dp=2,tp=2,pp=2" in results[0]["ran"] and "sp=1,zero=1" in results[0]["ran"]


def test_fused_kernels_run_inside_the_stages(world2) -> None:
    fired = world2.assert_passed(pp2_fused_kernels_llama3)[0]["fused"]
    assert fired["rms_norm_residual"] == 6 and fired["rope_qk"] == 3, fired


def test_uneven_stages_hold_what_the_plan_cut(world2, world4) -> None:
    assert "micro_batches=2" in world2.assert_passed(pp2_uneven_llama5)[0]["ran"]
    assert "pp=4" in world4.assert_passed(pp4_uneven_llama7)[0]["ran"]


def test_the_executor_runs_the_ir_lists_and_holds_what_the_memory_model_counts(world2) -> None:
    for rank, per_schedule in enumerate(world2.assert_passed(executed_as_listed)):
        for name, row in per_schedule.items():
            assert row["same_order"], (rank, name)
            assert row["measured"] == row["expected"], (rank, name, row)


def test_inference_and_full_state_dict_under_a_pipeline(world2) -> None:
    for row in world2.assert_passed(inference_and_state):
        assert row["logits"] < 1e-12 and row["state"] == 0.0 and row["names"] == 1.0, row


def test_checkpoint_round_trip_under_a_pipeline(world2) -> None:
    assert max(world2.assert_passed(checkpoint_under_pipeline)) == 0.0


def test_a_tied_head_on_another_rank_is_one_parameter(world2) -> None:
    rank0, rank1 = world2.assert_passed(tied_copies)
    assert rank0["shared"] == rank1["shared"] == ["embed.weight"], (rank0, rank1)
    assert rank0["owned"] == ["embed.weight"] and rank1["owned"] == []
    assert "embed.weight" in rank0["held"] and "embed.weight" in rank1["held"]
    assert set(rank0["held"]) & set(rank1["held"]) == {"embed.weight"}, "only the tied weight is held twice"
