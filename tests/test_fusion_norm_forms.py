"""The norm forms issue 35's GPU race found unfused, fused (item 2, "coverage for the forms users bring").

- Cohere writes its LayerNorm as ATen ops (no bias; x.float(), mean, (x - mean)^2's mean,
  (x - mean) * rsqrt(var + eps), weight.float() * h, .to(input_dtype)) and feeds attention and
  the MLP from one norm (a parallel block, out = residual + attn + mlp): the LayerNorm kernel
  takes the chain, casts and all, alone (layer_norm) or with the residual adds before it
  (layer_norm_residual, both adds: three addends).
- OLMo-2 norms each sublayer's output, then adds it (h = residual + norm(attn)): norm and add in
  one launch (rms_norm_add), which returns the sum alone.
- Granite scales each sublayer's output before the add (residual + h * residual_multiplier):
  rms_norm_residual takes the scale; and its embeddings (times embedding_multiplier), which
  rms_norm takes, returning the product (the residual stream) with the normed value.
- OLMo-1 calls F.layer_norm without weight or bias on x.to(float32) and casts the result back:
  the LayerNorm kernel takes the casts, and no parameters, alone or with the residual add.
- OPT flattens the residual sum to [tokens, hidden] before the MLP's norm and views the next
  sum back: layer_norm_residual reads the addends reshaped as the sum was.

Each form on a hand-written module and on the transformers family as shipped (2 layers, hidden
64): the fused program's loss and gradients against the unfused one's (float64, the kernels'
references, op for op: bit for bit on the modules), and `mplan inspect`'s coverage (a bf16
config) showing the new kernels fired and the ops they take gone from what is left. Forms that
must not fuse are held to that. Under TRITON_INTERPRET=1 (`pytest -k interpreted` in a process
started with it) the Triton kernels run in fp32 against the unfused ops.
"""
from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import rel_err
from hf_loss import HFLoss
from test_fusion_hf import _batch  # 2 x 12 ids and labels of vocabulary 64, three ignored
from torch import nn

from mplan.kernels.dispatch import INTERPRET
from mplan.passes.fuse_kernels import fuse_kernels

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten

HIDDEN = 64


# -- the forms, written by hand ------------------------------------------------------------------
class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm: no bias, statistics in fp32, cast back to the input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + 1e-5)
        return (self.weight.to(torch.float32) * x).to(dtype)


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm; `cast_before_weight` as Llama and Granite (n.to(dtype) * w), else
    as OLMo-2 ((w * n).to(dtype)); `upcast=False` is a model's own fp32 norm, no casts."""

    def __init__(self, *, cast_before_weight: bool, upcast: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.cast_before_weight, self.upcast = cast_before_weight, upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.upcast:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype) if self.cast_before_weight else (self.weight * x).to(dtype)


def _linear() -> nn.Linear:
    return nn.Linear(HIDDEN, HIDDEN, bias=False)


class ParallelBlock(nn.Module):
    """Cohere's block: one norm feeds both branches, out = residual + attn(h) + mlp(h)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = CohereLayerNorm(), _linear(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(torch.tanh(h))


class PostNormBlock(nn.Module):
    """OLMo-2's block: each sublayer's output normed, then added."""

    def __init__(self, *, upcast: bool = True) -> None:
        super().__init__()
        self.attn, self.mlp = _linear(), _linear()
        self.attn_norm = RMSNorm(cast_before_weight=False, upcast=upcast)
        self.mlp_norm = RMSNorm(cast_before_weight=False, upcast=upcast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn_norm(self.attn(x))
        return h + self.mlp_norm(torch.tanh(self.mlp(h)))


class ScaledResidualBlock(nn.Module):
    """Granite's block: pre-norms, each sublayer's output times residual_multiplier before the add."""

    def __init__(self, *, upcast: bool = True) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cast_before_weight=True, upcast=upcast)
        self.norm2 = RMSNorm(cast_before_weight=True, upcast=upcast)
        self.attn, self.mlp = _linear(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x)) * 0.22
        return h + torch.tanh(self.mlp(self.norm2(h))) * 0.22


class OlmoLayerNorm(nn.Module):
    """OLMo-1's LayerNorm: no weight or bias, computed in fp32, cast back to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.to(torch.float32), (HIDDEN,), None, None, 1e-5).to(x.dtype)


