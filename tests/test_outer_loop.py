"""The outer loop across sites (`runtime/outer_loop.py`) on 4 gloo ranks, 2 sites of 2, float64.

What is equal and what is not:
- inner SGD, `every=1`, outer plain SGD at lr 1.0: every parameter after each step equals
  synchronous DP's over all 4 ranks to 1e-12 (the anchor is the mean of the sites' parameters,
  which is the synchronous step but for the order of the sums);
- inner AdamW, same outer loop: it differs (each site's moments see only its own gradients);
- `every=4`: the sites' parameters differ between outer steps and agree right after each;
- the cross-site group carries exactly one all-reduce per outer step, nothing else, of this
  rank's half of the parameters (the site's two ranks send a half each).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import rel_err, run_checks
from mplan.runtime.outer_loop import OuterLoop, OuterOptimizer

SITES, PER_SITE, STEPS, ROWS = 2, 2, 8, 4  # ROWS per rank per step
PLAIN = OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False)


@functools.cache
def groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's site group, its cross-site group): sites [0, 1], [2, 3]; pairs [0, 2], [1, 3]."""
    rank, made = dist.get_rank(), {}
    for name, lists in (("site", [[0, 1], [2, 3]]), ("cross", [[0, 2], [1, 3]])):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                made[name] = group
    return made["site"], made["cross"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch (the same tokens under both schedules)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS * SITES * PER_SITE, 6, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    rows = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
    return x[rows], y[rows]


def train(inner: str, group: dist.ProcessGroup | None, loop_every: int | None,
          outer: OuterOptimizer = PLAIN) -> tuple[list[list[torch.Tensor]], OuterLoop | None]:
    """STEPS steps, gradients averaged over `group` (None: the world); with `loop_every`, the outer
    loop over the sites. Each step's parameters."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1) if inner == "sgd" else torch.optim.AdamW(net.parameters(), lr=0.01)
    loop = OuterLoop(net.parameters(), groups()[1], loop_every, outer, site_group=groups()[0]) if loop_every else None
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        for p in net.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        opt.step()
        if loop:
            loop.after_inner_step()
        seen.append([p.detach().clone() for p in net.parameters()])
    return seen, loop


def worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max(rel_err(x, y) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))


def check_every_step_with_sgd_equals_synchronous_dp():
    sync, _ = train("sgd", None, None)
    outer, _ = train("sgd", groups()[0], 1)
    assert worst(sync, outer) < 1e-12, worst(sync, outer)


def check_adamw_inside_differs_from_synchronous_dp():
    sync, _ = train("adamw", None, None)
    outer, _ = train("adamw", groups()[0], 1)
    assert worst(sync, outer) > 1e-6, worst(sync, outer)  # inexact: per-site moments


def check_sites_drift_between_outer_steps_and_agree_after():
    seen, loop = train("sgd", groups()[0], 4, OuterOptimizer())
    assert loop.outer_steps == STEPS // 4
    for step, params in enumerate(seen):
        flat = torch.cat([p.reshape(-1) for p in params])
        other = [torch.empty_like(flat) for _ in range(SITES)]
        dist.all_gather(other, flat, group=groups()[1])
        if (step + 1) % 4:
            assert rel_err(other[0], other[1]) > 1e-6, step
        else:
            assert torch.equal(other[0], other[1]), step


def check_one_all_reduce_over_the_cross_site_group_per_outer_step():
    cross, real, calls = groups()[1], dist.all_reduce, []

    def counting(tensor, *args, group=None, **kwargs):
        calls.append(group)
        if group is cross:
            assert tensor.numel() == -(-sum(p.numel() for p in model().parameters()) // PER_SITE)
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        _, loop = train("sgd", groups()[0], 4, OuterOptimizer())
    finally:
        dist.all_reduce = real
    assert sum(group is cross for group in calls) == loop.outer_steps == STEPS // 4
    assert sum(group is groups()[0] for group in calls) == STEPS * 4  # 4 tensors a step, inside the site


def check_outer_loop_needs_a_cross_site_group():
    with pytest.raises(ValueError, match="needs sites > 1"):
        OuterLoop(model().parameters(), None, 4)


CHECKS = [check_every_step_with_sgd_equals_synchronous_dp, check_adamw_inside_differs_from_synchronous_dp,
          check_sites_drift_between_outer_steps_and_agree_after,
          check_one_all_reduce_over_the_cross_site_group_per_outer_step, check_outer_loop_needs_a_cross_site_group]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(SITES * PER_SITE, CHECKS)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_distributed(outcomes, check):
    outcomes.assert_passed(check)
