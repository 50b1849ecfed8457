"""Autograd-aware resharding of one value between two placements on the tensor-parallel axis.

Input: a rank's local piece of a value under placement `src`, the TP axis (`TensorParallelAxis`:
group, size, this rank's index), the placement `dst` a consumer wants, and the gradient's pair:
`grad_src`, the placement the consumer's backward delivers (its strategy's input-gradient
placement), and `grad_dst`, the one the producer needs (`grad_placement` of its output).
Output: the local piece under `dst`; its backward turns the gradient from `grad_src` into
`grad_dst`. Forward and backward each run the collective `placement.transition` names:

    S(d) -> R      all-gather along d           P -> R      all-reduce (sum)
    P -> S(d)      reduce-scatter along d       R -> S(d)   keep chunk `rank` of d (no traffic)
    S(d) -> S(e)   all-to-all (split e, concatenate d)      x -> x      nothing

Megatron's conjugate pairs (`collectives.py`) are special cases: copy_to_region is
(R -> R, grad P -> R), reduce_from_region (P -> R, grad R -> R), gather_sequence
(S -> R, grad P -> S), reduce_scatter_sequence (P -> S, grad S -> R). Writing the pair as two
independent transitions lets the passes execute whatever mix the sharding ILP picks.

Invariants:
- Chunk i of a sharded dim lives on TP rank i (the convention of `collectives.py`).
- A meta tensor takes a shape-only path with no communication: that is how the local graph is
  verified in one process (`passes.check_local_graph`), with `group=None` and any `size`.
- A real tensor with `size > 1` and no group is an error, never a silent local result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mplan.planner.placement import Placement, Shard, transition
from mplan.runtime.collectives import _all_gather, _all_reduce, _all_to_all, _reduce_scatter
from mplan.runtime.process_groups import ProcessGroup, ProcessGroups


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelAxis:
    """This rank's view of the TP axis: its group, the axis size and its index in the group."""

    group: ProcessGroup | None
    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside an axis of size {self.size}")

    def require_group(self, what: str) -> ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"{what} on a TP axis of {self.size} ranks needs a process group "
                               f"(None is allowed only for shape checks on meta tensors)")
        return self.group


def tp_axis(groups: ProcessGroups) -> TensorParallelAxis:
    """This rank's TP axis from its process groups."""
    return TensorParallelAxis(group=groups.tp, size=groups.mesh.tp, rank=groups.tp_rank)


def apply_transition(x: torch.Tensor, src: Placement, dst: Placement, axis: TensorParallelAxis) -> torch.Tensor:
    """The collective that moves `x` (this rank's piece under `src`) to `dst`; no autograd."""
    if src == dst or axis.size == 1:
        return x
    kind = transition(src, dst)  # None here: R -> S(d), a local slice
    if x.is_meta:
        return _meta_transition(x, src, dst, axis.size)
    if kind == "all_gather":
        return _all_gather(x, axis.require_group(kind), _dim(src))
    if kind == "all_reduce":
        return _all_reduce(x, axis.require_group(kind))
    if kind == "reduce_scatter":
        return _reduce_scatter(x, axis.require_group(kind), _dim(dst))
    if kind == "all_to_all":
        return _all_to_all(x, axis.require_group(kind), _dim(dst), _dim(src))
    # R -> S(d): every rank already holds the whole value; keep its own chunk.
    dim, size = _dim(dst), x.shape[_dim(dst)] // axis.size
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
                grad_dst: Placement, axis: TensorParallelAxis) -> torch.Tensor:
        ctx.grad_src, ctx.grad_dst, ctx.axis = grad_src, grad_dst, axis
        out = apply_transition(x, src, dst, axis)
        # autograd needs a distinct output when the forward moves nothing (copy_to_region's case)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return apply_transition(grad, ctx.grad_src, ctx.grad_dst, ctx.axis), None, None, None, None, None


def redistribute(x: torch.Tensor, src: Placement, dst: Placement, grad_src: Placement,
                 grad_dst: Placement, axis: TensorParallelAxis) -> torch.Tensor:
    """`x` moved from `src` to `dst`; its gradient moved from `grad_src` to `grad_dst` in backward."""
    if axis.size == 1 or (src == dst and (grad_src == grad_dst or not x.requires_grad)):
        return x
    if not x.requires_grad or not torch.is_grad_enabled():
        return apply_transition(x, src, dst, axis)
    return _Redistribute.apply(x, src, dst, grad_src, grad_dst, axis)


def all_reduce_no_grad(x: torch.Tensor, axis: TensorParallelAxis,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a tensor outside autograd (row statistics of the vocabulary-parallel
    loss); meta tensors and single-rank axes pass through."""
    if axis.size > 1 and not x.is_meta:
        dist.all_reduce(x, op=op, group=axis.require_group("all-reduce"))
    return x


__all__ = ["TensorParallelAxis", "all_reduce_no_grad", "apply_transition", "redistribute", "tp_axis"]
