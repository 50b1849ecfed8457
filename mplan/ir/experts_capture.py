"""Capture recognizes experts modules and records each as one `moe_experts` op.

Hugging Face's experts (transformers 5: `MixtralExperts`, `Qwen2MoeExperts`, ...) loop over the
experts `nonzero()` finds (data-dependent: torch.export refuses it) or run `torch._grouped_mm`
on a sort of the routed tokens; either way the export would show no MoE layer, only its pieces
or a failure. What they compute is fixed by transformers' experts interface
(`transformers.integrations.moe.use_experts_implementation`): forward(hidden_states [T, h],
top_k_index [T, k], top_k_weights [T, k]) over stacked weights `gate_up_proj` [E, 2F, h]
(gate rows, then up rows) or `up_proj` [E, F, h] without a gate, `down_proj` [E, h, F] and
`act_fn`. While capturing, such a module's forward calls `mplan.kernels.moe.moe_experts`
instead, which export keeps as one node: the same function of the same weights.

A module is recognized by that interface's attributes and layout, not by its class name:
    has_gate, has_bias, is_transposed, is_concatenated flags set by the interface's decorator;
    3-D weights whose shapes fit [E, G*F, h] and [E, h, F];
    an activation that equals one of `ACTIVATIONS` on a probe tensor;
    the interface's own gate (`_apply_gate` not overridden: act(gate) * up).
Variants the op does not describe (biases, transposed or interleaved weights, a post-expert
norm, a custom gate: gpt-oss) are left as they are; their export then succeeds or names the
construct it cannot trace. mplan's own MoE family calls the op directly.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn

from mplan.kernels.moe import ACTIVATIONS, moe_experts

def activation_name(fn: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The name in `ACTIVATIONS` of the function `fn` computes (on a probe made per call: a
    module-level tensor would stay alive with the module), or None."""
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            value = fn(probe)
    except Exception:  # an activation that does not take a float64 tensor is not one of ours
        return None
    for name, candidate in ACTIVATIONS.items():
        if isinstance(value, torch.Tensor) and torch.allclose(value, candidate(probe), rtol=1e-9, atol=1e-12):
            return name
    return None


def _standard_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    return gate is None or getattr(gate, "__name__", "") == "_default_apply_gate"


def experts_call(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """`moe_experts` on `module`'s weights, if it follows transformers' experts interface in a
    layout the op describes (module docstring); None otherwise."""
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    if not all(isinstance(getattr(module, f, None), bool) for f in flags):
        return None
    if module.has_bias or module.is_transposed or not module.is_concatenated or \
            getattr(module, "has_post_expert_norm", False) or not _standard_gate(module):
        return None
    w_in = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    w_out = getattr(module, "down_proj", None)
    if not isinstance(w_in, torch.Tensor) or not isinstance(w_out, torch.Tensor) or w_in.dim() != 3 \
            or w_out.dim() != 3:
        return None
    experts, width, hidden = w_in.shape
    ffn = width // 2 if module.has_gate else width
    if tuple(w_out.shape) != (experts, hidden, ffn) or (module.has_gate and width % 2):
        return None
    activation = activation_name(getattr(module, "act_fn", None) or (lambda x: None))
    if activation is None:
        return None
    gated = module.has_gate

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        w_in = module.gate_up_proj if gated else module.up_proj
        return moe_experts(hidden_states, top_k_index, top_k_weights, w_in, module.down_proj,
                           activation=activation, gated=gated)
    return forward


@contextlib.contextmanager
def experts_as_op(model: nn.Module) -> Iterator[list[str]]:
    """While inside, every recognized experts module of `model` runs `moe_experts`; yields their
    names. Restores each module's own forward on exit."""
    patched: list[tuple[nn.Module, object]] = []
    names: list[str] = []
    try:
        for name, module in model.named_modules():
            call = experts_call(module)
            if call is None:
                continue
            patched.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = functools.wraps(type(module).forward)(call)
            names.append(name)
        yield names
    finally:
        for module, previous in patched:
            if previous is _MISSING:
                del module.forward
            else:
                module.forward = previous


_MISSING = object()
