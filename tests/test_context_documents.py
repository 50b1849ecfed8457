"""Packed documents (issue 34, items 3 and 4): with document ids, no token attends across
documents, at cp=1 and cp=2, and training is the same as running each document on its own; under
cp each micro-batch is split so the ranks' attention work (quadratic in each document's length) is
equal, or, where its documents deal whole onto the ranks with equal work, runs each document at
cp=1 with no exchange (dynamic CP between 1 and the plan's cp, chosen per micro-batch).

Equivalence: `autoparallel(..., document_mask=True)` and `train_step(ids, labels, doc_ids=)`,
3 AdamW steps with active clipping in float64 on 2 gloo ranks (cp=1, cp=2, and two pipeline
stages, with and without recomputation), against one process that runs
every document as its own sequence and averages the token losses over all of them: losses and
every parameter within 1e-9. mplan's Llama family (RoPE): attention depends on position
differences only, so a document at positions a..b of a packed row computes what it computes at
0..b-a alone, up to rounding. Positions are not restarted per document, so a model with learned
absolute positions (nanoGPT's wpe) would train its documents at shifted positions: refused, one
line on every rank, at cp=2 and at cp=1.

Packing for the rule (`data.packing = "cp_aligned"`, `mplan.data.cp_packing`): the loader's
cp-aligned windows, padding included (EOS ids labelled -100, one document per token), trained under
cp=2 one row per micro-batch: every window packed aligned runs at cp=1, the rest at cp=2, exact
against each document alone (the reference weighs micro-batches alike, as the runtime's loss
scaling does: padded windows hold fewer labelled tokens). `mplan train` runs with the key under cp=2.

Balance: a synthetic packed mix (document lengths log-normal, median 600 tokens, sigma 1.2, cut to
[16, S]: a heavy tail like web-text corpora's, stated as synthetic) at 32k tokens over cp=4 and
128k over cp=8; the attention pairs per rank counted under head-tail chunks and under the
document-aware split the runtime takes (`runtime.lowering.document_layout`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from distributed import run_checks
from test_equivalence import MAX_NORM, OPTIMIZER, TOL, errors, family

LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"
SEQ, VOCAB, STEPS = 16, 64, 3
LENGTHS = [[5, 8, 3], [10, 6], [16], [2, 2, 12]]  # documents of each packed row
# dynamic CP: the first micro-batch's documents deal whole onto the two ranks (each at cp=1, no
# exchange), the second's cannot (a document of 10 tokens is longer than a rank's 8): cp=2
DYNAMIC = [[4, 4, 4, 4], [4, 4, 4, 4], [10, 6], [10, 6]]


def _data(lengths: list[list[int]] = LENGTHS) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    from mplan.ir.attention_mask import doc_ids_from_lengths

    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=generator)
        labels[0, 4] = labels[3, 0] = -100  # the ranks count different tokens
        data.append((ids, labels))
    return data, doc_ids_from_lengths(lengths)


def _separately(make: Any, data: list, steps_lengths: list[list[list[int]]], *,
                rows_per_micro: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, each document its own sequence: the token-mean loss over all documents
    (`steps_lengths`: each step's documents per row), or, with `rows_per_micro`, the mean over
    micro-batches of each one's token mean (the runtime scales each micro-batch's loss by
    1 / micro-batches: micro-batches with other counts of labelled tokens weigh alike)."""
    model = make()
    optimizer = OPTIMIZER(model.parameters())
    losses = []
    for (ids, labels), lengths in zip(data, steps_lengths):
        optimizer.zero_grad()
        group = rows_per_micro or len(lengths)
        parts = []
        for first in range(0, len(lengths), group):
            total, count = 0.0, 0
            for row in range(first, first + group):
                start = 0
                for n in lengths[row]:
                    kept = int((labels[row, start:start + n] != -100).sum())
                    if kept:
                        loss = model(ids[row:row + 1, start:start + n], labels=labels[row:row + 1, start:start + n])
                        total = total + loss * kept
                        count += kept
                    start += n
            parts.append(total / count)
        loss = sum(parts) / len(parts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def _packed(plan: str, *, micro_batch_size: int | None = None, lengths: list[list[int]] = LENGTHS) -> dict[str, Any]:
    import mplan

    make = family(LLAMA)
    data, doc_ids = _data(lengths)
    pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=len(lengths),
                            plan=plan, max_grad_norm=MAX_NORM, document_mask=True,
                            micro_batch_size=micro_batch_size)
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels, doc_ids=doc_ids))
        norms.append(pm.last_grad_norm)
    return {**errors(pm, losses, norms, _separately(make, data, [lengths] * len(data))), "cp": pm.plan.mesh.cp,
            "sizes": pm.last_context_sizes}


