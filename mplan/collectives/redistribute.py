"""Autograd-aware resharding of one value between two placements on one mesh axis.

Input: a rank's local piece of a value under placement `src`, the axis (`AxisGroup`: group,
size, this rank's index), the placement `dst` a consumer wants, and the gradient's pair:
`grad_src`, the placement the consumer's backward delivers (its strategy's input-gradient
placement), and `grad_dst`, the one the producer needs (`grad_placement` of its output).
Output: the local piece under `dst`; its backward turns the gradient from `grad_src` into
`grad_dst`. Forward and backward each run the collective `placement.transition` names:

    S(d) -> R      all-gather along d           P -> R      all-reduce (sum)
    P -> S(d)      reduce-scatter along d       R -> S(d)   keep chunk `rank` of d (no traffic)
    S(d) -> S(e)   all-to-all (split e, concatenate d)      x -> x      nothing

Megatron-LM's conjugate pairs are named cases of one `redistribute` (the passes emit the
general form, so whatever mix the sharding ILP picks runs):

    function                   forward          backward
    copy_to_region             R -> R           P -> R      (enter a TP region)
    reduce_from_region         P -> R           R -> R      (leave it)
    scatter_to_region(d)       R -> S(d)        S(d) -> R
    gather_from_region(d)      S(d) -> R        R -> S(d)
    gather_sequence(d)         S(d) -> R        P -> S(d)   (sequence parallelism)
    reduce_scatter_sequence(d) P -> S(d)        S(d) -> R
    all_to_all(split, concat)  S(concat) -> S(split)        the inverse (expert dispatch)

Invariants:
- Chunk i of a sharded dim lives on rank i of the axis.
- A group of one rank (or `None`: always a group of one in mplan) is the identity, with no
  collective and no autograd node.
- A meta tensor takes a shape-only path with no communication: that is how the local graph is
  verified in one process (`passes.check_local_graph`), with `group=None` and any `size`.
- A real tensor with `size > 1` and no group is an error, never a silent local result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mplan.collectives import flat
from mplan.ir.placement import P, Placement, R, Shard, transition

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisGroup:
    """This rank's view of one mesh axis: its group, the axis size and its index in the group."""

    group: ProcessGroup | None
    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside an axis of size {self.size}")

    @classmethod
    def of(cls, group: ProcessGroup | None) -> AxisGroup:
        """The axis `group` spans (None: a group of one)."""
        return cls(group=None, size=1, rank=0) if group is None else cls(group=group, size=group.size(),
                                                                         rank=group.rank())

    def require_group(self, what: str) -> ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"{what} on an axis of {self.size} ranks needs a process group "
                               f"(None is allowed only for shape checks on meta tensors)")
        return self.group


def apply_transition(x: torch.Tensor, src: Placement, dst: Placement, axis: AxisGroup) -> torch.Tensor:
    """The collective that moves `x` (this rank's piece under `src`) to `dst`; no autograd."""
    if src == dst or axis.size == 1:
        return x
    kind = transition(src, dst)  # None here: R -> S(d), a local slice
    if x.is_meta:
        return _meta_transition(x, src, dst, axis.size)
    if kind == "all_gather":
        return flat.all_gather(x, axis.require_group(kind), _dim(src))
    if kind == "all_reduce":
        return flat.all_reduce(x, axis.require_group(kind))
    if kind == "reduce_scatter":
        return flat.reduce_scatter(x, axis.require_group(kind), _dim(dst))
    if kind == "all_to_all":
        return flat.all_to_all(x, axis.require_group(kind), _dim(dst), _dim(src))
    # R -> S(d): every rank already holds the whole value; keep its own chunk.
    dim = _dim(dst)
    size = flat.chunk_size(x, dim, axis.size, "split")
    return x.narrow(dim, axis.rank * size, size).contiguous()


def _dim(placement: Placement) -> int:
    assert isinstance(placement, Shard)
    return placement.dim


def _meta_transition(x: torch.Tensor, src: Placement, dst: Placement, n: int) -> torch.Tensor:
    shape = list(x.shape)
    if isinstance(src, Shard):
        shape[src.dim] *= n
    if isinstance(dst, Shard):
        if shape[dst.dim] % n:
            raise ValueError(f"cannot shard dim {dst.dim} of size {shape[dst.dim]} over {n} ranks")
        shape[dst.dim] //= n
    return x.new_empty(shape)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Placement, dst: Placement, grad_src: Placement,
                grad_dst: Placement, axis: AxisGroup) -> torch.Tensor:
        ctx.grad_src, ctx.grad_dst, ctx.axis = grad_src, grad_dst, axis
        out = apply_transition(x, src, dst, axis)
        # autograd needs a distinct output when the forward moves nothing (copy_to_region's case)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return apply_transition(grad, ctx.grad_src, ctx.grad_dst, ctx.axis), None, None, None, None, None


def redistribute(x: torch.Tensor, src: Placement, dst: Placement, grad_src: Placement,
                 grad_dst: Placement, axis: AxisGroup) -> torch.Tensor:
    """`x` moved from `src` to `dst`; its gradient moved from `grad_src` to `grad_dst` in backward."""
    if axis.size == 1 or (src == dst and (grad_src == grad_dst or not x.requires_grad)):
        return x
    if not x.requires_grad or not torch.is_grad_enabled():
        return apply_transition(x, src, dst, axis)
    return _Redistribute.apply(x, src, dst, grad_src, grad_dst, axis)


def all_reduce_no_grad(x: torch.Tensor, axis: AxisGroup,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a tensor outside autograd (row statistics of the vocabulary-parallel
    loss); meta tensors and single-rank axes pass through."""
    if axis.size > 1 and not x.is_meta:
        dist.all_reduce(x, op=op, group=axis.require_group("all-reduce"))
    return x


# -- Megatron-LM's pairs (module docstring) -------------------------------------------------------
def _pair(x: torch.Tensor, group: ProcessGroup | None, src: Placement, dst: Placement, grad_src: Placement,
          grad_dst: Placement) -> torch.Tensor:
    axis = AxisGroup.of(group)
    if axis.size == 1:
        return x
    if not torch.is_grad_enabled() or not x.requires_grad:
        return apply_transition(x, src, dst, axis)
    return _Redistribute.apply(x, src, dst, grad_src, grad_dst, axis)


def copy_to_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return _pair(x, group, R, R, P, R)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region holding partial sums: all-reduce forward, identity backward."""
    return _pair(x, group, P, R, R, R)


def scatter_to_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor along `dim`; all-gather backward."""
    d = Shard(dim % x.dim())
    return _pair(x, group, R, d, d, R)


def gather_from_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """All-gather chunks along `dim` into a replicated tensor; keep the chunk backward."""
    d = Shard(dim % x.dim())
    return _pair(x, group, d, R, R, d)


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Enter a TP region from sequence-sharded activations: all-gather, reduce-scatter backward."""
    d = Shard(dim % x.dim())
    return _pair(x, group, d, R, P, d)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Leave a TP region into sequence-sharded activations: reduce-scatter, all-gather backward."""
    d = Shard(dim % x.dim())
    return _pair(x, group, P, d, d, R)


def all_to_all(x: torch.Tensor, group: ProcessGroup | None, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Send chunk i of `x` along `split_dim` to rank i; concatenate what arrives along
    `concat_dim`, in rank order (S(concat) -> S(split)); the inverse exchange backward."""
    split, concat = Shard(split_dim % x.dim()), Shard(concat_dim % x.dim())
    return _pair(x, group, concat, split, split, concat)
