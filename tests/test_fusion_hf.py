"""Fusion on the models users bring: Hugging Face families as transformers writes them.

Each family is built from a tiny config, exported as `autoparallel` exports it (loss from
`labels=`, `use_cache=False`), fused, and held to the unfused program: loss and every gradient
(float64, except the loss transformers computes in fp32), and the expected coverage, per
family, of which chains became which kernel. The bf16 capture (what `autoparallel` sees for a
model built in bf16) shows Hugging Face's fp32 upcast inside the norm folded into the fused
norm, residual add included.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hf_loss import HFLoss
from torch import nn

from mplan.kernels.rotary import rope_qk, rope_qk_reference
from mplan.passes.fuse_kernels import fuse_kernels

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)

FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 8}),
    # partial rotary: RoPE on the first rot_dim of each head vector, the rest concatenated back
    "phi": (transformers.PhiConfig, transformers.PhiForCausalLM, {"partial_rotary_factor": 0.5}),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, {"rotary_pct": 0.25}),
    "opt": (transformers.OPTConfig, transformers.OPTForCausalLM,
            {"ffn_dim": 48, "word_embed_proj_dim": 32, "dropout": 0.0, "attention_dropout": 0.0,
             "activation_dropout": 0.0, "layerdrop": 0.0}),
    "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM, {}),
}

COVERAGE = {
    # every norm fused with the residual add before it (the first reads the embedding alone);
    # q, k, v one GEMM (Qwen2's biases too); RoPE on q and k in one launch; attention causal with GQA; gate
    # and up one GEMM into SwiGLU. (A float32 model's upcast is a no-op whose value the
    # residual stream reuses: its adds stay apart, the norms fuse alone.)
    "llama": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
              "linear_swiglu": 2, "linear_cross_entropy": 1},
    "mistral": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
                "linear_swiglu": 2, "linear_cross_entropy": 1},
    "qwen2": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
              "linear_swiglu": 2, "linear_cross_entropy": 1},
    # Gemma: (1 + weight) norms with type_as; its GELU-tanh gated MLP
    "gemma": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
              "linear_geglu": 2, "linear_cross_entropy": 1},
    # partial rotary (half and a quarter of each head; StableLM's in test_fusion_forms.py): the
    # slice, the rotation and the concatenation of q and of k in one rope_qk (rot_dim 4 and 2 of
    # head_dim 8); attention and MLP in parallel off one LayerNorm, fused with its residual add,
    # q/k/v one GEMM beside the MLP's fc1 (it stays apart: no attention input), fc1's bias and
    # its gelu_new (GELU's tanh approximation written out) one bias_gelu
    "phi": {"layer_norm_residual": 2, "linear_group": 2, "rope_qk": 2, "attention": 2, "bias_gelu": 2,
            "linear_cross_entropy": 1},
    "gpt_neox": {"layer_norm_residual": 2, "rope_qk": 2, "attention": 2, "linear_cross_entropy": 1},
    # OPT: all five LayerNorms after their residual adds (the first after the embeddings' sum with
    # the positions'); the MLP's and the next block's norms read the sum reshaped to [tokens,
    # hidden] and back, the addends reshaped instead
    "opt": {"layer_norm_residual": 5, "linear_group": 2, "attention": 2, "linear_cross_entropy": 1},
    # OLMo-1: F.layer_norm without weight or bias, in fp32 and cast back: the first of the
    # embedding alone, the rest with the residual add before them
    "olmo": {"layer_norm": 1, "layer_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
             "linear_swiglu": 2, "linear_cross_entropy": 1},
}

ROT_DIMS = {"phi": 4, "gpt_neox": 2}
"""rot_dim of the partial-rotary families at SHAPE's head_dim 8."""


def _build(family: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**SHAPE, **extra, **overrides})
    config._attn_implementation = "sdpa"
    return HFLoss(model_cls(config).to(dtype))


def _export(module: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(module, args, strict=False).module()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=generator)
    labels = torch.randint(0, 64, (2, 12), generator=generator)
    labels[0, :3] = -100
    return ids, labels


