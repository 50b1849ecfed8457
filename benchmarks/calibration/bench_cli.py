"""Does `mplan bench CONFIG.json --measure` predict the step and peak of the HF models users bring?

Two sets of Hugging Face configs (--configs):

  seen     the three models of benchmarks/models/hf_models.py (Llama at TinyLlama-1.1B's shape, Mistral
           ~1B, Qwen2-1.5B), plan `auto`; target (issue 19, item 6): |error| <= 5% for both
  unseen   three configs never benchmarked here before (issue 30, "A GPU it never saw"), at
           micro-batch 1, 2 and 8 with and without recomputation; target |error| <= 10% on every row:
           - qwen3: Qwen3-1.7B's shape (28 layers, hidden 2048, 16 heads / 8 KV heads of 128, q/k
             RMSNorm, SwiGLU 6144, vocabulary 151,936, tied head);
           - smollm2: SmolLM2-1.7B's shape, a Llama (24 layers, hidden 2048, 32 heads, no GQA, SwiGLU
             8192, vocabulary 49,152, tied head);
           - gemma: Gemma-2B's shape (18 layers, hidden 2048, 8 heads / 1 KV head of 256, GeGLU 16384,
             vocabulary 256,000, `1 + weight` RMSNorm, scaled embedding, tied head).

For each config it writes the `config.json` a user would hand to mplan (transformers'
`to_json_string`, `torch_dtype` bfloat16, `architectures` naming the class), then runs the CLI
exactly as a user does, one process per config:
    python3 -m torch.distributed.run --nproc-per-node 1 -m mplan bench CONFIG --cluster CLUSTER \\
        --global-batch 8 --seq-len 2048 --plans PLANS --measure --out ROWS.json
and reads the rows back. CLUSTER is the packaged measured profile on an H200 (`h200`); on any other
GPU the case first runs `mplan profile` (this machine's kernels, about 35 s) and benches on that
file, as a user of a GPU mplan never saw would; --cluster names another. Every measured row is
judged: predicted against measured step time and peak memory (`mplan.bench`'s prediction_error,
predicted / measured - 1, the memory against max_memory_allocated); a row that failed keeps its
error and the others still run (`mplan bench` isolates rows). The report names the card, torch,
transformers and Python, and the cluster the rows were priced on. The report is rewritten after
each model (a run killed from outside keeps the models done), then once more by the harness.

This case was benchmarks/hf_bench.py until 2026-12-07: the hf_bench_*, hf_measure* and hf_reprice-*
results were made by `python3 benchmarks/hf_bench.py` with the same flags, but for
hf_measure_h100-2026-12-05.json, made by benchmarks/hf_measure_gpu.py (the unseen set until
2026-12-06, when hf_bench.py still priced the seen set on the h200 preset whatever the card).

Run on the GPU (about a minute per model, most of it the CPU-side capture and the first steps; a
256k-vocabulary model's rows take minutes):
    PYTHONPATH=. python3 -m benchmarks.calibration bench-cli --out $OUT/hf_bench.json
    PYTHONPATH=. python3 -m benchmarks.calibration bench-cli --configs unseen --models qwen3 --out $OUT/hf_measure.json
`--profile` adds one step per row under torch.profiler (its kernel time by kind and largest kernels,
in the rows): the evidence where a price misses, e.g. what micro-batch 1 runs beyond 8's kernels.
A model whose process outlived --timeout-s after writing its rows (they are rewritten after each
plan) is judged on them; `--rejudge` re-reads an earlier run's rows files from the folder beside
--out (`<stem>_work/`) and rewrites its judgements into --out, running nothing.
Priced again on a CPU after a cost-model change, beside earlier runs' measurements, each row as the
plan that ran (its resolved spec: an `auto` row is not searched again), several runs of one config
joining (e.g. a later call that measured the rows an earlier one's budget cut); the seen set's H200 run
with `--reprice benchmarks/results/hf_bench_h200-2026-12-02.json --cluster h200`:
    PYTHONPATH=. python3 -m benchmarks.calibration bench-cli \\
        --reprice benchmarks/results/hf_measure_h100-2026-12-06-qwen3.json \\
        --cluster benchmarks/results/profile_h100-2026-12-06-graphed.json --out /tmp/repriced.json
Smoke test on a CPU (tiny configs, one gloo rank, the cpu cluster preset; nothing is judged):
    PYTHONPATH=. python3 -m benchmarks.calibration bench-cli --device cpu --small --out /tmp/hf_bench.json
    PYTHONPATH=. python3 -m benchmarks.calibration bench-cli --configs unseen --device cpu --small \\
        --out /tmp/hf_measure.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNSEEN_PLANS = ("mbs=1", "mbs=2", "mbs=8", "mbs=1,recompute=selective", "mbs=2,recompute=selective",
                "mbs=8,recompute=selective", "mbs=8,recompute=full")
"""The unseen set's plans: micro-batch 1, 2 and 8 of a global batch of 8, without and with recomputation."""

