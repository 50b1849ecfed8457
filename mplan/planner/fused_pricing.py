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
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.ir.graph import Graph, OpNode, dtype_bytes
from mplan.ir.placement import Placement, local_shape

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
"""Fitted by `fit_kernel_copy_fraction` on each kernel's headline shape in that file (RMSNorm's
taken from RMSNorm + residual's; GeGLU's from an ad hoc run with no result file); held out
(tests/test_held_out.py): the same run's other training shapes (`timing_more`), at that run's copy
rate within 7%. They are shares of the benchmark's copy rate (4.244 TB/s); the h200 profile's copy
table they multiply runs slower below a few GB (4.0 TB/s at 0.5 GB), so these kernels are priced
up to 25% above their measured times (the same test file bounds it)."""


def fit_kernel_copy_fraction(timing: dict[str, Any]) -> tuple[float, float]:
    """The rule MEASURED_COPY_FRACTION was fitted by, on one kernel's timing of
    benchmarks/kernels_h200.py (a `timing` or `timing_more` entry): the Triton kernel's forward and
    backward shares of copy bandwidth (fewest bytes over GPU kernel time at the run's copy rate),
    each capped at 1.0."""
    triton = timing["triton"]
    return min(triton["fwd_copy_fraction"], 1.0), min(triton["bwd_copy_fraction"], 1.0)


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
    from mplan.ir.fusion_coverage import fused_chains
    from mplan.ir.fusion_patterns import FUSION_PATTERNS

    if graph.program is None:
        return {}
    chains: dict[str, FusedChain] = {}
    measured = [pattern for pattern in FUSION_PATTERNS if pattern.name in MEASURED_COPY_FRACTION]
    for kernel, match in fused_chains(graph, measured):
        chain = FusedChain(op=kernel, anchor=match.anchor.name)
        chains.update({n.name: chain for n in match.chain if n.name in graph and graph.node(n.name).kind != "matmul"})
    return chains


@dataclass(frozen=True, slots=True)
class FusedSave:
    """What a fused kernel keeps for its backward, in place of what its chain's ATen ops keep."""

    kept: tuple[str, ...] = ()
    """IR values the kernel saves (activations; a parameter among them is no activation)"""
    extra: tuple[tuple[str, str], ...] = ()
    """its own side tensors, as (IR node, measure): "rows4" one fp32 per row of the node's
    value (a norm's rstd, a loss's or attention's log-sum-exp), "rows8" two, "inputI" a tensor
    the size and dtype of the node's I-th input (the fused head + loss's gradient buffers)"""
    causal: bool = False
    """attention that runs causally (`is_causal`, or a mask the pattern proved causal)"""
    inside: bool = False
    """a chain node other than its anchor: its value is never made (the kernel computes it in
    registers or in chunks), and it keeps nothing"""
    chunked: bool = False
    """inside a kernel that makes this value one chunk of rows at a time (the fused head + loss's
    logits): that chunk is the kernel's working memory (`HeadChunking`)"""
    kernel: str = ""
    """on a chain's anchor: the fused op it runs (a key of FUSED_LAUNCHES), for its host time"""


NOTHING_KEPT = FusedSave()
"""A fused op that keeps nothing (RoPE: its tables are buffers)."""
INSIDE_A_KERNEL = FusedSave(inside=True)
"""A chain node other than its anchor: the fused kernel took over its value and what it kept."""
MADE_IN_CHUNKS = FusedSave(inside=True, chunked=True)
"""The fused head + loss's logits: never whole, one chunk of rows at a time."""


