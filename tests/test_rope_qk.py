"""`rope_qk`: rotate-half RoPE on q and k in one launch per direction, as two `rope` calls.

Two parts:
- the reference dispatch (CPU, in process): rope_qk is `rope(q), rope(k)`, float64, forward and
  backward, with GQA, q/k as transposed views of their projections, and the tables in the three
  shapes Hugging Face passes ([seq, head_dim], [1, 1, seq, head_dim], [batch, 1, seq, head_dim]);
  the output dtypes are the reference chain's;
- the Triton kernel under Triton's CPU interpreter (`test_interpreted_*`): run by
  `tests/test_kernels.py::test_interpreter_suite` in a subprocess started with TRITON_INTERPRET=1
  (Triton fixes compile-vs-interpret at import), skipped in process otherwise. Shapes are tiny
  and not powers of two (6 q heads, 3 kv heads, 5 positions, head_dim 12), so every mask runs;
  fp32 within 1e-6 (relative, in norm) of the fp32 reference, fp16 within 2e-3 of float64.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from distributed import rel_err

from mplan.kernels import rope, rope_qk, rope_qk_reference, rotary
from mplan.kernels.dispatch import INTERPRET
from mplan.models.layers import rope_tables

FP32_TOL = 1e-6
FP16_TOL = 2e-3
TABLE_SHAPES = ["seq_dim", "1_1_seq_dim", "batch_1_seq_dim"]

interpreted = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start; run by "
                                                       "tests/test_kernels.py::test_interpreter_suite")


def _tables(shape: str, batch: int, seq: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as Hugging Face passes them; per batch (positions offset by the batch index,
    as position_ids of packed or left-padded sequences give) for [batch, 1, seq, head_dim]."""
    cos, sin = rope_tables(seq + batch, head_dim, 10000.0, device=torch.device("cpu"))
    if shape == "seq_dim":
        cos, sin = cos[:seq], sin[:seq]
    elif shape == "1_1_seq_dim":
        cos, sin = cos[None, None, :seq], sin[None, None, :seq]
    else:
        cos = torch.stack([cos[b:b + seq] for b in range(batch)])[:, None]
        sin = torch.stack([sin[b:b + seq] for b in range(batch)])[:, None]
    return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


