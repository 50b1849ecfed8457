"""Outside-model zoo for tests: models nobody on the project wrote, built as users bring them.

`ZOO` maps a name to a `ZooModel`: ten Hugging Face causal LMs built from their stock config
with only the size fields shrunk, and two researcher-style models written from scratch here in
the idioms such code uses (nanoGPT's fused qkv + manual masked attention + tied head; einsum
projections, RoPE buffers, a fused SwiGLU projection and an in-place op). Every model is tiny
and float64 on CPU, so a training step takes milliseconds and comparisons against the plain
single-process loop (`reference_training`) can be tight.

`float32_inside` records whether the model's own code computes something in float32 even
when the model is float64 (read off the transformers source, see each entry's `notes`); such
models cannot match a reference to float64 rounding, and `split_batch_error` measures how far
plain PyTorch itself drifts when the batch is split, which bounds what a test may demand.
"""
from __future__ import annotations


import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 64
SEQ = 16
MAX_POSITIONS = 32
HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 64

BUILD_SEED = 0
"""Global RNG seed every `make` builds under, so two builds have identical weights."""
NOISE_SEED = 1
NOISE_SCALE = 0.01
"""Seeded noise added to every parameter after init: no bias sits at 0 nor norm weight at 1,
where relative errors would compare rounding noise."""

LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build the model and how a user computes its loss."""

    name: str
    make: Callable[[], nn.Module]
    """Builds the model in float64 on CPU, deterministically (identical weights per call)."""
    vocab: int
    seq: int
    """Sequence length to train at."""
    loss_in_forward: bool
    """True: the loss is `model(ids, labels=labels).loss` (HF causal LMs shift labels inside)."""
    loss_fn: LossFn | None
    """`(logits, labels) -> loss` for models that return logits; None when `loss_in_forward`."""
    float32_inside: bool
    """The model's code computes some part in float32 even when the model is float64."""
    notes: str


def _seeded_build(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under a fixed global seed, cast to float64, every distinct parameter perturbed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILD_SEED)
        model = build().to(torch.float64)
    generator = torch.Generator().manual_seed(NOISE_SEED)
    with torch.no_grad():
        for param in model.parameters():  # yields a tied parameter once, so ties stay tied
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise, alpha=NOISE_SCALE)
    return model


def _hf_model(config_name: str, model_name: str, sizes: dict[str, Any], eval_mode: bool) -> nn.Module:
    """`ModelClass(ConfigClass(**sizes))` from transformers, every non-size default as shipped."""
    transformers = importlib.import_module("transformers")
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**sizes))
    return model.eval() if eval_mode else model


def _make_hf(config_name: str, model_name: str, sizes: dict[str, Any],
             eval_mode: bool = False) -> Callable[[], nn.Module]:
    """A zero-argument `make` for one Hugging Face family."""
    return partial(_seeded_build, partial(_hf_model, config_name, model_name, sizes, eval_mode))


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross-entropy over (B, T, V) logits; labels are already the targets (no shift)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


# ---------------------------------------------------------------------------------------------
# nanoGPT-style GPT


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's hyperparameters, at zoo size (no dropout: nanoGPT's default is 0.0)."""

    block_size: int = MAX_POSITIONS
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = HIDDEN


class CausalSelfAttention(nn.Module):
    """Fused qkv projection, manual attention under a registered lower-triangular mask."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """Linear -> GELU -> Linear, 4x wide."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: attention then MLP, each on a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, lm_head tied to wte."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith('c_proj.weight'):  # scaled init of the residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits (B, T, vocab) for token ids (B, T)."""
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} exceeds block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


# ---------------------------------------------------------------------------------------------
# Einsum Llama-like decoder


