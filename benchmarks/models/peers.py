"""Whole Hugging Face models against their peers on one GPU: HF eager, torch.compile, HF + Liger
Kernel (where Liger patches the family) and mplan, all in one run, family by family (issue 35's
"must show"; the question "is mplan's training step the fastest on the models users bring?").

The families (benchmarks/models/families.py says which and why) are built from their configs (no
download), bf16 parameters, use_cache=False. Every system trains the same seed-0 weights on the
same FRESH batches (step k of every system trains on batch k; Zipf-like tokens, as in
the `hf-models` case) with fused AdamW (lr 1e-4 after --lr-warmup steps of linear warm-up),
global-norm clipping at 1.0, the loss read back every step:
    eager    the HF model, its loss from labels=
    compile  torch.compile(HF model) (default mode; its warm-up includes the compile)
    mplan    mplan.autoparallel(model, plan="dp=1,tp=1,pp=1", kernels=True, cuda_graphs=True) then
             pm.train_step(ids, labels) (--no-cuda-graphs: without; the row's "cuda_graphs" says whether
             the steps replayed or why not)
    liger    the HF model patched by liger_kernel.transformers.apply_liger_kernel_to_<family>(model=...)
             with the patch's own defaults; recorded as not supported where Liger has no patch

Isolation. Each family runs in its own process (this case with --family NAME), so one family's
failure (an exception, an out-of-memory, a hang past --family-timeout-s) is recorded and the next
family still runs; the JSON is rewritten after every family. Liger patches transformers' modules
globally, so within a family the liger system runs in a child process of its own (this case with
--system liger), driven over a pipe; all four systems stay resident and take turns in --rounds
interleaved rounds whose order rotates, each process emptying its CUDA cache before the other's turn
(the `hf-models` case's method, whose child protocol and loss checks this case shares:
benchmarks/models/child.py, hf_step.py).

Reported per family and system: median step time, the coefficient of variation of the timed steps
(standard deviation / mean), peak memory above what was allocated before its build, first-step and
set-up times, every loss and gradient norm. Per family: mplan_vs_<peer> and mplan_vs_best_peer, each
the MEDIAN OF PER-ROUND RATIOS (the peer's time in round r / mplan's time in round r; the best peer
is the one with the lowest median step), so a slow round of one system does not decide the figure;
mplan's peak memory over the lowest peer's; mplan's, compile's and liger's losses against eager's
(hf_step.loss_agreement); mplan's fusion report (which kernels fired, which entries missed
and why, and per block type the memory-bound ops left: `mplan inspect`'s coverage). The card,
torch, triton, transformers and liger-kernel versions are in the JSON.
Targets (issue 35): mplan_vs_best_peer >= 1.0, mplan's peak <= 1.10 x the lowest peer's, losses agree.

--own gpt,llama adds mplan's own GPT-1.3B and Llama-1.1B (the `e2e` case's workloads on its
memorized batch, eager/compile/mplan, through contest.race_own_model) after the families, under
"own", with the targets issue 35 keeps (GPT >= 1.05x eager, Llama >= 1.3x eager, both >= compile)
and this case's per-round ratios and step spread beside them ("per_round").

Run on the GPU (from the repository root, Liger from the carried wheels; a device call has 600 s,
about 1.5-2 minutes a family with its cold torch.compile, so a few families a call):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel pulp highspy
    PYTHONPATH=. python -m benchmarks.models peers --families gemma2,phi3,qwen3 --out $OUT/peers_a.json
    PYTHONPATH=. python -m benchmarks.models peers --families "" --own gpt,llama --out $OUT/peers_own.json
    PYTHONPATH=. python -m benchmarks.models peers --families "" --own gpt --own-pairs --systems eager,compile,mplan \
        --out $OUT/peers_own_pairs.json      # GPT-1.3B with graphs: a pair at a time fits
Smoke test of the same code paths on a CPU (tiny configs; compile only if named in --systems; liger
skipped, or with --smoke-child its slot run by the plain HF model in the child process):
    PYTHONPATH=. python -m benchmarks.models peers --device cpu --small --out /tmp/peers.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any
from unittest import mock

import torch

import mplan
from benchmarks.harness import add_device_flags
from benchmarks.models import trace
from benchmarks.models.child import PipeChild, answer_commands
from benchmarks.models.contest import (PROFILE_STEPS, per_round, race_own_model, release_cache, rotating_rounds,
                                       steady_blocks)
from benchmarks.models.families import Family, families, family
from benchmarks.models.hf_step import (
    BATCH_SEED,
    LOSS_MEAN_RTOL,
    LOSS_STEP_RTOL,
    ZIPF_OFFSET,
    Feed,
    build_compile,
    build_eager,
    fingerprint,
    hf_step,
    initial_model,
    loss_agreement,
    on_device,
    token_batches,
)
from benchmarks.models.kernel_profile import profile_steps
from benchmarks.models.timing import Running, warm_up
from benchmarks.models.workloads import FULL, MAX_GRAD_NORM, SMALL, SYSTEMS, Setting, Step
from benchmarks.report import Clock, run_header, write_report
from mplan.fusion.coverage import fusion_coverage

PEERS = ("eager", "compile", "liger")
TARGET_VS_BEST_PEER = 1.0
TARGET_PEAK_VS_LOWEST_PEER = 1.10
STDERR_TAIL_LINES = 40
"""lines of a failed family process's stderr kept in its entry"""
PACKAGES = ("torch", "triton", "transformers", "liger-kernel")
OWN = "own:"
"""prefix of the family-process name of one of mplan's own models (--own)"""
OWN_KINDS = ("gpt", "llama")


