"""The I/W split of a stage's backward (`runtime/split_backward.py`) against plain autograd.

Every stage runs its micro-batches in ZB-H1's order (F0 F1 I0 I1 W0 W1) and is compared with
F0 B0 F1 B1 done by `torch.autograd.backward`: the input gradients and the parameter gradients
accumulated over the micro-batches must be bitwise equal (float64, CPU, same kernels on the
same values). After I the test keeps only what the executor sends (the input gradients) and
the `WeightGradients`, so W must not depend on anything else holding the graph. Other checks:
I does only the input-side work and W does not re-run it (counted flops, counted backward
nodes, a counted custom Function on the input path); `.grad` views survive; the micro-batch's
saved tensors die with W; unused, frozen and non-differentiable pieces are left alone.
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import Node
from torch.utils.flop_counter import FlopCounterMode

from mplan.runtime.split_backward import WeightGradients, backward_full, backward_input

HIDDEN, FFN, VOCAB, TOKENS = 6, 10, 11, 5
NUM_MICRO_BATCHES = 2
Outputs = tuple[list[torch.Tensor], list[torch.Tensor | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """A pipeline stage: its module, each micro-batch's inputs, and how it makes its outputs."""

    module: nn.Module
    inputs: Callable[[int], list[torch.Tensor]]  # fresh tensors (leaves) for micro-batch mb
    run: Callable[[list[torch.Tensor], int], Outputs]  # outputs and their gradients

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.module.parameters())


def _gen(mb: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + mb)


def _activation(mb: int) -> list[torch.Tensor]:
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=_gen(mb)).requires_grad_()]


def _output_grad(mb: int, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, dtype=like.dtype, generator=_gen(mb, salt=1))


def counted_identity() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[int]]:
    """An identity autograd.Function whose backward calls are counted."""
    calls = [0]

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return grad

    return Identity.apply, calls


class Scale(torch.autograd.Function):
    """x * w over the last dim, as a custom Function: a Python-defined node reading a parameter."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class Block(nn.Module):
    """Pre-norm MLP with a residual: x + W2 tap(gelu(W1 LN(x) + b1)) + b2 (tap: a counted identity)."""

    def __init__(self, tap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        super().__init__()
        self.norm, self.tap = nn.LayerNorm(HIDDEN), tap
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.tap(F.gelu(self.up(self.norm(x)))))


def block_stage(tap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Stage:
    torch.manual_seed(0)
    module = Block(tap).double()

    def run(inputs: list[torch.Tensor], mb: int) -> Outputs:
        y = module(inputs[0])
        return [y], [_output_grad(mb, y)]

    return Stage(module=module, inputs=_activation, run=run)


def _ids(mb: int) -> list[torch.Tensor]:
    return [torch.randint(VOCAB, (TOKENS,), generator=_gen(mb, salt=2))]


def _targets(mb: int) -> torch.Tensor:
    return torch.randint(VOCAB, (TOKENS,), generator=_gen(mb, salt=3))


class TiedLM(nn.Module):
    """Embedding and output head sharing one weight, with a block between (one stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block = nn.Embedding(VOCAB, HIDDEN), Block()

    def forward(self, ids: torch.Tensor, mb: int, x: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids) if x is None else x + self.embed(ids)
        return F.cross_entropy(F.linear(self.block(h), self.embed.weight), _targets(mb))


def tied_first_stage() -> Stage:
    """A whole model in one stage: token ids in, loss out; no differentiable input."""
    torch.manual_seed(1)
    module = TiedLM().double()
    return Stage(module=module, inputs=_ids, run=lambda inputs, mb: ([module(inputs[0], mb)], [None]))


def tied_last_stage() -> Stage:
    """Activations and ids in, loss out: the tied weight is read below and beside the input path."""
    torch.manual_seed(2)
    module = TiedLM().double()
    return Stage(module=module, inputs=lambda mb: _ids(mb) + _activation(mb),
                 run=lambda inputs, mb: ([module(inputs[0], mb, inputs[1])], [None]))


class Twice(nn.Module):
    """One weight read by two ops where one feeds the other: through nn.Linear, or directly."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.weight, self.direct = nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN), direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.direct:
            return torch.tanh(x @ self.weight) @ self.weight
        return F.linear(torch.tanh(F.linear(x, self.weight)), self.weight)


def twice_stage(direct: bool) -> Stage:
    torch.manual_seed(3)
    module = Twice(direct).double()

    def run(inputs: list[torch.Tensor], mb: int) -> Outputs:
        y = module(inputs[0])
        return [y], [_output_grad(mb, y)]

    return Stage(module=module, inputs=_activation, run=run)


class ScaledBlock(nn.Module):
    """A Python-defined node (Scale) on both the input path and a parameter's path."""

    def __init__(self) -> None:
        super().__init__()
        self.gain, self.block = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN)), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(self.block(x), self.gain)


