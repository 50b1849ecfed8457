"""Writing a benchmark's JSON report, the same way for every script under benchmarks/.

    write_report(path, report)   the report as indented JSON with a final newline (folders made)
    triton_version()             Triton's version for the report, or None where it is not installed
"""
from __future__ import annotations

import json
import os
from typing import Any


def write_report(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
        handle.write("\n")


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
