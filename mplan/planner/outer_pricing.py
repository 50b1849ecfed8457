"""The outer loop across sites (`runtime/outer_loop.py`) priced per step, amortised over H.

Role: price what an `outer_steps=H` plan's data parallelism moves, beside hierarchical DP's
(`dp_sync.dp_collective`), so the search can weigh it where the user allowed inexact training.
Per step:
- inner: the gradients' all-reduce inside the site (the site's dp_local ranks), every step;
  nothing crosses the long haul;
- outer: once every H steps, the pseudo-gradient (float32, the size of the rank's parameters)
  crosses sites as hierarchical DP's shards do (each site rank's 1/dp_local slice all-reduced
  over the sites, all-gathered inside the site): hierarchical DP's all-reduce of those bytes,
  its seconds and link bytes divided by H.
The slice needs no reduce-scatter (the site's ranks hold the same parameters), so pricing the
outer step as a whole hierarchical all-reduce overstates its site-link part a little; the long
haul, which is what the outer loop saves, is priced as it runs.
Memory: the outer loop keeps an anchor and a momentum buffer, each a copy of the rank's
parameters in their dtype (`OUTER_STATE_COPIES`, `evaluate.py` adds them).
Input: the cluster, the plan's mesh (sites > 1), gradient bytes and parameter bytes per rank,
H. Output: a `SyncPrice` per step.
"""
from __future__ import annotations

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.mesh import MeshShape
from mplan.planner.dp_sync import SyncPrice, dp_collective, link_use

PSEUDO_GRADIENT_BYTES = 4
"""Bytes an element of the pseudo-gradient crosses sites in (float32, whatever the weights' dtype)."""


OUTER_STATE_COPIES = 2
"""Copies of the rank's parameters the outer loop keeps (`runtime/outer_loop.OuterLoop`: the anchor,
and the Nesterov momentum of DiLoCo's outer optimizer)."""


class OuterLoopRefused(ValueError):
    """An outer loop on a plan that cannot run it (one clear line)."""


def outer_loop_sync(cluster: ClusterSpec, grad_bytes: float, param_elements: float, mesh: MeshShape,
                    every: int) -> SyncPrice:
    """Seconds and link bytes per step of an outer loop over `mesh`'s sites taking its outer step
    every `every` steps (module docstring)."""
    if mesh.sites == 1:
        raise OuterLoopRefused("outer_steps needs sites > 1: the outer loop averages over sites")
    if every < 1:
        raise OuterLoopRefused(f"outer_steps must be a positive integer, got {every}")
    site = mesh.site_group_shape("dp", cluster.gpus_per_node)
    outer = dp_collective(cluster, "all_reduce", param_elements * PSEUDO_GRADIENT_BYTES, mesh)
    inner, links = 0.0, outer.links.times(1 / every)
    if site.size > 1 and grad_bytes:
        inner = collective_time(cluster, "all_reduce", grad_bytes, site)
        links = links + link_use(cluster, "all_reduce", grad_bytes, site)
    return SyncPrice(seconds=inner + outer.seconds / every, last_bucket_s=inner, links=links)
