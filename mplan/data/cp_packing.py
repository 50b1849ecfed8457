"""Packing for dynamic context parallelism: windows whose documents deal whole onto the cp ranks
with balanced attention work, so the runtime's two-size rule runs them at cp=1 with no K/V exchange.

Input: the stream's document lengths in order (each ends at its EOS: `document_lengths`), the
window length S and the number of shares k (the plan's cp), so a share is M = S / k tokens.
Output: `Packing`, a list of `Window`s, each a list of segments (window offset, stream start,
tokens); every position no segment covers is padding (an EOS id, label -100, each padding token
its own document under `loader.packed_document_ids`, so no query attends into or out of it).

Why: the plain loader cuts the stream wherever a window ends, so a window's documents never fill
the ranks' shares whole, and the runtime (`runtime.lowering.document_layout`, which asks
`ir.context_layout.whole_documents`) runs every window over the whole cp group. Choosing which
documents share a window fixes that, at the price of some padding.

How, window after window, reading the stream in order into a buffer of at least `lookahead`
windows' tokens (documents of at most M tokens only):
    deal      the buffer's documents, longest first (ties: stream order), each to the share with
              the least causal work sum L(L+1)/2 that still has room for it (ties: lowest share),
              a document no share has room for left in the buffer: the very rule `whole_documents`
              deals by, so the documents a window takes deal again the same way at run time
    balance   the shares' work, padding included (each padding token is a one-token document, and
              the padding fills every share's room exactly), must be within `tolerance` of equal:
              while it is not, the longest document of the busiest share is set aside for a later
              window and the deal is redone
    spill     a document longer than M, or one left in the buffer for more than `patience`
              windows, joins a second stream cut into windows as the plain loader cuts (those run
              over the whole cp group, as every window does today)
At the end the buffer's last documents make the last aligned windows (padded) and the spilled
stream's tail one padded window: every token of the stream is in exactly one window, so an epoch
trains on every token once (the plain loader drops the stream's last partial window).

Cost, stated: padding computes (GEMMs and its own one-token attention) but trains nothing; the
fraction is `Packing.padding` (about 1.5% on 64 windows of 128k tokens of Wikipedia's published
length mix, most of it the stream's last window: `python -m benchmarks.planning dynamic-cp --packing cp_aligned`).
The pack is a pure function of the lengths, S and k (no seed): the loader shuffles the windows'
order from its seed as it shuffles plain windows. Host time is pure Python: 0.3 s at 8 shares to
2.4 s at 32 for those 11,663 documents, so hours for a corpus of ten million, besides one scan of
the whole stream for the lengths. So a pack is made once per dataset, window length and share
count and kept beside the shards (`kept_packing`, which the loader and `mplan plan --documents`
share; `save_packing` / `load_packing`: plain arrays, no pickle, checked on load; a file that does
not check out is packed again, a directory it cannot write to packs at every open).

Where it pays: the runtime asks `whole_documents` once per micro-batch and needs every row of it
to hold the same documents, so windows run at cp=1 only with one row per micro-batch
(micro_batch_size=1, the usual size for windows long enough to need cp).
"""
from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Segment = tuple[int, int, int]
"""(offset in the window, start in the stream, tokens)."""


@dataclass(frozen=True, slots=True)
class Window:
    """One packed sample of S tokens: its segments in window order; `aligned`: packed so that its
    documents deal whole onto the shares (the cp ranks), else cut from the spilled stream."""

    segments: tuple[Segment, ...]
    aligned: bool

    def lengths(self, seq_len: int) -> list[int]:
        """Its documents' lengths in window order, each padding token a document of 1."""
        out, edge = [], 0
        for offset, _, n in self.segments:
            out += [1] * (offset - edge) + [n]
            edge = offset + n
        return out + [1] * (seq_len - edge)


