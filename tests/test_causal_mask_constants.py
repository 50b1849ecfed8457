"""A causal mask built with tensors the model creates from Python numbers is still proven causal.

transformers 5.17 writes its mask's 0 as `torch.tensor(0.0)`; torch.export lifts such a tensor
into a constant placeholder, which the mask's evaluation once took for an input: Gemma-2's
attention then ran on its mask, unfused (benchmarks/results/peers_h100-2026-12-06-a.json,
`attention missed x8`). The capture keeps each lifted constant's value on its node; the
evaluation reads it, and a constant that might encode a position (a window as a tensor) is read
only at the program's own length, never scaled to the short evaluation.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mplan

SEQ, WIDTH, HEADS, VOCAB = 12, 16, 2, 32


class MaskedAttention(nn.Module):
    """One attention layer whose additive mask is built as transformers 5.17 builds it: a lifted
    0.0 where a key is allowed, the dtype's lowest value elsewhere; `window` (a tensor, when
    given) also hides keys more than `window - 1` positions back."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.window = window

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        position = torch.arange(s, device=ids.device)
        allowed = position[None, :] <= position[:, None]
        if self.window is not None:
            allowed = allowed & (position[:, None] - position[None, :] < torch.tensor(self.window))
        zero = torch.tensor(0.0, dtype=x.dtype)  # lifted by torch.export: a constant placeholder
        mask = torch.where(allowed, zero, torch.finfo(x.dtype).min)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.transpose(1, 2).reshape(b, s, WIDTH))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _run(window: int | None) -> tuple[dict[str, int], float, float]:
    torch.manual_seed(0)
    model = MaskedAttention(window).double()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    reference = _loss(copy.deepcopy(model)(ids), ids).item()
    pm = mplan.autoparallel(model, example_inputs=(ids,), loss_fn=_loss, global_batch=2, plan="dp=1,tp=1,pp=1",
                            kernels=True, optimizer=torch.optim.SGD, progress="quiet")
    counts = dict(pm.program.meta["fuse_kernels"].counts)
    return counts, pm.train_step(ids, ids), reference


@pytest.mark.parametrize("window", [None, 64])
def test_a_mask_with_lifted_constants_is_proven_causal(window: int | None) -> None:
    """No window, or a window (a tensor) longer than the sequence: the mask is the causal one;
    attention fuses as causal SDPA and the loss is the model's."""
    counts, loss, reference = _run(window)
    assert counts.get("attention") == 1
    assert loss == pytest.approx(reference, rel=1e-12)


def test_a_window_given_as_a_tensor_is_read_at_the_programs_own_length() -> None:
    """A window of 4 over 12 tokens (a tensor constant) hides more than the causal mask: the mask
    stays, and the loss is still the model's."""
    counts, loss, reference = _run(4)
    assert "attention" not in counts
    assert loss == pytest.approx(reference, rel=1e-12)
