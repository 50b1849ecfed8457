"""A low-communication outer loop across sites (DiLoCo-style), opt-in and inexact.

Role: let each site train on its own for `every` inner steps, its data parallelism reducing
gradients inside the site only (nothing crosses the long-haul link), then take one outer step
over the sites: each rank's pseudo-gradient, the change since the last outer step
(`anchor - theta`), is averaged over the cross-site group in ONE all-reduce (all parameters in a
flat buffer of at least float32; with `site_group`, each rank of a site sends only its 1/n
slice of it, the site's ranks holding the same parameters, and the slices are all-gathered inside the site after, as
hierarchical DP's shards are), and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9, as DiLoCo) moves the
anchor, which every site then loads. The long haul then carries the parameters once per `every`
steps instead of the gradients every step (`planner/outer_pricing.py` prices it).

What equals what: with inner SGD, `every=1` and the outer optimizer plain SGD at lr 1.0 (no
momentum) the anchor after each outer step is the mean of the sites' parameters, which is
synchronous DP's step up to the order of the floating-point sums; with a stateful inner
optimizer (AdamW) it is not (each site's moments see only its own gradients), nor for
`every > 1`: that is the inexactness a user has to allow.

Input: the rank's trainable parameters (its own shards, under TP or ZeRO the same shards at the
same site-local position in every site), `ProcessGroups.cross_site_dp` and optionally
`ProcessGroups.site_dp`. Output: parameters
overwritten in place at each outer step.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True, slots=True)
class OuterOptimizer:
    """The outer step's SGD: `lr`, heavy-ball `momentum` (0: none), Nesterov's look-ahead."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


class OuterLoop:
    """Counts inner steps and, every `every` of them, takes the outer step over `group`."""

    def __init__(self, params: Iterable[torch.nn.Parameter], group: ProcessGroup | None, every: int,
                 outer: OuterOptimizer = OuterOptimizer(), site_group: ProcessGroup | None = None) -> None:
        if every < 1:
            raise ValueError(f"outer loop: outer_steps must be a positive integer, got {every}")
        if group is None:
            raise ValueError("outer loop: outer_steps needs sites > 1 (a cross-site group to average over)")
        self.params = [p for p in params if p.requires_grad]
        self.group, self.every, self.outer, self.site_group = group, every, outer, site_group
        self.anchor = [p.detach().clone() for p in self.params]
        self.velocity = [torch.zeros_like(p) for p in self.anchor] if outer.momentum else None
        self.inner_steps = 0
        self.outer_steps = 0

    def after_inner_step(self) -> bool:
        """Call after each inner optimizer step; True when it took an outer step."""
        self.inner_steps += 1
        if self.inner_steps % self.every:
            return False
        self._outer_step()
        return True

    @torch.no_grad()
    def _outer_step(self) -> None:
        # the differences and their mean over the sites in at least float32, as `planner/outer_pricing.py`
        # prices the long haul: rounded to bf16, a parameter's small change over H steps would be lost
        wire = functools.reduce(torch.promote_types, (a.dtype for a in self.anchor), torch.float32)
        flat = torch.cat([(a.to(wire) - p.detach().to(wire)).reshape(-1) for a, p in zip(self.anchor, self.params)])
        n = 1 if self.site_group is None else dist.get_world_size(self.site_group)
        size = flat.numel()
        flat = torch.nn.functional.pad(flat, (0, -size % n))
        mine = flat.chunk(n)[0 if n == 1 else dist.get_rank(self.site_group)].clone()
        dist.all_reduce(mine, group=self.group)  # the one collective over the long haul
        mine /= dist.get_world_size(self.group)
        if n > 1:
            dist.all_gather_into_tensor(flat, mine, group=self.site_group)
        else:
            flat = mine
        flat = flat[:size]
        start, o = 0, self.outer
        for i, (anchor, param) in enumerate(zip(self.anchor, self.params)):
            delta = flat[start:start + anchor.numel()].view_as(anchor).to(anchor.dtype)
            start += anchor.numel()
            if self.velocity is not None:
                self.velocity[i].mul_(o.momentum).add_(delta)
                delta = delta + o.momentum * self.velocity[i] if o.nesterov else self.velocity[i]
            anchor.sub_(delta, alpha=o.lr)
            param.copy_(anchor)
        self.outer_steps += 1
