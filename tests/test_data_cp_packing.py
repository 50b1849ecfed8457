"""Packing for dynamic CP (issue 34, item 4): `data.packing = "cp_aligned"` fills windows so their
documents deal whole onto the cp ranks with balanced work, which the runtime's two-size rule
(`ir.context_layout.whole_documents`) then runs at cp=1; the plain loader's windows never deal.

Specs: every token of the stream is in exactly one window of an epoch; each window the packer marks
aligned is one `whole_documents` deals (the rule the runtime asks, not the packer's own copy of it);
padding is EOS ids labelled -100, each its own document; every real token's label is the token after
it in the stream; the checkpointed position (`consumed_samples`) resumes at the same sample, and a
state of another packing or share count is refused in one line; the config refuses a bad value.
Exactness of training on such windows under cp=2 is in tests/test_context_documents.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mplan.data import DataError, PackedLoader, TokenShards
from mplan.data.cp_packing import pack_for_shares
from mplan.data.loader import packed_document_ids
from mplan.ir.attention_mask import doc_ids_from_lengths
from mplan.ir.context_layout import whole_documents
from short_documents import short_documents

SEQ = 32


def _web_mix(tokens: int, seed: int) -> list[int]:
    """Synthetic document lengths, log-normal (median 600, sigma 1.2), cut to [16, 131072]."""
    rng = np.random.RandomState(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(min(max(rng.lognormal(np.log(600), 1.2), 16), 131072)))
    return out


@pytest.mark.parametrize("cp", [8, 16])
def test_most_windows_deal_whole_where_stream_cuts_deal_none(cp: int) -> None:
    seq_len = 131072
    lengths = _web_mix(24 * seq_len, seed=cp)
    packing = pack_for_shares(lengths, seq_len, cp)
    covered = sorted((start, n) for w in packing.windows for _, start, n in w.segments)
    edge = 0
    for start, n in covered:  # the documents' tokens, each in exactly one window
        assert start == edge, (start, edge)
        edge += n
    assert edge == sum(lengths)
    dealt = [whole_documents(seq_len, cp, doc_ids_from_lengths(w.lengths(seq_len))) is not None
             for w in packing.windows]
    assert dealt == [w.aligned for w in packing.windows]
    assert sum(dealt) / len(dealt) > 0.5, packing.aligned
    assert packing.padding < 0.06, packing.padding
    stream_cut = [whole_documents(seq_len, cp, doc_ids_from_lengths(pieces)) is None
                  for pieces in _cut(lengths, seq_len)]
    assert all(stream_cut)


def _cut(lengths: list[int], seq_len: int) -> list[list[int]]:
    out, current, room = [], [], seq_len
    for n in lengths:
        while n:
            take = min(n, room)
            current.append(take)
            n, room = n - take, room - take
            if not room:
                out.append(current)
                current, room = [], seq_len
    return out


def test_packing_refuses_shares_that_do_not_divide_the_window() -> None:
    with pytest.raises(ValueError, match="do not split into 3 equal shares"):
        pack_for_shares([4, 4], 32, 3)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """Shards of 120 short documents (1-14 words), so a share of 16 tokens holds whole ones."""
    return short_documents(tmp_path_factory.mktemp("cp_packing"), 120)


def test_an_epoch_trains_every_token_once_and_padding_trains_nothing(tokens: str) -> None:
    shards = TokenShards.open(tokens)
    stream = shards.read(0, shards.num_tokens).astype(np.int64)
    loader = PackedLoader(tokens, seq_len=SEQ, global_batch=4, seed=1, packing="cp_aligned", shares=2)
    n = loader.num_sequences
    ids, labels = loader.samples(0, n)
    assert ids.shape == labels.shape == (n, SEQ)
    seen = np.zeros(shards.num_tokens, dtype=np.int64)
    for row in range(n):
        window = loader.pack.windows[loader.sequence_index(row)]
        real = torch.zeros(SEQ, dtype=torch.bool)
        for offset, start, count in window.segments:
            real[offset:offset + count] = True
            seen[start:start + count] += 1
            assert torch.equal(ids[row, offset:offset + count], torch.from_numpy(stream[start:start + count]))
            successors = torch.from_numpy(stream[start + 1:start + count + 1])
            assert torch.equal(labels[row, offset:offset + len(successors)], successors)
        assert bool((ids[row, ~real] == shards.eos_id).all()) and bool((labels[row, ~real] == -100).all())
        if window.aligned:  # each padding token its own document: the rule deals the window whole
            assert whole_documents(SEQ, 2, packed_document_ids(ids[row:row + 1], shards.eos_id)) is not None
    assert bool((seen == 1).all())
    assert loader.pack.aligned > 0.5 and 0 < loader.pack.padding < 0.2, (loader.pack.aligned, loader.pack.padding)


def test_the_position_resumes_and_other_windows_are_refused(tokens: str) -> None:
    def loader(**kw):
        return PackedLoader(tokens, **{"seq_len": SEQ, "global_batch": 4, "seed": 1, "packing": "cp_aligned",
                                       "shares": 2, **kw})

    straight = loader()
    batches = [straight.next_batch()[0] for _ in range(5)]
    first = loader()
    for _ in range(2):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == 8 and state["packing"] == "cp_aligned" and state["shares"] == 2
    resumed = loader(global_batch=2)  # another global batch continues at the next sample
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([resumed.next_batch()[0] for _ in range(6)]), torch.cat(batches[2:]))
    plain = PackedLoader(tokens, seq_len=SEQ, global_batch=4, seed=1)
    for fresh, saved in ((loader(shares=4), state), (plain, state), (loader(), plain.state_dict())):
        with pytest.raises(DataError, match="data loader state: saved with packing .*other windows") as error:
            fresh.load_state_dict(saved)
        assert "\n" not in str(error.value) and fresh.consumed_samples == 0
    with pytest.raises(DataError, match="packing must be one of stream, cp_aligned, got 'aligned'"):
        loader(packing="aligned")


def test_the_pack_is_kept_beside_the_shards_and_checked_when_read(tokens: str, monkeypatch) -> None:
    """A corpus's pack takes minutes to hours of host time: the loader packs once per dataset,
    window length and share count and reads the kept file after; a file that does not check out
    (truncated, or of other shares) is packed again, never trusted."""
    import os

    from mplan.data import cp_packing

    def opened(shares: int = 2) -> PackedLoader:
        return PackedLoader(tokens, seq_len=SEQ, global_batch=4, seed=1, packing="cp_aligned", shares=shares)
    path = cp_packing.pack_file(tokens, TokenShards.open(tokens).fingerprint, SEQ, 2)
    if os.path.exists(path):
        os.remove(path)
    first = opened()
    assert os.path.exists(path)
    calls = []
    packer = cp_packing.pack_for_shares
    monkeypatch.setattr(cp_packing, "pack_for_shares", lambda *a, **k: calls.append(a) or packer(*a, **k))
    again = opened()
    assert calls == [] and again.pack == first.pack  # read back, the same windows
    with open(path, "r+b") as f:  # half a file: packed again
        f.truncate(os.path.getsize(path) // 2)
    assert cp_packing.load_packing(path, SEQ, 2) is None
    assert opened().pack == first.pack and len(calls) == 1
    assert cp_packing.load_packing(path, SEQ, 4) is None  # kept for 2 shares: not a pack for 4
    other = cp_packing.Packing(seq_len=SEQ, shares=2, windows=(cp_packing.Window(segments=((0, 0, 20), (10, 20, 4)),
                                                                                     aligned=True),))
    cp_packing.save_packing(other, path)  # overlapping segments: refused on load
    assert cp_packing.load_packing(path, SEQ, 2) is None
    assert opened().pack == first.pack and len(calls) == 2


@pytest.mark.parametrize("overrides,message", [
    (["data.packing=aligned"], "data.packing must be stream or cp_aligned, got 'aligned'"),
    (["data.packing=cp_aligned"], "data.packing cp_aligned needs data.document_mask = true"),
])
def test_the_config_refuses_a_bad_packing_in_one_line(tmp_path, overrides: list[str], message: str) -> None:
    from mplan.train.config import ConfigError, load_config

    path = tmp_path / "run.toml"
    path.write_text('[data]\npath = "tokens"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as error:
        load_config(str(path), overrides)
    assert "\n" not in str(error.value)
    assert load_config(str(path), ["data.packing=cp_aligned", "data.document_mask=true"]).data.packing == "cp_aligned"
