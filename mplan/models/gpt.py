"""GPT-2/3 reference model (Megatron-LM's GPT): learned positions, pre-LayerNorm blocks.

Names (a contract for the planner and passes):
  embed, pos_embed, layers.{i}.{attn_norm, attn.{q,k,v,o}_proj, mlp_norm, mlp.{fc_in, fc_out}},
  norm, lm_head (absent when `tie_embeddings`: the head then reads `embed.weight`).
All linears carry biases; the MLP uses GELU with the tanh approximation (GPT-2/3, Megatron).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mplan.models.config import GPTConfig
from mplan.models.decoder import DecoderLM, empty_embedding
from mplan.models.layers import Attention


class GPTMLP(nn.Module):
    """fc_out(gelu_tanh(fc_in(x)))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """x + attn(ln(x)), then + mlp(ln(.))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(config.hidden, config.num_heads, config.num_heads, bias=True,
                              fused=config.fused_attention)
        self.mlp_norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = GPTMLP(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPTModel(DecoderLM):
    """forward(input_ids [B, S], labels [B, S] | None) -> logits [B, S, V] or the mean loss.

    Labels are the targets aligned with input_ids (already shifted by the data pipeline)."""

    config: GPTConfig

    def __init__(
        self,
        config: GPTConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = 0,
    ) -> None:
        super().__init__(config)
        with torch.device("meta"):
            self.embed = empty_embedding(config.vocab, config.hidden)
            self.pos_embed = empty_embedding(config.seq_len, config.hidden)
            self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
            self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
            self._make_head()
        self._materialize(device, dtype, seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos_embed(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(x, labels)
