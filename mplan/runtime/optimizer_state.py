"""What the distributed optimizers take in and hand out: parameter groups and tensor-only state.

Input: parameters as torch optimizers accept them (tensors, or dicts of parameter groups);
a torch optimizer's nested `state_dict()`. Output: normalized parameter groups; a flat
`dict[str, Tensor]` that safetensors or `torch.save(..., weights_only)` can store, and back.
Checkpoints never need pickled Python objects (DESIGN.md: nothing is ever unpickled).

Flat keys:
    state.<param index>.<name>         per-parameter state (`exp_avg`, `step`, ...)
    param_groups.<group index>.<name>  numeric hyperparameters (`lr`, `betas`, `weight_decay`)

Invariants: hyperparameters that are not numbers, booleans or tuples of numbers (None,
strings, such as `foreach=None`) are not stored: they come from the live optimizer on load,
as do the parameter indices of each group. Loading restores Python types from the live
values (`betas` stays a tuple of floats).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

ParamsArg = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
"""What torch optimizers accept: parameters, or parameter groups with per-group options."""


@dataclass(frozen=True, slots=True)
class StateRange:
    """Elements [start, stop) of `param` (flattened, row-major) whose optimizer state this rank
    keeps in `holder` (the tensor the torch optimizer steps: the parameter itself, or a ZeRO-1
    shard of master weights), starting at element `at` of it. What checkpoints read and write."""

    param: torch.Tensor
    holder: torch.Tensor
    start: int
    stop: int
    at: int


def as_param_groups(params: ParamsArg) -> list[dict[str, Any]]:
    """Parameter groups as torch optimizers normalize them: each a dict with a `params` list."""
    items = list(params)
    if not items:
        raise ValueError("the optimizer got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        return [{**group, "params": list(group["params"])} for group in items]
    if any(isinstance(item, dict) for item in items):
        raise TypeError("pass either parameters or parameter-group dicts, not a mix")
    return [{"params": items}]


def flatten_optimizer_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A torch optimizer's `state_dict()` as a flat dict of tensors."""
    flat: dict[str, torch.Tensor] = {}
    for index, entries in state["state"].items():
        for name, value in entries.items():
            flat[f"state.{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    for index, group in enumerate(state["param_groups"]):
        for name, value in group.items():
            tensor = _numeric_tensor(value) if name != "params" else None
            if tensor is not None:
                flat[f"param_groups.{index}.{name}"] = tensor
    return flat


def unflatten_optimizer_state(
    flat: Mapping[str, torch.Tensor], live: Mapping[str, Any]
) -> dict[str, Any]:
    """The nested state dict for `load_state_dict`, completed from the live optimizer's."""
    param_groups = [dict(group) for group in live["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, index, name = _split_key(key)
        if kind == "state":
            state.setdefault(index, {})[name] = value
        elif index >= len(param_groups):
            raise ValueError(f"{key}: the optimizer has only {len(param_groups)} parameter groups")
        else:
            param_groups[index][name] = _like(value, param_groups[index].get(name))
    return {"state": state, "param_groups": param_groups}


def _split_key(key: str) -> tuple[str, int, str]:
    parts = key.split(".", 2)
    if len(parts) != 3 or parts[0] not in ("state", "param_groups") or not parts[1].isdigit():
        raise ValueError(
            f"{key}: not an optimizer state key (state.<i>.<name> or param_groups.<i>.<name>)"
        )
    return parts[0], int(parts[1]), parts[2]


def _numeric_tensor(value: Any) -> torch.Tensor | None:
    if torch.is_tensor(value):
        return value
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, (tuple, list)) and value and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def _like(value: torch.Tensor, live: Any) -> Any:
    """`value` converted to the Python type the live hyperparameter has."""
    if torch.is_tensor(live) or live is None:
        return value
    if isinstance(live, bool):
        return bool(value.item())
    if isinstance(live, int):
        return int(value.item())
    if isinstance(live, float):
        return float(value.item())
    if isinstance(live, (tuple, list)):
        return type(live)(value.tolist())
    return value
