"""`DecoderLM`: what the three families share — building, initialization, output head, loss.

Building: a model's layers are always created on the meta device (no memory, no
wasted default init), then, unless the target device is meta, moved with `to_empty` and
filled by `init_weights(seed)`. A model built on "cpu" is therefore bit-identical to one
built on meta, moved with `to_empty(device="cpu")` and initialized with the same seed.

Initialization (Megatron-LM): normal(0, 0.02) for embeddings and linear/expert weights;
output projections of each block (`o_proj`, `fc_out`, `down_proj`, `w_down`) get
0.02 / sqrt(2 * num_layers) so the residual stream's variance does not grow with depth;
norm weights are ones, biases zeros.

Every parameter draws from its own CPU generator seeded by (seed, parameter name) and is
generated in float32, then copied into place. So a parameter's values depend only on the
seed, its name and its shape: not on the device, not on the order of initialization, and
not on which other parameters exist. A pipeline stage that holds a few blocks, or a rank
that holds a shard, can reproduce exactly the weights of the full single-device model.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from mplan.models.config import TransformerConfig
from mplan.models.layers import RotaryEmbedding

INIT_STD = 0.02
"""Megatron-LM `init_method_std` default (also GPT-2's)."""

OUTPUT_PROJECTIONS = frozenset({"o_proj", "fc_out", "down_proj", "w_down"})
"""Modules/parameters whose output is added to the residual stream."""


class DecoderLM(nn.Module):
    """Base of `GPTModel`, `LlamaModel`, `MoEModel`. Subclasses create their submodules
    inside `with torch.device("meta"):` and then call `_materialize`."""

    embed: nn.Embedding
    norm: nn.Module

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def _materialize(
        self, device: torch.device | str | None, dtype: torch.dtype | None, seed: int | None
    ) -> None:
        if dtype is not None:
            self.to(dtype)
        target = torch.get_default_device() if device is None else torch.device(device)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights(seed)

    def _make_head(self) -> None:
        """`lm_head` exists only when untied: tying reads `embed.weight` in `logits`, so
        every parameter has exactly one name."""
        if not self.config.tie_embeddings:
            self.lm_head = nn.Linear(self.config.hidden, self.config.vocab, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if self.config.tie_embeddings:
            return F.linear(x, self.embed.weight)
        return self.lm_head(x)

    def output(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Logits [batch, seq, vocab] without labels, else the mean cross-entropy."""
        logits = self.logits(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter and buffer in place (see the module docstring).

        seed None draws a base seed from torch's global generator (so `torch.manual_seed`
        governs it); an int makes the weights a pure function of (seed, name, shape)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        std_out = INIT_STD / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)  # every 1-D non-bias parameter is a norm weight
            else:
                parts = set(name.split("."))
                std = std_out if parts & OUTPUT_PROJECTIONS else INIT_STD
                param.copy_(normal_like(param, std, parameter_seed(seed, name)))
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_tables()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def empty_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An nn.Embedding without its default init: `init_weights` overwrites it anyway, and
    the default normal_ on meta tensors imports torch's Python decompositions (~1.5 s the
    first time), which alone would dominate building a model on meta."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across Python runs (unlike `hash`)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def normal_like(param: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """normal(0, std) of param's shape, float32 on the CPU, from a generator seeded with `seed`."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
