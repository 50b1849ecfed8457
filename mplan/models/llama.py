"""Llama 2/3 reference model: RoPE, pre-RMSNorm blocks, SwiGLU, grouped-query attention.

Names (a contract for the planner and passes):
  embed, rope.{cos, sin} (non-persistent buffers), layers.{i}.{attn_norm,
  attn.{q,k,v,o}_proj, mlp_norm, mlp.{gate,up,down}_proj}, norm, lm_head (absent when tied).
The RoPE tables live once at the top level and are passed to every block, rather than
copied per layer (126 copies of an 8192 x 128 table would cost ~1 GB in float32 for 405B).
"""

from __future__ import annotations

import torch
from torch import nn

from mplan.models.config import LlamaConfig
from mplan.models.decoder import DecoderLM, empty_embedding
from mplan.models.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU

Rope = tuple[torch.Tensor, torch.Tensor]


class LlamaBlock(nn.Module):
    """x + attn(rms(x), rope), then + mlp(rms(.))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config.hidden, config.num_heads, config.kv_heads, bias=False)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = self._make_mlp(config)

    def _make_mlp(self, config: LlamaConfig) -> nn.Module:
        return SwiGLU(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(DecoderLM):
    """forward(input_ids [B, S], labels [B, S] | None) -> logits [B, S, V] or the mean loss.

    Labels are the targets aligned with input_ids (already shifted by the data pipeline)."""

    config: LlamaConfig
    block_type: type[nn.Module] = LlamaBlock

    def __init__(
        self,
        config: LlamaConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = 0,
    ) -> None:
        super().__init__(config)
        with torch.device("meta"):
            self.embed = empty_embedding(config.vocab, config.hidden)
            self.rope = RotaryEmbedding(config.seq_len, config.head_dim, config.rope_theta)
            self.layers = nn.ModuleList(self.block_type(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden, config.norm_eps)
            self._make_head()
        self._materialize(device, dtype, seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        rope = self.rope(input_ids.shape[1])
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, rope)
        return self.output(x, labels)
