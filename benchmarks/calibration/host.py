"""Host time per launch, measured, and the step times it predicts at micro-batch 1, 2 and 8 (issue 30).

Small micro-batches leave the GPU waiting on the host: an H100 step of a 1.7B Qwen-style config at
micro-batch 1 measured 1015 ms against 493 ms predicted, 2.96x its micro-batch-8 step for the same
tokens. This case checks the cost model's host term against a measurement, in three steps:
  1. `measure_device.measure_host` on this GPU: host seconds per ATen op, view, extra launch,
     backward node, Triton launch and AdamW tensor (streams of tiny ops, the device idle);
  2. a Qwen2-style Hugging Face config.json (transformers writes it; 0.5B shape, 8 x 1024 tokens a
     step), and a cluster file: this GPU's preset (h200 with its packaged kernel tables, else
     dgx-h100 on one GPU) carrying the measured host figures;
  3. `mplan bench CONFIG --measure` under torchrun (one rank) at mbs=1, 2 and 8 (dp=1, the same 8
     sequences a step), as a user runs it; and the same plans predicted with a free host (every
     host figure 0), in this process, to show what the host term adds.
Per micro-batch it reports the measured step, both predictions and their errors (predicted /
measured - 1), and the micro-batch-1 over micro-batch-8 ratio measured and predicted.
`--apply PROFILE` writes the measured host figures into a profile file (its kernel tables kept),
as `copy-table --apply` does for copies.

Run on the GPU (a few minutes, most of it capture and the first steps):
    PYTHONPATH=. python -m benchmarks.calibration host --out $OUT/host_overhead.json
Smoke test on a CPU (tiny config, gloo, the cpu preset; nothing is judged):
    PYTHONPATH=. python -m benchmarks.calibration host --device cpu --small --out /tmp/host.json
The cluster file and config it benches sit beside --out, in <out stem>_work/. (host_overhead_h100-2026-12-05.json
was made by the old `benchmarks/host_overhead.py` with the same flags, from hf_measure_gpu.sh.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.calibration.gpu import device_of
from benchmarks.report import run_header
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.measure_device import measure_host
from mplan.cost_models.profile import ClusterProfile, DeviceProfile, HostTiming

ROOT = Path(__file__).resolve().parents[2]

MICRO_BATCHES = (1, 2, 8)
GLOBAL_BATCH = 8


def qwen2_config(small: bool) -> tuple[dict[str, Any], int]:
    """A Qwen2-style config (Qwen2-0.5B's shape; tiny for the smoke test) and its sequence length."""
    if small:
        sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=128)
        seq = 32
    else:
        sizes = dict(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936)
        seq = 1024
    return {**sizes, "max_position_embeddings": seq, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}, seq


def write_config(sizes: dict[str, Any], path: Path) -> None:
    import transformers

    config = transformers.Qwen2Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                      attn_implementation="sdpa", use_cache=False)
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = "bfloat16"
    path.write_text(config.to_json_string())


def cluster_with(host: HostTiming, device_name: str) -> ClusterSpec:
    """This device's preset (its packaged kernel tables where it has them) carrying `host`."""
    if device_name == "cpu":
        base = ClusterSpec.preset("cpu", gpus_per_node=1)
    elif "H200" in device_name:
        base = ClusterSpec.preset("h200")
    else:
        base = ClusterSpec.preset("dgx-h100", gpus_per_node=1)
    profile = base.profile or ClusterProfile(note="host figures only (issue 30)")
    device = profile.device or DeviceProfile(name=device_name, torch_version=host.source,
                                             measured_on=time.strftime("%Y-%m-%d"))
    return base.with_profile(dataclasses.replace(profile, device=dataclasses.replace(device, host=host)))


def free_host(host: HostTiming) -> HostTiming:
    return dataclasses.replace(host, aten_op_s=0.0, view_op_s=0.0, launch_s=0.0, backward_node_s=0.0,
                               triton_launch_s=0.0, adamw_foreach_tensor_s=0.0, adamw_fused_tensor_s=0.0,
                               source="free host: the prediction without the host term")


def specs() -> list[str]:
    return [f"dp=1,tp=1,pp=1,mbs={mbs},recompute=none" for mbs in MICRO_BATCHES]


