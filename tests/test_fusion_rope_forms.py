"""The attention-side forms issue 35 (item 2) found unfused: interleaved RoPE, the casts around
RoPE, q/k norms over all heads, q/k/v beside a parallel block's MLP.

- Cohere rotates the pairs (2i, 2i + 1) (`stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)`,
  tables repeat_interleave'd) and casts q and k to fp32 before RoPE and back after it; OLMo-2 casts
  after it. RoPE on q and k then runs as one rope_qk launch (`interleaved`, `upcast`, `dtype`).
- OLMo-2 norms q and k over all heads between the projection and the reshape to heads; Cohere's
  input norm feeds q, k, v and the MLP's gate and up (a parallel block): q, k, v still run as one
  grouped GEMM (linear_group), its parts feeding the norms; gate and up stay the GLU's.
- Ernie 4.5 casts each product's operand instead, after rotating: `q.float() * cos +
  rotate_pairs(q).float() * sin` (a rotation moves values without arithmetic, so it is the same
  cast); RoPE on q and k runs as one rope_qk launch all the same.
- q and k in two layouts do not pair, and say why; nor does GPT-J's interleaved partial RoPE on
  [batch, seq, heads, head_dim], permuted after it (each RoPE still fuses).

Each form is checked on a hand-written module and on a tiny Hugging Face model as transformers
ships it (2 layers, hidden 64): fused and unfused programs agree forward and backward (float64 on
the reference dispatch; fp32 with the Triton kernels under TRITON_INTERPRET=1 in the
`interpreted` tests), and `fusion_coverage` (what `mplan inspect` shows) has rope_qk and
linear_group fired. Interpreted tests run only in a process started with TRITON_INTERPRET=1:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_fusion_rope_forms.py -k interpreted
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import rel_err
from hf_loss import HFLoss
from torch import nn

from mplan.fusion.coverage import fusion_coverage, missed_chains
from mplan.ir.trace import capture
from mplan.kernels.dispatch import INTERPRET
from mplan.kernels.rotary import rope, rope_qk, rope_qk_reference, rope_reference
from mplan.passes.fuse_kernels import fuse_kernels

transformers = pytest.importorskip("transformers")

interpreted = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, SEQ = 4, 2, 16, 64, 12


def _tables(seq: int, dim: int, *, interleaved: bool, dtype: torch.dtype = torch.float64,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, dim]: each frequency twice, side by side (interleaved) or in two halves."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


class Attention(nn.Module):
    """q/k/v projections of one input, RoPE, causal SDPA reading 2 kv heads for 4 q heads.

    layouts: the rotation of q and of k ("pairs": Cohere's, "halves": Llama's); casts: q.float()
    before RoPE and .to(dtype) after it (Cohere's); casts_each: x.float() and rotate(x).float(), each
    product's operand cast after rotating, and .to(dtype) after RoPE (Ernie 4.5's); qk_norm: RMSNorm of
    q and of k over all heads before the reshape to heads (OLMo-2's); mlp: a SwiGLU MLP on the same
    input, summed in (a parallel block, Cohere's)."""

    def __init__(self, *, layouts: tuple[str, str] = ("pairs", "pairs"), casts: bool = False,
                 casts_each: bool = False, qk_norm: bool = False, mlp: bool = False) -> None:
        super().__init__()
        self.layouts, self.casts, self.casts_each = layouts, casts, casts_each
        self.qk_norm, self.mlp = qk_norm, mlp
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(HEADS * HEAD_DIM))
        self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(KV_HEADS * HEAD_DIM))
        self.gate_proj = nn.Linear(HIDDEN, 96, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 96, bias=False)
        self.down_proj = nn.Linear(96, HIDDEN, bias=False)
        cos, sin = _tables(SEQ, HEAD_DIM, interleaved=layouts[0] == "pairs")  # q's, k's too
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
        dtype = x.dtype
        if self.casts:
            x = x.float()
        rotated = _rotate_pairs(x) if layout == "pairs" else _rotate_halves(x)
        if self.casts_each:
            return (x.float() * cos + rotated.float() * sin).to(dtype)
        y = x * cos + rotated * sin
        return y.to(dtype) if self.casts else y

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q, k = self._rms(q, self.q_norm), self._rms(k, self.k_norm)
        q, k, v = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)  # once, as Hugging Face's rotary embedding
        q, k = self._rope(q, cos, sin, self.layouts[0]), self._rope(k, cos, sin, self.layouts[1])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        if self.mlp:
            out = out + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


