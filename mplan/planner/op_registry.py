"""The op registry: for each ATen op, its sharding strategies on one mesh axis, how the passes
lower each of them, and which of them a hand-written Megatron-LM plan would use.

One `OpEntry` per op packet (`aten.linear`, any overload) in `REGISTRY`. An entry's rule makes
the op's strategies for a node on an axis of n ranks; every strategy it makes names its
`lowering` (`ir/strategy.py`), the rule of `mplan.passes.local_ops.LOWERINGS` that runs it on
local shards, so the planner can never pick what no pass can lower (a test holds every lowering
named here to that table, and a property test runs the view family's strategies against eager).
`megatron` is the set of split strategy names Megatron-LM's layout uses for the op (None: any
split is Megatron's, as for the elementwise ops between its parallel layers).

Most ops are described by an einsum-like string (`linear`: "...k,nk,n->...n"): sharding one
index letter shards every operand that carries it; a contracted letter makes the output `P`.
Elementwise ops follow broadcasting, views map dimensions through the reshape, and a few ops
(attention, embedding, cross-entropy) have rules of their own. An op with no entry, or one that
capture could not describe (`OpNode.known` False), gets only the replicated strategy: never a
guess.

Input-gradient placements follow DTensor's algebra: an operand that carries the sharded letter
gets an `S` gradient; one that does not (it was replicated while the op was split) gets a `P`
gradient that must be reduced; a replicated op gives `R` gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mplan.ir.graph import OpNode, TensorMeta
from mplan.ir.op_table import op_packet
from mplan.ir.placement import P, Placement, R, Shard, grad_placement
from mplan.ir.strategy import Strategy
from mplan.ir.strategy import replicated as _replicated

StrategyRule = Callable[[OpNode, int], list[Strategy]]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpEntry:
    """What mplan knows about sharding one op."""

    rule: StrategyRule  # (node, axis size) -> strategies, replicated first
    megatron: frozenset[str] | None = None  # split strategy names Megatron's layout uses; None: any


def replicated(node: OpNode) -> Strategy:
    """The strategy every op has: inputs whole, the single-device op (assertions about the
    captured global tensors are dropped instead: they are not true of local shards)."""
    return _replicated(len(node.inputs), "dropped" if op_packet(node.op) in _ASSERTIONS else "replicated")


def _divisible(size: int, n: int) -> bool:
    return size % n == 0 and size >= n


def _arg(node: OpNode, position: int, name: str, default: Any) -> Any:
    """A positional-or-keyword argument of the ATen call, as captured."""
    if len(node.args) > position:
        return node.args[position]
    return dict(node.kwargs).get(name, default)


def _dim(value: object, rank: int) -> int:
    return int(value) % rank if rank else 0  # type: ignore[call-overload]


_LETTERS = "abcdefghijlmopqrtuvwxyz"  # "k", "n", "s" left free for specs


def einsum_strategies(operands: Sequence[str], out: str, metas: Sequence[TensorMeta],
                      out_meta: TensorMeta, n: int, *, name: Callable[[str], str] | None = None,
                      no_shard: str = "", lowering: Callable[[str], str] = lambda c: "local") -> list[Strategy]:
    """One strategy per shardable letter of `operands -> out`, plus the replicated one.

    Operands given as "" are not tensors (ignored). A letter can be sharded when every dim that
    carries it is divisible by n and it is not in `no_shard`.
    """
    k = len(operands)
    strategies = [_replicated(k)]
    letters = dict.fromkeys(c for spec in (*operands, out) for c in spec)
    for letter in letters:
        if letter in no_shard:
            continue
        sizes = [m.shape[spec.index(letter)] for spec, m in zip(operands, metas) if letter in spec]
        if letter in out:
            sizes.append(out_meta.shape[out.index(letter)])
        if not sizes or not all(_divisible(s, n) for s in sizes):
            continue
        ins = tuple(Shard(spec.index(letter)) if letter in spec else R for spec in operands)
        grads = tuple(Shard(spec.index(letter)) if letter in spec else (P if spec else R)
                      for spec in operands)
        output = Shard(out.index(letter)) if letter in out else P
        strategies.append(Strategy(name=(name or (lambda c: f"shard({c})"))(letter), inputs=ins,
                                   output=output, input_grads=grads, split=True, lowering=lowering(letter)))
    return strategies


def _batch_letters(rank: int) -> str:
    return _LETTERS[:rank]


# -- GEMMs ----------------------------------------------------------------------------------------
def _linear(node: OpNode, n: int) -> list[Strategy]:
    x = node.input_metas[0]
    b = _batch_letters(len(x.shape) - 1)
    bias = len(node.inputs) > 2
    operands = [b + "k", "nk"] + (["n"] if bias else [])
    names = {"k": "row", "n": "column"}
    # A row-parallel linear's output is a partial sum: each rank adds bias / n (`row_bias`).
    return einsum_strategies(operands, b + "n", node.input_metas, node.output, n,
                             name=lambda c: names.get(c, "batch"),
                             lowering=lambda c: "row_bias" if c == "k" and bias else "local")


def _matmul(node: OpNode, n: int) -> list[Strategy]:
    a, b = node.input_metas[0], node.input_metas[1]
    if len(a.shape) != len(b.shape) or len(a.shape) < 2 or a.shape[:-2] != b.shape[:-2]:
        return [replicated(node)]  # broadcasting batch dims: not worth a rule yet
    batch = _batch_letters(len(a.shape) - 2)
    weight = any(pos == 1 for pos, _ in node.params)  # x @ W: name the splits as a linear's
    names = {"k": "row", "n": "column"} if weight else {}
    return einsum_strategies([batch + "ik", batch + "kn"], batch + "in", node.input_metas, node.output, n,
                             name=lambda c: "batch" if c in batch else names.get(c, f"shard({c})"))


def _einsum(node: OpNode, n: int) -> list[Strategy]:
    """`torch.einsum` (torch.export keeps it whole): the equation is the einsum description itself.
    An ellipsis, a repeated letter within an operand (a trace) or an operand count that does not
    match is kept whole."""
    equation = str(node.args[0]).replace(" ", "") if node.args else ""
    lhs, arrow, out = equation.partition("->")
    operands = lhs.split(",")
    if not arrow or "." in equation or len(operands) != len(node.inputs) or \
            any(len(set(spec)) != len(spec) for spec in (*operands, out)) or \
            any(len(spec) != len(m.shape) for spec, m in zip(operands, node.input_metas)):
        return [replicated(node)]
    return einsum_strategies(operands, out, node.input_metas, node.output, n)


# -- attention ------------------------------------------------------------------------------------
def _sdpa(node: OpNode, n: int) -> list[Strategy]:
    # q [b, hq, s, d], k/v [b, hk, s, d], an optional mask broadcastable to [b, hq, s, s]. Heads
    # and batch split cleanly (a mask follows where it is not broadcast). Splitting query rows
    # would break the causal mask's offsets, and the head dim / key axis feed a softmax: never.
    q, k = node.input_metas[0], node.input_metas[1]
    if len(node.inputs) not in (3, 4):
        return [replicated(node)]
    mask = node.input_metas[3] if len(node.inputs) == 4 else None

    def follow(dim: int, size: int) -> tuple[Placement, ...]:
        if mask is None:
            return ()
        offset = 4 - len(mask.shape)
        here = dim - offset
        return (Shard(here) if here >= 0 and mask.shape[here] == size else R,)

    strategies = [replicated(node)]
    if _divisible(q.shape[0], n):
        m = follow(0, q.shape[0])
        strategies.append(Strategy(name="batch", inputs=(Shard(0),) * 3 + m, output=Shard(0),
                                   input_grads=(Shard(0),) * 3 + m, split=True))
    if _divisible(q.shape[1], n) and _divisible(k.shape[1], n):
        m = follow(1, q.shape[1])
        strategies.append(Strategy(name="heads", inputs=(Shard(1),) * 3 + m, output=Shard(1),
                                   input_grads=(Shard(1),) * 3 + m, split=True))
    if mask is None or follow(1, q.shape[1]) == (R,):
        strategies.extend(kv_replicated_heads(q, k, n, masked=mask is not None))
    return strategies


def kv_replicated_heads(q: TensorMeta, k: TensorMeta, n: int, *, masked: bool = False) -> list[Strategy]:
    """Grouped-query attention with fewer (or indivisible) key/value heads than ranks: query
    heads split n ways, keys and values whole on every rank, each rank reading the kv heads its
    query heads use (Megatron replicates kv heads when kv_heads < tp). The k/v gradients are
    partial: each rank's covers only the heads it read. A mask must broadcast over heads."""
    hq, hk = q.shape[1], k.shape[1]
    if not _divisible(hq, n) or _divisible(hk, n) or hq % hk:
        return []
    local, group = hq // n, hq // hk
    if group % local and local % group:
        return []  # a rank's query heads would cover a fraction of a kv group unevenly
    m = (R,) if masked else ()
    return [Strategy(name="heads_kv_replicated", inputs=(Shard(1), R, R) + m, output=Shard(1),
                     input_grads=(Shard(1), P, P) + m, split=True, lowering="kv_replicated_attention")]