def _projections(batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj and k_proj outputs, [batch, seq, heads * head_dim], leaves."""
    return tuple(torch.randn(batch, seq, h * head_dim).to(dtype).requires_grad_() for h in (q_heads, kv_heads))


def _heads(projected: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim], a transposed view (as HF does)."""
    batch, seq, _ = projected.shape
    return projected.view(batch, seq, -1, head_dim).transpose(1, 2)


def _forward_backward(op: Callable[..., tuple[torch.Tensor, torch.Tensor]], q_proj: torch.Tensor,
                      k_proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upstream: list[torch.Tensor],
                      head_dim: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    outputs = op(_heads(q_proj, head_dim), _heads(k_proj, head_dim), cos, sin)
    grads = torch.autograd.grad(outputs, (q_proj, k_proj), [u.to(o.dtype) for u, o in zip(upstream, outputs)])
    return outputs, grads


def _two_ropes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return rope(q, cos, sin), rope(k, cos, sin)


# --- the reference dispatch -------------------------------------------------------------------


@pytest.mark.parametrize("table_shape", TABLE_SHAPES)
def test_rope_qk_is_two_rope_calls_in_float64(table_shape: str) -> None:
    """GQA (4 q heads, 2 kv heads), q and k transposed views of their projections (non-contiguous):
    outputs and the gradients w.r.t. both projections equal two `rope` calls'."""
    torch.manual_seed(0)
    batch, seq, head_dim = 2, 5, 8
    cos, sin = _tables(table_shape, batch, seq, head_dim, torch.float64)
    q_proj, k_proj = _projections(batch, seq, 4, 2, head_dim, torch.float64)
    assert not _heads(q_proj, head_dim).is_contiguous()
    upstream = [torch.randn(batch, h, seq, head_dim, dtype=torch.float64) for h in (4, 2)]
    got, got_grads = _forward_backward(rope_qk, q_proj, k_proj, cos, sin, upstream, head_dim)
    want, want_grads = _forward_backward(_two_ropes, q_proj, k_proj, cos, sin, upstream, head_dim)
    for g, w in zip(got + got_grads, want + want_grads):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)


def test_rope_qk_reference_is_the_rope_reference_on_q_and_on_k() -> None:
    torch.manual_seed(0)
    cos, sin = _tables("batch_1_seq_dim", 2, 5, 8, torch.float64)
    q, k = torch.randn(2, 4, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    got = rope_qk_reference(q, k, cos, sin)
    want = (rotary.rope_reference(q, cos, sin), rotary.rope_reference(k, cos, sin))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(("x_dtype", "table_dtype"), [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16)], ids=str)
def test_output_dtypes_are_the_reference_chains(x_dtype: torch.dtype, table_dtype: torch.dtype) -> None:
    """bf16 q/k with fp32 tables give fp32 (x * cos promotes), as `rope_reference` does; gradients
    come back in q's and k's dtypes."""
    torch.manual_seed(0)
    cos, sin = _tables("1_1_seq_dim", 2, 5, 8, table_dtype)
    q_proj, k_proj = _projections(2, 5, 4, 2, 8, x_dtype)
    upstream = [torch.randn(2, h, 5, 8) for h in (4, 2)]
    (q_out, k_out), (dq, dk) = _forward_backward(rope_qk, q_proj, k_proj, cos, sin, upstream, 8)
    want = rope_qk_reference(_heads(q_proj, 8), _heads(k_proj, 8), cos, sin)
    assert q_out.dtype == k_out.dtype == want[0].dtype == torch.promote_types(x_dtype, table_dtype)
    assert dq.dtype == dk.dtype == x_dtype


def test_consumer_attention_gives_the_autocast_dtype() -> None:
    """Under autocast, consumer="attention" returns what attention would cast its fp32 input to."""
    torch.manual_seed(0)
    cos, sin = _tables("seq_dim", 2, 5, 8, torch.float32)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = rope_qk(q, k, cos, sin)
        marked = rope_qk(q, k, cos, sin, consumer="attention")
    assert all(p.dtype == torch.float32 for p in plain) and all(m.dtype == torch.bfloat16 for m in marked)
    assert all(torch.equal(m, p.to(torch.bfloat16)) for m, p in zip(marked, plain))


def test_tables_the_kernel_takes_are_views_not_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three table shapes become [batch, 1, seq, head_dim] views of the same storage (stride
    0 where broadcast); other shapes and tables that require grad are left to two `rope` calls
    (meta tensors: `_qk_tables` only looks at shapes and strides, and use_triton is patched)."""
    q, k = torch.empty(2, 4, 5, 8, device="meta"), torch.empty(2, 2, 5, 8, device="meta")
    monkeypatch.setattr(rotary, "use_triton", lambda t: t.dtype != torch.float64)
    for shape, strides in [((5, 8), (0, 40, 8, 1)), ((1, 1, 5, 8), (0, 40, 8, 1)), ((2, 1, 5, 8), (40, 40, 8, 1))]:
        cos, sin = torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
        tables = rotary._qk_tables(q, k, cos, sin)
        assert tables is not None and all(t.shape == (2, 1, 5, 8) and t.stride() == strides for t in tables)
    per_head = torch.empty(2, 4, 5, 8, device="meta")
    assert rotary._qk_tables(q, k, per_head, per_head) is None
    trainable = torch.empty(5, 8, device="meta", requires_grad=True)
    assert rotary._qk_tables(q, k, trainable, trainable) is None
    assert rotary._qk_tables(q, k[..., :6], torch.empty(5, 6, device="meta"), torch.empty(5, 6, device="meta")) is None


# --- the Triton kernel under the interpreter ----------------------------------------------------


@interpreted
@pytest.mark.parametrize("table_shape", TABLE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interpreted_kernel_matches_the_reference(dtype: torch.dtype, table_shape: str) -> None:
    """6 q heads and 3 kv heads as transposed views, 5 positions (2-token tiles: a partial one),
    head_dim 12 (half 6 of an 8-wide block): outputs and both gradients, tables in q's dtype
    (fp32: against the fp32 reference within 1e-6; fp16: against float64 within 2e-3)."""
    torch.manual_seed(0)
    batch, seq, head_dim = 2, 5, 12
    cos, sin = _tables(table_shape, batch, seq, head_dim, dtype)
    q_proj, k_proj = _projections(batch, seq, 6, 3, head_dim, dtype)
    upstream = [torch.randn(batch, h, seq, head_dim) for h in (6, 3)]
    outputs, grads = _forward_backward(rope_qk, q_proj, k_proj, cos, sin, upstream, head_dim)
    assert all("RopeQKFunction" in o.grad_fn.name() for o in outputs), outputs[0].grad_fn
    ref_dtype, tol = (torch.float32, FP32_TOL) if dtype == torch.float32 else (torch.float64, FP16_TOL)
    ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q_proj, k_proj)]
    want, want_grads = _forward_backward(rope_qk_reference, *ref_leaves, cos.to(ref_dtype), sin.to(ref_dtype),
                                         upstream, head_dim)
    for name, got, expected in zip(["q", "k", "dq", "dk"], outputs + grads, want + want_grads):
        assert got.dtype == dtype and got.shape == expected.shape, name
        assert rel_err(got.to(ref_dtype), expected) < tol, f"{name}: {rel_err(got.to(ref_dtype), expected):.3g}"


@interpreted
def test_interpreted_fp16_inputs_with_fp32_tables_give_fp32() -> None:
    """The dtype semantics of the reference: fp16 q/k times fp32 tables is fp32, fp16 gradients."""
    torch.manual_seed(0)
    cos, sin = _tables("batch_1_seq_dim", 2, 5, 12, torch.float32)
    q_proj, k_proj = _projections(2, 5, 6, 3, 12, torch.float16)
    upstream = [torch.randn(2, h, 5, 12) for h in (6, 3)]
    outputs, grads = _forward_backward(rope_qk, q_proj, k_proj, cos, sin, upstream, 12)
    leaves = [t.detach().double().requires_grad_() for t in (q_proj, k_proj)]
    want, want_grads = _forward_backward(rope_qk_reference, *leaves, cos.double(), sin.double(), upstream, 12)
    assert [t.dtype for t in outputs + grads] == [torch.float32] * 2 + [torch.float16] * 2
    assert "RopeQKFunction" in outputs[0].grad_fn.name()
    for got, expected in zip(outputs + grads, want + want_grads):
        assert rel_err(got.double(), expected) < FP16_TOL


@interpreted
def test_interpreted_one_launch_each_way_in_the_inputs_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power-of-two heads and columns and 6 positions in 2-token tiles: the unmasked (EVEN) path.
    One launch forward and one backward, `rope`'s kernel not at all; the outputs keep the
    transposed layout of q and k, so the gradients w.r.t. the projections come back contiguous."""
    torch.manual_seed(0)
    batch, seq, head_dim = 2, 6, 8
    cos, sin = _tables("seq_dim", batch, seq, head_dim, torch.float32)
    q_proj, k_proj = _projections(batch, seq, 4, 2, head_dim, torch.float32)
    launches = []
    qk_run, rope_run = rotary._rope_qk_kernel.run, rotary._rope_kernel.run
    monkeypatch.setattr(rotary._rope_qk_kernel, "run", lambda *a, **kw: launches.append("qk") or qk_run(*a, **kw))
    monkeypatch.setattr(rotary._rope_kernel, "run", lambda *a, **kw: launches.append("rope") or rope_run(*a, **kw))
    q, k = _heads(q_proj, head_dim), _heads(k_proj, head_dim)
    q_out, k_out = rope_qk(q, k, cos, sin)
    assert launches == ["qk"] and q_out.stride() == q.stride() and k_out.stride() == k.stride()
    upstream = [torch.randn(o.shape) for o in (q_out, k_out)]
    dq, dk = torch.autograd.grad((q_out, k_out), (q_proj, k_proj), upstream)
    assert launches == ["qk", "qk"] and dq.is_contiguous() and dk.is_contiguous()
    want = rope_qk_reference(q, k, cos, sin)
    want_grads = torch.autograd.grad(want, (q_proj, k_proj), upstream)
    for got, expected in zip((q_out, k_out, dq, dk), want + want_grads):
        assert rel_err(got, expected) < FP32_TOL


@interpreted
def test_interpreted_consumer_attention_under_autocast_gives_bf16() -> None:
    """consumer="attention" under CPU autocast: bf16 outputs within one bf16 step of the fp32
    ones (the interpreter truncates where the GPU rounds), fp32 gradients equal to the plain op's."""
    torch.manual_seed(0)
    cos, sin = _tables("seq_dim", 2, 5, 12, torch.float32)
    q, k = (torch.randn(2, h, 5, 12, requires_grad=True) for h in (6, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = rope_qk(q, k, cos, sin)
        marked = rope_qk(q, k, cos, sin, consumer="attention")
    assert [t.dtype for t in plain + marked] == [torch.float32] * 2 + [torch.bfloat16] * 2
    for m, p in zip(marked, plain):
        assert torch.allclose(m.float(), p, rtol=2**-7, atol=0)
    upstream = [torch.randn(m.shape, dtype=torch.bfloat16) for m in marked]
    got = torch.autograd.grad(marked, (q, k), upstream)
    want = torch.autograd.grad(plain, (q, k), [u.float() for u in upstream])
    assert all(rel_err(g, w) < FP32_TOL for g, w in zip(got, want))


@interpreted
def test_interpreted_tables_that_require_grad_take_the_reference_as_rope_does() -> None:
    """As `rope`: trainable tables get their gradient from the reference ops, not the kernel."""
    torch.manual_seed(0)
    cos, sin = (t.requires_grad_() for t in _tables("seq_dim", 2, 5, 12, torch.float32))
    q, k = torch.randn(2, 6, 5, 12), torch.randn(2, 3, 5, 12)
    q_out, k_out = rope_qk(q, k, cos, sin)
    assert "RopeQKFunction" not in q_out.grad_fn.name()
    got = torch.autograd.grad((q_out.sum(), k_out.sum()), (cos, sin))
    want = torch.autograd.grad([o.sum() for o in rope_qk_reference(q, k, cos, sin)], (cos, sin))
    assert all(torch.allclose(g, w) for g, w in zip(got, want))


# --- partial rotary: RoPE on the first rot_dim of each head vector, the rest passed through ----

PARTIAL_HEAD_DIM, ROT_DIM = 12, 4  # a third of each head rotated (StableLM rotates a quarter)


def _partial(rot_dim: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return lambda q, k, cos, sin: rope_qk(q, k, cos, sin, rot_dim=rot_dim)


def _partial_reference(rot_dim: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Hugging Face's partial rotary as StableLM writes it: slice, rotate, concatenate."""
    def hf(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q_rot, k_rot = rotary.rope_reference(q[..., :rot_dim], cos, sin), rotary.rope_reference(k[..., :rot_dim], cos, sin)
        return torch.cat((q_rot, q[..., rot_dim:]), dim=-1), torch.cat((k_rot, k[..., rot_dim:]), dim=-1)
    return hf


@pytest.mark.parametrize("table_shape", TABLE_SHAPES)
def test_partial_rotary_is_huggingfaces_slice_rotate_concatenate_in_float64(table_shape: str) -> None:
    """rot_dim 4 of head_dim 12, tables 4 wide, GQA, transposed views: outputs and gradients
    equal the slice/rotate/cat chain's; the unrotated columns come through unchanged."""
    torch.manual_seed(0)
    batch, seq = 2, 5
    cos, sin = _tables(table_shape, batch, seq, ROT_DIM, torch.float64)
    q_proj, k_proj = _projections(batch, seq, 4, 2, PARTIAL_HEAD_DIM, torch.float64)
    upstream = [torch.randn(batch, h, seq, PARTIAL_HEAD_DIM, dtype=torch.float64) for h in (4, 2)]
    got, got_grads = _forward_backward(_partial(ROT_DIM), q_proj, k_proj, cos, sin, upstream, PARTIAL_HEAD_DIM)
    want, want_grads = _forward_backward(_partial_reference(ROT_DIM), q_proj, k_proj, cos, sin, upstream,
                                         PARTIAL_HEAD_DIM)
    for g, w in zip(got + got_grads, want + want_grads):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0][..., ROT_DIM:], _heads(q_proj, PARTIAL_HEAD_DIM)[..., ROT_DIM:])
    assert all(torch.equal(g, w) for g, w in zip(rotary.rope_qk_reference(*(t.detach() for t in got), cos, sin,
                                                                           ROT_DIM),
                                                 _partial_reference(ROT_DIM)(*(t.detach() for t in got), cos, sin)))


@interpreted
@pytest.mark.parametrize("table_shape", TABLE_SHAPES)
@pytest.mark.parametrize("rot_dim", [4, 6], ids=lambda r: f"rot{r}")
def test_interpreted_partial_rotary_runs_one_launch_each_way_and_matches_the_reference(
        rot_dim: int, table_shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, 6 q heads and 3 kv heads of head_dim 12 as transposed views, rot_dim 4 (half 2, a
    full block) and 6 (half 3, masked): one `rope_qk` launch each way on the rotated columns,
    `rope`'s kernel not at all; outputs and both gradients within 1e-6 of the fp32 chain, in q's
    and k's layout (gradients w.r.t. the projections contiguous)."""
    torch.manual_seed(0)
    batch, seq = 2, 5
    cos, sin = _tables(table_shape, batch, seq, rot_dim, torch.float32)
    q_proj, k_proj = _projections(batch, seq, 6, 3, PARTIAL_HEAD_DIM, torch.float32)
    launches = []
    qk_run, rope_run = rotary._rope_qk_kernel.run, rotary._rope_kernel.run
    monkeypatch.setattr(rotary._rope_qk_kernel, "run", lambda *a, **kw: launches.append("qk") or qk_run(*a, **kw))
    monkeypatch.setattr(rotary._rope_kernel, "run", lambda *a, **kw: launches.append("rope") or rope_run(*a, **kw))
    upstream = [torch.randn(batch, h, seq, PARTIAL_HEAD_DIM) for h in (6, 3)]
    outputs, grads = _forward_backward(_partial(rot_dim), q_proj, k_proj, cos, sin, upstream, PARTIAL_HEAD_DIM)
    assert launches == ["qk", "qk"] and all("RopeQKFunction" in o.grad_fn.name() for o in outputs)
    q = _heads(q_proj, PARTIAL_HEAD_DIM)
    assert outputs[0].stride() == q.stride() and all(g.is_contiguous() for g in grads)
    ref_leaves = [t.detach().requires_grad_() for t in (q_proj, k_proj)]
    want, want_grads = _forward_backward(_partial_reference(rot_dim), *ref_leaves, cos, sin, upstream,
                                         PARTIAL_HEAD_DIM)
    for name, got, expected in zip(["q", "k", "dq", "dk"], outputs + grads, want + want_grads):
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert rel_err(got, expected) < FP32_TOL, f"{name}: {rel_err(got, expected):.3g}"