class RMSNorm(nn.Module):
    """RMSNorm in the input's dtype (no float32 upcast)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim, the RoPE rotation partner."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class EinsumAttention(nn.Module):
    """Multi-head attention whose projections are einsums on raw weight Parameters."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        head_dim = dim // n_heads
        self.wq = nn.Parameter(torch.randn(n_heads, head_dim, dim) * 0.02)
        self.wk = nn.Parameter(torch.randn(n_heads, head_dim, dim) * 0.02)
        self.wv = nn.Parameter(torch.randn(n_heads, head_dim, dim) * 0.02)
        self.wo = nn.Parameter(torch.randn(dim, n_heads, head_dim) * 0.02)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = torch.einsum("btd,hkd->bhtk", x, self.wq)
        k = torch.einsum("btd,hkd->bhtk", x, self.wk)
        v = torch.einsum("btd,hkd->bhtk", x, self.wv)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.einsum("bhtk,dhk->btd", y, self.wo)


class SwiGLU(nn.Module):
    """One fused gate/up projection split in two, SiLU-gated, projected back down."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class EinsumBlock(nn.Module):
    """Pre-norm block whose attention residual is rescaled in place."""

    def __init__(self, dim: int, n_heads: int, ffn: int, residual_scale: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = EinsumAttention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.ffn = SwiGLU(dim, ffn)
        self.residual_scale = residual_scale

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x.mul_(self.residual_scale)  # in place on a non-leaf: add's backward saves nothing
        return x + self.ffn(self.ffn_norm(x))


class EinsumLM(nn.Module):
    """Llama-like decoder: RoPE tables as non-persistent float64 buffers, untied head."""

    def __init__(self, vocab: int = VOCAB, dim: int = HIDDEN, n_layers: int = LAYERS,
                 n_heads: int = HEADS, ffn: int = FFN, max_seq: int = MAX_POSITIONS,
                 residual_scale: float = 0.9, rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(
            EinsumBlock(dim, n_heads, ffn, residual_scale) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        inv_freq = rope_theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq, head_dim)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits (B, T, vocab) for token ids (B, T)."""
        t = ids.size(1)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------------
# The zoo

_LOSS_NOTE = ("float32: the causal-LM loss upcasts (transformers/loss/loss_utils.py "
              "ForCausalLMLoss: `logits = logits.float()`), so the loss and its gradient into the "
              "logits are float32.")
_ROPE_NOTE = ("RoPE cos/sin are computed in float32 (`freqs = position_ids[..., None].float() * "
              "self.inv_freq.to(..., dtype=torch.float)`) then cast to float64; they do not depend "
              "on the batch.")
_RMS_NOTE = "RMSNorm upcasts: `hidden_states = hidden_states.to(torch.float32)`."
_GQA_NOTE = f"GQA: num_key_value_heads={KV_HEADS}."


def _hf_entry(name: str, config_name: str, model_name: str, sizes: dict[str, Any], notes: str,
              eval_mode: bool = False) -> ZooModel:
    return ZooModel(name=name, make=_make_hf(config_name, model_name, sizes, eval_mode),
                    vocab=VOCAB, seq=SEQ, loss_in_forward=True, loss_fn=None,
                    float32_inside=True, notes=notes)


_LLAMA_SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS)

