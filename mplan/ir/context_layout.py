"""How a sequence is split over the ranks of a context-parallel (`cp`) axis, and how balanced
the attention work of that split is. Pure data and arithmetic: no process group.

    ContextLayout(seq_len, spans)       rank r holds the half-open ranges spans[r], in order
      .positions(r)                     global positions of rank r's tokens (RoPE reads its
                                        table rows at these: cos.index_select(0, positions))
      .split(x, dim, r) / .unsplit(pieces, dim)   full tensor <-> rank r's piece (exact inverse)
      .order()                          positions of the rank-order concatenation of the pieces
                                        (what an all-gather along the sequence holds)
    contiguous(seq_len, cp)             rank r holds [r S/cp, (r+1) S/cp)
    head_tail(seq_len, cp)              2cp chunks; rank r holds chunk r and chunk 2cp-1-r
    balance_attention(seq_len, cp, mask=, doc_ids=)   chunks dealt so each rank's attention
                                        work is equal (packed documents, sliding windows)
    whole_documents(seq_len, cp, doc_ids)   each rank whole documents only, balanced, or None:
                                        no key any rank needs is elsewhere (dynamic CP's cp=1)
    num_visible_pairs(layout, mask, doc_ids)  per rank: unmasked (query, key) pairs of its queries
    imbalance(work)                     max / mean - 1

Why balance: in the ring and all-gather variants each rank computes attention for its own
queries against every key (`mplan.collectives.context_attention`), and its cost is the number
of unmasked pairs it meets (masked blocks are skipped). Under a causal mask the query at
position p sees p + 1 keys, so a contiguous split gives rank r work proportional to 2r + 1:
the last rank does (2cp - 1) / cp times the mean, and every rank waits for it. Chunk i of 2cp
(c tokens each) has work c^2 i + c(c+1)/2, so chunks i and 2cp-1-i sum to the same
c^2 (2cp-1) + c(c+1) for every i: head-tail pairing is exactly balanced for causal attention,
with equal token counts, so every other op (per-token work) stays balanced too.

Packed documents break that: work is the sum over documents of L(L+1)/2, quadratic in each
document's length, wherever the documents fall; a sliding window of W makes the first W tokens
cheaper than the rest (W = S/4 leaves both splits 14% off). `balance_attention` cuts the sequence into
k chunks per rank, weighs each by the pairs its queries see (`attention_mask.keys_per_query`,
summed over batch rows: one layout serves the whole batch), deals them largest first to the
least-loaded rank that still has room for a chunk (k each: token counts stay equal), then
swaps chunks between the heaviest and lightest rank while that lowers the heavier. It takes
the fewest chunks per rank (the longest contiguous runs: kernels run best on long runs) whose
imbalance is within `tolerance`, else the best it found. For one document it deals exactly the
head-tail pairs at k = 2.

Host cost: the runtime computes a layout for every micro-batch of documents, on the host, beside
the training step. Work per position comes from `keys_per_query` (numpy, one thread: torch's
intra-op threads contend with the step's) and the deal and its swap search are numpy over the
k * cp chunks: a few ms at 128k tokens over cp=8, where the same deal in Python loops took
0.1-0.8 s.

Invariants: the spans of all ranks cover [0, seq_len) exactly once; every rank holds the same
number of tokens (collectives exchange equal pieces, and per-token ops stay balanced); each
rank's spans are sorted and never touch (adjacent chunks are merged).

In the plan: a `cp` mesh axis on which every op holds its rank's slice of the sequence. Only
attention needs other ranks' tokens; RoPE takes `positions(r)`; the loss normalizes by the
token count summed over the cp group. A document-balanced layout depends on each batch's
documents, so the runtime splits each batch with its own layout; head-tail is fixed per length.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mplan.ir.attention_mask import CAUSAL, AttentionMask, keys_per_query

__all__ = ["ContextLayout", "balance_attention", "contiguous", "head_tail", "imbalance", "num_visible_pairs",
           "whole_documents"]

Span = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextLayout:
    """Rank r of the cp axis holds positions [a, b) for each (a, b) in spans[r] (module docstring)."""

    seq_len: int
    spans: tuple[tuple[Span, ...], ...]

    def __post_init__(self) -> None:
        if not self.spans:
            raise ValueError("a context layout needs at least one rank")
        covered = sorted(span for rank in self.spans for span in rank)
        edge = 0
        for start, end in covered:
            if start != edge or end <= start:
                raise ValueError(f"spans must tile [0, {self.seq_len}) exactly: {covered}")
            edge = end
        if edge != self.seq_len:
            raise ValueError(f"spans cover [0, {edge}) of a sequence of {self.seq_len}")
        counts = [sum(end - start for start, end in rank) for rank in self.spans]
        if len(set(counts)) != 1:
            raise ValueError(f"every rank must hold as many tokens as the others: {counts}")
        for rank, own in enumerate(self.spans):
            if any(a[1] >= b[0] for a, b in zip(own, own[1:])):
                raise ValueError(f"rank {rank}'s spans must be sorted and separate: {own}")

    @property
    def cp(self) -> int:
        return len(self.spans)

    @property
    def local_len(self) -> int:
        """Tokens each rank holds: seq_len / cp."""
        return self.seq_len // self.cp

    def positions(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """Int64 [local_len]: the global positions of rank `rank`'s tokens, in its order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans[rank]])

    def order(self, device: torch.device | None = None) -> torch.Tensor:
        """Int64 [seq_len]: positions of every rank's tokens, rank after rank."""
        return torch.cat([self.positions(rank, device) for rank in range(self.cp)])

    def split(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of the full tensor `x` along `dim` (differentiable)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"dim {dim} has {x.shape[dim]} positions, the layout {self.seq_len}")
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.spans[rank]], dim)

    def unsplit(self, pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The full tensor from every rank's piece (rank order), the inverse of `split`."""
        if len(pieces) != self.cp:
            raise ValueError(f"{len(pieces)} pieces for a layout of {self.cp} ranks")
        joined = torch.cat(list(pieces), dim)
        return joined.index_select(dim, torch.argsort(self.order(joined.device)))

    def __str__(self) -> str:
        ranks = " | ".join(f"{r}: " + " ".join(f"[{a}:{b})" for a, b in own) for r, own in enumerate(self.spans))
        return f"cp={self.cp} over {self.seq_len} tokens; {ranks}"


def _divide(seq_len: int, pieces: int, what: str) -> int:
    if seq_len % pieces:
        raise ValueError(f"{what}: {seq_len} tokens do not split into {pieces} equal chunks "
                         f"({seq_len} % {pieces} = {seq_len % pieces})")
    return seq_len // pieces


def _from_chunks(seq_len: int, chunk: int, chunks: Sequence[Sequence[int]]) -> ContextLayout:
    """Rank r holds chunks[r] (chunk i = [i chunk, (i+1) chunk)), adjacent chunks merged."""
    spans = []
    for own in chunks:
        merged: list[list[int]] = []
        for i in sorted(own):
            if merged and merged[-1][1] == i * chunk:
                merged[-1][1] += chunk
            else:
                merged.append([i * chunk, (i + 1) * chunk])
        spans.append(tuple((a, b) for a, b in merged))
    return ContextLayout(seq_len=seq_len, spans=tuple(spans))


def contiguous(seq_len: int, cp: int) -> ContextLayout:
    """Rank r holds the r-th of cp equal runs."""
    chunk = _divide(seq_len, cp, "contiguous context layout")
    return _from_chunks(seq_len, chunk, [[r] for r in range(cp)])


def head_tail(seq_len: int, cp: int) -> ContextLayout:
    """2cp equal chunks; rank r holds chunks r and 2cp-1-r (exact causal balance, module docstring)."""
    chunk = _divide(seq_len, 2 * cp, f"head-tail context layout over cp={cp}")
    return _from_chunks(seq_len, chunk, [[r, 2 * cp - 1 - r] for r in range(cp)])


def num_visible_pairs(layout: ContextLayout, mask: AttentionMask = CAUSAL,
                      doc_ids: torch.Tensor | None = None) -> tuple[int, ...]:
    """Per rank: the unmasked (query, key) pairs of its queries, summed over batch rows."""
    per_position = keys_per_query(mask, layout.seq_len, doc_ids).sum(dim=0)
    return tuple(int(per_position[layout.positions(r)].sum()) for r in range(layout.cp))


def imbalance(work: Sequence[int]) -> float:
    """How far the busiest rank is above the mean: max / mean - 1 (0: perfectly balanced)."""
    mean = sum(work) / len(work)
    return max(work) / mean - 1 if mean else 0.0


def _deal(weights: np.ndarray, cp: int, per_rank: int) -> list[list[int]]:
    """Chunk indices per rank, `per_rank` each: largest weight first to the lightest rank with
    room, then heaviest/lightest swaps while they lower the heavier of the two: of the pairs
    (a on the heaviest, b on the lightest) with 0 < w_a - w_b < gap, the one leaving the two
    closest, |gap - 2 (w_a - w_b)|, ties to the lowest (a, b)."""
    ranks: list[list[int]] = [[] for _ in range(cp)]
    load = np.zeros(cp, dtype=np.int64)
    open_ranks = [(0, r) for r in range(cp)]
    for i in np.lexsort((np.arange(len(weights)), -weights)).tolist():
        _, r = heapq.heappop(open_ranks)
        ranks[r].append(i)
        load[r] += weights[i]
        if len(ranks[r]) < per_rank:
            heapq.heappush(open_ranks, (int(load[r]), r))
    owned = np.array(ranks, dtype=np.int64)  # [cp, per_rank]
    for _ in range(cp * per_rank * per_rank):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        moved = weights[owned[hi]][:, None] - weights[owned[lo]][None, :]
        closeness = np.where((moved > 0) & (moved < gap), np.abs(gap - 2 * moved), -1)
        candidates = np.argwhere(closeness >= 0)
        if not len(candidates):
            break
        best = closeness[candidates[:, 0], candidates[:, 1]]
        tied = candidates[best == best.min()]
        x, y = tied[np.lexsort((owned[lo][tied[:, 1]], owned[hi][tied[:, 0]]))[0]]
        owned[hi, x], owned[lo, y] = owned[lo, y], owned[hi, x]
        load[hi] -= moved[x, y]
        load[lo] += moved[x, y]
    return owned.tolist()


def balance_attention(seq_len: int, cp: int, *, mask: AttentionMask = CAUSAL, doc_ids: torch.Tensor | None = None,
                      tolerance: float = 0.05, max_chunks_per_rank: int = 16) -> ContextLayout:
    """A layout whose ranks hold equal tokens and near-equal attention work under `mask` and
    documents `doc_ids` ([S] or [B, S]; None: one document): the fewest chunks per rank within
    `tolerance` of balance, else the most balanced tried (module docstring)."""
    per_position = keys_per_query(mask, seq_len, doc_ids).numpy().sum(axis=0)
    best: tuple[float, ContextLayout] | None = None
    per_rank = 1
    while per_rank <= max_chunks_per_rank and seq_len % (cp * per_rank) == 0:
        chunk = seq_len // (cp * per_rank)
        weights = per_position.reshape(-1, chunk).sum(axis=1)
        ranks = _deal(weights, cp, per_rank)
        spread = imbalance([int(weights[own].sum()) for own in ranks])
        if best is None or spread < best[0]:
            best = (spread, _from_chunks(seq_len, chunk, ranks))
        if spread <= tolerance:
            break
        per_rank *= 2
    if best is None:
        raise ValueError(f"balance_attention: {seq_len} tokens do not split into {cp} equal pieces "
                         f"({seq_len} % {cp} = {seq_len % cp})")
    return best[1]


def whole_documents(seq_len: int, cp: int, doc_ids: torch.Tensor, *, tolerance: float = 0.05) -> ContextLayout | None:
    """A layout giving every rank whole documents only, S / cp tokens each, with causal attention
    work within `tolerance` of equal; None when no such deal is found. Under it no query has a
    visible key on another rank, so attention runs on each rank alone: each document at cp=1, the
    cp ranks acting as data parallelism over documents (dynamic CP's smallest size). Documents
    are dealt largest first to the least-loaded rank with room (`doc_ids` [S], or [rows, S] with
    the same documents in every row: one layout serves the rows)."""
    rows = (doc_ids.reshape(1, -1) if doc_ids.dim() == 1 else doc_ids).cpu().numpy()
    if rows.shape[1] != seq_len or seq_len % cp or not bool((rows == rows[:1]).all()):
        return None
    starts = [0] + (np.flatnonzero(rows[0, 1:] != rows[0, :-1]) + 1).tolist()
    spans = [(a, b) for a, b in zip(starts, starts[1:] + [seq_len])]
    room, load = [seq_len // cp] * cp, [0] * cp
    owned: list[list[Span]] = [[] for _ in range(cp)]
    for a, b in sorted(spans, key=lambda span: (span[0] - span[1], span[0])):
        fits = [r for r in range(cp) if room[r] >= b - a]
        if not fits:
            return None
        r = min(fits, key=lambda r: (load[r], r))
        owned[r].append((a, b))
        room[r] -= b - a
        load[r] += (b - a) * (b - a + 1) // 2
    if imbalance(load) > tolerance:
        return None
    merged = []
    for own in owned:
        runs: list[list[int]] = []
        for a, b in sorted(own):
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b])
        merged.append(tuple((a, b) for a, b in runs))
    return ContextLayout(seq_len=seq_len, spans=tuple(merged))
