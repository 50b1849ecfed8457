"""Routed experts of a mixture-of-experts layer as one op: `moe_experts`, and its parts.

    moe_experts(x [T, h], index [T, k], gate [T, k], w_in, w_out, w_up=None, *,
                activation="silu", gated=True, capacity_factor=None) -> [T, h]

Each token t goes to the k experts `index[t]` and gets back sum_j gate[t, j] * expert_j(x[t]).
An expert is an MLP on stacked weights (expert e is row e of each):
    w_up given      act(x w_in[e]^T) * (x w_up[e]^T), then w_out    w_in, w_up [E, F, h]
    gated, no w_up  w_in = [gate; up] stacked on dim 1 ([E, 2F, h], Hugging Face's gate_up_proj)
    not gated       act(x w_in[e]^T), then w_out                     w_in [E, F, h]
and w_out is [E, h, F]. `activation` is one of `ACTIVATIONS`.

Capacity (`capacity_factor`, None = dropless): each expert takes at most
C = min(T, ceil(capacity_factor * k * T / E)) of the T*k choices, counted choice-major (every
token's first choice, then every second choice..., each in token order, so first choices win,
as in GShard); the rest are dropped and contribute zero (a token keeps its other choices,
not renormalized). T is the tokens of this call: under data or expert parallelism each rank
applies the rule to its own micro-batch before dispatch, as Megatron-LM does.

Why one op: the experts' eager forms (Hugging Face's loop over the experts `nonzero()` finds,
`torch._grouped_mm`) have data-dependent shapes that torch.export refuses or hides. Capture
(`mplan.ir.moe`) calls this op instead, so the graph holds one node whose output shape is its
input's, the planner counts experts from its weights, and the runtime lowers it (locally, or
dispatched over expert-parallel ranks with all-to-all: `mplan.runtime.expert_parallel`).
Outside export it runs `moe_experts_reference`, differentiable torch ops (on a GPU, dropless:
`mplan.kernels.moe_grouped`'s grouped GEMMs), so mplan's MoE family trains eagerly through the
same code.

The parts, shared with the expert-parallel runtime:
    route(index, E, capacity)      which choices each expert keeps, grouped by expert
    expert_mlp(rows, counts, ...)  the experts on rows grouped by expert (counts rows each)
    combine(rows, route, gate, T)  rows back to their tokens, weighted by the gate
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MoEConfigError(ValueError):
    """Arguments of `moe_experts` that describe no experts layer (shapes, activation, capacity)."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per expert for `num_tokens` tokens: all of them when dropless (None)."""
    if capacity_factor is None:
        return num_tokens
    if not capacity_factor > 0:
        raise MoEConfigError(f"capacity_factor must be > 0 (or None for dropless routing), got {capacity_factor}")
    return min(num_tokens, math.ceil(capacity_factor * top_k * num_tokens / num_experts))


@dataclass(frozen=True, slots=True)
class Route:
    """The kept choices of one call, grouped by expert.

    A choice c is numbered choice-major, c = j * T + t (token t's j-th choice); `order` lists the
    kept ones, expert by expert, choice-major within an expert; `counts[e]` is how many expert e
    keeps (so `order` splits by `counts`)."""

    order: torch.Tensor  # [N] int64 choice ids
    counts: torch.Tensor  # [E] int64
    num_tokens: int
    top_k: int

    @property
    def tokens(self) -> torch.Tensor:
        """The token of each kept choice, in `order`."""
        return self.order % self.num_tokens


def route(index: torch.Tensor, num_experts: int, capacity: int) -> Route:
    """Group the choices of `index` [T, k] by expert, dropping those past `capacity` per expert.
    Dropless (capacity >= T) needs no host synchronization."""
    num_tokens, top_k = index.shape
    expert = index.t().reshape(-1)  # choice-major
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=num_experts)
    if capacity < num_tokens:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=index.device) - starts[expert[order]]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    return Route(order=order, counts=counts, num_tokens=num_tokens, top_k=top_k)


def expert_mlp(rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
               w_up: torch.Tensor | None, *, activation: str, gated: bool) -> torch.Tensor:
    """The experts on `rows` [N, h], grouped by expert (`counts[e]` rows for expert e in turn).

    The reference: one GEMM chain per expert (reads `counts` on the host). Empty experts still
    take part, so every expert's weights get a gradient (zero), as one stacked tensor's would."""
    act = ACTIVATIONS[activation]
    outs = []
    for e, piece in enumerate(rows.split(counts.tolist())):
        hidden = piece @ w_in[e].t()
        if w_up is not None:
            hidden = act(hidden) * (piece @ w_up[e].t())
        elif gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = act(gate) * up
        else:
            hidden = act(hidden)
        outs.append(hidden @ w_out[e].t())
    return torch.cat(outs) if outs else rows.new_zeros(0, w_out.shape[1])