class PreNormBlock(nn.Module):
    """OLMo-1's block: h = x + attn(norm(x)), out = h + mlp(norm(h))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = OlmoLayerNorm(), OlmoLayerNorm()
        self.attn, self.mlp = _linear(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + torch.tanh(self.mlp(self.norm2(h)))


def _layer_norm() -> nn.LayerNorm:
    """nn.LayerNorm with a weight and a bias that are not ones and zeros."""
    norm = nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(HIDDEN))
        norm.bias.add_(0.1 * torch.randn(HIDDEN))
    return norm


class FlattenedBlock(nn.Module):
    """OPT's block: the MLP's half reads the sum flattened to [tokens, hidden] (its residual too)
    and views its own sum back to the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = _layer_norm(), _layer_norm()
        self.attn, self.mlp = _linear(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        shape = h.shape
        h = h.reshape(-1, h.size(-1))
        return (h + torch.tanh(self.mlp(self.norm2(h)))).view(shape)


class Stack(nn.Module):
    """Two blocks and a final norm, the loss their output's mean weighted by a target; the input
    times `input_scale` first where given (Granite's embedding_multiplier)."""

    def __init__(self, blocks: list[nn.Module], final: nn.Module, input_scale: float | None = None) -> None:
        super().__init__()
        self.blocks, self.final, self.input_scale = nn.ModuleList(blocks), final, input_scale

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x * self.input_scale
        for block in self.blocks:
            x = block(x)
        return (self.final(x) * target).mean()


def _stack(form: str, dtype: torch.dtype, **options: Any) -> Stack:
    torch.manual_seed(0)
    blocks: dict[str, Any] = {
        "cohere": lambda: (ParallelBlock(), CohereLayerNorm()),
        "olmo2": lambda: (PostNormBlock(**options), RMSNorm(cast_before_weight=False, **options)),
        "granite": lambda: (ScaledResidualBlock(**options), RMSNorm(cast_before_weight=True, **options)),
        "olmo": lambda: (PreNormBlock(), OlmoLayerNorm()),
        "opt": lambda: (FlattenedBlock(), _layer_norm()),
    }
    made = [blocks[form]() for _ in range(2)]
    return Stack([block for block, _ in made], made[-1][1], 3.0 if form == "granite" else None).to(dtype)


MODULE_COUNTS = {
    # the first norm reads the input alone; the second block's and the final one the residual sums
    "cohere": {"layer_norm": 1, "layer_norm_residual": 2},
    # each sublayer's norm and add in one launch; the final norm reads the last sum alone
    "olmo2": {"rms_norm_add": 4, "rms_norm": 1},
    # every norm but the first after a scaled residual add, the scale in the kernel; the first of
    # the scaled input, returned with it
    "granite": {"rms_norm": 1, "rms_norm_residual": 4},
    # the first norm reads the input alone (its casts make it a chain), the others the residual sums
    "olmo": {"layer_norm": 1, "layer_norm_residual": 4},
    # every norm after a residual add, through the flattening and the view back; the first reads
    # the input alone and stays the one ATen kernel it is
    "opt": {"layer_norm_residual": 4},
}


def _module_programs(form: str, dtype: torch.dtype,
                     **options: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 5, HIDDEN, generator=generator, dtype=dtype),
              torch.randn(2, 5, HIDDEN, generator=generator, dtype=dtype))
    unfused = torch.export.export(_stack(form, dtype, **options), inputs, strict=False).module()
    return unfused, fuse_kernels(copy.deepcopy(unfused)), inputs