FORMS: dict[str, tuple[dict[str, Any], dict[str, int]]] = {
    # module options, then the fused kernels fuse_kernels reports (norms aside: another entry's)
    "interleaved": ({}, {"linear_group": 1, "rope_qk": 1}),
    "interleaved_with_casts": ({"casts": True}, {"linear_group": 1, "rope_qk": 1}),
    "interleaved_with_each_operand_cast": ({"casts_each": True}, {"linear_group": 1, "rope_qk": 1}),
    "halves_with_each_operand_cast": ({"layouts": ("halves", "halves"), "casts_each": True},
                                      {"linear_group": 1, "rope_qk": 1}),
    "halves_with_casts_after_qk_norms": ({"layouts": ("halves", "halves"), "casts": True, "qk_norm": True},
                                         {"linear_group": 1, "rope_qk": 1}),
    "interleaved_beside_a_parallel_mlp": ({"mlp": True}, {"linear_group": 1, "rope_qk": 1, "linear_swiglu": 1}),
}
_OURS = ("linear_group", "rope", "rope_qk", "linear_swiglu")
FP32_GRAD_SUM = {"interleaved_with_each_operand_cast", "halves_with_each_operand_cast"}
"""Forms whose input gradient the kernel sums in fp32 and rounds once, where the unfused program
rounds each product's gradient to x's dtype and sums there (each operand cast separately): the
forward agrees to float64 rounding, the input gradient to fp32's (in bf16 the kernel's single
rounding is the more accurate one)."""


