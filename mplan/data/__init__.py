"""Real training data: text to token shards on disk, and shards to packed, shuffled batches.

    prepare(inputs, out_dir)       text files (globs), JSONL or parquet -> tokenizer.json + token
                                   shards (`shards.py`; the `mplan data prepare` command)
    TokenShards.open(dir)          the shards validated and memory-mapped
    PackedLoader(dir, seq_len=, global_batch=, seed=)
                                   samples of seq_len + 1 tokens in a seeded order, each DP rank's
                                   rows, its position checkpointed by samples (`loader.py`)
    load_tokenizer / train_tokenizer
                                   a local Hugging Face tokenizer, or a byte-level BPE (`tokenizer.py`)

A leaf: it imports nothing of mplan's layers (only the `json_fields` reader and `progress`), and
no layer imports it; the training command and the user's script use it beside `autoparallel`.
`PackedLoader` (which imports torch) loads on first use, so preparing data needs no torch.
"""
from __future__ import annotations

from typing import Any

from mplan.data.errors import DataError
from mplan.data.shards import Shard, TokenShards, prepare
from mplan.data.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer

__all__ = ["DataError", "PackedLoader", "Shard", "TextTokenizer", "TokenShards", "load_tokenizer", "prepare",
           "train_tokenizer"]


def __getattr__(name: str) -> Any:
    if name == "PackedLoader":
        from mplan.data.loader import PackedLoader

        return PackedLoader
    raise AttributeError(f"module 'mplan.data' has no attribute {name!r}")
