"""A step's forwards and backwards replayed as one CUDA graph (`mplan.runtime.step_graph`), on the CPU.

CUDA graphs need a GPU, so here a stand-in backend gives a replay the effect a CUDA graph's has
on memory (`RerunReplay`): the recorded function runs again on the same static inputs, every
gradient that was None when the capture began starts None again, and the results are written
into the very tensors the capture returned (the loss) and left (the gradients). What that checks
is everything of the graphed step but the recording itself: the batch copied into the static
inputs, the kept gradients handed back before each replay and after every step dropped as eager
drops them, the optimizer stepping on them, accumulation over micro-batches, the fallbacks.
Trained that way, a model's losses and parameters equal the eager module's, float64.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import traceback
from collections.abc import Callable

import pytest
import torch

import mplan
from distributed import rel_err
from mplan.models import build_model
from mplan.runtime.step_graph import StepGraph, graph_refusal, sync_place

SPEC = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64"
GLOBAL_BATCH, MICRO = 4, 2
STEPS = 6
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


class RerunReplay:
    """Stands in for `CudaGraphs` on the CPU (module docstring)."""

    def __init__(self, leaves: list[torch.Tensor], fail: str | None = None, syncs: tuple[str, ...] = ()) -> None:
        self.leaves, self.fail, self.syncs, self.captures, self.replays = leaves, fail, list(syncs), 0, 0

    def synchronizing(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
        return run(), self.syncs

    def capture(self, record: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.captures += 1
        fresh = [leaf for leaf in self.leaves if leaf.grad is None]
        out = record()
        if self.fail:
            raise RuntimeError(self.fail)
        kept = {id(leaf): leaf.grad for leaf in fresh}

        def replay() -> None:  # memory rewritten; Python's attributes, as a graph leaves them, untouched
            self.replays += 1
            attributes = [leaf.grad for leaf in fresh]
            for leaf in fresh:
                leaf.grad = None
            again = record()
            out.copy_(again)
            for leaf, attribute in zip(fresh, attributes):
                if leaf.grad is not None:
                    kept[id(leaf)].copy_(leaf.grad)
                leaf.grad = attribute
        return replay, out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(step))
    return ids, ids


def _module() -> mplan.ParallelModule:
    model = build_model(SPEC, device="cpu", dtype=torch.float64, seed=0)
    return mplan.autoparallel(model, example_inputs=(_batch(0)[0][:MICRO],), global_batch=GLOBAL_BATCH,
                              micro_batch_size=MICRO, plan="dp=1,tp=1", optimizer=OPTIMIZER, max_grad_norm=1.0,
                              progress="quiet")


def _graphed(pm: mplan.ParallelModule, fail: str | None = None, syncs: tuple[str, ...] = ()) -> RerunReplay:
    leaves = list(pm.params.values())
    backend = RerunReplay(leaves, fail, syncs)
    pm.step_graph = StepGraph(leaves, backend=backend)
    return backend


def _train(pm: mplan.ParallelModule, states: list[str] | None = None) -> list[float]:
    losses = []
    for step in range(STEPS):
        losses.append(pm.train_step(*_batch(step + 1)))
        if states is not None:
            states.append(pm.step_graph.state())
        assert all(p.grad is None for p in pm.params.values()), "no gradient is held between steps, as eager"
    return losses


@functools.cache
def _eager() -> tuple[list[float], dict[str, torch.Tensor]]:
    pm = _module()
    return _train(pm), {k: v.detach().clone() for k, v in pm.params.items()}


def test_a_graphed_step_trains_as_the_eager_one_from_capture_to_the_last_step() -> None:
    """Two eager warm-up steps, the capture (and its own replay) at the third, replays after:
    every loss and every parameter after six AdamW steps (two micro-batches each, clipped) equal
    the eager module's; the capture happened once and every later step replayed."""
    pm = _module()
    backend = _graphed(pm)
    states: list[str] = []
    losses = _train(pm, states)
    want_losses, want_params = _eager()
    assert states == ["warming up"] * 2 + ["replaying"] * (STEPS - 2)
    assert backend.captures == 1 and backend.replays == STEPS - 2
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) < 1e-12
    assert max(rel_err(pm.params[k], v) for k, v in want_params.items()) < 1e-12