def scaled_stage() -> Stage:
    torch.manual_seed(4)
    module = ScaledBlock().double()

    def run(inputs: list[torch.Tensor], mb: int) -> Outputs:
        y = module(inputs[0])
        return [y], [_output_grad(mb, y)]

    return Stage(module=module, inputs=_activation, run=run)


STAGES: dict[str, Callable[[], Stage]] = {
    "block": block_stage,
    "tied_first_stage": tied_first_stage,
    "tied_last_stage": tied_last_stage,
    "linear_twice": lambda: twice_stage(direct=False),
    "matmul_twice": lambda: twice_stage(direct=True),
    "custom_function": scaled_stage,
}


def reference(stage: Stage, start: float | None = None) -> tuple[list[list[torch.Tensor | None]], list[torch.Tensor]]:
    """F0 B0 F1 B1 ... with plain autograd: each micro-batch's input grads, and the param grads
    accumulated onto `.grad` filled with `start` (None: no `.grad` to start from)."""
    for p in stage.params:
        p.grad = None if start is None else torch.full_like(p, start)
    input_grads = []
    for mb in range(NUM_MICRO_BATCHES):
        inputs = stage.inputs(mb)
        outputs, grads = stage.run(inputs, mb)
        torch.autograd.backward(outputs, grads)
        input_grads.append([x.grad for x in inputs])
    found = [p.grad for p in stage.params]
    for p in stage.params:
        p.grad = None
    return input_grads, found


def zb_h1_order(stage: Stage) -> tuple[list[tuple[torch.Tensor | None, ...]], list[WeightGradients]]:
    """F0 F1 ... then I0 I1 ...; returns each I's input grads and the W passes, not yet run."""
    pending = [(inputs, *stage.run(inputs, mb)) for mb, inputs in
               ((mb, stage.inputs(mb)) for mb in range(NUM_MICRO_BATCHES))]
    input_grads, weights = [], []
    while pending:
        inputs, outputs, grads = pending.pop(0)
        sent, weight = backward_input(outputs, grads, inputs, stage.params)
        input_grads.append(sent)
        weights.append(weight)
    return input_grads, weights