def bench_measured(config: Path, cluster: Path, seq: int, rows: Path, timeout_s: float) -> dict[str, Any]:
    """`mplan bench --measure` under torchrun, one rank, as a user runs it; its rows or why none."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mplan", "bench",
               str(config), "--cluster", str(cluster), "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(seq),
               "--plans", *specs(), "--measure", "--out", str(rows)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))})
        result: dict[str, Any] = {"returncode": done.returncode, "stderr": done.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        result = {"error": f"no exit within {timeout_s:.0f} s"}
    result.update(command=" ".join(command[1:]), wall_s=round(time.perf_counter() - started, 1))
    if rows.exists():
        result["rows"] = json.loads(rows.read_text())
    return result


def predicted_free(config: Path, cluster: ClusterSpec, seq: int) -> list[float | None]:
    """The same plans' predicted step seconds with a free host, planned in this process."""
    from mplan.bench import bench_plans

    rows = bench_plans(str(config), cluster, GLOBAL_BATCH, specs(), seq_len=seq)
    return [(row.get("predicted") or {}).get("step_time_s") for row in rows]


def compare(rows: dict[str, Any], free: list[float | None]) -> dict[str, Any]:
    """Per micro-batch: measured, predicted with and without the host term, and their errors."""
    table = []
    for mbs, row, without in zip(MICRO_BATCHES, rows.get("plans", []), free):
        measured = (row.get("measured") or {}).get("step_time_s")
        predicted = (row.get("predicted") or {}).get("step_time_s")
        entry: dict[str, Any] = {"mbs": mbs, "measured_step_s": measured, "predicted_step_s": predicted,
                                 "predicted_free_host_step_s": without,
                                 "error": row.get("error") or (row.get("measured") or {}).get("error")}
        if measured and predicted and without:
            entry.update(prediction_error=round(predicted / measured - 1, 4),
                         free_host_error=round(without / measured - 1, 4))
        table.append(entry)
    by = {e["mbs"]: e for e in table}
    ratios: dict[str, Any] = {}
    if all(by.get(m, {}).get(k) for m in (1, 8) for k in ("measured_step_s", "predicted_step_s",
                                                            "predicted_free_host_step_s")):
        ratios = {f"mbs1_over_mbs8_{k.removesuffix('_step_s')}": round(by[1][k] / by[8][k], 3)
                  for k in ("measured_step_s", "predicted_step_s", "predicted_free_host_step_s")}
    return {"rows": table, "ratios": ratios}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--timeout-s", type=float, default=420.0, help="for the measured bench")
    parser.add_argument("--apply", default=None, help="also write the measured host figures into this profile file")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The host figures, the measured bench and both predictions; a report without measured rows says why
    in `bench` (its return code and stderr)."""
    import transformers

    device = device_of(args, "host")
    out = Path(args.out)
    work = out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    host = measure_host(args.device, quick=args.small)
    print(f"host per launch: {json.dumps(dataclasses.asdict(host))}", flush=True)
    sizes, seq = qwen2_config(args.small)
    config = work / "qwen2.json"
    write_config(sizes, config)
    cluster = cluster_with(host, device_name)
    cluster_path = work / "cluster.json"
    cluster.to_json(str(cluster_path))
    measured = bench_measured(config, cluster_path, seq, work / "rows.json", args.timeout_s)
    free = predicted_free(config, cluster_with(free_host(host), device_name), seq)
    report = {
        **run_header(device), "transformers": transformers.__version__, "device": device_name, "config": sizes,
        "seq_len": seq, "global_batch": GLOBAL_BATCH, "host": dataclasses.asdict(host),
        "method": "host figures by measure_device.measure_host; step times by `mplan bench --measure` under "
                  "torchrun (one rank) on a cluster file carrying them; the free-host prediction is the same "
                  "plan with every host figure 0; errors are predicted / measured - 1",
        "bench": measured, "comparison": compare(measured.get("rows", {}), free)}
    print(json.dumps(report["comparison"], indent=1))
    if not measured.get("rows"):
        print("host: the measured bench wrote no rows (see the report's bench)", file=sys.stderr)
    if args.apply:
        profile = ClusterProfile.from_json(args.apply)
        if profile.device is None:
            raise SystemExit(f"host: {args.apply} has no device tables to add host figures to")
        dataclasses.replace(profile, device=dataclasses.replace(profile.device, host=host)).to_json(args.apply)
        print(f"wrote the host figures into {args.apply}")
    return report
