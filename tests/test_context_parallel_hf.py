"""Context parallelism on models as their authors ship them (issue 34): Hugging Face's Llama,
Mistral and Qwen2 with sliding windows, Gemma 2 with sliding windows and attention logit
soft-capping, and nanoGPT's manual attention, each trained under a cp plan exactly as on one
device.

What the lowering has to get right here that mplan's own families do not ask: the mask is a
tensor the model builds from its slice's positions (transformers' masking_utils: causal by
position ids, a sliding window, packed-sequence detection from position jumps; nanoGPT: rows of
a registered lower-triangular buffer), read back as a rule of global positions
(`passes.attention_forms.read_mask`); the labels are shifted by one inside the loss, across the
boundary between two ranks' chunks (`ContextShiftedLabels`); Gemma 2's attention is an eager
chain with tanh soft-capping, not SDPA.

Each check trains 3 AdamW steps with active clipping in float64 on 4 gloo ranks ("cp=2" fills
the world with dp=2) and compares every step's loss and every final parameter with one process:
relative error under 1e-9. transformers computes RMSNorm, the loss's logits and Gemma 2's eager
softmax in float32 even in a float64 model; as tests/test_equivalence.py's `hf_llama(faithful=True)`
does, those few lines run in float64 here (same math), so that both sides round alike.
Refusals (one line each): a sliding window the slice cannot show (L <= W < S), attention in a
form mplan does not find (einsum scores), a mask that is no position rule (ALiBi-like bias).
"""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_checks
from test_equivalence import TOL, _causal_lm_loss_float64, _rms_norm_float64, batches, errors, hf_llama, single_device, trained

SEQ, VOCAB = 16, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, use_cache=False)


