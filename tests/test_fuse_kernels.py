"""`fuse_kernels` on exported GPT and Llama graphs (reference dispatch, fp32, CPU), and the
chains it must leave alone. The same comparison under Triton's interpreter is in
tests/test_kernels_interpret.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mplan.fusion import FUSIONS, MATCHED
from mplan.kernels.dispatch import INTERPRET
from mplan.models import GPTConfig, GPTModel, LlamaConfig, LlamaModel
from mplan.passes.fuse_kernels import FusionReport, fuse_kernels

pytestmark = pytest.mark.skipif(INTERPRET, reason="compares against the reference dispatch")
aten = torch.ops.aten

GPT = GPTConfig(num_layers=2, hidden=16, num_heads=2, seq_len=8, vocab=32)
LLAMA = LlamaConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, seq_len=8, vocab=32, ffn_hidden=24)
EXPECTED_FIRED = {
    # the first LayerNorm reads embed + pos_embed, a broadcasting add: not a residual; q, k and v
    # become one GEMM in each block
    "gpt": {"linear_group": 2, "layer_norm_residual": 4, "attention": 2, "bias_gelu": 2, "linear_cross_entropy": 1},
    # the first RMSNorm reads the embedding alone; q and k are rotated in both blocks; gate and up
    # become one GEMM feeding the packed SwiGLU
    "llama": {"rms_norm": 1, "linear_group": 2, "rms_norm_residual": 4, "rope_qk": 2, "attention": 2,
              "linear_swiglu": 2, "linear_cross_entropy": 1},
}
UNFUSED_OPS = {aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.gelu.default, aten.silu.default,
               aten.neg.default, aten.cat.default, aten.cross_entropy_loss.default}


def _export(module: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(module, args, kwargs, strict=False).module()


def _model(family: str) -> nn.Module:
    return GPTModel(GPT, device="cpu") if family == "gpt" else LlamaModel(LLAMA, device="cpu")


def _fired(gm: torch.fx.GraphModule) -> dict[str, int]:
    report = gm.meta["fuse_kernels"]
    assert isinstance(report, FusionReport)
    return report.counts


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fused_graph_trains_like_the_unfused_one(family: str) -> None:
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    labels[1, 2] = -100
    unfused = _export(_model(family), ids, labels=labels)
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert _fired(fused) == EXPECTED_FIRED[family]
    # what is left of the chains: only the grouped projections' weight (and bias) concatenations
    cats = [node for node in fused.graph.nodes if node.target is aten.cat.default]
    assert all(arg.op in ("get_attr", "placeholder") for node in cats for arg in node.args[0])
    assert not (UNFUSED_OPS - {aten.cat.default}) & {node.target for node in fused.graph.nodes}
    losses = []
    for gm in (unfused, fused):
        loss = gm(ids, labels=labels)
        loss.backward()
        losses.append(loss)
    # the references are the chains' own ops, so the only rounding that may differ is the
    # bias moved out of fc_in's GEMM
    assert abs(losses[1].item() - losses[0].item()) <= 1e-6 * abs(losses[0].item())
    fused_params = dict(fused.named_parameters())
    for name, param in unfused.named_parameters():
        difference = (fused_params[name].grad - param.grad).norm().item()
        assert difference <= 1e-6 * max(param.grad.norm().item(), 1e-3), name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_attention_runs_as_the_autotuned_op(family: str) -> None:
    """The attention rule's op is SDPA itself off CUDA (on CUDA: its fastest backend), so the
    fused graph computes exactly the unfused one here. RoPE'd q and k feed the fused attention
    op, which still counts as attention for the autocast marks."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    unfused = _export(_model(family), ids, labels=labels)
    fused = fuse_kernels(copy.deepcopy(unfused), device="cuda")
    assert _fired(fused) == EXPECTED_FIRED[family]
    assert aten.scaled_dot_product_attention.default not in {node.target for node in fused.graph.nodes}
    assert fused.meta["fuse_kernels"].consumer_marks == sum(sum(kinds.values()) for kinds in EXPECTED_MARKS[family])
    # the loss comes from the fused head + loss, summed in chunks of rows: fp32 rounding apart
    assert torch.allclose(fused(ids, labels=labels), unfused(ids, labels=labels), rtol=1e-6, atol=0)


