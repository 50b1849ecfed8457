"""Real data (issue 32, item 2): text to token shards and back, the index refused field by field,
and the packed loader's order, DP slices and resumption by samples.

The corpus is written by the tests (text files in nested folders, a JSONL file); the expected
token stream is rebuilt from the texts with the tokenizer alone, never from the shards, so a
packing or offset bug cannot agree with itself. One test prepares 200 files of this machine's
Python standard library, the corpus the README's first command trains on.
"""
from __future__ import annotations

import glob
import json
import os
import sysconfig
import time

import numpy as np
import pytest
import torch

from mplan.data import DataError, PackedLoader, TokenShards, load_tokenizer, prepare, train_tokenizer
from mplan.data.shards import fingerprint

VOCAB = 320
TEXTS = {
    "texts/a/alpha.txt": "The quick brown fox jumps over the lazy dog.\n" * 7 + "Fin.\n",
    "texts/a/beta.txt": "def add(x, y):\n    return x + y\n\nprint(add(2, 3))\n" * 5,
    "texts/b/gamma.txt": "Größe, café, naïve, 東京, emoji 🚀 — all bytes survive.\n" * 4,
    "texts/b/empty.txt": "",
    "texts/delta.txt": "\n".join(f"line {i}: {'ab' * (i % 7)} {i * i}" for i in range(60)) + "\n",
}
RECORDS = ["a JSONL document about shards and tokens.", "another one, with numbers 12345 and 678.",
           "", "the last JSONL record: padding " + "x" * 50]


def _write_corpus(root) -> list[str]:
    """Write the corpus under `root`; return the documents in prepare's order (sorted paths, the
    JSONL's lines in place of its file), empty ones left out as prepare leaves them out."""
    for name, text in TEXTS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "texts" / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(RECORDS)) + "\n\n", encoding="utf-8")
    order = sorted([*TEXTS, "texts/c.jsonl"])
    docs = []
    for name in order:
        docs += RECORDS if name.endswith(".jsonl") else [TEXTS[name]]
    return [d for d in docs if d]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(root, documents, a prepared directory with several shards)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _write_corpus(root)
    out = str(root / "tokens")
    prepare([str(root / "texts/**/*.txt"), str(root / "texts/*.jsonl")], out, vocab_size=VOCAB, shard_tokens=200,
            progress=None)
    return root, docs, out


def _stream(shards: TokenShards, docs: list[str]) -> np.ndarray:
    """The corpus stream from the texts: each document's ids (the tokenizer alone), then EOS."""
    tok = shards.tokenizer()
    return np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in docs])


# ------------------------------------------------------------------------------------- preparation

def test_prepared_documents_decode_back_to_their_texts(corpus) -> None:
    _, docs, out = corpus
    shards = TokenShards.open(out)
    tok = shards.tokenizer()
    assert shards.dtype == np.uint16 and shards.vocab_size <= VOCAB and tok.eos_token == "<|endoftext|>"
    assert shards.num_documents == len(docs) == 7
    assert len(shards.shards) > 2  # shard_tokens=200 cut the corpus, between documents
    for i, text in enumerate(docs):
        ids = shards.document(i)
        assert ids[-1] == shards.eos_id and shards.eos_id not in ids[:-1]
        assert tok.decode(ids) == text  # byte-level BPE: exact, unicode included
    assert np.array_equal(shards.read(0, shards.num_tokens), _stream(shards, docs))


def test_preparing_twice_gives_the_same_bytes(corpus, tmp_path) -> None:
    root, _, out = corpus
    again = str(tmp_path / "again")
    summary = prepare([str(root / "texts/*.jsonl"), str(root / "texts/**/*.txt")], again, vocab_size=VOCAB,
                      shard_tokens=200)
    assert summary["fingerprint"] == TokenShards.open(out).fingerprint
    for name in sorted(os.listdir(out)):
        if name != "index.json":  # its sources list the patterns in the order given
            assert (tmp_path / "again" / name).read_bytes() == open(os.path.join(out, name), "rb").read(), name


