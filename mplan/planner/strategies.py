"""Sharding strategies of each op on one mesh axis, derived from compact descriptions.

A `Strategy` says, for one op on an axis of size n, which placement each tensor input must have,
which placement the output then has, which placements the input gradients come out with in
backward, and whether the op's work is split n ways. Most ops are described by an einsum-like
string (`linear`: "...k,nk,n->...n"): sharding one index letter shards every operand that carries
it; a contracted letter makes the output `P`. Elementwise ops follow broadcasting, views map
dimensions through the reshape, and a few ops (attention, embedding, cross-entropy) have rules
of their own. An op with no rule gets only the replicated strategy: never a guess.

Input-gradient placements follow DTensor's algebra: an operand that carries the sharded letter
gets an `S` gradient; one that does not (it was replicated while the op was split) gets a `P`
gradient that must be reduced; a replicated op gives `R` gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from mplan.ir.graph import OpNode, TensorMeta
from mplan.ir.op_table import op_packet
from mplan.planner.placement import P, Placement, R, Shard


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    name: str  # short label for explain: "replicate", "shard(k)", "heads", "vocab", ...
    inputs: tuple[Placement, ...]  # one per OpNode.inputs entry
    output: Placement
    input_grads: tuple[Placement, ...]  # placement of each input's gradient in backward
    split: bool  # the op's work (FLOPs and bytes) is divided by the axis size
    comm: tuple[tuple[str, int], ...] = ()  # collectives the op issues itself: (kind, bytes), forward

    def __str__(self) -> str:
        ins = ",".join(map(str, self.inputs))
        return f"{self.name}[{ins}->{self.output}]"


def replicated(node: OpNode) -> Strategy:
    k = len(node.inputs)
    return Strategy(name="replicate", inputs=(R,) * k, output=R, input_grads=(R,) * k, split=False)


def _divisible(size: int, n: int) -> bool:
    return size % n == 0 and size >= n


_LETTERS = "abcdefghijlmopqrtuvwxyz"  # "k", "n", "s" left free for specs


def einsum_strategies(operands: Sequence[str], out: str, metas: Sequence[TensorMeta],
                      out_meta: TensorMeta, n: int, *, name: Callable[[str], str] | None = None,
                      no_shard: str = "") -> list[Strategy]:
    """One strategy per shardable letter of `operands -> out`, plus the replicated one.

    Operands given as "" are not tensors (ignored). A letter can be sharded when every dim that
    carries it is divisible by n and it is not in `no_shard`.
    """
    k = len(operands)
    strategies = [Strategy(name="replicate", inputs=(R,) * k, output=R, input_grads=(R,) * k, split=False)]
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
                                   output=output, input_grads=grads, split=True))
    return strategies


def _batch_letters(rank: int) -> str:
    return _LETTERS[:rank]


def _linear(node: OpNode, n: int) -> list[Strategy]:
    x = node.input_metas[0]
    b = _batch_letters(len(x.shape) - 1)
    operands = [b + "k", "nk"] + (["n"] if len(node.inputs) > 2 else [])
    names = {"k": "row", "n": "column"}
    return einsum_strategies(operands, b + "n", node.input_metas, node.output, n,
                             name=lambda c: names.get(c, "batch"))


def _matmul(node: OpNode, n: int) -> list[Strategy]:
    a, b = node.input_metas[0], node.input_metas[1]
    if len(a.shape) != len(b.shape) or len(a.shape) < 2 or a.shape[:-2] != b.shape[:-2]:
        return [replicated(node)]  # broadcasting batch dims: not worth a rule yet
    batch = _batch_letters(len(a.shape) - 2)
    return einsum_strategies([batch + "ik", batch + "kn"], batch + "in", node.input_metas,
                             node.output, n, name=lambda c: "batch" if c in batch else f"shard({c})")


def _sdpa(node: OpNode, n: int) -> list[Strategy]:
    # q [b, hq, s, d], k/v [b, hk, s, d]; heads and batch split cleanly. Splitting query rows would
    # break the causal mask's offsets, and the head dim / key axis feed a softmax: never split.
    q, k = node.input_metas[0], node.input_metas[1]
    if len(node.inputs) != 3:
        return [replicated(node)]  # an explicit mask tensor: kept whole
    strategies = [replicated(node)]
    if _divisible(q.shape[0], n):
        strategies.append(Strategy(name="batch", inputs=(Shard(0),) * 3, output=Shard(0),
                                   input_grads=(Shard(0),) * 3, split=True))
    if _divisible(q.shape[1], n) and _divisible(k.shape[1], n):
        strategies.append(Strategy(name="heads", inputs=(Shard(1),) * 3, output=Shard(1),
                                   input_grads=(Shard(1),) * 3, split=True))
    strategies.extend(kv_replicated_heads(q, k, n))
    return strategies


def kv_replicated_heads(q: TensorMeta, k: TensorMeta, n: int) -> list[Strategy]:
    """Grouped-query attention with fewer (or indivisible) key/value heads than ranks: query
    heads split n ways, keys and values whole on every rank, each rank reading the kv heads its
    query heads use (Megatron replicates kv heads when kv_heads < tp). The k/v gradients are
    partial: each rank's covers only the heads it read."""
    hq, hk = q.shape[1], k.shape[1]
    if not _divisible(hq, n) or _divisible(hk, n) or hq % hk:
        return []
    local, group = hq // n, hq // hk
    if group % local and local % group:
        return []  # a rank's query heads would cover a fraction of a kv group unevenly
    return [Strategy(name="heads_kv_replicated", inputs=(Shard(1), R, R), output=Shard(1),
                     input_grads=(Shard(1), P, P), split=True)]