def documents_cp1() -> dict[str, Any]:
    return _packed("dp=2")


def documents_cp2() -> dict[str, Any]:
    return _packed("cp=2", micro_batch_size=2)  # two micro-batches, each under its own layout


def documents_cp2_ring() -> dict[str, Any]:
    return _packed("cp=2,cp_method=ring")


def documents_dynamic_cp() -> dict[str, Any]:
    return _packed("cp=2,cp_method=ring", micro_batch_size=2, lengths=DYNAMIC)


def documents_pp2() -> dict[str, Any]:
    """Two pipeline stages, two micro-batches in flight under 1F1B: each stage's attention reads
    the documents of the micro-batch its action computes."""
    return _packed("pp=2", micro_batch_size=2)


def documents_pp2_recompute() -> dict[str, Any]:
    """The same with every block recomputed: the first stage runs F0 F1 B0 B1, so B0's forward
    re-run reads micro-batch 0's documents, not those of F1 before it."""
    return _packed("pp=2,recompute=full", micro_batch_size=2)


def _tiny_documents(directory: str) -> str:
    """Token shards of 150 documents of 1-6 words: most fit whole in a cp rank's 8 tokens."""
    import json
    import os
    import random

    from mplan.data.shards import prepare

    words = "the of and to in is was for on that with as by at from his her an be are".split()
    chooser = random.Random(1)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "docs.jsonl"), "w", encoding="utf-8") as handle:
        for _ in range(150):
            handle.write(json.dumps({"text": " ".join(chooser.choices(words, k=chooser.randint(1, 6)))}) + "\n")
    return prepare(os.path.join(directory, "docs.jsonl"), os.path.join(directory, "tokens"), vocab_size=300,
                   progress=None)["directory"]


def documents_cp_aligned() -> dict[str, Any]:
    """The loader's cp-aligned windows (`data.packing = "cp_aligned"`, shares = cp = 2): padding
    (EOS, label -100, one document per token) and whole documents per rank. Under cp=2, one row per
    micro-batch, every aligned window runs at cp=1 and the others over both ranks; the same as each
    document trained alone in one process."""
    import os
    import shutil
    import tempfile

    import torch.distributed as dist

    import mplan
    from mplan.data import PackedLoader, TokenShards
    from mplan.data.loader import packed_document_ids

    directory = os.path.join(tempfile.gettempdir(), f"mplan-cp-aligned-{os.getppid()}")
    if dist.get_rank() == 0:
        _tiny_documents(directory)
    dist.barrier()
    tokens = os.path.join(directory, "tokens")
    shards = TokenShards.open(tokens)
    loader = PackedLoader(shards, seq_len=SEQ, global_batch=4, seed=0, packing="cp_aligned", shares=2)
    data = [loader.global_batch(step) for step in range(STEPS)]
    aligned = [loader.pack.windows[loader.sequence_index(s)].aligned for s in range(4 * STEPS)]
    steps_lengths = []
    for ids, _ in data:
        docs = packed_document_ids(ids, shards.eos_id)
        steps_lengths.append([torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in docs])
    make = family(LLAMA.replace("vocab=64", f"vocab={shards.vocab_size}"))
    pm = mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4,
                            plan="cp=2,cp_method=ring", max_grad_norm=MAX_NORM, document_mask=True, micro_batch_size=1)
    losses, norms, sizes = [], [], []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels, doc_ids=packed_document_ids(ids, shards.eos_id)))
        norms.append(pm.last_grad_norm)
        sizes += pm.last_context_sizes
    padding = sum(int((labels == -100).sum()) for _, labels in data) / (4 * STEPS * SEQ)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    reference = _separately(make, data, steps_lengths, rows_per_micro=1)
    return {**errors(pm, losses, norms, reference), "cp": pm.plan.mesh.cp,
            "sizes": sizes, "aligned": aligned, "padding": padding}


def refuses_doc_ids_without_document_mask() -> str:
    import mplan

    data, doc_ids = _data()
    # at cp > 1 attention is always lowered and takes documents; at cp=1 only when asked for
    pm = mplan.autoparallel(family(LLAMA)(), example_inputs=(data[0][0],), global_batch=len(LENGTHS), plan="dp=2")
    try:
        pm.train_step(*data[0], doc_ids=doc_ids)
    except ValueError as error:
        return str(error)
    return "not refused"


