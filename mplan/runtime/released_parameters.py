"""zero=3's parameters between steps: the right shape over freed storage, refusing to be read.

Role: `runtime/fully_sharded.py` releases each unit's gathered weights by resizing their storage
to 0 bytes, leaving every parameter tensor in place (autograd's saved tensors and the program's
feeds keep pointing at it). torch does not check a tensor's storage bounds, so reading such a
tensor reads freed memory: garbage, or a crash. Outside a step `pm.params` hold exactly these.
Input: the ParallelModule's parameters by name. Output: the same Parameter objects, whose class is
`ReleasedParameter` between steps (`guard`) and plain `nn.Parameter` inside them (`unguarded`),
so a step's ops pay nothing for the guard.

What a `ReleasedParameter` (and a view of it) does while its storage is released:
    metadata (shape, dtype, device, the storage object and its size, the gradient, hooks,
    requires_grad, identity)                 as any tensor
    detach(), .data                          a `ReleasedTensor` over the same storage, as guarded
    repr / str / format                      one line saying what it is and how to read it
    anything that reads values               RuntimeError, one line: read it whole with
                                             pm.whole_parameter(name) or pm.full_state_dict()
Reading values is never gathered here: a gather is a collective, which one rank reading a tensor
cannot start on the others.
Invariants: the guard looks at the storage on every call, so a guarded tensor whose storage holds
its elements (inside `pm.optimizer.parameters_whole()`, a unit gathered mid-step) reads as any
tensor; the classes change, never the tensors' storage or autograd identity.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

METADATA = frozenset({
    "shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "layout", "is_cuda", "is_cpu",
    "is_meta", "is_sparse", "is_quantized", "is_nested", "is_floating_point", "is_complex", "get_device",
    "requires_grad", "requires_grad_", "is_leaf", "grad", "_grad", "grad_fn", "_grad_fn", "_version", "output_nr",
    "untyped_storage", "storage_offset", "stride", "is_contiguous", "element_size", "itemsize", "nbytes",
    "data_ptr", "register_hook", "register_post_accumulate_grad_hook", "_backward_hooks",
    "_post_accumulate_grad_hooks", "retains_grad", "__len__", "__hash__", "names", "_is_view", "_base",
})
"""What reads no element: allowed on a released tensor."""
ALIASES = frozenset({"detach", "detach_", "data"})
"""The views torch makes without checking the storage's bounds: allowed while released."""
VIEWS = ALIASES | {"view", "view_as", "t", "T", "mT", "transpose", "permute", "unsqueeze", "squeeze", "expand",
                   "expand_as", "narrow", "select", "split", "chunk", "unbind", "unflatten", "as_strided"}
"""Ops that always return a view: their result is guarded too (taken while the storage is whole, it
reads the same storage once released). The others than `ALIASES` check the storage's bounds, so
while it is released they are refused like a read."""
_DESCRIBED = frozenset({"__repr__", "__str__", "__format__"})
_NAME = "_mplan_released_name"


def _name_of(func: Callable[..., Any]) -> str:
    """The attribute or method `func` is (a property's getter and setter come as `__get__`/`__set__`)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _released(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage is too small for its elements (zero=3 resized it to 0 bytes)."""
    with torch._C.DisableTorchFunctionSubclass():
        if tensor.numel() == 0:
            return False
        extent = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
        return tensor.untyped_storage().nbytes() < extent * tensor.element_size()


def _describe(tensor: torch.Tensor) -> str:
    name = getattr(tensor, _NAME, "?")
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
    return (f"<{name}: {shape} {dtype}, released by zero=3 between steps; read it with "
            f"pm.whole_parameter({name!r}) or pm.full_state_dict()>")


def _guarded_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> Any:
    source = next((a for a in args if isinstance(a, _Guard)), None)
    name = _name_of(func)
    if source is not None and name not in METADATA and _released(source):
        label = getattr(source, _NAME, "?")
        if name in _DESCRIBED:
            text = _describe(source)
            return format(text, *args[1:]) if name == "__format__" else text
        if name not in ALIASES:
            raise RuntimeError(
                f"{label} is a zero=3 shard released between steps (0 bytes of storage): `{name}` would read "
                f"freed memory; read it whole with pm.whole_parameter({label!r}) or pm.full_state_dict()")
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    if source is not None and name in VIEWS:  # guarded too: it reads the same storage once released
        for view in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(view) is torch.Tensor:
                view.__class__ = ReleasedTensor
                setattr(view, _NAME, getattr(source, _NAME, "?"))
    return out


class _Guard:
    """The `__torch_function__` both guarded classes share (module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        return _guarded_call(func, args, kwargs)


class ReleasedParameter(_Guard, nn.Parameter):
    """A zero=3 parameter between steps (module docstring)."""


class ReleasedTensor(_Guard, torch.Tensor):
    """A view of a released parameter (module docstring)."""


def guard(params: Mapping[str, nn.Parameter]) -> None:
    """Make each of `params` a `ReleasedParameter` named by its key (between steps)."""
    for name, param in params.items():
        param.__class__ = ReleasedParameter
        setattr(param, _NAME, name)


@contextlib.contextmanager
def unguarded(params: Mapping[str, nn.Parameter]) -> Iterator[None]:
    """`params` plain Parameters inside the context (a step, inference), guarded again after it."""
    for param in params.values():
        param.__class__ = nn.Parameter
    try:
        yield
    finally:
        guard(params)
