"""Fused Triton kernels with autograd, each beside the plain PyTorch reference it replaces.

One file per kernel family; each exports the op (which dispatches), its `*_reference` and
its `torch.autograd.Function`:
    rms_norm.py       rms_norm_residual(x, residual, weight, eps) -> (normed, new_residual); rms_norm
    layer_norm.py     layer_norm_residual(x, residual, weight, bias, eps) -> (normed, new_residual)
    bias_gelu.py      bias_gelu(x, bias) -> gelu_tanh(x + bias)
    swiglu.py         swiglu(gate, up) -> silu(gate) * up
    rotary.py         rope(x, cos, sin): rotate-half RoPE on [batch, heads, seq, head_dim]
    cross_entropy.py  cross_entropy(logits, labels), vocab_parallel_cross_entropy(local_logits, ...)
    fp8.py            fp8_linear through torch._scaled_mm (CUDA, capability >= 8.9 only)
    op_bytes.py       fused_op_bytes: the bytes each fused op moves, for the cost model
    dispatch.py       use_triton: Triton on CUDA (or CPU under TRITON_INTERPRET=1), else reference
    sigmoid.py        a shared device function (sigmoid and its complement, both accurate)

The graph pass that swaps these into a captured model is mplan.passes.fuse_kernels.
"""
from __future__ import annotations

from mplan.kernels.bias_gelu import bias_gelu, bias_gelu_reference
from mplan.kernels.cross_entropy import (
    VocabReductions,
    cross_entropy,
    cross_entropy_reference,
    vocab_parallel_cross_entropy,
)
from mplan.kernels.dispatch import use_triton
from mplan.kernels.layer_norm import layer_norm_residual, layer_norm_residual_reference
from mplan.kernels.op_bytes import FUSED_OP_TRAFFIC, FusedOpTraffic, fused_op_bytes
from mplan.kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_residual, rms_norm_residual_reference
from mplan.kernels.rotary import rope, rope_reference
from mplan.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "FUSED_OP_TRAFFIC",
    "FusedOpTraffic",
    "VocabReductions",
    "bias_gelu",
    "bias_gelu_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "fused_op_bytes",
    "layer_norm_residual",
    "layer_norm_residual_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_residual",
    "rms_norm_residual_reference",
    "rope",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
    "use_triton",
    "vocab_parallel_cross_entropy",
]
