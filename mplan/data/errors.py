"""The one error type of `mplan.data`: a corpus, a tokenizer or a token-shard directory that
cannot be used, said in one line naming the file and, for an index, the field.

It is a `ValueError` of mplan's own, so `mplan.refusal` reports it as a refusal (one line, no
traceback) wherever it reaches the top: the `mplan data` command, a training script.
"""
from __future__ import annotations


class DataError(ValueError):
    """A text corpus, tokenizer or token-shard directory mplan cannot use; the message names it."""
