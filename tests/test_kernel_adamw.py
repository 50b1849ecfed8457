"""mplan's multi-tensor Adam/AdamW (mplan/kernels/adamw.py) held against torch's own optimizers.

The specs run twice: here, where `adamw.step` takes its PyTorch reference (CPU tensors, no
interpreter), and in a subprocess started with TRITON_INTERPRET=1
(`test_the_specs_under_the_interpreter`), where it launches the Triton kernel and the reference is
forbidden (`kernel_only`). Triton fixes compile-vs-interpret when it is imported, hence the
subprocess. On its own:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernel_adamw.py

Tolerances: fp32 within 1e-6 (relative, in norm) of `torch.optim.AdamW(foreach=False)` over
several steps. 16-bit parameters step by step, from the same state, within one rounding of
torch's fused AdamW: fp32 math with each stored value rounded once is what `step` reproduces
(torch's for-loop path rounds every intermediate to 16 bits). The interpreter truncates
fp32 -> bf16 where the GPU rounds to nearest, so bf16 may be one unit further off there.
Parameter sizes are odd and small (1 to 4099 elements, 2-D ones too), so full, partial and empty
blocks of the kernel's chunks all run.

The plan (`adamw._Plan`: what one step repeats, made by a full step and run by the next ones) is
tested in both processes: here `_TableKernel` stands in for the Triton kernel, reading the table
and the work list as it does, through the tensors' addresses, so the host side runs in full.
"""
from __future__ import annotations

import copy
import ctypes
import functools
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import rel_err

from mplan.kernels import adamw
from mplan.kernels.dispatch import HAVE_TRITON, INTERPRET, tl
from mplan.runtime.compute_copies import ComputeCopies
from mplan.ir.mesh import MeshShape
from mplan.runtime.optimizer import build_optimizer
from mplan.runtime.process_groups import init_process_groups

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1,), (3,), (1000,), (4099,), (37, 29), (64, 33)]
FP32_TOL = 1e-6
STEPS = 4


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter every update must be the kernel's: the reference raises."""
    if INTERPRET:
        def refuse(*_: object) -> None:
            raise AssertionError("the PyTorch reference ran where the kernel should have")

        monkeypatch.setattr(adamw, "_update_reference", refuse)
    yield


