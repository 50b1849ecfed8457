"""The record of one fused kernel (`FusionEntry`) and the records its fields hold.

An entry says everything mplan knows about one fused kernel, in one place: the ATen chain it
replaces (`pattern`), what the kernel keeps for its backward (`keeps`, read by the memory
model), what it costs (`pricing`: its bytes and the share of copy bandwidth it was measured at,
or why its GEMMs keep their prices), how many kernels one call launches (`launches`, read by
the host-time model), the graph call that replaces a match (`emit`, run by the `fuse_kernels`
pass) and which of its outputs autocast would leave in fp32 (`marks`). mplan.fusion.registry
lists the entries in the order they are tried; tests/test_fusion_registry.py checks that none
lacks a field.

Matching: `FusionPattern.match(anchor)` returns a `PatternMatch`, None (the anchor starts no
chain of this kind) or a `Miss` (a near miss: the chain looks like this kernel's but a condition
fails, and the reason says which); `mplan inspect` and the pass's report show the misses.

Invariants: nothing here imports mplan.kernels or Triton at module level (the planner reads the
registry for every plan): an emitter imports its kernel when it runs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.fx import Graph, Node

__all__ = ["HEAD_CHUNK_ROWS_KEY", "INSIDE_A_KERNEL", "MADE_IN_CHUNKS", "SPLIT_BACKWARD_KEY", "AtenPricing", "Emitter", "FusedOpTraffic", "FusedSave", "FusionEntry", "FusionPattern", "Launches",
           "MeasuredPricing", "Miss", "NOT_MARKED", "PairedPattern", "PatternMatch", "call", "meta_like"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PatternMatch:
    """One matched chain: what a fused op replacing it takes over, reads and needs."""

    anchor: Node
    """the node the pattern was matched at (the fused call copies its source metadata)"""
    chain: tuple[Node, ...]
    """the matched nodes; a rewrite erases them once the fused call has taken over their uses"""
    outputs: tuple[Node, ...]
    """chain nodes whose values the fused op returns, in the order it returns them"""
    inputs: tuple[Node, ...]
    """graph values the fused op reads (a fused call must come after all of them)"""
    params: Mapping[str, Any]
    """the fused op's operands by name: graph values (also in `inputs`) and constants (eps,
    split sizes, SDPA's options); each entry's matcher says which"""


@dataclass(frozen=True, slots=True)
class Miss:
    """A chain that looks like the entry's but does not fit it, and why (shown by `mplan inspect`)."""

    why: str


Matcher = Callable[[Node], "PatternMatch | Miss | None"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FusionPattern:
    """A chain a fused op can replace: the ATen overloads it can end with, and its matcher."""

    anchors: tuple[Any, ...]
    match: Matcher


@dataclass(frozen=True, kw_only=True, slots=True)
class PairedPattern:
    """Two chains of another entry that feed one consumer together (RoPE on q and on k, both read
    by one attention call): the pass pairs them once every chain is fused."""

    of: str
    """the entry whose chains are paired"""
    consumers: str
    """what reads the pair, in words"""


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
    """the fused op (its entry's name) a chain's anchor runs, for its host time, or that a chain's
    other node runs inside, for its price (attention's: `op_cost.OpCoster`)"""
    made_in_chunks: tuple[str, ...] = ()
    """on a chain's anchor: chain values the kernel makes one chunk of rows at a time (the head's
    logits); each is `chunked` (MADE_IN_CHUNKS) rather than merely inside"""
    gradients_in_forward: bool = False
    """the kernel makes its inputs' gradients in forward and holds them on its autograd context,
    saving no tensor for autograd (the fused head + loss): torch's non-reentrant checkpoint stops
    re-running a region once every tensor it saved is back, so a recomputation that ends at such
    a kernel never re-runs it, and its `extra` (the gradients) stays whatever is recomputed"""


INSIDE_A_KERNEL = FusedSave(inside=True)
"""A chain node other than its anchor: the fused kernel took over its value and what it kept."""
MADE_IN_CHUNKS = FusedSave(inside=True, chunked=True)
"""The fused head + loss's logits: never whole, one chunk of rows at a time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Launches:
    """Kernels one call of a fused op launches, by who launches them: Triton kernels from the
    op's Python, ATen ops it calls (GEMMs, the sum of a norm's weight-gradient partials).
    Counted in mplan/kernels; allocations (torch.empty) and views launch nothing."""

    forward_triton: int
    forward_aten: int
    backward_triton: int
    backward_aten: int
    forward_per_chunk: bool = False
    """the forward counts are per chunk of rows (the fused head + loss, `HeadChunking`)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedOpTraffic:
    """Tensors one memory-bound fused op reads plus writes. A fused op is described by its
    "rows": `num_rows` rows of `row_size` elements in the activation dtype (`itemsize` bytes):
        norms, bias+GELU, GLUs   rows = tokens,               row_size = hidden / features
        RoPE                     rows = batch * heads * seq,  row_size = head_dim, table_rows = seq
        cross-entropy            rows = tokens,               row_size = (local) vocabulary
    and it moves `row_tensors` such [rows, row_size] tensors, `vectors` parameter-shaped
    [table_rows, row_size] tensors (norm weights and biases: table_rows = 1; RoPE's cos/sin tables)
    and `row_stats` 4-byte values per row (fp32 rstd/mean/log-sum-exp; an int64 label counts 2).
    Counts are the fewest bytes: every input read once, every output written once, as the kernels
    do (and as mplan/cost_models/reference/h200-kernels-2026-11-29.json counts them).
    Weight-gradient partial sums (~1-2% of the traffic at training shapes) are left out."""

    forward_row_tensors: int
    backward_row_tensors: int
    forward_vectors: int = 0
    backward_vectors: int = 0
    forward_row_stats: int = 0
    backward_row_stats: int = 0
    rows_of: Literal["output", "input0"] = "output"
    """whose shape gives rows and row_size: the anchor's output, or its first input (the loss's logits)"""
    table_rows_of: Literal["one", "seq"] = "one"
    """`table_rows`: 1, or the anchor output's second-to-last dim (RoPE's positions)"""
    what: str = ""
    """which tensors, forward; backward"""

    def bytes(self, *, num_rows: int, row_size: int, itemsize: int, backward: bool = False,
              table_rows: int = 1) -> int:
        """Bytes the forward (or the backward) moves."""
        row_tensors = self.backward_row_tensors if backward else self.forward_row_tensors
        vectors = self.backward_vectors if backward else self.forward_vectors
        row_stats = self.backward_row_stats if backward else self.forward_row_stats
        return (row_tensors * num_rows * row_size * itemsize + vectors * table_rows * row_size * itemsize
                + row_stats * num_rows * 4)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredPricing:
    """A memory-bound kernel: its bytes at the share of copy bandwidth it was measured at. The
    chain's GEMMs (a fused projection's, the head's) keep their own prices."""

    traffic: FusedOpTraffic
    copy_fraction: tuple[float, float]
    """(forward, backward) share of the device-to-device copy bandwidth the kernel reached"""
    source: str
    """where the fraction was measured"""


