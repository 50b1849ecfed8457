"""The document lengths of prepared token shards, read from the tokens: what the planner's dynamic
CP pricing (`mplan.planner.dynamic_context`) takes as "the expected mix of lengths from the data".

Input: a directory `mplan data prepare` wrote (`TokenShards.open` validates it). Output: int64
[documents]: each document's tokens, its EOS included, in the stream's order (the order the
loader packs them in).

Read literally from the ids, not from the index's offsets: a document ends at each EOS id, as
`loader.packed_document_ids` numbers the documents of a training window, so the lengths are the
ones training sees. The stream is scanned in blocks (memory stays bounded on a large corpus);
a stream not ending in EOS is refused, as `prepare` never writes one.
"""
from __future__ import annotations

import numpy as np

from mplan.data.errors import DataError
from mplan.data.shards import TokenShards

BLOCK_TOKENS = 1 << 24
"""Tokens scanned at once: 32 MiB of uint16."""


def document_lengths(directory: str, *, max_documents: int | None = None) -> np.ndarray:
    """Tokens of each document of `directory`'s shards (EOS included), the first `max_documents`
    of them where given (module docstring)."""
    shards = TokenShards.open(directory)
    ends: list[np.ndarray] = []
    found = 0
    for start in range(0, shards.num_tokens, BLOCK_TOKENS):
        block = shards.read(start, min(start + BLOCK_TOKENS, shards.num_tokens))
        ends.append(np.flatnonzero(block == shards.eos_id) + start + 1)
        found += len(ends[-1])
        if max_documents is not None and found >= max_documents:
            break
    stops = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    if max_documents is None and (not len(stops) or stops[-1] != shards.num_tokens):
        raise DataError(f"{directory}: the token stream does not end with the EOS id {shards.eos_id} "
                        f"(not written by `mplan data prepare`)")
    lengths = np.diff(np.concatenate([[0], stops])).astype(np.int64)
    return lengths if max_documents is None else lengths[:max_documents]
