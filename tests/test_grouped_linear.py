"""grouped_linear: q/k/v (or gate/up) as one GEMM that keeps the weights, not their concatenation."""
from __future__ import annotations

import pytest
import torch

from mplan.kernels.grouped_linear import grouped_linear, grouped_linear_reference, joined_weights


def _problem(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    weights = [torch.randn(n, 8, dtype=dtype, requires_grad=True) for n in (6, 3, 3)]
    biases = [torch.randn(n, dtype=dtype, requires_grad=True) if bias else None for n in (6, 3, 3)]
    return x, weights, biases


def _run(fn, x, weights, biases):  # noqa: ANN001, ANN202 - the op or its reference
    out = fn(x, weights, biases)
    leaves = [x, *weights, *(b for b in biases if b is not None)]
    return out, torch.autograd.grad(out, leaves, torch.ones_like(out))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_it_computes_the_concatenated_linear_bit_for_bit(bias: bool) -> None:
    problem = _problem(torch.float64, bias)
    (out, grads), (ref, ref_grads) = _run(grouped_linear, *problem), _run(grouped_linear_reference, *problem)
    assert torch.equal(out, ref)
    assert all(torch.allclose(g, r, rtol=1e-14, atol=1e-14) for g, r in zip(grads, ref_grads))


def test_it_keeps_the_weights_not_their_concatenation() -> None:
    x, weights, biases = _problem(torch.float64, False)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grouped_linear(x, weights, biases)
    assert {t.data_ptr() for t in saved} == {t.data_ptr() for t in (x, *weights)}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saved.clear()
        grouped_linear_reference(x, weights, biases)
    assert any(t.numel() == 12 * 8 for t in saved)  # the ATen chain keeps cat(weights) (or its transpose)


def test_under_autocast_it_casts_as_f_linear_does() -> None:
    x, weights, biases = _problem(torch.float32, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, grads), (ref, ref_grads) = _run(grouped_linear, x, weights, biases), \
            _run(grouped_linear_reference, x, weights, biases)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype == torch.float32
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)


def _end_to_end_weights() -> list[torch.Tensor]:
    """Three leaves viewing one storage one after another, as `runtime/grouped_storage.py` lays them."""
    torch.manual_seed(0)
    storage = torch.randn(12 * 8, dtype=torch.float64)
    return [torch.nn.Parameter(storage[a * 8:b * 8].view(b - a, 8)) for a, b in ((0, 6), (6, 9), (9, 12))]


@pytest.mark.parametrize("layout", ["end_to_end", "apart"])
def test_joined_weights_is_cat_forward_and_backward_and_a_view_where_they_lie_end_to_end(layout: str) -> None:
    """The ATen form of a grouped projection (zero-bubble schedules, FP8): linear(x, joined_weights(ws))."""
    weights = _end_to_end_weights() if layout == "end_to_end" else _problem(torch.float64, False)[1]
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    wide = joined_weights(weights)
    assert (wide.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()) == (layout == "end_to_end")
    out = torch.nn.functional.linear(x, wide)
    ref = torch.nn.functional.linear(x, torch.cat(weights))
    assert torch.equal(out, ref)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *weights], dy)
    want = torch.autograd.grad(ref, [x, *weights], dy)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_joined_weights_refuses_weights_of_two_dtypes() -> None:
    with pytest.raises(ValueError, match="differ in dtype"):
        joined_weights([torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)])
