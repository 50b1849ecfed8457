"""What capture knows about each ATen op: its kind, forward FLOPs and what backward keeps.

One `OpRule` per op packet (`aten.linear`, any overload). FLOPs follow Megatron's convention:
a multiply-add is 2 FLOPs, attention counts the full (non-causal) score matrix, and elementwise
work counts one FLOP per output element (a few for transcendental ops). `saves` lists what
autograd keeps for backward: argument positions and/or "out"; `converts` the saved arguments the
kernel keeps as a copy of its own in its first input's dtype when theirs differs; `extra_saved`
the small side outputs it keeps (statistics in the kernel's accumulation dtype). An op with no
rule is marked unknown: capture still records it, saves all its tensor inputs (an upper bound
for memory), and the planner replicates it rather than guess a sharding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from mplan.ir.graph import Graph, TensorMeta

FlopFn = Callable[[Sequence[TensorMeta], Sequence[TensorMeta]], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpRule:
    kind: str
    flops: FlopFn
    saves: tuple[int | str, ...] = ()  # argument positions and/or "out"
    cross: bool = False  # a product: each saved operand is needed only for the others' gradients
    # saved arguments kept as the kernel's own copy in input 0's dtype when theirs differs: a new
    # tensor per call, not the producer's storage (SDPA turns a boolean mask into an additive one)
    converts: tuple[int, ...] = ()
    # bytes of small side outputs kept for backward, from (inputs, outputs)
    extra_saved: Callable[[Sequence[TensorMeta], Sequence[TensorMeta]], int] | None = None


def _zero(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    return 0


def _per_out(k: int) -> FlopFn:
    return lambda ins, outs: k * outs[0].numel


def _per_in(k: int) -> FlopFn:
    return lambda ins, outs: k * ins[0].numel


def _linear(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # x [..., k] @ w.T [k, n]: 2*m*n*k; the bias add is not counted (Megatron does not).
    return 2 * outs[0].numel * ins[0].shape[-1]


def _matmul(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # Batched or not: every output element is a length-k dot product.
    return 2 * outs[0].numel * ins[0].shape[-1]


def _addmm(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    return 2 * outs[0].numel * ins[1].shape[-1]


def einsum_flops(equation: str, ins: Sequence[TensorMeta]) -> int:
    """2 x the product of every letter's size: each output element is a sum over the contracted
    letters (0 for an equation with an ellipsis, which this does not read)."""
    lhs = equation.replace(" ", "").partition("->")[0]
    if "." in lhs:
        return 0
    sizes: dict[str, int] = {}
    for spec, meta in zip(lhs.split(","), ins):
        sizes.update(zip(spec, meta.shape))
    return 2 * math.prod(sizes.values())


def _sdpa(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # q [b, hq, sq, d], k [b, hk, sk, d], v [b, hk, sk, dv]: QK^T and PV over all sq x sk
    # pairs (the causal half is still counted, as Megatron's 72BsLh^2(1+s/6h) does).
    q, k, v = ins[0], ins[1], ins[2]
    b, hq, sq, d = q.shape[-4], q.shape[-3], q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    return 2 * b * hq * sq * sk * (d + dv)


def _accumulation_bytes(meta: TensorMeta) -> int:
    """Bytes per element of a kernel's accumulation type on `meta`'s dtype: fp32 for 16- and 32-bit
    floats, fp64 for fp64 (ATen's `acc_type`, on CUDA and CPU alike)."""
    return max(4, meta.nbytes // max(1, meta.numel))


def _sdpa_lse(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # logsumexp [b, h, sq] kept by the flash/efficient kernels in their accumulation type (fp32 for
    # bf16; fp64 under fp64 on the CPU: counting fp32 there missed half of it)
    q = ins[0]
    return math.prod(q.shape[:-1]) * _accumulation_bytes(q)


def _norm_stats(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    x = ins[0]  # mean and rstd per normalized row, in the accumulation type (as the logsumexp above)
    return math.prod(x.shape[:-1]) * _accumulation_bytes(x) * 2


def _cross_entropy(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    return 5 * ins[0].numel  # max, sub, exp, sum, log per logit


def _moe_experts(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # x [T, h], index [T, k], gate, w_in [E, G*F, h], w_out [E, h, F], (w_up [E, F, h]): each of
    # the T*k routed copies runs its expert's GEMMs (dropless; capacity can only drop some)
    x, index, w_in = ins[0], ins[1], ins[3]
    width = w_in.shape[1] + (ins[5].shape[1] if len(ins) > 5 else 0) + ins[4].shape[2]
    return 2 * x.shape[0] * index.shape[1] * x.shape[1] * width


def _moe_saved(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    # the reference keeps the routed rows [T*k, h], the expert GEMMs' inputs and products
    # [T*k, G*F (+F)] and the activation's output [T*k, F], in x's dtype
    x, index, w_in = ins[0], ins[1], ins[3]
    ffn = ins[4].shape[2]
    width = x.shape[1] + w_in.shape[1] + (ins[5].shape[1] if len(ins) > 5 else 0) + 2 * ffn
    return x.shape[0] * index.shape[1] * width * (x.nbytes // max(1, x.numel))


def _topk(ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> int:
    return ins[0].numel * max(1, int(math.log2(max(2, ins[0].shape[-1]))))


LOSS_CASTS = ("aten._to_copy.default", "aten.to.dtype", "aten.clone.default")
"""Ops between a training graph's loss and its output that change no value's meaning (casts and
copies): what context parallelism looks through to find the loss, in the pass that splits it
(`passes/split_context.py`) and in the planner that asks whether it can (`planner/context_pricing.py`)."""

_VIEW_OPS = (
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unflatten", "flatten",
    "alias", "as_strided", "contiguous", "clone", "detach", "unbind", "narrow", "view_as",
    "expand_as", "movedim", "lift_fresh_copy", "_assert_tensor_metadata",
)
# Pure data movement: bytes, no arithmetic, nothing kept for backward.
_MOVE_OPS = (
    "cat", "stack", "_to_copy", "to", "type_as", "copy", "new_zeros", "new_ones", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_empty", "fill", "zeros", "ones", "full", "arange",
    "empty", "scalar_tensor", "repeat", "repeat_interleave", "tril", "triu", "masked_fill", "where",
    "pad", "constant_pad_nd", "roll", "flip", "index_select", "gather", "scatter", "scatter_add",
    "index_add", "index_put", "index", "one_hot", "embedding_dense_backward", "sym_size",
    "_local_scalar_dense", "item", "new_full", "lt", "gt", "le", "ge", "eq", "ne", "logical_not",
    "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "isinf", "isnan",
    "argmax", "argmin", "sort", "argsort", "cumsum", "floor_divide", "remainder", "ceil", "floor",
    "__and__", "__or__", "__invert__", "diff", "bincount", "nonzero", "unique", "searchsorted",
)

RULES: dict[str, OpRule] = {
    # GEMMs: backward needs both operands (the weight is a parameter, not an activation).
    "linear": OpRule(kind="matmul", flops=_linear, saves=(0, 1), cross=True),
    "matmul": OpRule(kind="matmul", flops=_matmul, saves=(0, 1), cross=True),
    "mm": OpRule(kind="matmul", flops=_matmul, saves=(0, 1), cross=True),
    "bmm": OpRule(kind="matmul", flops=_matmul, saves=(0, 1), cross=True),
    "baddbmm": OpRule(kind="matmul", flops=_addmm, saves=(1, 2), cross=True),
    "addmm": OpRule(kind="matmul", flops=_addmm, saves=(1, 2), cross=True),
    # torch.einsum stays whole in torch.export's graph (its equation is in the node's arguments).
    "einsum": OpRule(kind="matmul", flops=_zero, saves=(1,), cross=True),  # FLOPs from the equation: op_cost
    # A MoE layer's routed experts as one op (mplan.kernels.moe: capture makes every experts
    # module one): it keeps its inputs and the routed copies' intermediates.
    "moe_experts": OpRule(kind="matmul", flops=_moe_experts, saves=(0, 1, 2), extra_saved=_moe_saved),
    # Grouped GEMMs of MoE layers (Hugging Face's experts): tokens x hidden against E weights.
    "_grouped_mm": OpRule(kind="matmul", flops=_matmul, saves=(0, 1), cross=True),
    "grouped_mm_fallback": OpRule(kind="matmul", flops=_matmul, saves=(0, 1), cross=True),
    # Fused attention keeps q, k, v, its output and the row logsumexp (no s x s matrix), and its
    # mask when given one: a boolean mask (Hugging Face's, materialized by the export) becomes an
    # additive mask in q's dtype inside the op, a new [b, 1, sq, sk] tensor every call keeps.
    "scaled_dot_product_attention": OpRule(
        kind="attention", flops=_sdpa, saves=(0, 1, 2, 3, "out"), converts=(3,), extra_saved=_sdpa_lse),
    # Embedding lookup: backward scatters into the table by index, so only the ids are kept.
    "embedding": OpRule(kind="embedding", flops=_zero, saves=(1,)),
    # LayerNorm / RMSNorm kernels: input plus per-row statistics.
    "layer_norm": OpRule(kind="norm", flops=_per_in(8), saves=(0,), extra_saved=_norm_stats),
    "native_layer_norm": OpRule(kind="norm", flops=_per_in(8), saves=(0,), extra_saved=_norm_stats),
    "rms_norm": OpRule(kind="norm", flops=_per_in(4), saves=(0,), extra_saved=_norm_stats),
    "_fused_rms_norm": OpRule(kind="norm", flops=_per_in(4), saves=(0,), extra_saved=_norm_stats),
    # Loss over logits: backward recomputes softmax from the kept logits.
    "cross_entropy_loss": OpRule(kind="loss", flops=_cross_entropy, saves=(0, 1)),
    "nll_loss": OpRule(kind="loss", flops=_per_in(1), saves=(1,)),
    "nll_loss_nd": OpRule(kind="loss", flops=_per_in(1), saves=(1,)),
    # Softmax family: backward needs only the output.
    "softmax": OpRule(kind="elementwise", flops=_per_out(5), saves=("out",)),
    "_softmax": OpRule(kind="elementwise", flops=_per_out(5), saves=("out",)),
    "log_softmax": OpRule(kind="elementwise", flops=_per_out(5), saves=("out",)),
    "_log_softmax": OpRule(kind="elementwise", flops=_per_out(5), saves=("out",)),
    # Activations whose derivative needs the input.
    "gelu": OpRule(kind="elementwise", flops=_per_out(8), saves=(0,)),
    "silu": OpRule(kind="elementwise", flops=_per_out(4), saves=(0,)),
    # Activations whose derivative is a function of the output.
    "relu": OpRule(kind="elementwise", flops=_per_out(1), saves=("out",)),
    "sigmoid": OpRule(kind="elementwise", flops=_per_out(4), saves=("out",)),
    "tanh": OpRule(kind="elementwise", flops=_per_out(4), saves=("out",)),
    "exp": OpRule(kind="elementwise", flops=_per_out(2), saves=("out",)),
    "rsqrt": OpRule(kind="elementwise", flops=_per_out(2), saves=("out",)),
    "sqrt": OpRule(kind="elementwise", flops=_per_out(2), saves=("out",)),
    # Derivative needs the input.
    "pow": OpRule(kind="elementwise", flops=_per_out(1), saves=(0,)),
    "log": OpRule(kind="elementwise", flops=_per_out(2), saves=(0,)),
    "sin": OpRule(kind="elementwise", flops=_per_out(4), saves=(0,)),
    "cos": OpRule(kind="elementwise", flops=_per_out(4), saves=(0,)),
    "reciprocal": OpRule(kind="elementwise", flops=_per_out(1), saves=("out",)),
    # Products: each operand's gradient needs the other one.
    "mul": OpRule(kind="elementwise", flops=_per_out(1), saves=(0, 1), cross=True),
    "div": OpRule(kind="elementwise", flops=_per_out(1), saves=(0, 1), cross=True),
    # Linear elementwise ops: gradients pass through, nothing kept.
    "add": OpRule(kind="elementwise", flops=_per_out(1)),
    "sub": OpRule(kind="elementwise", flops=_per_out(1)),
    "rsub": OpRule(kind="elementwise", flops=_per_out(1)),
    "neg": OpRule(kind="elementwise", flops=_per_out(1)),
    "abs": OpRule(kind="elementwise", flops=_per_out(1), saves=(0,)),
    "clamp": OpRule(kind="elementwise", flops=_per_out(1), saves=(0,)),
    # Dropout keeps its mask (a bool per element; counted as the output's size, an upper bound).
    "dropout": OpRule(kind="elementwise", flops=_per_out(1), saves=("out",)),
    # Reductions: backward only needs shapes (max/min keep the winning indices).
    "sum": OpRule(kind="reduction", flops=_per_in(1)),
    "mean": OpRule(kind="reduction", flops=_per_in(1)),
    "amax": OpRule(kind="reduction", flops=_per_in(1), saves=(0, "out")),
    "max": OpRule(kind="reduction", flops=_per_in(1), saves=("out",)),
    "topk": OpRule(kind="reduction", flops=_topk, saves=("out",)),
    "histc": OpRule(kind="reduction", flops=_per_in(1)),
    # Mixture-of-experts dispatch helpers are pure data movement (listed in _MOVE_OPS).
}
RULES.update({op: OpRule(kind="view", flops=_zero) for op in _VIEW_OPS})
RULES.update({op: OpRule(kind="move", flops=_zero) for op in _MOVE_OPS})
# Ops whose backward keeps the index argument (a small integer tensor) for the scatter.
for _op, _idx in (("gather", 2), ("index_select", 2), ("index", 1), ("scatter_add", 2),
                  ("index_add", 2), ("scatter", 2)):
    RULES[_op] = OpRule(kind="move", flops=_zero, saves=(_idx,))


def op_packet(target: object) -> str:
    """`aten.linear.default` (an op or its name) -> `linear`; also strips the in-place suffix (`add_` -> `add`)."""
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    packet = name.removeprefix("aten.").removeprefix("mplan.").split(".")[0]
    return packet[:-1] if packet.endswith("_") and not packet.startswith("_") else packet


def rule_for(target: object) -> OpRule | None:
    return RULES.get(op_packet(target))


def persistent_inputs(graph: Graph) -> frozenset[str]:
    """The graph inputs that live for the whole run (buffers, lifted constants: RoPE tables), by IR
    name: what an op keeps of them for backward is a view that allocates nothing per micro-batch.
    Read from the export's signature, whose user inputs (token ids, labels) are the rest; a graph
    without its program counts every input as an activation."""
    if graph.program is None:
        return frozenset()
    return frozenset(graph.graph_inputs.keys() - set(graph.program.graph_signature.user_inputs))


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    flops: int
    bytes_read: int  # every tensor input read once (views move nothing)
    bytes_written: int
    saved_extra_bytes: int


def op_cost(rule: OpRule | None, kind: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta],
            args: Sequence[object] = ()) -> OpCost:
    """FLOPs, bytes moved and side tensors kept of one op on these shapes (capture and rebatch);
    `args` the op's arguments (an einsum's equation)."""
    flops = int(rule.flops(inputs, outputs)) if rule and outputs and inputs else 0
    if rule is RULES["einsum"] and args and isinstance(args[0], str):
        flops = einsum_flops(args[0], inputs)
    extra = int(rule.extra_saved(inputs, outputs)) if rule and rule.extra_saved and inputs else 0
    moves = kind not in ("view", "getitem")
    return OpCost(flops=flops, bytes_read=sum(m.nbytes for m in inputs) if moves else 0,
                  bytes_written=sum(m.nbytes for m in outputs) if moves else 0, saved_extra_bytes=extra)
