"""The outside-model zoo (tests/zoo_models.py: ten Hugging Face families from their shipped
configs, sizes shrunk, and two models written the way researchers write them) trains under mplan
as in the plain one-process loop: tp=2 with SP and pp=2 (1F1B over 4 micro-batches) on 2 gloo
ranks (`zoo_models.TESTED`; python -m benchmarks.equivalence zoo adds tp=2 without SP, dp=2, ZeRO-1, the
planner's own choice, and tp2 x dp2, tp2 x pp2 and plan=None on 4 ranks). Every model, every
plan, losses and every parameter after 3 AdamW steps, float64: relative error under 1e-9, or, for a
model whose own code computes in float32 (every Hugging Face loss does `logits.float()`),
`zoo_models.FLOAT32_FACTOR` times the error plain PyTorch itself shows when the batch is split,
measured here per model. No test here replaces anything the planner or the user chose.
"""
from __future__ import annotations

import functools

import pytest

import zoo_models
from distributed import run_checks

NAMES = tuple(zoo_models.ZOO)
PLANS = zoo_models.TESTED


@functools.lru_cache(maxsize=None)
def _check(plan: str | None):  # noqa: ANN202 - a zero-argument check for run_checks, one per plan
    def check() -> dict:
        return zoo_models.train_under_plan(NAMES, plan)
    check.__name__ = check.__qualname__ = f"zoo_{plan or 'auto'}"
    globals()[check.__name__] = check  # run_checks pickles a check by its qualified name
    return check


CHECKS = {world: {plan: _check(plan) for plan in plans} for world, plans in PLANS.items()}


@pytest.fixture(scope="module")
def world2():
    return run_checks(2, list(CHECKS[2].values()), timeout_s=900)


@functools.lru_cache(maxsize=None)
def bound(name: str) -> float:
    return zoo_models.error_bound(zoo_models.ZOO[name])


def _assert_matches(outcomes, world: int, plan: str | None, name: str) -> None:
    per_rank = outcomes.assert_passed(CHECKS[world][plan])
    rows = [ranks[name] for ranks in per_rank]
    row = rows[0]
    assert all(r == row for r in rows), f"ranks disagree: {rows}"
    assert not row["missing"], f"parameters missing from full_state_dict: {row['missing']}"
    assert row["error"] < bound(name), row
    if plan is not None and "tp=2" in plan:
        assert "tp=2" in row["ran"] and row["split"], f"nothing split under {row['ran']}"
    if plan is not None and "pp=2" in plan:
        assert "pp=2" in row["ran"], row


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("plan", PLANS[2], ids=lambda p: p or "auto")
def test_two_ranks(world2, plan: str | None, name: str) -> None:
    _assert_matches(world2, 2, plan, name)

