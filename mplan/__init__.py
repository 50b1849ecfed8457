"""mplan: automatic parallelization planner for PyTorch training.

Public names are re-exported here as the stages that define them land; see DESIGN.md.
"""
from __future__ import annotations

__version__ = "0.1.0"