def _memory(address: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The `numel` elements of `dtype` at host `address`, as a tensor over that memory."""
    return torch.frombuffer((ctypes.c_byte * (numel * dtype.itemsize)).from_address(address), dtype=dtype)


class _TableKernel:
    """Stands in for `adamw._adam_kernel` where Triton does not run: reads the work list and the
    table as the kernel does, reaching every tensor through its address, and applies the PyTorch
    reference to each listed chunk. A stale address or word, or a chunk listed twice or not at
    all, shows in the results; an `ALIGNED` launch of an unaligned tensor fails."""

    def __init__(self) -> None:
        self.reference = adamw._update_reference

    def __getitem__(self, grid: tuple[int]) -> Callable[..., None]:
        return self.launch

    def launch(self, work: torch.Tensor, table: torch.Tensor, float_table: torch.Tensor, grad_scale: torch.Tensor, *,
               ROW: int, BLOCK: int, BLOCKS_PER_CHUNK: int, DTYPE: object, GRAD_DTYPE: object, HAS_GRAD_SCALE: bool,
               HAS_COPY: bool, ALIGNED: bool, num_warps: int) -> None:
        dtype, grad_dtype = (next(d for d, name in adamw._KERNEL_DTYPES.items() if getattr(tl, name) == triton_dtype)
                             for triton_dtype in (DTYPE, GRAD_DTYPE))
        assert HAS_COPY or grad_dtype == dtype
        chunk = BLOCK * BLOCKS_PER_CHUNK
        for tensor, index in work.tolist():
            words, floats = table[tensor].tolist(), float_table[tensor].tolist()
            param, grad, exp_avg, exp_avg_sq, step, numel = words[:6]
            copy = words[13]
            assert bool(copy) == HAS_COPY
            assert not ALIGNED or all(address % 16 == 0 for address in words[:4] + [copy])
            start, count = index * chunk, min(chunk, numel - index * chunk)
            assert count > 0

            def at(address: int, of: torch.dtype = dtype) -> torch.Tensor:
                return _memory(address + start * of.itemsize, count, of)

            self.reference(adamw._Update(
                param=at(param), grad=at(grad, grad_dtype), exp_avg=at(exp_avg), exp_avg_sq=at(exp_avg_sq),
                step=_memory(step, 1, torch.float32)[0] if step else torch.tensor(floats[12], dtype=torch.float64),
                hyper=adamw._Hyper(*floats[6:12]), group=0, copy=at(copy, grad_dtype) if HAS_COPY else None),
                grad_scale if HAS_GRAD_SCALE else None)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch, kernel_only: None) -> None:
    """`adamw.step` updates every fp32 parameter through the kernel's table: under the interpreter
    by Triton's kernel (the reference forbidden), here by `_TableKernel`, so the host side (plan,
    table, work lists) runs in this process too."""
    if not INTERPRET:
        if not HAVE_TRITON:
            pytest.skip("the launch names Triton's dtypes")
        monkeypatch.setattr(adamw, "use_triton", lambda tensor: tensor.dtype != torch.float64)
        monkeypatch.setattr(adamw, "_adam_kernel", _TableKernel())


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    """Two groups with different learning rates (the optimizer's default lr is the first's)."""
    return [{"params": params[:3]}, {"params": params[3:], "lr": 2e-2}]


def _has_grad(step: int, index: int) -> bool:
    """Parameter 1 gets no gradient on the first step (its state starts later), parameter 4 none on
    step 2, parameter 5 never (its state stays empty)."""
    return not (index == 5 or (index, step) in ((1, 0), (4, 2)))


def _set_grads(step: int, *param_lists: list[torch.Tensor], dtype: torch.dtype = torch.float32,
               has_grad: Callable[[int, int], bool] = _has_grad) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for index, shape in enumerate(SHAPES):
        grad = (3 * torch.randn(shape, generator=gen)).to(dtype)
        for params in param_lists:
            params[index].grad = grad.clone() if has_grad(step, index) else None


def _assert_close_states(ours: torch.optim.Optimizer, reference: torch.optim.Optimizer, tol: float) -> None:
    for p, q in zip((p for g in ours.param_groups for p in g["params"]),
                    (q for g in reference.param_groups for q in g["params"])):
        assert rel_err(p.detach(), q.detach()) < tol, f"param {tuple(p.shape)}: {rel_err(p, q):.3g}"
        mine, theirs = ours.state[p], reference.state[q]
        assert set(mine) == set(theirs), (tuple(p.shape), set(mine), set(theirs))
        if not theirs:
            continue
        assert mine["step"].item() == theirs["step"].item()
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert (mine[key].dtype, mine[key].device) == (theirs[key].dtype, theirs[key].device), key
        for key in ("exp_avg", "exp_avg_sq"):
            error = rel_err(mine[key], theirs[key])
            assert error < tol, f"{key} {tuple(p.shape)}: {error:.3g}"


# -- fp32 against torch's for-loop AdamW --------------------------------------------------------

CASES = {
    "adamw_decay_grad_scale": (torch.optim.AdamW, 0.1, 2.5),
    "adamw_no_decay": (torch.optim.AdamW, 0.0, None),
    "adam_l2_decay_grad_scale": (torch.optim.Adam, 0.05, 0.75),
}


@pytest.mark.parametrize("case", CASES)
def test_fp32_steps_match_torch(case: str, kernel_only: None) -> None:
    """Several steps, two groups with different lr, gradients missing on some steps: params, both
    moments, steps and the gradients left behind (divided by grad_scale when one is given) match."""
    kind, weight_decay, scale = CASES[case]
    ours, theirs = _params(), _params()
    mine = kind(_groups(ours), lr=1e-2, weight_decay=weight_decay, foreach=False)
    reference = kind(_groups(theirs), lr=1e-2, weight_decay=weight_decay, foreach=False)
    assert adamw.applies(mine) == INTERPRET
    grad_scale = None if scale is None else torch.tensor(scale)
    for step in range(STEPS):
        _set_grads(step, ours, theirs)
        if grad_scale is not None:  # torch's for-loop takes no grad_scale: it gets the divided gradients
            for q in theirs:
                if q.grad is not None:
                    q.grad.div_(grad_scale)
        adamw.step(mine, grad_scale)
        reference.step()
        for p, q in zip(ours, theirs):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)
    _assert_close_states(mine, reference, FP32_TOL)


# -- 16-bit against torch's fused AdamW, step by step -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_steps_round_once_like_torch_fused(dtype: torch.dtype, kernel_only: None) -> None:
    """From the same state each step (torch's fused AdamW on the CPU, given a copy of ours), every
    stored value (params, moments, the scaled gradients) is within one rounding of torch's."""
    eps = torch.finfo(dtype).eps
    ours = _params(dtype)
    mine = torch.optim.AdamW(_groups(ours), lr=0.05, weight_decay=0.1, fused=True)  # its state_dict says fused
    grad_scale = torch.tensor(1.5)
    for step in range(3):
        theirs = [p.detach().clone().requires_grad_() for p in ours]
        reference = torch.optim.AdamW(_groups(theirs), lr=0.05, weight_decay=0.1, fused=True)
        reference.load_state_dict(copy.deepcopy(mine.state_dict()))
        reference.grad_scale = grad_scale
        _set_grads(step, ours, theirs, dtype=dtype)
        adamw.step(mine, grad_scale)
        reference.step()
        for p, q in zip(ours, theirs):
            pairs = [(p.detach(), q.detach())]
            if p.grad is not None:
                pairs += [(p.grad, q.grad)] + [(mine.state[p][k], reference.state[q][k])
                                               for k in ("exp_avg", "exp_avg_sq")]
            for got, want in pairs:
                assert got.dtype == dtype
                error = (got.float() - want.float()).abs()
                bound = 2 * eps * want.float().abs() + 1e-6 * want.float().abs().max()
                assert bool((error <= bound).all()), (step, tuple(p.shape), float((error / bound).max()))


# -- steps: where torch keeps them, and how the kernel reads them -------------------------------

@pytest.mark.parametrize("where", ["fused_float32", "cpu_float32", "cpu_float64"])
def test_steps_wherever_torch_keeps_them_even_late_in_training(where: str, kernel_only: None) -> None:
    """torch keeps `step` on the parameter's device in float32 (fused groups; the kernel reads it
    through its address) or on the CPU (float64 under a float64 default dtype: read on the host).
    A state loaded at step 12345 checks the bias corrections far from step 1."""
    fused = where == "fused_float32"
    previous = torch.get_default_dtype()
    if where == "cpu_float64":
        torch.set_default_dtype(torch.float64)
    try:
        ours, theirs = _params(), _params()
        mine = torch.optim.AdamW(_groups(ours), lr=1e-2, fused=fused or None, foreach=None if fused else False)
        reference = torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=False)
        _set_grads(0, ours, theirs)
        reference.step()
        state = reference.state_dict()
        for entry in state["state"].values():
            entry["step"].fill_(12345.0)
        mine.load_state_dict(copy.deepcopy(state))
        reference.load_state_dict(state)
        for p, q in zip(ours, theirs):
            p.data.copy_(q.data)
        expected = (torch.float32, torch.device("cpu")) if fused or where == "cpu_float32" else (torch.float64,
                                                                                              torch.device("cpu"))
        for step in range(1, 3):
            _set_grads(step, ours, theirs)
            adamw.step(mine)
            reference.step()
        assert all((s["step"].dtype, s["step"].device) == expected for s in mine.state.values() if s)
        _assert_close_states(mine, reference, FP32_TOL)
    finally:
        torch.set_default_dtype(previous)