def test_zero1_at_one_rank_replays_as_its_eager_steps() -> None:
    """ZeRO-1 (allowed under graphs: its gradients are reduced in the optimizer step, outside the
    graph) trains as its eager module to the bit; zero=2, whose backward hooks reduce-scatter, is
    refused (below): replayed, six of its steps drift from eager by 1e-7."""
    def module() -> mplan.ParallelModule:
        model = build_model(SPEC, device="cpu", dtype=torch.float64, seed=0)
        return mplan.autoparallel(model, example_inputs=(_batch(0)[0][:MICRO],), global_batch=GLOBAL_BATCH,
                                  micro_batch_size=MICRO, plan="dp=1,tp=1,zero=1", optimizer=OPTIMIZER,
                                  max_grad_norm=1.0, progress="quiet")
    eager = module()
    want = _train(eager)
    graphed = module()
    backend = _graphed(graphed)
    assert _train(graphed) == want and backend.replays == STEPS - 2
    assert all(torch.equal(graphed.params[k], v) for k, v in eager.params.items())


def test_a_replay_reads_this_steps_batch_not_the_captured_one() -> None:
    """The batch is copied into the graph's static inputs: with the copy skipped, the replays
    would train on the capture's batch again and the losses would repeat."""
    pm = _module()
    _graphed(pm)
    losses = _train(pm)
    assert len(set(losses[2:])) == len(losses[2:])
    assert losses == pytest.approx(_eager()[0], rel=1e-12)


def test_a_failed_capture_runs_that_step_and_every_later_one_eagerly_saying_why() -> None:
    """A capture that raises (on a GPU: an op that synchronizes with the host, as MoE routing's
    counts do) leaves no partial gradient behind; the step reruns eagerly, the state names the
    cause, and the training is the eager one's."""
    pm = _module()
    backend = _graphed(pm, fail="operation not permitted when stream is capturing")
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        losses = _train(pm)
    assert pm.step_graph.state() == ("eager: the capture failed (RuntimeError: operation not permitted when "
                                     "stream is capturing)")
    assert backend.captures == 1 and backend.replays == 0
    assert losses == pytest.approx(_eager()[0], rel=1e-12)


def test_a_capture_that_fails_on_a_host_sync_names_where_the_warm_up_step_synchronized() -> None:
    """The last warm-up step is watched for host synchronizations (on a GPU, torch's sync debug
    mode). A capture that then fails (as a `.tolist()` inside one does) says so and names the
    places the watched step waited, which the capture's own error does not; training goes on
    eagerly, exactly."""
    pm = _module()
    places = tuple(f"moe.py:{line}" for line in range(89, 95))
    backend = _graphed(pm, fail="operation not permitted when stream is capturing", syncs=places)
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        losses = _train(pm)
    assert pm.step_graph.state() == ("eager: the capture failed (RuntimeError: operation not permitted when "
                                     "stream is capturing); the warm-up step synchronized with the host at "
                                     "moe.py:89, moe.py:90, moe.py:91, moe.py:92 and 2 more places")
    assert backend.captures == 1
    assert losses == pytest.approx(_eager()[0], rel=1e-12)


def test_a_sync_seen_in_warm_up_alone_does_not_refuse_a_capture_that_works() -> None:
    """The debug mode flags waits that happen once (torch's own lazy set-up): the capture is
    tried, and where it records, steps replay and train as eager does."""
    pm = _module()
    backend = _graphed(pm, syncs=("torch/cuda/__init__.py:1270",))
    losses = _train(pm)
    assert pm.step_graph.state() == "replaying" and backend.captures == 1
    assert losses == pytest.approx(_eager()[0], rel=1e-12)


def test_parameters_given_new_memory_drop_the_graph_rather_than_replay_on_the_old() -> None:
    """In-place updates (the optimizer's) keep replaying; a parameter whose storage is replaced
    (`p.data = ...`) would leave the graph reading the old memory: the next step runs eagerly and
    says why, and training stays the eager module's."""
    pm = _module()
    _graphed(pm)
    losses = [pm.train_step(*_batch(step + 1)) for step in range(3)]
    assert pm.step_graph.state() == "replaying"
    first = next(iter(pm.params.values()))
    first.data = first.data.clone()
    with pytest.warns(UserWarning, match="new memory"):
        losses += [pm.train_step(*_batch(step + 1)) for step in range(3, STEPS)]
    assert pm.step_graph.state().startswith("eager: parameters were given new memory")
    assert losses == pytest.approx(_eager()[0], rel=1e-12)


