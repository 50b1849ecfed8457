"""`python -m benchmarks.reprice CASE --out FILE [flags]`: the harness's command line over the cases."""
from __future__ import annotations

from benchmarks import harness, reprice
from benchmarks.reprice import activation_bytes, adamw_share, e2e, host_fit, megatron, races

CASES = {"races": races, "e2e": e2e, "activation-bytes": activation_bytes, "host-fit": host_fit,
         "adamw-share": adamw_share, "megatron": megatron}

if __name__ == "__main__":
    raise SystemExit(harness.main("reprice", reprice.__doc__ or "", CASES))