def _programs(module: nn.Module, *args: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    unfused = torch.export.export(module, args, strict=False).module()
    return unfused, fuse_kernels(copy.deepcopy(unfused))


def _forward_backward(gm: torch.fx.GraphModule, x: torch.Tensor, upstream: torch.Tensor,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = gm(x)
    out.backward(upstream)
    return out.detach(), {"x": x.grad, **{name: p.grad for name, p in gm.named_parameters() if p.grad is not None}}


def _module(dtype: torch.dtype, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    return Attention(**options).to(dtype)


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, SEQ, HIDDEN, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(2, SEQ, HIDDEN, generator=generator, dtype=torch.float64).to(dtype))


def _assert_fused_matches(form: str, dtype: torch.dtype, tol: float, grad_tol: float | None = None,
                          ) -> torch.fx.GraphModule:
    options, expected = FORMS[form]
    x, upstream = _inputs(dtype)
    unfused, fused = _programs(_module(dtype, **options), x)
    counts = fused.meta["fuse_kernels"].counts
    assert {k: v for k, v in counts.items() if k in _OURS} == expected
    (out, grads), (ref_out, ref_grads) = _forward_backward(fused, x, upstream), _forward_backward(unfused, x, upstream)
    assert rel_err(out, ref_out) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= (grad_tol or tol), name
    return fused


# --- the kernels' new options, on the reference dispatch (float64) ---------------------------------


def test_interleaved_rope_is_coheres_rotation() -> None:
    """rope(interleaved=True) and rope_qk's are Hugging Face Cohere's apply_rotary_pos_emb (its own
    rotate_half, repeat_interleave'd tables), partial rotary's first rot_dim too; the halves are not."""
    from transformers.models.cohere.modeling_cohere import rotate_half as cohere_rotate_half

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(2, KV_HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64)
    cos, sin = _tables(SEQ, HEAD_DIM, interleaved=True)
    want_q, want_k = (x * cos + cohere_rotate_half(x) * sin for x in (q, k))
    assert torch.equal(rope(q, cos, sin, interleaved=True), want_q)
    assert all(torch.equal(a, b) for a, b in zip(rope_qk(q, k, cos, sin, interleaved=True), (want_q, want_k)))
    assert not torch.allclose(rope(q, cos, sin), want_q)
    cos4, sin4 = _tables(SEQ, 4, interleaved=True)
    partial = rope(q, cos4, sin4, rot_dim=4, interleaved=True)
    assert torch.equal(partial[..., :4], q[..., :4] * cos4 + cohere_rotate_half(q[..., :4]) * sin4)
    assert torch.equal(partial[..., 4:], q[..., 4:])


def test_the_casts_around_rope_are_the_chains_casts() -> None:
    """upcast and dtype: the result is (x.to(upcast) rotated).to(dtype), its gradient in x's
    dtype, as the ATen chain's; on q and k alike in rope_qk."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64).requires_grad_()
    k = torch.randn(2, KV_HEADS, SEQ, HEAD_DIM, generator=generator, dtype=torch.float64).requires_grad_()
    cos, sin = _tables(SEQ, HEAD_DIM, interleaved=True)
    got = rope_qk(q, k, cos, sin, interleaved=True, upcast=torch.float32, dtype=torch.float16)
    want = tuple(rope_reference(x.float(), cos, sin, interleaved=True).to(torch.float16) for x in (q, k))
    assert [t.dtype for t in got] == [torch.float16] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    upstream = [torch.ones_like(t) for t in got]
    grads = torch.autograd.grad(got, (q, k), upstream)
    ref_grads = torch.autograd.grad(want, (q, k), upstream)
    assert all(g.dtype == torch.float64 and torch.equal(g, r) for g, r in zip(grads, ref_grads))


# --- hand-written modules: the pass on each form (float64, the reference dispatch) -----------------


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_fuses_and_computes_what_the_unfused_program_does(form: str) -> None:
    fused = _assert_fused_matches(form, torch.float64, 1e-12, 1e-6 if form in FP32_GRAD_SUM else None)
    (call,) = [n for n in fused.graph.nodes if n.target is rope_qk]
    options = FORMS[form][0]
    assert call.kwargs.get("interleaved", False) == (options.get("layouts", ("pairs",))[0] == "pairs")
    # the casts taken in: q.float() and .to(q.dtype) (float64) around the rotation, or on each operand
    cast = options.get("casts") or options.get("casts_each")
    want = {"upcast": torch.float32, "dtype": torch.float64} if cast else {}
    assert {k: v for k, v in call.kwargs.items() if k in ("upcast", "dtype")} == want
    assert not [n for n in fused.graph.nodes if n.target in (torch.ops.aten.stack.default, torch.ops.aten.neg.default)]


def test_q_and_k_norms_read_the_grouped_gemms_parts() -> None:
    """OLMo-2's form: one GEMM for q, k and v; its q and k parts are what the norms read."""
    fused = _assert_fused_matches("halves_with_casts_after_qk_norms", torch.float64, 1e-12)
    aten = torch.ops.aten
    (split,) = [n for n in fused.graph.nodes if n.target is aten.split_with_sizes.default]
    assert split.args[1] == [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    assert not [n for n in fused.graph.nodes if n.target is aten.linear.default and n.args[0] is split.args[0].args[0]]


def test_q_and_k_in_two_layouts_stay_two_ropes_and_the_miss_says_why() -> None:
    """q rotated in pairs, k in halves: each is a RoPE, but one rope_qk launch cannot take both;
    `mplan inspect`'s dry run reports the near miss with its reason."""
    x, upstream = _inputs(torch.float64)
    module = _module(torch.float64, layouts=("pairs", "halves"))
    unfused, fused = _programs(module, x)
    assert {k: v for k, v in fused.meta["fuse_kernels"].counts.items() if k in _OURS} == {"linear_group": 1,
                                                                                           "rope": 2}
    (out, _), (ref_out, _) = _forward_backward(fused, x, upstream), _forward_backward(unfused, x, upstream)
    assert rel_err(out, ref_out) <= 1e-12
    misses = [(kernel, miss.why) for kernel, _, miss in missed_chains(capture(module, (x,)))]
    assert misses == [("rope_qk", "RoPE on q and k differ in layout (interleaved or halves) or in the casts "
                                  "around them")]


# --- Hugging Face models as transformers ships them ------------------------------------------------

HF_SHAPE = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32)
HF = {  # config, model, attention implementation (eager: q/k norms before transformers' own matmuls)
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, "sdpa"),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, "sdpa"),
    "olmo2_eager": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, "eager"),
    "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM, "sdpa"),
}
HF_ROPE = {  # the rope_qk call of each layer: Cohere's interleaved pairs and its casts; OLMo-2's cast after
    "cohere": {"interleaved": True, "upcast": torch.float32, "dtype": torch.float64},
    "olmo2": {"dtype": torch.float64},
    "olmo2_eager": {"dtype": torch.float64},
    "ernie4_5": {"interleaved": True, "upcast": torch.float32, "dtype": torch.float64},  # each operand cast
}


