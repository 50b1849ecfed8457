"""Hierarchical data parallelism across sites (issue 36) equals flat data parallelism and one process.

Across sites, gradients are reduce-scattered inside each site, their shards all-reduced over the
sites and all-gathered inside each site again (`mplan/runtime/hierarchical_reduce.py`); ZeRO
shards over the replicas of a site and replicates the shards across sites. These checks run
it on 8 gloo ranks (2 sites of 4) in float64:

- the optimizers themselves (zero 0, 1, 2) on the MLP of tests/dp_fixtures.py, 5 AdamW steps
  with gradient accumulation, clipping and two parameter groups: against one process (< 1e-9)
  and against the same world without sites (< 1e-12: the same sums in another order of additions);
- the groups: the site is the outermost factor of dp and whole pipelines sit in one site;
- the slow link carries one message per bucket, and `MPLAN_INTER_SITE_DELAY_MS` delays it;
- a whole model (tiny Llama) through `mplan.autoparallel` (test_equivalence.py's comparison: 5
  AdamW steps with active clipping, < 1e-9 on every loss and parameter against one process, and
  against the same plan without sites): zero 0, 1 and 3 over 4 replicas a site; TP (with SP), PP and CP inside
  sites beside 2 replicas a site; TP and PP leaving one replica a site, where only the cross-site
  sum is left of the three phases;
- a zero=1 checkpoint moves between 2 sites and one site exactly.

All checks share one gloo group (tests/distributed.py).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import rel_err, run_checks
from dp_fixtures import (ADAMW, GLOBAL_BATCH, MAX_NORM, SMALL_BUCKET_BYTES, STEPS, TO_REFERENCE, batch, max_rel_err,
                         mlp, param_groups, reference, train_steps)
from test_equivalence import TOL, batches, errors, family, single_device, trained
from mplan.ir.mesh import MeshShape
from mplan.runtime.hierarchical_reduce import INTER_SITE_DELAY_ENV
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.process_groups import ProcessGroups, init_process_groups

WORLD_SIZE = 8
"""2 sites of 4 ranks: room for TP, PP or CP of 2 inside a site beside 2 replicas."""
TO_FLAT = 1e-12
"""Largest relative error against the same world without sites: the same sums in another order."""
MODEL, GLOBAL_BATCH_ROWS = "tiny-llama", 8
"""The whole model every autoparallel check trains (one capture per rank serves all but CP's),
on 8 sequences a step."""


# -- the MLP of dp_fixtures.py, over sites -------------------------------------------------------------
@functools.cache
def _groups(sites: int) -> ProcessGroups:
    return init_process_groups(MeshShape(dp=dist.get_world_size(), sites=sites))


def _train(zero: int, sites: int) -> tuple[list[float], nn.Module, object]:
    """5 steps on this rank's rows in two micro-batches; the global losses, the model, the optimizer."""
    groups = _groups(sites)
    model = mlp()
    optimizer = build_optimizer(param_groups(model), ADAMW, groups, zero=zero, bucket_bytes=SMALL_BUCKET_BYTES)
    return train_steps(model, optimizer, groups, range(STEPS)), model, optimizer


def _check_zero(zero: int) -> dict[str, float]:
    ref_losses, _, ref_model = reference()
    losses, model, _ = _train(zero, sites=2)
    flat_losses, flat_model, _ = _train(zero, sites=1)
    result = {"to_one_process": max_rel_err(losses, model, ref_losses, ref_model),
              "to_flat": max_rel_err(losses, model, flat_losses, flat_model)}
    assert result["to_one_process"] < TO_REFERENCE and result["to_flat"] < TO_FLAT, result
    return result


def check_zero0_two_sites() -> dict[str, float]:
    return _check_zero(0)


def check_zero1_two_sites() -> dict[str, float]:
    return _check_zero(1)


def check_zero2_two_sites() -> dict[str, float]:
    return _check_zero(2)


def check_an_unused_parameter_across_sites() -> dict[str, float]:
    """A layer no loss reads: its bucket never completes in backward, so (zero=2) it and the
    buckets after it wait for the step, their cross-site sums too; sites equal one site."""
    out = {}
    for zero in (0, 1, 2):
        runs = []
        for sites in (2, 1):
            groups = _groups(sites)
            model = mlp()
            unused = nn.Linear(5, 2)  # never called: stepped with a zero gradient, as on one site
            params = [*param_groups(model), {"params": list(unused.parameters())}]
            optimizer = build_optimizer(params, ADAMW, groups, zero=zero, bucket_bytes=SMALL_BUCKET_BYTES)
            local = GLOBAL_BATCH // groups.mesh.dp
            for step in range(STEPS):
                x, y = (t[groups.dp_rank * local:(groups.dp_rank + 1) * local] for t in batch(step))
                optimizer.zero_grad()
                optimizer.before_last_backward()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step(max_grad_norm=MAX_NORM)
            runs.append([p.detach().clone() for p in [*model.parameters(), *unused.parameters()]])
        out[f"zero{zero}"] = max(rel_err(a, b) for a, b in zip(*runs))
        assert out[f"zero{zero}"] < TO_FLAT, out
    return out


def check_groups_split_dp_into_sites() -> dict[str, object]:
    """The site-local group holds dp / sites replicas of this rank's site, the cross-site group
    one rank per site at this rank's site-local position."""
    groups = _groups(2)
    world = dist.get_world_size()
    site_ranks = [dist.get_global_rank(groups.site_dp, i) for i in range(groups.site_dp.size())]
    cross_ranks = [dist.get_global_rank(groups.cross_site_dp, i) for i in range(groups.cross_site_dp.size())]
    half = world // 2
    assert groups.site_rank == groups.rank // half
    assert site_ranks == list(range(groups.site_rank * half, (groups.site_rank + 1) * half))
    assert cross_ranks == [groups.rank % half, groups.rank % half + half]
    return {"site": site_ranks, "cross": cross_ranks}


def check_one_cross_site_message_per_bucket() -> dict[str, int]:
    """Each bucket's shard crosses once a step, whatever the micro-batches; zero=0 and zero=1's
    reduce-scatters start from the last backward's hooks as the flat reduction does, and zero=2
    posts each cross-site sum from that backward once the bucket's last gradient is in."""
    counts = {}
    for zero in (0, 1, 2):
        _, _, optimizer = _train(zero, sites=2)
        sites = optimizer.grad_sync._sites if zero == 0 else optimizer._sites
        buckets = optimizer.grad_sync.num_buckets if zero == 0 else len(optimizer._slots)
        assert sites.link.num_posted == STEPS * buckets, (zero, sites.link.num_posted, buckets)
        # what crosses is a shard: the padded buckets over the site's replicas, 66 elements in all
        local = optimizer.groups.site_dp.size()
        assert sites.link.num_bytes <= STEPS * 8 * (66 // local + buckets), (zero, sites.link.num_bytes)
        in_backward = {0: lambda: optimizer.grad_sync.started_in_backward, 1: lambda: optimizer.started_in_backward,
                       2: lambda: optimizer.crossed_in_backward}[zero]()
        assert in_backward == buckets, (zero, in_backward, buckets)
        counts[f"zero{zero}"] = buckets
    return counts


def check_injected_delay_holds_back_the_cross_site_sums() -> dict[str, float]:
    """With MPLAN_INTER_SITE_DELAY_MS, a step waits for its cross-site sums at least that long,
    and the result is unchanged."""
    os.environ[INTER_SITE_DELAY_ENV] = "30"
    try:
        start = time.perf_counter()
        losses, model, optimizer = _train(0, sites=2)
        elapsed = time.perf_counter() - start
    finally:
        del os.environ[INTER_SITE_DELAY_ENV]
    assert optimizer.grad_sync._sites.link.delay_s == 0.03
    assert elapsed >= STEPS * 0.03, elapsed
    ref_losses, _, ref_model = reference()
    assert max_rel_err(losses, model, ref_losses, ref_model) < TO_REFERENCE
    return {"seconds": elapsed}


# -- whole models through autoparallel ----------------------------------------------------------------
def two_site_cluster(world_size: int) -> Any:
    """This machine's ranks as 2 sites of one node each, joined by a 1 Gb/s, 10 ms link (a plan's
    `sites=2` needs a cluster of 2 sites; the figures only price, the ranks are local)."""
    from mplan.api import _local_cluster

    base = _local_cluster(world_size)
    inter = dataclasses.replace(base.links.intra_node, kind="roce", source="unused: each site is one node")
    cluster = dataclasses.replace(base, num_nodes=2, gpus_per_node=world_size // 2,
                                  links=dataclasses.replace(base.links, inter_node=inter))
    return cluster.with_sites(2, inter_site_gbps=1.0, inter_site_latency_ms=10.0, source="test: two local sites")


def _fresh_heap() -> None:
    """Leave what exists now out of later garbage collections. autoparallel ends with gc.collect()
    (api.py: the model is freed at once), which in a rank walks torch's, mplan's and the earlier
    checks' objects (~370,000) at every build: 1.5 s of a 2.6 s build at 8 ranks on 2 cores; a
    build and its 5 steps took 0.6 s frozen, 2.2 s not. What is frozen is never collected: a rank
    lives for one test module, and its peak memory grew 2% (415 to 422 MB)."""
    gc.freeze()


@functools.cache
def _one_process() -> tuple[list, dict[str, torch.Tensor]]:
    return single_device(family(MODEL), batches(GLOBAL_BATCH_ROWS))


def _against_flat_and_one_process(plan: str) -> dict[str, Any]:
    """`MODEL` under `plan` with sites=2, one sequence a micro-batch, against one process and
    against the same plan on one site."""
    _fresh_heap()
    make, data = family(MODEL), batches(GLOBAL_BATCH_ROWS)
    pm, losses, norms = trained(make, f"{plan},sites=2", data, progress="quiet", micro_batch_size=1,
                                cluster=two_site_cluster(dist.get_world_size()))
    assert pm.plan.mesh.sites == pm.groups.sites == 2 and pm.groups.cross_site_dp is not None, pm.plan.describe()
    result = errors(pm, losses, norms, _one_process())
    flat_pm, flat_losses, _ = trained(make, plan, data, progress="quiet", micro_batch_size=1)
    assert flat_pm.groups.sites == 1
    result["to_flat"] = errors(pm, losses, norms, (flat_losses, flat_pm.full_state_dict()))["param"]
    result["to_flat_loss"] = max(abs(a - b) / abs(b) for a, b in zip(losses, flat_losses))
    result["site_group"] = pm.groups.site_dp.size()
    result["crossed_in_backward"] = getattr(pm.optimizer, "crossed_in_backward", None)  # zero>=2
    assert result["loss"] < TOL and result["param"] < TOL and result["clipped"], result
    assert result["to_flat"] < TOL and result["to_flat_loss"] < TOL, result
    return result


def dp_zero0() -> dict[str, Any]:
    return _against_flat_and_one_process("dp=8")


def dp_zero1() -> dict[str, Any]:
    return _against_flat_and_one_process("dp=8,zero=1")


def dp_zero3() -> dict[str, Any]:
    return _against_flat_and_one_process("dp=8,zero=3")


def tp2_sp_zero1_in_sites() -> dict[str, Any]:
    return _against_flat_and_one_process("tp=2,dp=4,sp=1,zero=1")


def pp2_zero1_in_sites() -> dict[str, Any]:
    return _against_flat_and_one_process("pp=2,dp=4,zero=1")


def cp2_zero1_in_sites() -> dict[str, Any]:
    return _against_flat_and_one_process("cp=2,dp=4,zero=1")


def tp2_pp2_zero0_one_replica_per_site() -> dict[str, Any]:
    """dp=2 over 2 sites: a site's replica group is one rank, so only the cross-site sum is left."""
    result = _against_flat_and_one_process("tp=2,pp=2,dp=2")
    assert result["site_group"] == 1, result
    return result


def _built(make: Callable[[], nn.Module], spec: str, data: list, **options: Any) -> Any:
    import mplan
    from capture_cache import reused_captures
    from test_equivalence import MAX_NORM, OPTIMIZER

    with reused_captures(make.capture_key):
        return mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, progress="quiet",
                                  global_batch=data[0][0].shape[0], plan=spec, max_grad_norm=MAX_NORM, **options)


def _shared_dir() -> str:
    where = [tempfile.mkdtemp(prefix="mplan_sites_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    return where[0]


def checkpoint_between_sites_and_one_site() -> dict[str, Any]:
    """zero=1 over 2 sites (each site's ranks hold the same shards): saved after 2 steps, loaded
    into the same plan on one site and back into 2 sites; parameters and optimizer state come
    back bit for bit, and the 3 steps after it match training on without a stop."""
    _fresh_heap()
    make, data, n = family(MODEL), batches(GLOBAL_BATCH_ROWS), dist.get_world_size()
    spec, cluster = f"dp={n},zero=1", two_site_cluster(n)
    first = _built(make, f"{spec},sites=2", data, cluster=cluster)
    for ids, labels in data[:2]:
        first.train_step(ids, labels)
    saved = first.full_state_dict()
    flat = _built(make, spec, data)
    flat.load(first.save(_shared_dir()))
    again = _built(make, f"{spec},sites=2", data, cluster=cluster)
    again.load(flat.save(_shared_dir()))
    state = {k: v for k, v in first.optimizer.state_dict().items() if not k.startswith("layout.")}
    back = again.optimizer.state_dict()
    out = {"one_site_params_exact": all(torch.equal(v, saved[k]) for k, v in flat.full_state_dict().items()),
           "two_sites_params_exact": all(torch.equal(v, saved[k]) for k, v in again.full_state_dict().items()),
           "two_sites_state_exact": all(torch.equal(v, back[k]) for k, v in state.items())}
    tails = [[pm.train_step(ids, labels) for ids, labels in data[2:]] for pm in (first, again, flat)]
    a, b, c = (pm.full_state_dict() for pm in (first, again, flat))
    out["resumed_identical"] = tails[0] == tails[1] and all(torch.equal(a[k], b[k]) for k in a)
    out["one_site_resumed"] = max([abs(x - y) / abs(x) for x, y in zip(tails[0], tails[2])]
                                  + [rel_err(c[k], a[k]) for k in a])
    assert all(v for k, v in out.items() if k != "one_site_resumed") and out["one_site_resumed"] < TOL, out
    return out


CHECKS = [
    check_groups_split_dp_into_sites,
    check_zero0_two_sites,
    check_zero1_two_sites,
    check_zero2_two_sites,
    check_an_unused_parameter_across_sites,
    check_one_cross_site_message_per_bucket,
    check_injected_delay_holds_back_the_cross_site_sums,
    dp_zero0,
    dp_zero1,
    dp_zero3,
    tp2_sp_zero1_in_sites,
    pp2_zero1_in_sites,
    cp2_zero1_in_sites,
    tp2_pp2_zero0_one_replica_per_site,
    checkpoint_between_sites_and_one_site,
]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(WORLD_SIZE, CHECKS, timeout_s=600)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_distributed(outcomes, check) -> None:
    outcomes.assert_passed(check)


def test_a_bad_delay_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplan.runtime.hierarchical_reduce import injected_delay_s

    monkeypatch.setenv(INTER_SITE_DELAY_ENV, "ten")
    with pytest.raises(ValueError, match="MPLAN_INTER_SITE_DELAY_MS='ten' is not a number"):
        injected_delay_s()
    monkeypatch.setenv(INTER_SITE_DELAY_ENV, "2.5")
    assert injected_delay_s() == 0.0025
