"""Planning a Hugging Face config costs what planning the preset of its shape costs (issue 30).

The cause found: proving a Hugging Face model's attention mask causal (so that attention is fused
and priced as `is_causal=True`) evaluated the [batch, 1, seq, seq] mask at the program's own
length on the CPU: 17 s of CPU at 32k tokens, a 2 x 128k x 128k mask out of reach. These tests
hold what stays fixed without timing anything (a loaded machine stretches wall time): planning
a config creates no real tensor of seq x seq entries, and the short evaluation decides every mask
as the full-length one does, sliding windows included.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mplan
from mplan.ir.causal_mask import SHORT_SEQ, evaluate_constant, is_causal_mask
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner

pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=8192, torch_dtype="bfloat16")


class LargestRealTensor(TorchDispatchMode):
    """The most entries of any tensor an ATen op makes off the meta device (meta tensors hold no
    memory and cost no arithmetic)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self.numel = max(self.numel, value.numel())
        return out


def _config(tmp_path: Path, name: str, **fields: Any) -> str:
    architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
    folder = tmp_path / f"{name}-{fields.get('sliding_window')}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": name,
                                                    **TINY, **fields}))
    return str(folder)


def _mask(graph: mplan.ir.Graph) -> tuple[Any, Any, Any]:
    """(attn_mask, q, k) of the first SDPA call of the captured program."""
    sdpa = next(n for n in graph.program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")
    assert mask is not None, "transformers passed no mask: nothing here is tested"
    return mask, sdpa.args[0], sdpa.args[1]


def test_planning_a_config_makes_no_seq_by_seq_tensor(tmp_path: Path) -> None:
    seq = 4096
    graph = capture_for_planning(_config(tmp_path, "qwen3"), seq_len=seq)
    largest = LargestRealTensor()
    with largest:
        planner = Planner(graph, mplan.ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    # before the fix: the 2 x 4096 x 4096 mask itself; now a mask of SHORT_SEQ
    assert largest.numel <= 2 * SHORT_SEQ * SHORT_SEQ < seq * seq
    assert planner.saves, "nothing fused: the mask decision was not exercised"
    mask, q, k = _mask(graph)
    assert is_causal_mask(mask, q, k), "the causal mask was not proven causal"


@pytest.mark.parametrize("name, window, causal", [
    ("llama", None, True),
    ("mistral", 64, False),     # a window under SHORT_SEQ / 2: shows at the short length
    ("mistral", 300, False),    # a window too large to scale: evaluated at the program's length
    ("mistral", 1000, True),    # a window longer than the sequence masks nothing more than causal
])
def test_short_evaluation_decides_as_the_full_length_does(tmp_path: Path, name: str, window: int | None,
                                                          causal: bool) -> None:
    seq = 512  # long enough to be evaluated short, short enough to evaluate in full as a reference
    fields = {} if window is None else {"sliding_window": window}
    graph = capture_for_planning(_config(tmp_path, name, **fields), seq_len=seq)
    mask, q, k = _mask(graph)
    full = evaluate_constant(mask)
    assert tuple(full.shape[-2:]) == (seq, seq)
    largest = LargestRealTensor()
    with largest:
        decided = is_causal_mask(mask, q, k)
    assert decided is causal
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    assert bool(torch.equal(full[0, 0], allowed)) is causal
    scaled_window = window is None or window < SHORT_SEQ // 2
    assert (largest.numel <= 2 * SHORT_SEQ * SHORT_SEQ) is scaled_window


def test_a_mask_too_large_to_evaluate_is_not_called_causal(tmp_path: Path) -> None:
    """A window that cannot be scaled, at a length past EXACT_LIMIT: not proven causal, and
    nothing of seq x seq is computed to say so."""
    graph = capture_for_planning(_config(tmp_path, "mistral", sliding_window=300), seq_len=8192)
    mask, q, k = _mask(graph)
    largest = LargestRealTensor()
    with largest:
        assert not is_causal_mask(mask, q, k)
    assert largest.numel < 8192 * 8192


# -- The sharding ILP of a Hugging Face block: followers folded (mplan/planner/ilp_followers.py) --
#
# The second cause: HiGHS on the Qwen3-8B block (86 ops: q/k norms, upcasts, views) took 1-2.5 s
# per solve against 0.2 s for the Llama-family block of its shape, 6 solves a search. Nodes that
# provably follow their producer are folded into it, impossible copies are constraints rather than
# 1e3-second prices, and the objective is scaled to its largest coefficient. The plans must be the
# ones the unfolded problem has: these tests solve both and compare.

MEDIUM = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, torch_dtype="bfloat16")
FAMILIES = {
    "gpt": "gpt:layers=2,hidden=256,heads=8,seq=512,vocab=1024",
    "llama": "llama:layers=2,hidden=256,heads=8,kv_heads=2,ffn=512,seq=512,vocab=1024",
    "moe": "moe:layers=2,hidden=256,heads=8,kv_heads=2,ffn=256,seq=512,vocab=1024,experts=4,topk=2",
}
HF = {
    "llama": ("LlamaForCausalLM", MEDIUM),
    "qwen3": ("Qwen3ForCausalLM", {**MEDIUM, "head_dim": 32}),  # q/k norms
    "gpt2": ("GPT2LMHeadModel", dict(n_layer=2, n_embd=256, n_head=8, n_positions=1024, vocab_size=1024,
                                     torch_dtype="bfloat16")),
}


def _hf_dir(tmp_path: Path, name: str) -> str:
    architecture, fields = HF[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": name, **fields}))
    return str(folder)


def planner_graph(planner: Planner) -> mplan.ir.Graph:
    return planner.graph


def _unfolded(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplan.planner import sharding_ilp

    monkeypatch.setattr(sharding_ilp, "find_followers", lambda *args: {})


@pytest.mark.parametrize("model", [*FAMILIES, *(f"hf-{name}" for name in HF)])
def test_folding_followers_changes_no_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """Every segment at TP 2 and 4, with and without sequence parallelism, as the search solves it:
    the same strategy for every op and the same objective (1e-6 relative) folded and unfolded."""
    spec = FAMILIES.get(model) or _hf_dir(tmp_path, model.removeprefix("hf-"))
    graph = capture_for_planning(spec, seq_len=512)
    cluster = mplan.ClusterSpec.preset("dgx-h100", nodes=1)
    keys = [(tp, sp) for tp in (2, 4) for sp in (False, True)]
    folded = Planner(graph, cluster, kernels=True)
    solved = {key: folded.sharded(*key).sharding for key in keys}
    with monkeypatch.context() as patch:
        _unfolded(patch)
        unfolded = Planner(graph, cluster, kernels=True)
        reference = {key: unfolded.sharded(*key).sharding for key in keys}
    fewer = 0
    for key in keys:
        for name, want in reference[key].segments.items():
            got = solved[key].segments[name]
            assert got.objective_s == pytest.approx(want.objective_s, rel=1e-6), (key, name)
            differ = {op for op in want.choice if want.choice[op] != got.choice[op]}
            # the unfolded problem has exact ties (a gather before a view or after it, a fused norm's
            # zero-priced members run gathered or sharded), which HiGHS broke either way; folded,
            # a follower takes its producer's layout. Anything priced, or holding a parameter, is equal.
            priced = {op for op in differ if planner_graph(folded).node(op).params or
                      want.op_prices[op].compute_s or got.op_prices[op].compute_s or
                      want.op_prices[op].comm_s or got.op_prices[op].comm_s}
            assert not priced, (key, name, {op: (str(want.choice[op]), str(got.choice[op])) for op in priced})
            assert got.num_variables <= want.num_variables
            fewer += want.num_variables - got.num_variables
    assert fewer > 0, "nothing was folded: the comparison tested nothing"


def test_a_qwen3_block_folds_its_followers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3 block (q/k norms, upcasts, views, RoPE, GQA expansion) at TP 4: a sixth fewer
    ILP variables folded (here 1686 -> 1396)."""
    from mplan.planner.sharding_ilp import solve_block_sharding
    from mplan.ir.placement import R

    graph = capture_for_planning(_hf_dir(tmp_path, "qwen3"), seq_len=512)
    planner = Planner(graph, mplan.ClusterSpec.preset("dgx-h100", nodes=1), kernels=True)
    coster = planner.sharded(4, False).coster
    block = max(planner.graph.block_types, key=lambda b: b.num_instances)
    assert block.name == "Qwen3DecoderLayer"
    folded = solve_block_sharding(planner.graph, block, coster, R)
    _unfolded(monkeypatch)
    unfolded = solve_block_sharding(planner.graph, block, coster, R)
    assert folded.objective_s == pytest.approx(unfolded.objective_s, rel=1e-6)
    assert folded.num_variables <= 0.85 * unfolded.num_variables, (folded.num_variables, unfolded.num_variables)
