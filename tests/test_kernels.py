"""Kernels on the reference dispatch (in process), their byte table, FP8's errors, and the
Triton interpreter suite (tests/test_kernels_interpret.py) run in a subprocess.

What runs here never touches Triton's interpreter: CPU tensors take each op's reference, so
the checks are about the dispatch, the sharded cross-entropy's math (with the reductions
simulated by threads, and on two gloo ranks), FP8's arithmetic through torch._scaled_mm on the
CPU and its refusal to run there through the public op.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import rel_err, run_ranks
from torch.nn.attention import SDPBackend

from mplan.fusion import fused_op_bytes
from mplan.kernels import (
    VocabReductions,
    attention,
    cross_entropy,
    rms_norm_residual,
    rope,
    sdpa_autotune,
    use_triton,
    vocab_parallel_cross_entropy,
)
from mplan.kernels.dispatch import INTERPRET
from mplan.kernels.fp8 import (
    Fp8LinearFunction,
    Fp8ScalingState,
    Fp8Unavailable,
    fp8_linear,
    transformer_engine_available,
)
from mplan.models.layers import RMSNorm, apply_rope, rope_tables

ROOT = Path(__file__).resolve().parent.parent
needs_reference_dispatch = pytest.mark.skipif(INTERPRET, reason="this process runs Triton's interpreter")


@needs_reference_dispatch
def test_cpu_tensors_take_the_reference_and_match_the_model_layers() -> None:
    torch.manual_seed(0)
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    assert not use_triton(x)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    normed, total = rms_norm_residual(x, r, norm.weight, 1e-5)
    assert torch.equal(total, x + r) and torch.equal(normed, norm(x + r))
    cos, sin = rope_tables(3, 8, 10000.0, device=torch.device("cpu"))
    q = torch.randn(2, 4, 3, 8)
    assert torch.equal(rope(q, cos.float(), sin.float()), apply_rope(q, cos.float(), sin.float()))


def test_rope_tables_that_need_gradients_keep_autograd() -> None:
    """The Triton path gives the tables no gradient, so such tables must take the reference."""
    cos, sin = (t.float().requires_grad_() for t in rope_tables(3, 8, 10000.0, device=torch.device("cpu")))
    rope(torch.randn(1, 2, 3, 8), cos, sin).sum().backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0


def _simulated_group(world_size: int) -> list[VocabReductions]:
    """Per-rank reductions over threads: each rank deposits its tensor, all meet, all combine."""
    barrier = threading.Barrier(world_size)
    slots: list[torch.Tensor | None] = [None] * world_size

    def reduction(rank: int, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            slots[rank] = tensor.clone()
            barrier.wait()
            result = slots[0]
            for other in slots[1:]:
                result = combine(result, other)
            barrier.wait()  # nobody overwrites a slot before every rank has combined
            return result

        return reduce

    return [VocabReductions(all_reduce_max=reduction(rank, torch.maximum), all_reduce_sum=reduction(rank, torch.add))
            for rank in range(world_size)]


@needs_reference_dispatch
@pytest.mark.parametrize("bounds", [(0, 70), (0, 33, 70), (0, 10, 41, 70)], ids=["1", "2", "3"])
def test_vocab_parallel_cross_entropy_with_simulated_reductions(bounds: tuple[int, ...]) -> None:
    """Shards of uneven width, labels in every shard, two ignored rows and a row masked (-inf)
    over whole shards: the loss on every rank and the concatenated gradients equal
    F.cross_entropy on the whole logits."""
    torch.manual_seed(0)
    logits = 3.0 * torch.randn(11, 70)
    logits[4, :41] = float("-inf")
    labels = torch.randint(0, 70, (11,))
    labels[4] = 50
    labels[[1, 7]] = -100
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, labels)
    (expected_grad,) = torch.autograd.grad(expected, full)
    shards = list(zip(bounds[:-1], bounds[1:]))
    groups = _simulated_group(len(shards))
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rank_main(rank: int) -> None:
        start, stop = shards[rank]
        local = logits[:, start:stop].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, start, groups[rank])
        results[rank] = (loss.detach(), torch.autograd.grad(loss, local)[0])

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank in range(len(shards)):
        assert rel_err(results[rank][0], expected.detach()) < 1e-6
    grad = torch.cat([results[rank][1] for rank in range(len(shards))], dim=1)
    assert rel_err(grad, expected_grad) < 1e-6
    assert grad[[1, 7]].abs().max() == 0


@needs_reference_dispatch
def test_cross_entropy_reference_is_chunked_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch local math walks rows in chunks; a chunk of 2 rows changes nothing."""
    import mplan.kernels.cross_entropy_loss as module

    torch.manual_seed(0)
    logits, labels = torch.randn(9, 40), torch.randint(0, 40, (9,))
    whole = vocab_parallel_cross_entropy(logits, labels, 0, VocabReductions.identity())
    monkeypatch.setattr(module, "TORCH_CHUNK_ELEMENTS", 80)
    chunked = vocab_parallel_cross_entropy(logits, labels, 0, VocabReductions.identity())
    assert rel_err(chunked, whole) < 1e-7
    assert rel_err(whole, cross_entropy(logits, labels)) < 1e-6