def _loss_and_grads(gm: torch.fx.GraphModule, *args: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = gm(*args)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in gm.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_fuses_as_expected_and_trains_exactly_like_its_unfused_program(family: str) -> None:
    ids, labels = _batch()
    unfused = _export(_build(family), ids, labels)
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert fused.meta["fuse_kernels"].counts == COVERAGE[family]
    targets = {node.target for node in fused.graph.nodes}
    # the causal mask transformers builds is gone, and with it the repeated keys and values
    assert aten.scaled_dot_product_attention.default not in targets
    assert aten.expand.default not in {n.target for n in fused.graph.nodes if "attention" in str(list(n.users))}
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused, ids, labels), _loss_and_grads(unfused, ids, labels)
    # transformers computes the loss of logits.float(): fp32 whatever the model's dtype, so the
    # loss and what flows back from it agree to fp32 rounding (the rest is float64)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-12, name


@pytest.mark.parametrize("family", list(ROT_DIMS))
def test_partial_rotary_pairs_into_one_rope_qk_with_its_rot_dim(family: str) -> None:
    """q and k each sliced at rot_dim, rotated and concatenated with their rest: one rope_qk call
    per layer takes the whole q and k with the rot_dim-wide tables; no slice or cat of them is left."""
    ids, labels = _batch()
    fused = fuse_kernels(_export(_build(family), ids, labels))
    calls = [node for node in fused.graph.nodes if node.target is rope_qk]
    assert [node.kwargs["rot_dim"] for node in calls] == [ROT_DIMS[family]] * SHAPE["num_hidden_layers"]
    for node in calls:
        assert node.args[0].meta["val"].shape[-1] == 8 and node.args[2].meta["val"].shape[-1] == ROT_DIMS[family]
    assert not any(node.target is aten.cat.default and node.meta["val"].dim() == 4 for node in fused.graph.nodes)


def test_the_fused_head_and_loss_runs_in_the_chunks_the_plan_names() -> None:
    """fuse_kernels(head_chunk_rows=) (a Plan's `head_loss_chunk_rows`) reaches the op: 24 rows in
    chunks of 5 (the last one short) train as the default single chunk does."""
    from mplan.kernels.head_loss import linear_cross_entropy

    ids, labels = _batch()
    unfused = _export(_build("llama"), ids, labels)
    default, chunked = fuse_kernels(copy.deepcopy(unfused)), fuse_kernels(copy.deepcopy(unfused), head_chunk_rows=5)
    heads = {name: [n for n in gm.graph.nodes if n.target is linear_cross_entropy]
             for name, gm in (("default", default), ("chunked", chunked))}
    assert [n.kwargs.get("chunk_rows") for n in heads["default"]] == [None]
    assert [n.kwargs.get("chunk_rows") for n in heads["chunked"]] == [5]
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(chunked, ids, labels), _loss_and_grads(default, ids, labels)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)  # the fp32 loss, summed over other chunks
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-12, name


def test_attention_runs_causally_with_gqa_and_builds_no_mask() -> None:
    ids, labels = _batch()
    fused = fuse_kernels(_export(_build("llama"), ids, labels))
    calls = [node for node in fused.graph.nodes if node.op == "call_function" and node.target.__name__ == "attention"]
    assert [node.kwargs["is_causal"] for node in calls] == [True, True]
    assert [node.kwargs["enable_gqa"] for node in calls] == [True, True]
    # the key of each call is its 2 kv heads, not a copy repeated over the 4 query heads
    assert [tuple(node.args[1].meta["val"].shape) for node in calls] == [(2, 2, 12, 8)] * 2
    # nothing of the [batch, 1, seq, seq] mask is computed any more
    assert not any(node.op == "call_function" and node.target in (aten.le.Tensor, aten.__and__.Tensor)
                   for node in fused.graph.nodes)


