"""Wall time of `mplan plan ... --json`, each run in a fresh process, start-up included (CPU only;
what the README's planning-time row quotes).

Jobs:
- the two preset jobs the README has always quoted: `gpt3-175b` on 128 DGX A100 nodes (1024
  GPUs) and `llama3-8b` on 8 DGX H100 nodes at seq 8192; and `llama3-405b` at seq 8192 on 2048
  DGX H100 nodes (16384 GPUs), the widest search context parallelism makes;
- every Hugging Face config under benchmarks/configs/ (1B, 8B and 70B shapes; Llama, Qwen2/3 and
  Mistral styles) at `--seq-len` 4096 and 32768 on 8 DGX H100 nodes, each beside the mplan
  family spec of the same shape (`llama:layers=...`, what a preset is), so that the file shows
  whether a user's config plans as fast as the preset of its shape.

The file records every run's wall and CPU seconds, the plan's own `planner` figures (candidates,
capture, search and total seconds), the mesh chosen (identical across runs or not), per config
the ratio of its fastest run to its twin's, and the load average before and after each job,
since other processes on a shared machine stretch wall time.

    python benchmarks/planning_time.py -o benchmarks/results/planning_time-cpu-2026-12-05-after.json
    python benchmarks/planning_time.py --only qwen3-8b --repeats 1     # one config, both lengths
    python benchmarks/planning_time.py --only qwen3-8b --seq-lens 131072 --nodes 32   # the longest the issue asks
    python benchmarks/planning_time.py --only gpt3-175b llama3-8b llama3-405b qwen3-8b --seq-lens 131072 \
        -o benchmarks/results/planning_time-cpu-2026-12-06.json     # issue 30's jobs (cp in the search)

With --capture, the capture alone instead: time and peak memory of capturing the largest presets
on the meta device, each in a fresh process (so peak RSS is that capture's own), full depth and
shallow (what the README's capture row quotes):

    python benchmarks/planning_time.py --capture -o benchmarks/results/capture-cpu-2026-11-29.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")
SEQ_LENS = (4096, 32768)
H100_CLUSTER = ["--cluster", "dgx-h100", "--nodes", "8", "--global-batch", "512", "--runtime", "mplan"]
H100_NODES = H100_CLUSTER.index("--nodes") + 1
PRESET_JOBS = {
    "gpt3-175b": ["gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128", "--global-batch", "1536",
                  "--runtime", "mplan"],
    "llama3-8b": ["llama3-8b", "--seq-len", "8192", *H100_CLUSTER],
    # issue 30's third job: 16384 H100s, where context parallelism's degrees widen the search most
    "llama3-405b": ["llama3-405b", "--seq-len", "8192", "--cluster", "dgx-h100", "--nodes", "2048",
                    "--global-batch", "2048", "--runtime", "mplan"],
}


def family_twin(config: dict, seq_len: int) -> str:
    """The mplan family spec of the config's shape (layers, widths, heads, vocabulary, tying) with
    its RoPE table `seq_len` long:
    planned by the same code path as a preset. Biases and q/k norms have no family key; they
    change a block's op count by a few, not its shape."""
    heads = config["num_attention_heads"]
    fields = {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "heads": heads,
              "kv_heads": config.get("num_key_value_heads") or heads, "ffn": config["intermediate_size"],
              "seq": seq_len, "vocab": config["vocab_size"],
              "tie": int(bool(config.get("tie_word_embeddings", False)))}
    return "llama:" + ",".join(f"{k}={v}" for k, v in fields.items())


CAPTURE_PRESETS = ["gpt3-175b", "llama3-405b", "mixtral-8x7b"]

