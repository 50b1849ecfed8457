"""Building blocks shared by the model families: RMSNorm, rotary tables, attention, SwiGLU.

Module and parameter names here are a contract: the planner and the sharding passes
recognise `q_proj`/`k_proj`/`v_proj`/`o_proj`, `gate_proj`/`up_proj`/`down_proj` by name.

Invariants:
- Activations are laid out [batch, seq, hidden]; attention runs on [batch, heads, seq, head_dim].
- Head counts are read from tensor shapes in forward (`view(..., -1, head_dim)`), so a layer
  whose projections were sharded over heads (tensor parallelism) still runs unchanged.
- Nothing in forward creates a tensor on a fixed device or branches on tensor values, so
  torch.export captures the blocks on the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in the input's dtype.

    Written with plain tensor ops rather than nn.RMSNorm so the captured graph shows the
    elementwise ops the cost model and the kernel-fusion pass expect."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """RoPE tables `cos`, `sin` of shape [seq_len, head_dim] (rotate-half convention).

    The tables are non-persistent buffers: they are not in the state dict (they are a
    function of the config) and `reset_tables()` rewrites them after `to_empty`. Built under
    the meta device they are meta tensors of the right shape and dtype; elsewhere, filled."""

    def __init__(self, seq_len: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.seq_len, self.head_dim, self.theta = seq_len, head_dim, theta
        # empty, then filled on real devices only: arithmetic on meta tensors goes through
        # torch's Python decompositions, whose first import costs more than the whole build
        self.register_buffer("cos", torch.empty(seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Recompute the tables in float64 on the CPU and copy them into the buffers: the
        values are then identical whatever device and dtype the model lives on."""
        cos, sin = rope_tables(self.seq_len, self.head_dim, self.theta, device=torch.device("cpu"))
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def rope_tables(
    seq_len: int, head_dim: int, theta: float, *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), each frequency used twice
    ([f0..f_{d/2-1}, f0..f_{d/2-1}]) to match `rotate_half`; float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / theta**exponents
    positions = torch.arange(seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by the tables [seq, head_dim]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections.

    Grouped-query attention (fewer key/value heads) goes through SDPA's `enable_gqa`, which
    was checked to match explicitly repeated k/v in float64 on the CPU and to export on the
    meta device as a single `scaled_dot_product_attention` node, so k/v are never expanded
    in memory."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, *, bias: bool, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.head_dim = hidden // num_heads
        self.enable_gqa = num_kv_heads != num_heads
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.enable_gqa)
        else:
            out = unfused_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention with the score matrix materialized, as Megatron-LM ran it in 2021 (before fused
    attention kernels): scores, causal mask, softmax, then the value product. Only for multi-head
    attention (the GPT family); the same function as SDPA with is_causal=True."""
    seq = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.matmul(probs, v)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), bias-free (Llama)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
