"""MoE layers are found however the model writes them, and their experts become one exact op.

`moe_experts` (mplan.kernels.moe) against a token-by-token loop for every weight layout,
activation, top-k and capacity; capture turning Hugging Face's experts (the eager loop over
`nonzero()`, `torch._grouped_mm`) and mplan's into one node per layer, the router, shared
expert and auxiliary loss found around it; `mplan inspect` on a Mixtral config; what capture
declines to recognize. Families whose routers go beyond Mixtral's (DeepSeek-V3's sigmoid scores,
selection bias, group-limited top-k and scaling; Ernie-4.5's clamped renormalization; GraniteMoE's
top-k before softmax) keep one op per layer and train exactly as written; experts the op cannot
express (gpt-oss, Llama-4) stay plain ops, named with why.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from mplan.ir.moe import experts_nodes, moe_layers
from mplan.ir.trace import capture_for_training
from mplan.kernels.moe import ACTIVATIONS, MOE_EXPERTS_OP, MoEConfigError, moe_experts, moe_experts_reference

F64 = torch.float64


def naive(x, index, gate, w_in, w_out, w_up, activation, gated, capacity_factor):
    """Token by token, choice-major, first come first served until an expert is full."""
    tokens, k = index.shape
    experts = w_in.shape[0]
    capacity = tokens if capacity_factor is None else min(tokens, math.ceil(capacity_factor * k * tokens / experts))
    act, load, out = ACTIVATIONS[activation], [0] * experts, torch.zeros_like(x)
    for j in range(k):
        for t in range(tokens):
            e = int(index[t, j])
            if load[e] >= capacity:
                continue
            load[e] += 1
            h = x[t] @ w_in[e].t()
            if w_up is not None:
                h = act(h) * (x[t] @ w_up[e].t())
            elif gated:
                a, b = h.chunk(2)
                h = act(a) * b
            else:
                h = act(h)
            out[t] = out[t] + gate[t, j] * (h @ w_out[e].t())
    return out


LAYOUTS = {"separate": (True, True), "stacked": (True, False), "plain": (False, False)}  # gated, separate up


def _inputs(layout: str, top_k: int, experts: int = 4, tokens: int = 12, skew: bool = False, seed: int = 0):
    gated, separate = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    hidden, ffn = 6, 5
    x = torch.randn(tokens, hidden, generator=g, dtype=F64)
    logits = torch.randn(tokens, experts, generator=g, dtype=F64) + (torch.tensor([4.0] + [0.0] * (experts - 1),
                                                                                  dtype=F64) if skew else 0)
    gate, index = logits.softmax(-1).topk(top_k, -1)
    w_in = torch.randn(experts, (2 if gated and not separate else 1) * ffn, hidden, generator=g, dtype=F64)
    w_out = torch.randn(experts, hidden, ffn, generator=g, dtype=F64)
    w_up = torch.randn(experts, ffn, hidden, generator=g, dtype=F64) if separate else None
    return x, index, gate, w_in, w_out, w_up, gated


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize(("top_k", "capacity_factor", "skew"), [(1, None, False), (2, None, True), (2, 0.5, False),
                                                               (2, 1.0, True)])
def test_moe_experts_matches_a_token_loop(layout, activation, top_k, capacity_factor, skew) -> None:
    x, index, gate, w_in, w_out, w_up, gated = _inputs(layout, top_k, skew=skew)
    got = moe_experts(x, index, gate, w_in, w_out, w_up, activation=activation, gated=gated,
                      capacity_factor=capacity_factor)
    want = naive(x, index, gate, w_in, w_out, w_up, activation, gated, capacity_factor)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_op_and_its_backward_equal_the_reference() -> None:
    x, index, gate, w_in, w_out, w_up, gated = _inputs("separate", 2, skew=True)
    leaves = [t.clone().requires_grad_() for t in (x, gate, w_in, w_out, w_up)]
    op = MOE_EXPERTS_OP(leaves[0], index, leaves[1], leaves[2], leaves[3], leaves[4], "gelu", True, 1.0)
    grads = torch.autograd.grad(op, leaves, torch.ones_like(op))
    ref_leaves = [t.clone().requires_grad_() for t in (x, gate, w_in, w_out, w_up)]
    ref = moe_experts_reference(ref_leaves[0], index, ref_leaves[1], ref_leaves[2], ref_leaves[3], ref_leaves[4],
                                activation="gelu", capacity_factor=1.0)
    ref_grads = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    assert torch.equal(op, ref)
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-13) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "activation": "swish"}, "activation 'swish' is not one of"),
    (lambda a: {**a, "capacity_factor": 0.0}, "capacity_factor must be > 0"),
    (lambda a: {**a, "w_out": a["w_out"][:, :, :-1]}, "expert weights do not fit hidden"),
    (lambda a: {**a, "gate": a["gate"][:, :1]}, r"expected x \[T, h\], index and gate \[T, k\]"),
])
def test_arguments_that_describe_no_experts_layer_are_refused(change, match) -> None:
    x, index, gate, w_in, w_out, w_up, gated = _inputs("separate", 2)
    args = dict(x=x, index=index, gate=gate, w_in=w_in, w_out=w_out, w_up=w_up, activation="silu",
                capacity_factor=None)
    with pytest.raises(MoEConfigError, match=match):
        moe_experts(**change(args))


# -- capture ------------------------------------------------------------------------------------
def _hf(kind: str, implementation: str = "eager", **extra):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, use_cache=False, **extra)
    if kind == "mixtral":
        config = MixtralConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        model = MixtralForCausalLM
    else:
        config = Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2)
        model = Qwen2MoeForCausalLM
    config._experts_implementation = implementation
    torch.manual_seed(0)
    return model(config).to(F64)


def _mplan(spec: str):
    from mplan.models import build_model

    return build_model(f"moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,{spec}", device="cpu",
                       dtype=F64, seed=0)


IDS = torch.zeros(2, 16, dtype=torch.long)


@pytest.mark.parametrize(("make", "scoring", "normalized", "shared", "aux"), [
    (lambda: _hf("mixtral", output_router_logits=True), "softmax, then top-k", True, 0, True),
    (lambda: _hf("mixtral", "grouped_mm"), "softmax, then top-k", True, 0, False),
    (lambda: _hf("qwen2_moe", output_router_logits=True), "softmax, then top-k", False, 4, True),
    (lambda: _hf("qwen2_moe", "grouped_mm", norm_topk_prob=True), "softmax, then top-k", True, 4, False),
    (lambda: _mplan("experts=4,topk=2"), "softmax, then top-k", True, 0, True),
    (lambda: _mplan("experts=8,topk=1,shared=40,capacity=1.25"), "softmax, then top-k", True, 3, True),
], ids=["mixtral-eager", "mixtral-grouped_mm", "qwen2_moe-eager", "qwen2_moe-grouped_mm", "mplan", "mplan-shared"])
def test_every_experts_form_captures_as_one_op_per_layer(make, scoring, normalized, shared, aux) -> None:
    model = make()
    graph = capture_for_training(model, (IDS,))
    ops = {n.op for n in graph.nodes}
    assert not ops & {"aten.nonzero.default", "aten._grouped_mm.default"}, ops
    assert any(m.sym is not None for m in graph.graph_inputs.values()), "captured at a fixed batch"
    layers = moe_layers(graph)
    assert len(layers) == 2 and all(m.router is not None for m in layers)
    for m in layers:
        assert (m.scoring, m.normalized, len(m.shared_expert), m.aux_loss) == (scoring, normalized, shared, aux)
        assert m.experts.num_experts in (4, 8) and m.experts.tokens == 32 and m.experts.activation == "silu"
    assert all("forward" not in vars(mod) for mod in model.modules()), "capture left a patched forward behind"


def test_hugging_face_experts_run_the_same_function_as_one_op() -> None:
    """The grouped_mm form in float32 (as transformers runs it by default) and the eager loop in
    float64: the captured program's loss equals the model's own."""
    import mplan

    for implementation, dtype, tol in (("grouped_mm", torch.float32, 1e-5), ("eager", F64, 1e-12)):
        model = _hf("mixtral", implementation, output_router_logits=True).to(dtype)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = float(model(ids, labels=ids).loss)
        pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=torch.optim.SGD, global_batch=2,
                                plan="dp=1")
        got = pm.train_step(ids, ids)
        assert abs(got - want) <= tol * abs(want), (implementation, got, want)


def test_experts_capture_declines_what_the_op_does_not_describe() -> None:
    from mplan.ir.experts_capture import activation_name, experts_call

    experts = _hf("mixtral").model.layers[0].mlp.experts
    assert experts_call(experts) is not None
    for flag in ("has_bias", "is_transposed"):
        setattr(experts, flag, True)
        assert experts_call(experts) is None, flag
        setattr(experts, flag, False)
    experts.act_fn = torch.nn.Mish()  # not an activation the op has
    assert experts_call(experts) is None
    assert activation_name(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"


def test_inspect_shows_the_moe_layers_of_a_mixtral_config(tmp_path, capsys) -> None:
    from transformers import MixtralConfig

    from mplan.cli import main

    MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=32).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path / "config.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(m["num_experts"], m["top_k"], m["ffn"]) for m in doc["moe_layers"]] == [(4, 2, 48)] * 2


def test_a_capacity_factor_no_longer_collides_with_the_symbolic_batch() -> None:
    graph = capture_for_training(_mplan("experts=4,topk=2,capacity=1.25"), (IDS,))
    assert [e.capacity_factor for e in experts_nodes(graph)] == [1.25, 1.25]
    assert any(m.sym is not None for m in graph.graph_inputs.values())


# -- Hugging Face families beyond Mixtral's router ------------------------------------------------
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # model type -> (its MoE keys, the router `mplan inspect` must report)
    "deepseek_v3": (dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                         q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         n_group=2, topk_group=1, first_k_dense_replace=1, num_key_value_heads=4),
                    "sigmoid, then top-k with a selection bias, group-limited, renormalized, scaled by 2.5"),
    "ernie4_5_moe": (dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1),
                     "softmax, then top-k with a selection bias, renormalized"),
    "minimax_m2": (dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
                   "sigmoid, then top-k with a selection bias, renormalized"),
    "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2), "top-k, then softmax"),
}
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8, attn_implementation="eager")


def _family(model_type: str, dtype: torch.dtype = F64, implementation: str = "eager", **extra):
    """A tiny model of `model_type` with every dropout and jitter off and, where the router has one,
    a selection bias that is not zero (so choosing and weighting the experts differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **FAMILIES.get(model_type, ({}, ""))[0], **extra})
    for key in dir(config):
        if ("dropout" in key or "jitter" in key) and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(2), dtype=dtype))
    return model