EXPECTED_MARKS = {
    # every norm feeds only linears: the grouped q/k/v, fc_in (its bias split off), the output head
    "gpt": ({"linear": 4}, {}),
    # the norms as GPT's; RoPE'd q and k (one rope_qk a block) feed attention only
    "llama": ({"linear": 5}, {"attention": 2}),
}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_outputs_that_autocast_would_cast_are_marked_and_left_in_the_autocast_dtype(family: str) -> None:
    """Under autocast a norm of an fp32 residual stream is fp32 (and RoPE with fp32 tables), which
    the linear (attention) after it casts to bf16: marked with that consumer, the fused op returns
    bf16 itself. The values are the same: a training step matches the unmarked graph's exactly."""
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    fused = fuse_kernels(_export(_model(family), ids, labels=labels))
    marked = [node for node in fused.graph.nodes if "consumer" in node.kwargs]
    marks: tuple[dict[str, int], dict[str, int]] = ({}, {})
    for node in marked:
        table = marks[1] if node.target.__name__.startswith("rope") else marks[0]
        table[node.kwargs["consumer"]] = table.get(node.kwargs["consumer"], 0) + 1
    assert marks == EXPECTED_MARKS[family]
    assert fused.meta["fuse_kernels"].consumer_marks == len(marked)

    unmarked = copy.deepcopy(fused)
    for node in unmarked.graph.nodes:
        node.kwargs = {key: value for key, value in node.kwargs.items() if key != "consumer"}
    unmarked.recompile()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [gm(ids, labels=labels) for gm in (unmarked, fused)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    marked_params = dict(fused.named_parameters())
    for name, param in unmarked.named_parameters():
        assert torch.equal(marked_params[name].grad, param.grad), name

    dtypes = {}
    interpreter = torch.fx.Interpreter(fused)
    run_node = interpreter.run_node

    def spy(node: torch.fx.Node) -> object:
        value = run_node(node)
        if node in marked:
            dtypes[node.name] = (value[0] if isinstance(value, tuple) else value).dtype
        return value

    interpreter.run_node = spy  # type: ignore[method-assign]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        interpreter.run(ids, labels)
    assert len(dtypes) == len(marked) and set(dtypes.values()) == {torch.bfloat16}


def test_every_inserted_node_carries_its_value_metadata() -> None:
    fused = fuse_kernels(_export(_model("llama"), torch.randint(0, 32, (2, 8))))
    assert "cross_entropy" not in _fired(fused)  # no labels: the graph ends at the logits
    for node in fused.graph.nodes:
        if node.op == "call_function":
            assert node.meta.get("val") is not None, node.format_node()


def test_rules_are_documented_data() -> None:
    names = [e.name for e in FUSIONS]
    assert len(set(names)) == len(names)
    assert names.index("rms_norm_residual") < names.index("rms_norm")  # the longer chain first
    # the planner prices the chains the entries find in this order: the pass tries them so
    assert list(MATCHED) == [e for e in FUSIONS if e.name != "rope_qk"]


class _NormWithLeakedStatistic(nn.Module):
    """An RMSNorm whose rsqrt is also returned: fusing it would compute the statistic twice."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * scale * self.weight, scale


class _Unfusable(nn.Module):
    """Look-alikes the rules must not touch: exact GELU, a label-smoothed loss, a RoPE-like
    rotation that splits at the wrong place, a LayerNorm over two dims, attention with a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm([4, 8])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        rotated = torch.cat([-h[..., 3:], h[..., :3]], dim=-1)  # rotate_half would split at 4
        h = h * cos + rotated * sin
        h = self.norm(h + x)
        h = F.scaled_dot_product_attention(h, h, h, attn_mask=cos[:, :4] > 0)
        return F.cross_entropy(h.reshape(-1, 8), labels, label_smoothing=0.1)


def test_chains_that_do_not_fit_a_rule_are_left_alone() -> None:
    leaked = fuse_kernels(_export(_NormWithLeakedStatistic(), torch.randn(2, 4, 8)))
    assert _fired(leaked) == {}
    unfusable = fuse_kernels(_export(_Unfusable(), torch.randn(2, 4, 8), torch.randn(4, 8), torch.randn(4, 8),
                                     torch.randint(0, 8, (8,))), device="cuda")
    assert _fired(unfusable) == {}
    # nothing fires, and the near miss says why rather than passing silently
    assert str(unfusable.meta["fuse_kernels"]).startswith("fuse_kernels: no rule fired; attention missed x1: a mask")


# ---- FP8 linears (opt-in) ------------------------------------------------------------------------

FP8_GPT = GPTConfig(num_layers=2, hidden=32, num_heads=2, seq_len=8, vocab=64)
FP8_LLAMA = LlamaConfig(num_layers=2, hidden=32, num_heads=2, num_kv_heads=1, seq_len=8, vocab=64, ffn_hidden=48)
FP8_LINEARS_PER_BLOCK = {"gpt": 4, "llama": 4}  # qkv (grouped), out, fc_in, fc_out / qkv, out, gate+up, down


def _fp8_graph(family: str, monkeypatch: pytest.MonkeyPatch,
               ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.Tensor, torch.Tensor]:
    """(unfused, fused with fp8=True) exports of a model whose GEMM dimensions are multiples of
    16; FP8 arithmetic through torch._scaled_mm on the CPU (the device check lifted)."""
    import mplan.passes.fuse_kernels as pass_module

    monkeypatch.setattr(pass_module, "fp8_unavailable_reason", lambda *_: None)
    torch.manual_seed(0)
    model = GPTModel(FP8_GPT, device="cpu") if family == "gpt" else LlamaModel(FP8_LLAMA, device="cpu")
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    unfused = _export(model, ids, labels=labels)
    fused = fuse_kernels(copy.deepcopy(unfused), fp8=True)
    return unfused, fused, ids, labels


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fp8_sweep_swaps_every_block_linear_but_the_output_head(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fused, _, _ = _fp8_graph(family, monkeypatch)
    assert _fired(fused)["fp8_linear"] == 2 * FP8_LINEARS_PER_BLOCK[family]
    # the head stays in the training dtype: inside the fused head + loss, no aten.linear left
    assert not [node for node in fused.graph.nodes if node.target is aten.linear.default]
    assert [node.target.__name__ for node in fused.graph.nodes if node.op == "call_function"
            and getattr(node.target, "__name__", "") == "linear_cross_entropy"] == ["linear_cross_entropy"]
    states = {id(node.target.state) for node in fused.graph.nodes if type(node.target).__name__ == "Fp8Linear"}
    assert len(states) == 2 * FP8_LINEARS_PER_BLOCK[family]  # one scaling state per linear


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fp8_graph_trains_close_to_fp32(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 arithmetic through torch._scaled_mm on the CPU (the device check lifted): three AdamW
    steps stay within FP8's rounding of the fp32 run, and every parameter gets a gradient."""
    import mplan.kernels.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_unavailable_reason", lambda *_: None)
    unfused, fused, ids, labels = _fp8_graph(family, monkeypatch)
    losses = {}
    for name, gm in (("fp32", unfused), ("fp8", fused)):
        optimizer = torch.optim.AdamW(gm.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = gm(ids, labels=labels)
            loss.backward()
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gm.parameters())
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["fp8"][-1] < losses["fp8"][0]
    assert max(abs(a - b) / b for a, b in zip(losses["fp8"], losses["fp32"])) < 0.03, losses


def test_fp8_is_refused_where_it_cannot_run_and_the_graph_is_left_as_it_was() -> None:
    from mplan.kernels.fp8 import Fp8Unavailable

    torch.manual_seed(0)
    unfused = _export(GPTModel(FP8_GPT, device="cpu"), torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    code = unfused.code
    with pytest.raises(Fp8Unavailable, match=r"fp8=True\): FP8 linear needs a CUDA device .*, not cpu"):
        fuse_kernels(unfused, device="cpu", fp8=True)
    assert unfused.code == code