def _embedding(node: OpNode, n: int) -> list[Strategy]:
    ids = node.input_metas[1]
    b = _batch_letters(len(ids.shape))
    # Vocabulary-parallel (Megatron): each rank looks up the ids it owns, zeros elsewhere, so the
    # output is a partial sum; the weight gradient stays sharded by vocabulary.
    return einsum_strategies(["vh", b], b + "h", node.input_metas, node.output, n,
                             name=lambda c: {"v": "vocab", "h": "hidden"}.get(c, "batch"))


def _cross_entropy(node: OpNode, n: int) -> list[Strategy]:
    logits = node.input_metas[0]
    if len(logits.shape) != 2 or len(node.inputs) != 2:
        return [replicated(node)]
    num_rows, vocab = logits.shape
    strategies = [replicated(node)]
    if _divisible(num_rows, n):
        strategies.append(Strategy(name="batch", inputs=(Shard(0), Shard(0)), output=P,
                                   input_grads=(Shard(0), Shard(0)), split=True))
    if _divisible(vocab, n):
        # Vocabulary-parallel cross-entropy: all-reduce the row max, the sum of exponentials and
        # the target logit ([rows] fp32 each); no rank ever holds the full logits.
        row_bytes = num_rows * 4
        strategies.append(Strategy(name="vocab", inputs=(Shard(1), R), output=R,
                                   input_grads=(Shard(1), R), split=True,
                                   comm=(("all_reduce", row_bytes),) * 3))
    return strategies


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


def _follow(node: OpNode, n: int, dim_map: dict[int, int], *, partial: bool = True) -> list[Strategy]:
    """Strategies of a single-input data-movement op given how its dims map to the output's."""
    k = len(node.inputs)
    strategies = [replicated(node)]
    src = node.input_metas[0].shape
    for d_in, d_out in dim_map.items():
        if _divisible(src[d_in], n) and _divisible(node.output.shape[d_out], n):
            rest = (R,) * (k - 1)
            strategies.append(Strategy(name=f"shard({d_in})", inputs=(Shard(d_in),) + rest,
                                       output=Shard(d_out), input_grads=(Shard(d_in),) + rest, split=True))
    if partial and k == 1:
        strategies.append(Strategy(name="partial", inputs=(P,), output=P, input_grads=(R,), split=False))
    return strategies


def _dim(value: object, rank: int) -> int:
    return int(value) % rank if rank else 0  # type: ignore[call-overload]


def _view(node: OpNode, n: int) -> list[Strategy]:
    packet = op_packet(node.op)
    src = node.input_metas[0].shape if node.input_metas else ()
    rank = len(src)
    if not node.inputs or not node.outputs:
        return [replicated(node)]
    if packet in ("transpose",) and len(node.args) >= 3:
        a, b = _dim(node.args[1], rank), _dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
        return _follow(node, n, {perm[o]: o for o in range(rank)})
    if packet == "t":
        return _follow(node, n, {0: 1, 1: 0} if rank == 2 else {0: 0})
    if packet == "permute" and len(node.args) >= 2:
        perm = [_dim(d, rank) for d in node.args[1]]
        return _follow(node, n, {perm[o]: o for o in range(rank)})
    if packet in ("slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind"):
        cut = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
        removed = packet in ("select", "unbind")
        return _follow(node, n, {d: d - (removed and d > cut) for d in range(rank) if d != cut},
                       partial=packet in ("slice", "narrow", "select"))
    if packet == "expand":
        out = node.output.shape
        offset = len(out) - rank
        return _follow(node, n, {d: d + offset for d in range(rank) if src[d] == out[d + offset]})
    if packet in ("_to_copy", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "to",
                  "type_as", "view_as"):
        return _follow(node, n, {d: d for d in range(rank)})
    return _follow(node, n, view_dim_map(src, node.output.shape))