UNSEEN: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                                  tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
                                  rope_theta=1e6)),
    "smollm2": ("LlamaConfig", dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=32,
                                    num_key_value_heads=32, intermediate_size=8192, vocab_size=49152,
                                    tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                    rope_theta=130000.0)),
    "gemma": ("GemmaConfig", dict(num_hidden_layers=18, hidden_size=2048, num_attention_heads=8,
                                  num_key_value_heads=1, head_dim=256, intermediate_size=16384, vocab_size=256000,
                                  tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=8192,
                                  rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh")),
}
"""The unseen set: each config's transformers class and its published shape."""
FULL_SHAPE = (8, 2048)
"""global batch and sequence length of every run (SMALL_SHAPE: the smoke test's)"""
SMALL_SHAPE = (2, 32)
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64)
"""An unseen config's sizes in the smoke test (the seen set's tiny sizes are hf_models's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigSet:
    """One set of configs and what a run of it defaults to and is judged by."""

    models: tuple[str, ...]
    plans: tuple[str, ...]
    target: float
    """the largest |prediction_error| of step time and of peak memory a row may have"""
    timeout_s: float
    """per model: its `mplan bench --measure` process"""
    why: str


SETS = {
    "seen": ConfigSet(models=("llama", "mistral", "qwen2"), plans=("auto",), target=0.05, timeout_s=240.0,
                      why="issue 19: predicted step time and peak memory within 5% of the measured ones"),
    "unseen": ConfigSet(models=tuple(UNSEEN), plans=UNSEEN_PLANS, target=0.10, timeout_s=500.0,
                        why="issue 30: predicted step time and peak memory within 10% of the measured ones, "
                            "on every row"),
}


def write_config(name: str, directory: Path, *, small: bool) -> Path:
    """The named config's config.json as transformers writes it, in bf16, naming its class."""
    if name in UNSEEN:
        return _write_unseen(name, directory, small=small)
    # the seen set: the same three models, by the same definitions (imported here: it loads mplan and the race)
    from benchmarks.models import hf_step as hf_models

    model = {m.name: m for m in hf_models._families(small)}[name]
    config = model.config()
    config.architectures = [model.model_class]
    config.dtype = "bfloat16"
    path = directory / f"{name}.json"
    path.write_text(config.to_json_string())
    return path


def _write_unseen(name: str, directory: Path, *, small: bool) -> Path:
    """An unseen config's config.json as transformers writes it (bf16, naming its causal-LM class)."""
    import transformers

    class_name, sizes = UNSEEN[name]
    sizes = {**sizes, **SMALL} if small else dict(sizes)
    theta = sizes.pop("rope_theta")
    config = getattr(transformers, class_name)(**sizes, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                               use_cache=False)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    config.dtype = "bfloat16"
    path = directory / f"{name}.json"
    path.write_text(config.to_json_string())
    return path


def cluster_for(device: str, work: Path, timeout_s: float) -> tuple[str, dict[str, Any]]:
    """`h200` (the packaged measured profile) on an H200; on another GPU, a profile measured now."""
    if device == "cpu":
        return "cpu", {"source": "the cpu preset (smoke test)"}
    import torch

    name = torch.cuda.get_device_name()
    if "H200" in name.upper():
        return "h200", {"source": f"packaged H200 profile ({name})"}
    path = work / "cluster.json"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mplan",
                           "profile", "-o", str(path), "--no-links", "-q"], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ".")})
    if done.returncode != 0:
        raise SystemExit(f"mplan profile failed on {name}:\n{done.stderr[-3000:]}")
    return str(path), {"source": f"`mplan profile` on this {name}", "seconds": round(time.perf_counter() - started, 1),
                       "profile": json.loads(path.read_text())}


