"""Graph capture and the typed IR: `capture(model, inputs) -> Graph`; pipeline schedules as data.

The IR knows nothing of planning: it records what the model computes (ops, shapes, FLOPs,
bytes, parameters, saved activations, repeated blocks, MoE layers: `moe.py`, each layer's
experts one op from `experts_capture.py`) and what a pipeline schedule does.
Names load on first use, so the schedule IR can be imported without torch (planning is light).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "capture": "mplan.ir.trace", "CaptureError": "mplan.ir.trace",
    **{name: "mplan.ir.graph" for name in ("BlockType", "Graph", "OpNode", "ParamInfo", "Segment",
                                           "TensorMeta", "dtype_bytes")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mplan.ir' has no attribute {name!r}")