class _RopeQKSavingTables(torch.autograd.Function):
    """rope_qk as its Triton kernel computes it: it keeps cos and sin, never q or k (the
    backward is the rotation by -sin)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                consumer: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return rope_qk_reference(q, k, cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:
        cos, sin = ctx.saved_tensors
        return (*rope_qk_reference(dq, dk, cos, -sin), None, None, None)


def _rope_qk_saving_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           consumer: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _RopeQKSavingTables.apply(q, k, cos, sin, consumer)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_no_saved_tensor_keeps_the_packed_qkv_buffer_alive(family: str) -> None:
    """q, k and v come out of one GEMM as views of one buffer; RoPE replaces q and k with new
    tensors, so the buffer must go once RoPE ran. Attention keeps v: if v were still a view,
    the whole buffer (q's and k's columns too) would live until the backward."""
    ids, labels = _batch()
    fused = fuse_kernels(_export(_build(family), ids, labels))
    for node in fused.graph.nodes:  # RoPE as its kernel runs on a GPU (on the CPU the reference keeps q)
        if node.target is rope_qk:
            node.target = _rope_qk_saving_tables
    fused.recompile()
    packed = (4 + 2 + 2) * 8 * ids.numel() * 8  # [tokens, q + k + v columns] float64 bytes
    weights = {p.untyped_storage().data_ptr() for p in fused.parameters()}
    saved: list[int] = []  # the bytes of each saved activation's storage (parameters left out)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused(ids, labels).backward()
    assert saved and packed not in saved
    # the copy is of v alone: the projections RoPE rotates stay views of the GEMM's output
    clones = [n for n in fused.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == SHAPE["num_hidden_layers"]
    assert all(tuple(n.meta["val"].shape)[-1] == 2 * 8 for n in clones)


def test_a_mask_that_depends_on_the_input_or_is_not_causal_is_kept() -> None:
    """A padding mask (an input) may hide any key; a sliding window of 4 over 12 tokens hides
    more than the causal mask: both are passed to SDPA as they are."""
    ids, labels = _batch()
    padding = torch.ones_like(ids)
    padding[1, -2:] = 0
    padded = fuse_kernels(_export(_build("llama"), ids, labels, padding))
    windowed = fuse_kernels(_export(_build("mistral", sliding_window=4), ids, labels))
    for fused in (padded, windowed):
        assert aten.scaled_dot_product_attention.default in {node.target for node in fused.graph.nodes}
        assert "attention" not in fused.meta["fuse_kernels"].counts


def test_a_bf16_model_folds_the_fp32_upcast_and_the_residual_add_into_the_norm() -> None:
    """Built in bf16, the norm upcasts its input to fp32, rounds the normalized value back to
    bf16, then multiplies the weight: the fused norm takes those casts as its form and the
    residual add before it, and computes what the chain computes."""
    ids, labels = _batch()
    unfused = _export(_build("llama", torch.bfloat16), ids, labels)
    fused = fuse_kernels(copy.deepcopy(unfused))
    counts = fused.meta["fuse_kernels"].counts
    assert (counts["rms_norm"], counts["rms_norm_residual"]) == (1, 4)
    norms = [node for node in fused.graph.nodes if node.op == "call_function"
             and getattr(node.target, "__name__", "").startswith("rms_norm")]
    assert all(node.kwargs.get("upcast") and node.kwargs.get("norm_dtype") == torch.bfloat16 for node in norms)
    assert not any(node.target is aten.pow.Tensor_Scalar for node in fused.graph.nodes)
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused, ids, labels), _loss_and_grads(unfused, ids, labels)
    assert torch.allclose(loss.float(), ref_loss.float(), rtol=1e-2)
    for name, grad in ref_grads.items():
        assert (grads[name].float() - grad.float()).norm() <= 3e-2 * grad.float().norm() + 1e-6, name


def test_inspect_shows_each_block_fully_fused_and_what_is_left_outside(tmp_path) -> None:  # noqa: ANN001
    """`mplan inspect CONFIG.json` in the config's own dtype: the decoder layer's chains all
    become kernels and nothing memory-bound is left in it (attention's output, reshaped to its
    own shape by transformers >= 5.24, transposed back and made contiguous, is the [b, s, h, d]
    memory the kernel wrote: no copy); what is left outside blocks (RoPE's tables) is listed with
    its bytes and why."""
    from mplan.planner.planning import capture_spec
    from mplan.summary import summarize

    config_cls, _, _ = FAMILIES["llama"]
    config_cls(**SHAPE, dtype="bfloat16").save_pretrained(tmp_path)
    doc = summarize(capture_spec(str(tmp_path), batch=2, seq_len=12), per_op=False)
    block, outside = doc["fusion"]
    assert block["block_type"] == "LlamaDecoderLayer" and block["instances"] == 2
    assert block["left"] == []
    assert {f["kernel"] for f in block["fused"]} == {"rms_norm", "rms_norm_residual", "linear_group", "rope_qk",
                                                    "attention", "linear_swiglu"}
    assert {f["kernel"] for f in outside["fused"]} == {"rms_norm_residual", "linear_cross_entropy"}
    # RoPE as the runtime runs it: q and k in one rope_qk launch per layer, no single rope left
    (rope,) = [f for f in block["fused"] if f["kernel"] == "rope_qk"]
    assert rope["count"] * block["instances"] == COVERAGE["llama"]["rope_qk"]
    assert all(op["bytes"] > 0 and op["why"] for op in outside["left"])