def _sharded_cross_entropy_float64() -> tuple[float, float]:
    torch.manual_seed(0)
    logits, labels = 2.0 * torch.randn(6, 50), torch.randint(0, 50, (6,))
    start, stop = (0, 20) if dist.get_rank() == 0 else (20, 50)
    local = logits[:, start:stop].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, start, group=None)
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, labels)
    return (rel_err(loss, expected),
            rel_err(torch.autograd.grad(loss, local)[0], torch.autograd.grad(expected, full)[0][:, start:stop]))


@needs_reference_dispatch
@pytest.mark.distributed
def test_vocab_parallel_cross_entropy_on_two_gloo_ranks_float64() -> None:
    for loss_err, grad_err in run_ranks(2, _sharded_cross_entropy_float64, timeout_s=60):
        assert loss_err < 1e-12 and grad_err < 1e-12


def test_fused_op_bytes_at_the_h200_reference_shapes() -> None:
    tokens, hidden, bf16 = 16384, 4096, 2
    forward = fused_op_bytes("rms_norm_residual", num_rows=tokens, row_size=hidden, itemsize=bf16)
    # x, residual read; normed, new_residual written; the weight; one fp32 rstd per row
    assert forward == 4 * tokens * hidden * bf16 + hidden * bf16 + 4 * tokens
    assert fused_op_bytes("swiglu", num_rows=tokens, row_size=14336, itemsize=bf16, backward=True) == (
        5 * tokens * 14336 * bf16)
    # RoPE on [4, 32, 4096, 128]: x read, y written, cos/sin tables [4096, 128]
    assert fused_op_bytes("rope", num_rows=4 * 32 * 4096, row_size=128, itemsize=bf16, table_rows=4096) == (
        2 * 4 * 32 * 4096 * 128 * bf16 + 2 * 4096 * 128 * bf16)
    assert fused_op_bytes("cross_entropy", num_rows=4096, row_size=128256, itemsize=bf16) == (
        4096 * 128256 * bf16 + 5 * 4 * 4096)
    with pytest.raises(KeyError, match="no fused kernel 'softmax'"):
        fused_op_bytes("softmax", num_rows=1, row_size=1, itemsize=2)
    with pytest.raises(KeyError, match="priced as its ATen ops"):
        fused_op_bytes("attention", num_rows=1, row_size=1, itemsize=2)


