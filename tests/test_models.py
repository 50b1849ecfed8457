"""Reference models: sizes against closed forms and published counts, numerics against
naive references (GQA, RoPE, MoE routing with and without drops, aux loss), deterministic
init across meta/CPU builds, torch.export on meta, and the model-spec grammar."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mplan.models import (
    PRESETS,
    GPTConfig,
    GPTModel,
    LlamaConfig,
    LlamaModel,
    MoEConfig,
    MoELayer,
    MoEModel,
    build_model,
    example_inputs,
    resolve_model,
)
from mplan.models.layers import Attention, RotaryEmbedding, apply_rope

TINY = ("tiny-gpt", "tiny-llama", "tiny-moe")
F64 = torch.float64


def tiny(name: str, **changes: object):
    return dataclasses.replace(PRESETS[name], **changes)


# ---- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_fast_and_matches_closed_form(name: str) -> None:
    start = time.perf_counter()
    model = build_model(name)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{name} took {elapsed:.2f}s to build on meta"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == PRESETS[name].num_parameters()


@pytest.mark.parametrize("name", ["gpt3-125m", "gpt3-1.3b", "gpt3-175b"])
def test_gpt_count_is_narayanan_formula_plus_final_layernorm(name: str) -> None:
    # Narayanan et al. 2021: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)) = 12lh^2 + 13lh + (V+s)h.
    # It counts per block 4h^2+4h (attention + biases), 8h^2+5h (MLP + biases), 4h (two
    # LayerNorms), tied token plus position embeddings, and omits the final LayerNorm (2h).
    c = PRESETS[name]
    assert c.tie_embeddings and c.ffn == 4 * c.hidden
    l, h, v, s = c.num_layers, c.hidden, c.vocab, c.seq_len
    narayanan = 12 * l * h * h + 13 * l * h + (v + s) * h
    assert build_model(name).num_parameters() == narayanan + 2 * h


@pytest.mark.parametrize(
    ("name", "published", "rel"),
    [
        ("llama3-8b", 8.03e9, 0.005),
        ("llama3-70b", 70.6e9, 0.005),
        ("llama3-405b", 405.8e9, 0.005),
        ("mixtral-8x7b", 46.7e9, 0.005),
        ("gpt3-175b", 175e9, 0.01),
    ],
)
def test_published_parameter_counts(name: str, published: float, rel: float) -> None:
    assert build_model(name).num_parameters() == pytest.approx(published, rel=rel)


def test_mixtral_active_parameters() -> None:
    # "each token has access to 47B parameters, but only uses 13B active" (Mixtral paper);
    # 12.9B in Mistral's announcement
    assert PRESETS["mixtral-8x7b"].num_active_parameters() == pytest.approx(12.9e9, rel=0.005)


# ---- configs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: GPTConfig(num_layers=0, hidden=32, num_heads=4, seq_len=8, vocab=16), "num_layers"),
        (lambda: GPTConfig(num_layers=1, hidden=30, num_heads=4, seq_len=8, vocab=16), "hidden"),
        (lambda: tiny("tiny-llama", num_kv_heads=3), "num_kv_heads"),
        (lambda: tiny("tiny-llama", hidden=36, num_heads=12), "head_dim"),
        (lambda: tiny("tiny-moe", top_k=5), "top_k"),
        (lambda: tiny("tiny-moe", capacity_factor=0.0), "capacity_factor"),
        (lambda: tiny("tiny-moe", vocab=-1), "vocab"),
    ],
)
def test_config_validation_names_the_field(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_derived_widths_follow_replace() -> None:
    c = PRESETS["tiny-gpt"]
    assert c.ffn == 4 * c.hidden and c.head_dim == c.hidden // c.num_heads
    assert dataclasses.replace(c, hidden=64).ffn == 256
    assert PRESETS["tiny-llama"].kv_heads == 2 and c.kv_heads == c.num_heads


# ---- forward, backward, init ---------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_forward_backward_float64(name: str, tie: bool) -> None:
    config = tiny(name, tie_embeddings=tie)
    model = build_model(config, device="cpu", dtype=F64)
    ids, labels = example_inputs(model, batch=2, device="cpu")
    assert model(ids).shape == (2, config.seq_len, config.vocab)
    loss = model(ids, labels=labels)
    assert loss.dtype == F64 and loss.ndim == 0 and torch.isfinite(loss)
    # small init: logits near zero, so the loss is near that of a uniform guess
    assert loss.item() == pytest.approx(math.log(config.vocab), abs=0.1)
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) != tie
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    if name == "tiny-moe":
        assert "layers.0.mlp.router.weight" in names


@pytest.mark.parametrize("name", TINY)
def test_meta_then_init_weights_equals_cpu_build(name: str) -> None:
    on_cpu = build_model(name, device="cpu", seed=7)
    from_meta = build_model(name, device="meta")
    from_meta.to_empty(device="cpu")
    from_meta.init_weights(seed=7)
    a = dict(on_cpu.named_parameters()) | dict(on_cpu.named_buffers())
    b = dict(from_meta.named_parameters()) | dict(from_meta.named_buffers())
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    other = build_model(name, device="cpu", seed=8)
    assert not torch.equal(other.embed.weight, on_cpu.embed.weight)


def test_init_is_dtype_independent_and_megatron_scaled() -> None:
    f32 = build_model("tiny-llama", device="cpu", dtype=torch.float32, seed=3)
    f64 = build_model("tiny-llama", device="cpu", dtype=F64, seed=3)
    for (n, p32), p64 in zip(f32.named_parameters(), f64.parameters()):
        assert torch.equal(p32.double(), p64), n
    model = build_model(PRESETS["tiny-gpt"], device="cpu", seed=0)
    out_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    assert model.layers[0].attn.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.15)
    assert model.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert torch.all(model.layers[0].attn.q_proj.bias == 0)
    assert torch.all(model.layers[0].attn_norm.weight == 1)


# ---- attention and RoPE --------------------------------------------------------------------


def test_gqa_attention_equals_repeated_kv_reference() -> None:
    torch.manual_seed(0)
    attn = Attention(32, num_heads=8, num_kv_heads=2, bias=False).double()
    x = torch.randn(2, 6, 32, dtype=F64)
    rope = RotaryEmbedding(6, 4, 10000.0).double()
    rope.reset_tables()  # float64 tables, not float32 ones cast up
    cos, sin = rope(6)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 6, -1, 4).transpose(1, 2)

    q = apply_rope(heads(attn.q_proj(x)), cos, sin)
    k = apply_rope(heads(attn.k_proj(x)), cos, sin).repeat_interleave(4, dim=1)
    v = heads(attn.v_proj(x)).repeat_interleave(4, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    reference = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(attn(x, (cos, sin)), reference, rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_only_on_position_difference() -> None:
    rope = RotaryEmbedding(12, 16, 500000.0).double()
    rope.reset_tables()  # float64 tables, not float32 ones cast up
    cos, sin = rope(12)
    torch.manual_seed(1)
    q = torch.randn(16, dtype=F64).expand(1, 1, 12, 16)
    k = torch.randn(16, dtype=F64).expand(1, 1, 12, 16)
    scores = (apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2))[0, 0]
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scores[0, 1], scores[0, 2])  # it does depend on the difference


# ---- MoE -----------------------------------------------------------------------------------


def naive_moe(layer: MoELayer, x: torch.Tensor, capacity: int) -> tuple[torch.Tensor, int]:
    """Token by token over its top-k experts; choices taken choice-major, first come first
    served, until an expert holds `capacity`. Returns the output and the number dropped."""
    c = layer.config
    tokens = x.reshape(-1, c.hidden)
    e = layer.experts
    out = torch.zeros_like(tokens)
    load = [0] * c.num_experts
    dropped = 0
    picks = []
    for t in range(tokens.shape[0]):
        probs = torch.softmax(tokens[t] @ layer.router.weight.T, dim=-1)
        weights, experts = probs.topk(c.top_k)
        picks.append((weights / weights.sum(), experts))
    for j in range(c.top_k):
        for t, (weights, experts) in enumerate(picks):
            i = int(experts[j])
            if load[i] >= capacity:
                dropped += 1
                continue
            load[i] += 1
            hidden = F.silu(e.w_gate[i] @ tokens[t]) * (e.w_up[i] @ tokens[t])
            out[t] += weights[j] * (e.w_down[i] @ hidden)
    return out.view_as(x), dropped


@pytest.mark.parametrize(("capacity_factor", "drops"), [(None, False), (0.5, True)])
def test_moe_layer_matches_naive_loop(capacity_factor: float | None, drops: bool) -> None:
    config = tiny("tiny-moe", capacity_factor=capacity_factor)
    model = build_model(config, device="cpu", dtype=F64, seed=1)
    layer = model.layers[0].mlp
    x = torch.randn(2, 8, config.hidden, dtype=F64, generator=torch.Generator().manual_seed(2))
    capacity = config.capacity(16)
    assert capacity == (16 if capacity_factor is None else math.ceil(0.5 * 2 * 16 / 4))
    y, _ = layer(x)
    reference, dropped = naive_moe(layer, x, capacity)
    assert (dropped > 0) == drops
    torch.testing.assert_close(y, reference, rtol=1e-12, atol=1e-12)


def test_moe_aux_loss_equals_naive_formula() -> None:
    config = PRESETS["tiny-moe"]
    layer = build_model(config, device="cpu", dtype=F64, seed=4).layers[1].mlp
    x = torch.randn(3, 5, config.hidden, dtype=F64, generator=torch.Generator().manual_seed(5))
    _, aux = layer(x)
    tokens = x.reshape(-1, config.hidden)
    probs = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
    chosen = probs.topk(config.top_k).indices
    counts = torch.stack([(chosen == e).sum() for e in range(config.num_experts)]).to(F64)
    fraction = counts / chosen.numel()
    expected = config.num_experts * (fraction * probs.mean(0)).sum()
    torch.testing.assert_close(aux, expected, rtol=1e-12, atol=1e-12)


def test_moe_model_loss_adds_weighted_aux_losses() -> None:
    model = build_model(tiny("tiny-moe", aux_loss_coef=0.5), device="cpu", dtype=F64)
    ids, labels = example_inputs(model, batch=2, device="cpu")
    logits = model(ids)
    lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    x = model.embed(ids)
    rope = model.rope(ids.shape[1])
    aux = []
    for block in model.layers:
        x, a = block(x, rope)
        aux.append(a)
    torch.testing.assert_close(model(ids, labels), lm + 0.5 * sum(aux), rtol=1e-12, atol=1e-12)


# ---- export --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_export_on_meta(name: str) -> None:
    model = build_model(name)
    ids, labels = example_inputs(model, batch=2)
    exported = torch.export.export(model, (ids,), {"labels": labels}, strict=False)
    assert exported.module()(ids, labels=labels).shape == ()
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product_attention" in t for t in targets)


# ---- specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_resolves(name: str) -> None:
    source = resolve_model(name)
    assert source.config == PRESETS[name] and source.family == PRESETS[name].family
    assert (source.seq_len, source.vocab) == (PRESETS[name].seq_len, PRESETS[name].vocab)


def test_family_spec_builds_and_runs() -> None:
    spec = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
    source = resolve_model(spec)
    assert source.config == GPTConfig(name=spec, num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab=128)
    model = build_model(spec, device="cpu", dtype=F64)
    assert isinstance(model, GPTModel)
    ids, _ = example_inputs(model, batch=1, device="cpu")
    assert model(ids).shape == (1, 32, 128)
    moe = resolve_model(
        "moe:layers=1,hidden=32,heads=4,kv_heads=2,seq=8,vocab=16,ffn=48,experts=4,topk=1,capacity=none,tie=1"
    )
    assert moe.config.top_k == 1 and moe.config.capacity_factor is None and moe.config.tie_embeddings


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        ("gpt:layers=2,hidden=64", "missing key.*heads"),
        ("gpt:layers,hidden=64", "expected key=value, got 'layers'"),
        ("gpt:layers=2,layers=3,hidden=64", "'layers' given twice"),
        ("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,bogus=1", "unknown key 'bogus'.*valid keys"),
        ("gpt:layers=two,hidden=64,heads=4,seq=32,vocab=128", "bad value 'two' for key 'layers'"),
        ("llama:layers=2,hidden=64,heads=4,seq=32,vocab=128", "missing key.*ffn"),
        ("gpt:layers=2,hidden=64,heads=5,seq=32,vocab=128", "hidden"),
        ("moe:layers=1,hidden=32,heads=4,seq=8,vocab=16,ffn=48,experts=2,topk=3", "top_k"),
        ("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128,kv_heads=2", "unknown key 'kv_heads'"),
        ("no-such-model", "presets: gpt3-125m"),
        ("missing/config.json", "no such file"),
        ("mplan.models.presets:no_such_factory", "cannot load factory"),
    ],
)
def test_bad_specs_raise_one_clear_error(spec: str, cause: str) -> None:
    with pytest.raises(ValueError, match=cause):
        resolve_model(spec)


def test_hf_config_json_builds_without_network(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
    )
    hf.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path / "config.json"))
    assert source.family == "hf" and (source.seq_len, source.vocab) == (16, 64)
    assert source.config.use_cache is False
    on_meta = build_model(str(tmp_path))
    assert next(on_meta.parameters()).device.type == "meta"
    ours = LlamaConfig(
        num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, ffn_hidden=64, seq_len=16, vocab=64,
    )
    assert sum(p.numel() for p in on_meta.parameters()) == ours.num_parameters()
    on_cpu = build_model(str(tmp_path), device="cpu", dtype=F64)
    ids, _ = example_inputs(on_cpu, batch=1, device="cpu")
    assert on_cpu(ids).logits.shape == (1, 16, 64)


def test_factory_spec(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_models.py").write_text(
        "from mplan.models import PRESETS\n"
        "from mplan.models.gpt import GPTModel\n"
        "def config():\n    return PRESETS['tiny-llama']\n"
        "def module():\n    return GPTModel(PRESETS['tiny-gpt'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_model("my_models:config").family == "llama"
    source = resolve_model("my_models:module")
    assert source.family == "factory" and source.seq_len == 16
    model = build_model("my_models:module", device="cpu", dtype=F64, seed=0)
    assert next(model.parameters()).dtype == F64 and next(model.parameters()).device.type == "cpu"


def test_example_inputs() -> None:
    ids, labels = example_inputs(PRESETS["tiny-gpt"], batch=3, device="cpu", seed=5)
    assert ids.shape == labels.shape == (3, 16) and ids.dtype == labels.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the next tokens
    again, _ = example_inputs(PRESETS["tiny-gpt"], batch=3, device="cpu", seed=5)
    assert torch.equal(ids, again) and int(ids.max()) < 64
    meta_ids, _ = example_inputs(resolve_model("llama3-8b"), batch=2, seq_len=128)
    assert meta_ids.device.type == "meta" and meta_ids.shape == (2, 128)


# ---- property ------------------------------------------------------------------------------


@st.composite
def small_configs(draw):
    family = draw(st.sampled_from(["gpt", "llama", "moe"]))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 4))
    common = dict(
        num_layers=draw(st.integers(1, 2)), hidden=heads * head_dim, num_heads=heads,
        seq_len=draw(st.integers(1, 8)), vocab=draw(st.integers(2, 40)),
        tie_embeddings=draw(st.booleans()),
    )
    if family == "gpt":
        return GPTConfig(**common, ffn_hidden=draw(st.none() | st.integers(1, 24)))
    llama = dict(common, num_kv_heads=kv_heads, ffn_hidden=draw(st.integers(1, 24)))
    if family == "llama":
        return LlamaConfig(**llama)
    experts = draw(st.integers(1, 4))
    return MoEConfig(
        **llama, num_experts=experts, top_k=draw(st.integers(1, experts)),
        capacity_factor=draw(st.none() | st.floats(0.1, 2.0)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=small_configs(), batch=st.integers(1, 3))
def test_random_small_configs_run(config, batch: int) -> None:
    model = build_model(config, device="cpu", dtype=F64)
    assert isinstance(model, {"gpt": GPTModel, "llama": LlamaModel, "moe": MoEModel}[config.family])
    assert model.num_parameters() == config.num_parameters()
    ids, labels = example_inputs(model, batch=batch, device="cpu")
    assert model(ids).shape == (batch, config.seq_len, config.vocab)
    assert torch.isfinite(model(ids, labels))
