"""Negative controls: the float64 equivalence check fails when a parallel run's arithmetic is wrong.

The equivalence tests (test_equivalence*.py, test_pipeline.py, test_expert_parallel.py) pass when
a plan's training matches one process within a relative error of 1e-9. That only means something
if a wrong plan does not pass too. Each check here trains one family's plan twice on the same 4
gloo ranks against the same one-process reference: once as shipped (it must pass the bound) and
once with one fault planted by patching the runtime from this test, never in library code:

    family   plan (4 ranks)          planted fault
    tp       tp=2,dp=2               the row-parallel output's all-reduce skipped (partial sums kept)
    sp       tp=2,dp=2,sp=1          the sequence reduce-scatter keeps this rank's chunk, unsummed
    dp       dp=4                    the data-parallel gradient all-reduce skipped (divided, not summed)
    zero     dp=4,zero=1             ZeRO-1's gradient reduce-scatter keeps this rank's slice, unsummed
    pp       pp=4 (1F1B)             each stage sends back its first micro-batch's gradient (stale)
    ep       dp=4,ep=4               the expert all-to-all's backward halves the gradient
    tp x pp  tp=2,pp=2               the all-reduce of tp skipped inside pipeline stages

The faulted run must miss the bound by a wide margin (`WIDE`, 1000x), so the check could not pass
a wrong run by luck of rounding. A wrong *global* gradient scale is not among them on purpose:
under AdamW with active clipping it is invisible to any end-to-end check (clipping rescales every
gradient to the same norm, and Adam divides the scale out), so it is caught by unit tests of the
gradient sync, not here. One gloo group of 4 ranks runs every check.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distributed import run_checks
from test_equivalence import TOL, batches, errors, family, single_device, trained
from test_expert_parallel import accumulated, moe

WIDE = 1e3
"""How far past the 1e-9 bound a faulted run must land: 1e-6 or more."""


# -- the faults (context managers, entered on every rank around one training run) ----------------
@contextlib.contextmanager
def skipped_tp_all_reduce() -> Iterator[None]:
    """P -> R keeps the local partial sum: a row-parallel layer's output all-reduce never runs."""
    from mplan.collectives import flat

    with mock.patch.object(flat, "all_reduce", lambda x, group: x.contiguous().clone()):
        yield