# -- torch's state format: state_dict, load_state_dict, torch's own step in between --------------

def test_state_dicts_round_trip_between_mplan_and_torch(kernel_only: None) -> None:
    """A state made by `adamw.step` loads into a fresh torch AdamW that then steps as one that made
    every step itself; torch's state loads into an optimizer `adamw.step` continues; and one
    optimizer may alternate between the two."""
    runs = {name: _params() for name in ("torch", "mplan_then_torch", "torch_then_mplan", "alternating")}
    optimizers = {name: torch.optim.AdamW(_groups(p), lr=1e-2, weight_decay=0.1, foreach=False)
                  for name, p in runs.items()}
    for step in range(2 * STEPS):
        _set_grads(step, *runs.values())
        first_half = step < STEPS
        for name, optimizer in optimizers.items():
            uses_mplan = {"torch": False, "mplan_then_torch": first_half, "torch_then_mplan": not first_half,
                          "alternating": step % 2 == 0}[name]
            adamw.step(optimizer) if uses_mplan else optimizer.step()
        if step == STEPS - 1:  # hand over through state_dict() into fresh optimizers
            for name in ("mplan_then_torch", "torch_then_mplan"):
                fresh = torch.optim.AdamW(_groups(runs[name]), lr=1e-2, weight_decay=0.1, foreach=False)
                fresh.load_state_dict(optimizers[name].state_dict())
                optimizers[name] = fresh
    for name in ("mplan_then_torch", "torch_then_mplan", "alternating"):
        _assert_close_states(optimizers[name], optimizers["torch"], FP32_TOL)