# -- embedding and loss ---------------------------------------------------------------------------
def _embedding(node: OpNode, n: int) -> list[Strategy]:
    if _arg(node, 3, "scale_grad_by_freq", False) or _arg(node, 4, "sparse", False):
        return [replicated(node)]  # their gradients are not sums over shards
    ids = node.input_metas[1]
    b = _batch_letters(len(ids.shape))
    # Vocabulary-parallel (Megatron): each rank looks up the ids it owns, zeros elsewhere, so the
    # output is a partial sum; the weight gradient stays sharded by vocabulary.
    return einsum_strategies(["vh", b], b + "h", node.input_metas, node.output, n,
                             name=lambda c: {"v": "vocab", "h": "hidden"}.get(c, "batch"),
                             lowering=lambda c: "vocab_embedding" if c == "v" else "local")


_REDUCTION_NONE = 0  # at::Reduction


def _cross_entropy(node: OpNode, n: int) -> list[Strategy]:
    # cross_entropy_loss(logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0)
    logits = node.input_metas[0]
    if len(logits.shape) != 2 or len(node.inputs) != 2 or _arg(node, 2, "weight", None) is not None:
        return [replicated(node)]  # class weights: kept whole
    num_rows, vocab = logits.shape
    reduction = int(_arg(node, 3, "reduction", 1))
    strategies = [replicated(node)]
    if _divisible(num_rows, n) and reduction != _REDUCTION_NONE:
        # each rank's sum over its rows, divided by the rows counted on all ranks: a partial sum
        strategies.append(Strategy(name="batch", inputs=(Shard(0), Shard(0)), output=P,
                                   input_grads=(Shard(0), Shard(0)), split=True, lowering="batch_loss"))
    if _divisible(vocab, n) and not float(_arg(node, 5, "label_smoothing", 0.0)):
        # Vocabulary-parallel cross-entropy: all-reduce the row max, the sum of exponentials and
        # the target logit ([rows] fp32 each); no rank ever holds the full logits.
        row_bytes = num_rows * 4
        strategies.append(Strategy(name="vocab", inputs=(Shard(1), R), output=R,
                                   input_grads=(Shard(1), R), split=True,
                                   comm=(("all_reduce", row_bytes),) * 3, lowering="vocab_loss"))
    return strategies


