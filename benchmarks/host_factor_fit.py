"""How far the host term's micro-benchmarks are from mplan's own runtime, from GPU measurements
already taken (issue 30): one factor fitted on one row, held out on the others. CPU only.

The host figures `mplan profile` measures (`measure_device.measure_host`) time tiny eager ops, one
kind at a time. mplan's training step pays more per op than such a stream: its fused kernels are
autograd Functions whose Python forward and backward allocate and launch several kernels, the
local program is an FX module, and each micro-batch runs its own hooks. On an H100 a host-bound
step (micro-batch 1) of a Qwen2-0.5B config measured 117 ms a micro-batch where the priced host
term said far less. This script asks whether one factor on every host figure closes that gap:

1. read the measured rows: `host_overhead_h100-2026-12-05.json` (Qwen2-0.5B, 8 x 1024 tokens, at
   micro-batch 1, 2 and 8) and the `hf_measure` rows (Qwen3-1.7B and SmolLM2-1.7B shapes, 8 x 2048
   tokens, micro-batch 1 and 8), all on one H100, and the H100's profile from the same session
   (`profile_h100-2026-12-05.json`, its kernel tables and measured host figures);
2. fit f on the FIT row alone (Qwen2-0.5B at micro-batch 1, the most host-bound), by bisection on
   the predicted step time with every host figure scaled by f (the Planner's `host_factor`);
3. predict every other row at f = 1 (as measured) and at the fitted f: those are held out.

    PYTHONPATH=. python3 benchmarks/host_factor_fit.py --out benchmarks/results/host_factor_fit-cpu-2026-12-05.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mplan.cost_models.cluster import ClusterSpec  # noqa: E402
from mplan.planner.parallel_config import parse_plan_spec  # noqa: E402
from mplan.planner.planning import capture_for_planning  # noqa: E402
from mplan.planner.search import Planner  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIT = ("qwen2-0.5b", 1)
"""The one row the factor is fitted on: the most host-bound step measured."""


def measured_rows(hf_rows: list[Path]) -> list[dict[str, Any]]:
    """(model, config path, seq, mbs, measured step s), from the results files."""
    import hf_bench
    from host_overhead import write_config

    work = Path(os.environ.get("TMPDIR", "/tmp")) / "host_factor_fit"
    work.mkdir(parents=True, exist_ok=True)
    overhead = json.loads((RESULTS / "host_overhead_h100-2026-12-05.json").read_text())
    qwen2 = work / "qwen2-0.5b.json"
    write_config(overhead["config"], qwen2)
    rows = [{"model": "qwen2-0.5b", "config": qwen2, "seq": overhead["seq_len"], "mbs": r["mbs"],
             "measured_step_s": r["measured_step_s"], "source": "host_overhead_h100-2026-12-05.json"}
            for r in overhead["comparison"]["rows"] if r["measured_step_s"]]
    for path in hf_rows:
        name = path.name.split("_rows")[0]
        config = hf_bench.write_config(name, work, small=False)
        for r in json.loads(path.read_text())["plans"]:
            step = (r.get("measured") or {}).get("step_time_s")
            if step:
                rows.append({"model": name, "config": config, "seq": 2048,
                             "mbs": parse_plan_spec(r["spec"]).mbs, "spec": r["spec"],
                             "measured_step_s": step, "source": path.name})
    return rows


class Pricer:
    """Predicted step seconds of a row's plan under a host factor; one capture per model."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster, self.graphs = cluster, {}

    def __call__(self, row: dict[str, Any], factor: float) -> float:
        key = (str(row["config"]), row["seq"])
        if key not in self.graphs:
            self.graphs[key] = capture_for_planning(str(row["config"]), seq_len=row["seq"])
        planner = Planner(self.graphs[key], self.cluster, kernels=True, runtime="mplan", host_factor=factor)
        spec = parse_plan_spec(row.get("spec") or f"dp=1,tp=1,pp=1,mbs={row['mbs']},recompute=none")
        return planner.search(8, spec).best.step_time_s


def fit(pricer: Pricer, row: dict[str, Any]) -> float:
    """The factor whose prediction of `row` equals its measurement (bisection: monotone in f)."""
    low, high = 0.0, 16.0
    for _ in range(20):
        middle = (low + high) / 2
        if pricer(row, middle) < row["measured_step_s"]:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-rows", nargs="*", type=Path,
                        default=sorted(RESULTS.glob("hf_measure_h100-2026-12-05_work/*_rows.json")))
    args = parser.parse_args()
    cluster = ClusterSpec.from_json(str(RESULTS / "profile_h100-2026-12-05.json"))
    rows = measured_rows(args.hf_rows)
    pricer = Pricer(cluster)
    fit_row = next(r for r in rows if (r["model"], r["mbs"]) == FIT and "spec" not in r)
    factor = fit(pricer, fit_row)
    table = []
    for r in rows:
        at_one, at_fit = pricer(r, 1.0), pricer(r, factor)
        table.append({"model": r["model"], "mbs": r["mbs"], "spec": r.get("spec"), "source": r["source"],
                      "measured_step_s": r["measured_step_s"], "predicted_as_measured_s": at_one,
                      "predicted_fitted_s": at_fit, "error_as_measured": round(at_one / r["measured_step_s"] - 1, 4),
                      "error_fitted": round(at_fit / r["measured_step_s"] - 1, 4), "fitted_on": r is fit_row})
        print(json.dumps(table[-1]), flush=True)
    held = [t for t in table if not t["fitted_on"]]
    report = {"date": time.strftime("%Y-%m-%d"), "device": "NVIDIA H100 80GB HBM3 (measured 2026-12-05)",
              "profile": "profile_h100-2026-12-05.json", "fitted_on": f"{FIT[0]} at micro-batch {FIT[1]}",
              "factor": round(factor, 4), "rows": table,
              "held_out_worst_error_fitted": max(abs(t["error_fitted"]) for t in held),
              "held_out_worst_error_as_measured": max(abs(t["error_as_measured"]) for t in held)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"factor {factor:.3f}; held out: worst {report['held_out_worst_error_fitted']:.1%} fitted, "
          f"{report['held_out_worst_error_as_measured']:.1%} as measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
