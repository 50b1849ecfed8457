"""Named configurations of published models, plus tiny ones for tests.

Sources:
- GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (layers,
  d_model, heads), context 2048, and vocabulary 51200 (GPT-2's 50257 padded, as in
  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").
  Embeddings are tied (GPT-2/3, and Megatron's default).
  Two rows of the table are not self-consistent and are fixed as Megatron-LM does:
  1.3B lists 24 heads of 128 for d_model 2048 (we use 16 x 128); 13B lists d_model 5140
  with 40 heads of 128 (we use 5120 = 40 x 128).
- Llama 3 8B/70B/405B: Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783),
  Table 3, matching Meta's released `config.json`s: vocab 128256, RoPE theta 500000,
  8 key/value heads, RMSNorm eps 1e-5, untied embeddings; seq 8192, the pre-training
  context length (the released 3.1 configs extend it to 128K afterwards).
- Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088), Table 1, and
  mistralai/Mixtral-8x7B-v0.1's config.json (rope_theta 1e6, vocab 32000). The model's
  context is 32768, but we plan at seq 4096, the length Megatron-Core's Mixtral 8x7B
  training examples and published MoE throughput figures use. Mixtral routes dropless
  (capacity_factor None).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from mplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig(
        name=name, num_layers=layers, hidden=hidden, num_heads=heads,
        seq_len=2048, vocab=51200, tie_embeddings=True,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> LlamaConfig:
    return LlamaConfig(
        name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=8,
        ffn_hidden=ffn, seq_len=8192, vocab=128256, rope_theta=500000.0, norm_eps=1e-5,
    )


_ALL: tuple[ModelConfig, ...] = (
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96),
    _llama3("llama3-8b", 32, 4096, 32, 14336),
    _llama3("llama3-70b", 80, 8192, 64, 28672),
    _llama3("llama3-405b", 126, 16384, 128, 53248),
    MoEConfig(
        name="mixtral-8x7b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
        ffn_hidden=14336, seq_len=4096, vocab=32000, rope_theta=1e6, norm_eps=1e-5,
        # dropless, as Mixtral trains: the experts op routes T*k token copies whatever the load
        num_experts=8, top_k=2,
    ),
    # tiny models for tests: a few layers, every feature switched on (GQA, tying, drops)
    GPTConfig(name="tiny-gpt", num_layers=2, hidden=32, num_heads=4, seq_len=16, vocab=64),
    LlamaConfig(
        name="tiny-llama", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2,
        ffn_hidden=64, seq_len=16, vocab=64,
    ),
    MoEConfig(
        name="tiny-moe", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2,
        ffn_hidden=48, seq_len=16, vocab=64, num_experts=4, top_k=2,
    ),
)

PRESETS: Mapping[str, ModelConfig] = MappingProxyType({config.name: config for config in _ALL})
"""Preset name -> config (read-only)."""