_CAPTURE_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from mplan.planner.planning import capture_spec
t1 = time.perf_counter()
g = capture_spec(sys.argv[1], shallow=sys.argv[2] == "shallow")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "capture_call_s": t2 - t1, "export_s": g.capture_seconds,
                  "num_parameters": g.num_parameters, "num_layers": g.num_layers,
                  "num_ops": len(g.nodes), "training_flops_per_token": g.training_flops / g.tokens(),
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def measure_capture(preset: str, mode: str) -> dict:
    """One capture of `preset` (mode "full" or "shallow") in a fresh process: its figures."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CAPTURE_CHILD, preset, mode], check=True,
                         capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["process_wall_s"] = time.perf_counter() - start
    return {"preset": preset, "mode": mode, **{k: round(v, 3) if isinstance(v, float) else v
                                               for k, v in row.items()}}


def capture_doc() -> dict:
    rows = [measure_capture(p, m) for p in CAPTURE_PRESETS for m in ("full", "shallow")]
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "torch": torch.__version__, "python": platform.python_version(),
            "note": "meta device; peak_rss_gib is the capturing process's max RSS (ru_maxrss)", "rows": rows}


def jobs(only: list[str] | None, seq_lens: tuple[int, ...] = SEQ_LENS, nodes: int = 8) -> dict[str, dict]:
    """name -> {"args": the `mplan plan` arguments, "twin": the job it is compared with}; the configs
    on `nodes` DGX H100 nodes."""
    cluster = [*H100_CLUSTER[:H100_NODES], str(nodes), *H100_CLUSTER[H100_NODES + 1:]]
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


def run_job(args: list[str]) -> dict:
    """One fresh process: its wall seconds, and its CPU seconds (user + system, every thread),
    which other processes on a shared machine stretch far less than wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mplan", "plan", *args, "--json"], check=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    made = json.loads(done.stdout)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "planner": made.get("planner", {}),
            "plan": json.dumps(made.get("mesh", {}), sort_keys=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None,
                        help="job names to run (a preset, or a config directory's name)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS),
                        help="the configs' sequence lengths (the issue asks up to 131072)")
    parser.add_argument("--nodes", type=int, default=8,
                        help="DGX H100 nodes of the config jobs (131072 tokens of the Qwen3-8B config need 32)")
    parser.add_argument("--capture", action="store_true",
                        help="time the capture of the largest presets alone (full depth and shallow)")
    args = parser.parse_args()
    if args.capture:
        text = json.dumps(capture_doc(), indent=1)
        print(text)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "python": platform.python_version(),
           "load_average_before": os.getloadavg(), "jobs": {}}
    for name, job in jobs(args.only, tuple(args.seq_lens), args.nodes).items():
        load = os.getloadavg()
        runs = [run_job(job["args"]) for _ in range(args.repeats)]
        walls = [r["wall_s"] for r in runs]
        cpus = [r["cpu_s"] for r in runs]
        entry = {"command": "mplan plan " + " ".join(job["args"]) + " --json", "runs": runs,
                 "wall_s_min": min(walls), "wall_s_max": max(walls), "cpu_s_min": min(cpus),
                 "same_plan_every_run": len({r["plan"] for r in runs}) == 1,
                 "load_average_before": load, "load_average_after": os.getloadavg()}
        twin = doc["jobs"].get(job["twin"]) if job["twin"] else None
        if twin:
            entry["twin"] = job["twin"]
            entry["wall_over_twin"] = round(min(walls) / twin["wall_s_min"], 3)
            entry["cpu_over_twin"] = round(min(cpus) / twin["cpu_s_min"], 3)
            entry["same_plan_as_twin"] = runs[0]["plan"] == twin["runs"][0]["plan"]
        doc["jobs"][name] = entry
        print(f"{name}: {min(walls):.1f}-{max(walls):.1f} s wall, {min(cpus):.1f} s cpu, "
              f"{runs[0]['planner'].get('candidates')} candidates, capture "
              f"{runs[0]['planner'].get('capture_seconds')} s, search {runs[0]['planner'].get('search_seconds')} s"
              + (f", {entry['wall_over_twin']}x its family twin's wall, {entry['cpu_over_twin']}x its cpu"
                 if twin else "")
              + f", load {load[0]:.2f}", flush=True)
    doc["load_average_after"] = os.getloadavg()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
