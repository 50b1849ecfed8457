"""`fuse_kernels`: swap ATen op chains of a captured model for mplan's fused kernels.

Input: an ATen-level `torch.fx.GraphModule`, as `torch.export.export(model, ..., strict=False)
.module()` gives for mplan's models (nodes carry `meta["val"]` fake tensors). Output: the same
GraphModule, rewritten in place and recompiled, with `gm.meta["fuse_kernels"]` holding a
`FusionReport` (how often each rule fired).

Rules are data: `FUSION_RULES`, one `FusionRule` per pattern of mplan.ir.fusion_patterns
(`FUSION_PATTERNS`, in its order: what each matches is documented there), each paired with its
emitter in `_EMITTERS` (what replaces the chain, a comment per rule); and `ATTENTION_RULE`, used
when the program will run on CUDA: `device=`; and `FP8_LINEAR_RULE`, only when asked: `fp8=True`.
Each rule is tried at its anchor (the chain's last node); a match names the chain's nodes, the
chain values the fused op returns, the graph values it reads, and the operands the emitter
needs. The driver has the emitter insert the call (a `call_function` node whose target is the
kernel's dispatching op, e.g. `mplan.kernels.rms_norm_residual`, which runs the Triton autograd
Function on CUDA and the reference elsewhere), reroutes every use of the returned values, and
erases the chain.

Invariants:
- Results are unchanged (except under `fp8=True`, which rounds GEMM operands to FP8 on
  purpose): every fused op's reference is the chain's own ATen ops, so on the reference
  dispatch the fused graph computes the same function as the unfused one (bit for bit, except
  where a GEMM changes: bias+GELU moves the bias out of it, grouped projections concatenate
  weights, both rounding as float64 does; attention is the same SDPA op, run on the backend
  that times fastest, which on CUDA may round differently); tests hold fused and unfused
  forward and backward together.
- A chain is fused only when its pattern matches (intermediate values used only inside it, the
  constants and shapes a kernel assumes: mplan.ir.fusion_patterns). Anything else is left as it is.
- The fused call is placed where every value it reads is defined and before every use of a
  value it returns; a match that admits no such place is skipped.
"""
from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from mplan.ir.fusion_patterns import (
    ATTENTION_OPS,
    ATTENTION_PATTERN,
    FUSION_PATTERNS,
    LOSS_OPS,
    VIEW_OPS,
    FusionPattern,
    PatternMatch,
    fp8_linear_pattern,
    is_call,
    sole_consumer,
    tensor_value,
)
from mplan.kernels import (
    attention,
    bias_gelu,
    cross_entropy,
    geglu,
    geglu_packed,
    layer_norm_residual,
    rms_norm,
    rms_norm_residual,
    rope,
    rope_qk,
    swiglu,
    swiglu_packed,
)
from mplan.kernels.grouped_linear import grouped_linear
from mplan.kernels.head_loss import linear_cross_entropy
from mplan.kernels.fp8 import Fp8Linear, Fp8Unavailable, fp8_unavailable_reason
from mplan.passes.local_ops import VocabParallelCrossEntropy, VocabParallelHeadLoss
from mplan.kernels.op_bytes import FUSED_OP_TRAFFIC, FusedOpTraffic, fused_op_bytes

__all__ = ["ATTENTION_RULE", "FP8_LINEAR_RULE", "FUSED_OP_TRAFFIC", "FUSION_RULES", "FusedOpTraffic", "FusionReport",
           "FusionRule", "fuse_kernels", "fused_op_bytes"]

aten = torch.ops.aten
logger = logging.getLogger(__name__)