@contextlib.contextmanager
def unsummed_sequence_reduce_scatter() -> Iterator[None]:
    """P -> S(d) keeps this rank's chunk of its own partial sum, as if the reduction were skipped."""
    from mplan.collectives import flat

    def own_chunk(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        n = group.size()
        size = flat.chunk_size(x, dim, n, "reduce-scatter")
        return x.narrow(dim, dist.get_rank(group) * size, size).contiguous()
    with mock.patch.object(flat, "reduce_scatter", own_chunk):
        yield


@contextlib.contextmanager
def skipped_dp_all_reduce() -> Iterator[None]:
    """Each bucket is divided by dp but never summed over the replicas: every rank steps on its
    own quarter of the batch."""
    from mplan.runtime import data_parallel

    original = data_parallel._start_all_reduce

    def local_only(groups: Any, buckets: list, sites: Any, index: int) -> None:
        alone = dataclasses.replace(buckets[index], group=None, site_group=None)  # same buffer, no replica group
        return original(groups, [alone], sites, 0)
    with mock.patch.object(data_parallel, "_start_all_reduce", local_only):
        yield


@contextlib.contextmanager
def unsummed_zero_reduce_scatter() -> Iterator[None]:
    """ZeRO-1's reduce-scatter hands each rank its slice of its own gradient, unsummed."""
    from mplan.runtime import sharded_optimizer

    def own_slice(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> None:
        out.copy_(x.view(group.size(), -1)[dist.get_rank(group)])
    with mock.patch.object(sharded_optimizer, "reduce_scatter_flat", own_slice):
        yield


@contextlib.contextmanager
def stale_pipeline_gradients() -> Iterator[None]:
    """Every stage sends back, for each micro-batch, the input gradient of the step's first one."""
    from mplan.runtime.pipeline_executor import PipelineExecutor

    original = PipelineExecutor._send_backward
    first: dict[tuple[int, int], tuple] = {}

    def stale(self: Any, a: Any) -> None:
        state = self._state[(a.stage, a.microbatch)]
        key = (id(self), a.stage)
        if a.microbatch == 0:
            first[key] = tuple(g.detach().clone() if g is not None else None for g in state.input_grads)
        else:
            state.input_grads = first[key]
        original(self, a)
    with mock.patch.object(PipelineExecutor, "_send_backward", stale):
        yield


@contextlib.contextmanager
def halved_expert_gradient() -> Iterator[None]:
    """The expert all-to-all's backward returns half of each gradient row."""
    from mplan.collectives import uneven

    original = uneven._RowsAllToAll.backward

    def halved(ctx: Any, grad: torch.Tensor) -> tuple:
        out, *rest = original(ctx, grad)
        return (out * 0.5, *rest)
    with mock.patch.object(uneven._RowsAllToAll, "backward", staticmethod(halved)):
        yield


# -- one family's control: the same plan, clean and faulted, against one reference -------------
def control(make: Callable[[], Any], plan: str, global_batch: int, fault: Callable[[], Any], *,
            micro_batch_size: int | None = None, reference: Callable[[list], Any] | None = None) -> dict[str, Any]:
    """The largest relative errors of `plan` as shipped and with `fault` planted, against one process."""
    data = batches(global_batch)
    expected = reference(data) if reference else single_device(make, data)
    options = {} if micro_batch_size is None else {"micro_batch_size": micro_batch_size}
    clean = errors(*trained(make, plan, data, **options), expected)
    with fault():
        faulted = errors(*trained(make, plan, data, **options), expected)
    return {"clean": clean, "faulted": faulted}


def tp() -> dict[str, Any]:
    return control(family("tiny-gpt"), "tp=2,dp=2", 4, skipped_tp_all_reduce)


def sp() -> dict[str, Any]:
    return control(family("tiny-llama"), "tp=2,dp=2,sp=1", 4, unsummed_sequence_reduce_scatter)


def dp() -> dict[str, Any]:
    return control(family("tiny-llama"), "dp=4", 8, skipped_dp_all_reduce, micro_batch_size=2)


def zero() -> dict[str, Any]:
    return control(family("tiny-gpt"), "dp=4,zero=1", 4, unsummed_zero_reduce_scatter)


def pp() -> dict[str, Any]:
    return control(family("tiny-llama"), "pp=4,schedule=1f1b", 8, stale_pipeline_gradients, micro_batch_size=1)


def ep() -> dict[str, Any]:
    make = moe(8, 2)
    return control(make, "dp=4,ep=4", 8, halved_expert_gradient, micro_batch_size=1,
                   reference=lambda data: accumulated(make, data, 1))


def tp_pp() -> dict[str, Any]:
    return control(family("tiny-llama"), "tp=2,pp=2", 4, skipped_tp_all_reduce, micro_batch_size=1)


CHECKS = [tp, sp, dp, zero, pp, ep, tp_pp]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(4, CHECKS, timeout_s=600)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_a_planted_fault_fails_the_equivalence_check(outcomes, check) -> None:
    values = outcomes.assert_passed(check)
    assert len(values) == 4
    for rank, result in enumerate(values):
        clean, faulted = result["clean"], result["faulted"]
        assert clean["loss"] < TOL and clean["param"] < TOL, f"rank {rank}: the plan as shipped fails: {clean}"
        assert clean["clipped"] and faulted["clipped"], f"rank {rank}: clipping never engaged: {result}"
        assert faulted["ran"] == clean["ran"], f"rank {rank}: the fault changed the plan: {result}"
        worst = max(faulted["loss"], faulted["param"])
        assert worst > WIDE * TOL, f"rank {rank}: the planted fault passes the 1e-9 check: {faulted}"
