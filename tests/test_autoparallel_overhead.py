"""The trivial plan costs nothing over plain PyTorch (issue 5's H200 requirement, on the CPU).

On the H200, `autoparallel(plan="dp=1,tp=1")` once ran 7% slower than an eager loop and peaked
19% higher; after `del pm, model` a model's worth of memory stayed allocated. The causes, each
pinned here: a second copy of every parameter (plus the user's model kept alive by the
exported program and the inference closure), gradient buckets holding a model's gradients
through the forward, backward adding into them, per-parameter clipping kernels, and reference
cycles left by torch.export. The GPU figures are in benchmarks/results/autoparallel_h200-*.json
(their script retired in issue 35's fold: benchmarks/models/peers.py races mplan against eager now).

Also here: `kernels=True` (fuse_kernels on the local program) trains exactly like
`kernels=False` on the reference dispatch, in float64.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import mplan
from distributed import rel_err
from mplan.models import build_model, example_inputs

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True)
PER_STEP_EXTRA_OPS = 4
"""What a step may add to eager's ops of one kind: slicing the batch and summing the loss in
float64 (a per-parameter cost, 37 parameters here, could not hide under it)."""


def _model() -> nn.Module:
    return build_model(SPEC, device="cpu", dtype=torch.float32, seed=0)


def _trivial(model: nn.Module, ids: torch.Tensor, **options) -> mplan.ParallelModule:
    return mplan.autoparallel(model, example_inputs=(ids,), global_batch=ids.shape[0], plan="dp=1,tp=1",
                              optimizer=OPTIMIZER, max_grad_norm=1.0, **options)


def _storages(tensors: Iterator[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _live_cpu_bytes() -> int:
    """Bytes of the storages of every live CPU tensor (fake tensors of earlier exports aside),
    after collecting what earlier tests left in reference cycles (a refused call's traceback)."""
    gc.collect()
    every = (o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))
    return sum(_storages(t for t in every if t.device.type == "cpu").values())


def test_parameters_are_the_models_own() -> None:
    """No parameter, gradient bucket or buffer is held twice: building pm allocates nothing."""
    model = _model()
    ids, _ = example_inputs(model, 2, device="cpu")
    before = _live_cpu_bytes()
    pm = _trivial(model, ids)
    assert _storages(iter(pm.params.values())) == _storages(model.parameters())
    assert _live_cpu_bytes() == before
    assert pm.optimizer.grad_sync.num_buckets == 0


@pytest.fixture
def captures(monkeypatch) -> list[bool]:
    """Each capture `autoparallel` makes, in order: True for the training capture (with the loss),
    False for the forward's."""
    import mplan.api

    made: list[bool] = []
    capture = mplan.api.capture_for_training
    monkeypatch.setattr(mplan.api, "capture_for_training",
                        lambda *args, **kwargs: made.append(kwargs.get("with_loss", True)) or capture(*args, **kwargs))
    return made


def test_a_job_that_only_trains_captures_once(captures: list[bool]) -> None:
    """mplan's GPT returns only its loss given labels, so inference needs its forward captured
    apart: that second torch.export (as long as the first) waits for the first `pm(inputs)`,
    which then matches the model's own forward; training never pays it."""
    model = _model()
    ids, labels = example_inputs(model, 2, device="cpu")
    expected = model(ids).detach()
    pm = _trivial(model, ids)
    pm.train_step(ids, labels)
    assert captures == [True]
    torch.testing.assert_close(pm(ids), model(ids).detach())  # the model's weights are pm's, trained in place
    assert captures == [True, False]
    pm(ids)
    assert captures == [True, False] and not torch.equal(pm(ids), expected)  # kept; after a step, new weights


def test_a_model_that_cannot_be_copied_has_its_forward_captured_at_once(captures: list[bool]) -> None:
    """The inference capture reads a meta copy of the model; a model deepcopy refuses (here it
    holds a lock) is captured when pm is built instead, kept without its weights, and runs alike."""
    import threading

    model = _model()
    model.lock = threading.Lock()
    ids, _ = example_inputs(model, 2, device="cpu")
    pm = _trivial(model, ids)
    assert captures == [True, False]
    torch.testing.assert_close(pm(ids), model(ids).detach())
    assert captures == [True, False]


