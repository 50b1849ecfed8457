"""Repeated-block detection: find the N identical transformer layers of a model.

Candidates come from the module tree: every `nn.ModuleList`/`nn.Sequential` whose children share
one class and one parameter layout (the outermost such container wins; containers nested in a
block belong to the block). Identity is then checked structurally on the traced graph: two
instances are the same block type only if their op sequences, output shapes and (relative)
parameter names agree. Instances that differ become separate block types.

Shallow capture traces only the first `keep` instances of each container; `truncate_containers`
swaps the lists for short ones while tracing and restores them afterwards.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

import torch.nn as nn


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    """A list of same-class submodules: where repeated blocks live."""

    path: str  # FQN of the ModuleList ("layers", "model.layers", "transformer.h")
    class_name: str  # class of its children
    num_children: int


def _layout(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def find_containers(model: nn.Module) -> list[Container]:
    """Outermost module lists whose children all have the same class and parameter layout."""
    found: list[Container] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        if any(path == c.path or path.startswith(c.path + ".") for c in found):
            continue
        children = list(module)
        first = children[0]
        if all(type(c) is type(first) and _layout(c) == _layout(first) for c in children[1:]):
            # A list of leaf modules (e.g. a list of Linear) is not a block structure.
            if any(True for _ in first.children()) or len(list(first.parameters())) > 2:
                found.append(Container(path=path, class_name=type(first).__name__,
                                       num_children=len(children)))
    return found


@contextlib.contextmanager
def truncate_containers(model: nn.Module, containers: list[Container], keep: int) -> Iterator[None]:
    """Temporarily keep only the first `keep` children of each container (shallow capture)."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for c in containers:
            if c.num_children <= keep:
                continue
            parent_path, _, attr = c.path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            original = parent._modules[attr]
            short = type(original)(list(original)[:keep]) if isinstance(original, nn.Sequential) \
                else nn.ModuleList(list(original)[:keep])
            parent._modules[attr] = short
            swapped.append((parent, attr, original))
        yield
    finally:
        for parent, attr, original in reversed(swapped):
            parent._modules[attr] = original


_INDEX = re.compile(r"^(\d+)(?:\.|$)")


def instance_of(module_path: str, containers: list[Container]) -> tuple[Container, int] | None:
    """The container and child index a module path falls in, if any."""
    for c in containers:
        if module_path.startswith(c.path + ".") or not c.path:
            rest = module_path[len(c.path) + 1:] if c.path else module_path
            m = _INDEX.match(rest)
            if m:
                return c, int(m.group(1))
    return None


def relative_name(name: str, prefix: str) -> str:
    """`layers.3.attn.q_proj.weight` relative to `layers.3` -> `attn.q_proj.weight`."""
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else name
