"""Model configurations: the few numbers that define a reference model family.

Three frozen, keyword-only records, one per family:

- `GPTConfig`   GPT-2/3 style: learned positions, LayerNorm, biased linears, GELU MLP.
- `LlamaConfig` Llama style: RoPE, RMSNorm, no biases, SwiGLU MLP, grouped-query attention.
- `MoEConfig`   a Llama config whose every MLP is a mixture of experts (Mixtral style).

Invariants, checked on construction (one ValueError naming the field): every size is
positive, `hidden` is a multiple of `num_heads`, `num_heads` a multiple of the number of
key/value heads, `top_k <= num_experts`, RoPE head dims are even. There is no dropout
anywhere: the models are deterministic functions of their inputs and weights.

Optional widths are stored as given (`None` = the family default) and resolved by a
property (`ffn`, `kv_heads`), so `dataclasses.replace(cfg, hidden=...)` re-derives them.
`num_parameters()` is the closed-form count; tests hold it equal to the built module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


def _finite_number(value: object, *, above: float, or_equal: bool = False) -> bool:
    """A real number (not a bool), finite, above `above` (or equal to it with `or_equal`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False
    return finite and (value >= above if or_equal else value > above)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerConfig:
    """Fields shared by every decoder-only family. Not built directly."""

    family: ClassVar[str] = ""

    num_layers: int
    """transformer blocks"""
    hidden: int
    """model width (elements per token)"""
    num_heads: int
    """query attention heads"""
    seq_len: int
    """tokens per sequence the model is built for (position table / RoPE table length)"""
    vocab: int
    """token ids in [0, vocab)"""
    tie_embeddings: bool = False
    """the output head reuses `embed.weight` (no separate `lm_head` parameter)"""
    norm_eps: float = 1e-5
    """epsilon added inside every norm"""
    name: str = "custom"
    """human-readable name (the preset name, or the spec it was parsed from)"""

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "seq_len", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(field, f"must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            self._fail("hidden", f"={self.hidden} must be a multiple of num_heads={self.num_heads}")
        if not _finite_number(self.norm_eps, above=0):
            self._fail("norm_eps", f"must be > 0 and finite, got {self.norm_eps!r}")

    def _fail(self, field: str, message: str) -> None:
        raise ValueError(f"{type(self).__name__}.{field}: {message}")

    @property
    def head_dim(self) -> int:
        """elements per attention head"""
        return self.hidden // self.num_heads

    @property
    def kv_heads(self) -> int:
        """key/value heads (equal to `num_heads` unless the family groups queries)"""
        return self.num_heads

    @property
    def ffn(self) -> int:
        """MLP inner width (per expert for MoE)"""
        raise NotImplementedError

    def _embedding_parameters(self) -> int:
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + head


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig(TransformerConfig):
    """GPT-2/3: learned absolute positions, pre-LayerNorm, biased linears, GELU (tanh) MLP."""

    family: ClassVar[str] = "gpt"

    ffn_hidden: int | None = None
    """MLP inner width; None means 4 * hidden (GPT-2/3, Megatron default)"""
    fused_attention: bool = True
    """False materializes the score matrix (matmul, mask, softmax, matmul) as Megatron-LM did in
    2021; used to compare with that paper's measured runs"""

    def _validate(self) -> None:
        TransformerConfig._validate(self)
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0):
            self._fail("ffn_hidden", f"must be a positive integer or None, got {self.ffn_hidden!r}")

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    def num_parameters(self) -> int:
        """Closed form. Per block: q,k,v,o weights and biases (4h^2 + 4h), two LayerNorms
        (4h), fc_in and fc_out with biases (2hf + f + h); plus token and position tables,
        the final LayerNorm (2h) and the head unless tied."""
        h, f = self.hidden, self.ffn
        block = 4 * h * h + 4 * h + 4 * h + 2 * h * f + f + h
        return self.num_layers * block + self.seq_len * h + 2 * h + self._embedding_parameters()


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig(TransformerConfig):
    """Llama 2/3: RoPE, pre-RMSNorm, bias-free linears, SwiGLU MLP, grouped-query attention."""

    family: ClassVar[str] = "llama"

    ffn_hidden: int
    """SwiGLU inner width (gate_proj/up_proj outputs); not derived, published models round it"""
    num_kv_heads: int | None = None
    """key/value heads for grouped-query attention; None means num_heads (plain multi-head)"""
    rope_theta: float = 10000.0
    """RoPE base period (Llama 2: 1e4, Llama 3: 5e5, Mixtral: 1e6)"""

    def _validate(self) -> None:
        TransformerConfig._validate(self)
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0:
            self._fail("ffn_hidden", f"must be a positive integer, got {self.ffn_hidden!r}")
        if self.num_kv_heads is not None:
            if not isinstance(self.num_kv_heads, int) or self.num_kv_heads <= 0:
                self._fail("num_kv_heads", f"must be a positive integer or None, got {self.num_kv_heads!r}")
            if self.num_heads % self.num_kv_heads:
                self._fail(
                    "num_kv_heads",
                    f"={self.num_kv_heads} must divide num_heads={self.num_heads}",
                )
        if self.head_dim % 2:
            # rotate-half RoPE pairs element i with i + head_dim/2
            self._fail("hidden", f"head_dim={self.head_dim} (hidden/num_heads) must be even for RoPE")
        if not _finite_number(self.rope_theta, above=0):
            self._fail("rope_theta", f"must be > 0 and finite, got {self.rope_theta!r}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden

    def _attention_parameters(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv

    def _mlp_parameters(self) -> int:
        return 3 * self.hidden * self.ffn

    def num_parameters(self) -> int:
        """Closed form. Per block: q,o (h x h), k,v (h x kv_heads*head_dim), the MLP and two
        RMSNorm weights; plus the embedding, the final RMSNorm and the head unless tied."""
        block = self._attention_parameters() + self._mlp_parameters() + 2 * self.hidden
        return self.num_layers * block + self.hidden + self._embedding_parameters()


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig(LlamaConfig):
    """Llama blocks whose MLP is a top-k routed mixture of SwiGLU experts (Mixtral)."""

    family: ClassVar[str] = "moe"

    num_experts: int
    """experts per MoE layer"""
    top_k: int = 2
    """experts each token is sent to"""
    capacity_factor: float | None = None
    """expert capacity = ceil(capacity_factor * top_k * tokens / num_experts) tokens; choices
    beyond it are dropped. None means dropless (capacity = tokens: no token is ever dropped)"""
    aux_loss_coef: float = 0.01
    """weight of the load-balancing loss added to the LM loss (Switch / Megatron default 1e-2)"""
    shared_ffn: int = 0
    """intermediate width of a shared expert every token also runs (Qwen-MoE, DeepSeek); 0: none"""

    def _validate(self) -> None:
        LlamaConfig._validate(self)
        for field in ("num_experts", "top_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(field, f"must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            self._fail("top_k", f"={self.top_k} must be <= num_experts={self.num_experts}")
        if self.capacity_factor is not None and not _finite_number(self.capacity_factor, above=0):
            self._fail("capacity_factor", f"must be > 0 (finite) or None, got {self.capacity_factor!r}")
        if not _finite_number(self.aux_loss_coef, above=0, or_equal=True):
            self._fail("aux_loss_coef", f"must be >= 0 and finite, got {self.aux_loss_coef!r}")
        if not isinstance(self.shared_ffn, int) or isinstance(self.shared_ffn, bool) or self.shared_ffn < 0:
            self._fail("shared_ffn", f"must be a non-negative integer, got {self.shared_ffn!r}")

    def _mlp_parameters(self) -> int:
        return (self.num_experts * 3 * self.hidden * self.ffn + self.hidden * self.num_experts
                + 3 * self.hidden * self.shared_ffn)

    def num_active_parameters(self) -> int:
        """Parameters one token touches: every expert count replaced by top_k."""
        inactive = (self.num_experts - self.top_k) * 3 * self.hidden * self.ffn
        return self.num_parameters() - self.num_layers * inactive

    def capacity(self, num_tokens: int) -> int:
        """Slots per expert for a batch of `num_tokens` tokens (static: depends on shapes only)."""
        if self.capacity_factor is None:
            return num_tokens
        wanted = math.ceil(self.capacity_factor * self.top_k * num_tokens / self.num_experts)
        # an expert never receives more than one choice per token
        return min(num_tokens, wanted)


ModelConfig = GPTConfig | LlamaConfig | MoEConfig
