"""`python -m benchmarks.ranks CASE --out FILE`: the ranks harness (see the package docstring).

The cases import mplan inside their functions: zero3-prefetch's jobs run this module beside an
older commit's mplan, which may lack what another case uses."""
import sys

from benchmarks import harness
from benchmarks.ranks import __doc__ as doc
from benchmarks.ranks import checkpoint, outer_loop, two_sites, zero3_prefetch, zero_memory

sys.exit(harness.main("ranks", doc or "", {"zero-memory": zero_memory, "zero3-prefetch": zero3_prefetch,
                                           "outer-loop": outer_loop, "checkpoint": checkpoint,
                                           "two-sites": two_sites}))