def test_a_given_tokenizer_is_used_and_copied(corpus, tmp_path) -> None:
    """A Hugging Face-style directory (tokenizer.json + tokenizer_config.json naming the EOS)."""
    root, docs, out = corpus
    hf = tmp_path / "hf"
    hf.mkdir()
    TokenShards.open(out).tokenizer().save(str(hf))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    loaded = load_tokenizer(str(hf))
    assert loaded.eos_id == 0 and loaded.source == str(hf)
    summary = prepare(str(root / "texts/**/*.txt"), str(tmp_path / "tokens"), tokenizer=str(hf))
    assert summary["tokenizer"] == str(hf) and summary["num_shards"] == 1
    assert (tmp_path / "tokens" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    shards = TokenShards.open(str(tmp_path / "tokens"))
    text_docs = [TEXTS[n] for n in sorted(TEXTS) if TEXTS[n]]
    assert np.array_equal(shards.read(0, shards.num_tokens), _stream(shards, text_docs))


def test_a_directory_without_tokenizer_json_loads_through_transformers(tmp_path) -> None:
    """GPT-2's files (vocab.json, merges.txt, tokenizer_config.json): AutoTokenizer, offline, gives the
    fast tokenizer, which encodes as the one those files were saved from."""
    pytest.importorskip("transformers")
    trained = train_tokenizer(list(TEXTS.values()), vocab_size=300)
    trained.backend.model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                                "eos_token": "<|endoftext|>"}))
    loaded = load_tokenizer(str(tmp_path))
    assert (loaded.eos_id, loaded.vocab_size) == (trained.eos_id, trained.vocab_size)
    for text in TEXTS.values():
        assert loaded.encode(text) == trained.encode(text)
    trained.save(str(tmp_path))  # a tokenizer.json read directly: a configured EOS it lacks is refused
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(DataError, match="eos_token '<|nope|>' is not in the tokenizer's vocabulary"):
        load_tokenizer(str(tmp_path))


def test_bpe_training_is_deterministic() -> None:
    texts = list(TEXTS.values()) * 3
    first, second = train_tokenizer(texts, vocab_size=300), train_tokenizer(texts, vocab_size=300)
    assert first.backend.to_str() == second.backend.to_str()
    assert first.encode(texts[2]) == second.encode(texts[2]) and len(first.encode(texts[0])) < len(texts[0]) / 2