# ---- model and systems -------------------------------------------------------------------------

def build_liger(fam: Family, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    """Only in the liger child process: the patch reaches every model of transformers' classes."""
    assert fam.liger_patch is not None
    module = on_device(fam, setting)
    patch = getattr(importlib.import_module("liger_kernel.transformers"), fam.liger_patch)
    patch(model=module)
    defaults = {k: p.default for k, p in inspect.signature(patch).parameters.items() if k != "model"}
    return hf_step(module, module, batches, setting), {
        "pipeline": f"liger_kernel.transformers.{fam.liger_patch}(model=instance)", "liger_options": defaults}


def build_mplan(fam: Family, setting: Setting, batches: list[torch.Tensor],
                cuda_graphs: bool = True) -> tuple[Step, dict[str, Any]]:
    module = on_device(fam, setting)
    graphs = cuda_graphs and setting.device.type == "cuda"
    pm = mplan.autoparallel(module, example_inputs=(batches[0],), global_batch=fam.batch, plan="dp=1,tp=1,pp=1",
                            kernels=True, optimizer=setting.optimizer(), max_grad_norm=MAX_GRAD_NORM,
                            dtype=torch.bfloat16, device=setting.device, cuda_graphs=graphs)
    del module  # pm trains the model's own tensors
    report = pm.program.meta["fuse_kernels"]
    schedule = setting.lr_schedule(pm.optimizer.optimizer)  # mplan's AdamW kernel reads group["lr"] every step
    feed = Feed(batches)

    def step() -> tuple[float, float]:
        schedule()
        ids = feed.next()
        loss = pm.train_step(ids, ids)
        if pm.step_graph is not None:  # the row is this dict: the state after the last step is recorded
            info["cuda_graphs"] = pm.step_graph.state()
        return loss, pm.last_grad_norm

    info: dict[str, Any] = {
        "pipeline": f'mplan.autoparallel(plan="dp=1,tp=1,pp=1", kernels=True, cuda_graphs={graphs})',
        "fusion": {"fused": report.counts, "missed": report.missed, "summary": str(report),
                   "coverage": coverage(pm.graph)}}
    return step, info


def coverage(graph: Any) -> list[dict[str, Any]] | str:
    """`mplan inspect`'s fusion coverage of the captured graph, per block type: which kernels
    fused, which entries came close and why they missed, and the memory-bound ops left (with
    their bytes); the error's last line instead if it cannot be computed (the timing goes on)."""
    try:
        return [{"block_type": c.block_type, "instances": c.instances,
                 "fused": {f.kernel: f.count for f in c.fused},
                 "skipped": [{"kernel": m.kernel, "count": m.count, "why": m.why} for m in c.skipped],
                 "left": [{"op": op.op, "count": op.count, "bytes": op.bytes, "why": op.why} for op in c.left],
                 "left_bytes": c.left_bytes} for c in fusion_coverage(graph)]
    except Exception:  # noqa: BLE001 - a report, not the measurement
        return "coverage failed: " + traceback.format_exc().strip().splitlines()[-1]


BUILDERS = {"eager": build_eager, "compile": build_compile, "mplan": build_mplan, "liger": build_liger,
            "mplan_eager": functools.partial(build_mplan, cuda_graphs=False)}
"""mplan_eager: mplan launching every step from Python, beside `mplan` with its CUDA graphs in the same
rounds (--systems ...,mplan_eager), so that what the graphs buy is measured, not inferred across runs"""


def start_system(name: str, fam: Family, setting: Setting, batches: list[torch.Tensor],
                 warmup: int) -> Running | dict[str, Any]:
    """`timing.warm_up` (build, first step, warm-up steps, peak memory) on this case's builder."""
    with mock.patch.dict(SYSTEMS, {name: functools.partial(BUILDERS[name], batches=batches)}):
        return warm_up(name, fam, setting, warmup)  # type: ignore[arg-type]


def batch_count(args: argparse.Namespace) -> int:
    return (args.warmup + args.rounds * per_round(args) + args.steady_settle + args.steady_steps
            + (PROFILE_STEPS if args.profile else 0))


# ---- the liger child ---------------------------------------------------------------------------

class Child(PipeChild):
    """A family's liger system (`--system liger --family NAME`) in its own process (the module
    docstring says why), driven over hf_models's pipe protocol."""

    def __init__(self, fam: Family, args: argparse.Namespace, system: str) -> None:
        command = [sys.executable, "-m", "benchmarks.models", "peers", "--out", os.devnull, "--system", system,
                   "--family", fam.name,
                   "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--lr-warmup", str(args.lr_warmup),
                   "--steady-steps", str(args.steady_steps), "--steady-settle", str(args.steady_settle)]
        super().__init__(command + (["--small"] if args.small else []) + (["--profile"] if args.profile else []))


def serve_child(args: argparse.Namespace) -> None:
    """The child's loop: commands on stdin, JSON lines on the process's original stdout (anything
    libraries print goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    setting = Setting(device=torch.device(args.device), precision="bf16", lr_warmup=args.lr_warmup)
    fam = family(args.family, args.small)
    initial_model(fam)  # the CPU build, while the parent builds its own systems
    answer_commands(answers, setting,
                    lambda: start_system(args.system, fam, setting,
                                         token_batches(fam, batch_count(args),  # type: ignore[arg-type]
                                                       setting.device),
                                         args.warmup),
                    lambda: fingerprint(initial_model(fam)))


def liger_unavailable(fam: Family, device: torch.device) -> str | None:
    """Why the liger system cannot run this family here, or None."""
    if fam.liger_patch is None:
        return f"not supported: liger_kernel.transformers has no patch for {fam.model_class}"
    if device.type != "cuda":
        return "skipped: Liger's kernels are Triton GPU kernels"
    if importlib.util.find_spec("liger_kernel") is None:
        return ("skipped: liger-kernel is not installed (pip install --no-index --find-links .device_wheels "
                "--no-deps liger-kernel)")
    return None


def contest(fam: Family, names: list[str], child: Child | None, setting: Setting, batches: list[torch.Tensor],
            args: argparse.Namespace, clock: Clock) -> tuple[dict[str, dict[str, Any]], dict[str, Running]]:
    """Warms up each system in turn, then times them all in rotating interleaved rounds, the
    liger child taking its turn like the rest."""
    rows: dict[str, dict[str, Any]] = {}
    running: dict[str, Running] = {}
    for name in names:
        if name == "liger":
            if child is None:
                continue
            release_cache(setting)
            answer = child.ask("warmup")
            rows[name] = answer if "error" in answer else {**answer, "process": "child"}
        else:
            result = start_system(name, fam, setting, batches, args.warmup)
            if isinstance(result, Running):
                running[name] = result
            rows[name] = result.row if isinstance(result, Running) else result
        clock.log(f"{fam.name} {name}: " + ("ERROR " + rows[name]["error"].strip().splitlines()[-1]
                                            if "error" in rows[name] else
                                            f"warmed up, first step {rows[name]['first_step_s']} s"))
    turns = list(running) + (["liger"] if child is not None and "error" not in rows.get("liger", {"error": ""}) else [])
    rotating_rounds(turns, running, child, rows, setting, args.rounds, per_round(args))
    if args.steady_steps:
        steady_blocks(turns, running, child, rows, setting, args.steady_settle, args.steady_steps)
    return rows, running


def summarize(row: dict[str, Any], in_round: int) -> None:
    """Adds the median step, the steps' coefficient of variation and the per-round times to `row`."""
    steps = row.get("step_s_all") or []
    if not steps:
        return
    row["step_s"] = statistics.median(steps)
    row["step_cv"] = statistics.pstdev(steps) / statistics.fmean(steps)
    row["round_s"] = [sum(steps[i:i + in_round]) for i in range(0, len(steps) - in_round + 1, in_round)]
    steady = row.get("steady_step_s_all") or []
    if steady:
        row["steady_step_s"] = statistics.median(steady)
        row["steady_cv"] = statistics.pstdev(steady) / statistics.fmean(steady)


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-round ratios to each peer and to the best, peak against the lowest peer, losses, targets."""
    ok = {name: row for name, row in rows.items() if "step_s" in row}
    peers = [name for name in PEERS if name in ok]
    out: dict[str, Any] = {"peers_timed": peers, "loss_agreement": {}}
    if "mplan" in ok and peers:
        mine = ok["mplan"]["round_s"]
        for other in peers + [name for name in ("mplan_eager",) if name in ok]:  # and mplan without its graphs
            ratios = [theirs / my for theirs, my in zip(ok[other]["round_s"], mine)]
            out[f"mplan_vs_{other}"] = statistics.median(ratios)
            out[f"mplan_vs_{other}_per_round"] = ratios
        best = min(peers, key=lambda name: ok[name]["step_s"])
        out["best_peer"], out["mplan_vs_best_peer"] = best, out[f"mplan_vs_{best}"]
        peaks = {name: ok[name]["peak_gib"] for name in peers if ok[name].get("peak_gib")}
        if peaks and ok["mplan"].get("peak_gib"):
            lowest = min(peaks, key=peaks.__getitem__)
            out["lowest_peak_peer"], out["mplan_peak_vs_lowest_peer"] = lowest, ok["mplan"]["peak_gib"] / peaks[lowest]
    steady = {name: row["steady_cv"] for name, row in ok.items() if "steady_cv" in row}
    if steady:  # the spread of each system alone (timing.steady_block), and its median step's ratio
        out["steady_cv"] = steady
        if "mplan" in steady:
            out["mplan_vs_peers_steady"] = {other: ok[other]["steady_step_s"] / ok["mplan"]["steady_step_s"]
                                            for other in steady if other != "mplan"}
    if "eager" in ok:
        for name in ("mplan", "mplan_eager", "compile", "liger"):
            if name in ok:
                out["loss_agreement"][f"{name}_vs_eager"] = loss_agreement(ok[name], ok["eager"])
    out["targets"] = {
        f"mplan_vs_best_peer>={TARGET_VS_BEST_PEER}": out.get("mplan_vs_best_peer", 0.0) >= TARGET_VS_BEST_PEER,
        f"peak<={TARGET_PEAK_VS_LOWEST_PEER}x_lowest_peer": (None if "mplan_peak_vs_lowest_peer" not in out
                                                             else out["mplan_peak_vs_lowest_peer"]
                                                             <= TARGET_PEAK_VS_LOWEST_PEER),
        "losses_agree_with_eager": out["loss_agreement"].get("mplan_vs_eager", {}).get("passed", False),
    }
    if "mplan" in steady and "compile" in steady:  # issue 35: a spread at most torch.compile's
        out["targets"]["steady_cv<=compile_steady_cv"] = steady["mplan"] <= steady["compile"]
    return out


def run_family(fam: Family, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One family's contest, in this process (and the liger child's)."""
    clock = Clock()
    setting = Setting(device=torch.device(args.device), precision="bf16", lr_warmup=args.lr_warmup)
    reason = liger_unavailable(fam, setting.device) if "liger" in names else None
    stand_in = (reason is not None and fam.liger_patch is not None and args.smoke_child
                and setting.device.type == "cpu")
    child = (Child(fam, args, "eager" if stand_in else "liger")
             if "liger" in names and (reason is None or stand_in) else None)
    probe = initial_model(fam)
    entry: dict[str, Any] = {
        **run_header(setting.device), "class": fam.model_class, "config": dict(fam.sizes),
        "attn_implementation": fam.attention, "batch": fam.batch, "seq_len": fam.seq,
        "num_parameters": sum(p.numel() for p in probe.parameters()), "weights_fingerprint": fingerprint(probe),
    }
    batches = token_batches(fam, batch_count(args), setting.device)  # type: ignore[arg-type]
    try:
        rows, running = contest(fam, names, child, setting, batches, args, clock)
        if args.profile:
            entry["profile"] = {name: profile_steps(system.step, PROFILE_STEPS, setting.device)
                                for name, system in running.items()}
            if child is not None and "error" not in rows.get("liger", {"error": ""}):
                release_cache(setting)
                entry["profile"]["liger"] = child.ask(f"profile {PROFILE_STEPS}")
    finally:
        if child is not None:
            child.close()
    if "liger" in names and child is None:
        rows["liger"] = {"skipped": reason}
    if stand_in and "liger" in rows:
        rows["liger"]["stand_in"] = f"the plain HF model in the child process ({reason}): the child protocol's test"
    if "weights_fingerprint" in rows.get("liger", {}):
        entry["liger_weights_match"] = rows["liger"]["weights_fingerprint"] == entry["weights_fingerprint"]
    for row in rows.values():
        summarize(row, per_round(args))
    entry["systems"] = rows
    entry.update(compare(rows))
    clock.log(f"{fam.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
                                         if k.startswith("mplan_") and isinstance(v, float))
              + f"; targets {entry['targets']}")
    return entry


