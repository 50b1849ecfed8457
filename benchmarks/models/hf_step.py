"""A Hugging Face model's training step, the batches it trains on and how its losses are held to eager's.

The three models of the `hf-models` case (`HFModel`, `_families`), each built from its config with
seed-0 weights on the CPU (`initial_model`; `fingerprint` tells whether two processes built the
same), trained on fresh Zipf-like batches (`token_batches`: batch k the same in every process and
for every system) through `hf_step`; `loss_agreement` holds a system's losses to eager's by the
`hf-models` case's three tests. The `peers` case trains its families the same way.
"""
from __future__ import annotations

import copy
import functools
import importlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from benchmarks.models.workloads import FIRST_STEP_RTOL, Setting, Step, plain_step

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


class FromConfig(Protocol):
    """A transformers model class by name and its config: an `HFModel`, or a `families.Family`."""

    model_class: str

    def config(self) -> Any: ...


@functools.cache
def initial_model(model: FromConfig) -> nn.Module:
    """The seed-0 model on the CPU in bf16, built once per process (seconds at 1B parameters) and
    copied to the device for each system; the liger child builds the same (fingerprints compared)."""
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


class Feed:
    """A system's batches in step order: its k-th step gets batch k."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches, self.index = batches, 0

    def next(self) -> torch.Tensor:
        batch = self.batches[self.index % len(self.batches)]
        self.index += 1
        return batch


def hf_step(module: nn.Module, forward: Callable[..., Any], batches: list[torch.Tensor], setting: Setting) -> Step:
    feed = Feed(batches)

    def loss() -> torch.Tensor:
        ids = feed.next()
        return forward(input_ids=ids, labels=ids).loss

    return plain_step(loss, list(module.parameters()), setting)


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


def on_device(model: FromConfig, setting: Setting) -> nn.Module:
    """A copy of the seed-0 model on the setting's device, for one system."""
    return copy.deepcopy(initial_model(model)).to(setting.device)


def build_eager(model: FromConfig, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    """The HF model as it is, its loss from labels=."""
    module = on_device(model, setting)
    return hf_step(module, module, batches, setting), {"pipeline": f"{model.model_class}, loss from labels="}


def build_compile(model: FromConfig, setting: Setting, batches: list[torch.Tensor]) -> tuple[Step, dict[str, Any]]:
    """torch.compile(HF model), default mode (its first step includes the compile)."""
    module = on_device(model, setting)
    return hf_step(module, torch.compile(module), batches, setting), {"pipeline": "torch.compile(model)"}
