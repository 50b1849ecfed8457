"""Under TP with kernels=True, the output head and the vocabulary-parallel loss run as ONE chunked op.

`fuse_kernels` turns the TP program's column-parallel head and its loss,

    x_rep, W_local -> aten.linear -> view [rows, V/tp] [-> .to(float32)] -> VocabParallelCrossEntropy(mean)

into one `VocabParallelHeadLoss(x_rep, W_local, target)` call (`vocab_parallel_linear_cross_entropy`,
reported as `vocab_parallel_linear_cross_entropy: 1`), whose logits exist one chunk of rows at a
time: no [rows, V/tp] tensor is ever made. x's gradient out of it is this rank's partial addend,
as the local linear's was; the `Redistribute` in front of the head (x replicated, gradient P)
sums it over the TP group in backward: an all-reduce (P -> R), or under sequence parallelism the
reduce-scatter back to sequence shards (P -> S(1)).

Each check trains 3 AdamW steps (global-norm clipping active) on 2 gloo ranks in float64 and
compares every step's loss and every final parameter with one process: relative error under 1e-10.
Hugging Face's loss upcasts the logits to float32: its losses match to 1e-6, its parameters to
1e-3 (AdamW divides each gradient entry by its own magnitude, so fp32 rounding of entries near 0
moves parameters by up to 1e-4, the unfused TP program's as much); they are bit for bit those of
the same program with the head left unfused (its losses to an fp32 rounding). The models have
V/tp = 48 columns, unlike any other dim (hidden 32, 64 rows a step), so a tensor of the local
logits' shape is recognizable; the head op runs in chunks of 16 rows, as the Plan's
`head_loss_chunk_rows` says, whose [16, 48] logits the shape hook sees inside it. All checks
share one gloo group (tests/distributed.py).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distributed import rel_err, run_checks
from test_equivalence import MAX_NORM, OPTIMIZER, batches, errors, single_device

pytestmark = pytest.mark.distributed

STEPS = 3
TOL = 1e-10
HF_LOSS_TOL, HF_PARAM_TOL = 1e-6, 1e-3  # HF's loss is computed on float32 logits (module docstring)
VOCAB, HIDDEN, BATCH, SEQ = 96, 32, 4, 16
LOCAL_LOGITS = (BATCH * SEQ, VOCAB // 2)  # [rows, V/tp] at tp=2
CHUNK_ROWS = 16
LLAMA = f"llama:layers=2,hidden={HIDDEN},heads=4,kv_heads=2,ffn=64,seq={SEQ},vocab={VOCAB}"


def llama() -> nn.Module:
    from mplan.models import build_model
    from mplan.verify import perturbed

    return perturbed(build_model(LLAMA, device="cpu", dtype=torch.float64, seed=0))


def hf_llama() -> nn.Module:
    """transformers' LlamaForCausalLM in float64 with float64 RMSNorms (as test_equivalence's
    faithful model) but its own loss, which upcasts the logits to float32: the head's chain then
    has the cast, and the fused op computes that fp32 loss (`upcast=True`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mplan.verify import perturbed
    from test_equivalence import _rms_norm_float64

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float64)
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = functools.partial(_rms_norm_float64, module)
    return perturbed(model)


class BiasedHead(nn.Module):
    """A model of the user's own whose output head has a bias: the fused op takes its local slice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(torch.tanh(self.fc(self.embed(ids))))
        return logits if labels is None else nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def biased_head() -> nn.Module:
    from mplan.verify import perturbed

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return perturbed(BiasedHead())


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.shapes.extend(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _parallel(make: Callable[[], nn.Module], plan: Any, data: list) -> Any:
    import mplan

    return mplan.autoparallel(make(), example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=BATCH,
                              plan=plan, max_grad_norm=MAX_NORM, kernels=True)


def train_fused(make: Callable[[], nn.Module], plan: str, *, keep_state: bool = False) -> dict[str, Any]:
    """`make()` trained under `plan` with kernels=True, the Plan's `head_loss_chunk_rows` set to
    CHUNK_ROWS (the plan a spec resolves to, with that field changed), every op's output shape
    recorded; what the program and the run show, and the errors against one process
    (`keep_state`: also the losses and the final parameters)."""
    import dataclasses

    from mplan.passes.insert_collectives import Redistribute
    from mplan.passes.local_ops import VocabParallelHeadLoss

    data = batches(BATCH, steps=STEPS, vocab=VOCAB, seq=SEQ)
    resolved = _parallel(make, plan, data).plan
    pm = _parallel(make, dataclasses.replace(resolved, head_loss_chunk_rows=CHUNK_ROWS), data)
    program = pm.program
    heads = [n for n in program.graph.nodes if n.op == "call_module"
             and isinstance(program.get_submodule(n.target), VocabParallelHeadLoss)]
    assert len(heads) == 1, program.graph
    head = program.get_submodule(heads[0].target)
    assert head.chunk_rows == CHUNK_ROWS and resolved.head_loss_chunk_rows is None
    before_x = heads[0].args[0]  # what x comes through: the Redistribute that reduces its gradient
    reshard = program.get_submodule(before_x.target) if before_x.op == "call_module" else None
    linears = [tuple(n.meta["val"].shape) for n in program.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    losses, norms = [], []
    with _Shapes() as seen:
        for ids, labels in data:
            losses.append(pm.train_step(ids, labels))
            norms.append(pm.last_grad_norm)
    return {**errors(pm, losses, norms, single_device(make, data)),
            "fused": dict(pm.program.meta["fuse_kernels"].counts),
            "upcast": head.upcast,
            "x_gradient": (None if not isinstance(reshard, Redistribute)
                           else (str(reshard.grad_src), str(reshard.grad_dst))),
            "head_linears": [shape for shape in linears if shape[-1] == LOCAL_LOGITS[1]],
            "local_logits_made": sum(s[-1:] == LOCAL_LOGITS[1:] and s[:-1] in ((BATCH * SEQ,), (BATCH, SEQ))
                                     for s in seen.shapes),
            "chunk_logits_made": sum(s == (CHUNK_ROWS, LOCAL_LOGITS[1]) for s in seen.shapes),
            "bias": len(heads[0].args) == 4, **({"state": (losses, pm.full_state_dict())} if keep_state else {})}


def unfused_head(make: Callable[[], nn.Module], plan: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run with the head left an aten.linear before the vocabulary-parallel loss kernel
    (`fused`): its losses and final parameters."""
    from unittest import mock

    import mplan.passes.fuse_kernels

    data = batches(BATCH, steps=STEPS, vocab=VOCAB, seq=SEQ)
    with mock.patch.object(mplan.passes.fuse_kernels, "_vocab_parallel_head", return_value=None):
        pm = _parallel(make, plan, data)
    assert pm.program.meta["fuse_kernels"].counts["vocab_parallel_cross_entropy"] == 1
    return [pm.train_step(ids, labels) for ids, labels in data], pm.full_state_dict()


