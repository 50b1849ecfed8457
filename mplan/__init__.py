"""mplan: automatic parallelization planner for PyTorch training (TP, SP, PP, DP/ZeRO, EP).

The public names (docs/contract.md), loaded on first use so that `import mplan` stays light (the
planner needs PuLP, the GPU benchmark machines may not have it, and the CLI starts faster).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ClusterSpec": "mplan.cost_models.cluster",
    "Plan": "mplan.planner.plan",
    "PlanError": "mplan.planner.plan",
    "plan": "mplan.planner.planning",
    "capture": "mplan.ir.trace",
    "CaptureError": "mplan.ir.trace",
    "autoparallel": "mplan.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mplan' has no attribute {name!r}")
