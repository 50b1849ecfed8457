"""Text to token ids for `mplan data prepare`: a Hugging Face tokenizer directory, or a byte-level
BPE trained on the corpus itself when the user has none.

What: `load_tokenizer(path)` reads a local tokenizer (a `tokenizer.json`, a directory holding one,
or any directory `transformers.AutoTokenizer` reads offline as a fast tokenizer);
`train_tokenizer(texts, vocab_size=4096)` trains a byte-level BPE (GPT-2's pre-tokenizer and
alphabet) with `tokenizers`. Either way the result is a `TextTokenizer`: the `tokenizers.Tokenizer`
itself, the id of the end-of-document token that separates documents in a packed stream, and the
id bound that decides the shards' dtype. `TextTokenizer.save(dir)` writes `tokenizer.json`, so the
token shards carry the exact tokenizer that made them and a run can be reproduced or decoded.

Why `tokenizers` underneath even for a Hugging Face directory: its `tokenizer.json` is one
self-contained file that loads without transformers, encodes batches in parallel in Rust, and is
what every fast HF tokenizer already is (`AutoTokenizer(...).backend_tokenizer`); a slow-only
(sentencepiece) tokenizer is converted by transformers where it can be, refused otherwise.

Invariants: `encode` adds no special tokens (no BOS, no template): documents are joined by the
EOS token alone, as Megatron's `preprocess_data.py --append-eod` does; byte-level BPE decodes
every UTF-8 text back exactly (`decode(encode(t)) == t`); training is deterministic for the same
texts in the same order (checked in tests/test_data.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from mplan.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
"""The end-of-document token of a tokenizer trained here (GPT-2's spelling)."""

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary of a trained tokenizer: small enough for a small model to learn on a small corpus
(the stdlib's 31 MB of sources make 9.4 M tokens at 4096), and uint16 shards."""

MIN_VOCAB_SIZE = 258
"""256 byte tokens, the end-of-document token and at least one merge."""

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
"""End-of-document spellings looked for, in this order, when a directory's tokenizer_config.json
names no `eos_token`: GPT-2/NeoX, Llama 2/T5/Mistral, Llama 3, Gemma, Qwen chat, Llama 3 chat."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the token that ends each document."""

    backend: Any
    """The `tokenizers.Tokenizer` (typed Any: `tokenizers` is imported only when used)."""
    eos_id: int
    """Id of the end-of-document token appended after every document."""
    vocab_size: int
    """One above the largest token id (added tokens included): the bound the shards' dtype must hold."""
    source: str
    """Where it came from: a path, or "trained" (byte-level BPE on the corpus)."""

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_id)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with no special token added (no BOS, no EOS)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in parallel threads (the Rust side)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; special tokens (the EOS) are dropped."""
        return self.backend.decode([int(i) for i in ids])

    def save(self, directory: str) -> str:
        """Write `tokenizer.json` into `directory` and return its path."""
        path = os.path.join(directory, "tokenizer.json")
        self.backend.save(path)
        return path


def from_backend(backend: Any, *, eos_id: int, source: str) -> TextTokenizer:
    """A `TextTokenizer` over a loaded `tokenizers.Tokenizer` whose EOS id is already known."""
    vocab = backend.get_vocab(with_added_tokens=True)
    return TextTokenizer(backend=backend, eos_id=eos_id, vocab_size=max(vocab.values()) + 1, source=source)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> TextTokenizer:
    """A byte-level BPE of `vocab_size` tokens (EOS_TOKEN is id 0) trained on `texts`.

    The alphabet is all 256 bytes whatever the texts hold, so any later text encodes; GPT-2's
    pre-tokenizer regex splits words, numbers and punctuation before merging."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes, the end-of-document "
                        f"token and one merge), got {vocab_size!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_strings(texts), trainer)
    return from_backend(backend, eos_id=backend.token_to_id(EOS_TOKEN), source="trained")


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text:
            yield text


def load_tokenizer(path: str) -> TextTokenizer:
    """A local tokenizer: a `tokenizer.json` file, a directory holding one, or a directory that
    `transformers.AutoTokenizer` loads offline as a fast tokenizer. Its EOS token is the
    directory's `tokenizer_config.json` `eos_token`, else the first of EOS_CANDIDATES it knows."""
    from tokenizers import Tokenizer

    directory = os.path.dirname(path) if os.path.isfile(path) else path
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isdir(directory or "."):
        raise DataError(f"{path}: no such tokenizer directory or tokenizer.json file")
    if os.path.isfile(file):
        try:
            backend = Tokenizer.from_file(file)
        except Exception as exc:  # tokenizers raises plain Exception for a malformed file
            raise DataError(f"{file}: not a tokenizers tokenizer.json: {_first_line(exc)}") from None
    else:
        backend = _auto_tokenizer(directory)
    eos = _eos_token(directory, backend)
    return from_backend(backend, eos_id=backend.token_to_id(eos), source=path)


def _auto_tokenizer(directory: str) -> Any:
    """The fast (`tokenizers`) tokenizer transformers builds from `directory`, without network."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{directory}: holds no tokenizer.json, and reading other tokenizer files needs "
                        f"transformers, which is not installed") from None
    try:
        loaded = AutoTokenizer.from_pretrained(directory, local_files_only=True, use_fast=True)
    except Exception as exc:  # OSError, ValueError, or a converter's own error
        raise DataError(f"{directory}: transformers cannot load a tokenizer from it offline: "
                        f"{_first_line(exc)}") from None
    if not getattr(loaded, "is_fast", False):
        raise DataError(f"{directory}: transformers loads only a slow {type(loaded).__name__} from it; "
                        f"save it with a tokenizer.json (a fast tokenizer) first")
    return loaded.backend_tokenizer


def _eos_token(directory: str, backend: Any) -> str:
    named = _configured_eos(os.path.join(directory, "tokenizer_config.json"))
    if named is not None:
        if backend.token_to_id(named) is None:
            raise DataError(f"{directory}/tokenizer_config.json: eos_token {named!r} is not in the tokenizer's "
                            f"vocabulary")
        return named
    for candidate in EOS_CANDIDATES:
        if backend.token_to_id(candidate) is not None:
            return candidate
    raise DataError(f"{directory}: the tokenizer has no end-of-document token (tokenizer_config.json names no "
                    f"eos_token and none of {', '.join(EOS_CANDIDATES)} is in its vocabulary)")


def _configured_eos(config: str) -> str | None:
    """`eos_token` of a tokenizer_config.json (a string or {"content": ...}), None when absent."""
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise DataError(f"{config}: not readable JSON: {_first_line(exc)}") from None
    eos = data.get("eos_token") if isinstance(data, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise DataError(f"{config}: eos_token must be a string or an object with a content string, got {eos!r}")
    return eos


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
