"""Low-precision compute copies of the weights autocast casts: Megatron's bf16 weights beside fp32 masters.

Under autocast with fp32 parameters every linear casts its weight and bias to bf16 at each
forward (read 4 bytes, write 2, per parameter) and autograd casts their bf16 gradients back to
fp32 (read 2, write 4). On GPT-1.3B on the H200 those casts took 9.2 ms of mplan's 262 ms step
(benchmarks/results/step_profile_autocast_h200-2026-11-29-session4.json). Here each such
parameter gets a persistent copy in the autocast dtype, which the program reads instead (the
cast autocast then applies to it is a no-op); its gradient stays in that dtype; the optimizer
updates the fp32 parameter from it, and the copy is rewritten from the updated parameter: by
mplan's AdamW kernel in the same pass (`mplan.kernels.adamw.step(copies=...)`), else by a cast
of the gradient to the parameter before the torch optimizer's step and a copy after it.

Which parameters (`autocast_cast_parameters`): those every use of which in the local program is
an input autocast casts to its dtype: a linear's weight or bias, directly or through the
concatenation of a grouped projection (cast after concatenating or before: the same values),
a grouped GEMM's or the fused head + loss's weights and biases (which they cast as F.linear
does), and bias_gelu's bias (which it casts itself). Embedding tables, norm weights and output heads
tied to an embedding are read in fp32 and keep no copy; nor does a parameter whose gradient is
reduced over ranks (its bucket holds the master's dtype: `ComputeCopies` is given only the
others).

Exactness: a copy holds bf16(master), what autocast's cast gives; the gradient autograd gives a
cast copy is its bf16 gradient widened exactly, which is what the optimizer reads here. Losses
and parameters are those of the run without copies, step for step (tests/test_compute_copies.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.fx as fx
from torch import nn

aten = torch.ops.aten


def _casts_its_input(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user` reads `value` only where autocast casts it to its lower dtype."""
    from mplan.kernels import bias_gelu, linear_cross_entropy  # the kernels load Triton: not at `import mplan`
    from mplan.kernels.grouped_linear import grouped_linear, joined_weights

    if user.op != "call_function":
        return False
    if user.target is grouped_linear:  # (x, weights, biases): cast as F.linear casts
        return value is not user.args[0] and (value in user.args[1] or value in user.args[2])
    if user.target is linear_cross_entropy:  # (x, weight, labels, ignore_index, bias): the head's GEMM
        return value is not user.args[0] and value in (user.args[1], user.args[4])
    if user.kwargs:
        return False
    if user.target is aten.linear.default:
        return value not in user.args[:1] and value in user.args[1:]
    if user.target is bias_gelu:
        return user.args[0] is not value and user.args[1] is value
    if user.target is joined_weights:  # a grouped projection's weights (or biases), then its linear
        return value in user.args[0] and bool(user.users) and all(
            _casts_its_input(after, user) for after in user.users)
    return False


def autocast_cast_parameters(program: fx.GraphModule, placeholders: Mapping[str, str]) -> set[str]:
    """Parameter names (`placeholders`: placeholder -> parameter name) whose every use in
    `program` is an input that autocast casts to its lower dtype."""
    names = set()
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in placeholders and node.users and all(
                _casts_its_input(user, node) for user in node.users):
            names.add(placeholders[node.name])
    return names


class ComputeCopies:
    """Each master parameter's copy in `dtype` (a leaf that requires grad), and its upkeep."""

    def __init__(self, masters: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
        self.copies: dict[nn.Parameter, torch.Tensor] = {}
        for run in _end_to_end_runs(list(masters)):
            # masters lying end to end in one storage (a grouped GEMM's, `grouped_storage.py`) get
            # copies end to end in one storage too, so the GEMM reads its copies without concatenating
            storage = torch.empty(sum(m.numel() for m in run), dtype=dtype, device=run[0].device)
            at = 0
            for master in run:
                copy = storage[at:at + master.numel()].view(master.shape)
                copy.copy_(master.detach())
                self.copies[master] = copy.requires_grad_()
                at += master.numel()

    def __len__(self) -> int:
        return len(self.copies)

    def of(self, master: nn.Parameter) -> torch.Tensor:
        """What the program reads for `master`: its copy, or the master itself if it has none."""
        return self.copies.get(master, master)

    def grad_of(self, master: nn.Parameter) -> torch.Tensor | None:
        """The gradient accumulated for `master` this step (its copy's, where it has one)."""
        return self.copies[master].grad if master in self.copies else master.grad

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies := the masters, rounded (after anything but mplan's AdamW changed them)."""
        for master, copy in self.copies.items():
            copy.copy_(master)

    def zero_grad(self) -> None:
        for copy in self.copies.values():
            copy.grad = None

    @torch.no_grad()
    def fill_missing_grads(self) -> None:
        """A copy that received no gradient steps with zeros, as its master would (data_parallel.py)."""
        for copy in self.copies.values():
            if copy.grad is None:
                copy.grad = torch.zeros_like(copy)

    @torch.no_grad()
    def widen_grads(self) -> None:
        """master.grad := the copy's gradient in the master's dtype: for an optimizer that is not
        mplan's AdamW (it reads the copies' gradients itself)."""
        for master, copy in self.copies.items():
            master.grad = copy.grad.to(master.dtype)


def _end_to_end_runs(masters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`masters` in runs of those lying end to end in one storage (`grouped_linear.end_to_end`,
    the test the kernel makes), in the storage's order; a master alone is a run of one."""
    from mplan.kernels.grouped_linear import end_to_end  # the kernels load Triton: not at `import mplan`

    runs: list[list[nn.Parameter]] = []
    for master in sorted(masters, key=lambda m: (str(m.device), m.untyped_storage().data_ptr(), m.storage_offset())):
        if runs and end_to_end([runs[-1][-1], master]):
            runs[-1].append(master)
        else:
            runs.append([master])
    return runs
