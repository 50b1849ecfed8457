"""A checkpoint outlives its plan: saved under one plan, loaded under others and other world
sizes, training continues as if never stopped (gloo ranks, float64).

The model is a small MoE (4 layers, 4 experts, top-2, no capacity limit, no load-balancing loss,
so every plan computes the single-device function: a per-micro-batch auxiliary loss would
change with the micro-batching). Reference: one process, 6 AdamW steps, never stopped.

    8 ranks  dp=2,tp=2,pp=2,ep=2,zero=1 trains 3 steps and saves   -> src8
             the same plan resumes from src8 (Megatron's resume test: bit-identical)
             dp=8 (zero=0, no EP), pp=2 interleaved over 4 stages, dp=4,tp=2,ep=4 load src8 and train steps 4-6
    2 ranks  tp=2 and pp=2,zero=1 load src8 (8 -> 2); dp=2,zero=1 trains 3 steps, saves -> src2;
             a background save overlapped with 2 more steps writes what a blocking one does
    1 proc   loads src8 (8 -> 1)
    4 ranks  plan=None (the planner chooses for the larger world) loads src2 (2 -> 4)

A rank killed (SIGKILL) in the middle of a save leaves the previous checkpoint whole: a new job
resumes from it and matches the reference.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any

import pytest
import torch

from distributed import RankFailed, rel_err, run_ranks

MODEL = "moe:layers=4,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,aux=0,experts=4,topk=2,capacity=none"
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
STEPS, SAVED_AT, GLOBAL_BATCH = 6, 3, 8
TOL = 1e-9
SOURCE = "dp=2,tp=2,pp=2,ep=2,zero=1"
OTHERS_8 = ("dp=8,zero=0", "dp=4,pp=2,vpp=2,schedule=interleaved", "dp=4,tp=2,ep=4,zero=1")
OTHERS_2 = ("tp=2", "pp=2,zero=1")


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g), torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g))
            for _ in range(STEPS)]


def build(plan: str | None) -> Any:
    import mplan
    from mplan.models import build_model
    from mplan.verify import perturbed

    model = perturbed(build_model(MODEL, device="cpu", dtype=torch.float64, seed=0))
    return mplan.autoparallel(model, example_inputs=(data()[0][0],), optimizer=OPTIMIZER, global_batch=GLOBAL_BATCH,
                              plan=plan, progress="quiet")


def _train(pm: Any, steps: range) -> list[float]:
    batches = data()
    return [pm.train_step(*batches[i]) for i in steps]


def _rank0(value: Any) -> Any:
    import torch.distributed as dist

    return value if not dist.is_initialized() or dist.get_rank() == 0 else None


def resumed(root: str, plan: str | None) -> dict[str, Any]:
    """A fresh job under `plan` (other initial weights would not matter: everything is loaded)
    loads `root`, trains the last steps; its losses and whole parameters."""
    pm = build(plan)
    pm.load(root)
    assert pm.step == SAVED_AT, pm.step
    losses = _train(pm, range(SAVED_AT, STEPS))
    state = pm.full_state_dict()
    return _rank0({"plan": pm.plan.spec(), "losses": losses, "state": state})


def world8(root: str) -> dict[str, Any]:
    pm = build(SOURCE)
    _train(pm, range(SAVED_AT))
    pm.save(os.path.join(root, "src8"))
    straight = _train(pm, range(SAVED_AT, STEPS))
    again = resumed(os.path.join(root, "src8"), SOURCE)
    others = [resumed(os.path.join(root, "src8"), plan) for plan in OTHERS_8]
    return _rank0({"straight": straight, "again": again, "others": others})


def world2(root: str) -> dict[str, Any]:
    others = [resumed(os.path.join(root, "src8"), plan) for plan in OTHERS_2]
    pm = build("dp=2,zero=1")
    _train(pm, range(SAVED_AT))
    blocking = pm.save(os.path.join(root, "src2"))
    start = time.perf_counter()
    pending = pm.save(os.path.join(root, "background"), background=True)
    stall = time.perf_counter() - start
    _train(pm, range(SAVED_AT, STEPS - 1))  # changes every parameter while the save writes
    committed = pm.wait_for_save()
    return _rank0({"others": others, "blocking": blocking, "background": committed, "pending": pending,
                   "stall_s": stall})


def world4(root: str) -> dict[str, Any]:
    return resumed(os.path.join(root, "src2"), None)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    pm = build("dp=1")
    losses = _train(pm, range(STEPS))
    return {"losses": losses, "state": pm.full_state_dict()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = {"root": root, "8": run_ranks(8, world8, root, timeout_s=400)[0]}
    out["2"] = run_ranks(2, world2, root)[0]
    out["1"] = resumed(os.path.join(root, "src8"), "dp=1")
    out["4"] = run_ranks(4, world4, root)[0]
    return out


def _assert_continues(result: dict[str, Any], reference: dict[str, Any]) -> None:
    want = reference["losses"][SAVED_AT:]
    assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(result["losses"], want)), (result["plan"], result["losses"], want)
    assert sorted(result["state"]) == sorted(reference["state"]), result["plan"]
    worst = max((rel_err(result["state"][k], v), k) for k, v in reference["state"].items())
    assert worst[0] < TOL, (result["plan"], worst)


def test_the_source_plan_trains_as_one_process(runs, reference) -> None:
    assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(runs["8"]["straight"], reference["losses"][SAVED_AT:]))


def test_resuming_under_the_same_plan_is_bit_identical(runs) -> None:
    # Megatron's resume test: 6 straight steps against 3, a fresh job from the checkpoint, 3 more
    assert runs["8"]["again"]["losses"] == runs["8"]["straight"]


@pytest.mark.parametrize("index", range(len(OTHERS_8)), ids=list(OTHERS_8))
def test_eight_ranks_load_under_another_plan(runs, reference, index) -> None:
    _assert_continues(runs["8"]["others"][index], reference)


@pytest.mark.parametrize("index", range(len(OTHERS_2)), ids=list(OTHERS_2))
def test_two_ranks_load_what_eight_saved(runs, reference, index) -> None:
    _assert_continues(runs["2"]["others"][index], reference)


def test_one_process_loads_what_eight_saved(runs, reference) -> None:
    _assert_continues(runs["1"], reference)


def test_a_larger_world_replans_and_resumes(runs, reference) -> None:
    result = runs["4"]
    assert result["plan"] != "dp=2,zero=1", result["plan"]
    _assert_continues(result, reference)


def test_a_background_save_writes_what_a_blocking_one_does(runs) -> None:
    from mplan.runtime.checkpoint import read_tensors

    blocking, background = read_tensors(runs["2"]["blocking"]), read_tensors(runs["2"]["background"])
    assert runs["2"]["pending"] == runs["2"]["background"]
    assert sorted(blocking) == sorted(background)
    for key, value in blocking.items():
        assert torch.equal(value, background[key]), key


# -- a rank killed in the middle of a save ---------------------------------------------------------
def killed_while_saving(root: str) -> None:
    import torch.distributed as dist

    from mplan.runtime.checkpoint_storage import JsonMetadataWriter

    pm = build("dp=2,zero=1")
    _train(pm, range(SAVED_AT))
    pm.save(root)  # committed: step 3
    _train(pm, range(SAVED_AT, SAVED_AT + 1))
    if dist.get_rank() == 1:
        write = JsonMetadataWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            done = write(self, plan, planner)
            done.wait()  # this rank's bytes are on disk; the metadata and the commit are not
            os.kill(os.getpid(), signal.SIGKILL)
            return done
        JsonMetadataWriter.write_data = write_then_die
    pm.save(root)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, reference) -> None:
    root = str(tmp_path)
    with pytest.raises(RankFailed, match="exited with code -9|Connection reset|Connection closed"):
        run_ranks(2, killed_while_saving, root)  # rank 1 dies; rank 0 fails in the save's next collective
    assert sorted(os.listdir(root)) == [".step-00000004.partial", "latest", "step-00000003"]
    _assert_continues(run_ranks(2, resumed, root, "dp=2,zero=1")[0], reference)