def _hf_model(family: str, dtype: torch.dtype) -> nn.Module:
    config_cls, model_cls, attention = HF[family]
    torch.manual_seed(0)
    config = config_cls(**HF_SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = attention
    return model_cls(config).to(dtype)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, SEQ), generator=generator)
    labels = torch.randint(0, 64, (2, SEQ), generator=generator)
    labels[0, :3] = -100
    return ids, labels


def _hf_programs(family: str, dtype: torch.dtype) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    ids, labels = _batch()
    unfused = torch.export.export(HFLoss(_hf_model(family, dtype)), (ids, labels), strict=False).module()
    return unfused, fuse_kernels(copy.deepcopy(unfused))


def _hf_loss_and_grads(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = gm(*_batch())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in gm.named_parameters() if p.grad is not None}


def _assert_hf_fused_matches(family: str, dtype: torch.dtype, tol: float) -> torch.fx.GraphModule:
    unfused, fused = _hf_programs(family, dtype)
    counts = fused.meta["fuse_kernels"].counts
    assert (counts.get("linear_group"), counts.get("rope_qk"), counts.get("rope")) == (2, 2, None)
    (loss, grads), (ref_loss, ref_grads) = _hf_loss_and_grads(fused), _hf_loss_and_grads(unfused)
    assert rel_err(loss, ref_loss) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= tol, name
    return fused


@pytest.mark.parametrize("family", list(HF))
def test_hugging_face_models_fuse_rope_qk_and_linear_group_and_train_alike(family: str) -> None:
    """float64 but for the loss transformers computes in fp32 (and Cohere's q.float()): the loss and
    every gradient agree to fp32 rounding."""
    fused = _assert_hf_fused_matches(family, torch.float64, 1e-6)
    calls = [n for n in fused.graph.nodes if n.target is rope_qk]
    assert [{k: v for k, v in n.kwargs.items() if k != "consumer"} for n in calls] == [HF_ROPE[family]] * 2


@pytest.mark.parametrize("family", list(HF))
def test_inspect_coverage_shows_rope_qk_and_linear_group_fired(family: str) -> None:
    """`fusion_coverage` of the captured model (bf16 on the meta device, as `mplan inspect` captures
    it): the decoder layer's q/k/v as one GEMM and RoPE on q and k as one launch, no miss of either."""
    ids, labels = _batch()
    with torch.device("meta"):
        model = _hf_model(family, torch.bfloat16)
    block = fusion_coverage(capture(model, (ids.to("meta"),), labels=labels.to("meta")))[0]
    fused = {f.kernel: f.count for f in block.fused}
    assert fused["linear_group"] == 1 and fused["rope_qk"] == 1 and "rope" not in fused
    assert not [s for s in block.skipped if s.kernel in ("linear_group", "rope", "rope_qk")]
    assert not {op.op for op in block.left} & {"aten.stack.default", "aten.neg.default", "aten.flatten.using_ints"}


