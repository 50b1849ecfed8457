"""Buffers of a model built on the meta device: computed as the model computes them, or refused.

A buffer that is not in the state dict (a non-persistent RoPE table) has no values on meta;
`passes/shard_parameters.materialize_buffers` recomputes it by the rule the model carries
(mplan's `reset_tables()`, a Hugging Face-style `_init_weights`) and must refuse it, naming it,
where the rule leaves any element unset, whatever its dtype (complex, int64, bool, float): a rank
must never read uninitialized memory (issue 30 A: a complex `torch.polar` table trained wrong,
relative error 0.1, under tp=2).

Unit checks run in this process; the end-to-end check trains the issue's model (meta device +
`state_dict=`, complex polar RoPE, `config` and `_init_weights`) on two gloo ranks under tp=2:
refused where its `_init_weights` leaves the table unset, and trained exactly against one
process (float64, relative error < 1e-9) where it fills it.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from capture_cache import reused_captures
from distributed import run_checks
from test_equivalence import MAX_NORM, OPTIMIZER, batches, errors, single_device

DTYPES = (torch.complex128, torch.int64, torch.bool, torch.float64)


def table(dtype: torch.dtype, length: int = 8) -> torch.Tensor:
    """A small table of `dtype` whose every element is neither 0 nor 1 where the dtype allows."""
    steps = torch.arange(length, dtype=torch.float64)
    if dtype.is_complex:
        return torch.polar(torch.ones_like(steps), steps / 3).to(dtype)
    if dtype == torch.bool:
        return steps % 3 == 0
    if dtype.is_floating_point:
        return (steps + 2) / 7
    return (steps * 3 + 2).to(dtype)


class Tables(nn.Module):
    """A layer with a non-persistent buffer (not in the state dict) beside a parameter."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", table(dtype), persistent=False)


class HFStyle(nn.Module):
    """`config` and `_init_weights`: mplan takes it for a Hugging Face model. `rule` says what its
    `_init_weights` does to the table: "fills" it, leaves it "unset", fills "half", or draws it at
    "random"."""

    def __init__(self, dtype: torch.dtype, rule: str) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(dtype=dtype)
        self.rule = rule
        self.tables = Tables(dtype)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        if isinstance(module, Tables):
            dtype = module.table.dtype
            if self.rule == "fills":
                module.table.copy_(table(dtype))
            elif self.rule == "half":
                module.table[:4].copy_(table(dtype)[:4])
            elif self.rule == "random":
                module.table.copy_(torch.randint(0, 2, module.table.shape).to(dtype))


def meta_and_real(dtype: torch.dtype, rule: str) -> tuple[nn.Module, nn.Module]:
    with torch.device("meta"):
        meta = HFStyle(dtype, rule)
    return meta, HFStyle(dtype, rule)


def materialized(model: nn.Module, name: str, **options: Any) -> torch.Tensor:
    from mplan.passes.shard_parameters import materialize_buffers

    return materialize_buffers(None, model, [name], device="cpu", **options)[name]  # it reads the model alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", ["unset", "half", "random"])
def test_a_buffer_the_rule_does_not_compute_is_refused_by_name(dtype: torch.dtype, rule: str) -> None:
    meta, _ = meta_and_real(dtype, rule)
    with pytest.raises(TypeError, match=rf"buffer tables\.table \({str(dtype)[6:]}\) is on the meta device and "
                                        r"not in a state dict, and HFStyle\._init_weights leaves it unset"):
        materialized(meta, "tables.table")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_buffer_the_rule_fills_equals_the_real_models(dtype: torch.dtype) -> None:
    meta, real = meta_and_real(dtype, "fills")
    got = materialized(meta, "tables.table")
    assert got.dtype == dtype and torch.equal(got, real.tables.table)


def test_a_persistent_buffer_comes_from_the_state_dict() -> None:
    """A buffer the state dict holds is read from it, whatever the rule would (not) do."""
    with torch.device("meta"):
        meta = HFStyle(torch.int64, "unset")
    meta.tables.register_buffer("kept", torch.empty(8, dtype=torch.int64, device="meta"))
    kept = table(torch.int64) + 5
    assert torch.equal(materialized(meta, "tables.kept", state_dict={"tables.kept": kept}), kept)
    with pytest.raises(ValueError, match=r"buffer tables\.kept: the state dict has int32\[8\], the model int64\[8\]"):
        materialized(meta, "tables.kept", state_dict={"tables.kept": kept.int()})


