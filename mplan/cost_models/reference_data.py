"""The reference figures shipped inside the package, found and read from there.

Role: one place that knows where the reference files live, so that no code path reads anything
outside the installed package. The files are package data (``mplan/cost_models/reference/``,
listed in pyproject.toml; their sources are in that folder's README.md):
  megatron-sc21-a100.json        published Megatron-LM runs (read by ``megatron_reference.py``)
  h200-measured-2026-11-29.json  GEMMs, copy bandwidth and a GPT step measured on one H200
  h200-kernels-2026-11-29.json   memory-bound kernels (eager and torch.compile) on one H200
Input: a file name from ``REFERENCE_FILES``. Output: its path, or validated figures.
Invariants: an unknown name, a missing file or a malformed field raises ``ReferenceError`` naming
the file (and the field).
"""
from __future__ import annotations

import re
from importlib import resources

from mplan.json_fields import FieldReader, load_json_file


class ReferenceError(ValueError):
    """A reference file is unknown, missing or malformed."""


REFERENCE_FILES = ("megatron-sc21-a100.json", "h200-measured-2026-11-29.json", "h200-kernels-2026-11-29.json")
"""The files of ``mplan/cost_models/reference/``."""

_GEMM_KEY = re.compile(r"gemm_(\d+)x(\d+)x(\d+)_tflops")


def reference_path(name: str) -> str:
    """The path of a packaged reference file (inside the installed ``mplan`` package)."""
    if name not in REFERENCE_FILES:
        raise ReferenceError(f"unknown reference file {name!r}; files: {', '.join(REFERENCE_FILES)}")
    return str(resources.files("mplan.cost_models").joinpath("reference", name))


def load_h200_gemm_points(path: str | None = None) -> tuple[tuple[int, int, int, float], ...]:
    """The bf16 GEMMs of h200-measured-2026-11-29.json as (m, n, k, FLOP/s), in file order."""
    path = path or reference_path("h200-measured-2026-11-29.json")
    doc = load_json_file(path, ReferenceError)
    reader = FieldReader(doc, file=path, path="", error=ReferenceError)
    keys = [key for key in doc if _GEMM_KEY.fullmatch(key)]
    if not keys:
        raise ReferenceError(f"{path}: no gemm_MxNxK_tflops field")
    points = []
    for key in keys:
        m, n, k = (int(g) for g in _GEMM_KEY.fullmatch(key).groups())  # type: ignore[union-attr]
        points.append((m, n, k, reader.number(key) * 1e12))
    return tuple(points)
