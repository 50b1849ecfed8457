"""Context attention's CUDA kernels are trusted only after their own check (`fused_attention`).

The CUDA kernels' calls rest on torch's private op schema (None cum_seq tensors for a dense
batch, the philox tensors unread at dropout 0, cuDNN's [B, H, S, 1] log-sum-exp), so the first
call per device, dtype and head size checks a small block against float32 math, cuDNN's kernels
first and flash's next, and falls back to the reference path, with a warning, where both fail. No GPU here: the check's own logic runs on the CPU's
kernels (bf16 inputs upcast to float32 and cast back for the kernel, as on CUDA), a doctored
kernel makes it fail, and a CUDA device that cannot run it gets the reference path.
"""
from __future__ import annotations

import pytest
import torch

from mplan.collectives import fused_attention
from mplan.collectives.fused_attention import Piece, _check_block, attend, attend_backward, kernel_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_passes_on_kernels_that_compute_right(dtype: torch.dtype) -> None:
    """A full piece, a causal one and a second full one over 2 heads: the CPU flash kernels, run
    in `dtype` from float32 inputs, agree with float32 math on outputs, log-sum-exp and gradients."""
    assert _check_block(torch.device("cpu"), dtype, 64)


def test_the_check_holds_inside_an_inference_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attention call may come from `pm(inputs)` under no_grad: the check takes its own
    gradients all the same (here on the CPU's kernels, through the path a CUDA device takes)."""
    monkeypatch.setattr(fused_attention, "_BACKEND", {})
    with torch.no_grad():
        assert fused_attention._cuda_checked(torch.device("cpu"), torch.bfloat16, 32)


def test_the_check_fails_on_a_kernel_whose_log_sum_exp_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that returns its log-sum-exp off by 0.1 (a misread schema would do worse) fails it."""
    forward = fused_attention._forward
    monkeypatch.setattr(fused_attention, "_forward", lambda *args: (lambda out, lse: (out, lse + 0.1))(*forward(*args)))
    assert not _check_block(torch.device("cpu"), torch.float32, 64)


def test_a_cuda_device_whose_check_cannot_run_gets_the_reference_path_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Here the check raises (no CUDA): kernel_dtype says None, once warned, cached; float32 inputs
    and head sizes flash does not take never get the kernel."""
    monkeypatch.setattr(fused_attention, "_BACKEND", {})
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="CUDA kernels failed their check .*cudnn: .*; flash: .* the reference path runs"):
        assert kernel_dtype(cuda, torch.float32, torch.bfloat16, 64) is None
    assert kernel_dtype(cuda, torch.float32, torch.bfloat16, 64) is None  # cached: no second warning
    assert len(fused_attention._BACKEND) == 1
    assert kernel_dtype(cuda, torch.float32, torch.float32, 64) is None
    assert kernel_dtype(cuda, torch.bfloat16, torch.bfloat16, 260) is None and len(fused_attention._BACKEND) == 1


def test_pieces_in_a_narrower_kernel_dtype_merge_and_differentiate_in_the_callers() -> None:
    """attend/attend_backward with `kernel` narrower than q (float64 inputs, float32 kernels):
    results come back in q's dtype and within float32 rounding of the same calls in float64."""
    generator = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(1, 4, rows, 16, dtype=torch.float64, generator=generator) for rows in (24, 40, 40, 24))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 kv heads for 4 query heads
    calls = (Piece((0, 8), ((0, 16),), False), Piece((8, 24), ((16, 32),), True))
    wide = attend(q, k, v, calls, 0.25)
    narrow = attend(q, k, v, calls, 0.25, kernel=torch.float32)
    assert narrow[0].dtype == torch.float64 and narrow[1].dtype == torch.float64
    for got, want in zip(narrow, wide):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    wide_grads = attend_backward(q, k, v, calls, 0.25, grad, *wide)
    narrow_grads = attend_backward(q, k, v, calls, 0.25, grad, *wide, kernel=torch.float32)
    for got, want in zip(narrow_grads, wide_grads):
        assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_backend_that_fails_its_check_gives_way_to_the_next_without_a_warning(
        monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder) -> None:
    """cuDNN's kernels failing the check (here: the check itself reports the trial of "cudnn" wrong)
    leave flash's to run, said by `cuda_backend`, silently (a slower kernel is no wrong result);
    pinning a backend re-checks it, and an unknown name is refused."""
    monkeypatch.setattr(fused_attention, "_BACKEND", {})
    check = fused_attention._check_block

    def cudnn_wrong(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        return fused_attention._BACKEND[(device, dtype, head_dim)] != "cudnn" and check(device, dtype, head_dim)
    monkeypatch.setattr(fused_attention, "_check_block", cudnn_wrong)
    cpu = torch.device("cpu")
    assert fused_attention.cuda_backend(cpu, torch.bfloat16, 32) == "flash"
    assert not [w for w in recwarn if "mplan" in str(w.message)]
    assert fused_attention.use_cuda_backend(cpu, torch.bfloat16, 32, "cudnn") is not None
    assert fused_attention.cuda_backend(cpu, torch.bfloat16, 32) is None
    assert fused_attention.use_cuda_backend(cpu, torch.bfloat16, 32, "flash") is None
    assert fused_attention.cuda_backend(cpu, torch.bfloat16, 32) == "flash"
    with pytest.raises(ValueError, match="unknown CUDA attention backend 'math'"):
        fused_attention.use_cuda_backend(cpu, torch.bfloat16, 32, "math")
