"""Where each local parameter sits relative to the single-device model, as the runtime needs it.

Input: what the rewrite passes decided for each parameter (the plan's `sharding`), reduced to
four facts. Output: which group averages its gradient, and whether this rank's copy counts
in the global gradient norm. Gradient sync (`data_parallel.py`), the sharded optimizer and
gradient clipping read the same record, so they cannot disagree about a parameter.

Gradient convention: each data-parallel rank's loss is the mean over its own micro-batches
and the model's loss is the mean over the `dp` ranks, so every gradient is divided by
`mesh.dp` and then summed over the parameter's replicas:
- dense parameters: replicas are the `dp` group, so this is a plain average;
- expert parameters: an expert's local gradient already sums the tokens that all `ep` ranks
  of its EP group sent it (through the all-to-all backward), so summing over the
  `expert_dp = dp / ep` replicas and dividing by `dp` gives the full-batch mean
  (Megatron-LM scales expert gradients the same way, by expert_dp / dp after averaging).

Invariants: a parameter is never both `tp_sharded` and `tp_reduce`; a parameter without an
entry is `REPLICATED` (same on every rank of its group, full gradient on every TP rank).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mplan.runtime.process_groups import ProcessGroup, ProcessGroups


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamPlacement:
    """How one local parameter relates to its single-device counterpart."""

    tp_sharded: bool = False
    """This rank holds 1/tp of the parameter (column- or row-parallel weight, vocab shard)."""
    tp_reduce: bool = False
    """Replicated over TP, but each TP rank's gradient is a partial sum: a norm weight or bias
    applied to sequence-parallel shards sees only its shard's tokens. Summed over TP first."""
    expert: bool = False
    """An expert's parameter: different on each EP rank, replicated over `expert_dp`."""
    pp_copy: bool = False
    """A copy of a parameter that a stage on an earlier pipeline rank also reads (a tied output
    head): its gradient is summed with the owner's before the step (`stage_copies.py`), and it
    counts in the global norm on the owner only."""

    def __post_init__(self) -> None:
        if self.tp_sharded and self.tp_reduce:
            raise ValueError("a TP-sharded parameter has no TP replicas to reduce over")


REPLICATED = ParamPlacement()

Placements = Mapping[torch.Tensor, ParamPlacement]
"""Keyed by the parameter object itself (tensors hash by identity)."""


def placement_of(param: torch.Tensor, placements: Placements | None) -> ParamPlacement:
    return REPLICATED if placements is None else placements.get(param, REPLICATED)


def replica_group(placement: ParamPlacement, groups: ProcessGroups) -> ProcessGroup | None:
    """The ranks holding identical copies of this parameter, over which gradients are summed."""
    return groups.expert_dp if placement.expert else groups.dp


def shard_group(placement: ParamPlacement, groups: ProcessGroups) -> ProcessGroup | None:
    """The replicas a ZeRO optimizer shards this parameter's state over: its replica group,
    cut to this rank's site when the replicas span sites (dense parameters; the shards are
    then replicated across sites and their gradients summed over them, hierarchical_reduce.py).
    Experts keep their flat expert_dp group."""
    if groups.sites > 1 and not placement.expert:
        return groups.site_dp
    return replica_group(placement, groups)


def counts_in_norm(placement: ParamPlacement, groups: ProcessGroups, *, dp_sharded: bool) -> bool:
    """Whether this rank's gradient elements count in the global norm, so that summing over
    all ranks counts every element of the single-device gradient exactly once.

    `dp_sharded`: the gradient here is this rank's ZeRO partition (distinct on every replica of
    its `shard_group`, so counted on the first site only where that group is a site's) rather
    than a full copy (identical on every replica after the all-reduce).
    """
    tp_owner = placement.tp_sharded or groups.tp_rank == 0
    replica_rank = groups.expert_dp_rank if placement.expert else groups.dp_rank
    if dp_sharded:
        replica_rank = groups.site_rank if groups.sites > 1 and not placement.expert else 0
    return not placement.pp_copy and tp_owner and replica_rank == 0
