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
compile systems of the same process. So liger runs in a child process (this script with
`--system liger --model NAME`), started at the beginning of each model so that its CPU-side build
overlaps the main process's work; it builds the same seed-0 model (a weights fingerprint from both
processes is reported), patches that instance, and waits for commands on a pipe (one JSON line
answers each): `warmup`, `run K` (K timed steps), `profile K`, `quit`. The main process runs
eager, compile and mplan; all four systems stay resident on the GPU and take turns in --rounds
interleaved rounds whose order rotates, the liger child being one of the turns (both processes
return their cached blocks with torch.cuda.empty_cache before the other's turn). So liger's steps
are timed between the others' like theirs, and its losses form one continuous trajectory.

Method (benchmarks/e2e.py's, whose warm_up and timed_rounds this script calls): each system
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
the first loss and first gradient norm within e2e.FIRST_STEP_RTOL (same weights, same batch,
no update yet).
Targets (issue 19): mplan_vs_best_peer >= 1.0; mplan's peak <= 1.10 x the lowest peer's; losses agree.

--families gpt,llama adds mplan's own GPT-1.3B and Llama-1.1B (e2e's workloads and systems,
eager/compile/mplan on e2e's memorized batch, judged by e2e's compare) to the same run, with
issue 19's targets: mplan >= 1.05x eager (GPT), >= 1.3x eager (Llama), >= torch.compile.
--profile records 2 steps of every system (the liger child's too) under torch.profiler after the
timing and reports GPU time by kernel category (gemm, attention, norm, rope, swiglu, elementwise,
loss, optimizer, copy, other; step_profile's categories refined by kernel name; mplan's RMSNorm
and unpacked SwiGLU kernels share the Triton names _forward_kernel/_backward_kernel, so they are
counted together as norm_or_swiglu).

Run on the GPU (from the repository root, with Liger installed from the carried wheels). A device
call has 600 s in all, builds and cold torch.compile warm-ups (40-60 s a model) included, so run one
model per call (about 3-4 minutes each with all four systems):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel pulp highspy
    PYTHONPATH=. python3 benchmarks/hf_models.py --models llama --out $OUT/hf_llama.json
    PYTHONPATH=. python3 benchmarks/hf_models.py --models mistral --out $OUT/hf_mistral.json
    PYTHONPATH=. python3 benchmarks/hf_models.py --models qwen2 --out $OUT/hf_qwen2.json
    PYTHONPATH=. python3 benchmarks/hf_models.py --models none --families gpt,llama --out $OUT/hf_families.json
A system not started within --budget-s seconds is skipped and says so.
Smoke test of the same code path on a CPU (tiny models; compile only if named in --systems; liger
skipped with its reason, or with --smoke-child its slot run by the plain HF model in the child
process, which tests the child's protocol: its losses must equal eager's bit for bit):
    PYTHONPATH=. python3 benchmarks/hf_models.py --device cpu --small --families gpt,llama --profile \
        --smoke-child --out /tmp/hf.json
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import select
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mplan  # noqa: E402
from benchmarks.e2e import (  # noqa: E402
    FIRST_STEP_RTOL,
    MAX_GRAD_NORM,
    SYSTEMS,
    Running,
    Setting,
    Step,
    Workload,
    _initial_model,
    _plain_step,
    compare,
    model_flops,
    timed_rounds,
    warm_up,
)
from benchmarks.e2e import FULL as FAMILIES_FULL  # noqa: E402
from benchmarks.e2e import SMALL as FAMILIES_SMALL  # noqa: E402
from benchmarks.report import Clock, run_header, write_report  # noqa: E402
from benchmarks.step_profile import category as coarse_category, profiled  # noqa: E402

MODEL_SEED = 0
BATCH_SEED = 1234
ZIPF_OFFSET = 10.0
"""token k of the permuted vocabulary is drawn with probability proportional to 1 / (k + ZIPF_OFFSET)"""
LOSS_STEP_RTOL = 2e-2
"""per step, |loss - eager's loss| / eager's first loss: bf16 systems that round differently (fused
kernels compute in fp32 and round once; Liger's fused linear cross-entropy works in chunks) drift
apart by ~1e-3 of the loss per step; 2% leaves room for that drift over the run, not for a bug
(a wrong gradient term parts the curves by more within a few steps at lr 1e-4)"""
LOSS_MEAN_RTOL = 1e-2
"""the mean of the last LAST_STEPS losses against eager's, relative: where the runs end up"""
LAST_STEPS = 5
TARGET_VS_BEST_PEER = 1.0
TARGET_PEAK_VS_LOWEST_PEER = 1.10
FAMILY_TARGET_VS_EAGER = {"gpt": 1.05, "llama": 1.3}
"""issue 19: mplan's own families keep these speed-ups over eager (and are no slower than compile)"""
PEERS = ("eager", "compile", "liger")
PROFILE_STEPS = 2
CHILD_TIMEOUT_S = {"warmup": 400.0, "run": 180.0, "profile": 180.0, "quit": 60.0}
GiB = 2**30
ISOLATION = ("eager, compile and mplan run in the main process; liger in a child process (this script with "
             "--system liger), because Liger patches transformers' modules globally; the child builds the same "
             "seed-0 weights (fingerprints compared), trains on the same batches, and takes its turn in the same "
             "interleaved, rotating rounds as the main process's systems, all resident on the GPU, each process "
             "emptying its CUDA cache before the other's turn")


@dataclass(frozen=True, kw_only=True, slots=True)
class HFModel:
    """One Hugging Face causal LM: its transformers classes, Liger's patch for it, its sizes."""

    name: str
    config_class: str
    model_class: str
    liger_patch: str
    """the function of liger_kernel.transformers that patches this family"""
    sizes: tuple[tuple[str, Any], ...]
    """the config's keyword arguments (a tuple, so the model can key a cache)"""
    rope_theta: float
    batch: int
    seq: int

    def config(self) -> Any:
        transformers = importlib.import_module("transformers")
        return getattr(transformers, self.config_class)(
            **dict(self.sizes), rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attn_implementation="sdpa", use_cache=False)

    @property
    def vocab(self) -> int:
        return dict(self.sizes)["vocab_size"]


def _families(small: bool) -> tuple[HFModel, ...]:
    """The three models at full size (8 x 2048 tokens) or tiny (the CPU smoke test's 2 x 32)."""
    batch, seq = (2, 32) if small else (8, 2048)

    def sizes(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, **extra: Any
              ) -> tuple[tuple[str, Any], ...]:
        if small:
            layers, hidden, heads, kv_heads, ffn, vocab = 2, 64, 4, 2, 128, 128
        return tuple({"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                      "num_key_value_heads": kv_heads, "intermediate_size": ffn, "vocab_size": vocab,
                      **{k: (v(hidden // heads) if callable(v) else v) for k, v in extra.items()}}.items())

    return (
        HFModel(name="llama", config_class="LlamaConfig", model_class="LlamaForCausalLM",
                liger_patch="apply_liger_kernel_to_llama", rope_theta=10000.0, batch=batch, seq=seq,
                sizes=sizes(22, 2048, 16, 4, 5632, 32000, tie_word_embeddings=False, rms_norm_eps=1e-5,
                            max_position_embeddings=2048)),
        HFModel(name="mistral", config_class="MistralConfig", model_class="MistralForCausalLM",
                liger_patch="apply_liger_kernel_to_mistral", rope_theta=1e6, batch=batch, seq=seq,
                sizes=sizes(16, 2048, 16, 8, 7168, 32000, head_dim=lambda head_dim: head_dim, sliding_window=None,
                            tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=32768)),
        HFModel(name="qwen2", config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
                liger_patch="apply_liger_kernel_to_qwen2", rope_theta=1e6, batch=batch, seq=seq,
                sizes=sizes(28, 1536, 12, 2, 8960, 151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                            max_position_embeddings=32768)),
    )


# ---- model, batches, FLOPs -------------------------------------------------------------------

@functools.cache
def initial_model(model: HFModel) -> nn.Module:
    """The seed-0 model on the CPU in bf16, built once per process (seconds at 1B parameters) and
    copied to the device for each system; the liger child builds the same."""
    transformers = importlib.import_module("transformers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        module = getattr(transformers, model.model_class)(model.config())
    return module.to(torch.bfloat16).train()


def fingerprint(module: nn.Module) -> float:
    """A sum over every 997th weight of every parameter: equal in two processes iff (almost surely)
    they built the same weights."""
    return float(sum(p.detach().flatten()[::997].double().sum() for p in module.parameters()))


def token_batches(model: HFModel, count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` [batch, seq] token batches, batch k from a generator seeded with BATCH_SEED + 1 + k:
    the same sequence in every process and for every system (HF shifts the labels inside, so the
    labels are the ids)."""
    vocab = model.vocab
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(BATCH_SEED))
    weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + ZIPF_OFFSET)
    batches = []
    for k in range(count):
        draw = torch.multinomial(weights, model.batch * model.seq, replacement=True,
                                 generator=torch.Generator().manual_seed(BATCH_SEED + 1 + k))
        batches.append(order[draw].view(model.batch, model.seq).to(device))
    return batches


def batch_count(args: argparse.Namespace) -> int:
    """Steps every system takes: warm-up, timed (whole rounds) and profiled."""
    return args.warmup + args.rounds * per_round(args) + (PROFILE_STEPS if args.profile else 0)


def per_round(args: argparse.Namespace) -> int:
    return max(1, -(-args.steps // args.rounds))


def hf_flops(model: HFModel, module: nn.Module) -> float:
    """6 N tokens + 12 l h s tokens (the module docstring's N)."""
    config = module.config
    embed = module.get_input_embeddings().weight
    multiplied = sum(p.numel() for p in module.parameters() if p is not embed)
    if module.get_output_embeddings().weight is embed:  # tied: the head multiplies every token
        multiplied += embed.numel()
    tokens = model.batch * model.seq
    return 6 * multiplied * tokens + 12 * config.num_hidden_layers * config.hidden_size * model.seq * tokens


# ---- systems -----------------------------------------------------------------------------------

class Feed:
    """A system's batches in step order: its k-th step gets batch k."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches, self.index = batches, 0

    def next(self) -> torch.Tensor:
        batch = self.batches[self.index % len(self.batches)]
        self.index += 1
        return batch


Builder = Callable[..., tuple[Step, dict[str, Any]]]


def _on_device(model: HFModel, setting: Setting) -> nn.Module:
    return copy.deepcopy(initial_model(model)).to(setting.device)


def _hf_step(module: nn.Module, forward: Callable[..., Any], batches: list[torch.Tensor], setting: Setting) -> Step:
    feed = Feed(batches)

    def loss() -> torch.Tensor:
        ids = feed.next()
        return forward(input_ids=ids, labels=ids).loss

    return _plain_step(loss, list(module.parameters()), setting)


def build_eager(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    module = _on_device(model, setting)
    return _hf_step(module, module, batches, setting), {"pipeline": f"{model.model_class}, loss from labels="}


def build_compile(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    module = _on_device(model, setting)
    return _hf_step(module, torch.compile(module), batches, setting), {"pipeline": "torch.compile(model)"}


def build_liger(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    """Only in the liger child process: the patch reaches every model of transformers' classes."""
    module = _on_device(model, setting)
    patch = getattr(importlib.import_module("liger_kernel.transformers"), model.liger_patch)
    patch(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False, model=module)
    info = {"pipeline": f"liger_kernel.transformers.{model.liger_patch}(rope, rms_norm, swiglu, "
                        "fused_linear_cross_entropy; model=instance)"}
    return _hf_step(module, module, batches, setting), info


def build_mplan(model: HFModel, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    module = _on_device(model, setting)
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
    """e2e.warm_up (the same measurement) on this script's builder for `name`."""
    with mock.patch.dict(SYSTEMS, {name: functools.partial(BUILDERS[name], batches=batches)}):
        return warm_up(name, model, setting, warmup)  # type: ignore[arg-type]


# ---- profile -----------------------------------------------------------------------------------

FINE_CATEGORIES: tuple[tuple[str, str], ...] = (
    # refinements of step_profile.category for what it leaves as fused/elementwise/reduction/other
    ("loss", r"cross_entropy|log_?softmax|nll_loss|logsumexp|_block_stats_kernel|_combine_kernel|_grad_kernel"
             r"|_grad_in_place_kernel|_mean_kernel|element_mul_kernel"),
    ("norm", r"rms_?norm|rsqrt"),
    ("rope", r"rope|rotary"),
    ("swiglu", r"swiglu|silu|_packed_(forward|backward)_kernel"),
    # mplan's rms_norm and (unpacked) swiglu kernels share these Triton names: not told apart
    ("norm_or_swiglu", r"^_(forward|backward)_kernel$"),
)
COARSE_TO_CATEGORY = {"gemm": "gemm", "attention": "attention", "optimizer": "optimizer", "copy": "copy",
                      "elementwise": "elementwise", "reduction": "elementwise", "compile_triton": "elementwise",
                      "mplan_triton": "other", "other": "other"}


def kernel_category(name: str) -> str:
    coarse = coarse_category(name)
    if coarse in ("gemm", "attention", "optimizer"):
        return coarse
    for label, pattern in FINE_CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return COARSE_TO_CATEGORY[coarse]


def profile_steps(step: Step, steps: int, device: torch.device) -> dict[str, Any]:
    """`steps` steps under torch.profiler (`step_profile.profiled`), kernels by `kernel_category`,
    the top 25."""
    return profiled(step, steps, device, kernel_category, top=25)


# ---- the liger child ---------------------------------------------------------------------------

def liger_unavailable(device: torch.device) -> str | None:
    """Why the liger system cannot run here, or None."""
    if device.type != "cuda":  # Triton's interpreter fails in Liger's RMSNorm kernel (liger-kernel 0.8.5)
        return "skipped: Liger's kernels are Triton GPU kernels"
    if importlib.util.find_spec("liger_kernel") is None:
        return "skipped: liger-kernel is not installed (pip install --no-index --find-links .device_wheels " \
               "--no-deps liger-kernel)"
    return None


class PipeChild:
    """A system in its own process (the module docstring says why), driven over a pipe: one
    command a line in (`warmup`, `run K`, `profile K`, `quit`), one JSON line out; `command`
    starts it (this script or benchmarks/peers.py in its child mode)."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.error: str | None = None

    def ask(self, command: str) -> dict[str, Any]:
        """Sends `command`; its answer, or {"error": ...} when the child fails, dies or times out."""
        if self.error is not None:
            return {"error": self.error}
        timeout = CHILD_TIMEOUT_S[command.split()[0]]
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.kill()
            self.error = (f"liger child: no answer to {command!r} within {timeout:.0f} s" if self.proc.poll() is None
                          else f"liger child exited with code {self.proc.wait()} (its traceback is in the log)")
            self.proc.wait()
            return {"error": self.error}
        answer = json.loads(line)
        if "error" in answer:
            self.error = answer["error"]
        return answer

    def close(self) -> None:
        if self.proc.poll() is None and self.error is None:
            self.ask("quit")
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class LigerChild(PipeChild):
    """This script's liger system (`--system liger --model NAME`)."""

    def __init__(self, model: HFModel, args: argparse.Namespace, system: str = "liger") -> None:
        command = [sys.executable, os.path.abspath(__file__), "--system", system, "--model", model.name,
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
                    lambda: warm_up_hf(args.system, model, setting, token_batches(model, batch_count(args), setting.device),
                                       args.warmup),
                    lambda: fingerprint(initial_model(model)))


def answer_commands(answers: Any, setting: Setting, warm: Callable[[], Running | dict[str, Any]],
                    weights: Callable[[], str]) -> None:
    """A child's side of `PipeChild`'s protocol, until `quit`: `warmup` (`warm()`: the system
    built and warmed up, the row carrying `weights()`, its initial weights' fingerprint), `run N`
    (N timed steps), `profile N`; one JSON line to `answers` per command, an error as its row.
    Between answers the device's cached blocks are released for the parent's systems' turn."""
    running: Running | None = None
    while line := sys.stdin.readline():
        command, *rest = line.split()
        try:
            if command == "warmup":
                result = warm()
                if isinstance(result, Running):
                    running = result
                    result.row["weights_fingerprint"] = weights()
                answer = result.row if isinstance(result, Running) else result
            elif command == "run":
                assert running is not None, "run before a successful warmup"
                timed_rounds({"child": running}, setting, 1, int(rest[0]))
                answer = running.row
            elif command == "profile":
                assert running is not None, "profile before a successful warmup"
                answer = profile_steps(running.step, int(rest[0]), setting.device)
            else:
                answer = {}
        except Exception:  # noqa: BLE001 - the parent records it as the system's error
            answer = {"error": traceback.format_exc()}
        if setting.device.type == "cuda":
            torch.cuda.empty_cache()  # the parent's systems take the next turn
        answers.write(json.dumps(answer) + "\n")
        if command == "quit":
            break


# ---- runs --------------------------------------------------------------------------------------

def contest(starts: dict[str, Callable[[], Running | dict[str, Any]]], child: LigerChild | None,
            setting: Setting, args: argparse.Namespace, clock: Clock, label: str
            ) -> tuple[dict[str, dict[str, Any]], dict[str, Running]]:
    """Warms up each system in turn (skipping any not started within the budget), then times them
    in rotating interleaved rounds, the liger child (if any) taking its turn like the rest."""
    rows: dict[str, dict[str, Any]] = {}
    running: dict[str, Running] = {}
    for name, start in starts.items():
        if clock.elapsed() > args.budget_s:
            rows[name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            clock.log(f"{label} {name}: skipped (time budget)")
            continue
        if name == "liger" and child is not None:
            _release_cache(setting)
            answer = child.ask("warmup")
            rows[name] = answer if "error" in answer else {**answer, "process": "child"}
        else:
            result = start()
            if isinstance(result, Running):
                running[name] = result
            rows[name] = result.row if isinstance(result, Running) else result
        clock.log(f"{label} {name}: {_warmed(rows[name])}")
    turns = list(running)
    if child is not None and "step_s_all" in rows.get("liger", {}):
        turns.append("liger")
    for r in range(args.rounds if turns else 0):
        for name in turns[r % len(turns):] + turns[:r % len(turns)]:
            if name == "liger":
                _release_cache(setting)
                answer = child.ask(f"run {per_round(args)}")  # type: ignore[union-attr]
                rows["liger"] = answer if "error" in answer else {**answer, "process": "child"}
            else:
                timed_rounds({name: running[name]}, setting, 1, per_round(args))
    for name, row in rows.items():
        if row.get("step_s_all"):
            row["step_s"] = statistics.median(row["step_s_all"])
    return rows, running


def _warmed(row: dict[str, Any]) -> str:
    if "error" in row:
        return "ERROR " + row["error"].strip().splitlines()[-1]
    peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
    return f"warmed up, setup {row['setup_s']} s, first step {row['first_step_s']} s, peak {peak}"


def _release_cache(setting: Setting) -> None:
    gc.collect()
    if setting.device.type == "cuda":
        torch.cuda.empty_cache()


def _finish(rows: dict[str, dict[str, Any]], flops: float, label: str, log: Callable[[str], None]) -> None:
    for name, row in rows.items():
        if "step_s" in row:
            row["tflops"] = flops / row["step_s"] / 1e12
            peak = f", peak {row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else ""
            log(f"{label} {name}: step {row['step_s'] * 1e3:.1f} ms, {row['tflops']:.1f} TFLOP/s{peak}, "
                f"losses {[round(x, 4) for x in row['losses']]}")


def _profile_all(running: dict[str, Running], child: LigerChild | None, rows: dict[str, dict[str, Any]],
                 setting: Setting) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, system in running.items():
        try:
            out[name] = profile_steps(system.step, PROFILE_STEPS, setting.device)
        except Exception:  # noqa: BLE001 - the timing already taken must not be lost
            out[name] = {"error": traceback.format_exc()}
    if child is not None and "step_s" in rows.get("liger", {}):
        _release_cache(setting)
        out["liger"] = child.ask(f"profile {PROFILE_STEPS}")
    return out


def loss_agreement(mine: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """`mine`'s losses against `reference`'s, by the module docstring's three tests."""
    steps = min(len(mine["losses"]), len(reference["losses"]))
    first = abs(reference["losses"][0])
    diffs = [abs(a - b) / first for a, b in zip(mine["losses"][:steps], reference["losses"][:steps])]
    last = min(LAST_STEPS, steps)
    mean_mine = statistics.fmean(mine["losses"][steps - last:steps])
    mean_reference = statistics.fmean(reference["losses"][steps - last:steps])
    norms = mine["grad_norms"][0], reference["grad_norms"][0]
    out = {"steps": steps, "max_step_diff_over_first_loss": max(diffs), "step_tolerance": LOSS_STEP_RTOL,
           "last_steps": last, "last_mean": mean_mine, "reference_last_mean": mean_reference,
           "last_mean_rel_diff": abs(mean_mine - mean_reference) / abs(mean_reference),
           "mean_tolerance": LOSS_MEAN_RTOL, "first_loss_rel_diff": diffs[0],
           "first_grad_norm_rel_diff": (abs(norms[0] - norms[1]) / norms[1]
                                        if None not in norms and norms[1] else None),
           "first_step_tolerance": FIRST_STEP_RTOL}
    out["passed"] = (out["max_step_diff_over_first_loss"] <= LOSS_STEP_RTOL
                     and out["last_mean_rel_diff"] <= LOSS_MEAN_RTOL
                     and max(diffs[0], out["first_grad_norm_rel_diff"] or 0.0) <= FIRST_STEP_RTOL)
    return out


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
        _finish(rows, entry["flops_per_step"], model.name, clock.log)
        if args.profile and clock.elapsed() <= args.budget_s:
            entry["profile"] = _profile_all(running, child, rows, setting)
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


def run_family(workload: Workload, names: list[str], args: argparse.Namespace, setting: Setting,
               clock: Clock) -> dict[str, Any]:
    """One of mplan's own models through e2e's systems and compare, with issue 19's targets."""
    starts = {name: functools.partial(warm_up, name, workload, setting, args.warmup) for name in names}
    rows, running = contest(starts, None, setting, args, clock, workload.name)
    flops = model_flops(workload, _initial_model(workload, setting.param_dtype))  # e2e's seed-0 CPU model
    _finish(rows, flops, workload.name, clock.log)
    entry: dict[str, Any] = {"batch": workload.batch, "flops_per_step": flops,
                             "batches": "e2e's one memorized batch", "systems": rows}
    if args.profile and clock.elapsed() <= args.budget_s:
        entry["profile"] = _profile_all(running, None, rows, setting)
    entry.update(compare(rows))
    kind = workload.name.split("-")[0]
    entry["e2e_targets"] = entry.pop("targets")
    entry["targets"] = {
        f"mplan_vs_eager>={FAMILY_TARGET_VS_EAGER[kind]}": (entry.get("mplan_vs_eager", 0.0)
                                                          >= FAMILY_TARGET_VS_EAGER[kind]),
        "mplan_vs_compile>=1": entry.get("mplan_vs_compile", 0.0) >= 1.0,
        "losses_agree": entry["correctness"].get("mplan", {}).get("passed", False),
    }
    clock.log(f"{workload.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="where to write the JSON results (required except in the liger child)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the smoke test")
    parser.add_argument("--small", action="store_true", help="tiny models (with --device cpu: the smoke test)")
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
    args = parser.parse_args()
    if args.system is None and args.out is None:
        parser.error("--out is required")
    if args.systems is None:
        args.systems = "eager,compile,mplan,liger" if args.device == "cuda" else "eager,mplan,liger"
    return args


def main() -> None:
    args = parse_args()
    if args.system is not None:
        serve_child(args)
        return
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
        report["families"][workload.name] = run_family(workload, family_names, args, setting, clock)
        write_report(args.out, report)
        _cleanup(setting)
    report["wall_s"] = round(clock.elapsed(), 1)
    write_report(args.out, report)
    clock.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