@dataclass(frozen=True, slots=True)
class Packing:
    """The windows of one epoch, in the order they were packed (module docstring)."""

    seq_len: int
    shares: int
    windows: tuple[Window, ...]

    @property
    def padding(self) -> float:
        """Fraction of all window tokens that are padding."""
        real = sum(n for w in self.windows for _, _, n in w.segments)
        return 1.0 - real / (len(self.windows) * self.seq_len)

    @property
    def aligned(self) -> float:
        """Fraction of the windows packed to deal whole onto the shares."""
        return sum(w.aligned for w in self.windows) / len(self.windows)


def pack_for_shares(lengths: Sequence[int], seq_len: int, shares: int, *, tolerance: float = 0.05,
                    lookahead: int = 4, patience: int = 16) -> Packing:
    """The windows of S = `seq_len` tokens of the stream whose documents have `lengths`, packed for
    `shares` shares (module docstring)."""
    if shares < 1 or seq_len % shares:
        raise ValueError(f"cp-aligned packing: {seq_len} tokens do not split into {shares} equal shares")
    if not len(lengths) or min(lengths) < 1:
        raise ValueError("cp-aligned packing: needs documents of at least one token")
    share = seq_len // shares
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    lengths = [int(n) for n in lengths]
    windows: list[Window] = []
    spilled = _Cutter(seq_len)
    buffer: list[int] = []  # document indices, stream order
    entered: dict[int, int] = {}  # document -> the window count when it entered the buffer
    buffered, nxt = 0, 0
    while True:
        while buffered < lookahead * seq_len and nxt < len(lengths):
            if lengths[nxt] > share:
                windows += spilled.add(starts[nxt], lengths[nxt])
            else:
                buffer.append(nxt)
                entered[nxt] = len(windows)
                buffered += lengths[nxt]
            nxt += 1
        if not buffer:
            break
        stale = [d for d in buffer if len(windows) - entered[d] > patience]
        for d in stale:
            windows += spilled.add(starts[d], lengths[d])
        taken = _balanced_deal(buffer, lengths, share, shares, tolerance) if not stale else []
        if not taken and not stale:  # nothing balances: the oldest document goes to the cut stream
            taken_out = [buffer[0]]
            windows += spilled.add(starts[buffer[0]], lengths[buffer[0]])
        else:
            taken_out = stale
        if taken:
            segments, offsets = [], [0] * shares
            for r, docs in enumerate(taken):
                for d in sorted(docs):
                    segments.append((r * share + offsets[r], starts[d], lengths[d]))
                    offsets[r] += lengths[d]
            windows.append(Window(segments=tuple(segments), aligned=True))
            taken_out = [d for docs in taken for d in docs]
        gone = set(taken_out)
        buffer = [d for d in buffer if d not in gone]
        buffered -= sum(lengths[d] for d in gone)
    windows += spilled.flush()
    return Packing(seq_len=seq_len, shares=shares, windows=tuple(windows))


def _balanced_deal(buffer: list[int], lengths: list[int], share: int, shares: int,
                   tolerance: float) -> list[list[int]]:
    """Each share's documents of one balanced window from `buffer`, or [] (module docstring)."""
    order = sorted(buffer, key=lambda d: (-lengths[d], d))
    aside: set[int] = set()
    while True:
        owned: list[list[int]] = [[] for _ in range(shares)]
        load, room = [0] * shares, [share] * shares
        for d in order:
            if d in aside:
                continue
            n, best = lengths[d], -1
            for r in range(shares):
                if room[r] >= n and (best < 0 or load[r] < load[best]):
                    best = r
            if best >= 0:
                owned[best].append(d)
                room[best] -= n
                load[best] += n * (n + 1) // 2
        if not any(owned):
            return []
        final = [a + b for a, b in zip(load, room)]  # padding fills each share's room, one token of work each
        if max(final) <= (1 + tolerance) * sum(final) / shares:
            return owned
        busiest = max(range(shares), key=lambda r: (final[r], -r))
        aside.add(max(owned[busiest], key=lambda d: (lengths[d], -d)))