def test_prepare_refusals_are_one_line(corpus, tmp_path) -> None:
    root, _, out = corpus
    cases = {
        "matches no file": lambda: prepare(str(root / "nothing/*.txt"), str(tmp_path / "a")),
        "not empty": lambda: prepare(str(root / "texts/**/*.txt"), out),
        "vocab_size must be": lambda: prepare(str(root / "texts/**/*.txt"), str(tmp_path / "b"), vocab_size=100),
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    cases["bad.jsonl:2: needs a string field 'text'"] = lambda: prepare(str(bad), str(tmp_path / "c"))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        parquet = tmp_path / "d.parquet"
        parquet.write_bytes(b"PAR1")
        cases["needs pyarrow, which is not installed"] = lambda: prepare(str(parquet), str(tmp_path / "d"))
    for expected, call in cases.items():
        with pytest.raises(DataError) as caught:
            call()
        assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_prepares_and_refuses(corpus, tmp_path, capsys) -> None:
    from mplan.cli import main

    root, docs, _ = corpus
    out = str(tmp_path / "cli")
    assert main(["data", "prepare", str(root / "texts/**/*.txt"), "--jsonl", str(root / "texts/c.jsonl"), "-o", out,
                 "--vocab-size", str(VOCAB), "--exclude", "*/b/*", "--json", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_files"] == 4 and summary["num_documents"] == len(docs) - 1  # gamma.txt excluded
    assert main(["data", "prepare", str(root / "texts/**/*.txt"), "-o", out, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mplan data: error: ") and "not empty" in err


# ------------------------------------------------------------------------------- index validation

def _copy(out: str, tmp_path) -> str:
    import shutil

    target = str(tmp_path / "copy")
    shutil.copytree(out, target)
    return target


def _edit_index(directory: str, change) -> None:
    path = os.path.join(directory, "index.json")
    index = json.load(open(path))
    change(index)
    with open(path, "w") as handle:
        json.dump(index, handle)


def _refit(index: dict) -> None:
    index["fingerprint"] = fingerprint(index)


BROKEN = {
    "index.json: not valid JSON": lambda d: open(os.path.join(d, "index.json"), "w").write('{"format": '),
    "index.json: dtype must be one of 'uint16', 'uint32', got \"int8\"":
        lambda d: _edit_index(d, lambda i: i.update(dtype="int8")),
    "shard-00000.bin: holds {two} bytes, the index says {n} tokens of uint32 ({four} bytes): truncated or not":
        lambda d: _edit_index(d, lambda i: i.update(dtype="uint32")),
    "shard-00001.bin: holds 1 bytes": lambda d: os.truncate(os.path.join(d, "shard-00001.bin"), 1),
    "index.json: shards[0].file names a file that does not exist":
        lambda d: os.remove(os.path.join(d, "shard-00000.bin")),
    "index.json: shards[1].documents must be a file name inside the directory":
        lambda d: _edit_index(d, lambda i: i["shards"][1].update(documents="../tokens/shard-00001.docs.npy")),
    "index.json: shards[0].extra is not a known field":
        lambda d: _edit_index(d, lambda i: i["shards"][0].update(extra=1)),
    "index.json: num_tokens must be the sum of the shards' num_tokens":
        lambda d: _edit_index(d, lambda i: i.update(num_tokens=i["num_tokens"] + 1)),
    "index.json: eos_id must be below vocab_size": lambda d: _edit_index(d, lambda i: i.update(eos_id=70000)),
    "index.json: fingerprint does not match": lambda d: _edit_index(d, lambda i: i.update(eos_id=1)),
    "shard-00000.docs.npy: not a .npy array of document offsets":
        lambda d: np.save(os.path.join(d, "shard-00000.docs.npy"), np.array([0, {"x": 1}], dtype=object)),
    "shard-00000.docs.npy: document offsets must be a 1-D int64 array":
        lambda d: np.save(os.path.join(d, "shard-00000.docs.npy"), np.array([0, 100, 200], dtype=np.int32)),
    "shard-00001.docs.npy: document offsets must start at 0, increase strictly":
        lambda d: np.save(os.path.join(d, "shard-00001.docs.npy"), _short_offsets(d)),
    "holds no index.json": lambda d: os.remove(os.path.join(d, "index.json")),
}


def _short_offsets(directory: str) -> np.ndarray:
    offsets = np.load(os.path.join(directory, "shard-00001.docs.npy"))
    offsets[-1] -= 1
    return offsets


@pytest.mark.parametrize("expected", list(BROKEN))
def test_a_broken_directory_is_refused_in_one_line_naming_the_file(corpus, tmp_path, expected) -> None:
    directory = _copy(corpus[2], tmp_path)
    n = json.load(open(os.path.join(directory, "index.json")))["shards"][0]["num_tokens"]
    BROKEN[expected](directory)
    with pytest.raises(DataError) as caught:
        TokenShards.open(directory)
    message = str(caught.value)
    assert expected.format(n=n, two=2 * n, four=4 * n) in message and "\n" not in message
    assert directory in message  # names the file, with its directory


def test_a_changed_shard_is_caught_by_verify_not_by_open(corpus, tmp_path) -> None:
    directory = _copy(corpus[2], tmp_path)
    path = os.path.join(directory, "shard-00000.bin")
    data = bytearray(open(path, "rb").read())
    data[0] ^= 1
    open(path, "wb").write(bytes(data))
    shards = TokenShards.open(directory)  # sizes and index agree: open reads no token
    with pytest.raises(DataError, match="shard-00000.bin: its bytes do not match"):
        shards.verify()


# ------------------------------------------------------------------------------------------ loader

def test_an_epoch_reads_every_window_once_and_labels_are_shifted(corpus) -> None:
    _, docs, out = corpus
    loader = PackedLoader(out, seq_len=16, global_batch=4, seed=3)
    stream = _stream(loader.shards, docs)
    n = loader.num_sequences
    assert n == (len(stream) - 1) // 16 and n > 40
    ids, labels = loader.samples(0, n)
    assert ids.dtype == labels.dtype == torch.int64 and ids.shape == (n, 16)
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    order = [loader.sequence_index(s) for s in range(n)]
    assert sorted(order) == list(range(n)) and order != list(range(n))
    in_place = torch.empty_like(ids)
    in_place[order] = ids  # row i is window order[i]
    assert torch.equal(in_place.reshape(-1), torch.from_numpy(stream[:n * 16]).long())
    in_place[order] = labels
    assert torch.equal(in_place.reshape(-1), torch.from_numpy(stream[1:n * 16 + 1]).long())
    next_epoch = [loader.sequence_index(s) for s in range(n, 2 * n)]
    assert sorted(next_epoch) == list(range(n)) and next_epoch != order  # the same windows, another order


def test_the_order_is_a_function_of_the_seed(corpus) -> None:
    out = corpus[2]
    a, b = (PackedLoader(out, seq_len=8, global_batch=6, seed=7) for _ in range(2))
    c = PackedLoader(out, seq_len=8, global_batch=6, seed=8)
    for step in (0, 5, 40):  # step 40 is in a later epoch
        assert torch.equal(a.global_batch(step)[0], b.global_batch(step)[0])
    assert not torch.equal(a.global_batch(0)[0], c.global_batch(0)[0])


def test_dp_ranks_rows_make_the_global_batch(corpus) -> None:
    loader = PackedLoader(corpus[2], seq_len=8, global_batch=8, seed=1)
    epoch_steps = loader.num_sequences // 8
    for step in (0, 1, epoch_steps, epoch_steps + 1):  # the batch at an epoch's end wraps into the next
        whole = loader.global_batch(step)
        for dp in (1, 2, 4, 8):
            parts = [loader.local_batch(step, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    with pytest.raises(ValueError, match="must split evenly over dp_size 3"):
        loader.local_batch(0, 0, 3)


def _run(out: str, steps: int, dp: int, *, batch: int, state: dict | None = None) -> tuple[list[torch.Tensor], dict]:
    """`steps` steps on `dp` ranks, one loader each (as under torchrun), optionally resumed from
    `state`; each step's batch as the ranks' rows concatenated, and the state after them."""
    loaders = [PackedLoader(out, seq_len=8, global_batch=batch, seed=11) for _ in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint's manifest holds it
    batches = [torch.cat([loader.next_batch(r, dp)[0] for r, loader in enumerate(loaders)]) for _ in range(steps)]
    assert len({json.dumps(loader.state_dict()) for loader in loaders}) == 1
    return batches, loaders[0].state_dict()


@pytest.mark.parametrize("dp_after", [1, 4])
def test_a_dp_size_change_resumes_at_the_same_sample(corpus, dp_after) -> None:
    out = corpus[2]
    straight, _ = _run(out, 6, 2, batch=8)
    first, state = _run(out, 3, 2, batch=8)
    assert state["consumed_samples"] == 24
    second, _ = _run(out, 3, dp_after, batch=8, state=state)
    for a, b in zip(straight, first + second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch_after", [4, 12])
def test_a_global_batch_change_continues_with_the_next_sample(corpus, batch_after) -> None:
    out = corpus[2]
    reference = PackedLoader(out, seq_len=8, global_batch=8, seed=11)
    _, state = _run(out, 5, 2, batch=8)  # 40 samples: the stream of an epoch and a bit
    second, after = _run(out, 2, 2, batch=batch_after, state=state)
    assert torch.equal(torch.cat(second), reference.samples(40, 2 * batch_after)[0])
    assert after == {**state, "consumed_samples": 40 + 2 * batch_after, "global_batch": batch_after}


def test_a_state_from_other_data_or_windows_is_refused(corpus, tmp_path) -> None:
    root, _, out = corpus
    loader = PackedLoader(out, seq_len=8, global_batch=4, seed=2)
    loader.next_batch()
    state = loader.state_dict()
    assert state == {"consumed_samples": 4, "seed": 2, "seq_len": 8, "global_batch": 4,
                     "data_fingerprint": loader.shards.fingerprint}
    other = prepare(str(root / "texts/**/*.txt"), str(tmp_path / "other"), vocab_size=VOCAB)["directory"]
    refusals = {
        "saved on dataset": PackedLoader(other, seq_len=8, global_batch=4, seed=2),
        "saved with seq_len 8, this loader has 16": PackedLoader(out, seq_len=16, global_batch=4, seed=2),
        "saved with seed 2, this loader has 3": PackedLoader(out, seq_len=8, global_batch=4, seed=3),
    }
    for expected, fresh in refusals.items():
        with pytest.raises(DataError, match=expected):
            fresh.load_state_dict(state)
        assert fresh.consumed_samples == 0
    with pytest.raises(DataError, match="data loader state: step is not a known field"):
        loader.load_state_dict({**state, "step": 1})


def test_the_position_travels_in_a_checkpoint(corpus, tmp_path) -> None:
    """`extras={"data": loader}` of pm.save / pm.load: the next step's batch after a load is the
    one the saving run would have read."""
    import mplan
    from mplan.models import build_model

    out = corpus[2]
    vocab = TokenShards.open(out).vocab_size

    def pm_and_loader():
        model = build_model(f"gpt:layers=1,hidden=16,heads=2,seq=8,vocab={vocab}", device="cpu", seed=0)
        loader = PackedLoader(out, seq_len=8, global_batch=4, seed=5)
        pm = mplan.autoparallel(model, example_inputs=(loader.global_batch(0)[0],), global_batch=4, plan="dp=1",
                                progress="quiet")
        return pm, loader

    pm, loader = pm_and_loader()
    for _ in range(3):
        pm.train_step(*loader.next_batch())
    pm.save(str(tmp_path / "ckpt"), extras={"data": loader})
    expected = loader.next_batch()[0]
    pm2, loader2 = pm_and_loader()
    pm2.load(str(tmp_path / "ckpt"), extras={"data": loader2})
    assert loader2.consumed_samples == 12 and torch.equal(loader2.next_batch()[0], expected)


# ----------------------------------------------------------------------------------- a real corpus

def test_two_hundred_stdlib_files_prepare_in_seconds(tmp_path) -> None:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and "dist-packages" not in p)[:200]
    assert len(files) == 200
    start = time.perf_counter()
    summary = prepare(files, str(tmp_path / "stdlib"), vocab_size=4096, progress=None)
    seconds = time.perf_counter() - start
    assert summary["num_files"] == 200 and summary["num_documents"] >= 190 and summary["num_tokens"] > 200_000
    assert seconds < 20, f"200 stdlib files took {seconds:.1f} s"
    shards = TokenShards.open(summary["directory"])
    tok = shards.tokenizer()
    text = open(files[0], encoding="utf-8").read()
    assert tok.decode(shards.document(0)) == text
    assert len(shards.document(0)) < len(text) / 2.5  # the BPE learned Python: well under a token per 2.5 chars
    ids, labels = PackedLoader(shards, seq_len=256, global_batch=8, seed=0).local_batch(0, 1, 2)
    assert ids.shape == (4, 256) and int(ids.max()) < 4096
