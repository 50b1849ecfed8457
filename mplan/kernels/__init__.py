"""Fused Triton kernels with autograd, each beside the plain PyTorch reference it replaces.

One file per kernel family; each exports the op (which dispatches), its `*_reference` and
its `torch.autograd.Function`. Module names differ from the op names on purpose, so
`mplan.kernels.swiglu` is always the op, never a module shadowed by it:
    rmsnorm.py        rms_norm_residual(x, residual, weight, eps) -> (normed, new_residual); rms_norm
    layernorm.py      layer_norm_residual(x, residual, weight, bias, eps) -> (normed, new_residual)
    gelu.py           bias_gelu(x, bias) -> gelu_tanh(x + bias)
    glu.py            swiglu(gate, up) -> silu(gate) * up; swiglu_packed(y) on one GEMM's [..., 2F];
                      geglu(gate, up) -> gelu_tanh(gate) * up; geglu_packed(y) likewise
    rotary.py         rope(x, cos, sin): rotate-half RoPE on [batch, heads, seq, head_dim];
                      rope_qk(q, k, cos, sin) -> (q_out, k_out): q and k in one launch each way
    cross_entropy_loss.py  cross_entropy(logits, labels), vocab_parallel_cross_entropy(local_logits, ...)
    head_loss.py      linear_cross_entropy(x, weight, labels): the LM head's GEMM and loss in row
                      chunks, never the whole logits; vocab_parallel_linear_cross_entropy (TP);
                      linear_cross_entropy_bytes and chunk_bytes for the memory model
    sdpa_autotune.py  attention(q, k, v, ...): SDPA on the fused backend that times fastest for the shape
    fp8.py            fp8_linear through torch._scaled_mm (CUDA, capability >= 8.9 only)
    moe.py            moe_experts(x, index, gate, weights...): an MoE layer's routed experts as one op
    moe_grouped.py    moe_experts_grouped, grouped_expert_mlp: the same through torch._grouped_mm (GPU)
    dispatch.py       use_triton: Triton on CUDA (or CPU under TRITON_INTERPRET=1), else reference
    sigmoid.py        a shared device function (sigmoid and its complement, both accurate)
    partials.py       sum_partials: the fp32 gradient partials of the norm and bias+GELU backwards, summed

The graph pass that swaps these into a captured model is mplan.passes.fuse_kernels; each kernel's
pattern, traffic, price and emitter are its entry in mplan.fusion.
"""
from __future__ import annotations

from mplan.kernels.sdpa_autotune import attention
from mplan.kernels.cross_entropy_loss import (
    VocabReductions,
    cross_entropy,
    cross_entropy_reference,
    vocab_parallel_cross_entropy,
)
from mplan.kernels.dispatch import use_triton
from mplan.kernels.gelu import bias_gelu, bias_gelu_reference
from mplan.kernels.glu import (
    geglu,
    geglu_packed,
    geglu_packed_reference,
    geglu_reference,
    swiglu,
    swiglu_packed,
    swiglu_packed_reference,
    swiglu_reference,
)
from mplan.kernels.layernorm import layer_norm_residual, layer_norm_residual_reference
from mplan.kernels.head_loss import (
    linear_cross_entropy,
    linear_cross_entropy_bytes,
    linear_cross_entropy_reference,
    vocab_parallel_linear_cross_entropy,
)
from mplan.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_residual, rms_norm_residual_reference
from mplan.kernels.rotary import rope, rope_qk, rope_qk_reference, rope_reference

__all__ = [
    "VocabReductions",
    "attention",
    "bias_gelu",
    "bias_gelu_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "geglu",
    "geglu_packed",
    "geglu_packed_reference",
    "geglu_reference",
    "layer_norm_residual",
    "layer_norm_residual_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_bytes",
    "linear_cross_entropy_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_residual",
    "rms_norm_residual_reference",
    "rope",
    "rope_qk",
    "rope_qk_reference",
    "rope_reference",
    "swiglu",
    "swiglu_packed",
    "swiglu_packed_reference",
    "swiglu_reference",
    "use_triton",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
]