def _assert_same(actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert (a is None) == (e is None)
        if e is not None:
            assert torch.equal(a, e), f"max abs diff {(a - e).abs().max().item():.3g}"


@pytest.mark.parametrize("name", list(STAGES))
def test_i_then_w_equals_plain_backward(name: str) -> None:
    stage = STAGES[name]()
    expected_inputs, expected_params = reference(stage)
    input_grads, weights = zb_h1_order(stage)
    gc.collect()  # only the WeightGradients hold the graphs now (the outputs went out of scope)
    for mb, expected in enumerate(expected_inputs):
        _assert_same(list(input_grads[mb]), expected)
    assert all(p.grad is None for p in stage.params), "I must not touch parameter gradients"
    for weight in weights:
        weight.run()
    _assert_same([p.grad for p in stage.params], expected_params)


@pytest.mark.parametrize("name", list(STAGES))
def test_backward_full_equals_plain_backward(name: str) -> None:
    stage = STAGES[name]()
    expected_inputs, expected_params = reference(stage)
    for mb, expected in enumerate(expected_inputs):
        inputs = stage.inputs(mb)
        outputs, grads = stage.run(inputs, mb)
        _assert_same(list(backward_full(outputs, grads, inputs, stage.params)), expected)
    _assert_same([p.grad for p in stage.params], expected_params)


def test_first_stage_input_pass_computes_nothing() -> None:
    stage = tied_first_stage()
    inputs = stage.inputs(0)
    outputs, grads = stage.run(inputs, 0)
    with FlopCounterMode(display=False) as flops:
        sent, weight = backward_input(outputs, grads, inputs, stage.params)
    assert sent == (None,) and flops.get_total_flops() == 0
    assert all(p.grad is None for p in stage.params)
    weight.run()
    assert all(p.grad is not None for p in stage.params)


def test_existing_grads_are_accumulated_in_place() -> None:
    stage = block_stage()
    _, expected = reference(stage, start=0.25)
    bucket = torch.full((sum(p.numel() for p in stage.params),), 0.25, dtype=torch.float64)
    offset = 0
    for p in stage.params:
        p.grad = bucket[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    before = [(p.grad, p.grad.data_ptr()) for p in stage.params]
    for weight in zb_h1_order(stage)[1]:
        weight.run()
    for p, (grad, pointer) in zip(stage.params, before):
        assert p.grad is grad and p.grad.data_ptr() == pointer
    assert torch.equal(bucket, torch.cat([g.flatten() for g in expected]))


def _backward_flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(("name", "extra"), [("block", 0), ("linear_twice", 0), ("matmul_twice", 1)])
def test_input_and_weight_passes_share_one_backwards_work(name: str, extra: int) -> None:
    """I's GEMM flops are those of the input gradients alone; I + W those of one backward,
    plus, for a weight two chained matmuls read directly, the one dX GEMM the module docstring
    says W step 1 recomputes."""
    stage = STAGES[name]()
    (x,) = stage.inputs(0)
    outputs, grads = stage.run([x], 0)
    input_only = _backward_flops(lambda: torch.autograd.grad(outputs, [x], grads, retain_graph=True))
    full = _backward_flops(lambda: torch.autograd.grad(outputs, [x, *stage.params], grads, retain_graph=True))
    input_pass = _backward_flops(lambda: backward_input(outputs, grads, [x], stage.params))
    sent, weight = backward_input(outputs, grads, [x], stage.params)
    weight_pass = _backward_flops(weight.run)
    dx_gemm = 2 * TOKENS * HIDDEN * HIDDEN
    assert input_pass == input_only < full
    assert input_pass + weight_pass == full + extra * dx_gemm


def _graph_nodes(outputs: list[torch.Tensor]) -> list[Node]:
    seen: dict[Node, None] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen[node] = None
            stack.extend(child for child, _ in node.next_functions if child is not None)
    return list(seen)


def test_weight_pass_does_not_rerun_the_input_path() -> None:
    tap, calls = counted_identity()
    stage = block_stage(tap)
    inputs = stage.inputs(0)
    outputs, grads = stage.run(inputs, 0)
    ran: dict[str, list[str]] = {"I": [], "W": []}
    phase = ["I"]
    handles = [node.register_hook(lambda gi, go, node=node: ran[phase[0]].append(node.name()))
               for node in _graph_nodes(outputs)]
    _, weight = backward_input(outputs, grads, inputs, stage.params)
    assert calls == [1]
    phase[0] = "W"
    weight.run()
    for handle in handles:
        handle.remove()
    assert calls == [1], "the input path's custom Function ran again in W"
    # I: the input path only, no transpose-of-weight or bias node; W: the nodes where the
    # parameters' paths leave it (each once) and the parameter-only nodes below them.
    assert sorted(ran["I"]) == sorted(["AddBackward0", "AddmmBackward0", "IdentityBackward", "GeluBackward0",
                                       "AddmmBackward0", "NativeLayerNormBackward0"])
    assert sorted(ran["W"]) == sorted(["AddmmBackward0", "AddmmBackward0", "NativeLayerNormBackward0",
                                       "TBackward0", "TBackward0"])


class _Saved:
    """What a saved_tensors_hooks pack returns: alive exactly as long as autograd keeps it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.mark.parametrize("name", ["block", "custom_function"])
def test_activations_live_until_the_weight_pass(name: str) -> None:
    stage = STAGES[name]()
    saved: weakref.WeakSet[_Saved] = weakref.WeakSet()

    def pack(tensor: torch.Tensor) -> _Saved:
        holder = _Saved(tensor)
        saved.add(holder)
        return holder

    inputs = stage.inputs(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor):
        outputs, grads = stage.run(inputs, 0)
    total = len(saved)
    sent, weight = backward_input(outputs, grads, inputs, stage.params)
    del outputs, grads, inputs
    gc.collect()
    assert 0 < len(saved) <= total, "what W needs must outlive I"
    weight.run()
    assert len(saved) == 0, f"{len(saved)} saved tensors outlived W"
    assert sent[0] is not None


def test_second_run_is_an_error() -> None:
    stage = block_stage()
    weight = zb_h1_order(stage)[1][0]
    weight.run()
    with pytest.raises(RuntimeError, match=r"run\(\) was already called"):
        weight.run()


class Partial(nn.Module):
    """An unused parameter, a frozen one, and a second output that does not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused, self.frozen = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 3), nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.used(self.frozen(x)), self.frozen(x.detach())


def test_unused_frozen_and_non_differentiable_parts_are_left_alone() -> None:
    torch.manual_seed(5)
    module = Partial().double()
    params = list(module.parameters())
    unused_grad = torch.ones(3, HIDDEN, dtype=torch.float64)
    module.unused.weight.grad = unused_grad
    (x,) = _activation(0)
    y, z = module(x)
    g = _output_grad(0, y)
    sent, weight = backward_input([y, z], [g, None], [x], params)
    weight.run()
    expected = torch.autograd.grad(module.used(module.frozen(x)), [x, module.used.weight], g)
    _assert_same([sent[0], module.used.weight.grad], list(expected))
    assert module.unused.weight.grad is unused_grad and torch.equal(unused_grad, torch.ones(3, HIDDEN))
    assert module.unused.bias.grad is None and module.frozen.weight.grad is None


def test_bad_arguments_are_rejected() -> None:
    stage = block_stage()
    (x,) = stage.inputs(0)
    (y,), _ = stage.run([x], 0)
    with pytest.raises(ValueError, match="ones only for a scalar"):
        backward_input([y], [None], [x], stage.params)
    with pytest.raises(ValueError, match="1 outputs but 2 output gradients"):
        backward_full([y], [None, None], [x], stage.params)
    with pytest.raises(ValueError, match="input 0 requires grad but is not a leaf"):
        backward_input([y], [torch.ones_like(y)], [x * 2], stage.params)
