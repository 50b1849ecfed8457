"""`mplan profile`: measure this machine's kernels and links and write a cluster file.

Run on every rank under torchrun (or alone for one device): each rank's device is timed
(`measure_device.profile_device`), rank 0's tables are kept; with more than one rank the links are
timed on every group shape the world can make (`measure_links.profile_links`) and fitted with an
alpha-beta model per collective and link level. The result is the local `ClusterSpec`
(`ClusterSpec.local()`) carrying that profile, written by rank 0 as one validated JSON file that
`ClusterSpec.from_json` loads (and `mplan plan --cluster FILE` plans on).
"""
from __future__ import annotations

import datetime
from typing import Callable

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.profile import ClusterProfile


def profile_cluster(output: str | None, world: object | None, *, quick: bool = False, links: bool = True,
                    progress: Callable[[str], None] | None = None) -> ClusterSpec:
    """Measure, build the cluster spec with its profile, and (rank 0) write it to `output`.
    `world` is the job's default process group (None: this process alone)."""
    import torch
    import torch.distributed as dist

    from mplan.cost_models.measure_device import profile_device
    from mplan.cost_models.measure_links import profile_links

    say = progress or (lambda _msg: None)
    rank = dist.get_rank() if world is not None else 0
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    say(f"rank {rank}: timing kernels on {device}")
    device_profile = profile_device(device, quick=quick, progress=say)
    link_profile = None
    if links and world is not None and dist.get_world_size() > 1:
        say("timing collectives on every group shape")
        link_profile = profile_links(sizes=(1 << 16, 1 << 20, 1 << 24) if quick else None)
    cluster = ClusterSpec.local().with_profile(ClusterProfile(
        note=f"measured by mplan profile on {datetime.date.today().isoformat()}", device=device_profile,
        links=link_profile))
    if output and rank == 0:
        cluster.to_json(output)
    return cluster
