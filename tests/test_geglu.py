"""GeGLU, the gated MLP with GELU-tanh (Gemma): geglu(gate, up) = gelu_tanh(gate) * up, and
geglu_packed(y) = geglu(y[..., :F], y[..., F:]) on one GEMM's [..., 2F] output.

In this process CPU tensors take the reference dispatch, which must be the eager chain itself,
`F.gelu(gate, approximate="tanh") * up`, op for op. The Triton kernels are checked by Triton's
CPU interpreter in a subprocess started with TRITON_INTERPRET=1 (the mode is fixed when Triton
is imported): the tests named `..._under_the_interpreter`, skipped in any other process. There
fp32 results and gradients must match the fp32 reference within 1e-6 (relative, in norm), fp16
ones the float64 reference within 2e-3, on tiny shapes that are no multiple of the
interpreter's blocks (128 elements, 2 x 16 tiles), so every mask runs. On its own:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_geglu.py -k under_the_interpreter
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from distributed import rel_err

from mplan.kernels import geglu, geglu_packed, geglu_packed_reference, geglu_reference, use_triton
from mplan.kernels.dispatch import INTERPRET

needs_reference_dispatch = pytest.mark.skipif(INTERPRET, reason="this process runs Triton's interpreter")
under_the_interpreter = pytest.mark.skipif(
    not INTERPRET,
    reason="needs TRITON_INTERPRET=1 from process start; run by tests/test_kernels.py::test_interpreter_suite")

FP32_TOL = 1e-6
FP16_TOL = 2e-3
DTYPES = [torch.float32, torch.float16]


def _leaf(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, dtype=torch.float32)).to(dtype).requires_grad_()


def _forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor,
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    y = fn(*inputs)
    return y, torch.autograd.grad(y, inputs, dy.to(y.dtype))


def _eager_chain(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


@needs_reference_dispatch
def test_geglu_on_the_reference_dispatch_is_the_eager_chain() -> None:
    torch.manual_seed(0)
    gate, up = _leaf(2, 3, 10, dtype=torch.float64, scale=3.0), _leaf(2, 3, 10, dtype=torch.float64)
    dy = torch.randn(2, 3, 10, dtype=torch.float64)
    assert not use_triton(gate)
    y, grads = _forward_backward(geglu, [gate, up], dy)
    want, want_grads = _forward_backward(_eager_chain, [gate, up], dy)
    assert "Mul" in y.grad_fn.name()  # autograd through the chain, no Function of ours
    assert torch.equal(y, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert torch.equal(geglu_reference(gate, up), want)


@needs_reference_dispatch
def test_geglu_packed_on_the_reference_dispatch_is_the_eager_chain_on_the_halves() -> None:
    torch.manual_seed(0)
    y_in = _leaf(2, 3, 20, dtype=torch.float64, scale=3.0)
    dy = torch.randn(2, 3, 10, dtype=torch.float64)
    out, (grad,) = _forward_backward(geglu_packed, [y_in], dy)
    want, (want_grad,) = _forward_backward(lambda t: _eager_chain(t[..., :10], t[..., 10:]), [y_in], dy)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)
    assert torch.equal(geglu_packed_reference(y_in), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_geglu_packed_equals_geglu_on_the_halves(dtype: torch.dtype) -> None:
    """The same values either way (up to rounding: the eager gelu takes another CPU code path on
    a strided half), and the packed gradient is [d_gate | d_up] in y's layout (under the
    interpreter, float32 compares the Triton kernels of both forms)."""
    torch.manual_seed(0)
    packed = _leaf(7, 90, dtype=dtype, scale=3.0)
    gate, up = (half.detach().clone().requires_grad_() for half in packed.chunk(2, dim=-1))
    dy = torch.randn(7, 45, dtype=dtype)
    out, (grad,) = _forward_backward(geglu_packed, [packed], dy)
    want, (d_gate, d_up) = _forward_backward(geglu, [gate, up], dy)
    assert out.shape == (7, 45) and grad.shape == packed.shape
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grad, torch.cat([d_gate, d_up], dim=-1))


def _check_against_reference(fused: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                             inputs: list[torch.Tensor], function_name: str) -> None:
    """Output and input gradients of the Triton path against the reference: fp32 against fp32
    within FP32_TOL, fp16 against float64 within FP16_TOL."""
    dtype = inputs[0].dtype
    dy = torch.randn(fused(*inputs).shape)
    y, grads = _forward_backward(fused, inputs, dy)
    assert function_name in y.grad_fn.name(), f"the Triton path did not run: {y.grad_fn}"
    ref_dtype, tol = (torch.float32, FP32_TOL) if dtype == torch.float32 else (torch.float64, FP16_TOL)
    ref_inputs = [t.detach().to(ref_dtype).requires_grad_() for t in inputs]
    want, want_grads = _forward_backward(reference, ref_inputs, dy.to(ref_dtype))
    assert y.dtype == dtype and y.shape == want.shape
    assert rel_err(y.to(ref_dtype), want) < tol, f"output: {rel_err(y.to(ref_dtype), want):.3g}"
    for i, (got, expected) in enumerate(zip(grads, want_grads)):
        assert got.dtype == dtype
        assert rel_err(got.to(ref_dtype), expected) < tol, f"gradient {i}: {rel_err(got.to(ref_dtype), expected):.3g}"


@under_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geglu_kernels_match_the_reference_under_the_interpreter(dtype: torch.dtype) -> None:
    """7 x 45 = 315 elements: two full blocks of 128 and a partial one; gate values up to ~10,
    out where GELU's sigmoid rounds to 0 or 1 in fp32."""
    torch.manual_seed(0)
    _check_against_reference(geglu, geglu_reference, [_leaf(7, 45, dtype=dtype, scale=3.0), _leaf(7, 45, dtype=dtype)],
                             "GeGLUFunction")


@under_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geglu_packed_kernels_match_the_reference_under_the_interpreter(dtype: torch.dtype) -> None:
    """7 rows of 2 x 45: rows and columns both leave partial tiles; the gradient comes back packed."""
    torch.manual_seed(0)
    _check_against_reference(geglu_packed, geglu_packed_reference, [_leaf(7, 90, dtype=dtype, scale=3.0)],
                             "PackedGeGLUFunction")


@under_the_interpreter
def test_geglu_kernels_return_the_references_dtypes_under_the_interpreter() -> None:
    """An fp16 gate with an fp32 up gives the promoted fp32, as the chain does, each gradient in
    its input's dtype; under autocast, which casts neither op of the chain, nothing changes."""
    torch.manual_seed(0)
    gate, up = _leaf(5, 33, dtype=torch.float16, scale=3.0), _leaf(5, 33, dtype=torch.float32)
    y = geglu(gate, up)
    assert "GeGLUFunction" in y.grad_fn.name() and y.dtype == geglu_reference(gate, up).dtype == torch.float32
    assert rel_err(y.double(), geglu_reference(gate.detach().double(), up.detach().double())) < FP16_TOL
    assert [g.dtype for g in torch.autograd.grad(y, (gate, up), torch.ones_like(y))] == [torch.float16, torch.float32]
    packed = _leaf(5, 66, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.float16):
        for fused, reference, inputs in ((geglu, geglu_reference, (gate, up)),
                                         (geglu, geglu_reference, (up, up)),
                                         (geglu_packed, geglu_packed_reference, (packed,))):
            got = fused(*inputs)
            assert "GeGLUFunction" in got.grad_fn.name() and got.dtype == reference(*inputs).dtype
