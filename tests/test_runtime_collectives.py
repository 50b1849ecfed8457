"""Conjugate collectives against single-process references, on gloo ranks in float64.

Every rank builds the full model from the same seed, runs it alone as the reference, then
runs its shard through the collectives; forward outputs and the gradients of inputs and
weights must match the reference's (its chunk, where sharded).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import rel_err, run_checks
from mplan.collectives.redistribute import (
    all_to_all,
    copy_to_region,
    gather_from_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_to_region,
)

TOLERANCE = 1e-12


def _chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    n, rank = dist.get_world_size(), dist.get_rank()
    return x.chunk(n, dim)[rank]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _mlp_weights(hidden: int, ffn: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(ffn, hidden, generator=gen), "b1": torch.randn(ffn, generator=gen),
        "w2": torch.randn(hidden, ffn, generator=gen), "b2": torch.randn(hidden, generator=gen),
    }


def _assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
    error = rel_err(actual, expected)
    assert error < TOLERANCE, f"{name}: relative error {error:.3e}"
    return error


def check_column_then_row_parallel_mlp() -> float:
    """copy_to_region -> column-parallel -> row-parallel -> reduce_from_region == the MLP."""
    n = dist.get_world_size()
    full = {k: _leaf(v) for k, v in _mlp_weights(hidden=6, ffn=4 * n).items()}
    x_data = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    x_ref = _leaf(x_data)
    y_ref = F.linear(F.gelu(F.linear(x_ref, full["w1"], full["b1"])), full["w2"]) + full["b2"]
    (y_ref * probe).sum().backward()

    group = dist.group.WORLD
    # Column-parallel shards w1/b1 by output rows, row-parallel shards w2 by input columns.
    w1, b1 = _leaf(_chunk(full["w1"], 0)), _leaf(_chunk(full["b1"], 0))
    w2, b2 = _leaf(_chunk(full["w2"], 1)), _leaf(full["b2"])
    x = _leaf(x_data)
    hidden = F.gelu(F.linear(copy_to_region(x, group), w1, b1))
    y = reduce_from_region(F.linear(hidden, w2), group) + b2
    (y * probe).sum().backward()
    return max(
        _assert_close("y", y, y_ref), _assert_close("x.grad", x.grad, x_ref.grad),
        _assert_close("w1.grad", w1.grad, _chunk(full["w1"].grad, 0)),
        _assert_close("b1.grad", b1.grad, _chunk(full["b1"].grad, 0)),
        _assert_close("w2.grad", w2.grad, _chunk(full["w2"].grad, 1)),
        _assert_close("b2.grad", b2.grad, full["b2"].grad),
    )


def check_gather_output_then_scatter_input() -> float:
    """Column-parallel with gathered output, then row-parallel that scatters its input."""
    n = dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    w1_full, w2_full = _leaf(torch.randn(2 * n, 3, generator=gen)), _leaf(torch.randn(4, 2 * n, generator=gen))
    x_data, probe = torch.randn(7, 3, generator=gen), torch.randn(7, 4, generator=gen)
    x_ref = _leaf(x_data)
    y_ref = torch.tanh(x_ref @ w1_full.t()) @ w2_full.t()
    (y_ref * probe).sum().backward()

    group = dist.group.WORLD
    w1, w2, x = _leaf(_chunk(w1_full, 0)), _leaf(_chunk(w2_full, 1)), _leaf(x_data)
    replicated = torch.tanh(gather_from_region(copy_to_region(x, group) @ w1.t(), group, dim=-1))
    y = reduce_from_region(scatter_to_region(replicated, group, dim=-1) @ w2.t(), group)
    (y * probe).sum().backward()
    # tanh on the gathered activations runs identically on every rank, so its gradient
    # reaching gather_from_region is replicated and the split backward is exact.
    return max(
        _assert_close("y", y, y_ref), _assert_close("x.grad", x.grad, x_ref.grad),
        _assert_close("w1.grad", w1.grad, _chunk(w1_full.grad, 0)),
        _assert_close("w2.grad", w2.grad, _chunk(w2_full.grad, 1)),
    )


def check_sequence_parallel_mlp() -> float:
    """LayerNorm on sequence shards -> gather_sequence -> MLP -> reduce_scatter_sequence."""
    n = dist.get_world_size()
    seq, batch, hidden = 2 * n, 3, 6
    full = {k: _leaf(v) for k, v in _mlp_weights(hidden=hidden, ffn=2 * n).items()}
    gen = torch.Generator().manual_seed(4)
    norm_w_data = torch.randn(hidden, generator=gen)
    # Sequence-first like Megatron, and transposed in memory: the collectives must accept it.
    x_data = torch.randn(batch, seq, hidden, generator=gen).transpose(0, 1)
    probe = torch.randn(seq, batch, hidden, generator=gen)

    x_ref, norm_w_ref = _leaf(x_data), _leaf(norm_w_data)
    h_ref = F.layer_norm(x_ref, (hidden,), norm_w_ref)
    y_ref = F.linear(F.gelu(F.linear(h_ref, full["w1"], full["b1"])), full["w2"]) + full["b2"]
    (y_ref * probe).sum().backward()

    group = dist.group.WORLD
    x, norm_w = _leaf(_chunk(x_data, 0)), _leaf(norm_w_data)
    w1, b1 = _leaf(_chunk(full["w1"], 0)), _leaf(_chunk(full["b1"], 0))
    w2, b2 = _leaf(_chunk(full["w2"], 1)), _leaf(full["b2"])
    h = gather_sequence(F.layer_norm(x, (hidden,), norm_w), group, dim=0)
    y = reduce_scatter_sequence(F.linear(F.gelu(F.linear(h, w1, b1)), w2), group, dim=0) + b2
    (y * _chunk(probe, 0)).sum().backward()
    # Replicated weights applied to sequence shards see only their shard's tokens: their
    # gradients are partial sums (the `tp_reduce` flag of data_parallel.py exists for this).
    dist.all_reduce(norm_w.grad)
    dist.all_reduce(b2.grad)
    return max(
        _assert_close("y", y, _chunk(y_ref, 0)),
        _assert_close("x.grad", x.grad, _chunk(x_ref.grad, 0)),
        _assert_close("norm_w.grad", norm_w.grad, norm_w_ref.grad),
        _assert_close("w1.grad", w1.grad, _chunk(full["w1"].grad, 0)),
        _assert_close("b1.grad", b1.grad, _chunk(full["b1"].grad, 0)),
        _assert_close("w2.grad", w2.grad, _chunk(full["w2"].grad, 1)),
        _assert_close("b2.grad", b2.grad, full["b2"].grad),
    )


def check_all_to_all_forward_backward_round_trip() -> float:
    """all_to_all is the chunk exchange; its backward is the inverse exchange."""
    n, rank = dist.get_world_size(), dist.get_rank()
    split_dim, concat_dim = 0, 2
    inputs = [_leaf(torch.randn(2 * n, 3, 5, generator=torch.Generator().manual_seed(10 + r)))
              for r in range(n)]
    probes = [torch.randn(2, 3, 5 * n, generator=torch.Generator().manual_seed(20 + r))
              for r in range(n)]
    # Reference: rank j receives chunk j of every rank's input, concatenated in rank order.
    outputs_ref = [torch.cat([x.chunk(n, split_dim)[j] for x in inputs], concat_dim) for j in range(n)]
    sum((y * p).sum() for y, p in zip(outputs_ref, probes)).backward()

    x = _leaf(inputs[rank].detach().transpose(1, 2).contiguous().transpose(1, 2))
    y = all_to_all(x, dist.group.WORLD, split_dim, concat_dim)
    back = all_to_all(y, dist.group.WORLD, concat_dim, split_dim)
    (y * probes[rank]).sum().backward()
    assert torch.equal(back, x), "all_to_all back along the swapped dims must restore the input"
    return max(
        _assert_close("y", y, outputs_ref[rank]),
        _assert_close("x.grad", x.grad, inputs[rank].grad),
    )


def check_indivisible_size_is_an_error() -> str:
    x = torch.randn(2 * dist.get_world_size() + 1, 2)
    with pytest.raises(ValueError, match="not divisible by the group size") as error:
        reduce_scatter_sequence(x, dist.group.WORLD, dim=0)
    return str(error.value)


CHECKS = [
    check_column_then_row_parallel_mlp,
    check_gather_output_then_scatter_input,
    check_sequence_parallel_mlp,
    check_all_to_all_forward_backward_round_trip,
    check_indivisible_size_is_an_error,
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def outcomes(request: pytest.FixtureRequest):
    return run_checks(request.param, CHECKS)


@pytest.mark.distributed
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_distributed(outcomes, check) -> None:
    outcomes.assert_passed(check)


def test_group_of_one_is_the_identity_without_autograd_node() -> None:
    x = torch.randn(4, 2, requires_grad=True)
    for collective in (copy_to_region, reduce_from_region, gather_sequence, reduce_scatter_sequence):
        assert collective(x, None) is x
    assert scatter_to_region(x, None, 0) is x and gather_from_region(x, None, 0) is x
    assert all_to_all(x, None, 0, 1) is x
