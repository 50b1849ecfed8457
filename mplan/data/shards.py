"""Token shards: a text corpus tokenized once into memory-mapped files a loader reads by offset.

What: `prepare(inputs, out_dir)` reads text files (glob patterns, each file one document), JSONL
files (one document per line, its "text" field) or parquet files (one per row of the "text" column,
with pyarrow if installed: `mplan.data.parquet`, which checks each before anything is written),
tokenizes every document (a given tokenizer, or a byte-level BPE trained on the same documents,
`mplan.data.tokenizer`), and writes into `out_dir`:

    tokenizer.json          the tokenizer that made the ids (reproducible, decodable)
    shard-00000.bin         token ids, raw little-endian uint16 (vocab_size <= 65536) or uint32;
                            each document's ids followed by the EOS id
    shard-00000.docs.npy    int64 [num_documents + 1]: offsets (in tokens) where each document of
                            the shard starts, then the shard's length; a document's span
                            includes its EOS
    ...
    index.json              written last, so a directory without one was never finished:
      {"format": "mplan-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 4096,
       "eos_id": 0, "tokenizer": "tokenizer.json", "tokenizer_sha256": "...",
       "num_tokens": N, "num_documents": D,
       "shards": [{"file": "shard-00000.bin", "num_tokens": n, "num_documents": d,
                   "documents": "shard-00000.docs.npy", "sha256": "<of the .bin>"}, ...],
       "sources": {"patterns": [...], "num_files": F, "skipped": [files not UTF-8]},
       "fingerprint": "<sha256 of the fields above but sources>"}

`TokenShards.open(dir)` reads it back: every field validated (one line naming the file and the
field), each .bin's size checked against its token count, each offsets file loaded without
pickles and checked (starts at 0, strictly increasing, ends at the shard's length), the
fingerprint recomputed from the fields; then the .bin files are mapped with `numpy.memmap` and
`read(start, stop)` returns any token range of the corpus as one stream across shards.

Megatron's indexed dataset (`megatron/core/datasets/indexed_dataset.py`) is the model: one .bin
of raw ids, an index of document lengths and offsets, memory-mapped, the EOS appended by
`preprocess_data.py --append-eod`. What differs: the index is JSON (validated like every mplan
file; Megatron's .idx is a packed binary with a magic header) beside one small .npy of offsets per
shard; a corpus is split into shards of about `shard_tokens` ids, cut between documents, so no
file grows without bound; the tokenizer travels with the tokens; the dataset has a fingerprint
that a loader's checkpointed position is tied to.

Invariants: files are read in sorted path order (duplicates across patterns once), so the same
inputs give byte-identical shards; no document is empty; every document ends with the EOS id.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from fnmatch import fnmatch
from typing import Any

import numpy as np

from mplan.data import parquet
from mplan.data.errors import DataError
from mplan.data.tokenizer import DEFAULT_VOCAB_SIZE, TextTokenizer, from_backend, load_tokenizer, train_tokenizer
from mplan.json_fields import FieldReader, load_json_file

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "mplan-token-shards"
VERSION = 1
DTYPES = ("uint16", "uint32")

DEFAULT_SHARD_TOKENS = 1 << 28
"""A shard is closed after the document that takes it past this many tokens: 512 MiB of uint16."""

BATCH_CHARS = 4 << 20
"""Characters of text handed to the tokenizer at once: enough for its threads, little memory."""

TEXT_FIELD = "text"
"""The field (JSONL) or column (parquet) holding each document's text."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One shard as the index describes it."""

    file: str
    """The .bin file's name inside the directory."""
    num_tokens: int
    num_documents: int
    documents: str
    """The .npy file of its document start offsets (int64, num_documents + 1 entries)."""
    sha256: str
    """Of the .bin's bytes (checked by `TokenShards.verify`, which reads every byte)."""


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id below `vocab_size`."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def fingerprint(fields: dict[str, Any]) -> str:
    """The dataset's identity: a sha256 over what decides its tokens (not where they came from)."""
    kept = {k: fields[k] for k in ("format", "version", "dtype", "vocab_size", "eos_id", "tokenizer_sha256",
                                    "num_tokens", "num_documents", "shards")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------- prepare

def prepare(inputs: str | Sequence[str], out_dir: str, *, tokenizer: str | TextTokenizer | None = None,
            vocab_size: int = DEFAULT_VOCAB_SIZE, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            exclude: Sequence[str] = (), progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokenize `inputs` into token shards in `out_dir` (module docstring) and return a summary:
    {"directory", "num_files", "num_documents", "num_tokens", "num_shards", "dtype", "vocab_size",
    "eos_id", "tokenizer" (a path or "trained"), "skipped", "fingerprint", "seconds"}.

    `inputs`: glob patterns or paths (`**` recursive); a `.jsonl` file gives one document per
    line, a `.parquet` file one per row, any other file is one document. `exclude`: patterns
    (fnmatch on the whole path, e.g. '*/site-packages/*') whose matches are left out.
    `tokenizer`: a path (`load_tokenizer`), a TextTokenizer, or None to train a byte-level BPE of
    `vocab_size` on the same documents. `out_dir` must be new or empty. `progress` hears news."""
    start = time.perf_counter()
    say = progress or (lambda _: None)
    patterns = [inputs] if isinstance(inputs, str) else list(inputs)
    files = find_files(patterns, exclude=exclude)
    if not isinstance(shard_tokens, int) or isinstance(shard_tokens, bool) or shard_tokens < 1:
        raise DataError(f"shard_tokens must be an integer >= 1, got {shard_tokens!r}")
    for path in files:  # before the output exists and the tokenizer trains: a wrong file costs a second
        if path.endswith(".parquet"):
            parquet.check(path, TEXT_FIELD)
    _make_empty_dir(out_dir)
    skipped: list[str] = []
    if tokenizer is None:
        say(f"training a byte-level BPE of {vocab_size} tokens on {len(files)} files")
        tok = train_tokenizer(_documents(files, []), vocab_size=vocab_size)
    else:
        tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    tok.save(out_dir)
    dtype = dtype_for(tok.vocab_size)
    writer = _ShardWriter(out_dir, np.dtype(dtype), shard_tokens)
    for batch in _batches(_documents(files, skipped)):
        for ids in tok.encode_batch(batch):
            if ids:
                writer.add(ids, tok.eos_id)
        say(f"{writer.num_documents} documents, {writer.num_tokens / 1e6:.1f} M tokens")
    shards = writer.close()
    if not shards:
        raise DataError(f"{', '.join(patterns)}: no text in {len(files)} file(s) "
                        f"({len(skipped)} not UTF-8)")
    index = _write_index(out_dir, tok, dtype, shards,
                         {"patterns": patterns, "num_files": len(files), "skipped": skipped})
    return {"directory": out_dir, "num_files": len(files), "num_documents": index["num_documents"],
            "num_tokens": index["num_tokens"], "num_shards": len(shards), "dtype": dtype,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.source, "skipped": skipped,
            "fingerprint": index["fingerprint"], "seconds": time.perf_counter() - start}


def find_files(patterns: Sequence[str], *, exclude: Sequence[str] = ()) -> list[str]:
    """The files `patterns` match (each must match at least one), less `exclude`, sorted, once."""
    if not patterns:
        raise DataError("no input given: name text files (a glob such as 'texts/**/*.txt') or a JSONL file")
    found: set[str] = set()
    for pattern in patterns:
        matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        kept = [p for p in matches if not any(fnmatch(p, e) for e in exclude)]
        if not kept:
            more = f" ({len(matches)} left out by --exclude)" if matches else ""
            raise DataError(f"{pattern}: matches no file{more}")
        found.update(os.path.normpath(p) for p in kept)
    return sorted(found)


def _make_empty_dir(out_dir: str) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise DataError(f"{out_dir}: already exists and is not empty; name a new directory or remove it")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{out_dir}: cannot create: {exc.strerror or exc}") from None


def _documents(files: Sequence[str], skipped: list[str]) -> Iterator[str]:
    """Each document's text in order; a text file that is not UTF-8 is named in `skipped`."""
    for path in files:
        if path.endswith(".jsonl"):
            yield from _jsonl_documents(path)
        elif path.endswith(".parquet"):
            yield from parquet.documents(path, TEXT_FIELD)
        else:
            try:
                with open(path, encoding="utf-8") as handle:
                    yield handle.read()
            except UnicodeDecodeError:
                skipped.append(path)
            except OSError as exc:
                raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _jsonl_documents(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{number}: not a JSON object: {exc}") from None
                text = record.get(TEXT_FIELD) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{number}: needs a string field {TEXT_FIELD!r}, got "
                                    f"{type(text).__name__ if isinstance(record, dict) else 'no object'}")
                yield text
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start} of a line)") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Appends documents (ids + EOS) to shard-NNNNN.bin, closing a shard between documents once
    it holds `shard_tokens` ids."""

    def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[Shard] = []
        self.num_tokens = self.num_documents = 0
        self._handle: Any = None
        self._hash: Any = None
        self._offsets: list[int] = [0]

    def add(self, ids: list[int], eos_id: int) -> None:
        if self._handle is None:
            name = f"shard-{len(self.shards):05d}.bin"
            self._handle = open(os.path.join(self.directory, name), "wb")
            self._hash, self._offsets = hashlib.sha256(), [0]
        data = np.asarray(ids + [eos_id], dtype=self.dtype).astype(self.dtype.newbyteorder("<"), copy=False)
        payload = data.tobytes()
        self._handle.write(payload)
        self._hash.update(payload)
        self._offsets.append(self._offsets[-1] + len(data))
        self.num_tokens += len(data)
        self.num_documents += 1
        if self._offsets[-1] >= self.shard_tokens:
            self._finish_shard()

    def _finish_shard(self) -> None:
        self._handle.close()
        stem = f"shard-{len(self.shards):05d}"
        np.save(os.path.join(self.directory, f"{stem}.docs.npy"), np.asarray(self._offsets, dtype="<i8"))
        self.shards.append(Shard(file=f"{stem}.bin", num_tokens=self._offsets[-1],
                                 num_documents=len(self._offsets) - 1, documents=f"{stem}.docs.npy",
                                 sha256=self._hash.hexdigest()))
        self._handle = None

    def close(self) -> list[Shard]:
        if self._handle is not None:
            self._finish_shard()
        return self.shards


def _write_index(out_dir: str, tok: TextTokenizer, dtype: str, shards: list[Shard],
                 sources: dict[str, Any]) -> dict[str, Any]:
    with open(os.path.join(out_dir, TOKENIZER_FILE), "rb") as handle:
        tokenizer_sha256 = hashlib.sha256(handle.read()).hexdigest()
    index: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        "tokenizer": TOKENIZER_FILE, "tokenizer_sha256": tokenizer_sha256,
        "num_tokens": sum(s.num_tokens for s in shards), "num_documents": sum(s.num_documents for s in shards),
        "shards": [dataclasses.asdict(s) for s in shards], "sources": sources}
    index["fingerprint"] = fingerprint(index)
    partial = os.path.join(out_dir, INDEX_FILE + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=1)
        handle.write("\n")
    os.replace(partial, os.path.join(out_dir, INDEX_FILE))
    return index


# -------------------------------------------------------------------------------------------- open

class TokenShards:
    """A prepared directory, validated and memory-mapped: one token stream across its shards."""

    __slots__ = ("directory", "dtype", "vocab_size", "eos_id", "fingerprint", "shards", "num_tokens",
                 "num_documents", "_tokens", "_token_starts", "_offsets", "_doc_starts", "_tokenizer_file",
                 "_tokenizer_sha256")

    def __init__(self, *, directory: str, dtype: str, vocab_size: int, eos_id: int, fingerprint: str,
                 shards: Sequence[Shard], tokenizer_file: str, tokenizer_sha256: str) -> None:
        self.directory, self.dtype, self.vocab_size, self.eos_id = directory, np.dtype(dtype), vocab_size, eos_id
        self.fingerprint, self.shards, self._tokenizer_file = fingerprint, tuple(shards), tokenizer_file
        self._tokenizer_sha256 = tokenizer_sha256
        self._tokens = [_map_tokens(directory, s, self.dtype) for s in self.shards]
        self._offsets = [_load_offsets(directory, s) for s in self.shards]
        self._token_starts = np.cumsum([0] + [s.num_tokens for s in self.shards])
        self._doc_starts = np.cumsum([0] + [s.num_documents for s in self.shards])
        self.num_tokens = int(self._token_starts[-1])
        self.num_documents = int(self._doc_starts[-1])

    @classmethod
    def open(cls, directory: str) -> TokenShards:
        """Read and check `directory`'s index, shards and offsets (module docstring)."""
        path = os.path.join(directory, INDEX_FILE)
        if not os.path.isfile(path):
            what = "is not a directory" if not os.path.isdir(directory) else f"holds no {INDEX_FILE}"
            raise DataError(f"{directory}: {what} (make token shards with `mplan data prepare`)")
        r = FieldReader(load_json_file(path, DataError), file=path, path="", error=DataError)
        fields: dict[str, Any] = {"format": r.string("format", choices=[FORMAT])}
        version = r.integer("version")
        if version != VERSION:
            raise r.error("version", f"must be {VERSION} (this mplan's token-shard format)")
        fields["version"] = version
        fields["dtype"] = r.string("dtype", choices=DTYPES)
        fields["vocab_size"] = r.integer("vocab_size", minimum=2)
        if fields["vocab_size"] > np.iinfo(fields["dtype"]).max + 1:
            raise r.error("vocab_size", f"must fit {fields['dtype']} (at most {np.iinfo(fields['dtype']).max + 1})")
        fields["eos_id"] = r.integer("eos_id", minimum=0)
        if fields["eos_id"] >= fields["vocab_size"]:
            raise r.error("eos_id", f"must be below vocab_size {fields['vocab_size']}")
        tokenizer = _plain_name(r, "tokenizer", directory)
        fields["tokenizer_sha256"] = _sha256_field(r, "tokenizer_sha256")
        fields["num_tokens"] = r.integer("num_tokens")
        fields["num_documents"] = r.integer("num_documents")
        shards = [_read_shard(s, directory) for s in r.objects("shards")]
        if not shards:
            raise r.error("shards", "must name at least one shard")
        fields["shards"] = [dataclasses.asdict(s) for s in shards]
        for total in ("num_tokens", "num_documents"):
            if fields[total] != sum(getattr(s, total) for s in shards):
                raise r.error(total, f"must be the sum of the shards' {total}")
        sources = r.obj("sources")
        for key in ("patterns", "skipped"):
            if not (isinstance(sources.raw(key), list) and all(isinstance(x, str) for x in sources.raw(key))):
                raise sources.error(key, "must be a list of strings")
        sources.integer("num_files", minimum=0)
        sources.finish()
        stored = _sha256_field(r, "fingerprint")
        r.finish()
        for shard in shards:  # before the fingerprint: a wrong dtype or count is named as such
            _check_size(directory, shard, np.dtype(fields["dtype"]))
        if stored != fingerprint(fields):
            raise r.error("fingerprint", "does not match the index's other fields (edited by hand?)")
        return cls(directory=directory, dtype=fields["dtype"], vocab_size=fields["vocab_size"],
                   eos_id=fields["eos_id"], fingerprint=stored, shards=shards,
                   tokenizer_file=os.path.join(directory, tokenizer), tokenizer_sha256=fields["tokenizer_sha256"])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole corpus (across shards), a copy in the shards' dtype."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the corpus of {self.num_tokens}")
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        parts = []
        while start < stop:
            offset = start - int(self._token_starts[first])
            take = min(stop - start, self.shards[first].num_tokens - offset)
            parts.append(self._tokens[first][offset:offset + take])
            start += take
            first += 1
        return np.concatenate(parts) if len(parts) != 1 else np.array(parts[0])

    def document(self, index: int) -> np.ndarray:
        """The ids of document `index` (in prepare's order), its EOS last."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} outside the corpus of {self.num_documents}")
        shard = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        local = index - int(self._doc_starts[shard])
        begin, end = self._offsets[shard][local:local + 2]
        return np.array(self._tokens[shard][begin:end])

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer that made these ids (the directory's tokenizer.json)."""
        from tokenizers import Tokenizer

        with open(self._tokenizer_file, "rb") as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != self._tokenizer_sha256:
            raise DataError(f"{self._tokenizer_file}: does not match the index's tokenizer_sha256 (not the "
                            f"tokenizer that made these tokens)")
        try:
            backend = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises plain Exception
            raise DataError(f"{self._tokenizer_file}: not a tokenizers tokenizer.json: {exc}") from None
        return from_backend(backend, eos_id=self.eos_id, source=self._tokenizer_file)

    def verify(self) -> None:
        """Hash every .bin and compare with the index (reads all the data: not done by `open`)."""
        for shard in self.shards:
            digest = hashlib.sha256()
            with open(os.path.join(self.directory, shard.file), "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
            if digest.hexdigest() != shard.sha256:
                raise DataError(f"{os.path.join(self.directory, shard.file)}: its bytes do not match the "
                                f"index's sha256 (changed since prepared)")


def _plain_name(r: FieldReader, key: str, directory: str) -> str:
    """A file name inside `directory` (no separators, no '..'), which must exist."""
    name = r.string(key)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise r.error(key, "must be a file name inside the directory")
    if not os.path.isfile(os.path.join(directory, name)):
        raise r.error(key, "names a file that does not exist")
    return name


def _sha256_field(r: FieldReader, key: str) -> str:
    value = r.string(key)
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise r.error(key, "must be a sha256 in 64 lowercase hex digits")
    return value


def _read_shard(r: FieldReader, directory: str) -> Shard:
    shard = Shard(file=_plain_name(r, "file", directory), num_tokens=r.integer("num_tokens"),
                  num_documents=r.integer("num_documents"), documents=_plain_name(r, "documents", directory),
                  sha256=_sha256_field(r, "sha256"))
    r.finish()
    return shard


def _check_size(directory: str, shard: Shard, dtype: np.dtype) -> None:
    path = os.path.join(directory, shard.file)
    size, expected = os.path.getsize(path), shard.num_tokens * dtype.itemsize
    if size != expected:
        raise DataError(f"{path}: holds {size} bytes, the index says {shard.num_tokens} tokens of {dtype} "
                        f"({expected} bytes): {'truncated' if size < expected else 'longer'} or not this "
                        f"index's shard")


def _map_tokens(directory: str, shard: Shard, dtype: np.dtype) -> np.memmap:
    return np.memmap(os.path.join(directory, shard.file), dtype=dtype.newbyteorder("<"), mode="r",
                     shape=(shard.num_tokens,))


def _load_offsets(directory: str, shard: Shard) -> np.ndarray:
    """The shard's document offsets, checked: int64, num_documents + 1 of them, 0 first, strictly
    increasing, num_tokens last. Loaded without pickles."""
    path = os.path.join(directory, shard.documents)
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"{path}: not a .npy array of document offsets: {exc}") from None
    if not isinstance(offsets, np.ndarray) or offsets.dtype != np.dtype("<i8") or offsets.ndim != 1:
        raise DataError(f"{path}: document offsets must be a 1-D int64 array, got "
                        f"{getattr(offsets, 'dtype', type(offsets).__name__)} of shape {getattr(offsets, 'shape', '?')}")
    if len(offsets) != shard.num_documents + 1:
        raise DataError(f"{path}: holds {len(offsets)} offsets, the index says {shard.num_documents} documents "
                        f"(+1 for the end)")
    if offsets[0] != 0 or offsets[-1] != shard.num_tokens or not bool(np.all(np.diff(offsets) > 0)):
        raise DataError(f"{path}: document offsets must start at 0, increase strictly and end at the shard's "
                        f"{shard.num_tokens} tokens")
    return offsets
