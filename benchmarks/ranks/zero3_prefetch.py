"""How much of zero=3's unit gathers the prefetch hides on gloo CPU ranks: step time with the
prefetch against the same job on the commit before it, and zero=1's.

    PYTHONPATH=. python -m benchmarks.ranks zero3-prefetch --rounds 6 \\
        -o benchmarks/results/zero3_prefetch-cpu-2026-12-06.json
(that result made before the harness, by `python benchmarks/zero3_prefetch_cpu.py` with the same flags)

Each variant is one torchrun job of 4 ranks (gloo, float32, one thread a rank) running this case
with `--job`: it builds the model under `dp=4` at the variant's zero level, takes
`--warmup` steps, then times `--steps` steps between barriers and, inside each, the seconds the
rank spends in the optimizer's `gather` and `prefetch` calls: the gathers' exposed time (with the
prefetch, the wait for a gather issued a unit earlier; without it, the whole blocking gather).
The variants take turns, `--rounds` times, so drift on a shared machine falls on all alike.
Each runs the `mplan` package of a commit, extracted by `git archive` and put first on
PYTHONPATH (so edits to the working tree meanwhile change nothing; the job's `benchmarks` package
is the working tree's):

    zero3          zero=3 on `--after` (each unit's gather issued one unit ahead)
    zero3-before   zero=3 on `--before` (synchronous gathers)
    zero1          zero=1 on `--after`: no per-unit gathers (the parameters stay whole)

Every figure is measured. The gathers' share of a step is read off zero3-before (its gather
seconds over its step); the share of them the prefetch leaves exposed (zero3's gather seconds over
zero3-before's) is set beside the share that pricing the gathers as overlapped would leave
(`exposed_share_if_overlapped`: the first gather of each pass, by bytes, where each unit computes
longer than the next one's gather takes; `planner/evaluate.py` ZeroCollectives.unit_seconds).
Each job also records the machine's 1-minute load average at its end (its own 4 ranks make about
4 of it), since a shared machine's other jobs slow some rounds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ranks.launch import header, join_job, timed, torchrun

REPO = Path(__file__).resolve().parents[2]
RANKS = 4
DEFAULT_MODEL = "llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1536,seq=128,vocab=8192"
BEFORE = "b9bf0d1^"
"""The commit before zero=3's prefetch landed (b9bf0d1 added it)."""
TREE_OF = {"zero3": "after", "zero3-before": "before", "zero1": "after"}
VARIANTS = ("zero3", "zero3-before", "zero1")


# -- one job (every rank of a torchrun job) --------------------------------------------------------
def _job(args: argparse.Namespace) -> dict[str, Any] | None:
    """One variant on this torchrun job's ranks: rank 0's per-step figures, None on the others."""
    import mplan
    from mplan.models import build_model

    torch.set_num_threads(1)
    if not join_job():
        raise SystemExit("--job runs under torchrun: the driver starts it")
    model = build_model(args.model, device="cpu", dtype=torch.float32, seed=0)
    ids = torch.randint(0, model.config.vocab, (args.batch, model.config.seq_len),
                        generator=torch.Generator().manual_seed(0))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            global_batch=args.batch, micro_batch_size=args.mbs, plan=f"dp={RANKS},zero={args.job}",
                            progress="quiet")
    inside = [0.0]
    for name in ("gather", "prefetch"):  # zero=3 only; the tree before the prefetch has no `prefetch`
        if hasattr(pm.optimizer, name):
            setattr(pm.optimizer, name, _clocked(getattr(pm.optimizer, name), inside))
    steps, gathers = [], []
    for step in range(args.warmup + args.steps):
        inside[0] = 0.0
        seconds, _ = timed(lambda: pm.train_step(ids, ids))
        if step >= args.warmup:
            steps.append(seconds)
            gathers.append(inside[0])
    # zero=3: each unit's gathered bytes, in forward order (the first gather of each pass is the
    # first unit's, forward, and the last unit's, backward)
    units = [sum(held.nbytes for held in unit) for unit in getattr(pm.optimizer, "_units", ())]
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"mplan": mplan.__file__, "plan": pm.plan.spec(), "step_s": steps, "gather_s": gathers,
            "parameters": sum(p.numel() for p in model.parameters()), "unit_bytes": units,
            "load": os.getloadavg()[0]}