_ENTRIES = [
    _hf_entry("llama", "LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_SIZES, head_dim=HEAD_DIM),
              f"{_LOSS_NOTE} {_RMS_NOTE} {_ROPE_NOTE} {_GQA_NOTE}"),
    _hf_entry("mistral", "MistralConfig", "MistralForCausalLM", dict(_LLAMA_SIZES, head_dim=HEAD_DIM),
              f"{_LOSS_NOTE} {_RMS_NOTE} {_ROPE_NOTE} {_GQA_NOTE} sliding_window stays 4096 "
              f"(longer than any sequence here)."),
    _hf_entry("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _LLAMA_SIZES,
              f"{_LOSS_NOTE} {_RMS_NOTE} {_ROPE_NOTE} {_GQA_NOTE} q/k/v carry biases."),
    _hf_entry("gpt2", "GPT2Config", "GPT2LMHeadModel",
              dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                   n_positions=MAX_POSITIONS),
              f"{_LOSS_NOTE} Ships with resid/embd/attn dropout 0.1: built in eval() mode so "
              f"dropout is off (config untouched). Conv1D projections, tied lm_head.",
              eval_mode=True),
    _hf_entry("gptj", "GPTJConfig", "GPTJForCausalLM",
              dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                   n_positions=MAX_POSITIONS, rotary_dim=4),
              f"{_LOSS_NOTE} The sinusoidal RoPE table is built in float32 "
              f"(create_sinusoidal_positions: `.float()`). The eager attention path would take "
              f"q@k in float32, but the default attention is sdpa. Parallel attention+MLP block."),
    _hf_entry("gemma", "GemmaConfig", "GemmaForCausalLM", dict(_LLAMA_SIZES, head_dim=HEAD_DIM),
              f"{_LOSS_NOTE} GemmaRMSNorm computes in float32 (`output = self._norm(x.float())`, "
              f"`output * (1.0 + self.weight.float())`). {_ROPE_NOTE} {_GQA_NOTE} Embeddings "
              f"scaled by sqrt(hidden); tied lm_head."),
    _hf_entry("phi2", "PhiConfig", "PhiForCausalLM", _LLAMA_SIZES,
              f"{_LOSS_NOTE} {_ROPE_NOTE} {_GQA_NOTE} partial_rotary_factor as shipped (0.5); "
              f"parallel attention+MLP block with one LayerNorm."),
    _hf_entry("opt", "OPTConfig", "OPTForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, ffn_dim=FFN, word_embed_proj_dim=HIDDEN,
                   max_position_embeddings=MAX_POSITIONS),
              f"{_LOSS_NOTE} Ships with dropout 0.1: built in eval() mode so dropout is off "
              f"(config untouched). Learned positions offset by 2; tied lm_head.",
              eval_mode=True),
    _hf_entry("falcon", "FalconConfig", "FalconForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, ffn_hidden_size=FFN,
                   max_position_embeddings=MAX_POSITIONS),
              f"{_LOSS_NOTE} {_ROPE_NOTE} Shipped defaults: multi-query attention (one k/v "
              f"head; num_kv_heads only applies to the new decoder architecture), parallel "
              f"attention+MLP block, fused query_key_value, tied lm_head."),
    _hf_entry("stablelm", "StableLmConfig", "StableLmForCausalLM", _LLAMA_SIZES,
              f"{_LOSS_NOTE} {_ROPE_NOTE} {_GQA_NOTE} partial_rotary_factor as shipped (0.25)."),
    ZooModel(name="nanogpt", make=partial(_seeded_build, partial(GPT, GPTConfig())),
             vocab=VOCAB, seq=SEQ, loss_in_forward=False, loss_fn=loss_fn, float32_inside=False,
             notes="Written here in nanoGPT's style: fused c_attn split in three, manual masked "
                   "softmax attention, causal mask as a (persistent) buffer, lm_head tied to "
                   "transformer.wte (one Parameter under two names). No dropout (nanoGPT's "
                   "default is 0.0). Labels are the targets as given (no shift). The key third of "
                   "c_attn.bias has zero true gradient (softmax ignores a per-query constant), "
                   "so its gradient is rounding noise (~1e-20) that AdamW rescales: "
                   "split_batch_error grows with steps (1.6e-13 at 2 AdamW steps, 1.3e-12 at 10); "
                   "the same holds wherever a key bias is not rotated (gpt2, opt, and the "
                   "non-rotary dims of phi2's k_proj.bias)."),
    ZooModel(name="einsum_lm", make=partial(_seeded_build, EinsumLM),
             vocab=VOCAB, seq=SEQ, loss_in_forward=False, loss_fn=loss_fn, float32_inside=False,
             notes="Written here: einsum q/k/v/o on raw Parameters, RoPE tables as non-persistent "
                   "float64 buffers, fused gate/up Linear split by chunk (SwiGLU), hand-written "
                   "RMSNorm in the input dtype, an in-place `x.mul_(residual_scale)` on a "
                   "non-leaf, sdpa(is_causal=True), untied head. Labels as given (no shift)."),
]

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _ENTRIES}


