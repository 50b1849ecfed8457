"""Dynamic context parallelism (issue 34, item 4), predicted: what a CP size chosen per packed
sequence or per document from its documents' lengths would save over one fixed CP size, on a
published length distribution and on synthetic ones. Every figure is a prediction of mplan's own
cost models (`mplan.planner.dynamic_context`), nothing here is measured.

    python -m benchmarks.planning dynamic-cp [--seq-len 131072] [--cp 8,16,32] [--sequences 16]
        [--profile benchmarks/results/profile_h100-2026-12-06-graphed.json] [--data DIR]
        -o benchmarks/results/dynamic_cp-predicted-2026-12-06.json
    python -m benchmarks.planning dynamic-cp --packing cp_aligned --sequences 64
        -o benchmarks/results/dynamic_cp_aligned-predicted-2026-12-06.json
(those results made before the harness, by `python benchmarks/dynamic_cp.py` with the same flags)

What is predicted, from what: for a Llama-3-8B layer stack (`dynamic_context.LLAMA3_8B`, bf16,
tp = 1) and packed sequences of `seq_len` tokens cut from each mix's document stream as mplan's
loader cuts them, the step seconds per packed sequence under
    fixed      every sequence over all cp ranks, the runtime's balanced layout, ring exchange
    two_size   the runtime's rule today (`runtime.lowering.document_layout`): cp=1 where whole
               documents deal onto the ranks, else fixed
    dynamic    each document on the smallest power-of-two group holding it (Megatron-LM's hybrid
               CP), in rank-seconds: an upper bound (every rank kept busy)
GEMMs and attention are priced by `ComputeCostModel` on the measured H100 profile `--profile`
(its GEMM and attention tables, timed as CUDA graph replays on 2026-12-06), the K, V hops by
`collective_time` on `ClusterSpec.preset("dgx-h100", nodes=cp / 8)` (NVLink within a node of 8,
InfiniBand beyond; the profile's device tables attached to it).

With --packing cp_aligned the same mixes are also packed as `mplan train`'s `data.packing =
"cp_aligned"` packs them (`mplan.data.cp_packing.pack_for_shares`, shares = cp: documents of at
most S / cp tokens dealt whole onto the ranks with balanced work, padding where they do not fill,
longer or unbalanceable documents cut into plain windows), and each row adds, per REAL token
(padding costs compute and trains nothing): the runtime's two-size rule on the cp-aligned windows
against fixed CP on the plain loader's windows, the fraction of windows the rule runs at cp=1, the
padding fraction, and dynamic CP's upper bound for reference.

Printed on 2026-12-06 with --packing cp_aligned --sequences 64 (predictions; 64 packed sequences'
worth of documents per mix, 65 cp-aligned windows): the runtime's rule runs 83% / 74% / 62% of the
cp-aligned windows at cp=1 on Wikipedia's published mix at cp=8 / 16 / 32 (web 85/74/55%, long-mix
35/31/22%; the rest hold documents longer than S / cp or ones the balance set aside), against 0% of
the loader's windows; padding is 1.5% of the tokens (0.8% long-mix), most of it the last, partly
filled window of so short a stream (0.9-1.8% inside Wikipedia's aligned windows). Per real token,
against fixed CP on the loader's windows: Wikipedia 0.99x at cp=8 (in a node the exchange hides and
cp=1 pays the 5% work imbalance the rule allows and the padding), 1.92x at cp=16, 1.96x at cp=32
(web 1.00x / 1.90x / 1.78x, long-mix 1.02x / 1.23x / 1.20x), where dynamic CP's upper bound on the
same documents is 2.79x / 4.74x at cp=16 / 32: two sizes leave every window with a document longer
than S / cp over the whole group.

Length mixes:
    wikipedia   PUBLISHED: English Wikipedia's documents per token-length bin, from the dataset
                card of seonglae/wikipedia_token on Hugging Face (README, commit b7a46d0:
        https://huggingface.co/datasets/seonglae/wikipedia_token/commit/b7a46d0ace1f21f656b158f611420a22bd4b509b),
                6,458,670 documents in bins [?, 1024), [1024, 2048), ..., [65536, 128000),
                WIKIPEDIA_HISTOGRAM below. The card gives counts per bin only (its tokenizer is
                not stated): lengths are drawn log-uniform inside each bin, and the first bin's
                lower edge, not published, is taken as 32 tokens: both assumptions.
    web         SYNTHETIC: log-normal lengths, median 600 tokens, sigma 1.2, cut to [16, seq_len]
    long-mix    SYNTHETIC: half the tokens from `web`, half from documents log-uniform in
                [16k, seq_len] (16k cut to seq_len where that is shorter)
    data        with --data DIR: the lengths between EOS ids of prepared token shards
                (`mplan.data.document_lengths`), documents longer than seq_len cut
The report has one row per (mix, cp).

Printed on 2026-12-06 (predictions; 16 packed sequences of 131072 tokens per mix): within one
node (cp=8, NVLink) the ring's hops mostly hide behind attention and dynamic CP is predicted
1.05x faster on Wikipedia's published mix (1.04x web, 1.02x long-mix); once the group crosses
nodes fixed CP exposes its InfiniBand hops for every sequence of short documents, and dynamic CP,
which runs most of Wikipedia's documents on one rank, is predicted 2.87x (cp=16) and 4.96x
(cp=32) faster (web 2.82x / 4.86x, long-mix 1.64x / 2.17x). Fixed cp=16 is itself predicted
slower per sequence than cp=8 on these mixes (1.55 s against 1.14 s on Wikipedia's): a fixed
size would stay in the node. The runtime's two-size rule deals none of these windows whole (0%
at cp=1: `whole_documents` needs whole documents filling every rank exactly, and the loader's
windows cut documents at their edges), so today it prices as fixed CP on them. Moving the
assumed lower edge of Wikipedia's first bin from 32 to 16 or 128 tokens moves no speed-up by
more than 0.01x.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np
import torch

from benchmarks.report import machine_header
from mplan.cost_models.cluster import ClusterSpec
from mplan.data.cp_packing import pack_for_shares
from mplan.planner.dynamic_context import LLAMA3_8B, LengthMix, cut_documents, price_dynamic_context, price_windows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PROFILE = os.path.join(ROOT, "benchmarks", "results", "profile_h100-2026-12-06-graphed.json")

WIKIPEDIA_SOURCE = ("English Wikipedia, documents per token-length bin, dataset card of seonglae/wikipedia_token "
                    "(Hugging Face, README commit b7a46d0); log-uniform inside bins, first bin's lower edge 32 assumed")
WIKIPEDIA_HISTOGRAM = (
    (32, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 128000),
    (5320881, 693911, 300935, 106221, 30611, 4812, 1253, 46),
)
"""Bin edges (tokens) and documents per bin as the card publishes them ("Token count"), but the
first edge, 32, which the card leaves out ("~1024")."""


def web_lengths(rng: np.random.RandomState, tokens: int, seq_len: int) -> list[int]:
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(min(max(rng.lognormal(math.log(600), 1.2), 16), seq_len)))
    return out


def long_mix_lengths(rng: np.random.RandomState, tokens: int, seq_len: int) -> list[int]:
    out = web_lengths(rng, tokens // 2, seq_len)
    long: list[int] = []
    while sum(long) < tokens // 2:
        long.append(int(math.exp(rng.uniform(math.log(min(16384, seq_len)), math.log(seq_len)))))
    mixed = out + long
    rng.shuffle(mixed)  # the loader's stream interleaves them
    return mixed


def wikipedia_lengths(tokens: int, seq_len: int) -> list[int]:
    """Documents drawn from the published histogram until they fill `tokens`."""
    edges, counts = WIKIPEDIA_HISTOGRAM
    mean = sum(c * math.sqrt(a * b) for a, b, c in zip(edges, edges[1:], counts)) / sum(counts)
    drawn = LengthMix.from_histogram(edges, counts, num_documents=int(2 * tokens / mean) + 64, seed=0,
                                     source=WIKIPEDIA_SOURCE).lengths
    out, total = [], 0
    for n in cut_documents(drawn, seq_len):
        if total >= tokens:
            break
        out.append(n)
        total += n
    return out


def mixes(args: argparse.Namespace) -> list[LengthMix]:
    tokens = args.sequences * args.seq_len
    found = [LengthMix(lengths=tuple(wikipedia_lengths(tokens, args.seq_len)), source="published: " + WIKIPEDIA_SOURCE),
             LengthMix(lengths=tuple(web_lengths(np.random.RandomState(0), tokens, args.seq_len)),
                       source="synthetic: log-normal, median 600, sigma 1.2, cut to [16, seq_len]"),
             LengthMix(lengths=tuple(long_mix_lengths(np.random.RandomState(0), tokens, args.seq_len)),
                       source="synthetic: half web, half log-uniform in [16k, seq_len]")]
    if args.data:
        from mplan.data.document_lengths import document_lengths

        lengths = cut_documents(document_lengths(args.data).tolist(), args.seq_len)
        found.append(LengthMix(lengths=tuple(lengths), source=f"data: lengths between EOS ids of {args.data}"))
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=131072, help="tokens per packed sequence")
    parser.add_argument("--cp", default="8,16,32", help="fixed CP sizes, comma-separated (8 per DGX node)")
    parser.add_argument("--sequences", type=int, default=16, help="packed sequences' worth of documents per mix")
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="cluster file whose measured device tables price compute")
    parser.add_argument("--data", default=None, help="prepared token shards to read a length mix from")
    parser.add_argument("--packing", choices=("loader", "cp_aligned"), default="loader",
                        help="cp_aligned: also price the cp-aligned packing (module docstring)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    profile = ClusterSpec.from_json(args.profile).profile
    names = ["wikipedia", "web", "long-mix", "data"]
    rows = []
    for name, mix in zip(names, mixes(args)):
        for cp in (int(c) for c in args.cp.split(",")):
            cluster = ClusterSpec.preset("dgx-h100", nodes=max(1, cp // 8)).with_profile(profile)
            price = price_dynamic_context(mix, LLAMA3_8B, cluster, seq_len=args.seq_len, cp=cp)
            shares = ", ".join(f"cp{c} {share:.0%}" for c, share in price.tokens_at)
            print(f"{name:9s} cp={cp:<2d} {price.num_sequences} x {args.seq_len} tokens, "
                  f"{price.num_documents} documents: "
                  f"predicted per packed sequence fixed {price.fixed_s * 1e3:.0f} ms, runtime two-size "
                  f"{price.two_size_s * 1e3:.0f} ms ({price.two_size_whole:.0%} at cp=1), dynamic "
                  f"{price.dynamic_s * 1e3:.0f} ms: predicted speed-up {price.speedup:.2f}x (tokens at {shares})")
            rows.append({"mix": name, "source": mix.source, "cp": cp, "seq_len": args.seq_len,
                         "num_sequences": price.num_sequences, "num_documents": price.num_documents,
                         "median_document": int(np.median(mix.lengths)),
                         "mean_document": round(float(np.mean(mix.lengths)), 1),
                         "fixed_s": round(price.fixed_s, 5), "two_size_s": round(price.two_size_s, 5),
                         "dynamic_s": round(price.dynamic_s, 5), "speedup": round(price.speedup, 3),
                         "two_size_speedup": round(price.two_size_speedup, 3),
                         "two_size_whole": round(price.two_size_whole, 3),
                         "tokens_at": {str(c): round(s, 4) for c, s in price.tokens_at}})
            if args.packing == "cp_aligned":
                rows[-1].update(aligned_row(mix, cluster, args.seq_len, cp, price.fixed_s))
                r = rows[-1]
                print(f"{'':9s}   cp-aligned packing: {r['aligned_windows']} windows, {r['aligned_whole']:.0%} "
                      f"at cp=1, padding {r['aligned_padding']:.1%}: predicted per real token two-size "
                      f"{r['aligned_speedup']:.2f}x fixed CP on the loader's windows "
                      f"(dynamic bound {price.speedup:.2f}x)")
    header = {**machine_header(), "profile": os.path.relpath(args.profile, ROOT),
              "cluster": "dgx-h100 preset (NVLink in a node of 8, InfiniBand beyond) with the profile's device "
                         "tables", "method": "ring"}
    if args.packing != "cp_aligned":
        return {"what": "PREDICTED step seconds per packed sequence (all 32 layers, forward + backward, busiest "
                        "rank) of a Llama-3-8B layer stack at fixed, the runtime's two-size and power-of-two "
                        "dynamic context parallelism (mplan.planner.dynamic_context); nothing measured",
                **header, "rows": rows}
    return {"what": "PREDICTED seconds per REAL token (all 32 layers, forward + backward, busiest rank) of a "
                    "Llama-3-8B layer stack: the runtime's two-size rule on cp-aligned packed windows "
                    "(mplan.data.cp_packing, padding priced as tokens that train nothing) against fixed CP on "
                    "the plain loader's windows, with power-of-two dynamic CP's upper bound; nothing measured",
            **header, "packing": "cp_aligned: pack_for_shares(tolerance=0.05, lookahead=4, patience=16)",
            "fields": {"aligned_whole": "fraction of cp-aligned windows the runtime's rule runs at cp=1",
                       "aligned_padding": "fraction of the cp-aligned windows' tokens that are padding",
                       "aligned_speedup": "loader_fixed_us_per_token / aligned_two_size_us_per_token",
                       "speedup": "dynamic CP's upper bound over fixed CP (loader's windows)"},
            "rows": rows}


def aligned_row(mix: LengthMix, cluster: ClusterSpec, seq_len: int, cp: int, loader_fixed_s: float) -> dict:
    """The cp-aligned packing of `mix` priced per real token against fixed CP on the loader's
    windows (`loader_fixed_s` seconds per window of `seq_len` real tokens)."""
    packing = pack_for_shares(mix.lengths, seq_len, cp)
    price = price_windows([w.lengths(seq_len) for w in packing.windows], LLAMA3_8B, cluster, seq_len=seq_len, cp=cp)
    real = sum(n for w in packing.windows for _, _, n in w.segments)
    two_size, fixed = sum(price.two_size_s) / real, sum(price.fixed_s) / real
    baseline = loader_fixed_s / seq_len
    return {"aligned_windows": len(packing.windows), "aligned_packed": round(packing.aligned, 3),
            "aligned_whole": round(sum(price.whole) / len(price.whole), 3),
            "aligned_padding": round(packing.padding, 4),
            "loader_fixed_us_per_token": round(baseline * 1e6, 4),
            "aligned_fixed_us_per_token": round(fixed * 1e6, 4),
            "aligned_two_size_us_per_token": round(two_size * 1e6, 4),
            "aligned_speedup": round(baseline / two_size, 3)}
