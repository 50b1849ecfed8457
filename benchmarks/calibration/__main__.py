"""`python -m benchmarks.calibration CASE --out FILE [flags]`: the harness's command line over the cases."""
from __future__ import annotations

from benchmarks import calibration, harness
from benchmarks.calibration import (activation_probe, bench_cli, card_profile, copy_table, cp_attention, host,
                                    memory_timeline, split_backward, steps, steps_check, train_summary)

CASES = {"steps": steps, "steps-check": steps_check, "host": host, "memory-timeline": memory_timeline,
         "activation-probe": activation_probe, "split-backward": split_backward, "copy-table": copy_table,
         "cp-attention": cp_attention, "bench-cli": bench_cli, "profile": card_profile,
         "train-summary": train_summary}

if __name__ == "__main__":
    raise SystemExit(harness.main("calibration", calibration.__doc__ or "", CASES))
