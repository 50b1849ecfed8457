"""Writing a benchmark's JSON report, the same way for every script under benchmarks/.

    write_report(path, report)   the report as indented JSON with a final newline (folders made)
    triton_version()             Triton's version for the report, or None where it is not installed
    run_header(device)           a report's first keys: date, GPU (or the CPU smoke test), versions
    machine_header()             the same for a CPU run that is not a smoke test: the machine and the commit
    package_versions(*names)     {name: installed version or None}, for the packages a run times or loads
    Clock()                      seconds since the script began: time-stamped log lines and budgets

Run as a script, it checks the docs' figures against these reports (benchmarks/claims.py):

    python benchmarks/report.py --check [--list]
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import torch


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


def run_header(device: torch.device) -> dict[str, Any]:
    return {"date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke test)",
            "torch": torch.__version__, "python": platform.python_version(), "triton": triton_version()}


def package_versions(*names: str) -> dict[str, str | None]:
    """Each installed distribution's version (None where it is not installed): the peers a run
    times (liger-kernel) or the models it loads (transformers)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in names}


def machine_header() -> dict[str, Any]:
    """Date, machine, versions and commit of a run measured or predicted on this CPU (planning
    time, a re-pricing): what a reader needs to know which checkout gave the figures."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return {"date": datetime.date.today().isoformat(),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "python": platform.python_version(), "mplan_commit": commit or None}


class Clock:
    """Seconds since it was made; `log` prints a line stamped with them to stderr."""

    def __init__(self) -> None:
        self.began = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)


def main() -> int:
    if "--check" not in sys.argv[1:]:
        print("usage: python benchmarks/report.py --check [--list]   (the docs' figures against benchmarks/results/)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import claims

    return claims.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