def _keeps(kernel: str, match: Any) -> FusedSave:
    """What `mplan.kernels` keeps for each fused op (their autograd Functions' saved tensors)."""
    p, name = match.params, (lambda node: node.name)
    anchor = match.anchor.name
    if kernel in ("rms_norm_residual", "layer_norm_residual"):  # the sum, rstd (LayerNorm: and mean)
        return FusedSave((name(match.outputs[1]),), ((anchor, "rows4" if kernel == "rms_norm_residual" else "rows8"),))
    if kernel == "rms_norm":
        return FusedSave((name(p["x"]),), ((anchor, "rows4"),))
    if kernel == "linear_group":  # the input; the weights are parameters, their concatenation not kept
        return FusedSave((name(p["x"]),))
    if kernel == "bias_gelu":  # the GEMM's input and its unbiased output
        return FusedSave((name(p["x"]), name(p["linear"])))
    if kernel in ("linear_swiglu", "linear_geglu"):  # the GEMM's input, the packed [gate | up] product
        return FusedSave((name(p["x"]), name(p["gate"]), name(match.chain[1])))
    if kernel in ("swiglu", "geglu"):
        return FusedSave((name(p["gate"]), name(p["up"])))
    if kernel == "cross_entropy":  # the logits in their own dtype (never an fp32 copy), lse
        return FusedSave((name(p["logits"]),), ((name(p["logits"]), "rows4"),))
    if kernel == "linear_cross_entropy":  # d_x, d_W (d_b): the head's inputs' sizes; no logits at all
        head = name(match.chain[0])
        return FusedSave((), tuple((head, f"input{i}") for i in range(3 if p["bias"] is not None else 2)))
    if kernel == "attention":  # q, k, v (unrepeated under GQA), the output, lse
        return FusedSave((*(name(n) for n in match.inputs), anchor), ((name(match.inputs[0]), "rows4"),),
                         causal=bool(p["options"]["is_causal"]))
    return NOTHING_KEPT  # rope: its tables are buffers


def find_fused_saves(graph: Graph) -> dict[str, FusedSave]:
    """Node name -> what the fused kernel its chain becomes keeps (on the anchor; INSIDE_A_KERNEL
    on the chain's other nodes), for every chain `fuse_kernels` fuses (mplan.ir.fusion_coverage).
    The memory model counts these instead of the ATen ops' saves: Hugging Face's fp32 copies
    inside norms and loss, the causal mask, repeated keys and values, whole logits."""
    from mplan.ir.fusion_coverage import fused_chains

    if graph.program is None:
        return {}
    saves: dict[str, FusedSave] = {}
    for kernel, match in fused_chains(graph):
        saves.update({node.name: INSIDE_A_KERNEL for node in match.chain if node.name in graph})
        if kernel == "linear_cross_entropy" and match.chain[0].name in graph:  # the head GEMM's logits
            saves[match.chain[0].name] = MADE_IN_CHUNKS
        saves[match.anchor.name] = replace(_keeps(kernel, match), kernel=kernel)
    return saves


@dataclass(frozen=True, slots=True, kw_only=True)
class Launches:
    """Kernels one call of a fused op launches, by who launches them: Triton kernels from the
    op's Python, ATen ops it calls (GEMMs, the sum of a norm's weight-gradient partials)."""

    forward_triton: int
    forward_aten: int
    backward_triton: int
    backward_aten: int


FUSED_LAUNCHES: dict[str, Launches] = {
    # counted in mplan/kernels (2026-12-05); allocations (torch.empty) and views launch nothing
    "rms_norm_residual": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1),  # + sum_partials
    "rms_norm": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1),
    "layer_norm_residual": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1),
    "bias_gelu": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1),  # + db's sum
    "swiglu": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=0),
    "geglu": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=0),
    # the packed [gate | up] GEMM, then the packed kernel; backward: the packed kernel, dX and dW GEMMs
    "linear_swiglu": Launches(forward_triton=1, forward_aten=1, backward_triton=1, backward_aten=2),
    "linear_geglu": Launches(forward_triton=1, forward_aten=1, backward_triton=1, backward_aten=2),
    "rope": Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=0),
    # block statistics, combine, mean; backward: the gradient kernel
    "cross_entropy": Launches(forward_triton=3, forward_aten=0, backward_triton=1, backward_aten=0),
    # PER CHUNK of rows (`HeadChunking`): statistics, combine, gradient in place; the logits, d_x and
    # d_W GEMMs. Backward: d_x and d_W scaled by the loss's gradient
    "linear_cross_entropy": Launches(forward_triton=3, forward_aten=3, backward_triton=2, backward_aten=0),
    # the weights' concatenation and one GEMM; backward: dX and dW GEMMs
    "linear_group": Launches(forward_triton=0, forward_aten=2, backward_triton=0, backward_aten=2),
    "attention": Launches(forward_triton=0, forward_aten=1, backward_triton=0, backward_aten=1),  # SDPA
}
"""Kernels per call of each fused op (`fuse_kernels`' kernels), what `host_cost` charges a fused
chain's anchor in host time; RoPE on q and k paired into one launch is counted as two."""


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

        return min(self.rows, default_chunk_rows(self.vocab, dtype_bytes(self.dtype)))

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
    from mplan.ir.fusion_patterns import feeds_the_loss

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