Emitter = Callable[[Graph, PatternMatch], Node]
"""Adds a match's fused call(s) to the graph; returns the node giving its `outputs` (a tuple if several)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FusionRule:
    """A pattern and the fused call that replaces what it matches."""

    pattern: FusionPattern
    emit: Emitter

    @property
    def name(self) -> str:
        """the fused op's name (the pattern's), as counted in `FusionReport`"""
        return self.pattern.name


@dataclass(frozen=True, slots=True)
class FusionReport:
    """How many chains each rule replaced, and how many fused outputs were marked with the op
    that consumes them (`_mark_consumers`)."""

    counts: dict[str, int] = field(default_factory=dict)
    consumer_marks: int = 0

    def __str__(self) -> str:
        fired = ", ".join(f"{name} x{count}" for name, count in self.counts.items())
        marks = f"; {self.consumer_marks} outputs marked for autocast's casts" if self.consumer_marks else ""
        return f"fuse_kernels: {fired or 'no rule fired'}{marks}"


# ---- emitters, one per rule ------------------------------------------------------------------

def _call(graph: Graph, target: Callable[..., Any], args: tuple[Any, ...], like: Node,
          kwargs: dict[str, Any] | None = None) -> Node:
    node = graph.call_function(target, args, kwargs)
    node.meta.update({key: like.meta[key] for key in ("stack_trace", "nn_module_stack") if key in like.meta})
    return node


def _meta_like(value: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=value.dtype, device="meta")


def _grouped_linear(graph: Graph, like: Node, x: Node, weights: Sequence[Any], biases: Sequence[Any],
                    out: torch.Tensor) -> Node:
    """F.linear(x, cat(weights), cat(biases)): several linears on one input as one GEMM (its
    result [..., sum of out_features] carries a meta value, as later rules read shapes). As
    `grouped_linear`, which keeps the weights rather than their concatenation for the backward;
    as ATen ops (`aten.cat`, then `aten.linear`) where the backward is split into input and
    weight gradients (zero-bubble schedules), whose split runs a GEMM's dX and dW apart."""
    w = tensor_value(weights[0])
    rows = sum(tensor_value(weight).shape[0] for weight in weights)
    if not graph.owning_module.meta.get(_SPLIT_BACKWARD, False):
        product = _call(graph, grouped_linear, (x, list(weights), list(biases)), like)
        product.meta["val"] = _meta_like(out, (*out.shape[:-1], rows))
        return product
    wide = _call(graph, aten.cat.default, (list(weights),), like)
    wide.meta["val"] = _meta_like(w, (rows, w.shape[1]))
    args: tuple[Any, ...] = (x, wide)
    if biases[0] is not None:
        bias = _call(graph, aten.cat.default, (list(biases),), like)
        bias.meta["val"] = _meta_like(w, (rows,))
        args = (x, wide, bias)
    product = _call(graph, aten.linear.default, args, like)
    product.meta["val"] = _meta_like(out, (*out.shape[:-1], rows))
    return product


_SPLIT_BACKWARD = "fuse_kernels.aten_grouped_linears"
"""gm.meta key: True when grouped GEMMs must stay ATen ops (`fuse_kernels(split_backward=, fp8=)`)."""
_HEAD_CHUNK_ROWS = "fuse_kernels.head_chunk_rows"
"""gm.meta key: rows per chunk of the fused head + loss, None for its default (`fuse_kernels(head_chunk_rows=)`)."""