# -- norms, elementwise, reductions ---------------------------------------------------------------
def _norm(node: OpNode, n: int) -> list[Strategy]:
    # layer_norm(x, normalized_shape, weight, bias, eps) / rms_norm(x, shape, weight, eps)
    x = node.input_metas[0]
    normalized = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], tuple) else (x.shape[-1],)
    lead = len(x.shape) - len(normalized)
    b = _batch_letters(lead)
    tail = "xyz"[:len(normalized)]
    operands = [b + tail] + [tail] * (len(node.inputs) - 1)
    return einsum_strategies(operands, b + tail, node.input_metas, node.output, n, no_shard=tail)


def _elementwise(node: OpNode, n: int) -> list[Strategy]:
    if node.kind != "elementwise" and op_packet(node.op) not in _SELECTS or not node.input_metas:
        return [replicated(node)]
    out = node.output
    rank = len(out.shape)
    letters = _batch_letters(rank)
    operands = []
    broadcast = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    for m in node.input_metas:
        offset = rank - len(m.shape)
        # A dim an operand broadcasts along gets a letter of its own that is never sharded.
        operands.append("".join(letters[offset + i] if m.shape[i] == out.shape[offset + i] else next(broadcast)
                                for i in range(len(m.shape))))
    strategies = einsum_strategies(operands, letters, node.input_metas, out, n,
                                   no_shard="ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    strategies.extend(_partial_strategies(node))
    return strategies


def _partial_strategies(node: OpNode) -> list[Strategy]:
    """Linear maps of a partial sum stay partial: P+P, P*R, P/R, -P."""
    packet = op_packet(node.op)
    k = len(node.inputs)
    if packet in ("add", "sub") and k == 2 and node.input_metas[0].shape == node.input_metas[1].shape:
        return [Strategy(name="partial", inputs=(P, P), output=P, input_grads=(R, R), split=False)]
    if packet in ("add", "sub", "neg", "mul", "div", "_to_copy", "clone") and k == 1:
        if packet in ("add", "sub") and not _scalar_operand_is_zero(node):
            return []  # adding a constant to every rank's partial would count it n times
        return [Strategy(name="partial", inputs=(P,), output=P, input_grads=(R,), split=False)]
    if packet == "mul" and k == 2:
        return [Strategy(name="partial", inputs=(P, R), output=P, input_grads=(R, P), split=False),
                Strategy(name="partial", inputs=(R, P), output=P, input_grads=(P, R), split=False)]
    if packet == "div" and k == 2:
        return [Strategy(name="partial", inputs=(P, R), output=P, input_grads=(R, P), split=False)]
    return []


def _scalar_operand_is_zero(node: OpNode) -> bool:
    return any(a == 0 for a in node.args[1:2])


def _softmax(node: OpNode, n: int) -> list[Strategy]:
    rank = len(node.output.shape)
    dim = _dim(_arg(node, 1, "dim", -1), rank)
    return _follow(node, n, {d: d for d in range(rank) if d != dim}, partial=False)


def _reduction(node: OpNode, n: int) -> list[Strategy]:
    packet = op_packet(node.op)
    if packet not in ("sum", "mean") or not node.input_metas:
        return [replicated(node)]
    rank = len(node.input_metas[0].shape)
    dims = _arg(node, 1, "dim", None)
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if dims is None or dims == ():
        return [replicated(node)]
    reduced = {_dim(d, rank) for d in (dims if isinstance(dims, tuple) else (dims,))}
    mapping = {d: d if keepdim else d - sum(r < d for r in reduced) for d in range(rank) if d not in reduced}
    return _follow(node, n, mapping, partial=packet == "sum")


# -- views and data movement ----------------------------------------------------------------------
def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Source dims that a reshape keeps as the outermost factor of an output dim: src -> dst.

    Groups of consecutive dims with equal products are matched; within a group only the first
    (outermost) dim of each side can carry a shard, and only onto the first dim of the other.
    """
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = i, j
        ps, pd = src[i], dst[j]
        while ps != pd:
            if ps < pd:
                i += 1
                ps *= src[i] if i < len(src) else 1
            else:
                j += 1
                pd *= dst[j] if j < len(dst) else 1
            if i >= len(src) or j >= len(dst):
                return mapping
        # skip size-1 dims at the start of the group so the shard lands on a real dim
        while gi < i and src[gi] == 1:
            gi += 1
        while gj < j and dst[gj] == 1:
            gj += 1
        if src[gi] > 1 and dst[gj] > 1:
            mapping[gi] = gj
        i += 1
        j += 1
    return mapping


def _follow(node: OpNode, n: int, dim_map: dict[int, int], *, partial: bool = True,
            lowering: str = "local") -> list[Strategy]:
    """Strategies of a single-input data-movement op given how its dims map to the output's."""
    k = len(node.inputs)
    strategies = [replicated(node)]
    src = node.input_metas[0].shape
    for d_in, d_out in dim_map.items():
        if _divisible(src[d_in], n) and _divisible(node.output.shape[d_out], n):
            rest = (R,) * (k - 1)
            strategies.append(Strategy(name=f"shard({d_in})", inputs=(Shard(d_in),) + rest,
                                       output=Shard(d_out), input_grads=(Shard(d_in),) + rest, split=True,
                                       lowering=lowering))
    if partial and k == 1:
        strategies.append(Strategy(name="partial", inputs=(P,), output=P, input_grads=(R,), split=False))
    return strategies


# the dim each of these cuts, as (position, keyword, default): split(x, size, dim=0), chunk(x, n, dim=0), ...
_CUT_DIM = {"slice": (1, "dim", 0), "narrow": (1, "dim", 0), "select": (1, "dim", 0), "unbind": (1, "dim", 0),
            "split": (2, "dim", 0), "split_with_sizes": (2, "dim", 0), "chunk": (2, "dim", 0)}
# view_as(x, other) is a reshape of x to other's shape (other only lends its shape: whole)
_RESHAPES = ("view", "_unsafe_view", "reshape", "view_copy", "squeeze", "unsqueeze", "flatten", "unflatten",
             "view_as")
_SAME_SHAPE = ("_to_copy", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "to", "type_as")


def _view(node: OpNode, n: int) -> list[Strategy]:
    packet = op_packet(node.op)
    src = node.input_metas[0].shape if node.input_metas else ()
    rank = len(src)
    if not node.inputs or not node.outputs or not node.input_metas:
        return [replicated(node)]
    if packet == "transpose" and len(node.args) >= 3:
        a, b = _dim(node.args[1], rank), _dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
        return _follow(node, n, {perm[o]: o for o in range(rank)})
    if packet == "t":
        return _follow(node, n, {0: 1, 1: 0} if rank == 2 else {0: 0})
    if packet == "permute" and len(node.args) >= 2:
        perm = [_dim(d, rank) for d in node.args[1]]
        return _follow(node, n, {perm[o]: o for o in range(rank)})
    if packet in _CUT_DIM:
        cut = _dim(_arg(node, *_CUT_DIM[packet]), rank)
        removed = packet in ("select", "unbind")
        # every piece keeps the other dims whole, so a shard of any of them is a shard of each piece
        return _follow(node, n, {d: d - (removed and d > cut) for d in range(rank) if d != cut})
    if packet == "expand":
        out = node.output.shape
        offset = len(out) - rank
        return _follow(node, n, {d: d + offset for d in range(rank) if src[d] == out[d + offset]},
                       lowering="expand_local")
    if packet in _SAME_SHAPE:
        return _follow(node, n, {d: d for d in range(rank)})
    # reshapes: the local output shape is the global one divided on the sharded dim
    return _follow(node, n, view_dim_map(src, node.output.shape), lowering="reshape_local")


def _cat(node: OpNode, n: int) -> list[Strategy]:
    rank = len(node.output.shape)
    cat_dim = _dim(_arg(node, 1, "dim", 0), rank)
    # torch skips 1-D empty tensors in a concatenation whatever the others' rank (a fresh KV
    # cache's `torch.tensor([])`): they stay whole and take no part in the split.
    empty = [m.shape == (0,) for m in node.input_metas]
    strategies = [replicated(node)]
    for d in range(rank):
        if d != cat_dim and all(e or _divisible(m.shape[d], n) for m, e in zip(node.input_metas, empty)):
            ins = tuple(R if e else Shard(d) for e in empty)
            strategies.append(Strategy(name=f"shard({d})", inputs=ins, output=Shard(d), input_grads=ins, split=True))
    return strategies + _partial_join(node, empty)


def _partial_join(node: OpNode, empty: list[bool] | None = None) -> list[Strategy]:
    """Joining partial sums is the partial sum of the join (cat, stack are linear)."""
    k = len(node.inputs)
    if empty and any(empty):
        return []  # an empty input is held whole, and nothing turns R into P
    return [Strategy(name="partial", inputs=(P,) * k, output=P, input_grads=(R,) * k, split=False)]


def _stack(node: OpNode, n: int) -> list[Strategy]:
    rank = len(node.output.shape)
    new = _dim(_arg(node, 1, "dim", 0), rank)
    k = len(node.inputs)
    strategies = [replicated(node)]
    for d in range(rank - 1):
        if all(_divisible(m.shape[d], n) for m in node.input_metas):
            out = d if d < new else d + 1
            strategies.append(Strategy(name=f"shard({d})", inputs=(Shard(d),) * k, output=Shard(out),
                                       input_grads=(Shard(d),) * k, split=True))
    return strategies + _partial_join(node)


def _getitem(node: OpNode, n: int) -> list[Strategy]:
    # One element of a multi-output op (split, unbind, topk): it holds whatever placement its
    # producer's outputs have, and its consumers read it so.
    rank = len(node.output.shape)
    return _follow(node, n, {d: d for d in range(rank)})


def _moe_experts(node: OpNode, n: int) -> list[Strategy]:
    """A MoE layer's routed experts (`mplan.kernels.moe`): whole, or every expert split by its FFN
    dim (Megatron's expert tensor parallelism): tokens, routing and gate whole on every rank, the
    up/gate weights by rows and the down weight by columns, so each rank adds its FFN slice's
    share (output P; the token and gate gradients are partial too). Weights stored as one
    [gate; up] tensor (Hugging Face's gate_up_proj) would need a strided split: whole. Splitting
    the tokens instead would apply a capacity factor to fewer tokens than the model does: never."""
    strategies = [replicated(node)]
    w_out = node.input_metas[4]
    separate_up = len(node.inputs) > 5
    gated = bool(node.args[7]) if len(node.args) > 7 else True
    if (separate_up or not gated) and _divisible(w_out.shape[2], n):
        weights = (Shard(1), Shard(2)) + ((Shard(1),) if separate_up else ())
        strategies.append(Strategy(name="ffn", inputs=(R, R, R) + weights, output=P,
                                   input_grads=(P, R, P) + weights, split=True, lowering="experts"))
    return strategies


def _assertion(node: OpNode, n: int) -> list[Strategy]:
    """An assertion about the captured tensors (`_ASSERTIONS`): one strategy per placement its
    input may arrive in (R, P, S(d) on every divisible dim), all lowered "dropped".

    The passes drop an assertion without reading its input (`insert_collectives`, rule "dropped"),
    so no copy is ever made for it: whatever placement the producer leaves is read as it is. With
    the replicated strategy alone the ILP priced a gather (S(d) -> R) into every sharded value an
    assertion reads, which no rank runs; Hugging Face blocks assert after every upcast, so their
    sharded layouts were overpriced (and the fold of `ilp_followers` blocked) wherever sharding
    crossed one. Offering each placement lets the ILP price the truth: the strategy that reads its
    producer's layout costs nothing, and the Plan records it so. Why strategies and not an ILP
    that skips assertion readers: the Plan stores a strategy per node and `check_sharding` checks
    every edge, so the strategy should say what the rank does (nothing, on the value as it is).
    A parameter (its storage is one placement, voted by its readers: `ir.sharding.parameter_layouts`)
    or an assertion on several tensors keeps the replicated strategy alone."""
    if len(node.inputs) != 1 or len(node.input_metas) != 1 or node.params:  # a symbolic size has no meta
        return [replicated(node)]
    shape = node.input_metas[0].shape
    return [replicated(node)] + [
        Strategy(name="as_arrives", inputs=(p,), output=R, input_grads=(grad_placement(p),), split=False,
                 lowering="dropped")
        for p in (R, P, *(Shard(d) for d, size in enumerate(shape) if _divisible(size, n)))]


_ASSERTIONS = frozenset({"_assert_tensor_metadata", "_assert_scalar", "_assert_async",
                         "sym_constrain_range_for_size"})
"""Assertions about the captured (global, possibly meta) tensors: not true of local shards."""
_SELECTS = frozenset({"masked_fill", "where"})  # data movement that maps elements one to one
_ELEMENTWISE = ("add", "sub", "rsub", "mul", "div", "neg", "gelu", "silu", "relu", "sigmoid", "tanh",
                "exp", "rsqrt", "sqrt", "pow", "log", "sin", "cos", "reciprocal", "abs", "clamp")

_GEMM = frozenset({"column", "row"})
REGISTRY: dict[str, OpEntry] = {
    "linear": OpEntry(rule=_linear, megatron=_GEMM),
    **{p: OpEntry(rule=_matmul, megatron=None) for p in ("matmul", "mm", "bmm")},
    "einsum": OpEntry(rule=_einsum, megatron=None),
    "scaled_dot_product_attention": OpEntry(rule=_sdpa, megatron=frozenset({"heads", "heads_kv_replicated"})),
    "embedding": OpEntry(rule=_embedding, megatron=frozenset({"vocab"})),
    "cross_entropy_loss": OpEntry(rule=_cross_entropy, megatron=frozenset({"vocab"})),
    "layer_norm": OpEntry(rule=_norm), "rms_norm": OpEntry(rule=_norm),
    **{p: OpEntry(rule=_softmax) for p in ("softmax", "_softmax", "log_softmax", "_log_softmax")},
    "cat": OpEntry(rule=_cat), "stack": OpEntry(rule=_stack),
    "sum": OpEntry(rule=_reduction), "mean": OpEntry(rule=_reduction),
    "getitem": OpEntry(rule=_getitem),
    "moe_experts": OpEntry(rule=_moe_experts, megatron=frozenset({"ffn"})),
    **{p: OpEntry(rule=_assertion) for p in _ASSERTIONS},
    **{p: OpEntry(rule=_elementwise) for p in (*_ELEMENTWISE, *_SELECTS)},
    **{p: OpEntry(rule=_view) for p in (*_CUT_DIM, *_RESHAPES, *_SAME_SHAPE, "transpose", "t", "permute",
                                        "expand")},
}


def strategies_for(node: OpNode, n: int) -> list[Strategy]:
    """Every strategy of `node` on an axis of size n; replicated first. n == 1: replicated only."""
    entry = REGISTRY.get(op_packet(node.op))
    if n == 1 or entry is None or not node.known or _tensor_keyword(node) or \
            not (node.outputs or op_packet(node.op) in _ASSERTIONS):  # an assertion has none: `_assertion`
        return [replicated(node)]
    # a rule that read only the tensor inputs gives no placement to a symbolic size among them
    # (a division by the token count): such strategies cannot be lowered
    return _dedupe([replicated(node)] + [s for s in entry.rule(node, n) if len(s.inputs) == len(node.inputs)])


def _tensor_keyword(node: OpNode) -> bool:
    """A tensor passed by keyword has no placement slot (`OpNode.inputs` lists positional ones):
    such an op runs whole."""
    return any(isinstance(v, str) and v.startswith("%") for _, v in node.kwargs)


def _dedupe(strategies: list[Strategy]) -> list[Strategy]:
    seen: dict[tuple[object, ...], Strategy] = {}
    for s in strategies:
        seen.setdefault((s.inputs, s.output, s.input_grads), s)
    return list(seen.values())


def megatron_style(node: OpNode, strategy: Strategy) -> bool:
    """The hand-written Megatron plan as a filter: an op's split strategies limited to those
    its registry entry names (weights and attention by columns, rows, heads or vocabulary, never
    by batch or sequence on the TP axis: that is DP's job there)."""
    entry = REGISTRY.get(op_packet(node.op))
    if not strategy.split or entry is None or entry.megatron is None:
        return True
    return strategy.name in entry.megatron


def megatron_required(n: int, stream: tuple[int, ...] | None = None) -> Callable[[OpNode, Strategy], bool]:
    """`megatron_style`, plus two rules a cost model alone would not follow on small shapes:
    weights and attention may not stay replicated when a Megatron split exists (a plan that
    names tp>1 asks for tensor parallelism), and, with sequence parallelism (`stream` = the
    residual stream's shape), no other op of that shape stays whole or splits the batch: the
    residual adds, norms and casts then run on sequence shards, S(1), as in Megatron-LM's
    sequence parallelism (ops of that shape inside a TP region keep their column split)."""
    def allow(node: OpNode, strategy: Strategy) -> bool:
        if not megatron_style(node, strategy):
            return False
        if node.kind in ("matmul", "attention", "embedding", "loss"):
            return strategy.split or not any(s.split and megatron_style(node, s) for s in strategies_for(node, n))
        if stream is not None and node.outputs and node.output.shape == stream:
            return strategy.output not in (R, Shard(0))
        return True
    return allow


def shard_bytes(meta: TensorMeta, placement: Placement, n: int) -> int:
    """Bytes one rank holds of a tensor with this placement."""
    return meta.nbytes // n if isinstance(placement, Shard) else meta.nbytes
