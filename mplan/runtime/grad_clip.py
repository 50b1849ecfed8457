"""Global gradient-norm clipping over a sharded, replicated, pipelined model.

Input: a rank's local gradients (full copies after data-parallel sync, or ZeRO partitions),
each parameter's `ParamPlacement`, and `ProcessGroups`. Output: the norm of the single-device
model's gradient, the same on every rank, and the gradients scaled in place exactly as
`torch.nn.utils.clip_grad_norm_` scales them on one device.

How: every gradient element of the single-device model is counted on exactly one rank
(`param_placement.counts_in_norm`): TP shards on every TP rank, TP replicas on TP rank 0, DP
replicas on their first replica, ZeRO partitions on every DP rank, pipeline stages on their
own ranks. One all-reduce of the local sum over the world then yields the global sum; its
root is the norm. For the infinity norm the maximum is taken and double counting is harmless.

Invariants: identical on every rank (the all-reduce result is), and identical (to rounding)
to the single-device result: clip coefficient `max_norm / (norm + 1e-6)` clamped at 1, as
torch computes it (per-tensor norms, then the norm of those). Per-tensor norms are computed in
at least float32 and combined in float64, so bf16 gradients do not lose the norm.

Cost: gradients are grouped by device and dtype and each group is handled by torch's
multi-tensor (`_foreach_*`) kernels, as `torch.nn.utils.clip_grad_norm_(foreach=True)` does:
a few launches per group instead of several per parameter (a 24-layer GPT has ~300).
`step_clipped` folds the clip coefficient into the optimizer's own pass where it can: mplan's
multi-tensor Adam/AdamW (`mplan.kernels.adamw`, where it applies), else torch's fused Adam/AdamW.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from mplan.kernels import adamw
from mplan.runtime.param_placement import Placements, counts_in_norm, placement_of
from mplan.runtime.process_groups import ProcessGroups, group_size

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as in torch.nn.utils.clip_grad_norm_."""


@torch.no_grad()
def global_grad_norm(
    counted_grads: Iterable[torch.Tensor],
    groups: ProcessGroups,
    *,
    norm_type: float = 2.0,
    device: torch.device,
) -> torch.Tensor:
    """The global norm from the gradients this rank counts (collective over the world).

    `device` is where the all-reduce runs (NCCL needs a GPU tensor even on a rank that
    counts no gradient, e.g. TP rank 1 of a model whose parameters are all replicated).
    """
    # float64 accumulator on every rank: the all-reduce needs one dtype everywhere.
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, dtype), grads in _by_device_and_dtype(g for g in counted_grads if g.numel()).items():
        wide = torch.promote_types(dtype, torch.float32)
        norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=wide)).to(torch.float64)
        if math.isinf(norm_type):
            total = torch.maximum(total, norms.max().to(device))
        else:
            total += norms.pow(norm_type).sum().to(device)
    if group_size(groups.world) > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=groups.world)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


@torch.no_grad()
def scale_by_clip_coefficient_(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
) -> None:
    """Scale `grads` so that a global norm of `total_norm` becomes at most `max_norm`."""
    coefficient = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        torch._foreach_mul_(group, coefficient.to(device=device, dtype=dtype))


def folds_clipping(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_clipped` can hand the clip coefficient to `optimizer`'s own kernel: torch's
    fused Adam/AdamW on 16- or 32-bit parameters (its `grad_scale` is fp32, which would round a
    float64 run's coefficient)."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and not hasattr(optimizer, "grad_scale")
            and all(group.get("fused") for group in optimizer.param_groups)
            and all(p.dtype.itemsize <= 4 for group in optimizer.param_groups for p in group["params"]))


def step_unclipped(optimizer: torch.optim.Optimizer, *,
                   copies: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`optimizer.step()`, by mplan's Adam/AdamW kernel where it applies (with `copies`, as in
    `step_clipped`)."""
    if adamw.applies(optimizer):
        adamw.step(optimizer, copies=copies)
    else:
        optimizer.step()


@torch.no_grad()
def step_clipped(optimizer: torch.optim.Optimizer, grads: Iterable[torch.Tensor], max_norm: float,
                 total_norm: torch.Tensor, *, copies: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`optimizer.step()` on `grads` clipped to a global norm of at most `max_norm`.

    For mplan's Adam/AdamW kernel (`adamw.applies`) and torch's fused Adam/AdamW
    (`folds_clipping`) the coefficient's reciprocal is the kernel's `grad_scale`: it divides each
    gradient as it reads it (and stores it so divided, as clipping leaves it), one pass over the
    gradients fewer than scaling them first (~1 ms a step for 1B bf16 parameters on an H200).
    Otherwise the gradients are scaled, then the optimizer steps. `copies` (master -> compute
    copy, `compute_copies.py`) goes to mplan's kernel, which reads those masters' gradients from
    the copies and rewrites the copies."""
    by_mplan = adamw.applies(optimizer)
    if not by_mplan and not folds_clipping(optimizer):
        scale_by_clip_coefficient_(grads, max_norm, total_norm)
        optimizer.step()
        return
    grad_scale = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0).reciprocal().float()
    if by_mplan:
        adamw.step(optimizer, grad_scale, copies=copies)
        return
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """What one multi-tensor kernel can take together, in the given order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    groups: ProcessGroups,
    *,
    placements: Placements | None = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip the full gradients held by `params` (after DP sync) by the global norm; return it.

    Collective over the world: every rank calls it, with its own local parameters.
    """
    params = list(params)
    total = replicated_grad_norm(params, groups, placements=placements, norm_type=norm_type)
    scale_by_clip_coefficient_((p.grad for p in params if p.grad is not None), max_norm, total)
    return total


def replicated_grad_norm(params: list[torch.Tensor], groups: ProcessGroups, *,
                         placements: Placements | None = None, norm_type: float = 2.0,
                         grad_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p.grad) -> torch.Tensor:
    """The global norm of the full gradients held by `params` (after DP sync); collective.
    `grad_of(param)` is its gradient (a compute copy's, where it has one)."""
    return global_grad_norm(
        (grad for p, grad in ((p, grad_of(p)) for p in params)
         if grad is not None and counts_in_norm(placement_of(p, placements), groups, dp_sharded=False)),
        groups,
        norm_type=norm_type,
        device=params[0].device if params else torch.device("cpu"),
    )
