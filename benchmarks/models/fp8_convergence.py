"""FP8 against bf16 training over a few hundred fresh batches on one GPU: do their losses converge alike?

The `e2e` case compares mplan's FP8 losses with bf16's over 15 steps of one batch, which the
models memorize: thin evidence (Llama's FP8 loss ran up to 7.2% of the first loss above
bf16's mid-descent in benchmarks/results/e2e_h200-2026-11-29.json). Here both train on data with
learnable structure and a known best loss, a fresh batch every step, long enough to leave the
steep part of the descent.

Data: a fixed random first-order Markov chain over the token ids 0..--states-1 (default 8192 of
the vocabulary): each state has --successors (8) distinct successors drawn uniformly, their
probabilities softmax(LOGIT_SCALE z), z ~ N(0, 1). Sequences start from the chain's stationary
distribution pi, so every position has the same best achievable loss, the entropy rate
H = sum_i pi_i H(P_i). Also reported: H(pi), the loss of a model that ignores its input (what
learning the transitions must beat), and the exact best loss on the final steps' batches (the
mean of -log P(label | input)). All --steps x batch sequences are drawn once, on the device, from
--seed; both systems train on the same batches in the same order, from e2e's seed-0
weights. Why 8192 states and not the whole vocabulary: 300 steps of 8 x 2048 tokens see each of
8192 x 8 transitions ~75 times, each of 50304 x 8 only ~12 times, too few to get near the floor.

Systems (benchmarks/models/workloads.mplan_module, plan dp=1,tp=1,pp=1, kernels=True):
    mplan      bf16 parameters and activations
    mplan_fp8  the same with fp8=True (the blocks' linears as FP8 GEMMs, delayed scaling)
Training as e2e (fused AdamW, global-norm clipping at 1.0, the loss read back every step)
but a peak lr of 3e-4 (e2e: 1e-4), the usual peak for models of this size, chosen to get far
down the curve in a few hundred steps (how far is for the first run to show), warmed up linearly
over the first 10% of steps against early spikes, then constant. No decay: bf16 parameters have
no fp32 master copy, so an update under half an ulp (2^-9 to 2^-8 of the weight) is lost, and a
decayed lr reaches that first.

Reported per model: each system's loss and gradient norm (before clipping) at every step, its
median step time (CUDA events; the first step, which autotunes, left out) and its final loss
(the mean over the last 10% of steps); the chain's entropy rate, H(pi) and the best final loss;
and FP8 against bf16: the final losses' relative difference (fp8 - bf16) / bf16, the same over
bf16's excess above the best final loss, and the largest |smoothed fp8 - smoothed bf16| /
smoothed bf16 after the first 10% of steps (trailing means over SMOOTH_STEPS). Batch noise falls
on both alike (the same batches) and mostly cancels in the differences; bf16's own run-to-run
spread (non-deterministic kernels) is not measured. Passed: FP8's final loss at most
FINAL_LOSS_RTOL above bf16's (one-sided: FP8 ending lower is no failure).

Run on the GPU (from the repository root; about 6 minutes: two CPU model builds, then per model
and system its set-up and autotuning, ~20 s, and 300 steps at ~0.17-0.26 s; a system not started
within --budget-s is skipped and says so; the report is rewritten after every system):
    PYTHONPATH=. python -m benchmarks.models fp8-convergence --out $OUT/fp8_convergence.json
One model at a time: add --models gpt-1.3b (or llama-1.1b).
Smoke test of the same code path on a CPU (tiny models on a 16-state chain, mplan's kernels on
their references; FP8 needs a CUDA device of capability >= 8.9, so it is skipped with the reason):
    PYTHONPATH=. python -m benchmarks.models fp8-convergence --device cpu --small --out /tmp/fp8_convergence.json
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import add_device_flags
from benchmarks.models.timing import start_timer
from benchmarks.models.workloads import MAX_GRAD_NORM, Setting, Workload, mplan_module, select_workloads
from benchmarks.report import Clock, run_header, write_report
from mplan.kernels.fp8 import fp8_unavailable_reason
from mplan.runtime.parallel_module import ParallelModule

FINAL_LOSS_RTOL = 0.01
"""FP8's final loss at most 1% above bf16's. Not measured by mplan: general knowledge of published
FP8 training (NVIDIA Transformer Engine's and others' FP8 loss curves end within about 1% of
bf16's), cited from memory, not from one paper's figure. The losses come back in bf16 (an error of
at most 2^-9, 0.2%, per step), which the mean over the final steps averages down"""
FINAL_FRACTION = 0.1
"""the final loss is the mean over this last fraction of the steps; the curve gap skips as much
at the start, where both fall fastest and a step's lag is a large relative difference"""
SMOOTH_STEPS = 10
"""the trailing mean that smooths each curve before the step-by-step comparison"""
WARMUP_FRACTION = 0.1
"""the lr rises linearly to its peak over this first fraction of the steps"""
LOGIT_SCALE = 1.5
"""a state's successor probabilities are softmax(LOGIT_SCALE z): an entropy rate of ~1.43 nats
(8192 or 50304 states; ln 8 = 2.08 were they uniform)"""
CHUNK_ROWS = 4096
"""rows of the [rows, states] uniform draw that picks successors, at a time (4096 x 50304 fp32: 0.8 GB)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """The defaults of a run, which --steps, --states and --lr override."""

    steps: int
    states: int
    """the chain's states: token ids 0..states-1 (at most the vocabulary)"""
    lr: float
    """AdamW's peak learning rate"""


GPU_RECIPE = Recipe(steps=300, states=8192, lr=3e-4)
SMOKE_RECIPE = Recipe(steps=120, states=16, lr=3e-3)
"""tiny models learn slowly at 3e-4; at 3e-3 they get well below H(pi) on 16 states in 120 steps
of 2 x 32 tokens (final ~1.7 nats; H(pi) 2.61, entropy rate 1.51)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkovChain:
    """State i moves to successors[i, j] with probability probs[i, j]; a row's successors are distinct."""

    successors: torch.Tensor
    """[states, k] int64"""
    probs: torch.Tensor
    """[states, k] float64, rows summing to 1"""
    stationary: torch.Tensor
    """[states] float64, pi = pi P"""

    @property
    def entropy_rate(self) -> float:
        """sum_i pi_i H(P_i), nats per token: the best loss any model can reach on stationary sequences."""
        return float((self.stationary * -torch.xlogy(self.probs, self.probs).sum(-1)).sum())

    @property
    def context_free_loss(self) -> float:
        """H(pi), nats: the best loss of a model that ignores its input."""
        return float(-torch.xlogy(self.stationary, self.stationary).sum())

    def best_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean of -log P(label | input) over a batch: the Bayes-optimal model's loss on it."""
        hit = self.successors[ids] == labels[..., None]
        return float(-(self.probs[ids] * hit).sum(-1).log().mean())


def make_chain(num_states: int, num_successors: int, generator: torch.Generator) -> MarkovChain:
    """A random chain drawn from `generator` (on its device), with its stationary distribution."""
    device = generator.device
    successors = torch.cat([
        torch.rand(min(CHUNK_ROWS, num_states - start), num_states, generator=generator, device=device)
        .topk(num_successors, dim=1).indices
        for start in range(0, num_states, CHUNK_ROWS)])
    logits = LOGIT_SCALE * torch.randn(num_states, num_successors, generator=generator, device=device,
                                       dtype=torch.float64)
    probs = logits.softmax(-1)
    return MarkovChain(successors=successors, probs=probs, stationary=_stationary(successors, probs))


def _stationary(successors: torch.Tensor, probs: torch.Tensor, tol: float = 1e-12,
                max_iterations: int = 100_000) -> torch.Tensor:
    """pi by power iteration of the lazy chain (P + I) / 2, which has the same pi but is never
    periodic, from the uniform distribution until an iteration moves pi by < tol (L1)."""
    pi = torch.full((successors.shape[0],), 1 / successors.shape[0], dtype=torch.float64, device=successors.device)
    for _ in range(max_iterations):
        moved = torch.zeros_like(pi).index_add_(0, successors.flatten(), (pi[:, None] * probs).flatten())
        lazy = (pi + moved) / 2
        if float((lazy - pi).abs().sum()) < tol:
            return lazy
        pi = lazy
    raise RuntimeError(f"the chain's stationary distribution did not converge in {max_iterations} iterations")


def sample(chain: MarkovChain, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[num_sequences, length] int64 token ids walking the chain, the first drawn from pi."""
    cumulative = chain.probs.cumsum(-1)
    last = chain.successors.shape[1] - 1  # where rounding leaves a row's cumulative sum under u
    tokens = torch.empty(num_sequences, length, dtype=torch.int64, device=chain.successors.device)
    tokens[:, 0] = torch.multinomial(chain.stationary, num_sequences, replacement=True, generator=generator)
    for t in range(1, length):
        current = tokens[:, t - 1]
        u = torch.rand(num_sequences, 1, generator=generator, device=tokens.device, dtype=torch.float64)
        choice = (u > cumulative[current]).sum(-1).clamp_(max=last)
        tokens[:, t] = chain.successors[current, choice]
    return tokens


def batches(tokens: torch.Tensor, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) per step: `batch` sequences of `tokens` [steps * batch, seq_len + 1] in order,
    labels the next token of each input."""
    for start in range(0, tokens.shape[0], batch):
        rows = tokens[start:start + batch]
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def train(pm: ParallelModule, tokens: torch.Tensor, batch: int, device: torch.device) -> dict[str, Any]:
    """One step per batch of `tokens` under the warm-up schedule; every step's loss, gradient norm
    and time."""
    steps = tokens.shape[0] // batch
    warmup = max(1, round(WARMUP_FRACTION * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer.optimizer, lambda step: min(1.0, (step + 1) / warmup))
    losses: list[float] = []
    grad_norms: list[float | None] = []
    step_s: list[float] = []
    for ids, labels in batches(tokens, batch):
        elapsed = start_timer(device)
        losses.append(pm.train_step(ids, labels))  # reading the loss back waits for the step
        step_s.append(round(elapsed(), 5))
        grad_norms.append(pm.last_grad_norm)
        schedule.step()
    tail = _tail(steps)
    return {"losses": losses, "grad_norms": grad_norms, "step_s_all": step_s, "warmup_steps": warmup,
            "step_s": statistics.median(step_s[1:] or step_s), "first_step_s": step_s[0],
            "final_loss": statistics.fmean(losses[-tail:])}


def _tail(steps: int) -> int:
    return max(1, round(FINAL_FRACTION * steps))


def _trailing_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def compare(bf16: list[float], fp8: list[float], best_final_loss: float) -> dict[str, Any]:
    """FP8's losses against bf16's, step for step over the same batches (see the module docstring)."""
    steps = len(bf16)
    tail = _tail(steps)
    final_bf16, final_fp8 = statistics.fmean(bf16[-tail:]), statistics.fmean(fp8[-tail:])
    smooth_bf16, smooth_fp8 = _trailing_mean(bf16, SMOOTH_STEPS), _trailing_mean(fp8, SMOOTH_STEPS)
    start = min(steps - 1, max(tail, SMOOTH_STEPS - 1))
    gaps = [abs(f - b) / b for b, f in zip(smooth_bf16[start:], smooth_fp8[start:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    final_rel_diff = (final_fp8 - final_bf16) / final_bf16
    return {
        "final_steps": tail, "final_loss_bf16": final_bf16, "final_loss_fp8": final_fp8,
        "final_rel_diff": final_rel_diff,
        "final_excess_rel_diff": (final_fp8 - final_bf16) / (final_bf16 - best_final_loss),
        "smoothed_max_rel_gap": gaps[worst], "smoothed_max_rel_gap_step": start + worst,
        "smoothed_from_step": start, "tolerance": FINAL_LOSS_RTOL,
        "passed": math.isfinite(final_rel_diff) and final_rel_diff <= FINAL_LOSS_RTOL,
    }


def run_system(workload: Workload, setting: Setting, fp8: bool, tokens: torch.Tensor) -> dict[str, Any]:
    """Builds one system and trains it on `tokens`; returns its row, or the error instead."""
    start = time.perf_counter()
    pm = None
    try:
        pm, info = mplan_module(workload, setting, fp8)
        info["setup_s"] = round(time.perf_counter() - start, 2)
        info.update(train(pm, tokens, workload.batch, setting.device))
        return info
    except Exception:  # noqa: BLE001 - one system's failure must not lose the other's numbers
        return {"error": traceback.format_exc()}
    finally:
        del pm
        gc.collect()
        if setting.device.type == "cuda":
            torch.cuda.empty_cache()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flags(parser, small=False)
    parser.add_argument("--small", action="store_true", help="tiny models, 16 states (--device cpu: the smoke test)")
    parser.add_argument("--models", default=None, help="comma-separated workload names (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per system (default {GPU_RECIPE.steps}; --small {SMOKE_RECIPE.steps})")
    parser.add_argument("--states", type=int, default=None,
                        help=f"the chain's states (default {GPU_RECIPE.states}; --small {SMOKE_RECIPE.states})")
    parser.add_argument("--successors", type=int, default=8, help="successors of each state")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate (default {GPU_RECIPE.lr}; --small {SMOKE_RECIPE.lr})")
    parser.add_argument("--seed", type=int, default=0, help="the chain's and the batches' seed")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="start no system after this many seconds (a GPU command may run 600 s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    log = clock.log
    default = SMOKE_RECIPE if args.small else GPU_RECIPE
    recipe = Recipe(steps=args.steps or default.steps, states=args.states or default.states, lr=args.lr or default.lr)
    setting = Setting(device=torch.device(args.device), precision="bf16", lr=recipe.lr)
    workloads = select_workloads(args.small, args.models)
    report: dict[str, Any] = {
        **run_header(setting.device),
        "precision": "bf16 parameters and activations; mplan_fp8: the blocks' linears as FP8 GEMMs",
        "training": f"fused AdamW, lr {recipe.lr} warmed up linearly over the first {WARMUP_FRACTION:.0%} of "
                    f"{recipe.steps} steps then constant, global-norm clipping {MAX_GRAD_NORM}, loss read back "
                    f"every step",
        "data": f"a random first-order Markov chain over token ids 0..states-1, {args.successors} distinct successors "
                f"per state with probabilities softmax({LOGIT_SCALE} z), z ~ N(0,1); sequences start from its "
                f"stationary distribution; a fresh batch every step, the same batches for both systems (seed "
                f"{args.seed})",
        "method": f"each system built from the seed-0 weights and trained {recipe.steps} steps, one after the other; "
                  f"final loss = mean over the last {FINAL_FRACTION:.0%} of steps; curve gap = max over steps past "
                  f"the first {FINAL_FRACTION:.0%} of |smoothed fp8 - smoothed bf16| / smoothed bf16, trailing "
                  f"means over {SMOOTH_STEPS} steps; passed: (final fp8 - final bf16) / final bf16 <= "
                  f"{FINAL_LOSS_RTOL} (a tolerance from general knowledge of published FP8 training, not measured)",
        "models": {},
    }
    for workload in workloads:
        config = workload.config
        states = min(recipe.states, config.vocab)
        generator = torch.Generator(device=setting.device).manual_seed(args.seed)
        chain = make_chain(states, args.successors, generator)
        tokens = sample(chain, recipe.steps * workload.batch, config.seq_len + 1, generator)
        final = tokens[-_tail(recipe.steps) * workload.batch:]
        entry = report["models"][workload.name] = {
            "config": dataclasses.asdict(config), "batch": workload.batch,
            "chain": {"states": states, "successors": args.successors, "entropy_rate": chain.entropy_rate,
                      "context_free_loss": chain.context_free_loss,
                      "best_final_loss": chain.best_loss(final[:, :-1], final[:, 1:])},
            "systems": {},
        }
        log(f"{workload.name}: chain of {states} states, entropy rate {chain.entropy_rate:.4f}, "
            f"H(pi) {chain.context_free_loss:.4f}")
        for name, fp8 in (("mplan", False), ("mplan_fp8", True)):
            reason = fp8_unavailable_reason(setting.device) if fp8 else None
            if reason is None and clock.elapsed() > args.budget_s:
                reason = f"past the {args.budget_s:.0f} s budget"
            if reason is not None:
                entry["systems"][name] = {"skipped": reason}
                log(f"{workload.name} {name}: skipped ({reason})")
                continue
            row = entry["systems"][name] = run_system(workload, setting, fp8, tokens)
            if "error" in row:
                log(f"{workload.name} {name}: ERROR " + row["error"].strip().splitlines()[-1])
            else:
                log(f"{workload.name} {name}: step {row['step_s'] * 1e3:.1f} ms, loss {row['losses'][0]:.3f} -> "
                    f"final {row['final_loss']:.4f} (best {entry['chain']['best_final_loss']:.4f})")
            write_report(args.out, report)
        ran = [name for name in ("mplan", "mplan_fp8") if "losses" in entry["systems"][name]]
        if len(ran) == 2:
            entry["comparison"] = compare(entry["systems"]["mplan"]["losses"], entry["systems"]["mplan_fp8"]["losses"],
                                          entry["chain"]["best_final_loss"])
            c = entry["comparison"]
            log(f"{workload.name}: fp8 vs bf16 final {c['final_rel_diff']:+.2%} (of the excess over the best: "
                f"{c['final_excess_rel_diff']:+.1%}), smoothed curve gap max {c['smoothed_max_rel_gap']:.2%} at step "
                f"{c['smoothed_max_rel_gap_step']}: {'PASSED' if c['passed'] else 'FAILED'} "
                f"(tolerance {FINAL_LOSS_RTOL:.0%})")
        else:
            entry["comparison"] = {"skipped": f"needs both systems' losses; ran: {ran or 'none'}"}
            log(f"{workload.name}: no comparison ({entry['comparison']['skipped']})")
    report["wall_s"] = round(clock.elapsed(), 1)
    return report
