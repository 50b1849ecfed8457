"""Dynamic context parallelism, priced (issue 34, item 4): what choosing the CP size per packed
sequence, or per document, from its documents' lengths saves over one fixed CP size, on the
expected mix of lengths of the data.

Input: a `LengthMix` (document lengths in tokens, each at most the packed sequence: a list, a
published histogram (`LengthMix.from_histogram`) or the lengths read from prepared token shards,
`mplan.data.document_lengths`), one transformer layer's shapes (`LayerShape`), the packed
sequence length S, the fixed CP size cp and a `ClusterSpec` (a preset, or a measured profile).
Output: `DynamicContextPrice`: the expected step seconds per packed sequence (forward and
backward of every layer, on the busiest rank) under three schemes, and the speed-ups.

Why: a packed sequence of short documents has little attention to hide a ring's K, V hops
behind, and a cp group crossing nodes pays InfiniBand hops for every one; run on fewer ranks
(one: none at all), those documents skip the exchange. How much that buys depends on the mix of
lengths, so the mix is the input, and every second is mplan's own cost models': GEMMs and
attention by `ComputeCostModel` (measured tables where the cluster has a profile), the ring's
exchange by `context_pricing.exchange` (`collective_time` hops, hidden behind attention blocks
where the device overlaps them), as the planner prices a cp plan.

Packing, as mplan's loader packs: the documents in the mix's order are one token stream cut into
windows of S tokens (a document crossing a window's edge becomes two pieces); the tail short of
a window is dropped. The same pieces go to every scheme. M = S / cp tokens per rank.

    fixed      every window over the cp ranks with the runtime's layout
               (`context_layout.balance_attention`): per rank the GEMMs of M rows, its attention
               pairs' share of the window's attention, the ring's exposed exchange
    two_size   the runtime's rule (`runtime.lowering.document_layout`): a window whose documents
               deal whole onto the cp ranks with balanced work (`context_layout.whole_documents`)
               runs each rank's documents alone (cp=1, no exchange, the busiest rank paces);
               any other window as `fixed`
    dynamic    each piece on the smallest power-of-two c <= cp with length <= c M (as Megatron-LM's
               hybrid CP and benchmarks/planning/dynamic_cp.py define it); pieces at c = 1 packed first-fit
               decreasing into units of M tokens on one rank, each piece at c > 1 (longer than
               c M / 2, so alone in its unit) over c ranks, head-tail balanced, with the ring's
               exchange on a group of c. Priced in rank-seconds / cp: the scheduler is assumed
               to keep every rank busy and a unit's free room costs nothing, an upper bound on
               what a real schedule of units gets

Per layer, one rank of a group of c holding T tokens:
    linears    for each linear (in -> out) of `LayerShape.linears`: forward [T, in] @ [in, out],
               backward [T, out] @ [out, in] and the weight gradient [out, T] @ [T, in]
               (`ComputeCostModel.matmul_time`)
    attention  a set of documents is one varlen kernel: priced as `attention_time` (causal,
               forward + backward) of n documents of their root-mean-square length, scaled by
               their true pairs (sum L(L+1)/2) over that batch's; a rank pays the share of the
               set's pairs its queries hold (one document: exactly `attention_time` of it)
    exchange   `context_pricing.exchange(method, c, ...)` at the rank's K, V bytes (T tokens x
               kv_heads x head_dim x 2 x dtype bytes) and attention seconds, on the group
               `GroupShape(c, min(c, gpus_per_node))`: cp innermost, tp = 1

Windows packed another way (`price_windows`, e.g. `mplan.data.cp_packing`'s windows for the
cp ranks, padding given as one-token documents): the seconds of each window under `fixed` and under
`two_size`, and whether the rule runs it at cp=1; padding is priced as the tokens it is (GEMM rows
and their own attention), so a caller comparing packings divides by the real tokens.

Not priced (equal per token in every scheme, so they dilute the speed-up a little): norms,
activations and residual adds, the embedding and the head, the gradient reduction.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.dtypes import dtype_bytes
from mplan.ir.attention_mask import CAUSAL, doc_ids_from_lengths, keys_per_query
from mplan.ir.context_layout import balance_attention, whole_documents
from mplan.ir.mesh import GroupShape
from mplan.planner.context_pricing import AttentionOp, exchange
from mplan.planner.host_cost import host_timing
from mplan.planner.parallel_config import CP_METHODS


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShape:
    """One decoder layer (attention + gated MLP), whole on one rank (tp = 1)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    num_layers: int = 1
    dtype: str = "bf16"

    def linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of each linear: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.hidden
        return ((h, q), (h, kv), (h, kv), (q, h), (h, self.ffn), (h, self.ffn), (self.ffn, h))

    def kv_bytes(self, tokens: int) -> float:
        """K and V of `tokens` tokens, bytes."""
        return 2.0 * tokens * self.kv_heads * self.head_dim * dtype_bytes(self.dtype)


