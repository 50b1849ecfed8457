"""`python -m benchmarks.equivalence CASE --out FILE`: the equivalence harness (see the package docstring)."""
import sys

from benchmarks import harness
from benchmarks.equivalence import __doc__ as doc
from benchmarks.equivalence import experts, fusion, gpus, pipelines, zoo

sys.exit(harness.main("equivalence", doc or "", {"pipelines": pipelines, "experts": experts, "zoo": zoo,
                                                 "gpus": gpus, "fusion": fusion}))
