"""Context-parallel attention: each rank of a cp group holds a slice of the sequence
(`mplan.ir.context_layout`) and gets exactly what attention over the whole sequence gives its
own query rows, forward and backward.

    context_attention(q, k, v, layout=, group=, method="ring", mask=CAUSAL, doc_ids=None,
                      scale=None, softcap=None, upcast=None) -> out [B, Hq, local_seq, Dv]
        q [B, Hq, local_seq, D], k [B, Hkv, local_seq, D], v [B, Hkv, local_seq, Dv]: this
        rank's tokens, at layout.positions(rank); GQA when Hkv < Hq (q head h reads kv head
        h // (Hq / Hkv), as Hugging Face's repeat_kv); doc_ids [S] or [B, S] for the whole
        sequence (document boundaries are small: every rank holds them all).

What each query sees is `mplan.ir.attention_mask.visible` (causal, sliding window, documents)
of global positions; scores are q.k * scale, then cap * tanh(s / cap) with `softcap`
(Gemma 2's logit soft-capping), then softmax over the visible keys.

Why three methods (they trade traffic against memory and head counts):

    method       forward traffic per rank             backward                   needs
    all_gather   all-gather K, V: (cp-1)/cp of S      reduce-scatter dK, dV       full K, V in memory
    ring         cp-1 hops of one K, V block,         cp-1 hops of K, V plus      two K, V blocks
                 each hidden behind a block's math    cp hops of dK, dV
    all_to_all   all-to-all q, k, v and out: heads    the inverse all-to-alls     Hq % cp == 0
    (Ulysses)    split over cp, sequence gathered

How:
- all_gather: K and V gathered along the sequence (`redistribute.gather_sequence`, whose
  backward reduce-scatters dK and dV: every rank's queries add to every key's gradient), then
  one masked softmax of the local queries against all keys, by autograd. Llama 3's choice: with
  GQA, K and V are a small fraction of the activations.
- ring: a custom autograd Function. Forward: at step s this rank holds the K, V block of rank
  (rank - s) mod cp; it posts the send of that block to rank + 1 and the receive of the next
  from rank - 1, computes its queries against the block while they travel, and merges the
  partial result by log-sum-exp (online softmax): with m = logaddexp(lse_a, lse_b),
  out = out_a e^(lse_a - m) + out_b e^(lse_b - m). Rows and columns of a block with no visible
  pair are skipped (a fully masked block costs nothing): that is what makes the layout's balance
  the ranks' real balance. Backward re-runs the ring from the saved output and log-sum-exp
  (FlashAttention's backward: P = exp(S - lse), dV = P^T dO, dS = P (dP - rowsum(dO * O)),
  times 1 - tanh^2 under soft-capping): each block's dK, dV accumulator travels with the ring,
  every rank adds its queries' part, and after cp hops it arrives at the block's owner.
- all_to_all (Ulysses): an all-to-all gives each rank Hq / cp heads of the whole sequence
  (`redistribute.all_to_all`), plain attention runs there, and the inverse all-to-all brings the
  rank its tokens back. Needs cp | Hq. K and V heads: when cp | Hkv they split as q's do; else
  each kv head is repeated cp / gcd(Hkv, cp) times first (so Hkv x copies is a multiple of cp,
  and every rank's q heads find their kv head among its own), and autograd sums the copies'
  gradients. Each rank computes all queries of its heads, so it is balanced whatever the layout.

Block computation, two paths (`PATHS` counts which ran): where a block's mask is causal per
span or absent, with no documents, window or soft-capping and v's head size = q's, PyTorch's
fused attention kernels compute it and return the log-sum-exp that the merge needs
(`fused_attention`: flash on CPU in float32/float64/bf16/fp16, on CUDA in bf16/fp16 once a
first small block checks out against float32 math, else the reference path): no
[Sq, Sk] score matrix is ever held, which is what makes 32k-128k tokens fit. Elsewhere the
reference path below materialises the block's scores (small blocks, or masks no kernel takes).

Precision (the reference path): plain torch matmul and softmax in the inputs' dtype or `upcast`
where wider: Hugging Face's eager attention takes its softmax in float32 in a bfloat16 model
(`softmax(..., dtype=torch.float32)`) and SDPA's kernels accumulate in float32, so the lowering
passes upcast=float32 and the scores, softmax, log-sum-exp merge and accumulators (the ring's
out, lse, dq and the dk, dv that travel back: twice the gradient hops' bytes in bf16) are
float32; K and V travel forward in the inputs' dtype and the output is cast back to it. A cp run
is then no less precise than the model it replaces (in bf16 it rounds once, at the output, where
the model's eager chain rounds scores and weights too). In float64
each method matches one-process attention to ~1e-15 (the tests ask 1e-12). The ring's merge is
exact arithmetic reordered; every query sees at least itself, so no row's log-sum-exp is -inf
at the end (rows masked within one block are handled: their weight is 0).

In the plan: on a `cp` mesh axis every op holds a sequence slice and runs as it would on the
full sequence, per token; attention is the one op that needs other ranks' tokens, and this
module is what the passes will put in its place. RoPE reads its tables at the layout's
positions; the loss's normalization sums token counts over the cp group.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mplan.collectives import fused_attention
from mplan.collectives.redistribute import all_to_all, gather_sequence
from mplan.ir.attention_mask import CAUSAL, AttentionMask, document_ids, visible
from mplan.ir.context_layout import ContextLayout

__all__ = ["METHODS", "PATHS", "context_attention", "local_attention"]

ProcessGroup = dist.ProcessGroup
Method = Literal["all_gather", "ring", "all_to_all"]
METHODS: tuple[Method, ...] = ("all_gather", "ring", "all_to_all")
Span = tuple[int, int]

PATHS: Counter[str] = Counter()
"""Blocks computed per path since the last clear: "kernel" (fused, no score matrix) or
"reference" (scores materialised). What the tests read to know which path ran."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Scores:
    """How a block of scores is formed and masked."""

    mask: AttentionMask
    scale: float
    softcap: float | None
    doc_ids: torch.Tensor | None  # [B | 1, S], on the inputs' device
    compute: torch.dtype  # scores, softmax and accumulators (`upcast`); the output is cast back
    kernel: torch.dtype | None  # what the fused kernels run this mask in on this device; None: none can

    def up(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.compute)

    def logits(self, q5: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores [B, Hkv, g, Sq, Sk] of grouped queries q5 [B, Hkv, g, Sq, D] against k
        [B, Hkv, Sk, D], and tanh(s / cap) under soft-capping (the backward's derivative)."""
        raw = q5 @ k.unsqueeze(2).transpose(-1, -2) * self.scale
        if self.softcap is None:
            return raw, None
        squashed = torch.tanh(raw / self.softcap)
        return squashed * self.softcap, squashed

    def visible(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return visible(self.mask, q_positions, k_positions, self.doc_ids)

    def pieces(self, q_spans: tuple[Span, ...], k_spans: tuple[Span, ...]) -> tuple[fused_attention.Piece, ...] | None:
        """The block as fused kernel calls, or None: the reference path (scores materialised)."""
        calls = fused_attention.pieces(q_spans, k_spans, self.mask.causal) if self.kernel is not None else None
        PATHS["reference" if calls is None else "kernel"] += 1
        return calls


def _fusable(mask: AttentionMask, doc_ids: torch.Tensor | None, softcap: float | None, q: torch.Tensor,
             v: torch.Tensor, compute: torch.dtype) -> torch.dtype | None:
    """The dtype the fused kernels compute this attention in, or None where they cannot compute
    it exactly: a sliding window, documents or soft-capping (no kernel mask or score transform
    for them), unequal q and v head sizes, no kernel for the dtypes and head size on this device."""
    if mask.window is not None or doc_ids is not None or softcap is not None or q.shape[-1] != v.shape[-1]:
        return None
    return fused_attention.kernel_dtype(q.device, compute, q.dtype, q.shape[-1])


def _positions(spans: tuple[Span, ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


def _grouped(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, S, D] as [B, Hkv, Hq / Hkv, S, D]: q head h under kv head h // (Hq / Hkv)."""
    return x.unflatten(1, (num_kv_heads, x.shape[1] // num_kv_heads))


class _FusedAttention(torch.autograd.Function):
    """Attention of q against k, v by the fused kernels' pieces, in the compute dtype."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[fused_attention.Piece, ...],
                scores: _Scores) -> torch.Tensor:
        q_up, k_up, v_up = scores.up(q), scores.up(k), scores.up(v)
        out, lse = fused_attention.attend(q_up, k_up, v_up, calls, scores.scale, scores.kernel)
        ctx.save_for_backward(q_up, k_up, v_up, out, lse)
        ctx.calls, ctx.scores = calls, scores
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = fused_attention.attend_backward(q, k, v, ctx.calls, ctx.scores.scale,
                                                                 ctx.scores.up(grad), out, lse, ctx.scores.kernel)
        return grad_q.to(grad.dtype), grad_k.to(grad.dtype), grad_v.to(grad.dtype), None, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_spans: tuple[Span, ...], k_spans: tuple[Span, ...],
            scores: _Scores) -> torch.Tensor:
    """Softmax attention of q (at global q_spans) against k, v (at k_spans) under the mask, in
    the compute dtype, the result in q's: the fused kernels where they express the mask, else
    the scores materialised (autograd's)."""
    calls = scores.pieces(q_spans, k_spans)
    if calls is not None:
        return _FusedAttention.apply(q, k, v, calls, scores)
    return _reference(q, k, v, scores.visible(_positions(q_spans, q.device), _positions(k_spans, q.device)), scores)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scores: _Scores) -> torch.Tensor:
    """Softmax attention of q against k, v where `seen` [B | 1, Sq, Sk] allows, the scores
    materialised in the compute dtype, the result in q's; autograd's."""
    s, _ = scores.logits(_grouped(scores.up(q), k.shape[1]), scores.up(k))
    weights = torch.softmax(s.masked_fill(~seen[:, None, None], -math.inf), dim=-1)
    return (weights @ scores.up(v).unsqueeze(2)).flatten(1, 2).to(q.dtype)


# -- the ring --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class _Shift:
    """Sends to the next rank and receives from the previous one, in flight."""

    works: list[Any]
    sent: list[torch.Tensor]  # kept alive until the sends complete
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


_BLOCKS, _GRADIENTS = 0, 1  # message tags of the ring


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ring:
    group: ProcessGroup
    rank: int
    size: int

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> _Shift:
        """Post `tensors` to rank + 1 and receives of the same shapes from rank - 1. The backward
        has blocks (tag 0) and gradients (tag 1) in flight at once: tags keep them apart where
        the backend matches by tag (gloo); NCCL matches by order, the same on every rank."""
        to = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        source = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = ([dist.P2POp(dist.isend, t, to, self.group, tag) for t in sent]
               + [dist.P2POp(dist.irecv, t, source, self.group, tag) for t in received])
        return _Shift(works=dist.batch_isend_irecv(ops), sent=sent, received=received)


def _live(seen: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Rows and columns of a block with any visible pair (None: all of them); None when the
    whole block is masked."""
    rows = seen.any(dim=-1).any(dim=0)
    if not bool(rows.any()):
        return None
    cols = seen.any(dim=-2).any(dim=0)
    return (None if bool(rows.all()) else rows.nonzero().squeeze(1),
            None if bool(cols.all()) else cols.nonzero().squeeze(1))


def _take(x: torch.Tensor, dim: int, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp safe to subtract: -inf (nothing seen) as 0, so exp(-inf - 0) = 0."""
    return lse.masked_fill(lse == -math.inf, 0.0)


def _forward_block(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: tuple[tuple[Span, ...], tuple[Span, ...]],
                   scores: _Scores, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge this block's attention (queries at spans[0], keys at spans[1]) into `out` [B, Hkv,
    g, Sq, Dv] and `lse` [B, Hkv, g, Sq] (q5, out and lse in the compute dtype; the block k, v as
    it travels, in the inputs'): by the fused kernels where they express the mask."""
    calls = scores.pieces(*spans)
    if calls is not None:
        block_out, block_lse = fused_attention.attend(q5.flatten(1, 2), scores.up(k), scores.up(v), calls, scores.scale,
                                                      scores.kernel)
        fused_attention.merge(out, lse, block_out.unflatten(1, out.shape[1:3]), block_lse.unflatten(1, lse.shape[1:3]))
        return
    seen = scores.visible(*(_positions(s, q5.device) for s in spans))
    live = _live(seen)
    if live is None:
        return
    rows, cols = live
    k, v = scores.up(k), scores.up(v)
    seen = _take(_take(seen, 1, rows), 2, cols)[:, None, None]
    s, _ = scores.logits(_take(q5, 3, rows), _take(k, 2, cols))
    s = s.masked_fill(~seen, -math.inf)
    block_lse = s.logsumexp(dim=-1)
    block_out = torch.exp(s - _finite(block_lse)[..., None]) @ _take(v, 2, cols).unsqueeze(2)
    old_out, old_lse = _take(out, 3, rows), _take(lse, 3, rows)
    new_lse = torch.logaddexp(old_lse, block_lse)
    merged = (old_out * torch.exp(old_lse - _finite(new_lse))[..., None]
              + block_out * torch.exp(block_lse - _finite(new_lse))[..., None])
    if rows is None:
        out.copy_(merged)
        lse.copy_(new_lse)
    else:
        out.index_copy_(3, rows, merged)
        lse.index_copy_(3, rows, new_lse)


def _backward_block(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: tuple[tuple[Span, ...], tuple[Span, ...]],
                    scores: _Scores, grad5: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                    grad_q5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add this block's part of dq to `grad_q5`; return its parts of dk and dv (whole block), in
    the compute dtype (q5, grad5, out [B, Hq, Sq, Dv], lse and delta are in it; the block k, v in
    the inputs'): by the fused kernels' backward where they express the mask."""
    k, v = scores.up(k), scores.up(v)
    calls = scores.pieces(*spans)
    if calls is not None:
        grad_q, grad_k, grad_v = fused_attention.attend_backward(q5.flatten(1, 2), k, v, calls, scores.scale,
                                                                 grad5.flatten(1, 2), out, lse.flatten(1, 2),
                                                                 scores.kernel)
        grad_q5 += grad_q.unflatten(1, grad_q5.shape[1:3])
        return grad_k, grad_v
    seen = scores.visible(*(_positions(s, q5.device) for s in spans))
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    live = _live(seen)
    if live is None:
        return grad_k, grad_v
    rows, cols = live
    seen = _take(_take(seen, 1, rows), 2, cols)[:, None, None]
    q_rows, k_cols, v_cols = _take(q5, 3, rows), _take(k, 2, cols), _take(v, 2, cols)
    grad_rows = _take(grad5, 3, rows)
    s, squashed = scores.logits(q_rows, k_cols)
    p = torch.exp(s.masked_fill(~seen, -math.inf) - _finite(_take(lse, 3, rows))[..., None])
    grad_s = p * (grad_rows @ v_cols.unsqueeze(2).transpose(-1, -2) - _take(delta, 3, rows)[..., None])
    if squashed is not None:
        grad_s = grad_s * (1 - squashed * squashed)
    grad_s = grad_s * scores.scale
    block_q = grad_s @ k_cols.unsqueeze(2)
    block_k = (grad_s.transpose(-1, -2) @ q_rows).sum(dim=2)
    block_v = (p.transpose(-1, -2) @ grad_rows).sum(dim=2)
    if rows is None:
        grad_q5 += block_q
    else:
        grad_q5.index_add_(3, rows, block_q)
    if cols is None:
        return block_k, block_v
    return grad_k.index_copy_(2, cols, block_k), grad_v.index_copy_(2, cols, block_v)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, layout: ContextLayout,
                scores: _Scores) -> torch.Tensor:
        q5 = _grouped(scores.up(q), k.shape[1])
        out = q5.new_zeros((*q5.shape[:-1], v.shape[-1]))
        lse = q5.new_full(q5.shape[:-1], -math.inf)
        block = [k, v]
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            travelling = ring.shift(block, _BLOCKS) if step < ring.size - 1 else None
            _forward_block(q5, *block, (layout.spans[ring.rank], layout.spans[owner]), scores, out, lse)
            if travelling is not None:
                block = travelling.wait()
        out = out.flatten(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout, ctx.scores = ring, layout, scores
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, scores = ctx.ring, ctx.layout, ctx.scores
        q5, grad5 = _grouped(scores.up(q), k.shape[1]), _grouped(scores.up(grad), k.shape[1])
        delta = (grad5 * _grouped(out, k.shape[1])).sum(dim=-1)
        grad_q5 = torch.zeros_like(q5)
        block = [k, v]
        accumulating: _Shift | None = None
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            travelling = ring.shift(block, _BLOCKS) if step < ring.size - 1 else None
            grad_k, grad_v = _backward_block(q5, *block, (layout.spans[ring.rank], layout.spans[owner]),
                                             scores, grad5, out, lse, delta, grad_q5)
            if accumulating is not None:
                earlier_k, earlier_v = accumulating.wait()
                grad_k += earlier_k
                grad_v += earlier_v
            # This block's gradient, summed over the ranks that held it so far, moves on with it;
            # the last hop brings each block's gradient home to its owner.
            accumulating = ring.shift([grad_k, grad_v], _GRADIENTS)
            if travelling is not None:
                block = travelling.wait()
        assert accumulating is not None
        grad_k, grad_v = accumulating.wait()
        return grad_q5.flatten(1, 2).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


# -- the entry point -------------------------------------------------------------------------------
def _compute_dtype(inputs: torch.dtype, upcast: torch.dtype | None) -> torch.dtype:
    """The wider of the inputs' dtype and `upcast` (module docstring, Precision)."""
    if upcast is None or not (inputs.is_floating_point and upcast.is_floating_point):
        return inputs
    return torch.promote_types(inputs, upcast)


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, layout: ContextLayout,
             scores: _Scores) -> torch.Tensor:
    cp, num_heads, num_kv_heads = layout.cp, q.shape[1], k.shape[1]
    if num_heads % cp:
        raise ValueError(f"all_to_all context attention splits heads over cp: {num_heads} query heads "
                         f"over cp={cp} ({num_heads} % {cp} = {num_heads % cp})")
    copies = cp // math.gcd(num_kv_heads, cp)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    heads = [all_to_all(x, group, split_dim=1, concat_dim=2) for x in (q, k, v)]
    everything = sum(layout.spans, ())
    out = _attend(*heads, everything, everything, scores)
    return all_to_all(out, group, split_dim=2, concat_dim=1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: ContextLayout,
                      group: ProcessGroup | None, method: Method = "ring", mask: AttentionMask = CAUSAL,
                      doc_ids: torch.Tensor | None = None, scale: float | None = None,
                      softcap: float | None = None, upcast: torch.dtype | None = None) -> torch.Tensor:
    """Attention over the whole sequence for this rank's queries (module docstring); scores,
    softmax and accumulation in `upcast` where it is wider than the inputs' dtype."""
    if method not in METHODS:
        raise ValueError(f"context attention method {method!r}: one of {', '.join(METHODS)}")
    size = 1 if group is None else group.size()
    if size != layout.cp:
        raise ValueError(f"a layout over cp={layout.cp} ranks with a group of {size}")
    batch, num_heads, local_len, head_dim = q.shape
    if k.shape[:3] != (batch, k.shape[1], local_len) or v.shape[:3] != k.shape[:3] or num_heads % k.shape[1]:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: k and v need q's batch and "
                         f"tokens and a head count dividing q's")
    if local_len != layout.local_len:
        raise ValueError(f"{local_len} local tokens where the layout gives each rank {layout.local_len}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"soft-capping needs a positive cap, got {softcap}")
    docs = None if doc_ids is None else document_ids(doc_ids, layout.seq_len).to(q.device)
    if docs is not None and docs.shape[0] not in (1, batch):
        raise ValueError(f"document ids for {docs.shape[0]} rows and a batch of {batch}")
    compute = _compute_dtype(q.dtype, upcast)
    scores = _Scores(mask=mask, scale=head_dim ** -0.5 if scale is None else scale, softcap=softcap, doc_ids=docs,
                     compute=compute, kernel=_fusable(mask, docs, softcap, q, v, compute))
    if group is None or size == 1:
        everything = sum(layout.spans, ())
        return _attend(q, k, v, everything, everything, scores)
    rank = group.rank()
    if method == "all_gather":
        keys, values = gather_sequence(k, group, dim=2), gather_sequence(v, group, dim=2)
        return _attend(q, keys, values, layout.spans[rank], sum(layout.spans, ()), scores)
    if method == "ring":
        return _RingAttention.apply(q, k, v, _Ring(group=group, rank=rank, size=size), layout, scores)
    return _ulysses(q, k, v, group, layout, scores)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, positions: torch.Tensor,
                    mask: AttentionMask = CAUSAL, doc_ids: torch.Tensor | None = None, scale: float | None = None,
                    softcap: float | None = None, upcast: torch.dtype | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (at global `positions`) against its own keys only: no
    collective. Exact where no visible key of these queries is on another rank, as under
    `context_layout.whole_documents` (every document on one rank)."""
    docs = None if doc_ids is None else document_ids(doc_ids, doc_ids.shape[-1]).to(q.device)
    scores = _Scores(mask=mask, scale=q.shape[-1] ** -0.5 if scale is None else scale, softcap=softcap, doc_ids=docs,
                     compute=_compute_dtype(q.dtype, upcast), kernel=None)
    PATHS["reference"] += 1
    return _reference(q, k, v, scores.visible(positions, positions), scores)
