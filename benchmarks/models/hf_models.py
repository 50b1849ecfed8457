"""Hugging Face causal LMs on one GPU: eager, torch.compile, mplan and Liger Kernel (issue 19's "must show").

Models, built from their configs (no download), bf16 parameters, SDPA attention, use_cache=False,
batch 8 x 2048 tokens:
    llama    LlamaForCausalLM at TinyLlama-1.1B's shape (22 layers, hidden 2048, 16 heads, 4 KV heads,
             SwiGLU 5632, vocab 32000, default RoPE)
    mistral  MistralForCausalLM at ~1.0B (16 layers, hidden 2048, 16 heads, 8 KV heads, SwiGLU 7168,
             vocab 32000, sliding_window None: full causal attention)
    qwen2    Qwen2ForCausalLM at Qwen2-1.5B's real shape (28 layers, hidden 1536, 12 heads, 2 KV heads,
             SwiGLU 8960, vocab 151936, tied embeddings, q/k/v biases): the large vocabulary stresses the loss
Systems, each training the same seed-0 weights on the same batches:
    eager    the HF model, its loss from labels=
    compile  torch.compile(HF model) (default mode; its warm-up includes the compile)
    mplan    mplan.autoparallel(model, plan="dp=1,tp=1,pp=1", kernels=True) then pm.train_step(ids, labels);
             the fusion report (pm.program.meta["fuse_kernels"]) is recorded
    liger    the HF model patched by liger_kernel.transformers.apply_liger_kernel_to_{llama,mistral,qwen2}
             (rope, rms_norm, swiglu, fused_linear_cross_entropy; cross_entropy off)
Every system trains alike: fused AdamW (lr 1e-4 after --lr-warmup steps of linear warm-up), global-norm
clipping at 1.0, the loss read back every step. Batches are FRESH: step k of every system trains on
batch k, drawn from a generator seeded with BATCH_SEED + 1 + k (tokens from a Zipf-like unigram distribution over a
fixed random permutation of the vocabulary, so the loss falls as the model learns it instead of
sitting at ln(vocab)); no batch is memorized.

How the systems are kept apart: Liger patches transformers' modeling modules at class/module level
(apply_rotary_pos_emb, the RMSNorm and MLP classes), which would silently change the eager and
compile systems of the same process. So liger runs in a child process (this case with
`--system liger --model NAME`), started at the beginning of each model so that its CPU-side build
overlaps the main process's work; it builds the same seed-0 model (a weights fingerprint from both
processes is reported), patches that instance, and waits for commands on a pipe (one JSON line
answers each): `warmup`, `run K` (K timed steps), `profile K`, `quit`. The main process runs
eager, compile and mplan; all four systems stay resident on the GPU and take turns in --rounds
interleaved rounds whose order rotates, the liger child being one of the turns (both processes
return their cached blocks with torch.cuda.empty_cache before the other's turn). So liger's steps
are timed between the others' like theirs, and its losses form one continuous trajectory.

Method (the `e2e` case's, whose warm_up and timed_rounds this case calls): each system
is built and warmed up in turn (--warmup steps); its peak memory is torch.cuda.max_memory_allocated
from a reset just before its build, above what was allocated then (the other resident systems and
the batches; in the child: the batches). Then --steps timed steps per system in --rounds rounds;
the step time is the median of every timed step (CUDA events).

Reported per model and system: median step time, model TFLOP/s (6 N tokens + 12 l h s tokens, N =
the parameters a token multiplies: all but the input embedding table, the output head included,
so a tied head counts once), peak memory, the losses and gradient norms of every step, set-up and
first-step times; per model mplan_vs_eager, mplan_vs_compile, mplan_vs_liger, mplan_vs_best_peer
(the fastest of eager, compile and liger that ran, over mplan: > 1 means mplan is faster), mplan's
peak memory over the lowest peer's, and the loss agreement of mplan with eager (compile's and
liger's with eager beside it, for scale): per step |loss - eager's| / eager's first loss <=
LOSS_STEP_RTOL, the means of the last LAST_STEPS losses within LOSS_MEAN_RTOL of each other, and
the first loss and first gradient norm within workloads.FIRST_STEP_RTOL (same weights, same batch,
no update yet).
Targets (issue 19): mplan_vs_best_peer >= 1.0; mplan's peak <= 1.10 x the lowest peer's; losses agree.

--families gpt,llama adds mplan's own GPT-1.3B and Llama-1.1B (e2e's workloads and systems,
eager/compile/mplan on e2e's memorized batch, judged by e2e's compare) to the same run, with
issue 19's targets: mplan >= 1.05x eager (GPT), >= 1.3x eager (Llama), >= torch.compile.
--profile records 2 steps of every system (the liger child's too) under torch.profiler after the
timing and reports GPU time by kernel category (gemm, attention, norm, rope, swiglu, elementwise,
loss, optimizer, copy, other; the `step-profile` case's categories refined by kernel name; mplan's RMSNorm
and unpacked SwiGLU kernels share the Triton names _forward_kernel/_backward_kernel, so they are
counted together as norm_or_swiglu).

Run on the GPU (from the repository root, with Liger installed from the carried wheels). A device
call has 600 s in all, builds and cold torch.compile warm-ups (40-60 s a model) included, so run one
model per call (about 3-4 minutes each with all four systems):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel pulp highspy
    PYTHONPATH=. python -m benchmarks.models hf-models --models llama --out $OUT/hf_llama.json
    PYTHONPATH=. python -m benchmarks.models hf-models --models mistral --out $OUT/hf_mistral.json
    PYTHONPATH=. python -m benchmarks.models hf-models --models qwen2 --out $OUT/hf_qwen2.json
    PYTHONPATH=. python -m benchmarks.models hf-models --models none --families gpt,llama --out $OUT/hf_families.json
A system not started within --budget-s seconds is skipped and says so.
Smoke test of the same code path on a CPU (tiny models; compile only if named in --systems; liger
skipped with its reason, or with --smoke-child its slot run by the plain HF model in the child
process, which tests the child's protocol: its losses must equal eager's bit for bit):
    PYTHONPATH=. python -m benchmarks.models hf-models --device cpu --small --families gpt,llama --profile \
        --smoke-child --out /tmp/hf.json
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from torch import nn

import mplan
from benchmarks.harness import add_device_flags
from benchmarks.models.child import PipeChild, answer_commands
from benchmarks.models.contest import (
    FAMILY_TARGET_VS_EAGER,
    PROFILE_STEPS,
    contest,
    finish,
    per_round,
    profile_all,
    race_own_model,
)
from benchmarks.models.hf_step import (
    BATCH_SEED,
    LOSS_MEAN_RTOL,
    LOSS_STEP_RTOL,
    ZIPF_OFFSET,
    Feed,
    HFModel,
    _families,
    build_compile,
    build_eager,
    fingerprint,
    hf_step,
    initial_model,
    loss_agreement,
    on_device,
    token_batches,
)
from benchmarks.models.timing import Running, warm_up
from benchmarks.models.workloads import FULL as FAMILIES_FULL
from benchmarks.models.workloads import MAX_GRAD_NORM, SMALL as FAMILIES_SMALL, SYSTEMS, Setting, Step
from benchmarks.report import Clock, run_header, write_report

TARGET_VS_BEST_PEER = 1.0
TARGET_PEAK_VS_LOWEST_PEER = 1.10
PEERS = ("eager", "compile", "liger")
ISOLATION = ("eager, compile and mplan run in the main process; liger in a child process (the hf-models case "
             "with --system liger), because Liger patches transformers' modules globally; the child builds the same "
             "seed-0 weights (fingerprints compared), trains on the same batches, and takes its turn in the same "
             "interleaved, rotating rounds as the main process's systems, all resident on the GPU, each process "
             "emptying its CUDA cache before the other's turn")


def batch_count(args: argparse.Namespace) -> int:
    """Steps every system takes: warm-up, timed (whole rounds) and profiled."""
    return args.warmup + args.rounds * per_round(args) + (PROFILE_STEPS if args.profile else 0)


def hf_flops(model: HFModel, module: nn.Module) -> float:
    """6 N tokens + 12 l h s tokens (the module docstring's N)."""
    config = module.config
    embed = module.get_input_embeddings().weight
    multiplied = sum(p.numel() for p in module.parameters() if p is not embed)
    if module.get_output_embeddings().weight is embed:  # tied: the head multiplies every token
        multiplied += embed.numel()
    tokens = model.batch * model.seq
    return 6 * multiplied * tokens + 12 * config.num_hidden_layers * config.hidden_size * model.seq * tokens


Builder = Callable[..., tuple[Step, dict[str, Any]]]


def build_liger(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    """Only in the liger child process: the patch reaches every model of transformers' classes."""
    module = on_device(model, setting)
    patch = getattr(importlib.import_module("liger_kernel.transformers"), model.liger_patch)
    patch(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False, model=module)
    info = {"pipeline": f"liger_kernel.transformers.{model.liger_patch}(rope, rms_norm, swiglu, "
                        "fused_linear_cross_entropy; model=instance)"}
    return hf_step(module, module, batches, setting), info


def build_mplan(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    module = on_device(model, setting)
    pm = mplan.autoparallel(module, example_inputs=(batches[0],), global_batch=model.batch, plan="dp=1,tp=1,pp=1",
                            kernels=True, optimizer=setting.optimizer(), max_grad_norm=MAX_GRAD_NORM,
                            dtype=torch.bfloat16, device=setting.device)
    del module  # pm trains the model's own tensors
    fusion = pm.program.meta["fuse_kernels"]
    schedule = setting.lr_schedule(pm.optimizer.optimizer)  # mplan's AdamW kernel reads group["lr"] every step
    feed = Feed(batches)

    def step() -> tuple[float, float]:
        schedule()
        ids = feed.next()
        return pm.train_step(ids, ids), pm.last_grad_norm

    return step, {"pipeline": 'mplan.autoparallel(plan="dp=1,tp=1,pp=1", kernels=True)',
                  "fuse_kernels": str(fusion), "fused": fusion.counts}


BUILDERS: dict[str, Builder] = {"eager": build_eager, "compile": build_compile, "mplan": build_mplan,
                                "liger": build_liger}


def warm_up_hf(name: str, model: HFModel, setting: Setting, batches: list[torch.Tensor],
               warmup: int) -> Running | dict[str, Any]:
    """`timing.warm_up` (the same measurement) on this case's builder for `name`."""
    with mock.patch.dict(SYSTEMS, {name: functools.partial(BUILDERS[name], batches=batches)}):
        return warm_up(name, model, setting, warmup)  # type: ignore[arg-type]


def liger_unavailable(device: torch.device) -> str | None:
    """Why the liger system cannot run here, or None."""
    if device.type != "cuda":  # Triton's interpreter fails in Liger's RMSNorm kernel (liger-kernel 0.8.5)
        return "skipped: Liger's kernels are Triton GPU kernels"
    if importlib.util.find_spec("liger_kernel") is None:
        return "skipped: liger-kernel is not installed (pip install --no-index --find-links .device_wheels " \
               "--no-deps liger-kernel)"
    return None


class LigerChild(PipeChild):
    """This case's liger system (`--system liger --model NAME`; it writes no report: it answers on the pipe)."""

    def __init__(self, model: HFModel, args: argparse.Namespace, system: str = "liger") -> None:
        command = [sys.executable, "-m", "benchmarks.models", "hf-models", "--out", os.devnull, "--system",
                   system, "--model", model.name,
                   "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--lr-warmup", str(args.lr_warmup)]
        super().__init__(command + (["--small"] if args.small else []) + (["--profile"] if args.profile else []))


def serve_child(args: argparse.Namespace) -> None:
    """The child's loop (`--system liger --model NAME`; `--system eager` only as the smoke test's
    stand-in): commands on stdin, JSON lines on the process's original stdout; anything libraries
    print goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    clock = Clock()
    setting = Setting(device=torch.device(args.device), precision="bf16", lr_warmup=args.lr_warmup)
    model = next(m for m in _families(args.small) if m.name == args.model)
    initial_model(model)  # the CPU build, while the main process builds its own systems
    clock.log(f"{args.system} child {model.name}: built on the CPU")
    answer_commands(answers, setting,
                    lambda: warm_up_hf(args.system, model, setting,
                                       token_batches(model, batch_count(args), setting.device), args.warmup),
                    lambda: fingerprint(initial_model(model)))


def compare_hf(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios against each peer and the best, peak memory against the lowest peer, loss agreement, targets."""
    ok = {name: row for name, row in rows.items() if "step_s" in row}
    out: dict[str, Any] = {"loss_agreement": {}}
    peers = [name for name in PEERS if name in ok]
    if "mplan" in ok:
        for peer in peers:
            out[f"mplan_vs_{peer}"] = ok[peer]["step_s"] / ok["mplan"]["step_s"]
        if peers:
            best = min(peers, key=lambda name: ok[name]["step_s"])
            out["best_peer"], out["mplan_vs_best_peer"] = best, ok[best]["step_s"] / ok["mplan"]["step_s"]
        peaks = {name: ok[name]["peak_gib"] for name in peers if ok[name].get("peak_gib")}
        if peaks and ok["mplan"].get("peak_gib"):
            lowest = min(peaks, key=peaks.__getitem__)
            out["lowest_peak_peer"] = lowest
            out["mplan_peak_vs_lowest_peer"] = ok["mplan"]["peak_gib"] / peaks[lowest]
    if "eager" in ok:
        for name in ("mplan", "compile", "liger"):
            if name in ok:
                out["loss_agreement"][f"{name}_vs_eager"] = loss_agreement(ok[name], ok["eager"])
    out["peers_timed"] = peers
    out["targets"] = {
        f"mplan_vs_best_peer>={TARGET_VS_BEST_PEER}": out.get("mplan_vs_best_peer", 0.0) >= TARGET_VS_BEST_PEER,
        f"peak<={TARGET_PEAK_VS_LOWEST_PEER}x_lowest_peer": (  # None where not measured (CPU)
            None if "mplan_peak_vs_lowest_peer" not in out
            else out["mplan_peak_vs_lowest_peer"] <= TARGET_PEAK_VS_LOWEST_PEER),
        "losses_agree_with_eager": out["loss_agreement"].get("mplan_vs_eager", {}).get("passed", False),
    }
    return out


def run_hf_model(model: HFModel, names: list[str], args: argparse.Namespace, setting: Setting,
                 clock: Clock) -> dict[str, Any]:
    reason = liger_unavailable(setting.device) if "liger" in names else None
    stand_in = reason is not None and args.smoke_child and setting.device.type == "cpu"
    child = LigerChild(model, args, "eager" if stand_in else "liger") if "liger" in names and (
        reason is None or stand_in) else None
    batches = token_batches(model, batch_count(args), setting.device)
    probe = initial_model(model)
    entry: dict[str, Any] = {
        "class": model.model_class, "config": dict(model.sizes), "rope_theta": model.rope_theta,
        "batch": model.batch, "seq_len": model.seq, "num_parameters": sum(p.numel() for p in probe.parameters()),
        "flops_per_step": hf_flops(model, probe), "weights_fingerprint": fingerprint(probe),
    }
    starts = {name: functools.partial(warm_up_hf, name, model, setting, batches, args.warmup)
              for name in names if name != "liger"}
    if "liger" in names:
        starts["liger"] = lambda: {"error": reason}
    try:
        rows, running = contest(starts, child, setting, args, clock, model.name)
        finish(rows, entry["flops_per_step"], model.name, clock.log)
        if args.profile and clock.elapsed() <= args.budget_s:
            entry["profile"] = profile_all(running, child, rows, setting)
    finally:
        if child is not None:
            child.close()
    if stand_in and "liger" in rows:
        rows["liger"]["stand_in"] = f"the plain HF model in the child process ({reason}): the child protocol's test"
    if "liger" in rows and "weights_fingerprint" in rows["liger"]:
        entry["liger_weights_match"] = rows["liger"]["weights_fingerprint"] == entry["weights_fingerprint"]
    entry["systems"] = rows
    entry.update(compare_hf(rows))
    clock.log(f"{model.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
                                           if k.startswith("mplan_") and isinstance(v, float))
              + f"; targets {entry['targets']}")
    running.clear()
    return entry


def _cleanup(setting: Setting) -> None:
    gc.collect()
    torch._dynamo.reset()
    if setting.device.type == "cuda":
        torch.cuda.empty_cache()


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for package in ("transformers", "liger-kernel"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flags(parser)
    parser.add_argument("--models", default="llama,mistral,qwen2",
                        help="comma-separated Hugging Face models (llama, mistral, qwen2; 'none' for none)")
    parser.add_argument("--systems", default=None,
                        help="comma-separated, of eager,compile,mplan,liger (default: all four on CUDA; "
                             "eager,mplan,liger on a CPU, where torch.compile is slow)")
    parser.add_argument("--families", default="",
                        help="also mplan's own models, of gpt,llama (e2e's GPT-1.3B and Llama-1.1B)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (their losses are checked)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per system (the median is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds the timed steps are spread over")
    parser.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="start no system (nor the profile) after this many seconds")
    parser.add_argument("--profile", action="store_true",
                        help=f"after timing, profile {PROFILE_STEPS} steps of each system by kernel category")
    parser.add_argument("--smoke-child", action="store_true",
                        help="CPU smoke test where Liger cannot run: run the liger slot's child process with the "
                             "plain HF model instead (tests the child protocol; its row says stand_in)")
    parser.add_argument("--system", choices=["liger", "eager"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--model", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The race, or in the liger child (`--system liger --model NAME`) its side of the pipe (no report)."""
    if args.systems is None:
        args.systems = "eager,compile,mplan,liger" if args.device == "cuda" else "eager,mplan,liger"
    if args.system is not None:
        serve_child(args)
        return None
    clock = Clock()
    setting = Setting(device=torch.device(args.device), precision="bf16", lr_warmup=args.lr_warmup)
    names = [name for name in args.systems.split(",") if name]
    wanted = set(args.models.split(","))
    report: dict[str, Any] = {
        **run_header(setting.device), **versions(),
        "precision": "bf16 parameters and activations",
        "training": f"fused AdamW lr {setting.lr} after {args.lr_warmup} steps of linear warm-up, global-norm "
                    f"clipping {MAX_GRAD_NORM}, loss read back every step",
        "batches": f"fresh every step: batch k from a generator seeded {BATCH_SEED} + 1 + k, Zipf-like tokens "
                   f"(offset {ZIPF_OFFSET}) over a fixed permutation of the vocabulary, labels = ids",
        "flops": "6 N B s + 12 l h s B s, N = parameters a token multiplies (all but the input embedding; the "
                 "output head included, once if tied)",
        "method": f"{args.warmup} warm-up steps per system, then {args.rounds} interleaved rounds of "
                  f"{per_round(args)} timed steps per system (rotating order), all systems resident; median step",
        "isolation": ISOLATION,
        "targets": {"mplan_vs_best_peer": TARGET_VS_BEST_PEER, "peak_vs_lowest_peer": TARGET_PEAK_VS_LOWEST_PEER,
                    "loss_step_rtol": LOSS_STEP_RTOL, "loss_mean_rtol": LOSS_MEAN_RTOL,
                    "families_mplan_vs_eager": FAMILY_TARGET_VS_EAGER},
        "models": {}, "families": {},
    }
    for model in (m for m in _families(args.small) if m.name in wanted):
        report["models"][model.name] = run_hf_model(model, names, args, setting, clock)
        write_report(args.out, report)  # after every model: a later one's failure loses nothing
        initial_model.cache_clear()
        _cleanup(setting)
    kinds = {kind for kind in args.families.split(",") if kind}
    family_names = [name for name in names if name in ("eager", "compile", "mplan")]
    for workload in (w for w in (FAMILIES_SMALL if args.small else FAMILIES_FULL) if w.name.split("-")[0] in kinds):
        report["families"][workload.name] = race_own_model(workload, family_names, args, setting, clock)
        write_report(args.out, report)
        _cleanup(setting)
    report["wall_s"] = round(clock.elapsed(), 1)
    return report