def combine(rows: torch.Tensor, routed: Route, gate: torch.Tensor) -> torch.Tensor:
    """Each token's sum over its choices j (in order) of gate[t, j] * its expert's row (zero for
    a dropped choice): the rows back in token order, [T, h]."""
    num_tokens, top_k = routed.num_tokens, routed.top_k
    placed = rows.new_zeros(num_tokens * top_k, rows.shape[1]).index_copy(0, routed.order, rows)
    weight = gate.t().reshape(top_k, num_tokens, 1).to(rows.dtype)
    return (placed.view(top_k, num_tokens, -1) * weight).sum(0)


def check_arguments(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                    w_out: torch.Tensor, w_up: torch.Tensor | None, activation: str, gated: bool) -> None:
    """One clear error for arguments that describe no experts layer."""
    if activation not in ACTIVATIONS:
        raise MoEConfigError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if x.dim() != 2 or index.dim() != 2 or gate.shape != index.shape or index.shape[0] != x.shape[0]:
        raise MoEConfigError(f"expected x [T, h], index and gate [T, k]; got x {tuple(x.shape)}, index "
                             f"{tuple(index.shape)}, gate {tuple(gate.shape)}")
    experts, width, hidden = w_in.shape
    ffn = width // 2 if gated and w_up is None else width
    if hidden != x.shape[1] or tuple(w_out.shape) != (experts, hidden, ffn) or \
            (w_up is not None and w_up.shape != w_in.shape):
        raise MoEConfigError(f"expert weights do not fit hidden {x.shape[1]}: w_in {tuple(w_in.shape)}, "
                             f"w_out {tuple(w_out.shape)}, w_up {None if w_up is None else tuple(w_up.shape)}")


def moe_experts_reference(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                          w_out: torch.Tensor, w_up: torch.Tensor | None = None, *, activation: str = "silu",
                          gated: bool = True, capacity_factor: float | None = None) -> torch.Tensor:
    """`moe_experts` as differentiable torch ops (route, gather, per-expert GEMMs, combine)."""
    check_arguments(x, index, gate, w_in, w_out, w_up, activation, gated)
    num_tokens, top_k = index.shape
    capacity = expert_capacity(num_tokens, top_k, w_in.shape[0], capacity_factor)
    routed = route(index, w_in.shape[0], capacity)
    rows = expert_mlp(x.index_select(0, routed.tokens), routed.counts, w_in, w_out, w_up,
                      activation=activation, gated=gated)
    return combine(rows, routed, gate).to(x.dtype)


@torch.library.custom_op("mplan::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                    w_out: torch.Tensor, w_up: torch.Tensor | None, activation: str, gated: bool,
                    capacity_factor: float | None) -> torch.Tensor:
    with torch.no_grad():
        return moe_experts_reference(x, index, gate, w_in, w_out, w_up, activation=activation, gated=gated,
                                     capacity_factor=capacity_factor)


@_moe_experts_op.register_fake
def _moe_experts_fake(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                      w_out: torch.Tensor, w_up: torch.Tensor | None, activation: str, gated: bool,
                      capacity_factor: float | None) -> torch.Tensor:
    check_arguments(x, index, gate, w_in, w_out, w_up, activation, gated)
    return x.new_empty(x.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, index, gate, w_in, w_out, w_up, activation, gated, capacity_factor = inputs
    ctx.save_for_backward(x, index, gate, w_in, w_out, w_up)
    ctx.options = {"activation": activation, "gated": gated, "capacity_factor": capacity_factor}


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # The op runs eagerly only where a captured program is replayed as is; mplan's runtime lowers
    # the node to modules (`runtime.expert_parallel`). Backward by recomputing the reference.
    x, index, gate, w_in, w_out, w_up = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None
              for t in (x, gate, w_in, w_out, w_up)]
    with torch.enable_grad():
        out = moe_experts_reference(leaves[0], index, leaves[1], leaves[2], leaves[3], leaves[4], **ctx.options)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    gx, ggate, gin, gout = (next(grads) for _ in range(4))
    gup = next(grads) if w_up is not None else None
    return gx, None, ggate, gin, gout, gup, None, None, None


_moe_experts_op.register_autograd(_backward, setup_context=_setup_context)

MOE_EXPERTS_OP = torch.ops.mplan.moe_experts.default
"""The op's overload as it appears in captured graphs."""


def moe_experts(x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, w_up: torch.Tensor | None = None, *, activation: str = "silu",
                gated: bool = True, capacity_factor: float | None = None) -> torch.Tensor:
    """The routed experts (module docstring): one op node under torch.export, the differentiable
    reference when run eagerly."""
    if torch.compiler.is_exporting():
        return MOE_EXPERTS_OP(x, index, gate, w_in, w_out, w_up, activation, gated, capacity_factor)
    if capacity_factor is None:
        from mplan.kernels import moe_grouped  # imports this module: loaded on first use

        if moe_grouped.grouped_available(x, w_in):
            return moe_grouped.moe_experts_grouped(x, index, gate, w_in, w_out, w_up, activation=activation,
                                                   gated=gated)
    return moe_experts_reference(x, index, gate, w_in, w_out, w_up, activation=activation, gated=gated,
                                 capacity_factor=capacity_factor)