def test_mplan_rope_tables_and_hf_inv_freq_are_recomputed_exactly() -> None:
    """mplan's `reset_tables()` owner and transformers' rotary `inv_freq` (recomputed by the
    model's own `_init_weights`), each against the same model built on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mplan.models import build_model

    with torch.device("meta"):
        meta = build_model("tiny-llama", dtype=torch.float64)
    real = build_model("tiny-llama", device="cpu", dtype=torch.float64)
    real_buffers = dict(real.named_buffers())
    names = [name for name, buffer in meta.named_buffers() if buffer.is_meta]
    assert names, "tiny-llama has no RoPE buffers to recompute"
    for name in names:
        assert torch.equal(materialized(meta, name), real_buffers[name]), name

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    with torch.device("meta"):
        hf_meta = LlamaForCausalLM(config)
    hf_real = dict(LlamaForCausalLM(config).named_buffers())
    hf_names = [name for name, buffer in hf_meta.named_buffers() if buffer.is_meta]
    assert "model.rotary_emb.inv_freq" in hf_names, hf_names
    for name in hf_names:
        got = materialized(hf_meta, name)
        assert got.dtype == hf_real[name].dtype and torch.equal(got, hf_real[name]), name


def test_a_complex_parameter_the_rule_leaves_unset_is_refused() -> None:
    """The NaN sentinel of parameters covers complex dtypes too."""
    from mplan.passes.shard_parameters import _ModuleInitializer

    with torch.device("meta"):
        model = HFStyle(torch.float64, "fills")
    model.tables.register_parameter("phase", nn.Parameter(torch.empty(4, dtype=torch.complex128, device="meta")))
    with pytest.raises(TypeError, match=r"parameter tables\.phase \(complex128\) is on the meta device and "
                                        r"HFStyle's _init_weights leaves it uninitialized"):
        _ModuleInitializer(model, 0, model._init_weights, None)("tables.phase")
    assert torch.isfinite(_ModuleInitializer(model, 0, model._init_weights, None)("tables.proj.weight")).all()


def test_a_module_is_initialized_once_for_all_its_parameters() -> None:
    """A weight and its bias come from one run of the rule on one copy of their module (a module's
    init ran once per parameter, and a 2.5B model spent minutes there), each still checked."""
    from mplan.passes.shard_parameters import _ModuleInitializer

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    calls: list[str] = []

    def rule(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        module.reset_parameters()

    read = _ModuleInitializer(model, 0, rule, None)
    values = {name: read(name) for name in ("0.weight", "0.bias", "1.weight", "1.bias")}
    assert calls == ["Linear", "Linear"], calls
    assert all(torch.isfinite(v).all() for v in values.values())
    other_rank = _ModuleInitializer(model, 0, rule, None)  # every rank draws the same full parameter
    assert all(torch.equal(other_rank(name), value) for name, value in values.items())


# -- end to end: the issue's model, tp=2 on two gloo ranks --------------------------------------------
class PolarRope(nn.Module):
    """RoPE as many hand-written models keep it: a complex table from `torch.polar`, not persisted."""

    def __init__(self, head_dim: int, seq: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.seq, self.theta = head_dim, seq, theta
        self.register_buffer("freqs_cis", self.compute(), persistent=False)

    def compute(self) -> torch.Tensor:
        inverse = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.outer(torch.arange(self.seq, dtype=torch.float64), inverse)
        return torch.polar(torch.ones_like(angles), angles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq, heads, head_dim]
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        turned = pairs * self.freqs_cis[: x.shape[1], None, :]
        return torch.view_as_real(turned).flatten(-2)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.rope = PolarRope(hidden // heads, seq)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (proj(y).view(b, s, self.heads, h // self.heads) for proj in (self.q, self.k, self.v))
        q, k = self.rope(q), self.rope(k)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PolarLM(nn.Module):
    """The issue's model: `config` and `_init_weights` (so mplan takes it for a Hugging Face one).
    `fills_rope`: whether `_init_weights` recomputes the RoPE table too."""

    def __init__(self, *, fills_rope: bool, vocab: int = 64, hidden: int = 32, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=seq)
        self.fills_rope = fills_rope
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, seq) for _ in range(2))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        if self.fills_rope and isinstance(module, PolarRope):
            module.freqs_cis.copy_(module.compute())

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def polar_lm(fills_rope: bool) -> nn.Module:
    from mplan.verify import perturbed

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return perturbed(PolarLM(fills_rope=fills_rope))


def train_from_meta(fills_rope: bool, plan: str) -> dict[str, Any]:
    """The model built on meta, weights from a real instance's state dict (its RoPE table not in it)."""
    import mplan

    data = batches(4)
    real = polar_lm(fills_rope)
    state = real.state_dict()
    assert not any("freqs_cis" in name for name in state), "the RoPE table must not be persisted"
    with torch.device("meta"):
        meta = PolarLM(fills_rope=fills_rope)
    with reused_captures("polar_lm"):  # both variants have one forward: capture it once per rank
        pm = mplan.autoparallel(meta, example_inputs=(data[0][0],), optimizer=OPTIMIZER, global_batch=4, plan=plan,
                                state_dict=state, max_grad_norm=MAX_NORM)
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pm.train_step(ids, labels))
        norms.append(pm.last_grad_norm)
    return errors(pm, losses, norms, single_device(functools.partial(polar_lm, fills_rope), data))


def polar_rope_unset_is_refused() -> str:
    try:
        result = train_from_meta(False, "tp=2")
    except TypeError as refusal:
        return str(refusal)
    raise AssertionError(f"trained a table no rule computes instead of refusing it: {result}")


def polar_rope_filled_trains_exactly() -> dict[str, Any]:
    return train_from_meta(True, "tp=2")


CHECKS = [polar_rope_unset_is_refused, polar_rope_filled_trains_exactly]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(2, CHECKS)


def test_the_issues_model_is_refused_where_its_rope_table_is_unset(outcomes) -> None:
    for message in outcomes.assert_passed(polar_rope_unset_is_refused):
        assert message.startswith("buffer layers.0.rope.freqs_cis (complex128) is on the meta device and not in a "
                                  "state dict, and PolarLM._init_weights leaves it unset"), message


def test_the_issues_model_trains_exactly_where_its_rope_table_is_filled(outcomes) -> None:
    for rank, result in enumerate(outcomes.assert_passed(polar_rope_filled_trains_exactly)):
        assert result["loss"] < 1e-9 and result["param"] < 1e-9, f"rank {rank}: {result}"
        assert result["clipped"], f"rank {rank}: clipping never engaged: {result}"