def _short_documents(directory: str) -> str:
    """Token shards of 60 short text documents (8-60 words), so windows of 32 tokens hold several."""
    import os
    import random

    from mplan.data.shards import prepare

    words = "the of and to in is was for on that with as by at from his her an be are this had not".split()
    chooser = random.Random(0)
    os.makedirs(os.path.join(directory, "text"), exist_ok=True)
    for i in range(60):
        with open(os.path.join(directory, "text", f"doc{i:02d}.txt"), "w", encoding="utf-8") as handle:
            handle.write(" ".join(chooser.choice(words) for _ in range(chooser.randint(8, 60))))
    out = os.path.join(directory, "tokens")
    prepare(os.path.join(directory, "text", "*.txt"), out, vocab_size=300)
    return out


def train_with_documents() -> dict[str, Any]:
    """`mplan train` with data.document_mask: cp=2 against dp=2 (both masked: the same losses) and
    dp=2 unmasked (other losses: the windows do hold several documents)."""
    import json
    import os
    import shutil
    import tempfile

    import torch.distributed as dist

    from mplan.data import TokenShards
    from mplan.data.loader import PackedLoader, packed_document_ids
    from test_train import _config, run

    directory = os.path.join(tempfile.gettempdir(), f"mplan-cp-documents-{os.getppid()}")  # the ranks' parent
    if dist.get_rank() == 0:
        tokens = _short_documents(directory)
    dist.barrier()
    tokens = os.path.join(directory, "tokens")
    common = ["train.seq_len=32", "train.steps=3", "schedule.warmup_steps=0", "checkpoint.dir="]
    losses = {}
    for name, overrides in (("cp2", ["plan.spec=cp=2", "data.document_mask=true"]),
                            ("cp2_aligned", ["plan.spec=cp=2", "data.document_mask=true", "data.packing=cp_aligned"]),
                            ("dp2", ["plan.spec=dp=2", "data.document_mask=true"]),
                            ("unmasked", ["plan.spec=dp=2"])):
        run(_config(directory, tokens, name), common + overrides)
        with open(os.path.join(directory, f"{name}.jsonl"), encoding="utf-8") as handle:
            losses[name] = [row["loss"] for row in map(json.loads, handle) if "loss" in row]
    loader = PackedLoader(TokenShards.open(tokens), seq_len=32, global_batch=4, seed=3)
    docs = packed_document_ids(loader.global_batch(0)[0], TokenShards.open(tokens).eos_id)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return {**losses, "documents_per_row": [int(d[-1]) + 1 for d in docs]}


def refuses_learned_positions_with_documents() -> list[str]:
    import mplan
    from mplan.ir.attention_mask import doc_ids_from_lengths
    from zoo_models import ZOO

    entry, messages = ZOO["nanogpt"], []
    ids = torch.randint(0, entry.vocab, (2, entry.seq), generator=torch.Generator().manual_seed(0))
    doc_ids = doc_ids_from_lengths([[5, entry.seq - 5], [entry.seq]])
    for plan in ("cp=2", "dp=2"):
        pm = mplan.autoparallel(entry.make(), example_inputs=(ids,), global_batch=2, plan=plan, loss_fn=entry.loss_fn,
                                document_mask=True)
        try:
            pm.train_step(ids, ids, doc_ids=doc_ids)
            messages.append("not refused")
        except ValueError as error:
            messages.append(str(error))
    return messages


CHECKS = [documents_cp1, documents_cp2, documents_cp2_ring, documents_dynamic_cp, documents_cp_aligned, documents_pp2,
          documents_pp2_recompute,
          refuses_doc_ids_without_document_mask, train_with_documents, refuses_learned_positions_with_documents]


@pytest.fixture(scope="module")
def world2() -> Any:
    return run_checks(2, CHECKS, timeout_s=600)


@pytest.mark.parametrize("check,cp,sizes", [(documents_cp1, 1, [1]), (documents_cp2, 2, [2, 2]),
                                            (documents_cp2_ring, 2, [2]), (documents_dynamic_cp, 2, [1, 2]),
                                            (documents_pp2, 1, [1, 1]), (documents_pp2_recompute, 1, [1, 1])])