def _lm_loss(output, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a Hugging Face model output
    """Cross-entropy in the logits' dtype (transformers' own loss casts them to float32, which would
    hide any difference below float32's resolution)."""
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def _train_both(model, steps: int = 2, lr: float = 0.5):  # noqa: ANN001, ANN202 - a Hugging Face model
    """`steps` SGD steps of a copy of `model` as written and through autoparallel at dp=1: the
    losses of both, the parameters of both after the steps (so every gradient), and mplan's module."""
    import copy
    import functools

    import mplan

    plain = copy.deepcopy(model)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pm = mplan.autoparallel(model, example_inputs=(ids,), loss_fn=_lm_loss, global_batch=2, plan="dp=1,tp=1,pp=1",
                            optimizer=functools.partial(torch.optim.SGD, lr=lr), device="cpu", progress="quiet")
    optimizer = torch.optim.SGD(plain.parameters(), lr=lr)
    want, got = [], []
    for _ in range(steps):
        loss = _lm_loss(plain(ids, use_cache=False), ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        want.append(float(loss.detach()))
        got.append(pm.train_step(ids, ids))
    return want, got, dict(plain.named_parameters()), pm


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_sigmoid_biased_grouped_or_scaled_router_keeps_one_op_and_trains_exactly(model_type) -> None:
    """The router stays ATen ops (whatever it computes), the experts one op: the inspect phrase
    names the router's variant, and losses and every parameter after SGD steps (so every
    gradient) equal the model's own in float64."""
    want, got, params, pm = _train_both(_family(model_type))
    layers = moe_layers(pm.graph)
    assert layers and {m.routing for m in layers} == {FAMILIES[model_type][1]}
    assert all(m.router is not None for m in layers) and not pm.graph.declined_experts
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    for name, param in params.items():
        assert torch.allclose(pm.params[name], param, rtol=1e-12, atol=1e-14), name


def test_experts_the_op_cannot_express_stay_plain_ops_and_say_why(tmp_path, capsys) -> None:
    """gpt-oss (biased, transposed, interleaved experts with a clamped gate) and Llama-4 (experts
    on score-scaled inputs): no `moe_experts` node, each experts module named with its reason,
    training as written; the eager loop's capture failure names them too."""
    from mplan.cli import main
    from mplan.ir.trace import CaptureError, capture_for_training

    want, got, params, pm = _train_both(_family("gpt_oss", torch.float32, "grouped_mm", **GPT_OSS), lr=0.1)
    assert not experts_nodes(pm.graph)
    assert set(pm.graph.declined_experts) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert all(why.startswith("GptOssExperts: biases, transposed weights, interleaved gate/up rows, its own gate")
               for why in pm.graph.declined_experts.values())
    assert got == pytest.approx(want, rel=1e-6)
    with pytest.raises(CaptureError, match=r"model.layers.0.mlp.experts and 1 like it stays plain ops.*biases"):
        capture_for_training(_family("gpt_oss", F64, "eager", **GPT_OSS), (IDS,))

    from transformers import AutoConfig

    AutoConfig.for_model("llama4_text", **{**TINY, "num_local_experts": 4, "num_experts_per_tok": 1,
                                           "intermediate_size_mlp": 48, "head_dim": 8}).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path / "config.json"), "--seq-len", "16", "--batch", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("MoE")]
    assert len(lines) == 1 and lines[0].startswith("MoE experts not recognized (model.layers.0.feed_forward.experts "
                                                   "and 1 more), left as plain ATen ops (replicated")
    assert "Llama4TextExperts: its forward takes the tokens alone" in lines[0]

