"""`python -m benchmarks.planning CASE --out FILE`: the planning harness (see the package docstring)."""
import sys

from benchmarks import harness
from benchmarks.planning import __doc__ as doc
from benchmarks.planning import capture, context, dynamic_cp, plan_time

sys.exit(harness.main("planning", doc or "", {"time": plan_time, "capture": capture, "context": context,
                                              "dynamic-cp": dynamic_cp}))