def _emit_linear_group(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    product = _grouped_linear(graph, match.anchor, p["x"], p["weights"], p["biases"], tensor_value(match.anchor))
    return _call(graph, aten.split_with_sizes.default, (product, list(p["sizes"]), -1), match.anchor)


def _emit_rms_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    return _call(graph, rms_norm_residual, (*p["addends"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_rms_norm(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    return _call(graph, rms_norm, (p["x"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_layer_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    return _call(graph, layer_norm_residual, (*p["addends"], p["weight"], p["bias"], p["eps"]), match.anchor)


def _emit_bias_gelu(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    unbiased = _call(graph, aten.linear.default, (p["x"], p["weight"]), p["linear"])
    unbiased.meta["val"] = p["linear"].meta.get("val")
    return _call(graph, bias_gelu, (unbiased, p["bias"]), match.anchor)


def _emit_linear_swiglu(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    product = _grouped_linear(graph, match.anchor, p["x"], p["weights"], p["biases"], tensor_value(p["gate"]))
    return _call(graph, swiglu_packed, (product,), match.anchor)


def _emit_swiglu(graph: Graph, match: PatternMatch) -> Node:
    return _call(graph, swiglu, (match.params["gate"], match.params["up"]), match.anchor)


def _emit_linear_geglu(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    product = _grouped_linear(graph, match.anchor, p["x"], p["weights"], p["biases"], tensor_value(p["gate"]))
    return _call(graph, geglu_packed, (product,), match.anchor)


def _emit_geglu(graph: Graph, match: PatternMatch) -> Node:
    return _call(graph, geglu, (match.params["gate"], match.params["up"]), match.anchor)


def _emit_rope(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    return _call(graph, rope, (p["x"], p["cos"], p["sin"]), match.anchor)


def _emit_cross_entropy(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    logits = p["logits"]
    if p["upcast"]:  # the view of the 16-bit logits the loss reads as fp32
        view = match.anchor.args[0]
        logits = _call(graph, aten.view.default, (logits, view.args[1]), view)
        logits.meta["val"] = _meta_like(tensor_value(p["logits"]), tensor_value(view).shape)
    return _call(graph, cross_entropy, (logits, p["labels"], p["ignore_index"], p["upcast"]), match.anchor)


def _emit_linear_cross_entropy(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    chunk_rows = graph.owning_module.meta.get(_HEAD_CHUNK_ROWS)
    return _call(graph, linear_cross_entropy, (p["x"], p["weight"], p["labels"], p["ignore_index"], p["bias"]),
                 match.anchor, {"upcast": p["upcast"], **({"chunk_rows": chunk_rows} if chunk_rows else {})})


def _emit_attention(graph: Graph, match: PatternMatch) -> Node:
    return _call(graph, attention, match.params["qkv"], match.anchor, match.params["options"])


def _emit_fp8_linear(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    args = (p["x"], p["weight"]) if p["bias"] is None else (p["x"], p["weight"], p["bias"])
    return _call(graph, Fp8Linear(), args, match.anchor)


_EMITTERS: dict[str, Emitter] = {
    # one aten.linear on the concatenated weights, split back: one GEMM instead of several narrow
    # ones, and one input gradient instead of a sum of them
    "linear_group": _emit_linear_group,
    # rms_norm_residual(a, b, weight, eps, **casts) -> (normed, a + b); the casts of the model's
    # form (Hugging Face's fp32 upcast, cast back before the weight, cast of the result)
    "rms_norm_residual": _emit_rms_norm_residual,
    # rms_norm(x, weight, eps, **casts)
    "rms_norm": _emit_rms_norm,
    # layer_norm_residual(a, b, weight, bias, eps) -> (normed, a + b)
    "layer_norm_residual": _emit_layer_norm_residual,
    # aten.linear without the bias, then bias_gelu(y, bias)
    "bias_gelu": _emit_bias_gelu,
    # one linear on [W_gate; W_up], then swiglu_packed: one GEMM, and a gradient already in the
    # layout its backward reads
    "linear_swiglu": _emit_linear_swiglu,
    # swiglu(gate, up)
    "swiglu": _emit_swiglu,
    # the same two with GELU-tanh: one GEMM then geglu_packed; geglu(gate, up)
    "linear_geglu": _emit_linear_geglu,
    "geglu": _emit_geglu,
    # rope(x, cos, sin)
    "rope": _emit_rope,
    # linear_cross_entropy(x, weight, labels, ignore_index, bias, upcast=): the head's GEMM and
    # the loss in chunks of rows, the gradients made in the forward
    "linear_cross_entropy": _emit_linear_cross_entropy,
    # cross_entropy(logits, labels, ignore_index, upcast): with upcast, the loss of the 16-bit
    # logits' fp32 copy, computed without making it
    "cross_entropy": _emit_cross_entropy,
}

FUSION_RULES: tuple[FusionRule, ...] = tuple(FusionRule(pattern=pattern, emit=_EMITTERS[pattern.name])
                                             for pattern in FUSION_PATTERNS)
"""The rules, in FUSION_PATTERNS' order (the planner prices the chains that order finds)."""

ATTENTION_RULE = FusionRule(pattern=ATTENTION_PATTERN, emit=_emit_attention)
"""SDPA without a mask or dropout -> attention(q, k, v, ...): the same op on whichever fused
backend (cuDNN, flash, memory-efficient) times fastest for the shape. Added to the rules when the
program runs on CUDA; elsewhere SDPA has one backend to choose from."""

_LOSSES = (*LOSS_OPS, cross_entropy, linear_cross_entropy)
"""What computes the loss once the rules ran (the FP8 sweep comes after cross_entropy's rule)."""

FP8_LINEAR_RULE = FusionRule(pattern=fp8_linear_pattern(losses=_LOSSES), emit=_emit_fp8_linear)
"""aten.linear with every GEMM dimension a multiple of 16, except the output head (a linear whose
value reaches the loss: kept in the training dtype, as Transformer Engine recipes keep it) ->
Fp8Linear()(x, weight, bias), each call with its own scaling state. Not exact: FP8 rounds to 3
mantissa bits (e4m3) and 2 for gradients (e5m2), so it runs only when asked (`fp8=True`), in a
sweep after the other rules (bias+GELU leaves a new bias-free linear behind)."""


# ---- the driver ------------------------------------------------------------------------------

def fuse_kernels(gm: GraphModule, rules: tuple[FusionRule, ...] | None = None, *,
                 device: torch.device | str | None = None, fp8: bool = False,
                 split_backward: bool = False, head_chunk_rows: int | None = None) -> GraphModule:
    """Replace every chain some rule matches (first matching rule wins, nodes in graph order);
    returns `gm`, recompiled, with `gm.meta["fuse_kernels"]` = FusionReport. `rules` defaults to
    FUSION_RULES and ATTENTION_RULE (`device`: where `gm` will run; on CUDA attention takes its
    fastest backend). `fp8` then sweeps FP8_LINEAR_RULE, first raising `Fp8Unavailable` (naming
    why) unless `device` can run FP8 GEMMs. `split_backward`: a zero-bubble schedule will split
    the backward into input and weight gradients, so grouped GEMMs stay ATen ops (as under
    `fp8`, whose sweep then finds them). `head_chunk_rows`: rows per chunk of the fused head +
    loss, vocabulary-parallel or not (None: the op's default; `Plan.head_loss_chunk_rows`)."""
    gm.meta[_SPLIT_BACKWARD] = split_backward or fp8
    gm.meta[_HEAD_CHUNK_ROWS] = head_chunk_rows
    if rules is None:
        rules = FUSION_RULES + (ATTENTION_RULE,)
    sweeps = [rules]
    if fp8:
        where = torch.device(device) if device is not None else torch.device("cpu")
        reason = fp8_unavailable_reason(where)
        if reason is not None:
            raise Fp8Unavailable(f"fuse_kernels(fp8=True): {reason}")
        sweeps.append((FP8_LINEAR_RULE,))
    graph = gm.graph
    counts: Counter[str] = Counter()
    erased: set[Node] = set()
    for node in list(graph.nodes):
        # export's checks that a cast's input has the traced dtype: a use no chain should count
        # (a fused op never exposes the value it checks)
        if is_call(node, aten._assert_tensor_metadata.default):
            graph.erase_node(node)
    # first: the output head it takes is then no linear that a rule (FP8's) could take
    vocab_parallel = _fuse_vocab_parallel_losses(gm)
    for sweep in sweeps:
        for node in list(graph.nodes):
            if node in erased or node.op != "call_function":
                continue
            for rule in sweep:
                if node.target not in rule.pattern.anchors:
                    continue
                match = rule.pattern.match(node)
                if match is not None and _rewrite(graph, match, rule.emit, erased):
                    counts[rule.name] += 1
                    break
    pairs = _pair_ropes(graph)
    if pairs:
        counts["rope"] -= 2 * pairs
        counts["rope_qk"] = pairs
        counts = +counts  # drops a rope count paired away entirely
    _release_rotated_projections(graph)
    counts.update(vocab_parallel)
    marks = _mark_consumers(graph)
    graph.lint()
    gm.recompile()
    gm.meta["fuse_kernels"] = report = FusionReport(dict(counts), consumer_marks=marks)
    logger.info("%s", report)
    return gm


def _fuse_vocab_parallel_losses(gm: GraphModule) -> Counter[str]:
    """TP programs compute a vocabulary-sharded loss in a module (`insert_collectives`), which no
    ATen rule sees. Its mean, where the local logits come straight from the column-parallel
    output head (`_vocab_parallel_head`), runs with the head's GEMM as one chunked op that never
    makes the local logits:

        before  x, w -> aten.linear(x, w [, b]) [-> view/reshape to [rows, V/n]] [-> .to(float32)]
                     -> call_module VocabParallelCrossEntropy(mean)(logits, target)
        after   x, w -> call_module VocabParallelHeadLoss(x, w, target [, b])   (the same node)

    (`vocab_parallel_linear_cross_entropy`; the linear, view and cast are erased; a bias is the
    column split's local slice and goes along). x's gradient is the partial addend the local
    linear's was, summed over the TP group by the same `Redistribute` before it. Any other mean
    (logits from anything but such a linear, or an intermediate used elsewhere) runs mplan's
    vocabulary-parallel cross-entropy kernel on the local logits (`fused`)."""
    fused: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not (isinstance(module, VocabParallelCrossEntropy) and module.reduction == "mean"):
            continue
        head = _vocab_parallel_head(node)
        if head is None:
            module.fused = True
            fused["vocab_parallel_cross_entropy"] += 1
            continue
        (x, weight, bias), chain, upcast = head
        gm.add_submodule(node.target, VocabParallelHeadLoss(axis=module.axis, ignore_index=module.ignore_index,
                                                            upcast=upcast, node=module.node,
                                                            chunk_rows=gm.meta.get(_HEAD_CHUNK_ROWS)))
        node.args = (x, weight, node.args[1]) + (() if bias is None else (bias,))
        for value in reversed(chain):  # the cast, the view, the linear: each used only on this path
            for check in [u for u in value.users if is_call(u, aten._assert_tensor_metadata.default)]:
                gm.graph.erase_node(check)
            gm.graph.erase_node(value)
        fused["vocab_parallel_linear_cross_entropy"] += 1
    return fused


def _vocab_parallel_head(loss: Node) -> tuple[tuple[Node, Node, Node | None], list[Node], bool] | None:
    """((x, w, bias or None), [linear, then the view and/or cast in data order], upcast) when the
    vocabulary-parallel loss `loss` reads `aten.linear(x, w [, bias])` through at most one view
    or reshape to [rows, V/n] and at most one `.to(float32)` (`upcast`; in either order), every
    one used only on that path (dtype assertions aside) and the rows those of `target`; else None."""
    if len(loss.args) != 2 or loss.kwargs:
        return None
    value, target = loss.args
    chain: list[Node] = []
    user, upcast, viewed = loss, False, False
    while isinstance(value, Node) and not is_call(value, aten.linear.default):
        only_here = {u for u in value.users if not is_call(u, aten._assert_tensor_metadata.default)} == {user}
        if not only_here or value.kwargs or len(value.args) != 2:
            return None
        if is_call(value, *VIEW_OPS) and not viewed:
            viewed = True
        elif is_call(value, aten.to.dtype) and value.args[1] == torch.float32 and not upcast:
            upcast = True
        else:
            return None
        chain.insert(0, value)
        user, value = value, value.args[0]
    linear = value
    if not is_call(linear, aten.linear.default) or linear.kwargs or \
            {u for u in linear.users if not is_call(u, aten._assert_tensor_metadata.default)} != {user}:
        return None
    x, weight, bias = (list(linear.args) + [None])[:3]
    xv, wv, out, logits, labels = (tensor_value(n) for n in (x, weight, linear, loss.args[0], target))
    if xv is None or wv is None or out is None or logits is None or labels is None or wv.dim() != 2:
        return None
    width = wv.shape[0]
    rows = xv.numel() // max(xv.shape[-1], 1)
    # the loss must read the linear's rows in their order, all of them: a flatten of its leading dims
    if out.shape[-1] != width or tuple(logits.shape) != (rows, width) or labels.numel() != rows:
        return None
    return (x, weight, bias), [linear, *chain], upcast


def _pair_ropes(graph: Graph) -> int:
    """rope(q, cos, sin) and rope(k, cos, sin) that feed one attention call as its q and k, each
    used only there -> rope_qk(q, k, cos, sin): one launch each way, cos and sin read once (and
    Hugging Face's [batch, 1, seq, head_dim] tables taken as they are). Returns the pairs made."""
    pairs = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION_OPS:
            continue
        q, k = node.args[:2]
        if not (is_call(q, rope) and is_call(k, rope) and q is not k and len(q.users) == len(k.users) == 1):
            continue
        if q.args[1:3] != k.args[1:3] or q.kwargs.get("consumer") != k.kwargs.get("consumer"):
            continue
        later = k if list(graph.nodes).index(k) > list(graph.nodes).index(q) else q
        with graph.inserting_after(later):
            both = _call(graph, rope_qk, (q.args[0], k.args[0], *q.args[1:3]), q, dict(q.kwargs))
        both.meta["val"] = (q.meta.get("val"), k.meta.get("val"))
        for index, single in enumerate((q, k)):
            with graph.inserting_after(both):
                part = graph.call_function(operator.getitem, (both, index))
            part.meta["val"] = single.meta.get("val")
            single.replace_all_uses_with(part)
            graph.erase_node(single)
        pairs += 1
    return pairs


_PART_VIEWS = (*VIEW_OPS, aten.transpose.int, aten.permute.default, aten.unsqueeze.default)
"""Views a projection's part goes through on its way to RoPE (Hugging Face's [b, s, h, d] -> [b, h, s, d])."""


def _rotated(part: Node) -> bool:
    """Every use of `part`, through views, is the rotated input of a RoPE kernel (never its tables):
    RoPE writes a new tensor, so nothing keeps `part`'s storage once it ran."""
    frontier = [part]
    while frontier:
        value = frontier.pop()
        for user in value.users:
            if is_call(user, rope) and user.args[0] is value or is_call(user, rope_qk) and value in user.args[:2]:
                continue
            if is_call(user, *_PART_VIEWS) and user.args[0] is value:
                frontier.append(user)
                continue
            return False
    return True


def _release_rotated_projections(graph: Graph) -> None:
    """Copy out the unrotated parts of a grouped GEMM whose other parts RoPE rotates.

    The q/k/v GEMM writes one packed buffer that q, k and v view. RoPE replaces q and k with new
    tensors, but attention keeps v for its backward, and as a view v kept the whole buffer: at
    Llama-1.1B's shape 80 MiB a layer more than q, k and v need, 1.7 GiB over 22 layers, found on
    the H200 as the 6.6% the memory model under-predicted the peak (29.10 GiB measured;
    benchmarks/results/memory_timeline_h200-2026-12-02-before-copy.json). A contiguous copy of v
    (16 MiB a layer there, microseconds) lets the buffer go once RoPE has run: 27.38 GiB
    (memory_timeline_h200-2026-12-02.json)."""
    for node in list(graph.nodes):
        if not (is_call(node, aten.split_with_sizes.default) and is_call(node.args[0], grouped_linear, aten.linear.default)):
            continue
        parts = sorted((u for u in node.users if is_call(u, operator.getitem)), key=lambda u: u.args[1])
        rotated = [_rotated(part) for part in parts]
        if not any(rotated) or all(rotated):
            continue
        for part in (p for p, r in zip(parts, rotated) if not r):
            with graph.inserting_after(part):
                copy = graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            value = part.meta.get("val")
            if isinstance(value, torch.Tensor):
                copy.meta["val"] = _meta_like(value, value.shape)
            part.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


_MARKED_OUTPUTS: dict[Any, int | str | None] = {
    layer_norm_residual: 0, rms_norm_residual: 0, rms_norm: None, rope: None, rope_qk: "all"}
"""Fused ops whose output autocast would otherwise leave in fp32 (norms of an fp32 residual
stream, RoPE with fp32 tables) -> which of their outputs is marked (None: the op's only one;
"all": each of them, which must all feed one kind of consumer)."""
_ATTENTION_OPS = (*ATTENTION_OPS, attention)
"""What computes attention once the rules ran (ATTENTION_RULE may have fused SDPA)."""
_LINEAR_OPS = (linear_cross_entropy, grouped_linear)
"""Fused ops whose first argument is a GEMM input, cast under autocast as F.linear casts it."""


def _mark_consumers(graph: Graph) -> int:
    """Give each fused norm or RoPE whose output only feeds linears (or attention) a `consumer=`
    keyword: under autocast, which casts those inputs to its lower dtype, the kernel then writes
    that dtype itself (`mplan.kernels.dispatch.consumer_cast_dtype`), the same values without
    the fp32 round trip. Outside autocast the keyword changes nothing. Returns how many."""
    marked = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MARKED_OUTPUTS:
            continue
        index = _MARKED_OUTPUTS[node.target]
        if index == "all":  # every output must go to the same kind of consumer
            kinds = {sole_consumer(u, attention_ops=_ATTENTION_OPS, linear_ops=_LINEAR_OPS) for u in node.users}
            consumer = kinds.pop() if len(kinds) == 1 else None
        else:
            outputs = [node] if index is None else [u for u in node.users if is_call(u, operator.getitem)
                                                      and u.args[1] == index]
            consumer = sole_consumer(outputs[0], attention_ops=_ATTENTION_OPS, linear_ops=_LINEAR_OPS) if len(outputs) == 1 else None
        if consumer is not None:
            node.kwargs = {**node.kwargs, "consumer": consumer}
            marked += 1
    return marked


def _rewrite(graph: Graph, match: PatternMatch, emit: Emitter, erased: set[Node]) -> bool:
    """Insert the fused call, reroute the outputs' uses, erase the chain; False if no valid place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    chain = set(match.chain)
    outside_users = [user for out in match.outputs for user in out.users if user not in chain]
    latest_input = max((order[n] for n in match.inputs if isinstance(n, Node)), default=-1)
    first_chain = min(match.chain, key=order.__getitem__)
    if latest_input < order[first_chain]:
        before = first_chain
    elif outside_users and latest_input >= min(order[user] for user in outside_users):
        return False
    else:
        before = list(graph.nodes)[latest_input + 1]
    with graph.inserting_before(before):
        fused = emit(graph, match)
        if len(match.outputs) == 1:
            results = [fused]
        else:
            results = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(match.outputs))]
    vals = [out.meta.get("val") for out in match.outputs]
    fused.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
    for out, result, val in zip(match.outputs, results, vals):
        result.meta["val"] = val
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in chain)
    dropped: list[Node] = []
    for node in sorted(match.chain, key=order.__getitem__, reverse=True):
        if not node.users:
            dropped.extend(node.all_input_nodes)
            graph.erase_node(node)
            erased.add(node)
    _erase_unused(graph, dropped, erased)
    return True


def _erase_unused(graph: Graph, nodes: list[Node], erased: set[Node]) -> None:
    """Erase what the chain read and nothing reads any more (an attention mask that the causal
    kernel replaced, and what computed it), when it is a pure ATen call: no mutation, no random
    numbers (erasing those would shift the generator's stream)."""
    while nodes:
        node = nodes.pop()
        if node in erased or node.users or node.op != "call_function" or not _pure(node.target):
            continue
        nodes.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _pure(target: Any) -> bool:
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)