@contextlib.contextmanager
def _no_automatic_gc() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_deleting_pm_and_model_frees_them_without_a_collection() -> None:
    """Reference counting alone frees the weights: nothing in pm or left by torch.export keeps
    them in a cycle that only Python's (unscheduled) cycle collector would free."""
    with _no_automatic_gc():
        model = _model()
        ids, labels = example_inputs(model, 2, device="cpu")
        pm = _trivial(model, ids)
        pm.train_step(ids, labels)
        pm(ids)  # the inference capture is of a weightless copy
        watched = [weakref.ref(t) for t in (next(model.parameters()), next(iter(pm.params.values())))]
        del pm, model
        assert [ref() for ref in watched] == [None, None]


def _profile(step: Callable[[], float]) -> tuple[collections.Counter[str], int]:
    """ATen op counts of one step and the bytes it allocates (after two warm-up steps)."""
    step()
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.events()
    counts = collections.Counter(e.name for e in events if e.name.startswith("aten::"))
    return counts, sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)


def test_trivial_step_runs_the_eager_step() -> None:
    """Same ops and the same allocations as a plain loop with foreach AdamW and clipping: no
    copy of parameters or gradients, no accumulation into buffers, no per-parameter clipping."""
    model = _model()
    ids, labels = example_inputs(model, 2, device="cpu")
    optimizer = OPTIMIZER(model.parameters())

    def eager() -> float:
        loss = model(ids, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    pm = _trivial(_model(), ids)
    (eager_ops, eager_bytes), (ops, allocated) = _profile(eager), _profile(lambda: pm.train_step(ids, labels))
    extra = {op: ops[op] - eager_ops[op] for op in ops if ops[op] > eager_ops[op] + PER_STEP_EXTRA_OPS}
    assert not extra, f"ops the trivial plan runs more often than eager: {extra}"
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert allocated - eager_bytes < param_bytes / 100, (allocated, eager_bytes, param_bytes)


@pytest.mark.parametrize("spec,fired", [
    ("tiny-gpt", {"linear_group": 2, "layer_norm_residual": 4, "attention": 2, "bias_gelu": 2, "linear_cross_entropy": 1}),
    ("tiny-llama", {"rms_norm": 1, "linear_group": 2, "rms_norm_residual": 4, "rope_qk": 2, "attention": 2,
                    "linear_swiglu": 2, "linear_cross_entropy": 1}),
])
def test_fused_kernels_train_like_the_graph(spec: str, fired: dict[str, int]) -> None:
    """kernels=True on the reference dispatch (CPU): the fused ops' references are the chains'
    own ops, so float64 losses and logits are those of kernels=False to float64 rounding (not
    bit for bit only because the grouped q/k/v GEMM may block its sums differently)."""
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (4, 16), generator=generator),
             torch.randint(0, 64, (4, 16), generator=generator)) for _ in range(3)]
    runs = []
    for kernels in (False, True):
        model = build_model(spec, device="cpu", dtype=torch.float64, seed=0)
        pm = mplan.autoparallel(model, example_inputs=(data[0][0],), global_batch=4, plan="dp=1",
                                optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), kernels=kernels)
        runs.append(([pm.train_step(x, y) for x, y in data], pm(data[0][0])))
    assert pm.program.meta["fuse_kernels"].counts == fired
    assert max(abs(a - b) / b for a, b in zip(runs[1][0], runs[0][0])) < 1e-13
    assert rel_err(runs[1][1], runs[0][1]) < 1e-13


def test_the_first_call_into_mplan_pins_nothing_of_its_caller(tmp_path) -> None:
    """The frames on the stack when mplan first loads its planner are the user's: a package that
    keeps an import error's traceback (PuLP keeps one per optional solver) would keep the model,
    the optimizer state and the graph alive forever (18 GiB on the H200, 2026-12-01)."""
    import subprocess
    import sys

    script = tmp_path / "first_call.py"
    script.write_text(
        "import gc, weakref, torch, mplan\n"
        "from mplan.models import build_model\n"
        "def train():\n"
        "    model = build_model('tiny-gpt', device='cpu', dtype=torch.float64, seed=0)\n"
        "    ids = torch.randint(0, 64, (2, 16))\n"
        "    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=2, plan='dp=1')\n"
        "    pm.train_step(ids, ids)\n"
        "    return weakref.ref(next(iter(pm.params.values())))\n"
        "alive = train()\n"
        "gc.collect()\n"
        "assert alive() is None, 'a parameter outlived the function that trained it'\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