def _grads(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The loss, then the gradient of every parameter and of the input."""
    x = inputs[0].clone().requires_grad_()
    loss = gm(x, *inputs[1:])
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for _, p in sorted(gm.named_parameters()))]


def _fused_ops(gm: torch.fx.GraphModule) -> dict[str, dict[str, Any]]:
    """Each fused norm call's keywords, by op."""
    return {getattr(n.target, "__name__", ""): dict(n.kwargs) for n in gm.graph.nodes
            if n.op == "call_function" and "norm" in getattr(n.target, "__name__", "")}


@pytest.mark.parametrize("form", list(MODULE_COUNTS))
def test_each_hand_written_form_fuses_and_computes_what_its_ops_compute(form: str) -> None:
    """float64 (the kernels' references, which are the models' chains op for op): loss and every
    gradient bit for bit; no op of a norm's chain is left."""
    unfused, fused, inputs = _module_programs(form, torch.float64)
    assert fused.meta["fuse_kernels"].counts == MODULE_COUNTS[form]
    assert fused.meta["fuse_kernels"].missed == {}
    left = {n.target for n in fused.graph.nodes}
    assert not left & {aten.rsqrt.default, aten.mean.dim, aten.sub.Tensor, aten.to.dtype}
    for got, want in zip(_grads(fused, *inputs), _grads(unfused, *inputs), strict=True):
        assert torch.equal(got, want)


def test_the_fused_calls_carry_each_forms_casts_and_scale() -> None:
    _, cohere, _ = _module_programs("cohere", torch.float64)
    assert _fused_ops(cohere)["layer_norm"] == {"hand_written": True, "upcast": True, "weight_upcast": True,
                                                "out_dtype": torch.float64}
    # (residual + attn) + mlp: the stream and attention's output, then the MLP's as the third addend
    residual_norms = [n for n in cohere.graph.nodes if getattr(n.target, "__name__", "") == "layer_norm_residual"]
    assert [(n.args[1].target, n.kwargs["third"].target) for n in residual_norms] == \
        [(aten.linear.default, aten.linear.default)] * 2
    _, olmo2, _ = _module_programs("olmo2", torch.float64)
    assert _fused_ops(olmo2)["rms_norm_add"] == {"upcast": True, "out_dtype": torch.float64}
    _, granite, _ = _module_programs("granite", torch.float64)
    scaled = [n for n in granite.graph.nodes if getattr(n.target, "__name__", "") == "rms_norm_residual"]
    # the final norm's residual add is the second block's last, scaled too
    assert [n.kwargs.get("scale") for n in scaled] == [0.22] * 4
    # the branch (the linear's output, not the product) goes in first, the residual second
    assert all(n.args[0].target in (aten.linear.default, aten.tanh.default) for n in scaled)
    assert _fused_ops(granite)["rms_norm"] == {"upcast": True, "norm_dtype": torch.float64, "scale": 3.0}
    # no product by a number is left (the loss's product with the target is no scaling)
    assert not [n for n in granite.graph.nodes
                if n.target is aten.mul.Tensor and not all(isinstance(arg, torch.fx.Node) for arg in n.args)]


def test_olmo1_s_norms_run_without_parameters_and_opt_s_read_the_addends_reshaped() -> None:
    """OLMo-1: every fused norm takes the casts as keywords, and no weight or bias; in fp32 its
    upcast is a no-op the residual stream reads on, and the norms still take their adds (bit for
    bit). OPT: the norms of the flattened sum, and of the sum viewed back, read the addends
    reshaped as the sum was."""
    _, olmo, _ = _module_programs("olmo", torch.float64)
    norms = [n for n in olmo.graph.nodes if getattr(n.target, "__name__", "").startswith("layer_norm")]
    assert len(norms) == 5
    for norm in norms:
        assert norm.args[-3:-1] == (None, None)  # (x[, residual], weight, bias, eps)
        assert {k: v for k, v in norm.kwargs.items() if k != "consumer"} == {"upcast": True,
                                                                            "out_dtype": torch.float64}
    unfused, fused, inputs = _module_programs("olmo", torch.float32)
    assert fused.meta["fuse_kernels"].counts == MODULE_COUNTS["olmo"]
    for got, want in zip(_grads(fused, *inputs), _grads(unfused, *inputs), strict=True):
        assert torch.equal(got, want)
    _, opt, _ = _module_programs("opt", torch.float64)
    residual_norms = [n for n in opt.graph.nodes if getattr(n.target, "__name__", "") == "layer_norm_residual"]
    addends = [n.args[i] for n in residual_norms for i in (0, 1)]
    assert all(a.target is aten.reshape.default for a in addends)
    flat, whole = (10, HIDDEN), (2, 5, HIDDEN)  # [tokens, hidden] and the input's [batch, seq, hidden]
    assert [tuple(a.meta["val"].shape) for a in addends] == [flat, flat, whole, whole] * 2


def test_a_sum_also_read_in_its_own_shape_leaves_the_norm_of_it_flattened_an_op() -> None:
    """The kernel returns the sum in the shape its norm reads, so a sum read unflattened too is
    no residual it can take: the add and the LayerNorm stay ATen ops, computing as before."""

    class BothShapes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = _layer_norm()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = x + y
            return (self.norm(h.reshape(-1, HIDDEN)) * 2).mean() + h.mean()

    torch.manual_seed(0)
    inputs = (torch.randn(2, 5, HIDDEN, dtype=torch.float64), torch.randn(2, 5, HIDDEN, dtype=torch.float64))
    unfused = torch.export.export(BothShapes().double(), inputs, strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert fused.meta["fuse_kernels"].counts == {}
    assert aten.layer_norm.default in {n.target for n in fused.graph.nodes}
    assert torch.equal(fused(*inputs), unfused(*inputs))


def test_a_post_norm_whose_sum_is_normed_and_read_on_leaves_the_add_to_the_next_norm() -> None:
    """Gemma-2: post-norm, add, then the next block's pre-norm of the sum, which goes on as the
    residual. The add is the pre-norm's (rms_norm_residual, which takes the stream's gradient in):
    the post-norm fuses alone."""

    class Gemma2Like(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.post = (RMSNorm(cast_before_weight=False) for _ in range(2))
            self.attn = _linear()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + self.post(self.attn(x))
            return h + self.attn(self.pre(h))

    torch.manual_seed(0)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    gm = torch.export.export(Gemma2Like().double(), (x,), strict=False).module()
    assert fuse_kernels(gm).meta["fuse_kernels"].counts == {"rms_norm": 1, "rms_norm_residual": 1}


def test_forms_whose_values_are_read_elsewhere_stay_ops_or_fuse_less() -> None:
    """A post-norm's output also read past the add: no norm + add (the norm alone fuses); a
    scaled branch whose product is read elsewhere: the product stays, the add fuses unscaled; a
    hand-written LayerNorm whose mean is read elsewhere: left as ops. Each still computes as before."""

    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.post = RMSNorm(cast_before_weight=False)
            self.pre = RMSNorm(cast_before_weight=True)
            self.layer_norm = CohereLayerNorm()
            self.attn = _linear()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            normed = self.post(self.attn(x))
            h = x + normed
            scaled = self.attn(h) * 0.5
            g = self.pre(h + scaled)
            y = g.float()
            mean = y.mean(-1, keepdim=True)
            centred = (y - mean) * torch.rsqrt((y - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
            return (self.layer_norm.weight.float() * centred).sum() + mean.sum(), normed.sum(), scaled.sum()

    torch.manual_seed(0)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    unfused = torch.export.export(Leaky().double(), (x,), strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert fused.meta["fuse_kernels"].counts == {"rms_norm": 1, "rms_norm_residual": 1}
    (residual,) = [n for n in fused.graph.nodes if getattr(n.target, "__name__", "") == "rms_norm_residual"]
    assert "scale" not in residual.kwargs
    assert aten.sub.Tensor in {n.target for n in fused.graph.nodes}
    for got, want in zip(fused(x), unfused(x), strict=True):
        assert torch.equal(got, want)


# -- the families as transformers ships them -----------------------------------------------------
SHAPE = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)

FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, {}),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                {"residual_multiplier": 0.22, "embedding_multiplier": 3.0}),
    "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM, {}),
    # enable_bias=False: the key projection's bias gets no gradient (softmax ignores a shift of
    # all of a query's scores), so its gradient and update would be rounding noise compared
    "opt": (transformers.OPTConfig, transformers.OPTForCausalLM,
            {"ffn_dim": 96, "word_embed_proj_dim": HIDDEN, "dropout": 0.0, "layerdrop": 0.0, "enable_bias": False}),
}

FAMILY_NORMS = {
    # float64: Cohere's first norm reads the embedding, the second block's and the final one the
    # residual sums; OLMo-2's q and k norms alone, its four post-norms with their adds, the final
    # norm alone; Granite's norms after its scaled adds; OLMo-1's first norm alone (the
    # embedding), the rest with their adds; all five of OPT's with their adds
    "cohere": {"layer_norm": 1, "layer_norm_residual": 2},
    "olmo2": {"rms_norm": 5, "rms_norm_add": 4},
    "granite": {"rms_norm": 1, "rms_norm_residual": 4},
    "olmo": {"layer_norm": 1, "layer_norm_residual": 4},
    "opt": {"layer_norm_residual": 5},
}


def _family_programs(family: str, dtype: torch.dtype) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**SHAPE, **extra)
    config._attn_implementation = "sdpa"
    unfused = torch.export.export(HFLoss(model_cls(config).to(dtype)), _batch(), strict=False).module()
    return unfused, fuse_kernels(copy.deepcopy(unfused))


def _loss_and_grads(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    loss = gm(*_batch())
    loss.backward()
    return [loss.detach(), *(p.grad for _, p in sorted(gm.named_parameters()))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_fuses_its_norms_and_trains_like_its_unfused_program(family: str) -> None:
    """float64 but for the loss transformers computes in fp32: loss and gradients to fp32 rounding."""
    unfused, fused = _family_programs(family, torch.float64)
    counts = fused.meta["fuse_kernels"].counts
    assert {k: v for k, v in counts.items() if "norm" in k} == FAMILY_NORMS[family]
    assert not {n.target for n in fused.graph.nodes} & {aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.mean.dim}
    (loss, *grads), (ref_loss, *ref_grads) = _loss_and_grads(fused), _loss_and_grads(unfused)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).norm() <= 1e-6 * want.norm() + 1e-12


def _coverage(family: str) -> dict[str, Any]:
    """fusion_coverage of the family's bf16 config (what `mplan inspect` reads): per block type
    and outside blocks, the fused kernels and the memory-bound ops left."""
    from mplan.fusion.coverage import fusion_coverage
    from mplan.planner.planning import capture_spec

    config_cls, _, extra = FAMILIES[family]
    with tempfile.TemporaryDirectory() as tmp:
        config_cls(**SHAPE, **extra, dtype="bfloat16").save_pretrained(tmp)
        coverages = fusion_coverage(capture_spec(tmp, batch=2, seq_len=12))
    block, outside = coverages
    return {"fused": {f.kernel: f.count for f in block.fused}, "left": {op.op: op.count for op in block.left},
            "outside_fused": {f.kernel for f in outside.fused}, "outside_left": {op.op for op in outside.left}}


NORM_OPS = {"aten.sub.Tensor", "aten.mean.dim", "aten.pow.Tensor_Scalar", "aten.rsqrt.default"}


def test_inspect_shows_cohere_s_layer_norms_fused_their_ops_gone() -> None:
    """The race's coverage left per Cohere layer mul x6, add x5, to.dtype x7, sub x2, mean x2,
    pow x1 (1.15 GB at its size) and the final norm. Now the norm, its casts included, is one
    kernel, and the block's two residual adds (residual + attn, + mlp) are the next norm's.
    (RoPE's ops among those are tests/test_fusion_rope_forms.py's.)"""
    coverage = _coverage("cohere")
    assert coverage["fused"]["layer_norm"] == 1  # the template block is the first: it norms the embedding
    assert coverage["left"] == {}
    assert "layer_norm_residual" in coverage["outside_fused"]  # the final norm, after the last add
    assert not coverage["outside_left"] & NORM_OPS


def test_inspect_shows_olmo2_s_post_norms_and_adds_fused_nothing_left() -> None:
    """The race left per OLMo-2 layer to.dtype x6 (604 MB) and add x2 (201 MB): the post-norms'
    casts and their residual adds, now inside rms_norm_add."""
    coverage = _coverage("olmo2")
    assert coverage["fused"]["rms_norm_add"] == 2 and coverage["fused"]["rms_norm"] == 2  # q and k norms
    assert coverage["left"] == {}


def test_inspect_shows_granite_s_residual_multiplier_fused_nothing_left_in_blocks() -> None:
    """The race left per Granite layer mul x2 (268 MB): the sublayer outputs times
    residual_multiplier, now inside rms_norm_residual; and outside the blocks one mul (134 MB),
    the embeddings times embedding_multiplier, now inside the first block's rms_norm (the
    template block's: the first)."""
    coverage = _coverage("granite")
    assert coverage["fused"]["rms_norm_residual"] == 1 and coverage["fused"]["rms_norm"] == 1
    assert coverage["left"] == {}
    _, fused = _family_programs("granite", torch.float64)
    (first,) = [n for n in fused.graph.nodes if getattr(n.target, "__name__", "") == "rms_norm"]
    assert first.kwargs["scale"] == 3.0 and first.args[0].target is aten.embedding.default


# -- under the Triton interpreter (TRITON_INTERPRET=1 from process start) ------------------------
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start")


KERNEL_FUNCTIONS = {
    "cohere": {"LayerNormResidualFunctionBackward"},
    "olmo2": {"RMSNormAddFunctionBackward", "RMSNormResidualFunctionBackward"},  # the final norm alone
    "granite": {"RMSNormResidualFunctionBackward"},
    "olmo": {"LayerNormResidualFunctionBackward"},
    "opt": {"LayerNormResidualFunctionBackward"},
}
"""The Triton autograd Functions each form's fused program runs."""


def _backward_nodes(loss: torch.Tensor) -> set[str]:
    """The names of every node in `loss`'s autograd graph."""
    names, frontier, seen = set(), [loss.grad_fn], set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return names


@needs_interpreter
@pytest.mark.parametrize(("form", "options"), [("cohere", {}), ("olmo2", {}), ("olmo2", {"upcast": False}),
                                               ("granite", {}), ("granite", {"upcast": False}), ("olmo", {}),
                                               ("opt", {})], ids=str)
def test_interpreted_hand_written_forms_match_their_ops(form: str, options: dict[str, Any]) -> None:
    """fp32, the fused norms' Triton kernels (their autograd Functions in the graph's backward)
    against the unfused ops: loss, input and parameter gradients within 1e-5."""
    unfused, fused, inputs = _module_programs(form, torch.float32, **options)
    assert KERNEL_FUNCTIONS[form] <= _backward_nodes(fused(*inputs))
    results = _grads(fused, *inputs)
    for got, want in zip(results, _grads(unfused, *inputs), strict=True):
        assert rel_err(got, want) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("family", list(FAMILIES))
def test_interpreted_family_matches_its_unfused_program(family: str) -> None:
    """fp32, every fused kernel in Triton under the interpreter: loss and gradients of the fused
    program within 1e-5 of the unfused one's. (In fp32 the norms' upcast is a no-op the residual
    stream reads on, so some residual adds stay apart: the norms run alone.)"""
    unfused, fused = _family_programs(family, torch.float32)
    assert KERNEL_FUNCTIONS[family] <= _backward_nodes(fused(*_batch()))
    (loss, *grads), (ref_loss, *ref_grads) = _loss_and_grads(fused), _loss_and_grads(unfused)
    assert rel_err(loss, ref_loss) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-5


@needs_interpreter
def test_interpreted_kernels_compute_their_references() -> None:
    """Each new kernel form directly, fp32, 11 rows of 40 (a partial row block), both outputs'
    gradients flowing back: the hand-written LayerNorm alone and after a residual add, three
    addends, F.layer_norm with casts and no weight or bias (alone, after a residual add) or a
    bias alone, norm + add, the scaled input normed and returned, and the scaled residual add."""
    from mplan.kernels.layernorm import (LayerNormForm, layer_norm, layer_norm_reference, layer_norm_residual,
                                         layer_norm_residual_reference)
    from mplan.kernels.rmsnorm import (NormForm, rms_norm, rms_norm_add, rms_norm_add_reference, rms_norm_reference,
                                       rms_norm_residual, rms_norm_residual_reference)

    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(11, 40, generator=generator), torch.randn(11, 40, generator=generator)
    weight = 1 + 0.1 * torch.randn(40, generator=generator)
    hand = {"hand_written": True, "upcast": True, "weight_upcast": True, "out_dtype": torch.float32}
    ln_form = LayerNormForm(True, True, torch.float32)
    casts = {"upcast": True, "out_dtype": torch.float32}
    cast_form = LayerNormForm(upcast=True, out_dtype=torch.float32, hand_written=False)
    cases = [
        (lambda a, r, w: layer_norm(a, w, None, 1e-5, **hand),
         lambda a, r, w: layer_norm_reference(a, w, None, 1e-5, ln_form), "LayerNormResidualFunction"),
        (lambda a, r, w: layer_norm_residual(a, r, w, None, 1e-5, **hand),
         lambda a, r, w: layer_norm_residual_reference(a, r, w, None, 1e-5, ln_form), "LayerNormResidualFunction"),
        # a third addend made from x, so that its gradient shows in x's
        (lambda a, r, w: layer_norm_residual(a, r, w, None, 1e-5, third=0.5 * a.flip(0)),
         lambda a, r, w: layer_norm_residual_reference(a, r, w, None, 1e-5, third=0.5 * a.flip(0)),
         "LayerNormResidualFunction"),
        (lambda a, r, w: layer_norm(a, None, None, 1e-5, **casts),
         lambda a, r, w: layer_norm_reference(a, None, None, 1e-5, cast_form), "LayerNormResidualFunction"),
        (lambda a, r, w: layer_norm_residual(a, r, None, None, 1e-5, **casts),
         lambda a, r, w: layer_norm_residual_reference(a, r, None, None, 1e-5, cast_form),
         "LayerNormResidualFunction"),
        # the weight leaf as a bias: its gradient is the bias's alone
        (lambda a, r, w: layer_norm_residual(a, r, None, w, 1e-5),
         lambda a, r, w: layer_norm_residual_reference(a, r, None, w, 1e-5), "LayerNormResidualFunction"),
        (lambda a, r, w: rms_norm_add(a, r, w, 1e-6, upcast=True, out_dtype=torch.float32),
         lambda a, r, w: rms_norm_add_reference(a, r, w, 1e-6, NormForm(True, None, torch.float32)),
         "RMSNormAddFunction"),
        (lambda a, r, w: rms_norm(a, w, 1e-6, scale=3.0),
         lambda a, r, w: (rms_norm_reference(3.0 * a, w, 1e-6), 3.0 * a), "RMSNormResidualFunction"),
        (lambda a, r, w: rms_norm_residual(a, r, w, 1e-6, scale=0.3),
         lambda a, r, w: rms_norm_residual_reference(a, r, w, 1e-6, scale=0.3), "RMSNormResidualFunction"),
    ]
    probe = torch.linspace(-1, 2, 40)
    for fused_op, reference, function in cases:
        results = []
        for op in (fused_op, reference):
            leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
            out = op(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            if op is fused_op:
                assert function in outs[0].grad_fn.name()
            sum(((o * probe) * (i + 1)).sum() for i, o in enumerate(outs)).backward()
            results.append([*(o.detach() for o in outs), *(t.grad for t in leaves)])
        for got, want in zip(*results, strict=True):
            assert (got is None) == (want is None), function  # layer_norm reads no residual
            assert got is None or rel_err(got, want) < 1e-5, function


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_training_step_with_the_new_norms_matches_one_without(family: str) -> None:
    """`autoparallel` on one process (the planner prices and counts the new entries' memory),
    float64, two SGD steps with kernels on and off: the same losses (to the fp32 rounding of
    transformers' loss) and the same parameters after them."""
    import functools

    import mplan

    ids, labels = _batch()
    results = []
    for kernels in (True, False):
        config_cls, model_cls, extra = FAMILIES[family]
        torch.manual_seed(0)
        config = config_cls(**SHAPE, **extra)
        config._attn_implementation = "sdpa"
        pm = mplan.autoparallel(model_cls(config).double(), example_inputs=(ids,), global_batch=2, plan="dp=1",
                                kernels=kernels, cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1),
                                optimizer=functools.partial(torch.optim.SGD, lr=0.1), progress="quiet")
        losses = [float(pm.train_step(ids, labels)) for _ in range(2)]
        report = pm.program.meta.get("fuse_kernels")
        results.append((losses, pm.full_state_dict(), report.counts if report is not None else {}))
    (losses, params, fired), (ref_losses, ref_params, unfused) = results
    assert {k: v for k, v in fired.items() if "norm" in k} == FAMILY_NORMS[family] and unfused == {}
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, value in ref_params.items():
        assert (params[name] - value).norm() <= 1e-6 * value.norm(), name
