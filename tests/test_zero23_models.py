"""ZeRO-2 and ZeRO-3 (issue 33) train a model nobody on the project wrote exactly as one process.

The zoo's nanoGPT (tests/zoo_models.py: fused qkv split in three, manual masked softmax, a head tied
to the token embedding) under DP4 zero=2, DP4 zero=3 and TP2 x DP2 zero=3 with sequence
parallelism, on one gloo group of 4 ranks, float64: 5 AdamW steps with active global-norm
clipping, every step's loss and every final parameter within a relative 1e-9 of the model trained
on one process. The harness is test_zero23.py's (`compare`: the
planner's plan for the spec at the level asked) and test_equivalence.py's (`single_device`,
`assert_equivalent`); the model is trained as a user who passes labels does (`NanoGPT`).
"""
from __future__ import annotations

from typing import Any

import pytest
from torch import Tensor, nn

from distributed import run_checks
from test_equivalence import assert_equivalent
from test_zero23 import compare
from zoo_models import ZOO


class NanoGPT(nn.Module):
    """The zoo's nanoGPT with its loss inside: `model(ids, labels=labels)` the zoo's `loss_fn` on
    its logits (what `single_device` trains), `model(ids)` the logits (what inference runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = ZOO["nanogpt"].make()

    def forward(self, ids: Tensor, labels: Tensor | None = None) -> Tensor:
        logits = self.gpt(ids)
        return logits if labels is None else ZOO["nanogpt"].loss_fn(logits, labels)


NanoGPT.capture_key = ("zoo", "nanogpt", "loss given labels")  # `compare` captures it once per rank


def dp4_zero2_nanogpt() -> dict[str, Any]:
    return compare(NanoGPT, "dp=4", 2, 8, micro_batch_size=1)


def dp4_zero3_nanogpt() -> dict[str, Any]:
    return compare(NanoGPT, "dp=4", 3, 8, micro_batch_size=1)


def tp2_dp2_sp_zero3_nanogpt() -> dict[str, Any]:
    return compare(NanoGPT, "tp=2,dp=2,sp=1", 3, 8, micro_batch_size=2)


CHECKS = [dp4_zero2_nanogpt, dp4_zero3_nanogpt, tp2_dp2_sp_zero3_nanogpt]


@pytest.fixture(scope="module")
def world4():
    return run_checks(4, CHECKS, timeout_s=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nanogpt_matches_one_process(world4, check) -> None:
    assert_equivalent(world4.assert_passed(check))
