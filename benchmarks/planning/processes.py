"""A measured run in a fresh process: its wall and CPU seconds and its JSON output.

Planning time is quoted start-up included, as a user meets it, and peak memory per capture, so
each run gets its own interpreter; CPU seconds (user + system, every thread) are recorded beside
wall seconds because other processes on a shared machine stretch wall time far more."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import Any


def run_json(args: list[str]) -> tuple[dict[str, Any], float, float]:
    """Run `python ARGS`, whose stdout is one JSON document: (that document, wall s, CPU s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads(done.stdout), wall, cpu
