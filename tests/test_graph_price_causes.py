"""Two causes of the H100 race's overpriced Gemma and Qwen3-MoE steps (issue 30/35,
`python -m benchmarks.reprice races`): a kernel table read with its timer's glitches, and attention written out
as ATen ops priced op by op though it runs as one SDPA call."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import GroupShape
from mplan.cost_models.compute_cost import ComputeCostModel, containment_envelope
from mplan.cost_models.profile import ClusterProfile, DeviceProfile, GemmTiming
from mplan.planner.fused_pricing import find_fused_chains, find_fused_saves
from mplan.planner.op_cost import OpCoster
from mplan.planner.op_registry import replicated
from mplan.planner.planning import capture_for_planning

H100_PROFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "profile_h100-2026-12-05.json"


def test_a_time_above_a_containing_shapes_is_lowered_to_it() -> None:
    timed = [((1, 1), 5.0), ((1, 2), 2.0), ((2, 1), 3.0), ((2, 2), 4.0)]
    # (1, 1) is contained in all three others: their least time; the rest contain no faster shape
    assert containment_envelope(timed) == [((1, 1), 2.0), ((1, 2), 2.0), ((2, 1), 3.0), ((2, 2), 4.0)]


def test_a_gemm_is_never_priced_slower_than_a_measured_gemm_containing_it() -> None:
    dims = (1024, 2048, 4096)
    rate = 500e12
    gemm = [GemmTiming(m=m, n=n, k=k, dtype="bf16", seconds=2 * m * n * k / rate) for m in dims for n in dims
            for k in dims]
    glitch = gemm.index(next(g for g in gemm if (g.m, g.n, g.k) == (2048, 1024, 2048)))
    gemm[glitch] = GemmTiming(m=2048, n=1024, k=2048, dtype="bf16", seconds=10 * gemm[glitch].seconds)
    device = DeviceProfile(name="synthetic", torch_version="2.13", measured_on="2026-12-06", gemm=tuple(gemm))
    model = ComputeCostModel(ClusterSpec.preset("dgx-h100", measured=False).with_profile(ClusterProfile(device=device)))
    containing = 2 * 2048 * 1024 * 4096 / rate  # k = 4096 contains it
    assert model.matmul_time(2048, 1024, 2048, "bf16") == pytest.approx(containing)
    assert model.matmul_time(4096, 4096, 4096, "bf16") == pytest.approx(2 * 4096 ** 3 / rate)  # untouched


def test_the_h100_profile_prices_gemma3s_key_projection_at_most_as_its_measured_k_2048_neighbour() -> None:
    """[4096, 1152] @ [1152, 256]: the H100 table timed k = 1024 at 409 us and k = 2048 at 38 us;
    read as measured, the projection cost 273 us (9 TFLOP/s)."""
    cluster = ClusterSpec.from_json(str(H100_PROFILE))
    rows = json.loads(H100_PROFILE.read_text())["profile"]["device"]["gemm"]
    neighbour = next(r["seconds"] for r in rows if (r["m"], r["n"], r["k"]) == (4096, 256, 2048))
    assert ComputeCostModel(cluster).matmul_time(4096, 256, 1152, "bf16") <= neighbour


def _tiny_gemma2() -> object:
    import transformers

    config = transformers.Gemma2Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=128,
                                       attn_logit_softcapping=None, final_logit_softcapping=None,
                                       max_position_embeddings=64, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    return capture_for_planning(model, example_inputs=(torch.zeros(2, 32, dtype=torch.long),))


def test_eager_attention_is_priced_as_the_one_sdpa_call_it_becomes() -> None:
    graph = _tiny_gemma2()
    saves = find_fused_saves(graph)
    cluster = ClusterSpec.from_json(str(H100_PROFILE))
    group = GroupShape(size=1, ranks_per_node=1)
    fused = OpCoster(cluster, 1, group, fused=find_fused_chains(graph), saves=saves)
    plain = OpCoster(cluster, 1, group)
    chain = [graph.node(name) for name, s in saves.items() if s.kernel == "attention" and name in graph]
    (anchor,) = [n for n in chain if not saves[n.name].inside]
    assert anchor.kind == "matmul"  # probabilities @ v: transformers' eager attention
    assert {n.kind for n in chain if saves[n.name].inside} >= {"matmul", "elementwise"}  # q @ k^T, softmax...
    probs, v = (m.shape for m in anchor.input_metas)
    args = (*probs, v[-1], anchor.output.dtype, True)  # the mask is proven causal
    priced = fused.op(anchor, replicated(anchor))
    assert priced.forward_s == pytest.approx(fused.compute.attention_time(*args, backward=False))
    assert priced.backward_s == pytest.approx(fused.compute.attention_time(*args, backward=True))
    assert all(fused.op(n, replicated(n)).forward_s == 0.0 for n in chain if n is not anchor)
    op_by_op = sum(plain.op(n, replicated(n)).forward_s for n in chain)
    assert priced.forward_s < op_by_op