@dataclass(frozen=True, kw_only=True, slots=True)
class AtenPricing:
    """A chain priced as its ATen ops (GEMMs, SDPA): the kernel does the same arithmetic."""

    why: str


NOT_MARKED = "not marked"
"""`FusionEntry.marks` of an op whose outputs are never left in fp32 by autocast."""

Emitter = Callable[[Graph, PatternMatch], Node]
"""Adds a match's fused call(s) to the graph; returns the node giving its `outputs` (a tuple if several)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FusionEntry:
    """One fused kernel: everything mplan knows of it (module docstring)."""

    name: str
    """the fused op's name, as the pass's report, the plan and `mplan inspect` count it"""
    pattern: FusionPattern | PairedPattern
    forms: tuple[str, ...]
    """the ways models write the chain that the pattern takes, in words"""
    keeps: Callable[[PatternMatch], FusedSave]
    """what the kernel saves for its backward, from a match"""
    pricing: MeasuredPricing | AtenPricing
    launches: Launches
    emit: Emitter
    marks: int | str | None = NOT_MARKED
    """which output autocast would leave in fp32 and the pass marks with its consumer (norms of an
    fp32 residual stream, RoPE with fp32 tables): an index, None (the op's only output), "all"
    (each, all feeding one kind of consumer), or NOT_MARKED"""
    lesser: str | None = None
    """the entry that takes this chain's tail when this one misses (a miss is reported then)"""
    notes: dict[str, str] = field(default_factory=dict)
    """anything else a reader of the entry needs (its kernel, its limits)"""


def call(graph: Graph, target: Callable[..., Any], args: tuple[Any, ...], like: Node,
         kwargs: dict[str, Any] | None = None) -> Node:
    """A call_function node copying `like`'s source metadata (stack trace, module stack)."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({key: like.meta[key] for key in ("stack_trace", "nn_module_stack") if key in like.meta})
    return node


def meta_like(value: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A meta tensor of `value`'s dtype at `shape` (a new node's `meta["val"]`)."""
    return torch.empty(tuple(shape), dtype=value.dtype, device="meta")


SPLIT_BACKWARD_KEY = "fuse_kernels.aten_grouped_linears"
"""GraphModule.meta key: True when grouped GEMMs must stay ATen ops (a zero-bubble schedule splits
the backward into input and weight gradients; FP8's sweep must find them)."""
HEAD_CHUNK_ROWS_KEY = "fuse_kernels.head_chunk_rows"
"""GraphModule.meta key: rows per chunk of the fused head + loss, None for its default."""
