"""Wall time of `mplan plan ... --json`, each run in a fresh process, start-up included (what the
README's planning-time row quotes).

Jobs:
- the two preset jobs the README has always quoted: `gpt3-175b` on 128 DGX A100 nodes (1024
  GPUs) and `llama3-8b` on 8 DGX H100 nodes at seq 8192; and `llama3-405b` at seq 8192 on 2048
  DGX H100 nodes (16384 GPUs), the widest search context parallelism makes;
- every Hugging Face config under benchmarks/configs/ (1B, 8B and 70B shapes; Llama, Qwen2/3 and
  Mistral styles) at `--seq-lens` 4096 and 32768 on 8 DGX H100 nodes, each beside the mplan
  family spec of the same shape (`llama:layers=...`, what a preset is), so that the file shows
  whether a user's config plans as fast as the preset of its shape.

The report records every run's wall and CPU seconds, the plan's own `planner` figures (candidates,
capture, search and total seconds), the mesh chosen (identical across runs or not), per config
the ratio of its fastest run to its twin's, and the load average before and after each job,
since other processes on a shared machine stretch wall time.

    python -m benchmarks.planning time -o benchmarks/results/planning_time-cpu-2026-12-05-after.json
    python -m benchmarks.planning time --only qwen3-8b --repeats 1 -o /tmp/t.json     # one config, both lengths
    python -m benchmarks.planning time --only qwen3-8b --seq-lens 131072 --nodes 32 -o /tmp/t.json
    python -m benchmarks.planning time --only gpt3-175b llama3-8b llama3-405b qwen3-8b --seq-lens 131072 \\
        -o benchmarks/results/planning_time-cpu-2026-12-06.json     # issue 30's jobs (cp in the search)
(results made before the harness: `python benchmarks/planning_time.py` with the same flags)
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from benchmarks.planning.processes import run_json
from benchmarks.report import machine_header

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
SEQ_LENS = (4096, 32768)
PRESET_JOBS = {
    "gpt3-175b": ["gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128", "--global-batch", "1536"],
    "llama3-8b": ["llama3-8b", "--seq-len", "8192", "--cluster", "dgx-h100", "--nodes", "8", "--global-batch", "512"],
    # issue 30's third job: 16384 H100s, where context parallelism's degrees widen the search most
    "llama3-405b": ["llama3-405b", "--seq-len", "8192", "--cluster", "dgx-h100", "--nodes", "2048",
                    "--global-batch", "2048"],
}


def family_twin(config: dict, seq_len: int) -> str:
    """The mplan family spec of the config's shape (layers, widths, heads, vocabulary, tying) with
    its RoPE table `seq_len` long: planned by the same code path as a preset. Biases and q/k norms
    have no family key; they change a block's op count by a few, not its shape."""
    heads = config["num_attention_heads"]
    fields = {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "heads": heads,
              "kv_heads": config.get("num_key_value_heads") or heads, "ffn": config["intermediate_size"],
              "seq": seq_len, "vocab": config["vocab_size"],
              "tie": int(bool(config.get("tie_word_embeddings", False)))}
    return "llama:" + ",".join(f"{k}={v}" for k, v in fields.items())


def jobs(only: list[str] | None, seq_lens: tuple[int, ...] = SEQ_LENS, nodes: int = 8) -> dict[str, dict]:
    """name -> {"args": the `mplan plan` arguments, "twin": the job it is compared with}; the configs
    on `nodes` DGX H100 nodes."""
    cluster = ["--cluster", "dgx-h100", "--nodes", str(nodes), "--global-batch", "512"]
    made: dict[str, dict] = {name: {"args": args, "twin": None} for name, args in PRESET_JOBS.items()}
    for name in sorted(os.listdir(CONFIGS)):
        path = os.path.join(CONFIGS, name)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        for seq in seq_lens:
            length = ["--seq-len", str(seq)]
            made[f"{name}@{seq}:family"] = {"args": [family_twin(config, seq), *length, *cluster], "twin": None}
            made[f"{name}@{seq}"] = {"args": [os.path.relpath(path), *length, *cluster],
                                     "twin": f"{name}@{seq}:family"}
    if only:
        made = {k: v for k, v in made.items() if any(k.split("@")[0].split(":")[0] == o for o in only)}
    return made


def run_job(args: list[str]) -> dict[str, Any]:
    """One `mplan plan --json` in a fresh process: its seconds, its planner figures and its mesh."""
    made, wall, cpu = run_json(["-m", "mplan", "plan", *args, "--runtime", "mplan", "--json"])
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "planner": made.get("planner", {}),
            "plan": json.dumps(made.get("mesh", {}), sort_keys=True)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None,
                        help="job names to run (a preset, or a config directory's name)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS),
                        help="the configs' sequence lengths (the issue asks up to 131072)")
    parser.add_argument("--nodes", type=int, default=8,
                        help="DGX H100 nodes of the config jobs (131072 tokens of the Qwen3-8B config need 32)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {**machine_header(), "load_average_before": os.getloadavg(), "jobs": {}}
    for name, job in jobs(args.only, tuple(args.seq_lens), args.nodes).items():
        load = os.getloadavg()
        runs = [run_job(job["args"]) for _ in range(args.repeats)]
        walls = [r["wall_s"] for r in runs]
        cpus = [r["cpu_s"] for r in runs]
        entry = {"command": "mplan plan " + " ".join(job["args"]) + " --runtime mplan --json", "runs": runs,
                 "wall_s_min": min(walls), "wall_s_max": max(walls), "cpu_s_min": min(cpus),
                 "same_plan_every_run": len({r["plan"] for r in runs}) == 1,
                 "load_average_before": load, "load_average_after": os.getloadavg()}
        twin = report["jobs"].get(job["twin"]) if job["twin"] else None
        if twin:
            entry["twin"] = job["twin"]
            entry["wall_over_twin"] = round(min(walls) / twin["wall_s_min"], 3)
            entry["cpu_over_twin"] = round(min(cpus) / twin["cpu_s_min"], 3)
            entry["same_plan_as_twin"] = runs[0]["plan"] == twin["runs"][0]["plan"]
        report["jobs"][name] = entry
        planner = runs[0]["planner"]
        print(f"{name}: {min(walls):.1f}-{max(walls):.1f} s wall, {min(cpus):.1f} s cpu, "
              f"{planner.get('candidates')} candidates, capture {planner.get('capture_seconds')} s, "
              f"search {planner.get('search_seconds')} s"
              + (f", {entry['wall_over_twin']}x its family twin's wall, {entry['cpu_over_twin']}x its cpu"
                 if twin else "") + f", load {load[0]:.2f}", flush=True)
    report["load_average_after"] = os.getloadavg()
    return report
