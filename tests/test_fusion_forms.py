"""The layer forms issue 35 found unfused, on Hugging Face models as transformers ships them.

- Gemma-2 soft-caps its logits between the head and the loss (c * tanh(z / c)); Cohere scales
  them (logit_scale), Granite divides them (logits_scaling): the fused head + loss takes each,
  applying the transform chunk by chunk, forward and backward.
- Phi-3 projects q, k, v with one packed `qkv_proj` sliced apart, and gate and up with one packed
  `gate_up_proj` chunked in halves; its RoPE slices x[..., :rotary_dim] and concatenates the
  (empty) rest back: q/k/v as one grouped GEMM split, RoPE on q and k in one launch, SwiGLU fused
  with its GEMM, as the separate forms get.
- Gemma-2's attention is transformers' eager one (matmul, scale, mask add, softmax in fp32,
  matmul): with its attention logits not soft-capped and a causal mask it is SDPA, and runs as
  one fused attention call; soft-capped (tanh) or under a window shorter than the sequence it
  stays ATen ops, reported with why.
- StableLM (as GPT-NeoX and Phi) rotates only the first rot_dim of each head (partial rotary),
  slicing, rotating and concatenating the rest back: RoPE on q and k in one launch on the rotated
  columns, the rest copied through.

Each family is built from a tiny config, exported as `autoparallel` exports it, fused and held to
its unfused program (loss and every gradient; float64 but for the loss transformers computes in
fp32). `mplan inspect`'s document says per family what fused, and what came close and why not
(Mistral's sliding window). Under TRITON_INTERPRET=1 (tests/test_kernels.py's interpreter
suite) the soft-capped, scaled head + loss's kernels and the fused Phi-3, Gemma-2 and StableLM
programs run Triton in fp32 against the unfused ops.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed import rel_err
from hf_loss import HFLoss
from test_fusion_hf import _batch  # 2 x 12 ids and labels of vocabulary 64, three ignored
from torch import nn

from mplan.kernels.dispatch import INTERPRET
from mplan.kernels.head_loss import linear_cross_entropy, linear_cross_entropy_reference
from mplan.passes.fuse_kernels import fuse_kernels

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)

FAMILIES: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    # config, model, config overrides, attention implementation (Gemma-2 has no SDPA path here)
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"head_dim": 8, "final_logit_softcapping": 30.0, "attn_logit_softcapping": None}, "eager"),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}, "sdpa"),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, {"logits_scaling": 4.0}, "sdpa"),
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, {"logit_scale": 0.25}, "sdpa"),
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM, {"partial_rotary_factor": 0.25},
                 "sdpa"),
}

COVERAGE = {
    # soft-capped logits into the head + loss; GeGLU with its GEMM; the norms after attention and
    # the MLP alone (Gemma-2 norms a sublayer's output before the residual add); eager attention
    # (matmul, scale, causal mask, fp32 softmax, matmul) as one causal SDPA call, so RoPE on q
    # and k, now feeding one attention call, pairs into rope_qk
    "gemma2": {"rms_norm": 5, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
               "linear_geglu": 2, "linear_cross_entropy": 1},
    # the packed projections: q/k/v split from one GEMM, gate/up its halves, RoPE paired
    "phi3": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
             "linear_swiglu": 2, "linear_cross_entropy": 1},
    # logits divided by logits_scaling into the head + loss
    "granite": {"rms_norm": 1, "rms_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2,
                "linear_swiglu": 2, "linear_cross_entropy": 1},
    # logits times logit_scale into the head + loss; Cohere's hand-written LayerNorm without a bias
    # (alone first, then with the parallel block's two adds), q/k/v one GEMM beside the MLP's
    # gate/up, its interleaved RoPE on q and k in one launch
    "cohere": {"layer_norm": 1, "layer_norm_residual": 2, "linear_group": 2, "rope_qk": 2, "linear_swiglu": 2,
               "attention": 2, "linear_cross_entropy": 1},
    # partial rotary (a quarter of each head): q and k sliced, rotated and concatenated with
    # their rest, both in one rope_qk (rot_dim 2 of head_dim 8); LayerNorms with their residual adds
    "stablelm": {"layer_norm_residual": 4, "linear_group": 2, "rope_qk": 2, "attention": 2, "linear_swiglu": 2,
                 "linear_cross_entropy": 1},
}


def _build(family: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> nn.Module:
    config_cls, model_cls, extra, attention = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**SHAPE, **extra, **overrides})
    config._attn_implementation = attention
    return HFLoss(model_cls(config).to(dtype))


def _programs(family: str, dtype: torch.dtype = torch.float64,
              **overrides: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    ids, labels = _batch()
    unfused = torch.export.export(_build(family, dtype, **overrides), (ids, labels), strict=False).module()
    return unfused, fuse_kernels(copy.deepcopy(unfused))


def _loss_and_grads(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = gm(*_batch())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in gm.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_form_fuses_and_trains_like_its_unfused_program(family: str) -> None:
    unfused, fused = _programs(family)
    assert fused.meta["fuse_kernels"].counts == COVERAGE[family]
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused), _loss_and_grads(unfused)
    # the loss of logits.float() is fp32 whatever the model's dtype: loss and its gradients agree
    # to fp32 rounding, the rest is float64
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-12, name


def test_the_head_and_loss_is_told_the_cap_and_the_scale() -> None:
    calls = {}
    for family in ("gemma2", "granite", "cohere"):
        _, fused = _programs(family)
        (node,) = [n for n in fused.graph.nodes if n.target is linear_cross_entropy]
        calls[family] = {k: v for k, v in node.kwargs.items() if k in ("softcap", "logit_scale")}
    assert calls == {"gemma2": {"softcap": 30.0}, "granite": {"logit_scale": 0.25}, "cohere": {"logit_scale": 0.25}}


def test_gemma2s_eager_attention_runs_as_one_causal_sdpa_call() -> None:
    """Causal (transformers' masks proven so: the sliding layer's window of 4096 is longer than the
    sequence), reading the 2 kv heads with enable_gqa, at Gemma-2's scale query_pre_attn_scalar ** -0.5
    = 1/16 (not head_dim ** -0.5): no softmax or [batch, heads, seq, seq] GEMM is left."""
    _, fused = _programs("gemma2")
    calls = [n for n in fused.graph.nodes if n.op == "call_function" and n.target.__name__ == "attention"]
    assert [(n.kwargs["is_causal"], n.kwargs["scale"], n.kwargs["enable_gqa"]) for n in calls] == [(True, 1 / 16, True)] * 2
    assert [tuple(n.args[1].meta["val"].shape) for n in calls] == [(2, 2, 12, 8)] * 2
    aten = torch.ops.aten
    assert not [n for n in fused.graph.nodes if n.target in (aten.softmax.int, aten.matmul.default, aten.tanh.default)]


@pytest.mark.parametrize(("overrides", "missed"), [
    ({"attn_logit_softcapping": 50.0}, {"attention logits soft-capped with tanh (no SDPA backend computes it)": 2}),
    # a window of 4 keys, shorter than the 12 positions: the sliding layer's mask is not causal
    ({"sliding_window": 4}, {"a mask that depends on the input or is not causal (padding, sliding window, documents)": 1}),
], ids=["attn_softcap", "short_window"])
def test_gemma2s_eager_attention_sdpa_cannot_run_stays_ops_and_says_why(overrides: dict[str, Any],
                                                                        missed: dict[str, int]) -> None:
    unfused, fused = _programs("gemma2", **overrides)
    report = fused.meta["fuse_kernels"]
    assert report.missed["attention"] == missed
    assert report.counts.get("attention", 0) == 2 - sum(missed.values())
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused), _loss_and_grads(unfused)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-12, name


def test_phi3s_packed_projections_become_one_split_gemm_and_the_packed_swiglu() -> None:
    _, fused = _programs("phi3")
    targets = [str(n.target) for n in fused.graph.nodes if n.op == "call_function"]
    assert targets.count("aten.split_with_sizes.default") == 2  # q, k, v of each layer's qkv_proj
    assert "aten.chunk.default" not in targets and "aten.silu.default" not in targets
    # v, the part RoPE leaves alone, is copied out so the packed buffer goes once RoPE has run
    assert targets.count("aten.clone.default") == 2


def test_a_soft_cap_after_a_scaling_or_logits_used_elsewhere_are_reported_not_fused() -> None:
    class Head(nn.Module):
        def __init__(self, *, scale_after_cap: bool) -> None:
            super().__init__()
            self.head = nn.Linear(8, 16, bias=False, dtype=torch.float64)
            self.scale_after_cap = scale_after_cap

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = torch.tanh(self.head(x) / 5.0) * 5.0
            if self.scale_after_cap:
                logits = logits * 2.0
            loss = nn.functional.cross_entropy(logits.view(-1, 16), labels.view(-1))
            return (loss,) if self.scale_after_cap else (loss, logits)

    x, labels = torch.randn(2, 3, 8, dtype=torch.float64), torch.randint(0, 16, (2, 3))
    for scale_after_cap, why in [(True, "scaled after the soft-cap"), (False, "also used outside the loss")]:
        gm = torch.export.export(Head(scale_after_cap=scale_after_cap), (x, labels), strict=False).module()
        report = fuse_kernels(gm).meta["fuse_kernels"]
        assert report.counts == {"cross_entropy": 1}
        (reason,) = report.missed["linear_cross_entropy"]
        assert why in reason


def test_inspect_reports_per_family_what_fused_and_what_missed_and_why(tmp_path, capsys) -> None:  # noqa: ANN001
    """`mplan inspect` on a config.json: Phi-3's decoder layer fuses whole, as Llama's; GPT-NeoX's
    rotates a quarter of each head (partial rotary_dim): RoPE on q and k still pairs into rope_qk
    (rotated part in the kernel, the rest passed through), and no miss is reported for it, nor
    for StableLM's; a near miss (Mistral's sliding window) is printed with its reason."""
    from mplan.planner.planning import capture_spec
    from mplan.summary import summarize

    transformers.Phi3Config(**SHAPE, pad_token_id=0, dtype="bfloat16").save_pretrained(tmp_path / "phi3")
    doc = summarize(capture_spec(str(tmp_path / "phi3"), batch=2, seq_len=12), per_op=False)
    block, outside = doc["fusion"]
    assert {f["kernel"] for f in block["fused"]} == {"rms_norm", "rms_norm_residual", "linear_group", "rope_qk", "attention",
                                                    "linear_swiglu"}
    assert block["skipped"] == [] and {f["kernel"] for f in outside["fused"]} >= {"linear_cross_entropy"}
    neox = {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}
    transformers.GPTNeoXConfig(**neox).save_pretrained(tmp_path / "neox")
    doc = summarize(capture_spec(str(tmp_path / "neox"), batch=2, seq_len=12), per_op=False)
    block = doc["fusion"][0]
    kernels = {f["kernel"] for f in block["fused"]}
    assert "rope_qk" in kernels and "rope" not in kernels
    assert not [s for s in block["skipped"] if s["kernel"] in ("rope", "rope_qk")]
    from mplan.cli import main

    # StableLM (a quarter rotated) prints rope_qk fused and no miss; a sliding window's attention
    # is a near miss, printed with its reason
    transformers.StableLmConfig(**SHAPE, partial_rotary_factor=0.25).save_pretrained(tmp_path / "stablelm")
    assert main(["inspect", str(tmp_path / "stablelm"), "--batch", "2", "--seq-len", "12"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "rope_qk x1" in printed and "missed" not in printed
    transformers.MistralConfig(**SHAPE, sliding_window=4).save_pretrained(tmp_path / "mistral")
    doc = summarize(capture_spec(str(tmp_path / "mistral"), batch=2, seq_len=12), per_op=False)
    (skipped,) = doc["fusion"][0]["skipped"]
    assert skipped["kernel"] == "attention" and "sliding window" in skipped["why"]
    assert main(["inspect", str(tmp_path / "mistral"), "--batch", "2", "--seq-len", "12"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"attention missed x{skipped['count']}: {' '.join(skipped['why'].split())}" in printed


# -- under the Triton interpreter (tests/test_kernels.py::test_interpreter_suite) -----------------
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start; "
                                                             "run by tests/test_kernels.py::test_interpreter_suite")


@needs_interpreter
@pytest.mark.parametrize("transform", [{"softcap": 3.0}, {"logit_scale": 0.5}, {"logit_scale": 2.0, "softcap": 4.0}],
                         ids=str)
def test_interpreted_head_loss_applies_the_transform_per_chunk(transform: dict[str, float]) -> None:
    """11 rows in chunks of 4 over a 70-token vocabulary, fp32, an incoming gradient of 3: the
    Triton kernels' loss and gradients within 1e-6 of the unfused ops' (the logits' scale set so
    the cap bends them); the kernels apply the transform as they load the logits, so no ATen op
    rewrites them (tanh_, mul_)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, 16, generator=generator) * 2, torch.randn(70, 16, generator=generator)
    bias, labels = torch.randn(70, generator=generator), torch.randint(0, 70, (11,), generator=generator)
    labels[2] = -100
    results = []
    for op, kwargs in ((linear_cross_entropy, {"chunk_rows": 4}), (linear_cross_entropy_reference, {})):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        with Ops() as ops:
            loss = op(leaves[0], leaves[1], labels, -100, leaves[2], **kwargs, **transform)
        (3.0 * loss).backward()
        if op is linear_cross_entropy:
            assert "LinearCrossEntropy" in loss.grad_fn.name()
            assert not ops.names & {"tanh_.default", "mul_.Tensor", "mul_.Scalar"}, ops.names
        results.append([loss.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(["loss", "d_x", "d_W", "d_b"], *results):
        assert rel_err(got, want) < 1e-6, name


@needs_interpreter
@pytest.mark.parametrize("family", ["phi3", "gemma2", "stablelm"])
def test_interpreted_fused_program_matches_the_unfused_one(family: str) -> None:
    """fp32, the fused kernels in Triton under the interpreter: loss and gradients of the fused
    program within 1e-5 of the unfused one's."""
    unfused, fused = _programs(family, torch.float32)
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused), _loss_and_grads(unfused)
    assert rel_err(loss, ref_loss) < 1e-5
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) < 1e-5, name


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_a_training_step_with_kernels_matches_one_without(family: str) -> None:
    """`autoparallel` on one process, float64 (the reference dispatch on the CPU), two SGD steps
    with kernels on and off: the same losses (to the fp32 rounding of transformers' loss) and the
    same parameters after them."""
    import functools

    import mplan

    ids, labels = _batch()
    results = []
    for kernels in (True, False):
        model = _build(family).model
        pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=2, plan="dp=1", kernels=kernels,
                                cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1),
                                optimizer=functools.partial(torch.optim.SGD, lr=0.1), progress="quiet")
        losses = [float(pm.train_step(ids, labels)) for _ in range(2)]
        report = pm.program.meta.get("fuse_kernels")
        results.append((losses, pm.full_state_dict(), report.counts if report is not None else {}))
    (losses, params, fired), (ref_losses, ref_params, unfused) = results
    assert fired["linear_cross_entropy"] == 1 and unfused == {}  # Gemma-2's soft-capped head + loss too
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, value in ref_params.items():
        assert (params[name] - value).norm() <= 1e-6 * value.norm(), name
