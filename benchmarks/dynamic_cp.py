"""Dynamic context parallelism (issue 34, item 4), predicted: what a CP size chosen per unit of
work from its documents' lengths would save over one fixed CP size, on stated length mixes.
Every figure is a prediction, nothing is measured. The runtime builds the two-size case
(`runtime.lowering.document_layout`: a micro-batch whose documents deal whole onto the cp
ranks with equal work runs each at cp=1, with no exchange; else over the whole group, exact
either way: tests/test_context_documents.py); this prices every power-of-two size.

    python benchmarks/dynamic_cp.py [--seq-len 131072] [--cp 8] [--sequences 64]

The job: a Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336) in
bf16, one cp group of `cp` H100s of DGX nodes (`ClusterSpec.preset("dgx-h100")`: NVLink within a
node of 8, InfiniBand beyond), packed
sequences of `seq_len` tokens, so each rank holds M = seq_len / cp tokens (its memory budget).

    fixed CP    every packed sequence over all cp ranks (ring attention, the document-aware layout
                of `context_layout.balance_attention`, so compute is balanced)
    dynamic CP  each document gets the smallest power-of-two c with length <= c * M; documents of
                one c are packed into units of c * M tokens run on c ranks (c = 1: one rank, no
                exchange), as Megatron-LM's hybrid CP does per sub-sequence

Per layer and unit of T tokens on c ranks (per rank): linear work 6 * P * T / c flops (P: the
layer's weights), attention 3.5 * 4 * heads * head_dim flops per visible (query, key) pair
(FlashAttention's backward is 2.5 forwards), K/V exchange (3c - 2) ring hops of K and V of T / c
tokens (c - 1 forward, c - 1 of K/V and c of dK/dV backward), each priced by mplan's
`collective_time("send_recv")` on the NVLink profile. The ring hides its hops behind attention
only: exposed = max(0, hops - attention time). Rates: 989 TFLOP/s bf16 dense at 55% for linear
work and 45% for attention (assumed, not measured). Both schedules are compared in rank-seconds
(work / cp), i.e. assuming the scheduler keeps every rank busy: an upper bound on dynamic CP's
gain (Megatron reports up to 1.48x on its real variable-length data).

Printed on 2026-12-06 (predictions, 8 packed sequences' worth of documents of 131072 tokens):
within one node (cp=8, NVLink) the exchange hides behind compute and dynamic CP gains 1.04x
(web) and 1.01x (long-mix); once the group crosses nodes (cp=16, 32 over InfiniBand) fixed CP
exposes its hops for every packed sequence of short documents, and dynamic CP, which runs them
on one or two ranks, is predicted 2.46x / 1.52x (cp=16) and 4.15x / 2.12x (cp=32) faster.

Length mixes (synthetic, stated as such; no corpus was measured here):
    web         log-normal lengths, median 600 tokens, sigma 1.2, cut to [16, seq_len]
    long-mix    half the tokens from `web`, half from documents log-uniform in [16k, seq_len]
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.attention_mask import CAUSAL, doc_ids_from_lengths, keys_per_query
from mplan.ir.mesh import GroupShape

LAYER = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)
PEAK_FLOPS = 989e12  # H100 SXM bf16 dense, datasheet
LINEAR_EFFICIENCY, ATTENTION_EFFICIENCY = 0.55, 0.45  # assumed


def layer_weights() -> int:
    h, kv = LAYER["hidden"], LAYER["kv_heads"] * LAYER["head_dim"]
    return 2 * h * h + 2 * h * kv + 3 * h * LAYER["ffn"]


def web_lengths(rng: np.random.RandomState, tokens: int, seq_len: int) -> list[int]:
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(min(max(rng.lognormal(math.log(600), 1.2), 16), seq_len)))
    return out


def long_mix_lengths(rng: np.random.RandomState, tokens: int, seq_len: int) -> list[int]:
    out = web_lengths(rng, tokens // 2, seq_len)
    long: list[int] = []
    while sum(long) < tokens // 2:
        long.append(int(math.exp(rng.uniform(math.log(16384), math.log(seq_len)))))
    return out + long


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing into units of `capacity` tokens (a document longer is cut)."""
    units: list[list[int]] = []
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        n = min(n, capacity)
        for i, free in enumerate(room):
            if n <= free:
                units[i].append(n)
                room[i] -= n
                break
        else:
            units.append([n])
            room.append(capacity - n)
    return units


def unit_seconds(lengths: list[int], c: int, cluster: ClusterSpec) -> float:
    """Rank-seconds of one unit (documents `lengths`) on c ranks: c x its per-rank time."""
    tokens = sum(lengths)
    pairs = int(keys_per_query(CAUSAL, tokens, doc_ids_from_lengths(lengths)).sum())
    linear = 6 * layer_weights() * tokens / c / (PEAK_FLOPS * LINEAR_EFFICIENCY)
    attention = 3.5 * 4 * LAYER["heads"] * LAYER["head_dim"] * pairs / c / (PEAK_FLOPS * ATTENTION_EFFICIENCY)
    exposed = 0.0
    if c > 1:
        block = 2 * (tokens // c) * LAYER["kv_heads"] * LAYER["head_dim"] * 2  # K and V, bf16
        shape = GroupShape(size=c, ranks_per_node=min(c, cluster.gpus_per_node))  # beyond a node: InfiniBand
        hop = collective_time(cluster, "send_recv", block, shape)
        exposed = max(0.0, (3 * c - 2) * hop - attention)
    return c * (linear + attention + exposed)


def compare(lengths: list[int], seq_len: int, cp: int, cluster: ClusterSpec) -> dict[str, float]:
    per_rank = seq_len // cp
    fixed = sum(unit_seconds(unit, cp, cluster) for unit in pack(lengths, seq_len))
    dynamic, shares = 0.0, {}
    for c in (2 ** i for i in range(int(math.log2(cp)) + 1)):
        mine = [n for n in lengths if (c == 1 or n > c // 2 * per_rank) and (n <= c * per_rank or c == cp)]
        shares[c] = sum(mine) / sum(lengths)
        dynamic += sum(unit_seconds(unit, c, cluster) for unit in pack(mine, c * per_rank))
    return {"fixed_s": fixed / cp, "dynamic_s": dynamic / cp, "speedup": fixed / dynamic,
            **{f"tokens_at_cp{c}": share for c, share in shares.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=131072, help="tokens per packed sequence")
    parser.add_argument("--cp", type=int, default=8, help="the fixed CP size (ranks of the group)")
    parser.add_argument("--sequences", type=int, default=16, help="packed sequences' worth of documents")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = ClusterSpec.preset("dgx-h100", nodes=max(1, args.cp // 8))
    for name, draw in (("web", web_lengths), ("long-mix", long_mix_lengths)):
        lengths = draw(np.random.RandomState(0), args.sequences * args.seq_len, args.seq_len)
        result = compare(lengths, args.seq_len, args.cp, cluster)
        shares = ", ".join(f"cp{k[len('tokens_at_cp'):]} {v:.0%}" for k, v in result.items() if k.startswith("tokens_at"))
        print(f"{name:9s} seq {args.seq_len} x {args.sequences}, {len(lengths)} documents: per layer, fixed cp={args.cp} "
              f"{result['fixed_s'] * 1e3:.0f} ms, dynamic {result['dynamic_s'] * 1e3:.0f} ms: predicted speed-up "
              f"{result['speedup']:.2f}x (tokens at {shares})")


if __name__ == "__main__":
    main()
