"""Which (query, key) pairs attention may use, stated once by position: causal, sliding window,
packed documents. The one mask definition of context parallelism.

    visible(mask, q_positions [Sq], k_positions [Sk], doc_ids)   -> bool [B | 1, Sq, Sk]
    keys_per_query(mask, seq_len, doc_ids)                       -> int64 [B | 1, S], O(S)
    document_ids(doc_ids, seq_len) / doc_ids_from_lengths(lengths)

Why by position: under context parallelism (`context_layout.py`) a rank holds scattered slices
of the sequence, and a block of its queries meets blocks of keys from other ranks. Stating the
mask as a function of global positions (and each position's document) lets every block build
its own piece, where a [S, S] mask tensor would have to be cut along a layout and could not be
held at 128k tokens. `keys_per_query` counts the same pairs in closed form per query (no S x S
tensor), which is what load balancing weighs: attention work is the number of unmasked pairs.

Rules (q, k global positions; a pair is visible when all that apply hold):
- causal: k <= q.
- window W (tokens, counting the query itself, as Mistral's and Gemma's sliding windows):
  q - k < W when causal, |q - k| < W when not.
- documents: doc_ids[q] == doc_ids[k]. Document ids are per token, [S] (every batch row
  alike) or [B, S], and never decrease along a row: packed documents, in order, so a document
  is a contiguous run of one id and "same id" is "same run".
Invariant: every query sees at least itself, so no softmax row is empty.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["AttentionMask", "CAUSAL", "doc_ids_from_lengths", "document_ids", "keys_per_query", "visible"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionMask:
    """The position rules of a mask (module docstring); documents come as data, `doc_ids`."""

    causal: bool = True
    window: int | None = None
    """Sliding window in tokens, the query included (1: a token sees only itself); None: none."""

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window covers at least the query itself: window={self.window}")

    def __str__(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return kind if self.window is None else f"{kind}, window {self.window}"


CAUSAL = AttentionMask()


def doc_ids_from_lengths(lengths: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
    """Per-token document ids of packed documents: [3, 2] -> [0, 0, 0, 1, 1]; a list of such
    lists (one per batch row, equal totals) gives [B, S]."""
    if lengths and not isinstance(lengths[0], int):
        rows = [doc_ids_from_lengths(row) for row in lengths]  # type: ignore[arg-type]
        if len({row.numel() for row in rows}) != 1:
            raise ValueError(f"batch rows pack different numbers of tokens: {[row.numel() for row in rows]}")
        return torch.stack(rows)
    if any(n < 1 for n in lengths):  # type: ignore[operator]
        raise ValueError(f"document lengths must be positive: {list(lengths)}")
    counts = torch.tensor(list(lengths), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def document_ids(doc_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`doc_ids` checked ([S] or [B, S] integers, never decreasing along a row) as [B | 1, S]."""
    rows = doc_ids.reshape(1, -1) if doc_ids.dim() == 1 else doc_ids
    if rows.dim() != 2 or rows.shape[1] != seq_len or rows.is_floating_point():
        raise ValueError(f"document ids must be integers of shape [{seq_len}] or [batch, {seq_len}], "
                         f"got {doc_ids.dtype} {list(doc_ids.shape)}")
    ids = _host(rows)
    falls = np.argwhere(ids[:, 1:] < ids[:, :-1])
    if len(falls):
        row, at = (int(i) for i in falls[0])
        raise ValueError(f"document ids decrease at position {at + 1} of row {row} ({int(rows[row, at])} -> "
                         f"{int(rows[row, at + 1])}): packed documents must be numbered in order")
    return rows


def visible(mask: AttentionMask, q_positions: torch.Tensor, k_positions: torch.Tensor,
            doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B | 1, Sq, Sk]: which keys each query may use. `doc_ids` as `document_ids` returns."""
    distance = q_positions[:, None] - k_positions[None, :]
    ok = torch.ones_like(distance, dtype=torch.bool)
    if mask.causal:
        ok &= distance >= 0
    if mask.window is not None:
        ok &= (distance if mask.causal else distance.abs()) < mask.window
    ok = ok.unsqueeze(0)
    if doc_ids is not None:
        ok = ok & (doc_ids[:, q_positions, None] == doc_ids[:, None, k_positions])
    return ok


def _host(doc_ids: torch.Tensor) -> np.ndarray:
    """Document ids as a host int64 array. The layout of every micro-batch is computed from them
    on the host: numpy runs these O(S) passes on one thread, where torch's intra-op threads
    contend with the training step's (10x slower at 128k tokens on a loaded 2-core host)."""
    return doc_ids.detach().cpu().numpy().astype(np.int64, copy=False)


def _document_bounds(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last position of each token's document, [B, S] each."""
    rows, seq_len = doc_ids.shape
    start, end = np.empty((rows, seq_len), dtype=np.int64), np.empty((rows, seq_len), dtype=np.int64)
    for row in range(rows):
        firsts = np.concatenate(([0], np.flatnonzero(doc_ids[row, 1:] != doc_ids[row, :-1]) + 1))
        ends = np.append(firsts[1:], seq_len)
        start[row], end[row] = np.repeat(firsts, ends - firsts), np.repeat(ends, ends - firsts)
    return start, end


def keys_per_query(mask: AttentionMask, seq_len: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Int64 [B | 1, S]: how many keys the query at each position sees, in closed form (the row
    sums of `visible` over the whole sequence, without building it)."""
    position = np.arange(seq_len)[None]
    if doc_ids is None:
        start, end = np.zeros_like(position), np.full_like(position, seq_len)
    else:
        start, end = _document_bounds(_host(document_ids(doc_ids, seq_len)))
    first, last = start, end - 1
    if mask.causal:
        last = np.minimum(last, position)
    if mask.window is not None:
        first = np.maximum(first, position - mask.window + 1)
        if not mask.causal:
            last = np.minimum(last, position + mask.window - 1)
    return torch.from_numpy(np.ascontiguousarray(last - first + 1))