def test_learning_rate_schedules_are_read_every_step(kernel_only: None) -> None:
    """A scheduler changes group["lr"] between steps; it sees `adamw.step` as the optimizer's step
    (no "lr_scheduler.step() before optimizer.step()" warning)."""
    ours, theirs = _params(), _params()
    mine = torch.optim.AdamW(_groups(ours), lr=1e-2, foreach=False)
    reference = torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=False)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (mine, reference)]
    assert adamw.applies(mine) == INTERPRET
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            _set_grads(step, ours, theirs)
            adamw.step(mine)
            reference.step()
            for schedule in schedules:
                schedule.step()
    assert mine.param_groups[1]["lr"] == pytest.approx(2e-2 / 4)
    _assert_close_states(mine, reference, FP32_TOL)


# -- the plan: made by one step, run by the next ones, remade when the optimizer changes -------

def _assert_equal_states(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    for p, q in zip((p for g in ours.param_groups for p in g["params"]),
                    (q for g in theirs.param_groups for q in g["params"])):
        assert torch.equal(p, q), tuple(p.shape)
        assert set(ours.state[p]) == set(theirs.state[q])
        for key, value in ours.state[p].items():
            assert torch.equal(value, theirs.state[q][key]), (tuple(p.shape), key)


def _load_own_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new tensors, the same values


def _load_float64_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Steps the kernel reads from the table (float64, on the CPU), incremented through ctypes doubles."""
    state = copy.deepcopy(optimizer.state_dict())
    for entry in state["state"].values():
        entry["step"] = entry["step"].to(torch.float64)
    optimizer.load_state_dict(state)


def _bucket_the_grads(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Gradients as views into one flat buffer at 4-byte offsets: the plan splits each launch in two."""
    with_grads = [p for p in params if p.grad is not None]
    flat = torch.empty(1 + sum(p.numel() for p in with_grads))
    offset = 1
    for p in with_grads:
        view = flat[offset:offset + p.numel()].view_as(p)
        p.grad = view.copy_(p.grad)
        offset += p.numel()


def _replace_one_moment(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.state[params[2]]["exp_avg"] = optimizer.state[params[2]]["exp_avg"].clone()


def _add_a_group(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    extra = torch.randn(7, 5, generator=torch.Generator().manual_seed(7)).requires_grad_()
    optimizer.add_param_group({"params": [extra], "lr": 3e-2})


def _drop_a_grad(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    params[0].grad = None


def _torch_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    optimizer.step()  # torch's own step, then `adamw.step` on the same gradients


CHANGES: dict[str, tuple[Callable[[torch.optim.Optimizer, list[torch.Tensor]], None] | None, bool]] = {
    "lr_scheduler": (None, False),
    "torch_step_between": (_torch_steps, False),
    "grad_becomes_none": (_drop_a_grad, True),
    "load_state_dict": (_load_own_state, True),
    "float64_steps_loaded": (_load_float64_steps, True),
    "grads_in_a_bucket": (_bucket_the_grads, False),
    "state_entry_replaced": (_replace_one_moment, True),
    "add_param_group": (_add_a_group, True),
}
"""What changes before the third step: (the change, made to each optimizer; whether it calls for a new plan)."""


@pytest.mark.parametrize("change", CHANGES)
def test_the_plan_runs_until_the_optimizer_changes(change: str, kernel: None) -> None:
    """Five steps, the change made before the third. The plan made by the first step runs the
    second and the fifth; the third step makes a new one exactly where the change calls for it.
    Every step is torch's AdamW's (within FP32_TOL) and, where `_TableKernel` runs, to the bit
    that of a twin whose plan is dropped before each of its steps (a check of the host side: the
    interpreter would only run the same tables twice as slowly)."""
    make_change, replans = CHANGES[change]
    runs = {name: _params() for name in ("mine", "torch") + (() if INTERPRET else ("twin",))}
    optimizers = {name: torch.optim.AdamW(_groups(params), lr=1e-2, weight_decay=0.1, foreach=False)
                  for name, params in runs.items()}
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step) for o in optimizers.values()
                 if change == "lr_scheduler"]
    plans = []
    kept: list[torch.Tensor] = []  # what a change replaces, held: a stale plan writes there (a failure, not a crash)
    for step in range(5):
        _set_grads(step, *runs.values(), has_grad=lambda step, index: index != 5)
        if step == 2 and make_change is not None:
            kept += [t for o in optimizers.values() for entry in o.state.values() for t in entry.values()]
            for name, optimizer in optimizers.items():
                make_change(optimizer, runs[name])
        if step >= 2 and change == "add_param_group":
            for optimizer in optimizers.values():
                optimizer.param_groups[2]["params"][0].grad = torch.full((7, 5), 0.5 - step)
        adamw.step(optimizers["mine"])
        if "twin" in optimizers:
            adamw._plans.pop(optimizers["twin"], None)
            adamw.step(optimizers["twin"])
        optimizers["torch"].step()
        for schedule in schedules:
            schedule.step()
        plans.append(adamw._plans.get(optimizers["mine"]))
    assert plans[0] is not None and plans[1] is plans[0] and plans[4] is plans[3]
    assert (plans[2] is not plans[1]) == replans
    if change == "lr_scheduler":
        assert optimizers["mine"].param_groups[1]["lr"] == pytest.approx(2e-2 / 32)
    _assert_close_states(optimizers["mine"], optimizers["torch"], FP32_TOL)
    if "twin" in optimizers:
        _assert_equal_states(optimizers["mine"], optimizers["twin"])


def test_compute_copies_give_the_gradient_and_are_rewritten(kernel: None) -> None:
    """fp32 parameters whose gradients arrive on bf16 compute copies (mplan/runtime/compute_copies.py):
    the step is torch's on those gradients widened, and each copy ends as its parameter rounded to
    bf16 (the interpreter truncates where the kernel rounds: within one bf16 step there). A change
    of copies makes a new plan."""
    params, twins = _params(), _params()
    copies = {p: p.detach().to(torch.bfloat16) for p in params}
    mine = torch.optim.AdamW(_groups(params), lr=1e-2, weight_decay=0.1, fused=None)
    reference = torch.optim.AdamW(_groups(twins), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        scale = torch.tensor(2.0) if step == 1 else None
        if step == 2:  # new copy tensors: the plan must not write into the old ones
            copies = {p: c.clone() for p, c in copies.items()}
        _set_grads(step, list(copies.values()), dtype=torch.bfloat16)
        for copy, twin in zip(copies.values(), twins):
            twin.grad = None if copy.grad is None else copy.grad.float() / (1.0 if scale is None else scale)
        adamw.step(mine, scale, copies=copies)
        reference.step()
        assert all(p.grad is None for p in params)
        _assert_close_states(mine, reference, FP32_TOL)
        for p, copy in copies.items():
            if INTERPRET:
                assert ((copy.float() - p.detach()).abs() <= p.detach().abs() * 2**-7).all()
            else:
                assert torch.equal(copy, p.detach().to(torch.bfloat16))


def test_applies_is_rechecked_when_the_optimizer_changes(kernel: None) -> None:
    """`applies` answers from the plan only while it describes the optimizer: a step hook, a state
    entry that is not torch Adam's, a float64 group added each turn it false (and `step` refuses
    the state), and undoing the first two turns it true again. The plan the next step makes (the
    float64 parameter has no gradient: the kernel does every update) keeps it false."""
    params = _params()
    optimizer = torch.optim.AdamW(_groups(params), lr=1e-2, foreach=False)
    _set_grads(1, params)
    adamw.step(optimizer)
    assert adamw.applies(optimizer) and adamw._plans.get(optimizer) is not None
    hook = optimizer.register_step_post_hook(lambda *_: None)
    assert not adamw.applies(optimizer)
    hook.remove()
    assert adamw.applies(optimizer)
    optimizer.state[params[0]]["max_exp_avg_sq"] = torch.zeros_like(params[0])
    assert not adamw.applies(optimizer)
    with pytest.raises(ValueError, match="state is not torch Adam's"):
        adamw.step(optimizer)
    del optimizer.state[params[0]]["max_exp_avg_sq"]
    assert adamw.applies(optimizer)
    optimizer.add_param_group({"params": [torch.zeros(3, dtype=torch.float64, requires_grad=True)]})
    assert not adamw.applies(optimizer)
    adamw.step(optimizer)
    assert adamw._plans.get(optimizer) is not None and not adamw.applies(optimizer)


# -- where it applies --------------------------------------------------------------------------

def test_applies_only_where_the_kernel_reproduces_torch() -> None:
    """True for a plain Adam/AdamW on fp32/bf16/fp16 parameters the kernel runs on (CPU ones only
    under the interpreter); false for options it does not implement, float64 or tensor-subclass
    parameters, tensor hyperparameters, step hooks or AMP attributes; `step` itself refuses the
    unsupported options."""
    def params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [torch.zeros(4, dtype=dtype, requires_grad=True)]

    for make in (lambda: torch.optim.AdamW(params()), lambda: torch.optim.Adam(params(torch.bfloat16)),
                 lambda: torch.optim.AdamW(params(torch.float16), fused=True)):
        assert adamw.applies(make()) == INTERPRET
    refused = {
        "amsgrad": torch.optim.AdamW(params(), amsgrad=True),
        "maximize": torch.optim.AdamW(params(), maximize=True),
        "capturable": torch.optim.AdamW(params(), capturable=True),
        "differentiable": torch.optim.AdamW(params(), differentiable=True),
        "tensor_lr": torch.optim.AdamW(params(), lr=torch.tensor(1e-3), foreach=False),
        "float64": torch.optim.AdamW(params(torch.float64)),
        "sgd": torch.optim.SGD(params(), lr=0.1),
        "subclass": type("MyAdamW", (torch.optim.AdamW,), {})(params()),
        "tensor_subclass": torch.optim.AdamW([torch.zeros(4).as_subclass(type("MyTensor", (torch.Tensor,), {}))
                                              .requires_grad_()]),
    }
    hooked = torch.optim.AdamW(params())
    hooked.register_step_post_hook(lambda *_: None)
    amp = torch.optim.AdamW(params())
    amp.found_inf = torch.zeros(())
    refused.update(step_hook=hooked, found_inf=amp)
    for name, optimizer in refused.items():
        assert not adamw.applies(optimizer), name
    for name in ("amsgrad", "maximize", "tensor_lr", "step_hook"):
        with pytest.raises(ValueError, match="cannot step this optimizer"):
            adamw.step(refused[name])


def test_float64_steps_by_the_reference_as_torch() -> None:
    """Where the kernel does not run (float64), `step` still reproduces torch, by the reference."""
    ours, theirs = _params(torch.float64), _params(torch.float64)
    mine = torch.optim.Adam(_groups(ours), lr=1e-2, weight_decay=0.1, foreach=False)
    reference = torch.optim.Adam(_groups(theirs), lr=1e-2, weight_decay=0.1, foreach=False)
    assert not adamw.applies(mine)
    for step in range(STEPS):
        _set_grads(step, ours, theirs, dtype=torch.float64)
        adamw.step(mine)
        reference.step()
    _assert_close_states(mine, reference, 1e-12)


# -- the runtime: mplan's optimizers on one rank -----------------------------------------------

@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["unclipped", "clipped"])
def test_runtime_optimizers_step_as_torch(zero: int, max_grad_norm: float | None, kernel_only: None) -> None:
    """ReplicatedOptimizer (zero=0) and ShardedOptimizer (zero=1, one flat fp32 master) on one rank
    take the kernel (under the interpreter) with and without global-norm clipping (the clip
    coefficient becomes the kernel's grad_scale) and train as torch's AdamW with clip_grad_norm_."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(24, 10, generator=gen), torch.randn(24, generator=gen), torch.randn(3, 24, generator=gen)]
    ours = [w.clone().requires_grad_() for w in weights]
    theirs = [w.clone().requires_grad_() for w in weights]
    factory = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)
    optimizer = build_optimizer(ours, factory, init_process_groups(MeshShape()), zero=zero)
    reference = factory(theirs)
    assert adamw.applies(optimizer.optimizer) == INTERPRET

    def loss(params: list[torch.Tensor], step: int) -> torch.Tensor:
        batch = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(8, 10, generator=batch), torch.randn(8, 3, generator=batch)
        return F.mse_loss(F.linear(torch.tanh(F.linear(x, params[0], params[1])), params[2]), y)

    for step in range(3):
        optimizer.zero_grad()
        reference.zero_grad()
        loss(ours, step).backward()
        loss(theirs, step).backward()
        norm = optimizer.step(max_grad_norm=max_grad_norm)
        if max_grad_norm is not None:
            reference_norm = torch.nn.utils.clip_grad_norm_(theirs, max_grad_norm)
            assert reference_norm > max_grad_norm, "the test must exercise clipping"
            assert rel_err(norm, reference_norm) < FP32_TOL
        reference.step()
    for p, q in zip(ours, theirs):
        assert rel_err(p.detach(), q.detach()) < FP32_TOL


@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["unclipped", "clipped"])
def test_runtime_steps_masters_from_their_compute_copies(max_grad_norm: float | None, kernel_only: None) -> None:
    """ReplicatedOptimizer with compute copies (mplan/runtime/compute_copies.py): the fp32 masters
    step, clipped by the global norm of the copies' bf16 gradients, as torch's AdamW steps on those
    gradients widened; the copies are rewritten (by the kernel under the interpreter, else
    refreshed after torch's step)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(24, 10, generator=gen), torch.randn(24, generator=gen), torch.randn(3, 24, generator=gen)]
    ours = [w.clone().requires_grad_() for w in weights]
    theirs = [w.clone().requires_grad_() for w in weights]
    copies = ComputeCopies(ours[:2], torch.bfloat16)  # the last weight keeps no copy
    factory = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.1)
    optimizer = build_optimizer(ours, factory, init_process_groups(MeshShape()), copies=copies)
    reference = factory(theirs)
    for step in range(3):
        optimizer.zero_grad()
        reference.zero_grad()
        gen = torch.Generator().manual_seed(10 + step)
        grads = [(3 * torch.randn(w.shape, generator=gen)).to(torch.bfloat16) for w in weights]
        for p, q, grad in zip(ours, theirs, grads):
            copies.of(p).grad = grad if copies.of(p) is not p else None
            if copies.of(p) is p:
                p.grad = grad.float()
            q.grad = grad.float()
        norm = optimizer.step(max_grad_norm=max_grad_norm)
        if max_grad_norm is not None:
            reference_norm = torch.nn.utils.clip_grad_norm_(theirs, max_grad_norm)
            assert rel_err(norm, reference_norm) < FP32_TOL
        reference.step()
        for p, q in zip(ours, theirs):
            assert rel_err(p.detach(), q.detach()) < FP32_TOL
        for master, copy in copies.copies.items():
            assert ((copy.float() - master.detach()).abs() <= master.detach().abs() * 2**-7).all()


# -- the benchmark script and the interpreter run ----------------------------------------------

@pytest.mark.skipif(INTERPRET, reason="the CPU smoke test needs the reference dispatch")
def test_optimizer_benchmark_smoke_on_the_cpu(tmp_path: Path) -> None:
    """The kernels harness's optimizer case (benchmarks/kernel_peers/optimizer.py) on tiny models on the
    CPU: its correctness check passes."""
    out = tmp_path / "optimizer.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernel_peers", "optimizer", "--device", "cpu", "--small",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["harness"] == "benchmarks.kernel_peers optimizer" and report["check_failed"] == []
    assert {(r["model"], r["dtype"]) for r in rows} == {(m, d) for m in ("gpt-tiny", "llama-tiny")
                                                       for d in ("bf16", "fp32")}
    assert all(r["check"]["passed"] for r in rows), rows


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="this process already runs Triton's interpreter")
def test_the_specs_under_the_interpreter() -> None:
    """This file in a fresh process with TRITON_INTERPRET=1: every spec above on the Triton kernel."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "2 skipped" in summary, summary