def _clocked(method: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    """`method`, adding the seconds each call takes to `total[0]`."""
    def clocked(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start
    return clocked


# -- the driver: jobs taking turns, each on its commit's mplan --------------------------------------
def _extract(commit: str, into: Path) -> None:
    """`commit`'s `mplan` package under `into`."""
    archive = subprocess.run(["git", "archive", commit, "mplan"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def _run_job(variant: str, args: argparse.Namespace, tree: Path, out: Path) -> dict[str, Any]:
    """One torchrun job of `variant` on `tree`'s mplan (the job starts in `tree`, so that no other
    `mplan` comes before it on its path): rank 0's row."""
    zero = 1 if variant == "zero1" else 3
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tree), str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = torchrun(RANKS, ["zero3-prefetch", "--job", str(zero), "--model", args.model, "--batch", str(args.batch),
                               "--mbs", str(args.mbs), "--warmup", str(args.warmup), "--steps", str(args.steps),
                               "--out", str(out)])
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-4000:]}")
    row = json.loads(out.read_text())
    if not Path(row["mplan"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{variant} imported mplan from {row['mplan']}, not from {tree}")
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [s for row in rows for s in row["step_s"]]
    gathers = [g for row in rows for g in row["gather_s"]]
    return {"plan": rows[0]["plan"], "step_s_median": round(statistics.median(steps), 4),
            "step_s_min": round(min(steps), 4), "gather_s_median": round(statistics.median(gathers), 4),
            "steps_timed": len(steps), "step_s_by_round": [round(statistics.median(r["step_s"]), 4) for r in rows],
            "gather_s_by_round": [round(statistics.median(r["gather_s"]), 4) for r in rows],
            "load_by_round": [round(r["load"], 1) for r in rows]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per job")
    parser.add_argument("--rounds", type=int, default=3, help="jobs per variant, taking turns")
    parser.add_argument("--before", default=BEFORE, help="the commit whose zero=3 has no prefetch")
    parser.add_argument("--after", default="HEAD", help="the commit whose zero=3 prefetches")
    parser.add_argument("--job", type=int, default=None, metavar="ZERO", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.job is not None:
        return _job(args)
    commits = {side: subprocess.run(["git", "rev-parse", getattr(args, side)], cwd=REPO, capture_output=True,
                                    text=True, check=True).stdout.strip() for side in ("before", "after")}
    with tempfile.TemporaryDirectory(prefix="mplan_trees_") as root:
        trees = {side: Path(root) / side for side in commits}
        for side, tree in trees.items():
            tree.mkdir()
            _extract(commits[side], tree)
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for round_ in range(args.rounds):
            for variant in VARIANTS:
                out = Path(root) / f"{variant}-{round_}.json"
                rows[variant].append(_run_job(variant, args, trees[TREE_OF[variant]], out))
                print(f"round {round_ + 1}/{args.rounds} {variant}: "
                      f"{statistics.median(rows[variant][-1]['step_s']):.4f} s a step", file=sys.stderr)
    results = {v: _summary(r) for v, r in rows.items()}
    units = rows["zero3"][0]["unit_bytes"]
    now, was = results["zero3"], results["zero3-before"]
    print(f"zero3 {now['step_s_median']} s a step, zero3-before {was['step_s_median']} s, zero1 "
          f"{results['zero1']['step_s_median']} s; gathers exposed: {now['gather_s_median']} s of "
          f"{was['gather_s_median']} s")
    return {**header(torch.device("cpu")),
            "model": args.model, "parameters": rows["zero3"][0]["parameters"], "dtype": "float32",
            "unit_bytes": units, "ranks": RANKS, "backend": "gloo", "threads_per_rank": 1, "global_batch": args.batch,
            "mbs": args.mbs, "before_commit": commits["before"], "after_commit": commits["after"],
            "note": "measured; each variant a torchrun job per round, variants taking turns; step_s between "
                    "barriers on every rank (rank 0's clock); gather_s: seconds inside the optimizer's gather "
                    "and prefetch calls, the gathers' exposed time; load_by_round: the machine's 1-minute load "
                    "average at each job's end, its own 4 ranks about 4 of it",
            "variants": results,
            "gathers_share_before": round(was["gather_s_median"] / was["step_s_median"], 3),
            "step_saved_s": round(was["step_s_median"] - now["step_s_median"], 4),
            "step_speedup": round(was["step_s_median"] / now["step_s_median"], 3),
            # before over after in each round: the pair ran minutes apart, under much the same load
            "step_speedup_by_round": [round(b / a, 3) for a, b in zip(now["step_s_by_round"], was["step_s_by_round"])],
            "exposed_share_measured": round(now["gather_s_median"] / was["gather_s_median"], 3),
            "exposed_share_if_overlapped": round((units[0] + units[-1]) / sum(units), 3)}
