"""The Hugging Face families the `peers` case (benchmarks/models/peers.py) races mplan on: one
`Family` per transformers class, at a size that trains on one H100 beside its three peers (about
0.6-1.3B parameters), or tiny for the CPU smoke test.

Chosen for the layer forms they bring, each captured by mplan (`python -m mplan inspect` on the
tiny config; tests/test_fusion_hf.py and tests/test_fusion_forms.py test the forms):
    gemma2     soft-capped logits (final_logit_softcapping 30) into the head + loss, GeGLU,
               sandwich norms; eager attention (transformers has no SDPA path for Gemma-2)
    phi3       packed qkv_proj and gate_up_proj weights
    qwen3      q/k RMSNorm per head (Qwen3-1.7B's widths, 12 layers)
    gemma3     q/k norms, GeGLU, 262k vocabulary (Gemma-3-1B's widths, 12 layers; sliding_window
               4096 >= the sequence, so every layer attends causally in full)
    granite    embedding, residual, attention and logits multipliers (logits_scaling 8)
    olmo2      norms after the sublayers, q/k RMSNorm over all heads
    qwen3_moe  mixture of experts (64 experts, top 8) with a sparse block on every layer
    cohere     LayerNorm without a bias, a parallel attention + MLP block, interleaved RoPE,
               logits times logit_scale, 256k vocabulary (no Liger patch)
    stablelm   LayerNorm with a bias, RoPE on a quarter of each head (no Liger patch)
    llama      TinyLlama-1.1B's shape: benchmarked before (the `hf-models` case), the anchor
Only llama was benchmarked before. Batches: 2 x 2048 tokens where the vocabulary is 256k (the
eager peers materialize [tokens, vocab] logits in fp32), 4 x 2048 above 100k, 8 x 2048 below, but
4 x 2048 for llama's 22 layers: four systems stay resident on one 80 GB card (about 8 bytes a
parameter each: bf16 weights, gradients and AdamW's two moments) beside one system's activations.
Depth is 8-12 layers but for llama: torch.compile's cold warm-up grows with the layers (87 s for a
26-layer Gemma-3 on the H200, benchmarks/results/peers-2026-12-06.json, where qwen3 at 28 layers and
gemma3 ran past a 130 s family timeout), and each family should fit about a minute and a half.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

SEQ = 2048
SMALL_BATCH, SMALL_SEQ = 2, 32


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One Hugging Face causal LM: its transformers classes, Liger's patch for it, its sizes."""

    name: str
    config_class: str
    model_class: str
    liger_patch: str | None
    """the function of liger_kernel.transformers that patches this family; None: Liger has none"""
    sizes: tuple[tuple[str, Any], ...]
    """the config's keyword arguments (a tuple, so a family can key a cache)"""
    batch: int
    seq: int
    attention: str = "sdpa"
    """transformers' attn_implementation"""

    def config(self) -> Any:
        transformers = importlib.import_module("transformers")
        return getattr(transformers, self.config_class)(**dict(self.sizes), attn_implementation=self.attention,
                                                        use_cache=False)

    @property
    def vocab(self) -> int:
        return dict(self.sizes)["vocab_size"]


TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 128, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "max_position_embeddings": 64,
        "n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": 128, "n_positions": 64}
"""The smoke test's shape: each family's own sizes replaced where it has them"""


def _family(name: str, config_class: str, model_class: str, liger: bool, *, attention: str = "sdpa",
            small: bool, batch: int | None = None, **sizes: Any) -> Family:
    if small:
        sizes = {k: TINY.get(k, v) for k, v in sizes.items()}
    vocab = sizes["vocab_size"]
    if batch is None:
        batch = 2 if vocab >= 256000 else 4 if vocab > 100000 else 8
    batch = SMALL_BATCH if small else batch
    return Family(name=name, config_class=config_class, model_class=model_class,
                  liger_patch=f"apply_liger_kernel_to_{'gemma3_text' if name == 'gemma3' else name}" if liger else None,
                  sizes=tuple(sizes.items()), batch=batch, seq=SMALL_SEQ if small else SEQ, attention=attention)


def families(small: bool) -> tuple[Family, ...]:
    """Every family, at full size or tiny."""
    return (
        _family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", True, attention="eager", small=small,
                num_hidden_layers=8, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                intermediate_size=9216, vocab_size=256000, final_logit_softcapping=30.0, attn_logit_softcapping=None,
                tie_word_embeddings=True, max_position_embeddings=8192),
        _family("phi3", "Phi3Config", "Phi3ForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=5632, vocab_size=32064, pad_token_id=0, tie_word_embeddings=False,
                max_position_embeddings=4096),
        _family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960),
        _family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                intermediate_size=6912, vocab_size=262144, sliding_window=4096, tie_word_embeddings=True,
                max_position_embeddings=32768),
        _family("granite", "GraniteConfig", "GraniteForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=49155, embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=True,
                max_position_embeddings=4096),
        _family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=8192, vocab_size=100352, tie_word_embeddings=False, max_position_embeddings=4096),
        _family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", True, small=small,
                num_hidden_layers=12, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
        _family("cohere", "CohereConfig", "CohereForCausalLM", False, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=5632, vocab_size=256000, logit_scale=0.0625, tie_word_embeddings=True,
                max_position_embeddings=8192),
        _family("stablelm", "StableLmConfig", "StableLmForCausalLM", False, small=small,
                num_hidden_layers=12, hidden_size=2048, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=5632, vocab_size=100352, partial_rotary_factor=0.25, tie_word_embeddings=False,
                max_position_embeddings=4096),
        # GPT-2 medium's shape (355M) at a 2048-token context: learned positions, Conv1D (addmm)
        # projections, gelu_new written out; Liger patches no GPT-2
        _family("gpt2", "GPT2Config", "GPT2LMHeadModel", False, small=small,
                n_layer=24, n_embd=1024, n_head=16, n_inner=4096, vocab_size=50257, n_positions=2048,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True),
        _family("llama", "LlamaConfig", "LlamaForCausalLM", True, small=small, batch=4,
                num_hidden_layers=22, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False, rms_norm_eps=1e-5,
                max_position_embeddings=2048),
    )


def family(name: str, small: bool) -> Family:
    """The family called `name`; a KeyError naming the known ones otherwise."""
    known = {f.name: f for f in families(small)}
    if name not in known:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(known)}")
    return known[name]
