"""Graph-timed calls read operands the call before did not leave in L2: rotated operand copies.

A graph of `n` calls on one set of operands finds a mid-sized GEMM's (8 MB of activations against a
24 MB weight) in the H100's 50 MB L2 from the call before; 1.7B steps at micro-batch 1 replayed as
graphs ran 12-17% slower than priced from such a profile. So call i of a graph reads copy i % k,
the k copies together at least twice the L2 (`operand_copies`). No GPU here: the capture is a fake
that records which copy each captured call read.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mplan.cost_models import measure_device
from mplan.cost_models.measure_device import (DEFAULT_L2_BYTES, L2_FLUSH_FACTOR, MAX_COPY_BYTES, MAX_GRAPH_CALLS,
                                              MedianTimer, OperandCopies, l2_cache_bytes, operand_copies,
                                              profile_device)
from mplan.cost_models.profile import NO_L2_FLUSH, ClusterProfile, ProfileError

MiB = 2**20
H100_L2 = 50 * MiB


def test_copies_together_reach_twice_the_l2_and_no_further() -> None:
    # 2048 tokens x 2048 hidden bf16 (8 MiB) against a 2048 x 6144 weight (24 MiB): 3 x 32 < 100 <= 4 x 32
    assert operand_copies(32 * MiB, H100_L2, calls=13) == 4
    assert operand_copies(2 * H100_L2, H100_L2, calls=64) == 1  # one call already reads twice the L2
    assert operand_copies((256 + 128) * MiB, H100_L2, calls=1) == 1  # 16384 x 8192 @ 8192 x 8192 bf16
    assert operand_copies(0, H100_L2, calls=64) == 1  # bytes unknown: never copied
    for bytes_read in [2**p for p in range(10, 32)] + [3 * 2**p for p in range(10, 30)]:
        k = operand_copies(bytes_read, H100_L2, calls=10**6)
        assert k * bytes_read >= L2_FLUSH_FACTOR * H100_L2
        assert k == 1 or (k - 1) * bytes_read < L2_FLUSH_FACTOR * H100_L2  # the fewest that do


def test_small_operands_get_one_copy_per_call_and_no_more() -> None:
    assert operand_copies(128 * 1024, H100_L2, calls=MAX_GRAPH_CALLS) == MAX_GRAPH_CALLS  # 256 x 256 bf16 pair
    assert operand_copies(128 * 1024, H100_L2, calls=13) == 13  # a copy past the calls would never be read
    sweep = [operand_copies(2**p, H100_L2, calls=MAX_GRAPH_CALLS) for p in range(10, 32)]
    assert sweep == sorted(sweep, reverse=True) and sweep[0] == MAX_GRAPH_CALLS and sweep[-1] == 1


def test_the_copies_beyond_the_original_stay_under_the_memory_cap() -> None:
    huge_l2 = 8 * 2**30  # an L2 this large wants 256 copies of 64 MiB: 16 GiB
    k = operand_copies(64 * MiB, huge_l2, calls=MAX_GRAPH_CALLS)
    assert k == 1 + MAX_COPY_BYTES // (64 * MiB) == 17
    for bytes_read in (MiB, 100 * MiB, 700 * MiB, 2 * 2**30):
        assert (operand_copies(bytes_read, huge_l2, calls=MAX_GRAPH_CALLS) - 1) * bytes_read <= MAX_COPY_BYTES


@dataclass
class RecordingGraphs:
    """A `Capture` that runs the calls it is given once, in order, each replay taking 5 us a call."""

    captured: list[int] = field(default_factory=list)  # number of calls of each capture

    @contextlib.contextmanager
    def __call__(self, calls: Sequence[Callable[[], object]]) -> Iterator[Callable[[int], list[float]]]:
        self.captured.append(len(calls))
        for call in calls:
            call()
        yield lambda count: [len(calls) * 5e-6] * count


@dataclass
class LoggedCopies:
    """`OperandCopies` whose calls log the copy they read; `made` lists the copies allocated."""

    bytes_read: int
    read: list[int] = field(default_factory=list)
    made: list[int] = field(default_factory=list)

    def copies(self) -> OperandCopies:
        def call_on(copy: int) -> Callable[[], object]:
            self.made.append(copy)
            return lambda: self.read.append(copy)
        return OperandCopies(call_on=call_on, bytes_read=self.bytes_read)


def _time(bytes_read: int) -> tuple[LoggedCopies, RecordingGraphs, float]:
    logged, graphs = LoggedCopies(bytes_read), RecordingGraphs()
    seconds = MedianTimer(torch, torch.device("cpu"), 1e-3, capture=graphs, l2_bytes=H100_L2)(logged.copies())
    return logged, graphs, seconds


def test_each_captured_call_reads_the_next_copy_in_rotation() -> None:
    logged, graphs, seconds = _time(32 * MiB)
    assert seconds == pytest.approx(5e-6)
    assert graphs.captured == [MAX_GRAPH_CALLS]  # a logging call is far below a millisecond
    eager, captured = logged.read[:3], logged.read[3:]  # two warm-ups and the eager estimate first
    assert eager == [0, 0, 0]  # the original operands
    assert captured == [i % 4 for i in range(MAX_GRAPH_CALLS)]
    assert sorted(set(logged.made)) == [0, 1, 2, 3] and logged.made.count(2) == 1  # each copy allocated once


def test_small_operands_are_never_read_twice_in_one_replay() -> None:
    logged, _, _ = _time(MiB)
    assert logged.read[3:] == list(range(MAX_GRAPH_CALLS))


def test_operands_above_twice_the_l2_are_not_copied() -> None:
    logged, _, _ = _time(200 * MiB)
    assert set(logged.made) == {0} and logged.read == [0] * (3 + MAX_GRAPH_CALLS)


def test_a_gemm_copy_is_another_pair_of_operands_of_the_same_shapes() -> None:
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    copies = measure_device._gemm_copies(torch, a, b)
    assert copies.bytes_read == (8 * 4 + 4 * 6) * 4
    assert torch.equal(copies.call_on(0)(), a @ b)
    other = copies.call_on(1)()
    assert other.shape == (8, 6) and other.dtype == a.dtype and not torch.allclose(other, a @ b)


def test_an_attention_copy_takes_its_own_gradients() -> None:
    q, k, v, grad = (torch.randn(1, 2, 8, 4, requires_grad=i < 3) for i in range(4))
    forward, forward_backward = measure_device._attention_copies(torch, q, k, v, grad, causal=True)
    assert (forward.bytes_read, forward_backward.bytes_read) == (3 * 64 * 4, 4 * 64 * 4)
    forward_backward.call_on(1)()
    assert q.grad is None and k.grad is None and v.grad is None  # copy 1's backward leaves the originals alone
    forward_backward.call_on(0)()
    grads = [t.grad.clone() for t in (q, k, v)]
    forward_backward.call_on(1)()  # nor does it reset theirs
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads))
    assert forward.call_on(2)().shape == q.shape


def _cuda_reporting(**properties: int) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(get_device_properties=lambda _device: SimpleNamespace(**properties)))


def test_the_l2_size_is_the_devices_where_it_reports_one() -> None:
    cuda = torch.device("cuda", 0)
    assert l2_cache_bytes(_cuda_reporting(L2_cache_size=52428800), cuda) == (52428800, "reported by the device")
    assert l2_cache_bytes(_cuda_reporting(), cuda)[0] == DEFAULT_L2_BYTES == H100_L2
    assert l2_cache_bytes(_cuda_reporting(L2_cache_size=0), cuda)[0] == DEFAULT_L2_BYTES
    assert l2_cache_bytes(torch, torch.device("cpu")) == (DEFAULT_L2_BYTES, "default, the device reports none")


def test_the_profile_records_the_rotation_and_round_trips(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    graphs = RecordingGraphs()
    monkeypatch.setattr(measure_device, "_graph_capture", lambda _torch, _device: graphs)
    device = profile_device("cpu", quick=True)
    assert device.l2_flush == ("rotated operands: call i of a graph reads copy i % k, k copies >= 2 x L2 "
                               "(50 MiB, default, the device reports none); k at most the graph's calls "
                               "and 1 GiB of copies")
    path = tmp_path / "profile.json"
    ClusterProfile(device=device).to_json(str(path))
    assert ClusterProfile.from_json(str(path)).device == device


def test_a_profile_timed_without_graphs_says_no_flush() -> None:
    assert profile_device("cpu", quick=True).l2_flush == NO_L2_FLUSH


def test_a_profile_written_before_the_rotation_loads_as_unflushed() -> None:
    obj = ClusterProfile(device=profile_device("cpu", quick=True)).to_dict()
    del obj["device"]["l2_flush"]
    assert ClusterProfile.from_dict(obj).device.l2_flush == NO_L2_FLUSH
    obj["device"]["l2_flush"] = 2
    with pytest.raises(ProfileError, match="device.l2_flush must be a string"):
        ClusterProfile.from_dict(json.loads(json.dumps(obj)))