# -- checks (each runs on both ranks) ---------------------------------------------------------------
def llama_tp2_sp() -> dict[str, Any]:
    return train_fused(llama, "tp=2,sp=1")


def llama_tp2() -> dict[str, Any]:
    return train_fused(llama, "tp=2")


def hf_llama_tp2_sp() -> dict[str, Any]:
    fused = train_fused(hf_llama, "tp=2,sp=1", keep_state=True)
    (fused_losses, fused_state), (losses, state) = fused.pop("state"), unfused_head(hf_llama, "tp=2,sp=1")
    return {**fused, "vs_unfused_head": (max(abs(a - b) / abs(b) for a, b in zip(fused_losses, losses)),
                                         max(rel_err(fused_state[name], value) for name, value in state.items()))}


def biased_head_tp2() -> dict[str, Any]:
    return train_fused(biased_head, "tp=2")


CHECKS = [llama_tp2_sp, llama_tp2, hf_llama_tp2_sp, biased_head_tp2]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(2, CHECKS, timeout_s=120)


@pytest.mark.parametrize("check,x_gradient,upcast,bias,tol", [pytest.param(*case, id=case[0].__name__) for case in [
    # SP: x is all-gathered from sequence shards; its summed gradient is reduce-scattered back
    (llama_tp2_sp, ("P", "S(1)"), False, False, (TOL, TOL)),
    # no SP: x is replicated; its gradient is all-reduced
    (llama_tp2, ("P", "R"), False, False, (TOL, TOL)),
    # HF's head: linear -> .to(float32) -> view; the fused op computes the fp32 loss
    (hf_llama_tp2_sp, ("P", "S(1)"), True, False, (HF_LOSS_TOL, HF_PARAM_TOL)),
    # a biased head (its x comes from a column-parallel linear, gathered along the hidden dim)
    (biased_head_tp2, ("P", "S(2)"), False, True, (TOL, TOL)),
]])
def test_head_and_loss_run_as_one_chunked_op(outcomes, check, x_gradient, upcast, bias, tol) -> None:
    loss_tol, param_tol = tol
    for rank, result in enumerate(outcomes.assert_passed(check)):
        assert result["fused"].get("vocab_parallel_linear_cross_entropy") == 1, result["fused"]
        assert "vocab_parallel_cross_entropy" not in result["fused"], result["fused"]
        assert result["upcast"] is upcast and result["bias"] is bias
        # the partial gradient of x out of the fused op is summed by the reshard in front of it
        assert result["x_gradient"] == x_gradient, result
        # no linear makes V/tp columns, no op makes the local logits; the op's chunks are seen
        assert result["head_linears"] == [] and result["local_logits_made"] == 0, result
        assert result["chunk_logits_made"] >= STEPS * (BATCH * SEQ // CHUNK_ROWS), result
        assert result["loss"] < loss_tol and result["param"] < param_tol, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"


def test_hugging_face_head_trains_as_the_unfused_one(outcomes) -> None:
    """Parameters to float64's rounding (a few ulp: the fused and the unfused head reach their
    weight gradient through different BLAS calls, which some CPUs' libraries round alike and others,
    as this machine's since 2026-12-06, 2.6e-16 apart); losses to an fp32 rounding (the chunks'
    partial sums add in another order)."""
    for result in outcomes.assert_passed(hf_llama_tp2_sp):
        loss, param = result["vs_unfused_head"]
        assert loss < HF_LOSS_TOL and param < 4 * torch.finfo(torch.float64).eps, result["vs_unfused_head"]
