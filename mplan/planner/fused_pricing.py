"""Prices of the memory-bound chains that `fuse_kernels` turns into one Triton kernel.

Without kernels every memory-bound op is charged its own reads and writes (op_cost.py). With
them (`autoparallel(kernels=True)`, the default on CUDA) a whole chain (norm + residual add,
bias + GELU, SwiGLU, RoPE, cross-entropy) runs as one kernel that moves `fused_op_bytes` at the
fraction of copy bandwidth the H200 measured for it. `find_fused_chains` finds the chains with
the fusion registry's entries (mplan.fusion, in the pass's order), matched on the captured
program (nothing is rewritten); `OpCoster` then charges a chain's anchor the fused
kernel and its other ops nothing. GEMMs and attention keep their prices (the grouped q/k/v
GEMM is priced as its parts: the runtime lays their weights end to end, so the GEMM reads
them in place, `runtime/grouped_storage.py`; bias+GELU's GEMM stays a GEMM), except under FP8
(`find_fp8_linears`, `fp8_linear_time`): the block linears as FP8 GEMMs plus their casts.

Memory and attention: `find_fused_saves` gives, for every chain the pass fuses (GEMM groups,
attention and the fused head + loss included), what the fused kernel keeps for its backward;
the sharding ILP's activation count (`sharding_ilp._saved_bytes`) takes that instead of the
chain's ATen ops' saves (Hugging Face's fp32 copies inside norms and loss, the causal mask,
repeated keys and values, whole logits), and the chain's inside is no transient, except the fused
head + loss's chunk of logits, its working memory (`HeadChunking`). Attention with
a mask the pattern proved causal is priced causal. On the H200 (2026-12-02) HF Llama-1.1B at 8 x
2048 under `dp=1` measured 211.4 ms and 30.06 GiB; priced so, 213.8 ms (+1.2%) and 31.4 GiB
(+4.5%, the allocator's 10% share included); priced on the ATen ops, 257 ms and 51.5 GiB. That
run predates `kernels.grouped_linear` (about 1.3 GiB less kept; not yet measured), so the memory
comparison is to be redone.

Measured: each memory-bound entry's `MeasuredPricing.copy_fraction` (mplan.fusion) is the share
of the device-to-device copy bandwidth the kernel reached on the H200, forward and backward
separately, by GPU kernel time at the kernel benchmark's main 16384-row training shapes
(benchmarks/results/kernels_h200-2026-11-29-session7.json); above 1.0 (SwiGLU, the RoPE and
cross-entropy forwards) is capped at 1.0 (`fit_kernel_copy_fraction`). Elsewhere the same
fractions are assumed, which is a prediction (at hidden 2048 the norm backwards measured a little
lower: 0.88 RMSNorm, 0.85 LayerNorm; bias+GELU's backward at 8192 features 0.91; RoPE's in
Llama's transposed layout 0.93). Held out (tests/test_held_out.py): the same run's other training
shapes (`timing_more`), at that run's copy rate within 7%. They are shares of the benchmark's copy
rate (4.244 TB/s); the h200 profile's copy table they multiply runs slower below a few GB (4.0
TB/s at 0.5 GB), so these kernels are priced up to 25% above their measured times (the same test
file bounds it). Every entry says how it is priced; none is skipped: an entry priced as its ATen
ops (`AtenPricing`: grouped GEMMs, attention) leaves its chain's ops their prices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.fusion.entry import INSIDE_A_KERNEL, MADE_IN_CHUNKS, FusedSave, MeasuredPricing
from mplan.ir.graph import Graph, OpNode, dtype_bytes
from mplan.ir.placement import Placement, local_shape

def fit_kernel_copy_fraction(timing: dict[str, Any]) -> tuple[float, float]:
    """The rule the entries' measured copy fractions were fitted by, on one kernel's timing of
    benchmarks/kernel_peers/fused.py (a `timing` or `timing_more` entry): the Triton kernel's forward and
    backward shares of copy bandwidth (fewest bytes over GPU kernel time at the run's copy rate),
    each capped at 1.0."""
    triton = timing["triton"]
    return min(triton["fwd_copy_fraction"], 1.0), min(triton["bwd_copy_fraction"], 1.0)


@dataclass(frozen=True, slots=True)
class FusedChain:
    op: str
    """the fused op (its entry's name)"""
    anchor: str
    """the node the kernel replaces last: it is charged the whole kernel"""
    pricing: MeasuredPricing
    """its entry's bytes and measured share of copy bandwidth"""


def find_fused_chains(graph: Graph) -> dict[str, FusedChain]:
    """Node name -> the memory-bound fused chain it belongs to, for the IR nodes of `graph`
    (needs the captured program; an empty map without one). Every entry's chain is found as the
    pass finds it; those priced as their ATen ops (`AtenPricing`) keep their ops' prices, and a
    chain's GEMMs keep theirs."""
    # imported here: the patterns need torch.fx, which this module (and the IR graph) does not load
    from mplan.fusion.coverage import fused_chains
    from mplan.fusion.registry import entry

    if graph.program is None:
        return {}
    chains: dict[str, FusedChain] = {}
    for kernel, match in fused_chains(graph):
        pricing = entry(kernel).pricing
        if not isinstance(pricing, MeasuredPricing):
            continue
        chain = FusedChain(op=kernel, anchor=match.anchor.name, pricing=pricing)
        chains.update({n.name: chain for n in match.chain if n.name in graph and graph.node(n.name).kind != "matmul"})
    return chains


def find_fused_saves(graph: Graph) -> dict[str, FusedSave]:
    """Node name -> what the fused kernel its chain becomes keeps (on the anchor, its entry's
    `keeps`; INSIDE_A_KERNEL naming the kernel on the chain's other nodes, MADE_IN_CHUNKS on what
    the kernel makes a chunk at a time), for every chain `fuse_kernels` fuses (mplan.fusion.coverage).
    The memory model counts these instead of the ATen ops' saves: Hugging Face's fp32 copies inside
    norms and loss, the causal mask, repeated keys and values, whole logits; `OpCoster` prices
    attention's chain as the one SDPA call it becomes."""
    from mplan.fusion.coverage import fused_chains
    from mplan.fusion.registry import entry

    if graph.program is None:
        return {}
    saves: dict[str, FusedSave] = {}
    for kernel, match in fused_chains(graph):
        kept = entry(kernel).keeps(match)
        inside = replace(INSIDE_A_KERNEL, kernel=kernel, gradients_in_forward=kept.gradients_in_forward)
        saves.update({node.name: inside for node in match.chain if node.name in graph})
        chunked = replace(MADE_IN_CHUNKS, gradients_in_forward=kept.gradients_in_forward)
        saves.update({name: chunked for name in kept.made_in_chunks if name in graph})
        saves[match.anchor.name] = replace(kept, kernel=kernel)
    return saves


@dataclass(frozen=True, slots=True)
class HeadChunking:
    """The fused head + loss on one rank for one micro-batch, as far as its chunk of rows matters:
    the chunk is its working memory (`working_bytes`), and a smaller one costs time (`seconds`)."""

    rows: int
    """local rows (tokens) of one micro-batch"""
    vocab: int
    """local vocabulary (V/tp under a vocabulary-parallel head)"""
    hidden: int
    dtype: str
    """the logits' (the GEMMs') dtype"""

    @property
    def default_rows(self) -> int:
        """Rows per chunk the op takes when the plan names none."""
        from mplan.kernels.head_loss import default_chunk_rows  # loads Triton: only graphs with the fused head pay

        return min(self.rows, default_chunk_rows(self.vocab, dtype_bytes(self.dtype), self.hidden))

    def working_bytes(self, chunk_rows: int | None = None) -> int:
        """One chunk's logits and row statistics (`kernels.head_loss.chunk_bytes`); None: the default chunk."""
        from mplan.kernels.head_loss import chunk_bytes

        return chunk_bytes(self.rows, self.vocab, dtype_bytes(self.dtype), chunk_rows, hidden=self.hidden)

    def smaller_chunks(self) -> Iterator[int]:
        """Chunk rows below the default, halving: what a plan short of memory tries, largest first."""
        rows = self.default_rows // 2
        while rows >= 1:
            yield rows
            rows //= 2

    def seconds(self, compute: ComputeCostModel, chunk_rows: int) -> float:
        """The op's GEMMs at `chunk_rows` rows a chunk (logits, d_x and d_W, all in its forward),
        what a chunk size changes. Every chunk after the first adds its d_W into the running one,
        reading and writing all V x H of it: that GEMM takes its FLOPs' time or that traffic's,
        whichever is longer (the traffic binds below about 300 rows on the H200)."""
        full, last = divmod(self.rows, chunk_rows)
        v, h = self.vocab, self.hidden
        accumulate = compute.memory_bound_time(2 * v * h * dtype_bytes(self.dtype))

        def chunk(m: int, first: bool) -> float:
            d_w = compute.matmul_time(v, h, m, self.dtype)
            return (compute.matmul_time(m, v, h, self.dtype) + compute.matmul_time(m, h, v, self.dtype)
                    + (d_w if first else max(d_w, accumulate)))

        return (chunk(chunk_rows, True) + (full - 1) * chunk(chunk_rows, False)
                + (chunk(last, full == 0) if last else 0.0))


def head_chunking(node: OpNode, placement: Placement, n: int) -> HeadChunking:
    """The fused head + loss whose logits are `node`'s output (the head GEMM), on one of `n` TP
    ranks, its output placed by `placement`."""
    shape = local_shape(node.output.shape, placement, n)
    return HeadChunking(rows=math.prod(shape[:-1]), vocab=shape[-1], hidden=node.input_metas[0].shape[-1],
                        dtype=node.output.dtype)


def extra_saved_bytes(graph: Graph, save: FusedSave) -> int:
    """The bytes of a fused kernel's side tensors at `graph`'s (rebatched) shapes."""
    total = 0
    for value, measure in save.extra:
        if value not in graph:
            continue
        node = graph.node(value)
        if measure.startswith("input"):
            total += node.input_metas[int(measure.removeprefix("input"))].nbytes
        elif node.outputs:
            total += (4 if measure == "rows4" else 8) * math.prod(node.output.shape[:-1])
    return total


def find_fp8_linears(graph: Graph) -> frozenset[str]:
    """The linears `fuse_kernels(fp8=True)` runs in FP8: every `aten.linear` but the output head
    (whose value reaches the loss). Their GEMM dimensions are checked where they are priced, on
    local shapes (`fp8_linear_time`)."""
    from mplan.fusion.graph_match import feeds_the_loss

    if graph.program is None:
        return frozenset()
    return frozenset(node.name for node in graph.program.graph.nodes
                     if node.op == "call_function" and str(node.target) == "aten.linear.default"
                     and node.name in graph and not feeds_the_loss(node))


FP8_CAST_COPY_FRACTION = 0.84
"""Share of copy bandwidth the FP8 cast kernel reached on the H200 at 16384 x 2048-8192
(benchmarks/results/fp8_h200-2026-11-29.json: 82-86%): `fit_fp8_cast_fraction` on its three
16384-row casts (its 1000 x 3000 cast, at the launch floor, aside). Held out
(tests/test_held_out.py): refitted on two of the three, the third's time predicted."""


def fit_fp8_cast_fraction(fractions: Sequence[float]) -> float:
    """The rule FP8_CAST_COPY_FRACTION was fitted by: the middle of the measured casts' range of
    copy-bandwidth shares, to two places."""
    return round((min(fractions) + max(fractions)) / 2, 2)


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
    traffic = chain.pricing.traffic
    value = anchor.input_metas[0] if traffic.rows_of == "input0" else anchor.output
    rows, row_size = math.prod(value.shape[:-1]), value.shape[-1]
    table_rows = value.shape[-2] if traffic.table_rows_of == "seq" else 1
    return traffic.bytes(num_rows=rows, row_size=row_size, itemsize=dtype_bytes(value.dtype), backward=backward,
                         table_rows=table_rows)