LLAMA3_8B = LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, num_layers=32)
"""Llama-3-8B's layer (Meta's config.json: hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336, 32 layers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthMix:
    """Document lengths in tokens, in the order the stream packs them, and where they come from."""

    lengths: tuple[int, ...]
    source: str

    @classmethod
    def from_histogram(cls, edges: Sequence[int], counts: Sequence[int], *, num_documents: int, seed: int,
                       source: str) -> LengthMix:
        """`num_documents` lengths drawn from a histogram: bin i holds counts[i] documents of
        lengths in [edges[i], edges[i+1]); a bin is chosen in proportion to its count, a length
        log-uniform within it (the shape inside a bin is not published: an assumption)."""
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:])) or min(edges) < 1:
            raise ValueError(f"histogram: {len(edges)} increasing edges >= 1 needed for {len(counts)} bins")
        weights = np.asarray(counts, dtype=np.float64)
        if weights.sum() <= 0 or (weights < 0).any():
            raise ValueError(f"histogram: counts must be >= 0 with a positive total, got {list(counts)}")
        rng = np.random.default_rng(seed)
        bins = rng.choice(len(counts), size=num_documents, p=weights / weights.sum())
        low, high = np.log(np.asarray(edges[:-1], dtype=np.float64)), np.log(np.asarray(edges[1:], dtype=np.float64))
        drawn = np.exp(rng.uniform(low[bins], high[bins]))
        return cls(lengths=tuple(int(n) for n in np.clip(np.floor(drawn), edges[0], edges[-1] - 1)), source=source)

    def windows(self, seq_len: int) -> list[list[int]]:
        """The pieces of each window of `seq_len` tokens (module docstring: the loader's packing);
        refuses an empty mix, a length outside [1, seq_len] or too few tokens for one window."""
        if not self.lengths:
            raise ValueError(f"length mix {self.source!r}: no documents")
        if min(self.lengths) < 1 or max(self.lengths) > seq_len:
            bad = next(n for n in self.lengths if n < 1 or n > seq_len)
            raise ValueError(f"length mix {self.source!r}: a document of {bad} tokens is outside [1, {seq_len}] "
                             f"(cut documents longer than the packed sequence first: `cut_documents`)")
        if sum(self.lengths) < seq_len:
            raise ValueError(f"length mix {self.source!r}: {sum(self.lengths)} tokens fill no packed sequence "
                             f"of {seq_len}")
        out: list[list[int]] = []
        current, room = [], seq_len
        for n in self.lengths:
            while n > 0:
                take = min(n, room)
                current.append(take)
                n, room = n - take, room - take
                if room == 0:
                    out.append(current)
                    current, room = [], seq_len
        return out


def cut_documents(lengths: Sequence[int], seq_len: int) -> list[int]:
    """Each document longer than `seq_len` as pieces of `seq_len` and its remainder, in order."""
    out: list[int] = []
    for n in lengths:
        out.extend([seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else []))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicContextPrice:
    """Expected seconds per packed sequence (all layers, forward and backward, busiest rank)."""

    seq_len: int
    cp: int
    method: str
    num_sequences: int  # windows priced
    num_documents: int  # pieces in them
    fixed_s: float
    two_size_s: float
    dynamic_s: float
    two_size_whole: float  # fraction of windows the runtime's rule runs at cp=1
    tokens_at: tuple[tuple[int, float], ...]  # dynamic: (c, fraction of tokens on groups of c)

    @property
    def speedup(self) -> float:
        """fixed / dynamic (power-of-two sizes)."""
        return self.fixed_s / self.dynamic_s

    @property
    def two_size_speedup(self) -> float:
        """fixed / two_size (the runtime's rule)."""
        return self.fixed_s / self.two_size_s


class _Pricer:
    """Per-layer seconds of one rank (module docstring), cached by shape."""

    def __init__(self, layer: LayerShape, cluster: ClusterSpec, method: str) -> None:
        self.layer, self.cluster, self.method = layer, cluster, method
        self.compute = ComputeCostModel(cluster)
        self.overlaps = host_timing(cluster).overlaps
        self._linear: dict[int, float] = {}

    def linear_s(self, rows: int) -> float:
        if rows not in self._linear:
            mm, d = self.compute.matmul_time, self.layer.dtype
            self._linear[rows] = sum(mm(rows, o, i, d) + mm(rows, i, o, d) + mm(o, i, rows, d)
                                     for i, o in self.layer.linears()) if rows > 0 else 0.0
        return self._linear[rows]

    def attention_s(self, lengths: Sequence[int]) -> tuple[float, float]:
        """Forward, backward seconds of `lengths` as one varlen call (module docstring)."""
        if not lengths:
            return 0.0, 0.0
        n = len(lengths)
        rms = max(1, round(math.sqrt(sum(x * x for x in lengths) / n)))
        scale = sum(x * (x + 1) for x in lengths) / (n * rms * (rms + 1))
        t = self.compute.attention_time
        layer = self.layer
        return tuple(scale * t(n, layer.heads, rms, rms, layer.head_dim, layer.dtype, True, backward)
                     for backward in (False, True))  # type: ignore[return-value]

    def rank_s(self, c: int, tokens: int, forward: float, backward: float) -> float:
        """One rank of a group of c: GEMMs of `tokens` rows, its attention, the exposed exchange."""
        seconds = self.linear_s(tokens) + forward + backward
        if c > 1:
            layer = self.layer
            op = AttentionOp(q_bytes=tokens * layer.heads * layer.head_dim * dtype_bytes(layer.dtype),
                             kv_bytes=layer.kv_bytes(tokens),
                             out_bytes=tokens * layer.heads * layer.head_dim * dtype_bytes(layer.dtype),
                             num_heads=layer.heads, num_kv_heads=layer.kv_heads,
                             forward_s=forward, backward_s=backward)
            group = GroupShape(size=c, ranks_per_node=min(c, self.cluster.gpus_per_node))
            ex = exchange(self.method, c, op, self.cluster, group, self.overlaps)
            seconds += ex.forward_s + ex.backward_s
        return seconds

    def fixed_s(self, pieces: list[int], seq_len: int, cp: int) -> float:
        """The window over all cp ranks, the runtime's balanced layout, busiest rank."""
        doc_ids = doc_ids_from_lengths(pieces)
        layout = balance_attention(seq_len, cp, doc_ids=doc_ids)
        per_position = keys_per_query(CAUSAL, seq_len, doc_ids).numpy().sum(axis=0)
        forward, backward = self.attention_s(pieces)
        total = float(per_position.sum())
        busiest = 0.0
        for rank in range(cp):
            share = float(per_position[layout.positions(rank).numpy()].sum()) / total
            busiest = max(busiest, self.rank_s(cp, seq_len // cp, forward * share, backward * share))
        return busiest

    def whole_s(self, pieces: list[int], seq_len: int, cp: int) -> float | None:
        """The runtime's cp=1 case: each rank its whole documents alone; None where they do not deal."""
        doc_ids = doc_ids_from_lengths(pieces)
        layout = whole_documents(seq_len, cp, doc_ids)
        if layout is None:
            return None
        starts = np.cumsum([0] + pieces[:-1])
        by_start = dict(zip(starts.tolist(), pieces))
        busiest = 0.0
        for spans in layout.spans:
            mine = []
            for a, b in spans:  # adjacent documents of one rank are merged into one span
                while a < b:
                    mine.append(by_start[a])
                    a += by_start[a]
            busiest = max(busiest, self.rank_s(1, seq_len // cp, *self.attention_s(mine)))
        return busiest


def _pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing into units of `capacity` tokens."""
    units: list[list[int]] = []
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, free in enumerate(room):
            if n <= free:
                units[i].append(n)
                room[i] -= n
                break
        else:
            units.append([n])
            room.append(capacity - n)
    return units


def group_size(length: int, per_rank: int, cp: int) -> int:
    """The smallest power-of-two c <= cp whose c ranks of `per_rank` tokens hold `length`."""
    c = 1
    while c < cp and length > c * per_rank:
        c *= 2
    return c


def price_dynamic_context(mix: LengthMix, layer: LayerShape, cluster: ClusterSpec, *, seq_len: int, cp: int,
                          method: str = "ring") -> DynamicContextPrice:
    """The three schemes of the module docstring on `mix`, per packed sequence of `seq_len` tokens."""
    if cp < 2 or cp & (cp - 1) or seq_len % (2 * cp):
        raise ValueError(f"dynamic CP: cp must be a power of two >= 2 dividing seq_len / 2, got cp={cp}, "
                         f"seq_len={seq_len}")
    if method not in CP_METHODS:
        raise ValueError(f"dynamic CP: method {method!r} is not one of {', '.join(CP_METHODS)}")
    windows = mix.windows(seq_len)
    pricer = _Pricer(layer, cluster, method)
    per_rank = seq_len // cp
    fixed = two_size = 0.0
    whole = 0
    for pieces in windows:
        alone = pricer.whole_s(pieces, seq_len, cp)
        spread = pricer.fixed_s(pieces, seq_len, cp)
        fixed += spread
        two_size += spread if alone is None else alone
        whole += alone is not None
    by_size: dict[int, list[int]] = {}
    for n in (n for pieces in windows for n in pieces):
        by_size.setdefault(group_size(n, per_rank, cp), []).append(n)
    rank_seconds = 0.0
    for c, lengths in by_size.items():
        if c == 1:
            rank_seconds += sum(pricer.rank_s(1, sum(unit), *pricer.attention_s(unit))
                                for unit in _pack(lengths, per_rank))
        else:
            rank_seconds += sum(c * pricer.rank_s(c, -(-n // c), *(t / c for t in pricer.attention_s([n])))
                                for n in lengths)
    count, tokens = len(windows), len(windows) * seq_len
    layers = layer.num_layers
    return DynamicContextPrice(
        seq_len=seq_len, cp=cp, method=method, num_sequences=count, num_documents=sum(len(p) for p in windows),
        fixed_s=layers * fixed / count, two_size_s=layers * two_size / count,
        dynamic_s=layers * rank_seconds / cp / count, two_size_whole=whole / count,
        tokens_at=tuple((c, sum(by_size[c]) / tokens) for c in sorted(by_size)))


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowsPrice:
    """Seconds of each given window (all layers, forward and backward, busiest rank)."""

    fixed_s: tuple[float, ...]
    two_size_s: tuple[float, ...]
    whole: tuple[bool, ...]  # the runtime's rule runs the window at cp=1


def price_windows(windows: Sequence[Sequence[int]], layer: LayerShape, cluster: ClusterSpec, *, seq_len: int,
                  cp: int, method: str = "ring") -> WindowsPrice:
    """`fixed` and `two_size` (module docstring) of windows given as their documents' lengths in
    window order, each summing to `seq_len`."""
    if cp < 2 or seq_len % (2 * cp):
        raise ValueError(f"dynamic CP: cp must be >= 2 dividing seq_len / 2, got cp={cp}, seq_len={seq_len}")
    pricer = _Pricer(layer, cluster, method)
    fixed, two_size, whole = [], [], []
    for pieces in windows:
        pieces = list(pieces)
        if sum(pieces) != seq_len or min(pieces) < 1:
            raise ValueError(f"price_windows: a window's documents must be >= 1 token and sum to {seq_len}")
        spread = layer.num_layers * pricer.fixed_s(pieces, seq_len, cp)
        alone = pricer.whole_s(pieces, seq_len, cp)
        fixed.append(spread)
        two_size.append(spread if alone is None else layer.num_layers * alone)
        whole.append(alone is not None)
    return WindowsPrice(fixed_s=tuple(fixed), two_size_s=tuple(two_size), whole=tuple(whole))
