"""Compute copies (mplan/runtime/compute_copies.py): under autocast the weights autocast would cast
every step are read from persistent bf16 copies, and training is exactly what it is without them.

Every test builds and parallelizes its own models; each model configuration is captured once
(tests/capture_cache.py), as the capture is the same for every one of them."""
from __future__ import annotations

import dataclasses
import functools
import tempfile

import pytest
import torch

import mplan
from capture_cache import reused_captures
from mplan.kernels.dispatch import INTERPRET
from mplan.models import GPTConfig, GPTModel, LlamaConfig, LlamaModel
from mplan.runtime import parallel_module

pytestmark = pytest.mark.skipif(INTERPRET, reason="the interpreter's bf16 truncation is not autocast's rounding")

GPT = GPTConfig(num_layers=2, hidden=16, num_heads=2, seq_len=8, vocab=32)
LLAMA = LlamaConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, seq_len=8, vocab=32, ffn_hidden=24)
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen))
            for _ in range(steps)]


def _model(family: str, **changes: object) -> torch.nn.Module:
    model = (GPTModel(dataclasses.replace(GPT, **changes), device="cpu", seed=0) if family == "gpt" else
             LlamaModel(dataclasses.replace(LLAMA, **changes), device="cpu", seed=0))
    model.capture_key = ("test_compute_copies", family, tuple(sorted(changes.items())))  # see _pm
    return model


def _pm(model: torch.nn.Module, **options: object) -> parallel_module.ParallelModule:
    """`model` parallelized, its capture reused from an earlier model of the same configuration."""
    with reused_captures(model.capture_key):
        return mplan.autoparallel(model, example_inputs=(_data()[0][0],), optimizer=OPTIMIZER, global_batch=4,
                                  plan="dp=1,tp=1,pp=1", autocast=torch.bfloat16, kernels=True, device="cpu",
                                  **options)


def _without_copies(monkeypatch: pytest.MonkeyPatch, family: str, **changes: object) -> parallel_module.ParallelModule:
    with monkeypatch.context() as patch:
        patch.setattr(parallel_module, "_compute_copies", lambda *args, **kwargs: None)
        return _pm(_model(family, **changes))


def _copied(pm: parallel_module.ParallelModule) -> set[str]:
    assert pm.copies is not None
    by_param = {id(param): name for name, param in pm.params.items()}
    return {by_param[id(master)] for master in pm.copies.copies}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_only_weights_autocast_casts_get_copies(family: str) -> None:
    """Linear weights and biases (also grouped, and fc_in's bias that bias+GELU casts), never the
    embedding tables or the norms, which autocast reads in fp32."""
    pm = _pm(_model(family))
    names = set(pm.params)
    fp32_read = {n for n in names if "embed" in n or "norm" in n or ".ln" in n or n.startswith("ln")}
    assert _copied(pm) == names - fp32_read
    assert all(copy.dtype == torch.bfloat16 for copy in pm.copies.copies.values())


def test_a_head_tied_to_the_embedding_keeps_no_copy() -> None:
    pm = _pm(_model("gpt", tie_embeddings=True))
    assert not any("embed" in name for name in _copied(pm))


def test_no_copies_without_autocast_or_in_a_bf16_model() -> None:
    model = _model("gpt")
    with reused_captures(model.capture_key):
        plain = mplan.autoparallel(model, example_inputs=(_data()[0][0],), optimizer=OPTIMIZER, global_batch=4,
                                   plan="dp=1,tp=1,pp=1", kernels=True, device="cpu")
    assert plain.copies is None
    assert _pm(_model("gpt"), dtype=torch.bfloat16).copies is None


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_training_with_copies_is_training_without_them(family: str, max_grad_norm: float | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit: the copies hold what autocast's casts give, and the masters step on the same
    gradients (here through torch's AdamW: the gradients widened, the copies refreshed)."""
    with_copies = _pm(_model(family), max_grad_norm=max_grad_norm)
    without = _without_copies(monkeypatch, family)
    without.max_grad_norm = max_grad_norm
    assert with_copies.copies is not None and len(with_copies.copies) > 0
    for inputs, labels in _data():
        assert with_copies.train_step(inputs, labels) == without.train_step(inputs, labels)
    want = without.full_state_dict()
    for name, value in with_copies.full_state_dict().items():
        assert torch.equal(value, want[name]), name
    for master, copy in with_copies.copies.copies.items():
        assert torch.equal(copy, master.detach().to(torch.bfloat16))


def test_a_loaded_checkpoint_refreshes_the_copies() -> None:
    data = _data(4)
    trained = _pm(_model("gpt"))
    for inputs, labels in data[:2]:
        trained.train_step(inputs, labels)
    fresh = _pm(_model("gpt"))
    with tempfile.TemporaryDirectory() as directory:
        trained.save(directory)
        fresh.load(directory)
    for master, copy in fresh.copies.copies.items():
        assert torch.equal(copy, master.detach().to(torch.bfloat16))
    for inputs, labels in data[2:]:
        assert fresh.train_step(inputs, labels) == trained.train_step(inputs, labels)