def run_own(kind: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One of mplan's own models (e2e's GPT-1.3B or Llama-1.1B, on its memorized batch)
    through contest.race_own_model, with issue 19's targets (which issue 35 keeps), plus this
    case's per-round ratios and step spread."""
    setting = Setting(device=torch.device(args.device), precision="bf16", lr_warmup=args.lr_warmup)
    (workload,) = [w for w in (SMALL if args.small else FULL) if w.name.split("-")[0] == kind]
    entry = race_own_model(workload, [name for name in names if name in ("eager", "compile", "mplan")], args,
                           setting, Clock())
    for row in entry["systems"].values():
        summarize(row, per_round(args))
    return {**run_header(setting.device), "workload": workload.name, **entry,
            "per_round": compare(entry["systems"])}


# ---- the run: one process per family ------------------------------------------------------------

def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def _forward_stderr(stream: Any, tail: collections.deque[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        tail.append(line)


def run_family_process(name: str, args: argparse.Namespace, scratch: str, systems: str | None = None,
                       tag: str = "") -> dict[str, Any]:
    """Runs `name` in a process of its own (a new session: on a timeout it and its liger child are
    killed together), racing `systems` (default: --systems); its entry, which it writes under
    `scratch` (`tag` tells apart several processes of one family), or what is known of its failure."""
    part = os.path.join(scratch, f"{name.replace(':', '_')}{tag}.json")
    command = [sys.executable, "-m", "benchmarks.models", "peers", "--family", name, "--out", part,
               "--parent", str(os.getpid()), "--device", args.device, "--systems", systems or args.systems,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--lr-warmup", str(args.lr_warmup), "--steady-steps", str(args.steady_steps),
               "--steady-settle", str(args.steady_settle)]
    command += [flag for flag, on in (("--small", args.small), ("--profile", args.profile),
                                      ("--smoke-child", args.smoke_child), ("--no-cuda-graphs", args.no_cuda_graphs))
                if on]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    reader = threading.Thread(target=_forward_stderr, args=(proc.stderr, tail), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=args.family_timeout_s)
        failure = f"the family's process exited with code {code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        failure = f"the family's process ran past --family-timeout-s {args.family_timeout_s:.0f} s and was killed"
    reader.join(timeout=5)
    if os.path.exists(part):
        with open(part, encoding="utf-8") as handle:
            entry = json.load(handle)
        for key in ("harness", "command"):  # the harness's record of the family's own command
            entry.pop(key, None)
        return entry
    return {"error": failure, "stderr_tail": "".join(tail)}


def run_own_pairs(name: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """One of mplan's own models raced as mplan against each peer of --systems in turn, a process per
    pair (--own-pairs): each pair's entry under "pairs", and its mplan_vs_<peer>, targets and losses'
    agreement lifted to the model's entry."""
    peers = [system for system in args.systems.split(",") if system in ("eager", "compile")]
    entry: dict[str, Any] = {"method": "mplan raced against one peer at a time, both resident, in a process per pair",
                             "pairs": {}, "targets": {}}
    for peer in peers:
        pair = run_family_process(name, args, scratch, systems=f"{peer},mplan", tag=f"_{peer}")
        entry["pairs"][peer] = pair
        if f"mplan_vs_{peer}" in pair:
            entry[f"mplan_vs_{peer}"] = pair[f"mplan_vs_{peer}"]
        for target, met in pair.get("targets", {}).items():  # a pair judges only its own peer, and agreement
            if f"_vs_{peer}" in target or "_vs_" not in target:
                entry["targets"][target] = entry["targets"].get(target, True) and met
        entry.setdefault("gpu", pair.get("gpu"))
    return entry


def exit_with_parent(parent: int) -> None:
    """A family's process runs in a session of its own (so a timeout kills it and its liger child
    together), which a kill of the run's process group does not reach: it exits once its parent
    (pid `parent`, also when gone before this is called) is gone, and the liger child then reads
    end-of-file and exits too, so no orphan keeps the GPU."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flags(parser)
    parser.add_argument("--families", default=",".join(f.name for f in families(small=True)),
                        help="comma-separated families (default: all; benchmarks/models/families.py lists them)")
    parser.add_argument("--own", default="",
                        help="also mplan's own models, of gpt,llama (e2e's GPT-1.3B and Llama-1.1B on its "
                             "memorized batch; eager, compile and mplan), after the families")
    parser.add_argument("--own-pairs", action="store_true",
                        help="race each of --own's models as mplan against one peer at a time, a process per pair "
                             "(GPT-1.3B with CUDA graphs does not fit beside two resident peers: the graph's pool "
                             "keeps a step's activations); each ratio then comes from its own pair's rounds")
    parser.add_argument("--systems", default=None,
                        help="comma-separated, of eager,compile,mplan,liger,mplan_eager (default: the first four on "
                             "CUDA; eager,mplan,liger on a CPU, where torch.compile is slow)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before timing (their losses are checked; default 3, --small 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per system (the median is reported; default 12, --small 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds the timed steps are spread over (default 4, --small 2)")
    parser.add_argument("--steady-steps", type=int, default=0,
                        help="after the rounds, each system alone for this many timed steps in a row: its spread as "
                             "a run of it sees it (timing.steady_block; default 0, none)")
    parser.add_argument("--steady-settle", type=int, default=5,
                        help="untimed steps before each system's steady block (the card settling on its power)")
    parser.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    parser.add_argument("--family-timeout-s", type=float, default=300.0,
                        help="kill a family's process (and its liger child) after this many seconds")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no family after this many seconds (default 480 on CUDA, a device call having "
                             "600 s; none on a CPU)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="mplan without cuda_graphs=True (its steps' forwards and backwards then launch from "
                             "Python every step; on CUDA the race runs mplan with them by default)")
    parser.add_argument("--profile", action="store_true",
                        help=f"after timing, profile {PROFILE_STEPS} steps of each system by kernel category")
    parser.add_argument("--gpu-trace", default=None,
                        help="CSV the card's SM clock, power, temperature and clock-event reasons go to every "
                             f"{trace.GPU_TRACE_MS} ms while the families run (nvidia-smi; benchmarks/models/trace.py "
                             "lines it up with each system's steps into the JSON's gpu_trace)")
    parser.add_argument("--smoke-child", action="store_true",
                        help="CPU smoke test: run the liger slot's child process with the plain HF model "
                             "(tests the child protocol; its row says stand_in)")
    parser.add_argument("--family", help=argparse.SUPPRESS)  # one family's process, or the child's family
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # the pid a family's process exits without
    parser.add_argument("--system", choices=["liger", "eager"], help=argparse.SUPPRESS)  # the child process

def check_arguments(args: argparse.Namespace) -> None:
    """Fills the defaults that depend on --device and --small; a ValueError names an unknown --own."""
    if args.systems is None:
        args.systems = "eager,compile,mplan,liger" if args.device == "cuda" else "eager,mplan,liger"
    for name, full, small in (("warmup", 3, 2), ("steps", 12, 2), ("rounds", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    if args.budget_s is None:
        args.budget_s = 480.0 if args.device == "cuda" else float("inf")
    for name in (n for n in args.families.split(",") if n):
        family(name, small=True)  # an unknown name fails here, naming the known ones
    unknown = set(args.own.split(",")) - set(OWN_KINDS) - {""}
    if unknown:
        raise ValueError(f"--own: unknown {', '.join(sorted(unknown))}; known: {', '.join(OWN_KINDS)}")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The race; in a family's process (`--family NAME`) that family's entry, in the liger child
    (`--system liger`) its side of the pipe (no report)."""
    check_arguments(args)
    BUILDERS["mplan"] = functools.partial(build_mplan, cuda_graphs=not args.no_cuda_graphs)
    if args.system is not None:
        serve_child(args)
        return None
    if args.family is not None:
        if args.parent is not None:
            exit_with_parent(args.parent)
        names = [name for name in args.systems.split(",") if name]
        try:
            entry = (run_own(args.family.removeprefix(OWN), names, args) if args.family.startswith(OWN)
                     else run_family(family(args.family, args.small), names, args))
        except Exception:  # noqa: BLE001 - recorded as the family's error; the run goes on
            entry = {"error": traceback.format_exc()}
        return entry
    clock = Clock()
    steps_in_round = per_round(args)
    report: dict[str, Any] = {
        "versions": versions(), "cuda": torch.version.cuda, "gpu": None,
        "precision": "bf16 parameters and activations",
        "training": f"fused AdamW lr 1e-4 after {args.lr_warmup} steps of linear warm-up, global-norm clipping "
                    f"{MAX_GRAD_NORM}, loss read back every step",
        "batches": f"fresh every step: batch k from a generator seeded {BATCH_SEED} + 1 + k, Zipf-like tokens "
                   f"(offset {ZIPF_OFFSET}) over a fixed permutation of the vocabulary, labels = ids",
        "method": f"{args.warmup} warm-up steps per system, then {args.rounds} interleaved rounds of {steps_in_round} "
                  "timed steps per system (rotating order), all systems of a family resident; median step; "
                  "mplan_vs_<peer>: median over rounds of the peer's round time / mplan's"
                  + (f"; then each system alone: {args.steady_settle} untimed and {args.steady_steps} timed steps in "
                     "a row (steady_cv: their spread)" if args.steady_steps else ""),
        "isolation": "one process per family; liger in a child process of its own (Liger patches transformers' "
                     "modules globally), taking its turn in the same rounds",
        "targets": {"mplan_vs_best_peer": TARGET_VS_BEST_PEER, "peak_vs_lowest_peer": TARGET_PEAK_VS_LOWEST_PEER,
                    "loss_step_rtol": LOSS_STEP_RTOL, "loss_mean_rtol": LOSS_MEAN_RTOL},
        "families": {}, "own": {},
    }
    with tempfile.TemporaryDirectory() as scratch, trace.sampling(args.gpu_trace):
        for name in [n for n in args.families.split(",") if n] + [OWN + kind for kind in args.own.split(",") if kind]:
            table, key = (report["own"], name.removeprefix(OWN)) if name.startswith(OWN) else (report["families"], name)
            if clock.elapsed() > args.budget_s:
                table[key] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            else:
                clock.log(f"{name}: starting")
                table[key] = (run_own_pairs(name, args, scratch) if args.own_pairs and name.startswith(OWN) else
                              run_family_process(name, args, scratch))
                report["gpu"] = report["gpu"] or table[key].get("gpu")
            report["wall_s"] = round(clock.elapsed(), 1)
            write_report(args.out, report)  # after every family: a later one's failure loses nothing
    if args.gpu_trace:  # the sampler has stopped: its file is whole
        return trace.annotate(report, args.gpu_trace)
    return report
