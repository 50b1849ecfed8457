"""Which `data.packing` pays for a plan on the user's own data: `mplan plan --documents DIR`.

Input: prepared token shards (`mplan data prepare`), the plan made (its mesh's cp and cp_method,
its sequence length), the model's layer shapes (`planner.model_shape.layer_shape`) and the
cluster it was planned for. Output: a few lines for people, every figure a prediction of mplan's
cost models (`planner.dynamic_context`), printed after the plan's explanation.

Why: the runtime runs a window at cp=1 (no K/V exchange) only where its documents deal whole onto
the cp ranks, and the loader's plain windows almost never do; the cp-aligned packing makes most
windows deal, at some padding. Whether that buys time depends on the data's mix of lengths and
the cp, so it is priced on the data itself, for the plan's own cp:

    loader      the plain loader's windows (the stream cut every seq_len tokens), fixed CP
    cp-aligned  the loader's `packing="cp_aligned"` windows for shares = cp (`cp_packing.kept_packing`:
                the pack kept beside the shards, which `mplan train` reuses, made from the lengths
                already read where there is none), under the runtime's two-size rule
    dynamic     power-of-two dynamic CP on the loader's windows' documents: an upper bound

compared per REAL token (padding computes but trains nothing). At most `MAX_WINDOWS` windows of
each packing, evenly spaced through the epoch, are priced; the layer is priced whole on a rank
(tp = 1), as `dynamic_context` prices it. The advice is cp-aligned packing where it is predicted
more than `PAYS` faster, else that it does not pay at this cp.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mplan.cost_models.cluster import ClusterSpec
from mplan.data.cp_packing import kept_packing
from mplan.data.document_lengths import document_lengths
from mplan.data.shards import TokenShards
from mplan.models.spec import ModelSource
from mplan.planner.dynamic_context import (LayerShape, LengthMix, cut_documents, price_dynamic_context,
                                           price_windows)
from mplan.planner.model_shape import ShapeUnknown, layer_shape
from mplan.planner.plan import Plan

MAX_WINDOWS = 32
"""Windows of each packing priced (evenly spaced): each prices the balanced layout of seq_len tokens."""
PAYS = 1.02
"""cp-aligned packing is advised where it is predicted faster per real token by more than this."""


def check_documents(directory: str) -> TokenShards:
    """The shard directory opened, or `DataError` in one line: cheap, so the CLI asks before planning."""
    return TokenShards.open(directory)


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentsPrice:
    """The data's mix and its predicted cost under the plan's cp (module docstring)."""

    num_documents: int
    median: float
    mean: float
    cp: int
    method: str
    seq_len: int
    priced: int  # windows of each packing priced
    loader_whole: float  # the loader's windows the two-size rule runs at cp=1
    aligned_whole: float  # cp-aligned windows it runs at cp=1
    padding: float  # of the cp-aligned pack's tokens
    loader_fixed_s: float  # per real token: fixed CP on the loader's windows
    aligned_two_size_s: float  # per real token: the two-size rule on cp-aligned windows
    dynamic_s: float | None  # per real token: dynamic CP's upper bound (None: cp not a power of two)

    @property
    def speedup(self) -> float:
        return self.loader_fixed_s / self.aligned_two_size_s


def price_documents(directory: str, lengths: np.ndarray, plan: Plan, layer: LayerShape,
                    cluster: ClusterSpec) -> DocumentsPrice:
    """The module docstring's comparison for a plan with cp > 1; `lengths`: the shards' documents."""
    cp, seq_len, method = plan.mesh.cp, plan.model.seq_len, plan.mesh.cp_method
    loader_windows = _spaced(LengthMix(lengths=tuple(cut_documents(lengths.tolist(), seq_len)),
                                       source=directory).windows(seq_len))
    pack = kept_packing(directory, TokenShards.open(directory).fingerprint, lambda: lengths.tolist(), seq_len, cp)
    aligned = _spaced(pack.windows)
    if cp & (cp - 1) == 0:
        mix = LengthMix(lengths=tuple(n for w in loader_windows for n in w), source=directory)
        price = price_dynamic_context(mix, layer, cluster, seq_len=seq_len, cp=cp, method=method)
        loader_fixed, loader_whole, dynamic = price.fixed_s, price.two_size_whole, price.dynamic_s / seq_len
    else:
        plain = price_windows(loader_windows, layer, cluster, seq_len=seq_len, cp=cp, method=method)
        loader_fixed, loader_whole, dynamic = float(np.mean(plain.fixed_s)), float(np.mean(plain.whole)), None
    packed = price_windows([w.lengths(seq_len) for w in aligned], layer, cluster, seq_len=seq_len, cp=cp,
                           method=method)
    real = sum(n for w in aligned for _, _, n in w.segments)
    return DocumentsPrice(num_documents=len(lengths), median=float(np.median(lengths)), mean=float(np.mean(lengths)),
                          cp=cp, method=method, seq_len=seq_len, priced=max(len(loader_windows), len(aligned)),
                          loader_whole=loader_whole, aligned_whole=float(np.mean(packed.whole)),
                          padding=pack.padding, loader_fixed_s=loader_fixed / seq_len,
                          aligned_two_size_s=sum(packed.two_size_s) / real, dynamic_s=dynamic)


def _spaced(windows: Sequence) -> list:
    """At most MAX_WINDOWS of `windows`, evenly spaced from the first to the last."""
    if len(windows) <= MAX_WINDOWS:
        return list(windows)
    return [windows[int(i)] for i in np.linspace(0, len(windows) - 1, MAX_WINDOWS).round()]


def documents_section(directory: str, plan: Plan, source: ModelSource, cluster: ClusterSpec) -> list[str]:
    """The lines `mplan plan --documents` prints after the plan (module docstring)."""
    lengths = document_lengths(directory)
    head = (f"Documents in {directory}: {len(lengths)}, median {np.median(lengths):.0f} tokens, "
            f"mean {np.mean(lengths):.1f}")
    if plan.mesh.cp == 1:
        return [head, "  this plan has cp = 1: the data's mix of lengths matters only under cp > 1"]
    try:
        layer = layer_shape(source)
    except ShapeUnknown as exc:
        return [head, f"  not priced: {exc}"]
    try:
        p = price_documents(directory, lengths, plan, layer, cluster)
    except ValueError as exc:  # too few tokens for one window, a seq_len the shares do not split
        return [head, f"  not priced: {exc}"]
    us = 1e6
    dynamic = ("" if p.dynamic_s is None else
               f"; dynamic CP's upper bound {p.dynamic_s * us:.4g} us ({p.loader_fixed_s / p.dynamic_s:.2f}x)")
    tp = f", layers priced at tp=1 (plan tp={plan.mesh.tp})" if plan.mesh.tp > 1 else ""
    if p.speedup > PAYS:
        advice = (f"  advice: set data.packing = \"cp_aligned\" (with data.document_mask = true) in mplan train: "
                  f"predicted {p.speedup:.2f}x faster per real token")
        if plan.micro_batch_size > 1:
            advice += f" (runs at cp=1 only with micro-batches of one row; this plan's hold {plan.micro_batch_size})"
    else:
        advice = (f"  advice: cp-aligned packing does not pay at cp={p.cp} on this data "
                  f"(predicted {p.speedup:.2f}x per real token)")
    return [head,
            f"  at cp={p.cp} ({p.method}), windows of {p.seq_len} tokens, up to {p.priced} of each packing "
            f"priced{tp}:",
            f"  predicted share the runtime's two-size rule runs at cp=1: {p.loader_whole:.0%} of the loader's "
            f"windows, {p.aligned_whole:.0%} of cp-aligned windows (padding {p.padding:.1%})",
            f"  predicted step time per real token (all layers, forward + backward): fixed CP on the loader's "
            f"windows {p.loader_fixed_s * us:.4g} us, two-size rule on cp-aligned windows "
            f"{p.aligned_two_size_s * us:.4g} us ({p.speedup:.2f}x){dynamic}",
            advice]