def test_packed_documents_train_as_separate_documents(world2: Any, check: Any, cp: int, sizes: list[int]) -> None:
    """`sizes`: the cp each micro-batch ran at; dynamic CP's step runs one micro-batch with every
    document on one rank (no exchange) and one over both ranks, and is exact all the same."""
    for rank, result in enumerate(world2.assert_passed(check)):
        assert result["cp"] == cp and result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"] and result["sizes"] == sizes, result


def test_cp_aligned_windows_run_at_cp1_and_train_exactly(world2: Any) -> None:
    """Packing for the ranks makes the two-size rule fire (the loader's plain windows never do):
    each aligned window ran at cp=1, the rest at cp=2, and training is exact with its padding."""
    for rank, result in enumerate(world2.assert_passed(documents_cp_aligned)):
        assert result["loss"] < TOL and result["param"] < TOL and result["clipped"], f"rank {rank}: {result}"
        assert result["sizes"] == [1 if whole else 2 for whole in result["aligned"]], result
        assert result["sizes"].count(1) >= len(result["sizes"]) // 2, result
        assert 0 < result["padding"] < 0.5, result


def test_mplan_train_masks_documents_under_cp2(world2: Any) -> None:
    result = world2.assert_passed(train_with_documents)[0]
    assert max(result["documents_per_row"]) >= 2, result
    assert len(result["cp2"]) == 3 and len(result["dp2"]) == 3 and len(result["cp2_aligned"]) == 3, result
    assert all(loss == loss for loss in result["cp2_aligned"]), result  # the cp-aligned windows train
    for cp2, dp2, unmasked in zip(result["cp2"], result["dp2"], result["unmasked"]):
        assert abs(cp2 - dp2) <= TOL * abs(dp2), result
    assert max(abs(a - b) for a, b in zip(result["dp2"], result["unmasked"])) > 1e-6, result


def test_doc_ids_need_a_document_module(world2: Any) -> None:
    for message in world2.assert_passed(refuses_doc_ids_without_document_mask):
        assert "document_mask=True" in message and "\n" not in message, message


def test_learned_absolute_positions_refuse_documents(world2: Any) -> None:
    """nanoGPT's wpe reads positions that run on across documents: one line, never shifted."""
    for messages in world2.assert_passed(refuses_learned_positions_with_documents):
        for message in messages:
            assert "learned absolute positions (transformer.wpe.weight)" in message and "\n" not in message, message


# -- balance (one process) ---------------------------------------------------------------------------
def packed_mix(seq_len: int, seed: int) -> list[int]:
    """Document lengths filling one row of `seq_len` tokens (module docstring's distribution)."""
    rng = np.random.RandomState(seed)
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        n = int(min(max(rng.lognormal(np.log(600), 1.2), 16), seq_len))
        lengths.append(min(n, seq_len - sum(lengths)))
    return lengths


@pytest.mark.parametrize("seq_len,cp", [(32768, 4), (131072, 8)])
def test_document_split_balances_attention_work(seq_len: int, cp: int) -> None:
    """Head-tail balances one causal document exactly and packed documents badly (the longest
    documents fall where they fall); the document-aware split is within 5% of equal."""
    from mplan.ir.attention_mask import doc_ids_from_lengths
    from mplan.ir.context_layout import head_tail, imbalance, num_visible_pairs
    from mplan.runtime.lowering import document_layout

    worst_head_tail, worst_chosen = 0.0, 0.0
    for seed in range(3):
        doc_ids = doc_ids_from_lengths(packed_mix(seq_len, seed))
        worst_head_tail = max(worst_head_tail, imbalance(num_visible_pairs(head_tail(seq_len, cp), doc_ids=doc_ids)))
        plan = _plan_stub(seq_len, cp)
        chosen, local = document_layout(plan, doc_ids.unsqueeze(0))
        assert not local  # documents up to the whole sequence: no deal of whole documents is balanced
        worst_chosen = max(worst_chosen, imbalance(num_visible_pairs(chosen, doc_ids=doc_ids)))
    assert worst_head_tail > 0.4, worst_head_tail
    assert worst_chosen <= 0.05, worst_chosen


def _plan_stub(seq_len: int, cp: int) -> Any:
    """What `document_layout` reads of a plan: its sequence length and cp."""
    from types import SimpleNamespace

    return SimpleNamespace(model=SimpleNamespace(seq_len=seq_len), mesh=SimpleNamespace(cp=cp))