def test_a_batch_of_other_shapes_than_the_captured_runs_eagerly() -> None:
    """StepGraph alone: a step of another shape runs `run` itself, once said; the graph stays."""
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    calls: list[int] = []

    def run(micro: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        calls.append(micro[0][0].shape[0])
        loss = (micro[0][0] @ weight[: micro[0][0].shape[1]]).sum()
        loss.backward()
        return loss.detach()

    graph = StepGraph([weight], warmup=1, backend=RerunReplay([weight]))
    graph.forward_backward([(torch.ones(2, 3, dtype=torch.float64),)], run)  # the watched warm-up step
    weight.grad = None
    first = graph.forward_backward([(torch.ones(2, 3, dtype=torch.float64),)], run)
    weight.grad = None
    with pytest.warns(UserWarning, match="other shapes"):
        other = graph.forward_backward([(torch.ones(4, 2, dtype=torch.float64),)], run)
    assert float(first) == 6.0 and float(other) == 8.0 and graph.state() == "replaying"


def test_by_default_graphs_are_tried_only_where_the_plan_allows_them() -> None:
    """`cuda_graphs` left unset asks for nothing a plan cannot do: on the CPU the module simply
    runs eagerly (no refusal, no step graph); True there is refused (below)."""
    assert _module().step_graph is None


def test_cuda_graphs_are_refused_in_one_line_where_they_cannot_run() -> None:
    """On the CPU before any capture (fast); for a plan of several ranks, FP8, zero=2 or 3 by name."""
    model = build_model(SPEC, device="cpu", dtype=torch.float64, seed=0)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^cuda_graphs=True: CUDA graphs need a CUDA device; this module runs on cpu$"):
        mplan.autoparallel(model, example_inputs=(_batch(0)[0],), global_batch=GLOBAL_BATCH, cuda_graphs=True,
                           progress="quiet")
    assert time.perf_counter() - start < 1.0
    plan = _module().plan
    cuda = torch.device("cuda")
    assert graph_refusal(plan, cuda) is None
    wide = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, world_size=2),
                               mesh=dataclasses.replace(plan.mesh, dp=2))
    assert "spans 2 ranks" in graph_refusal(wide, cuda)
    assert "FP8" in graph_refusal(plan, cuda, fp8=True)
    assert "zero=3" in graph_refusal(dataclasses.replace(plan, zero=3), cuda)
    assert "zero=2" in graph_refusal(dataclasses.replace(plan, zero=2), cuda)
    assert graph_refusal(dataclasses.replace(plan, zero=1), cuda) is None


def test_a_sync_is_placed_at_the_callers_line_not_inside_torchs_wrapper() -> None:
    """A synchronizing call made through a torch function is named by the line outside torch that
    made it, with the torch function beside it: the innermost frame alone (what the C++ warning
    carries) names only torch's own wrapper, which tells a user nothing."""
    here = traceback.extract_stack()
    inside = traceback.FrameSummary(os.path.join(os.path.dirname(torch.__file__), "cuda", "__init__.py"), 1270,
                                    "synchronize")
    assert sync_place([*here, inside]) == (f"{here[-1].filename}:{here[-1].lineno} "
                                           "(in torch's synchronize, cuda/__init__.py:1270)")
    assert sync_place(here) == f"{here[-1].filename}:{here[-1].lineno}"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")


def _on_cuda(graphs: bool | None, dtype: torch.dtype, kernels: bool) -> tuple[list[float], mplan.ParallelModule]:
    model = build_model(SPEC, device="cpu", dtype=dtype, seed=0)
    pm = mplan.autoparallel(model, example_inputs=(_batch(0)[0][:MICRO],), global_batch=GLOBAL_BATCH,
                            micro_batch_size=MICRO, plan="dp=1,tp=1", optimizer=OPTIMIZER, max_grad_norm=1.0,
                            device="cuda", dtype=dtype, kernels=kernels, cuda_graphs=graphs, progress="quiet")
    losses = [pm.train_step(*(t.cuda() for t in _batch(step + 1))) for step in range(STEPS)]
    return losses, pm


@needs_cuda
@pytest.mark.parametrize(("dtype", "kernels", "tol"), [(torch.float64, False, 1e-12), (torch.float32, True, 1e-5)])
def test_on_a_gpu_the_captured_step_replays_as_eager_trains(dtype: torch.dtype, kernels: bool, tol: float) -> None:
    """The real thing on a GPU: the step captured at the third step and replayed after trains as
    the eager module does (float64 without fused kernels: the same kernels, so equal to rounding;
    float32 with the Triton kernels, whose autotuned launches are captured too). The graphed module
    is autoparallel's default, which turns graphs on for such a plan. On an H100 (2026-12-06) both
    were equal to the bit."""
    want, eager = _on_cuda(False, dtype, kernels)
    got, graphed = _on_cuda(None, dtype, kernels)  # the default: on, a one-rank plan on CUDA allowing it
    assert graphed.step_graph.state() == "replaying"
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < tol
    assert max(rel_err(graphed.params[k], v) for k, v in eager.params.items()) < tol
