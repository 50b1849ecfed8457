"""GELU's tanh approximation written out, as Hugging Face's `gelu_new` (NewGELUActivation) writes it:

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3)))

eight elementwise ops, each a pass over the MLP's [tokens, 4h] activation forward and more
backward (GPT-2, GPT-J, Phi-1/2, CodeGen), found unfused in a survey of 25 Hugging Face families.
After a biased linear it runs as `bias_gelu` (GPT-J's and Phi's nn.Linear); after anything else
(GPT-2's Conv1D, whose bias is inside addmm) as ATen's one `gelu(approximate="tanh")`
(`gelu_tanh`). A formula that is not GELU's (another constant, as FastGELU's truncated
0.7978845608) or whose steps are read elsewhere stays ops. Fused and unfused programs agree
forward and backward (float64; the loss transformers computes in fp32).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from distributed import rel_err
from hf_loss import HFLoss
from test_fusion_hf import _batch, _loss_and_grads  # 2 x 12 ids and labels of vocabulary 64, three ignored
from torch import nn

from mplan.kernels import bias_gelu
from mplan.passes.fuse_kernels import fuse_kernels

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


class MLP(nn.Module):
    """fc_in, GELU written out with `constant` for sqrt(2/pi), fc_out; `leak`: the formula's
    inner sum is also returned (a step read outside the chain)."""

    def __init__(self, *, bias: bool = True, constant: float = math.sqrt(2.0 / math.pi), leak: bool = False) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(16, 64, bias=bias), nn.Linear(64, 16)
        self.constant, self.leak = constant, leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc_in(x)
        inner = y + 0.044715 * torch.pow(y, 3.0)
        out = self.fc_out(0.5 * y * (1.0 + torch.tanh(self.constant * inner)))
        return out + inner.sum() if self.leak else out


def _fused_against_unfused(module: nn.Module) -> torch.fx.GraphModule:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=generator, dtype=torch.float64)
    upstream = torch.randn(2, 8, 16, generator=generator, dtype=torch.float64)
    unfused = torch.export.export(module.to(torch.float64), (x,), strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    results = []
    for gm in (fused, unfused):
        leaf = x.clone().requires_grad_()
        out = gm(leaf)
        out.backward(upstream)
        results.append((out.detach(), [leaf.grad, *(p.grad for p in gm.parameters())]))
    (out, grads), (ref, ref_grads) = results
    assert rel_err(out, ref) <= 1e-14
    assert all(rel_err(g, r) <= 1e-13 for g, r in zip(grads, ref_grads))
    return fused


@pytest.mark.parametrize(("bias", "kernel"), [(True, "bias_gelu"), (False, "gelu_tanh")])
def test_the_written_out_gelu_fuses_with_its_bias_or_alone_and_computes_what_it_did(bias: bool, kernel: str) -> None:
    torch.manual_seed(0)
    fused = _fused_against_unfused(MLP(bias=bias))
    assert fused.meta["fuse_kernels"].counts == {kernel: 1}
    targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert aten.tanh.default not in targets and aten.pow.Tensor_Scalar not in targets
    assert (bias_gelu in targets) == bias and (aten.gelu.default in targets) != bias


@pytest.mark.parametrize("module", [MLP(constant=0.7978845608), MLP(leak=True)], ids=["fast_gelu_constant", "leak"])
def test_a_formula_that_is_not_gelus_or_is_read_elsewhere_stays_ops(module: nn.Module) -> None:
    fused = _fused_against_unfused(module)
    assert fused.meta["fuse_kernels"].counts == {}
    assert aten.tanh.default in {n.target for n in fused.graph.nodes}


FAMILIES = {  # config, model, what the MLP's GELU becomes
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             transformers.GPT2LMHeadModel, {"gelu_tanh": 2}),
    "gptj": (lambda: transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                             rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             transformers.GPTJForCausalLM, {"bias_gelu": 2}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hugging_face_gelu_new_fuses_and_trains_like_its_unfused_program(family: str) -> None:
    make_config, model_class, expected = FAMILIES[family]
    torch.manual_seed(0)
    model = HFLoss(model_class(make_config()).to(torch.float64))
    ids, labels = _batch()
    unfused = torch.export.export(model, (ids, labels), strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    counts = fused.meta["fuse_kernels"].counts
    assert {k: v for k, v in counts.items() if k in ("gelu_tanh", "bias_gelu")} == expected
    assert aten.tanh.default not in {n.target for n in fused.graph.nodes}
    (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(fused, ids, labels), _loss_and_grads(unfused, ids, labels)
    assert rel_err(loss, ref_loss) <= 1e-6  # transformers' loss is fp32
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= 1e-6, name
