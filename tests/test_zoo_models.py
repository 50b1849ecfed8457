"""The outside-model zoo (tests/zoo_models.py) is sound: deterministic, trainable, exportable."""
from __future__ import annotations

import math
import time
from collections.abc import Iterable

import pytest
import torch
from torch import Tensor, nn

from zoo_models import ZOO, ZooModel, batches, compute_loss, reference_training, split_batch_error

HF_FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "gptj", "gemma", "phi2", "opt", "falcon",
               "stablelm"]
RMSNORM_UPCAST = ["llama", "mistral", "qwen2", "gemma"]
"""Families whose RMSNorm computes in float32 (besides the float32 causal-LM loss of all ten)."""
NAMES = list(ZOO)


@pytest.fixture(autouse=True)
def _needs_transformers(request: pytest.FixtureRequest) -> None:
    """Skips the Hugging Face cases when transformers is not installed."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("name") in HF_FAMILIES:
        pytest.importorskip("transformers")


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer every test trains with."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class LossOf(nn.Module):
    """forward(ids, labels) -> loss, the way a user computes it. HF models run with
    use_cache=False: transformers 5 builds a DynamicCache even in training when use_cache is on,
    which a loss never needs and the exported graph should not carry."""

    def __init__(self, zoo: ZooModel, model: nn.Module) -> None:
        super().__init__()
        self.zoo, self.model = zoo, model

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        if self.zoo.loss_in_forward:
            return self.model(ids, labels=labels, use_cache=False).loss
        return compute_loss(self.zoo, self.model, ids, labels)


def test_zoo_has_every_model() -> None:
    assert NAMES == HF_FAMILIES + ["nanogpt", "einsum_lm"]
    for name, zoo in ZOO.items():
        assert zoo.name == name and zoo.seq == 16
        assert zoo.loss_in_forward == (zoo.loss_fn is None)


def test_float32_inside_where_transformers_upcasts() -> None:
    assert all(ZOO[name].float32_inside for name in HF_FAMILIES + RMSNORM_UPCAST)
    assert not ZOO["nanogpt"].float32_inside and not ZOO["einsum_lm"].float32_inside


@pytest.mark.parametrize("name", NAMES)
def test_builds_identically_in_float64(name: str) -> None:
    first, second = ZOO[name].make(), ZOO[name].make()
    a, b = first.state_dict(), second.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert all(p.dtype == torch.float64 for p in first.parameters())
    assert any(isinstance(m, nn.ModuleList) and len(m) == 2 for m in first.modules())
    assert all(not torch.any((p == 0) | (p == 1)) for p in first.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_trains_three_adamw_steps(name: str) -> None:
    zoo = ZOO[name]
    losses, params = reference_training(zoo, batches(4, 3, zoo.vocab, zoo.seq), adamw)
    assert all(math.isfinite(loss) for loss in losses)
    assert len(set(losses)) == 3, losses
    initial = dict(zoo.make().named_parameters(remove_duplicate=False))
    assert params.keys() == initial.keys()
    assert all(not torch.equal(params[key], initial[key]) for key in params)


@pytest.mark.parametrize("name", NAMES)
def test_exports_with_dynamic_batch(name: str) -> None:
    zoo = ZOO[name]
    wrapper = LossOf(zoo, zoo.make())
    ids, labels = batches(2, 1, zoo.vocab, zoo.seq)[0]
    batch = torch.export.Dim("batch", min=2)
    start = time.perf_counter()
    exported = torch.export.export(wrapper, (ids, labels), dynamic_shapes=({0: batch}, {0: batch}),
                                   strict=False)
    print(f"{name}: export {time.perf_counter() - start:.2f} s")
    ids, labels = batches(3, 1, zoo.vocab, zoo.seq, seed=1)[0]
    torch.testing.assert_close(exported.module()(ids, labels), wrapper(ids, labels).detach())


def test_nanogpt_head_is_tied() -> None:
    model = ZOO["nanogpt"].make()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(names)


@pytest.mark.parametrize("name", NAMES)
def test_split_batch_error(name: str) -> None:
    zoo = ZOO[name]
    error = split_batch_error(zoo, batches(4, 2, zoo.vocab, zoo.seq), adamw, pieces=2)
    print(f"{name}: split_batch_error {error:.2e} (float32_inside={zoo.float32_inside})")
    if not zoo.float32_inside:
        assert error < 1e-12