class _Cutter:
    """The spilled documents as one stream cut into windows of S tokens, as the plain loader cuts."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.segments: list[Segment] = []
        self.filled = 0

    def add(self, start: int, tokens: int) -> list[Window]:
        out = []
        while tokens:
            take = min(tokens, self.seq_len - self.filled)
            self.segments.append((self.filled, start, take))
            self.filled += take
            start, tokens = start + take, tokens - take
            if self.filled == self.seq_len:
                out.append(Window(segments=tuple(self.segments), aligned=False))
                self.segments, self.filled = [], 0
        return out

    def flush(self) -> list[Window]:
        return [Window(segments=tuple(self.segments), aligned=False)] if self.segments else []


PACK_VERSION = 1
"""Bumped when `pack_for_shares` or its defaults change: a kept pack of another version is packed again."""


def pack_file(directory: str, fingerprint: str, seq_len: int, shares: int) -> str:
    """Where the pack of the dataset with `fingerprint` for these windows and shares is kept."""
    return os.path.join(directory, f"cp_pack-v{PACK_VERSION}-{fingerprint[:16]}-{seq_len}x{shares}.npz")


def kept_packing(directory: str, fingerprint: str, lengths: Callable[[], Sequence[int]], seq_len: int,
                 shares: int) -> Packing:
    """The pack of the shards in `directory` (of `fingerprint`) for these windows and shares: the one
    kept beside them, else `pack_for_shares` of `lengths()` (the stream's document lengths, read only
    then: a scan of the whole stream), kept there for the next open. A directory it cannot write to
    (a read-only dataset) packs again at every open, never wrongly."""
    path = pack_file(directory, fingerprint, seq_len, shares)
    kept = load_packing(path, seq_len, shares)
    if kept is not None:
        return kept
    packing = pack_for_shares(lengths(), seq_len, shares)
    try:
        save_packing(packing, path)
    except OSError:
        pass
    return packing


def save_packing(packing: Packing, path: str) -> None:
    """Write `packing` to `path` as plain arrays (atomically: a reader never sees half a file)."""
    counts = np.array([len(w.segments) for w in packing.windows], dtype=np.int64)
    segments = np.array([seg for w in packing.windows for seg in w.segments], dtype=np.int64).reshape(-1, 3)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.savez(f, meta=np.array([PACK_VERSION, packing.seq_len, packing.shares], dtype=np.int64),
                 counts=counts, segments=segments, aligned=np.array([w.aligned for w in packing.windows]))
    os.replace(partial, path)


def load_packing(path: str, seq_len: int, shares: int) -> Packing | None:
    """The pack kept at `path` for these windows and shares, or None where there is none or it does
    not check out (another version, shape or shares; segments outside their window or overlapping)."""
    try:
        with np.load(path, allow_pickle=False) as kept:
            meta, counts, segments, aligned = (kept[k] for k in ("meta", "counts", "segments", "aligned"))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # absent, truncated, not ours
        return None
    if (meta.tolist() != [PACK_VERSION, seq_len, shares] or counts.ndim != 1 or segments.ndim != 2
            or segments.shape[1] != 3 or aligned.shape != counts.shape or aligned.dtype != np.bool_
            or int(counts.sum()) != len(segments) or (counts < 1).any()):
        return None
    windows, at = [], 0
    for count, flag in zip(counts.tolist(), aligned.tolist()):
        window = tuple(tuple(seg) for seg in segments[at:at + count].tolist())
        at += count
        edge = 0
        for offset, start, tokens in window:
            if offset < edge or tokens < 1 or start < 0 or offset + tokens > seq_len:
                return None
            edge = offset + tokens
        windows.append(Window(segments=window, aligned=flag))
    return Packing(seq_len=seq_len, shares=shares, windows=tuple(windows))
