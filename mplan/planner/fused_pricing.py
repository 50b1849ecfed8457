"""Prices of the memory-bound chains that `fuse_kernels` turns into one Triton kernel.

Without kernels every memory-bound op is charged its own reads and writes (op_cost.py). With
them (`autoparallel(kernels=True)`, the default on CUDA) a whole chain (norm + residual add,
bias + GELU, SwiGLU, RoPE, cross-entropy) runs as one kernel that moves `fused_op_bytes` at the
fraction of copy bandwidth the H200 measured for it. `find_fused_chains` finds the chains with
the patterns the pass fuses (mplan.ir.fusion_patterns, in the pass's order), matched on the
captured program (nothing is rewritten); `OpCoster` then charges a chain's anchor the fused
kernel and its other ops nothing. GEMMs and attention keep their prices (the grouped q/k/v
GEMM is priced as its parts; bias+GELU's GEMM stays a GEMM), except under FP8
(`find_fp8_linears`, `fp8_linear_time`): the block linears as FP8 GEMMs plus their casts.

Measured: `MEASURED_COPY_FRACTION` is the share of the device-to-device copy bandwidth each
kernel reached on the H200, forward and backward separately, by GPU kernel time at the kernel
benchmark's main 16384-row training shapes (benchmarks/results/kernels_h200-2026-11-29-session7.json);
above 1.0 (SwiGLU, the RoPE and cross-entropy forwards) is capped at 1.0. Elsewhere the same
fractions are assumed, which is a prediction (at hidden 2048 the norm backwards measured a little
lower: 0.88 RMSNorm, 0.85 LayerNorm; bias+GELU's backward at 8192 features 0.91; RoPE's in
Llama's transposed layout 0.93).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.ir.graph import Graph, OpNode, dtype_bytes

MEASURED_COPY_FRACTION: dict[str, tuple[float, float]] = {
    # fused op: (forward, backward) share of copy bandwidth, H200, 2026-11-29 (session 7's run)
    "rms_norm_residual": (0.965, 0.943),
    "rms_norm": (0.965, 0.943),  # the same kernel without the residual read
    "layer_norm_residual": (0.971, 0.899),
    "bias_gelu": (0.940, 0.944),
    "swiglu": (1.0, 1.0),
    "geglu": (1.0, 1.0),  # SwiGLU's kernels: 103% forward at 16384 x 14336 (H200, 2026-12-02, one ad hoc run)
    "rope": (1.0, 0.987),
    "cross_entropy": (1.0, 0.994),
}


@dataclass(frozen=True, slots=True)
class FusedChain:
    op: str
    """the fused op, a key of MEASURED_COPY_FRACTION and FUSED_OP_TRAFFIC"""
    anchor: str
    """the node the kernel replaces last: it is charged the whole kernel"""


def find_fused_chains(graph: Graph) -> dict[str, FusedChain]:
    """Node name -> the memory-bound fused chain it belongs to, for the IR nodes of `graph`
    (needs the captured program; an empty map without one)."""
    # imported here: the patterns need torch, which this module (and the IR graph) does not load
    from mplan.ir.fusion_patterns import FUSION_PATTERNS

    if graph.program is None:
        return {}
    patterns = [pattern for pattern in FUSION_PATTERNS if pattern.name in MEASURED_COPY_FRACTION]
    chains: dict[str, FusedChain] = {}
    for node in graph.program.graph.nodes:
        if node.op != "call_function" or node.name in chains:
            continue
        for pattern in patterns:
            if node.target not in pattern.anchors:
                continue
            match = pattern.match(node)
            names = {n.name for n in match.chain} if match is not None else set()
            if not names or names & chains.keys():
                continue
            chain = FusedChain(op=pattern.name, anchor=node.name)
            chains.update({name: chain for name in names if name in graph and graph.node(name).kind != "matmul"})
            break
    return chains


def find_fp8_linears(graph: Graph) -> frozenset[str]:
    """The linears `fuse_kernels(fp8=True)` runs in FP8: every `aten.linear` but the output head
    (whose value reaches the loss). Their GEMM dimensions are checked where they are priced, on
    local shapes (`fp8_linear_time`)."""
    from mplan.ir.fusion_patterns import feeds_the_loss

    if graph.program is None:
        return frozenset()
    return frozenset(node.name for node in graph.program.graph.nodes
                     if node.op == "call_function" and str(node.target) == "aten.linear.default"
                     and node.name in graph and not feeds_the_loss(node))


FP8_CAST_COPY_FRACTION = 0.84
"""Share of copy bandwidth the FP8 cast kernel reached on the H200 at 16384 x 2048-8192
(benchmarks/results/fp8_h200-2026-11-29.json: 82-86%)."""


def fp8_linear_time(compute: ComputeCostModel, m: int, n: int, k: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of an FP8 linear x[m, k] W[n, k]^T as kernels.fp8 runs it, or
    None where FP8 cannot run it (a dimension not a multiple of 16): three FP8 GEMMs plus the casts,
    each reading 2 bytes and writing 2 (both layouts) per element, of x and W forward and of the
    output gradient backward. Against the H200's measured FP8 linears at seven block shapes this
    predicts 0.95-1.17x their time, without a fitted constant."""
    if any(d % 16 for d in (m, n, k)):
        return None
    cast = lambda elements: compute.memory_bound_time(4.0 * elements / FP8_CAST_COPY_FRACTION)  # noqa: E731
    forward = compute.matmul_time(m, n, k, "fp8") + cast(m * k) + cast(n * k)
    backward = compute.matmul_time(m, k, n, "fp8") + compute.matmul_time(n, k, m, "fp8") + cast(m * n)
    return forward, backward


def fused_bytes(chain: FusedChain, anchor: OpNode, backward: bool) -> int:
    """Bytes the fused kernel moves, from the anchor's (full, unsharded) shapes."""
    from mplan.kernels.op_bytes import fused_op_bytes

    if chain.op == "cross_entropy":
        logits = anchor.input_metas[0]
        rows, row_size, itemsize = math.prod(logits.shape[:-1]), logits.shape[-1], dtype_bytes(logits.dtype)
        return fused_op_bytes(chain.op, num_rows=rows, row_size=row_size, itemsize=itemsize, backward=backward)
    out = anchor.output
    rows, row_size = math.prod(out.shape[:-1]), out.shape[-1]
    table_rows = out.shape[-2] if chain.op == "rope" else 1
    return fused_op_bytes(chain.op, num_rows=rows, row_size=row_size, itemsize=dtype_bytes(out.dtype),
                          backward=backward, table_rows=table_rows)