def bench_one(config: Path, rows_path: Path, *, cluster: str, global_batch: int, seq_len: int,
              plans: list[str], timeout_s: float, profile: bool = False) -> dict[str, Any]:
    """One `mplan bench --measure` under torchrun (`profile`: with `--profile`); its rows, or why there are none."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mplan", "bench",
               str(config), "--cluster", cluster, "--global-batch", str(global_batch), "--seq-len", str(seq_len),
               "--plans", *plans, "--measure", *(["--profile"] if profile else []), "--out", str(rows_path)]
    # the output goes to a file as it comes, so a process killed at the timeout still leaves its
    # progress lines (each phase's and each row's seconds): where the time went
    log = rows_path.with_suffix(".log")
    started = time.perf_counter()
    result: dict[str, Any] = {"command": " ".join(command[1:]), "log": log.name}
    with log.open("w", encoding="utf-8") as sink:
        try:
            result["returncode"] = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                                  timeout=timeout_s, env={**os.environ, "PYTHONPATH":
                                                                          os.environ.get("PYTHONPATH", ".")}).returncode
        except subprocess.TimeoutExpired:  # the rows are rewritten after each plan: a late exit may still have them
            result["error"] = f"no exit within {timeout_s:.0f} s"
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["output_tail"] = log.read_text(encoding="utf-8", errors="replace")[-4000:]
    if rows_path.exists():
        result["rows"] = json.loads(rows_path.read_text())
    return result


def judge(rows: dict[str, Any], *, target: float) -> list[dict[str, Any]]:
    """Per measured plan: predicted vs measured step and memory, and whether both are within `target`."""
    judged = []
    for row in rows.get("plans", []):
        measured = row.get("measured") or {}
        error = measured.get("prediction_error")
        entry: dict[str, Any] = {"spec": row["spec"], "resolved_spec": row.get("resolved_spec"),
                                 "predicted_step_s": (row.get("predicted") or {}).get("step_time_s")}
        if not error:
            entry["not_measured"] = measured.get("error") or row.get("error") or "no measurement"
        else:
            entry.update(measured_step_s=measured["step_time_s"], measured_peak_gib=measured.get("peak_memory_gib"),
                         predicted_allocated_gib=error["predicted_allocated_gib"],
                         step_time_error=error["step_time"], peak_memory_error=error["peak_memory"])
            errors = [e for e in (error["step_time"], error["peak_memory"]) if e is not None]
            entry["within_target"] = all(abs(e) <= target for e in errors)
        judged.append(entry)
    return judged


def rejudge(out: Path, configs: str, small: bool) -> dict[str, Any]:
    """Judge again an earlier report's models on the rows files its run left (module docstring); a model
    whose rows exist but whose report entry does not (the run was killed in it) is added, and so is
    the report itself where the run was killed before writing one (then its versions are unknown)."""
    work = out.parent / (out.stem + "_work")
    if out.exists():
        report = json.loads(out.read_text())
    else:
        report = {"configs": configs, "recovered": "the run was killed before writing its report: rebuilt from the "
                                                   "rows and configs in its work folder; versions not recorded",
                  "models": {}}
    target = SETS[report.get("configs", configs)].target
    batch, seq = SMALL_SHAPE if small else FULL_SHAPE  # what main ran them at
    report.setdefault("global_batch", batch)
    report.setdefault("seq_len", seq)
    for rows in sorted(work.glob("*_rows.json")):  # a model the run was killed in has rows, no entry
        name = rows.name.removesuffix("_rows.json")
        if name not in report["models"] and (work / f"{name}.json").exists():
            report["models"][name] = {"config": json.loads((work / f"{name}.json").read_text()),
                                      "error": "killed before its report entry was written"}
    for name, result in report["models"].items():
        rows = work / f"{name}_rows.json"
        on_disk = json.loads(rows.read_text()) if rows.exists() else {}
        # the rows file is rewritten after each plan: a process that outlived its timeout may have added some
        if len(on_disk.get("plans", [])) > len(result.get("rows", {}).get("plans", [])):
            result["rows"] = on_disk
            result["rows_read_after_the_run"] = True
        if not report.get("gpu"):  # a rebuilt report: the card its rows were measured on
            report["gpu"] = next((p["measured"]["device"] for p in result.get("rows", {}).get("plans", [])
                                  if (p.get("measured") or {}).get("device")), None)
        result["judged"] = judge(result.get("rows", {}), target=target)
        print(f"{name}: {json.dumps(result['judged'])}")
    judged = [row for result in report["models"].values() for row in result["judged"]]
    report["summary"] = summary(judged)
    return report


def summary(judged: list[dict[str, Any]]) -> dict[str, int]:
    """How many rows ran, were measured and came within the target."""
    return {"rows": len(judged), "measured": sum("not_measured" not in r for r in judged),
            "within_target": sum(bool(r.get("within_target")) for r in judged)}


def reprice(measured: list[Path], cluster: str) -> dict[str, Any]:
    """Price earlier runs' configs and plans again with this checkout's cost model (`mplan bench`
    without --measure, on `cluster`) and set each price beside its run's measured step: how a cost
    model change moves the error on steps already measured, with no GPU. The configs are the ones the
    runs wrote (kept in their reports), the plans the ones they measured. Several runs of one model
    (a later call measuring the rows an earlier one's budget cut) join when their config, batch and
    sequence agree; each row names the run it was measured in."""
    import transformers

    from benchmarks.report import machine_header

    runs = [(path, json.loads(path.read_text())) for path in measured]
    for _, then in runs:  # runs before 2026-12-05 ran at FULL_SHAPE and did not record it
        then.setdefault("global_batch", FULL_SHAPE[0])
        then.setdefault("seq_len", FULL_SHAPE[1])
    first = runs[0][1]
    work = Path(tempfile.mkdtemp(prefix="hf_reprice_"))
    report: dict[str, Any] = {
        **machine_header(), "machine": "cpu (prices only)",
        "transformers": transformers.__version__, "measured_in": [path.name for path, _ in runs],
        "measured_on": sorted({then.get("gpu") for _, then in runs if then.get("gpu")}),
        "cluster": os.path.basename(cluster), "global_batch": first["global_batch"], "seq_len": first["seq_len"],
        "method": "`mplan bench CONFIG` (no --measure) on this checkout; error is predicted / measured - 1 against "
                  "the measured run's step", "models": {}}
    measured_rows: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for path, then in runs:
        if (then["global_batch"], then["seq_len"]) != (first["global_batch"], first["seq_len"]):
            raise ValueError(f"{path.name}: global batch {then['global_batch']} and sequence {then['seq_len']}, "
                             f"where {runs[0][0].name} has {first['global_batch']} and {first['seq_len']}")
        for name, result in then["models"].items():
            if configs.setdefault(name, result["config"]) != result["config"]:
                raise ValueError(f"{path.name}: model {name}'s config differs from an earlier run's")
            measured_rows.setdefault(name, []).extend(
                (path.name, r) for r in result.get("rows", {}).get("plans", [])
                if (r.get("measured") or {}).get("step_time_s"))
    for name, rows in measured_rows.items():
        if not rows:
            continue
        config = work / f"{name}.json"
        config.write_text(json.dumps(configs[name]))
        priced = work / f"{name}_rows.json"
        command = [sys.executable, "-m", "mplan", "bench", str(config), "--cluster", cluster, "--global-batch",
                   str(first["global_batch"]), "--seq-len", str(first["seq_len"]), "--plans",
                   *dict.fromkeys(r["resolved_spec"] for _, r in rows), "--out", str(priced)]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ".")})
        if done.returncode != 0:
            raise SystemExit(f"mplan bench failed on {name}:\n{done.stderr[-3000:]}")
        # priced as the plan that ran (a spec such as `auto` leaves keys to the search, which this
        # checkout may settle otherwise)
        now = {r["spec"]: r["predicted"] for r in json.loads(priced.read_text())["plans"]}
        report["models"][name] = [_repriced_row(source, r, now[r["resolved_spec"]]) for source, r in rows]
        for row in report["models"][name]:
            peak = "" if row["peak_error_now"] is None else \
                f"; peak {row['peak_error_then']:+.1%} -> {row['peak_error_now']:+.1%}"
            print(f"{name} {row['spec']}: {row['error_then']:+.1%} -> {row['error_now']:+.1%}{peak}", flush=True)
    return report


def _repriced_row(source: str, row: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """A measured row of run `source` beside its price then and `now` (this checkout's prediction of
    the plan it ran): step and peak errors, predicted / measured - 1."""
    measured, peak = row["measured"], row["measured"].get("peak_memory_gib")
    return {"spec": row["spec"], "resolved_spec": row["resolved_spec"], "measured_in": source,
            "measured_step_s": measured["step_time_s"], "predicted_then_s": row["predicted"]["step_time_s"],
            "predicted_now_s": now["step_time_s"],
            "error_then": row["predicted"]["step_time_s"] / measured["step_time_s"] - 1,
            "error_now": now["step_time_s"] / measured["step_time_s"] - 1,
            "measured_peak_gib": peak, "predicted_allocated_gib_now": now["allocated_gib"],
            "peak_error_then": measured["prediction_error"]["peak_memory"],
            "peak_error_now": now["allocated_gib"] / peak - 1 if peak else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="seen", choices=sorted(SETS), help="which set (module docstring)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the smoke test")
    parser.add_argument("--small", action="store_true", help="tiny configs (the smoke test)")
    parser.add_argument("--models", default=None, help="comma-separated, of the set's (default: all of them)")
    parser.add_argument("--plans", nargs="+", default=None,
                        help="plan specs handed to mplan bench (default: the set's)")
    parser.add_argument("--cluster", default=None, help="a cluster file or preset (default: see the docstring)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per model (default: the set's)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step per row under torch.profiler: its kernel time by kind and its largest "
                             "kernels (`mplan bench --profile`)")
    parser.add_argument("--rejudge", action="store_true",
                        help="run nothing: judge --out's models again on the rows files of its run")
    parser.add_argument("--reprice", nargs="+", default=None, metavar="MEASURED_JSON",
                        help="measure nothing: price earlier runs' configs and plans again on this machine "
                             "(--cluster: the profile to price on) beside their measurements")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.rejudge:
        return rejudge(Path(args.out), args.configs, args.small)
    if args.reprice:
        if not args.cluster:
            raise ValueError("--reprice needs --cluster: the profile to price on")
        return reprice([Path(p) for p in args.reprice], args.cluster)
    chosen = SETS[args.configs]
    models = args.models.split(",") if args.models else list(chosen.models)
    if unknown := [m for m in models if m not in chosen.models]:
        raise ValueError(f"--models {','.join(unknown)}: the {args.configs} set has {','.join(chosen.models)}")
    plans = args.plans or list(chosen.plans)
    timeout_s = args.timeout_s or chosen.timeout_s

    import torch
    import transformers

    out = Path(args.out)
    work = out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    cluster, cluster_note = (args.cluster, {"source": "given"}) if args.cluster else \
        cluster_for(args.device, work, timeout_s)
    batch, seq = SMALL_SHAPE if args.small else FULL_SHAPE
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None,
        "configs": args.configs, "cluster": cluster, "cluster_note": cluster_note, "global_batch": batch,
        "seq_len": seq, "plans": plans,
        "method": "each config.json written by transformers (bf16), then `mplan bench CONFIG --measure` under "
                  "torchrun with one rank; prediction_error is predicted / measured - 1 (memory: against "
                  "torch.cuda.max_memory_allocated)",
        "target": f"|step_time_error| and |peak_memory_error| <= {chosen.target:.0%} on every row ({chosen.why})",
        "models": {}}
    out.write_text(json.dumps(report, indent=1))  # a run killed from outside still leaves its header
    for name in models:
        config = write_config(name, work, small=args.small)
        result = bench_one(config, work / f"{name}_rows.json", cluster=cluster, global_batch=batch, seq_len=seq,
                           plans=plans, timeout_s=timeout_s, profile=args.profile)
        result["config"] = json.loads(config.read_text())
        result["judged"] = judge(result.get("rows", {}), target=chosen.target)
        report["models"][name] = result
        print(f"{name}: {json.dumps(result['judged'])}", flush=True)
        out.write_text(json.dumps(report, indent=1))
    report["summary"] = summary([row for result in report["models"].values() for row in result["judged"]])
    print(f"summary: {json.dumps(report['summary'])}")
    return report
