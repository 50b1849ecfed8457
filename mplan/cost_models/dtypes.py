"""Canonical dtype names for cost modelling.

Role: one vocabulary for the number formats the cost models and profiles talk about, so a
device peak, a GEMM timing and a memory estimate all key on the same short string.
Input: a name as users write it ("bf16", "bfloat16", "torch.bfloat16", a ``torch.dtype``).
Output: the canonical short name and its storage size in bytes.
Invariants: ``DTYPES`` is closed; ``tf32`` is a compute mode stored as fp32 (4 bytes); ``fp8`` is
either e4m3 or e5m2 (1 byte). Nothing here imports torch.
"""
from __future__ import annotations

DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "tf32", "fp8", "fp64")
"""Canonical names, in the order device specs and profiles list them."""

_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp8": 1, "fp64": 8}

_ALIASES: dict[str, str] = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8", "e4m3": "fp8", "e5m2": "fp8",
}


def canonical_dtype(dtype: object) -> str:
    """The canonical short name of ``dtype`` (a string or a ``torch.dtype``); ValueError if unknown."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in _BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)} "
                         f"(or a torch name such as bfloat16)")
    return name


def dtype_bytes(dtype: object) -> int:
    """Storage size of one element of ``dtype``, in bytes."""
    return _BYTES[canonical_dtype(dtype)]