def _cat(node: OpNode, n: int) -> list[Strategy]:
    rank = len(node.output.shape)
    cat_dim = _dim(node.args[1] if len(node.args) > 1 else 0, rank)
    k = len(node.inputs)
    strategies = [replicated(node)]
    for d in range(rank):
        if d != cat_dim and all(_divisible(m.shape[d], n) for m in node.input_metas):
            strategies.append(Strategy(name=f"shard({d})", inputs=(Shard(d),) * k, output=Shard(d),
                                       input_grads=(Shard(d),) * k, split=True))
    return strategies


def _softmax(node: OpNode, n: int) -> list[Strategy]:
    rank = len(node.output.shape)
    dim = _dim(node.args[1] if len(node.args) > 1 else -1, rank)
    return _follow(node, n, {d: d for d in range(rank) if d != dim}, partial=False)


def _reduction(node: OpNode, n: int) -> list[Strategy]:
    packet = op_packet(node.op)
    if packet not in ("sum", "mean") or not node.input_metas:
        return [replicated(node)]
    rank = len(node.input_metas[0].shape)
    dims = node.args[1] if len(node.args) > 1 else None
    keepdim = bool(node.args[2]) if len(node.args) > 2 else dict(node.kwargs).get("keepdim", False)
    if dims is None or dims == ():
        return [replicated(node)]
    reduced = {_dim(d, rank) for d in (dims if isinstance(dims, tuple) else (dims,))}
    mapping = {d: d if keepdim else d - sum(r < d for r in reduced) for d in range(rank) if d not in reduced}
    return _follow(node, n, mapping, partial=packet == "sum")


def _getitem(node: OpNode, n: int) -> list[Strategy]:
    # Multi-output producers only get replicated strategies here, so a getitem follows R.
    return [replicated(node)]


_RULES: dict[str, Callable[[OpNode, int], list[Strategy]]] = {
    "linear": _linear,
    "matmul": _matmul, "mm": _matmul, "bmm": _matmul,
    "scaled_dot_product_attention": _sdpa,
    "embedding": _embedding,
    "cross_entropy_loss": _cross_entropy,
    "layer_norm": _norm, "rms_norm": _norm,
    "softmax": _softmax, "_softmax": _softmax, "log_softmax": _softmax, "_log_softmax": _softmax,
    "cat": _cat,
    "sum": _reduction, "mean": _reduction,
    "getitem": _getitem,
}
# Data movement that maps elements one to one under broadcasting (a causal mask on scores).
_SELECTS = {"masked_fill", "where"}
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "neg", "gelu", "silu", "relu", "sigmoid", "tanh",
                "exp", "rsqrt", "sqrt", "pow", "log", "sin", "cos", "reciprocal", "abs", "clamp"}


def strategies_for(node: OpNode, n: int) -> list[Strategy]:
    """Every strategy of `node` on an axis of size n; replicated first. n == 1: replicated only."""
    if n == 1 or not node.known or not node.outputs:
        return [replicated(node)]
    packet = op_packet(node.op)
    if packet in _RULES:
        found = _RULES[packet](node, n)
    elif packet in _ELEMENTWISE and node.input_metas:
        found = _elementwise(node, n) if node.kind == "elementwise" else [replicated(node)]
    elif packet in _SELECTS and node.input_metas:
        found = _elementwise(node, n)
    elif node.kind == "view":
        found = _view(node, n)
    elif packet in ("_to_copy", "clone", "to", "type_as"):
        found = _view(node, n)
    else:
        found = [replicated(node)]
    return _dedupe(found)


def _dedupe(strategies: list[Strategy]) -> list[Strategy]:
    seen: dict[tuple[object, ...], Strategy] = {}
    for s in strategies:
        seen.setdefault((s.inputs, s.output, s.input_grads), s)
    return list(seen.values())


def shard_bytes(meta: TensorMeta, placement: Placement, n: int) -> int:
    """Bytes one rank holds of a tensor with this placement."""
    return meta.nbytes // n if isinstance(placement, Shard) else meta.nbytes