def test_gptj_rotates_interleaved_pairs_unpaired_and_the_miss_says_why() -> None:
    """GPT-J rotates the first rotary_dim of each head in interleaved pairs on [batch, seq, heads,
    head_dim], then permutes to attention's layout: RoPE fuses on q and on k (two launches), exactly;
    the pairing into one launch is a near miss `mplan inspect` explains."""
    config = transformers.GPTJConfig(vocab_size=64, n_embd=HIDDEN, n_layer=2, n_head=HEADS, rotary_dim=8,
                                     n_positions=32, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    ids, labels = _batch()
    model = transformers.GPTJForCausalLM(config).to(torch.float64)
    unfused = torch.export.export(HFLoss(model), (ids, labels), strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert {k: v for k, v in fused.meta["fuse_kernels"].counts.items() if k in _OURS} == {"linear_group": 2, "rope": 4}
    assert [n.kwargs for n in fused.graph.nodes if n.target is rope] == [{"rot_dim": 8, "interleaved": True}] * 4
    (loss, grads), (ref_loss, ref_grads) = _hf_loss_and_grads(fused), _hf_loss_and_grads(unfused)
    assert rel_err(loss, ref_loss) <= 1e-6
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= 1e-6, name
    block = fusion_coverage(capture(model, (ids,), labels=labels))[0]
    assert [(s.kernel, s.count) for s in block.skipped] == [("rope_qk", 1)]
    assert "permuted after RoPE" in block.skipped[0].why


# --- under the Triton interpreter (fp32) ------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("rot_dim", [None, 6])
def test_interpreted_interleaved_kernels_match_the_reference(rot_dim: int | None) -> None:
    """rope and rope_qk with interleaved pairs on Triton (GQA 6 | 3 heads, 5 positions, head_dim
    12: every mask runs; partial rotary's first 6 too): forward and backward within 1e-6 of the
    fp32 reference; fp16 q and k with the casts (upcast fp32, result fp16) within 2e-3 of float64."""
    generator = torch.Generator().manual_seed(0)
    width = rot_dim or 12
    cos, sin = _tables(5, width, interleaved=True, dtype=torch.float32)
    projections = [torch.randn(2, 5, h * 12, generator=generator) for h in (6, 3)]
    upstream = [torch.randn(2, h, 5, 12, generator=generator) for h in (6, 3)]

    def run(op: Any, leaf_dtype: torch.dtype, **options: Any) -> list[torch.Tensor]:
        leaves = [p.clone().to(leaf_dtype).requires_grad_() for p in projections]
        q, k = (p.view(2, 5, -1, 12).transpose(1, 2) for p in leaves)
        outs = op(q, k, cos, sin, **options)
        torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(upstream, outs)])
        return [*outs, *(p.grad for p in leaves)]

    def two_ropes(q: torch.Tensor, k: torch.Tensor, *args: Any, **options: Any) -> tuple[torch.Tensor, ...]:
        return rope(q, *args, **options), rope(k, *args, **options)

    def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  **_: Any) -> tuple[torch.Tensor, ...]:
        return rope_qk_reference(q.double(), k.double(), cos.double(), sin.double(), rot_dim, interleaved=True)

    want = run(reference, torch.float32)
    for op in (rope_qk, two_ropes):
        got = run(op, torch.float32, rot_dim=rot_dim, interleaved=True)
        for name, a, b in zip(("q", "k", "dq", "dk"), got, want):
            assert rel_err(a.double(), b) < 1e-6, (op, name)
        got = run(op, torch.float16, rot_dim=rot_dim, interleaved=True, upcast=torch.float32, dtype=torch.float16)
        assert [t.dtype for t in got] == [torch.float16] * 4
        for name, a, b in zip(("q", "k", "dq", "dk"), got, want):
            assert rel_err(a.double(), b) < 2e-3, (op, name)
    assert "RopeQK" in rope_qk(*(p.view(2, 5, -1, 12).transpose(1, 2).requires_grad_() for p in projections),
                               cos, sin, rot_dim=rot_dim, interleaved=True)[0].grad_fn.name()


@interpreted
@pytest.mark.parametrize("form", list(FORMS))
def test_interpreted_form_matches_the_unfused_program(form: str) -> None:
    _assert_fused_matches(form, torch.float32, 1e-5)


@interpreted
@pytest.mark.parametrize("family", list(HF))
def test_interpreted_hugging_face_model_matches_the_unfused_program(family: str) -> None:
    _assert_hf_fused_matches(family, torch.float32, 1e-5)
