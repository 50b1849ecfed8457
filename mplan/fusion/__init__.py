"""Fusion: one entry per fused kernel, and the dry run that finds their chains in a captured model.

Between mplan.ir (the captured graph) and the layers that use fusion: the planner prices and
counts memory from the entries, the `fuse_kernels` pass (mplan.passes) rewrites with them, and
`mplan inspect` reports their coverage. One module per kind of kernel, each holding its
entries whole (pattern, what the kernel keeps, its price, its launches, its emitter):
    entry.py        FusionEntry and the records its fields hold
    graph_match.py  the node predicates the patterns share
    projections.py  linear_group: q/k/v as one GEMM (separate or packed projections)
    norms.py        layer_norm_residual, layer_norm, rms_norm_residual, rms_norm_add, rms_norm
    mlp.py          bias_gelu, linear_swiglu, swiglu, linear_geglu, geglu
    rope.py         rope, rope_qk (RoPE on q and k in one launch; halves or interleaved pairs)
    loss.py         linear_cross_entropy (the head + loss, scalings and soft-caps), cross_entropy
    attention.py    attention (causal masks proven, repeat_kv read once)
    fp8.py          fp8_linear, only when asked
    registry.py     FUSIONS: every entry in the order they are tried
    coverage.py     the chains, misses and memory-bound ops left of a captured Graph
Nothing here loads mplan.kernels or Triton until an emitter runs.
"""
from __future__ import annotations

from mplan.fusion.entry import (AtenPricing, FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches,
                                MeasuredPricing, Miss, PairedPattern, PatternMatch)
from mplan.fusion.registry import ATTENTION, FUSIONS, MATCHED, ROPE_QK, entry, fused_op_bytes

__all__ = ["ATTENTION", "FUSIONS", "MATCHED", "ROPE_QK", "AtenPricing", "FusedOpTraffic", "FusedSave", "FusionEntry",
           "FusionPattern", "Launches", "MeasuredPricing", "Miss", "PairedPattern", "PatternMatch", "entry",
           "fused_op_bytes"]
