"""Bytes each fused kernel moves, as data, so the cost model can price fused ops.

The fused kernels are memory-bound: time = fused_op_bytes(...) / measured bandwidth (the
device-to-device copy bandwidth of the profile, or the kernel's own measured TB/s from
benchmarks/kernels_h200.py). Counts are the fewest bytes: every input read once, every output
written once, as the kernels in this package actually do (and as
mplan/cost_models/reference/h200-kernels-2026-11-29.json counts them).

A fused op is described by its "rows": `num_rows` rows of `row_size` elements in the
activation dtype (`itemsize` bytes each):
    norms, bias+GELU, SwiGLU   rows = tokens,                row_size = hidden / features
    RoPE                       rows = batch * heads * seq,   row_size = head_dim, table_rows = seq
    cross-entropy              rows = tokens,                row_size = (local) vocabulary
and it moves `row_tensors` such [rows, row_size] tensors, `vectors` parameter-shaped
[table_rows, row_size] tensors (norm weights and biases: table_rows = 1; RoPE's cos/sin tables)
and `row_stats` 4-byte values per row (fp32 rstd/mean/log-sum-exp; an int64 label counts 2).
Weight-gradient partial sums (a few [programs, row_size] fp32 rows, ~1-2% of the traffic at
training shapes) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOpTraffic:
    """Tensors one fused op reads plus writes, in the units of the module docstring."""

    forward_row_tensors: int
    backward_row_tensors: int
    forward_vectors: int = 0
    backward_vectors: int = 0
    forward_row_stats: int = 0
    backward_row_stats: int = 0
    what: str = ""
    """which tensors, forward; backward"""


FUSED_OP_TRAFFIC: dict[str, FusedOpTraffic] = {
    "rms_norm_residual": FusedOpTraffic(
        forward_row_tensors=4, backward_row_tensors=4, forward_vectors=1, backward_vectors=2,
        forward_row_stats=1, backward_row_stats=1,
        what="read x, residual, weight; write normed, new_residual, rstd; "
             "read d_normed, d_new_residual, new_residual, weight, rstd; write dx, d_weight"),
    "rms_norm": FusedOpTraffic(
        forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
        forward_row_stats=1, backward_row_stats=1,
        what="read x, weight; write normed, rstd; read d_normed, x, weight, rstd; write dx, d_weight"),
    "layer_norm_residual": FusedOpTraffic(
        forward_row_tensors=4, backward_row_tensors=4, forward_vectors=2, backward_vectors=3,
        forward_row_stats=2, backward_row_stats=2,
        what="read x, residual, weight, bias; write normed, new_residual, mean, rstd; read d_normed, "
             "d_new_residual, new_residual, weight, mean, rstd; write dx, d_weight, d_bias"),
    "bias_gelu": FusedOpTraffic(
        forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
        what="read x, bias; write y; read dy, x, bias; write dx, d_bias"),
    "swiglu": FusedOpTraffic(
        forward_row_tensors=3, backward_row_tensors=5,
        what="read gate, up; write y; read dy, gate, up; write d_gate, d_up"),
    "geglu": FusedOpTraffic(  # SwiGLU's kernels with GELU-tanh: the same bytes
        forward_row_tensors=3, backward_row_tensors=5,
        what="read gate, up; write y; read dy, gate, up; write d_gate, d_up"),
    "rope": FusedOpTraffic(
        forward_row_tensors=2, backward_row_tensors=2, forward_vectors=2, backward_vectors=2,
        what="read x, cos, sin; write y; read dy, cos, sin; write dx"),
    "cross_entropy": FusedOpTraffic(
        forward_row_tensors=1, backward_row_tensors=2, forward_row_stats=5, backward_row_stats=3,
        what="read logits, labels; write max, sum-exp, target logit; read logits, labels, lse; write d_logits"),
}


def fused_op_bytes(op: str, *, num_rows: int, row_size: int, itemsize: int, backward: bool = False,
                   table_rows: int = 1) -> int:
    """Bytes the forward (or the backward) of fused op `op` moves; see the module docstring."""
    if op not in FUSED_OP_TRAFFIC:
        raise KeyError(f"no traffic entry for fused op {op!r}; known: {sorted(FUSED_OP_TRAFFIC)}")
    traffic = FUSED_OP_TRAFFIC[op]
    row_tensors = traffic.backward_row_tensors if backward else traffic.forward_row_tensors
    vectors = traffic.backward_vectors if backward else traffic.forward_vectors
    row_stats = traffic.backward_row_stats if backward else traffic.forward_row_stats
    return (row_tensors * num_rows * row_size * itemsize + vectors * table_rows * row_size * itemsize
            + row_stats * num_rows * 4)
