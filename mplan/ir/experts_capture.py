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
norm, a custom gate: gpt-oss; experts outside the interface: Llama-4's, which scale each
expert's input by its router score where the op weights its output) are left as they are; their
export then succeeds or names the construct it cannot trace, and `declined_experts` names each
with why (capture keeps the list on the graph for `mplan inspect`). mplan's own MoE family calls
the op directly.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
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


def decline_reason(module: nn.Module) -> str | None:
    """Why `moe_experts` cannot stand for `module`, in a few words; None when it can (the module
    follows transformers' experts interface in a layout the op describes: module docstring).
    Only meaningful for an experts module (`looks_like_experts`, or the interface's flags)."""
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    if not all(isinstance(getattr(module, f, None), bool) for f in flags):
        if len(inspect.signature(module.forward).parameters) == 1:
            return ("its forward takes the tokens alone, routed outside it, not top-k ids and weights (Llama-4 "
                    "scales each expert's input by its score; the op can only weight outputs)")
        return "not transformers' experts interface (forward(hidden_states, top_k_index, top_k_weights))"
    why = [text for bad, text in (
        (module.has_bias, "biases"), (module.is_transposed, "transposed weights"),
        (not module.is_concatenated, "interleaved gate/up rows"),
        (getattr(module, "has_post_expert_norm", False), "a norm after each expert"),
        (not _standard_gate(module), f"its own gate ({type(module).__name__}._apply_gate)")) if bad]
    if why:
        return ", ".join(why)
    w_in = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    w_out = getattr(module, "down_proj", None)
    if not isinstance(w_in, torch.Tensor) or not isinstance(w_out, torch.Tensor) or w_in.dim() != 3 \
            or w_out.dim() != 3:
        return "no 3-D stacked weights gate_up_proj (or up_proj) and down_proj"
    experts, width, hidden = w_in.shape
    ffn = width // 2 if module.has_gate else width
    if tuple(w_out.shape) != (experts, hidden, ffn) or (module.has_gate and width % 2):
        return f"weights {tuple(w_in.shape)} and {tuple(w_out.shape)} are not [E, G*F, h] and [E, h, F]"
    if activation_name(getattr(module, "act_fn", None) or (lambda x: None)) is None:
        return f"an activation ({type(getattr(module, 'act_fn', None)).__name__}) not among {sorted(ACTIVATIONS)}"
    return None


def looks_like_experts(module: nn.Module) -> bool:
    """`module` holds stacked expert weights: two or more 3-D parameters of its own with one dim-0
    size (the experts), e.g. Llama-4's `gate_up_proj` [E, h, 2F] and `down_proj` [E, F, h]. Used to
    name the experts capture leaves as plain ops; recognition itself reads the interface."""
    stacked = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(stacked) >= 2 and len(set(stacked)) == 1


def declined_experts(model: nn.Module) -> dict[str, str]:
    """Experts modules of `model` that capture leaves as plain ATen ops (the planner replicates
    them; the model computes exactly what it wrote), by name, with why."""
    return {name: f"{type(module).__name__}: {reason}" for name, module in model.named_modules()
            if (looks_like_experts(module) or isinstance(getattr(module, "has_gate", None), bool))
            and (reason := decline_reason(module)) is not None}


def experts_call(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """`moe_experts` on `module`'s weights, if it follows transformers' experts interface in a
    layout the op describes (module docstring); None otherwise (`decline_reason` says why)."""
    if decline_reason(module) is not None:
        return None
    activation = activation_name(getattr(module, "act_fn", None) or (lambda x: None))
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