def test_fp8_linear_refuses_the_cpu_naming_why() -> None:
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    with pytest.raises(Fp8Unavailable, match=r"CUDA device of compute capability >= 8\.9, not cpu"):
        fp8_linear(x, w, None, Fp8ScalingState())


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_fp8_arithmetic_through_scaled_mm_on_the_cpu() -> None:
    """The recipe itself (delayed scaling, e4m3 forward, e5m2 gradients) against fp32 linear:
    e4m3 keeps 3 mantissa bits, e5m2 2, so errors of a few percent and no more."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = (0.1 * torch.randn(48, 32)).requires_grad_()
    b = torch.randn(48, requires_grad=True)
    state = Fp8ScalingState()
    for step in range(2):  # the second step scales by the amax recorded in the first
        y = Fp8LinearFunction.apply(x, w, b, state)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, w, b), dy)
        expected = F.linear(x, w, b)
        expected_grads = torch.autograd.grad(expected, (x, w, b), dy)
        assert rel_err(y, expected) < 0.04, step
        assert rel_err(grads[0], expected_grads[0]) < 0.1 and rel_err(grads[1], expected_grads[1]) < 0.1
        assert torch.equal(grads[2], expected_grads[2])
        assert state.amax[0] == x.abs().max() and state.amax[1] == w.abs().max()
        assert state.amax[2] == dy.abs().max()


def test_transformer_engine_is_reported_unavailable_with_a_reason() -> None:
    available, reason = transformer_engine_available()
    assert available is False and "transformer-engine" in reason


INTERPRETED = {
    # file: the -k selection of its tests that run Triton under the interpreter
    "tests/test_kernels_interpret.py": "test_kernels_interpret",
    "tests/test_rope_qk.py": "interpreted",
    "tests/test_geglu.py": "under_the_interpreter or (on_the_halves and float32)",
    "tests/test_linear_cross_entropy.py": "interpreted",
    "tests/test_fusion_forms.py": "interpreted",
    "tests/test_fusion_rope_forms.py": "interpreted",
    "tests/test_fusion_norm_forms.py": "interpreted",
}


def _junit_outcomes(path: str) -> dict[tuple[str, str], str]:
    """(file, test name with its parameters) -> passed / failed / error / skipped, from a JUnit report."""
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[(file, case.get("name", ""))] = kinds[0] if kinds else "passed"
    return outcomes


def _test_functions(file: str) -> list[str]:
    tree = ast.parse(Path(ROOT, file).read_text(encoding="utf-8"))
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


@pytest.mark.slow
@needs_reference_dispatch
def test_interpreter_suite() -> None:
    """Every kernel file's interpreted tests, in one fresh process with TRITON_INTERPRET=1 (the
    mode is fixed when Triton is imported; one process pays the imports once)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    selection = " or ".join(f"({expr})" for expr in INTERPRETED.values())
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "interpreted.xml")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERPRETED,
                              "-k", selection, f"--junitxml={report}"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=400)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        outcomes = _junit_outcomes(report)
    # every test the selection ran passed: none skipped, none xfailed, none errored
    assert outcomes and set(outcomes.values()) == {"passed"}, {k: v for k, v in outcomes.items() if v != "passed"}
    # and every test the suite names ran: all of test_kernels_interpret.py's, and each other file's
    # tests named for the interpreter (a renamed or deselected one would drop out silently)
    ran = {(file, name.partition("[")[0]) for file, name in outcomes}
    named = {(file, name) for file in INTERPRETED for name in _test_functions(file)
             if file.endswith("test_kernels_interpret.py") or "interpret" in name}
    assert named and named <= ran, sorted(named - ran)


def test_everything_imports_and_runs_its_reference_without_triton() -> None:
    """Platforms without a Triton wheel (macOS) still import the kernels and the pass."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from mplan.kernels import cross_entropy, rms_norm_residual, swiglu\n"
        "from mplan.kernels.dispatch import HAVE_TRITON\n"
        "from mplan.passes.fuse_kernels import fuse_kernels\n"
        "x = torch.ones(2, 8)\n"
        "assert not HAVE_TRITON\n"
        "assert torch.equal(rms_norm_residual(x, x, torch.ones(8), 0.0)[0], torch.ones(2, 8))\n"
        "assert torch.equal(swiglu(x, x), torch.nn.functional.silu(x))\n"
        "print(float(cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100]))))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert abs(float(run.stdout.strip()) - float(torch.log(torch.tensor(4.0)))) < 1e-6


def test_attention_runs_the_fastest_backend_that_can_run_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backend timings faked (they need a GPU): the fastest that ran wins, one that could not run
    is left out, and a case none can run is left to PyTorch's own choice."""
    timings = {SDPBackend.CUDNN_ATTENTION: None, SDPBackend.FLASH_ATTENTION: 2.0, SDPBackend.EFFICIENT_ATTENTION: 1.5}
    monkeypatch.setattr(sdpa_autotune, "_TUNED", {})
    monkeypatch.setattr(sdpa_autotune, "_time_backend", lambda backend, case: timings[backend])
    case = sdpa_autotune.AttentionCase(shapes=((2, 4, 16, 8),) * 3, strides=((512, 8, 32, 1),) * 3,
                                       dtype=torch.bfloat16, device=torch.device("cuda", 0), is_causal=True,
                                       scale=None, enable_gqa=False, backward=True)
    choice = sdpa_autotune.fastest_backend(case)
    assert choice.backend == SDPBackend.EFFICIENT_ATTENTION
    assert choice.milliseconds == {"FLASH_ATTENTION": 2.0, "EFFICIENT_ATTENTION": 1.5}
    assert sdpa_autotune.tuned_cases() == [(case, choice)]
    monkeypatch.setattr(sdpa_autotune, "_time_backend", lambda backend, case: None)
    assert sdpa_autotune.fastest_backend(dataclasses.replace(case, is_causal=False)).backend is None
    # q/k/v arrive as transposes of [batch, seq, heads, head_dim]: tuning tensors take that layout
    assert sdpa_autotune._dense((2, 4, 16, 8), (512, 8, 32, 1)) and not sdpa_autotune._dense((2, 4, 16, 8), (1536, 8, 96, 1))


def test_attention_on_the_cpu_is_sdpa_itself() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    assert torch.equal(attention(q, k, v, is_causal=True, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