# ---------------------------------------------------------------------------------------------
# Data and the plain single-process training loop


def batches(global_batch: int, steps: int, vocab: int, seq: int,
            seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """`steps` (ids, labels) pairs of random int64 tokens [global_batch, seq], seeded."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(vocab, (global_batch, seq), generator=generator),
         torch.randint(vocab, (global_batch, seq), generator=generator))
        for _ in range(steps)
    ]


def compute_loss(zoo: ZooModel, model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """The loss the way a user computes it for this model."""
    if zoo.loss_in_forward:
        return model(ids, labels=labels).loss
    assert zoo.loss_fn is not None
    return zoo.loss_fn(model(ids), labels)


def reference_training(zoo: ZooModel, data: list[tuple[Tensor, Tensor]],
                       optimizer_factory: OptimizerFactory, *,
                       pieces: int = 1) -> tuple[list[float], dict[str, Tensor]]:
    """Plain single-process training on a fresh model: per-step losses and final parameters.

    With `pieces > 1` each batch is split into `pieces` equal row slices whose losses, scaled
    by 1/pieces, are backpropagated one after another (gradient accumulation, the arithmetic of
    data parallelism); the step's loss is the sum of the scaled pieces. Parameters are keyed by
    every name (`remove_duplicate=False`), so tied weights appear under each, as in state_dict.
    """
    model = zoo.make()
    optimizer = optimizer_factory(model.parameters())
    losses = []
    for ids, labels in data:
        assert ids.shape[0] % pieces == 0, f"batch of {ids.shape[0]} rows into {pieces} pieces"
        optimizer.zero_grad()
        step_loss = 0.0
        for piece_ids, piece_labels in zip(ids.chunk(pieces), labels.chunk(pieces)):
            loss = compute_loss(zoo, model, piece_ids, piece_labels) / pieces
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        losses.append(step_loss)
    params = {name: param.detach().clone()
              for name, param in model.named_parameters(remove_duplicate=False)}
    return losses, params


def _relative_error(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


def split_batch_error(zoo: ZooModel, data: list[tuple[Tensor, Tensor]],
                      optimizer_factory: OptimizerFactory, pieces: int) -> float:
    """Largest relative error, over per-step losses and every parameter, between training on
    whole batches and on batches split into `pieces`: the drift plain PyTorch itself shows."""
    whole_losses, whole_params = reference_training(zoo, data, optimizer_factory)
    split_losses, split_params = reference_training(zoo, data, optimizer_factory, pieces=pieces)
    errors = [abs(s - w) / abs(w) for s, w in zip(split_losses, whole_losses)]
    errors += [_relative_error(split_params[name], whole) for name, whole in whole_params.items()]
    return max(errors)


# ---------------------------------------------------------------------------------------------
# The zoo under mplan: one plan on every rank of a process group, every model against the plain loop

OPTIMIZER = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
GLOBAL_BATCH = 4
STEPS = 3
PLANS: dict[int, tuple[str | None, ...]] = {
    2: ("tp=2", "tp=2,sp=1", "dp=2", "dp=2,zero=1", "pp=2,mbs=1", None),
    4: ("tp=2,dp=2", "tp=2,pp=2,mbs=2", None),
}
"""The plans every zoo model trains under, by world size (None: the planner's own search): the
table python -m benchmarks.equivalence zoo measures (the README's)."""
TESTED: dict[int, tuple[str | None, ...]] = {
    2: ("tp=2,sp=1", "pp=2,mbs=1"),
}
"""The plans tests/test_zoo.py trains every zoo model under on every run: `PLANS` less what does
not depend on the model's code, which keeps CI under its 25 minutes: tp=2 without SP (the same
per-op layouts as with SP, whose sharding of the model's own ops it runs; SP adds the
sequence-sharded norms and residuals; test_equivalence.py holds both on mplan's and HF Llama), ZeRO-1 (optimizer-level;
test_equivalence*.py, test_pipeline.py and test_expert_parallel.py run it on mplan's and Hugging
Face models), dp=2 and the planner's own choice on 2 ranks (dp=2 for every zoo model,
results/zoo-cpu-2026-12-02.json; test_planner_layouts.py trains the planner's own plan for the
zoo's nanoGPT), and the 4-rank meshes, tp2 x dp2 and tp2 x pp2, which
compose the per-model tp=2 and pp=2 checks as test_equivalence_world4.py and test_pipeline.py
(TP2xPP2 with SP, HF Llama and Mistral among its models) hold for any model; the table's run
(python -m benchmarks.equivalence zoo) keeps them all."""
TOLERANCE = 1e-9
"""Relative error allowed where the model computes in float64 throughout."""
FLOAT32_FACTOR = 200
"""Models whose own code computes in float32 (`float32_inside`) are held to this many times the
error plain PyTorch shows when the batch is split into single rows (`split_batch_error`): float32
rounding, which splitting the work another way (by batch, by heads, by vocabulary) moves, and
AdamW then scales up on near-zero gradients. A defect shows as 1e-3 or more."""


def error_bound(zoo: ZooModel) -> float:
    """What a parallel run of `zoo` may differ from the plain loop by (see FLOAT32_FACTOR)."""
    if not zoo.float32_inside:
        return TOLERANCE
    data = batches(GLOBAL_BATCH, STEPS, zoo.vocab, zoo.seq)
    return max(TOLERANCE, FLOAT32_FACTOR * split_batch_error(zoo, data, OPTIMIZER, GLOBAL_BATCH))


def train_under_plan(names: Iterable[str], plan: str | None) -> dict[str, dict[str, Any]]:
    """On every rank of the current process group: each zoo model trained by `mplan.autoparallel`
    under `plan` (None: the planner's search) for STEPS AdamW steps, against `reference_training`;
    per model the largest relative error over the losses and every parameter (by every name), the
    layout that ran, or the error that stopped it. Each model is captured once per process
    (tests/capture_cache.py): a rank that trains it under several plans traces it once."""
    import mplan
    from capture_cache import reused_captures

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        zoo = ZOO[name]
        data = batches(GLOBAL_BATCH, STEPS, zoo.vocab, zoo.seq)
        with reused_captures(("zoo", name)):  # one capture per model and rank, whatever the plan
            pm = mplan.autoparallel(zoo.make(), example_inputs=(data[0][0],), loss_fn=zoo.loss_fn,
                                    optimizer=OPTIMIZER, global_batch=GLOBAL_BATCH, plan=plan)
        losses = [pm.train_step(ids, labels) for ids, labels in data]
        state = pm.full_state_dict()
        ref_losses, ref_params = _reference(name)
        errors = {f"loss{i}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(losses, ref_losses))}
        errors.update({p: _relative_error(state[p], ref) for p, ref in ref_params.items() if p in state})
        worst = max(errors, key=errors.__getitem__)
        results[name] = {"error": errors[worst], "worst": worst, "ran": pm.plan.spec(),
                         "missing": sorted(set(ref_params) - set(state)),
                         "split": sorted({s.name for s in pm.choice.values() if s.split})}
    return results


@lru_cache(maxsize=None)
def _reference(name: str) -> tuple[list[float], dict[str, Tensor]]:
    """`reference_training` of a zoo model on the zoo's data: the same for every plan, so a rank
    that trains a model under several plans computes it once."""
    zoo = ZOO[name]
    return reference_training(zoo, batches(GLOBAL_BATCH, STEPS, zoo.vocab, zoo.seq), OPTIMIZER)
