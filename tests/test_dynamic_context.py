"""Dynamic CP, priced (issue 34, item 4; `mplan.planner.dynamic_context`): the price of a packed
sequence at fixed CP, the runtime's two-size rule and power-of-two dynamic CP, on a mix of
document lengths read from a list, a histogram or prepared token shards.

Exact cases: documents as long as the packed sequence leave nothing to choose (all three equal);
documents of exactly one rank's tokens deal whole (the runtime's rule is dynamic CP there); a
sequence of two half-length documents at cp=2 is each on one rank, priced by hand from the
compute model. Tiny documents over a cp group crossing nodes: dynamic CP is faster, by the ring's
hops fixed CP exposes. Monotone: the longer the documents, the more attention hides the ring, so
the speed-up cannot grow with the length. Refusals are one line each.
"""
from __future__ import annotations

import numpy as np
import pytest

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.data import prepare
from mplan.data.shards import TokenShards
from mplan.planner.dynamic_context import LayerShape, LengthMix, cut_documents, group_size, price_dynamic_context

LAYER = LayerShape(hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2816, num_layers=2)
S = 16384


def _cluster(cp: int) -> ClusterSpec:
    return ClusterSpec.preset("dgx-h100", nodes=max(1, cp // 8))


def _mix(lengths: list[int], name: str = "test") -> LengthMix:
    return LengthMix(lengths=tuple(lengths), source=name)


@pytest.mark.parametrize("cp", [8, 16])
def test_documents_as_long_as_the_sequence_price_the_same_under_every_scheme(cp: int) -> None:
    price = price_dynamic_context(_mix([S] * 3), LAYER, _cluster(cp), seq_len=S, cp=cp)
    assert price.num_sequences == 3 and price.tokens_at == ((cp, 1.0),)
    assert price.dynamic_s == pytest.approx(price.fixed_s, rel=1e-12)
    assert price.two_size_s == price.fixed_s and price.two_size_whole == 0.0


def test_tiny_documents_over_nodes_run_faster_on_one_rank_each() -> None:
    price = price_dynamic_context(_mix([256] * (4 * S // 256)), LAYER, _cluster(16), seq_len=S, cp=16)
    assert price.tokens_at == ((1, 1.0),)
    assert price.speedup > 2.0  # fixed CP pays 16 ranks' InfiniBand hops behind little attention
    within = price_dynamic_context(_mix([256] * (4 * S // 256)), LAYER, _cluster(8), seq_len=S, cp=8)
    assert 1.0 <= within.speedup < price.speedup  # NVLink hops hide better


def test_documents_of_one_ranks_tokens_deal_whole_and_the_runtime_rule_is_dynamic_cp() -> None:
    price = price_dynamic_context(_mix([S // 16] * 32), LAYER, _cluster(16), seq_len=S, cp=16)
    assert price.two_size_whole == 1.0
    assert price.two_size_s == pytest.approx(price.dynamic_s, rel=1e-12)
    assert price.two_size_s < price.fixed_s


def test_two_half_documents_at_cp2_are_priced_by_hand() -> None:
    m = S // 2
    price = price_dynamic_context(_mix([m, m]), LAYER, _cluster(2), seq_len=S, cp=2)
    compute = ComputeCostModel(_cluster(2))
    linears = sum(compute.matmul_time(m, o, i, "bf16") + compute.matmul_time(m, i, o, "bf16")
                  + compute.matmul_time(o, i, m, "bf16") for i, o in LAYER.linears())
    attention = sum(compute.attention_time(1, LAYER.heads, m, m, LAYER.head_dim, "bf16", True, backward)
                    for backward in (False, True))
    assert price.tokens_at == ((1, 1.0),) and price.two_size_whole == 1.0
    assert price.dynamic_s == pytest.approx(LAYER.num_layers * (linears + attention), rel=1e-12)
    assert price.two_size_s == pytest.approx(price.dynamic_s, rel=1e-12)


def test_the_speedup_cannot_grow_with_the_documents_length() -> None:
    lengths = [S // 64, S // 16, S // 4, S]
    prices = [price_dynamic_context(_mix([n] * (2 * S // n)), LAYER, _cluster(16), seq_len=S, cp=16) for n in lengths]
    speedups = [p.speedup for p in prices]
    assert all(a >= b for a, b in zip(speedups, speedups[1:])), speedups
    fixed = [p.fixed_s for p in prices]
    assert all(a <= b for a, b in zip(fixed, fixed[1:])), fixed  # more attention per sequence
    assert speedups[-1] == pytest.approx(1.0, rel=1e-12)


def test_the_stream_is_cut_into_windows_as_the_loader_cuts_it() -> None:
    assert _mix([5, 8, 3, 2, 6]).windows(8) == [[5, 3], [5, 3], [2, 6]]
    assert _mix([5, 8, 3, 2, 6, 1]).windows(8) == [[5, 3], [5, 3], [2, 6]]  # the short tail dropped
    assert cut_documents([3, 20, 8], 8) == [3, 8, 8, 4, 8]
    assert [group_size(n, 1024, 8) for n in (1, 1024, 1025, 2048, 2049, 8192)] == [1, 1, 2, 2, 4, 8]


def test_a_histogram_is_drawn_in_proportion_within_its_bins() -> None:
    mix = LengthMix.from_histogram([100, 1000, 10000], [3, 1], num_documents=4000, seed=0, source="h")
    lengths = np.array(mix.lengths)
    assert lengths.min() >= 100 and lengths.max() < 10000
    assert (lengths < 1000).mean() == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: price_dynamic_context(_mix([]), LAYER, _cluster(8), seq_len=S, cp=8), "no documents"),
    (lambda: price_dynamic_context(_mix([100, S + 1]), LAYER, _cluster(8), seq_len=S, cp=8),
     f"a document of {S + 1} tokens is outside [1, {S}]"),
    (lambda: price_dynamic_context(_mix([0, S]), LAYER, _cluster(8), seq_len=S, cp=8), "a document of 0 tokens"),
    (lambda: price_dynamic_context(_mix([100]), LAYER, _cluster(8), seq_len=S, cp=8), "fill no packed sequence"),
    (lambda: price_dynamic_context(_mix([S]), LAYER, _cluster(8), seq_len=S, cp=6), "power of two"),
    (lambda: price_dynamic_context(_mix([S]), LAYER, _cluster(8), seq_len=S, cp=8, method="mesh"), "not one of"),
    (lambda: LengthMix.from_histogram([10, 5], [1], num_documents=3, seed=0, source="h"), "increasing edges"),
])
def test_bad_input_is_refused_in_one_line(make, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        make()
    assert message in str(caught.value) and "\n" not in str(caught.value)


TEXTS = ["the first document, short.", "a second one " * 40, "x", "a fourth: " + "lengths between eos " * 15]


def test_lengths_are_read_between_the_eos_ids_of_prepared_shards(tmp_path, monkeypatch) -> None:
    from mplan.data import document_lengths as reader

    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in TEXTS), encoding="utf-8")
    out = str(tmp_path / "tokens")
    prepare(str(tmp_path / "docs.jsonl"), out, vocab_size=300, shard_tokens=40, progress=None)
    shards = TokenShards.open(out)
    tok = shards.tokenizer()
    expected = [len(tok.encode(t)) + 1 for t in TEXTS]  # each document's ids and its EOS
    assert len(shards.shards) > 1
    monkeypatch.setattr(reader, "BLOCK_TOKENS", 7)  # documents cross the scan's blocks
    assert reader.document_lengths(out).tolist() == expected
    assert reader.document_lengths(out, max_documents=2).tolist() == expected[:2]