def _gemma_norm_float64(self: Any, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _eager_float64(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   softcap: float | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Gemma 2 eager attention with its softmax in the inputs' dtype (float64)."""
    groups = module.num_key_value_groups
    keys = key.repeat_interleave(groups, dim=1)
    values = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.dropout(F.softmax(scores, dim=-1), p=dropout, training=module.training)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def _hf(kind: str, **config: Any) -> Any:
    """A tiny float64 Hugging Face causal LM, the float32 lines run in float64 (module docstring)."""
    def make() -> nn.Module:
        import transformers

        from mplan.verify import perturbed

        config_class, model_class = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                     "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                     "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[kind]
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = model_class(config_class(**SMALL, **config)).to(torch.float64)
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                norm = _gemma_norm_float64 if kind == "gemma2" else _rms_norm_float64
                module.forward = types.MethodType(norm, module)
        if kind == "gemma2":
            from transformers.models.gemma2 import modeling_gemma2

            modeling_gemma2.eager_attention_forward = _eager_float64
        model.loss_function = _causal_lm_loss_float64
        return perturbed(model)
    make.capture_key = (kind, tuple(sorted(config.items())))
    return make


MISTRAL = _hf("mistral", sliding_window=3)  # every layer: a window of 3 < the slice's 8 tokens
QWEN2 = _hf("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)  # layer 1 slides
GEMMA2 = _hf("gemma2", head_dim=8, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None,
             query_pre_attn_scalar=8, attn_implementation="eager")


def _compare(make: Any, plan: str, *, ignored: int = 3, global_batch: int = 4, loss_fn: Any = None) -> dict[str, Any]:
    """`ignored` leading labels are -100 so the cp ranks count different tokens."""
    data = batches(global_batch, vocab=VOCAB, seq=SEQ)
    for _, labels in data:
        labels[:, :ignored] = -100
    options = {} if loss_fn is None else {"loss_fn": loss_fn}
    pm, losses, norms = trained(make, plan, data, **options)
    attention = [m for m in pm.program.modules() if type(m).__name__ == "ContextAttention"]
    reference = single_device(make, data) if loss_fn is None else _single_device_with(make, data, loss_fn)
    return {**errors(pm, losses, norms, reference), "cp": pm.plan.mesh.cp,
            "masks": [str(m.mask) for m in attention], "softcaps": [m.softcap for m in attention],
            "shifted": sum(type(m).__name__ == "ContextShiftedLabels" for m in pm.program.modules())}


def _single_device_with(make: Any, data: list, loss_fn: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    from test_equivalence import MAX_NORM, OPTIMIZER

    model = make()
    optimizer = OPTIMIZER(model.parameters())
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        loss = loss_fn(model(ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def llama_cp2() -> dict[str, Any]:
    return _compare(hf_llama(faithful=True), "cp=2")


def llama_cp2_ring() -> dict[str, Any]:
    return _compare(hf_llama(faithful=True), "cp=2,cp_method=ring")


def llama_cp4() -> dict[str, Any]:
    return _compare(hf_llama(faithful=True), "cp=4", global_batch=2)


def mistral_window_cp2() -> dict[str, Any]:
    return _compare(MISTRAL, "cp=2,cp_method=ring")


def qwen2_window_cp2() -> dict[str, Any]:
    return _compare(QWEN2, "cp=2")


def gemma2_softcap_cp2() -> dict[str, Any]:
    return _compare(GEMMA2, "cp=2")


def nanogpt_cp2() -> dict[str, Any]:
    from zoo_models import ZOO

    entry = ZOO["nanogpt"]
    return _compare(entry.make, "cp=2", loss_fn=entry.loss_fn)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _refusal(make: Any, plan: str) -> str:
    import mplan

    ids = torch.randint(0, VOCAB, (4, SEQ))
    try:
        mplan.autoparallel(make(), example_inputs=(ids,), global_batch=4, plan=plan, loss_fn=_token_loss)
    except Exception as error:  # the refusal's one line is what is checked
        return f"{type(error).__name__}: {error}"
    return "not refused"


def refuses_unseen_window() -> str:
    return _refusal(_hf("mistral", sliding_window=10), "cp=2")  # 8 local tokens <= 10 < 16


class _EinsumAttention(nn.Module):
    """Scores by einsum: attention in a form `find_attention` does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        weights = torch.einsum("bqd,bkd->bqk", x, x).softmax(-1)
        return self.head(torch.einsum("bqk,bkd->bqd", weights, x))


def refuses_unknown_attention() -> str:
    return _refusal(_EinsumAttention, "cp=2")


class _BiasedAttention(nn.Module):
    """SDPA with a float mask of distances (ALiBi-like): no causal or window rule gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).unsqueeze(1)
        position = torch.arange(ids.shape[1])
        bias = -(position[:, None] - position[None, :]).abs().to(x.dtype) / 4
        return self.head(F.scaled_dot_product_attention(x, x, x, attn_mask=bias).squeeze(1))


def refuses_position_bias() -> str:
    return _refusal(_BiasedAttention, "cp=2")


CHECKS = [llama_cp2, llama_cp2_ring, llama_cp4, mistral_window_cp2, qwen2_window_cp2, gemma2_softcap_cp2, nanogpt_cp2,
          refuses_unseen_window, refuses_unknown_attention, refuses_position_bias]


@pytest.fixture(scope="module")
def world4() -> Any:
    return run_checks(4, CHECKS, timeout_s=900)


def _equivalent(values: list[dict[str, Any]], cp: int) -> list[dict[str, Any]]:
    assert values, "no per-rank results"
    for rank, result in enumerate(values):
        assert result["cp"] == cp and result["loss"] < TOL and result["param"] < TOL, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
    assert all(v["loss"] == values[0]["loss"] for v in values), "ranks report different losses"
    return values


@pytest.mark.parametrize("check,cp", [(llama_cp2, 2), (llama_cp2_ring, 2), (llama_cp4, 4)])
def test_hf_llama_as_shipped(world4: Any, check: Any, cp: int) -> None:
    """transformers' SDPA path hands attention a bool mask it built (causal by position ids and
    packed-sequence detection): read as causal; its label shift crosses the ranks' chunks."""
    result = _equivalent(world4.assert_passed(check), cp)[0]
    assert result["masks"] == ["causal", "causal"] and result["shifted"] == 1, result


def test_sliding_windows(world4: Any) -> None:
    mistral = _equivalent(world4.assert_passed(mistral_window_cp2), 2)[0]
    assert mistral["masks"] == ["causal, window 3", "causal, window 3"], mistral
    qwen2 = _equivalent(world4.assert_passed(qwen2_window_cp2), 2)[0]
    assert qwen2["masks"] == ["causal", "causal, window 4"], qwen2


def test_gemma2_soft_capping_and_windows(world4: Any) -> None:
    """Gemma 2's eager chain (scale, tanh soft-cap, additive float mask, softmax) is found and
    lowered with its cap; layer 0 slides, layer 1 sees everything."""
    gemma = _equivalent(world4.assert_passed(gemma2_softcap_cp2), 2)[0]
    assert gemma["masks"] == ["causal, window 4", "causal"] and gemma["softcaps"] == [5.0, 5.0], gemma


def test_nanogpt(world4: Any) -> None:
    """nanoGPT's manual attention masked by rows of its `bias` buffer; no shift in its loss."""
    result = _equivalent(world4.assert_passed(nanogpt_cp2), 2)[0]
    assert result["masks"] == ["causal", "causal"] and result["shifted"] == 0, result


@pytest.mark.parametrize("check,words", [
    (refuses_unseen_window, ("sliding_window=10", "slice of 8 tokens")),
    (refuses_unknown_attention, ("softmax over the 8 tokens",)),
    (refuses_position_bias, ("ALiBi",)),
])
def test_refusals(world4: Any, check: Any, words: tuple[str, ...]) -> None:
    """What cannot be lowered exactly is refused in one line on every rank, never run wrong."""
    for message in world4.assert_passed(check):
        assert all(word in message for word in words) and "\n" not in message, message


def test_the_lowering_computes_in_the_dtype_the_model_softmax_asks() -> None:
    """Hugging Face's eager attention in a bf16 Llama takes its softmax in float32: the form
    carries float32 and the lowered attention computes in it (tests/test_context_attention.py's
    check_bf16_upcast measures the precision); SDPA's kernels accumulate in float32 too; a bf16
    eager chain without the upcast (nanoGPT's) stays in bf16."""
    import transformers

    from mplan.passes.attention_forms import find_attention

    def forms(model: nn.Module) -> list[Any]:
        ids = torch.randint(0, VOCAB, (2, SEQ))
        return find_attention(torch.export.export(model, (ids,), strict=False).module())

    upcasts = {}
    for implementation in ("eager", "sdpa"):
        config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 1}, attn_implementation=implementation)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        upcasts[implementation] = [form.upcast for form in forms(model)]

    class _Bf16Eager(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids).unsqueeze(1)
            return ((x @ x.transpose(-2, -1)) * 0.25).softmax(-1) @ x

    upcasts["bf16 eager"] = [form.upcast for form in forms(_Bf16Eager().to(torch.bfloat16))]
    assert upcasts == {"eager": [torch.float32], "sdpa": [torch.float32], "bf16 eager": [torch.bfloat16]}, upcasts
