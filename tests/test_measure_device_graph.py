"""Kernel timings free of the host's launch: graph capture, per-call division, fallback, the file.

On a GPU, `MedianTimer` times a GEMM or attention call as replays of a CUDA graph of `n` calls, over
`n`: CUDA events around one eager call time a kernel shorter than its launch at the launch (the
H100 profile of 2026-12-05 priced no GEMM under ~36 us). No GPU here: the capture is a fake passed
to the timer (`FakeGraphs`), and `CudaGraphCapture` runs against a fake `torch.cuda` that logs the
order of its calls (`FakeCuda`).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from mplan.cost_models import measure_device
from mplan.cost_models.measure_device import (CAPTURE_WARMUP, GRAPH_REPLAY_S, MAX_GRAPH_CALLS, CudaGraphCapture,
                                              MedianTimer, graph_calls, profile_device)
from mplan.cost_models.profile import ClusterProfile, DeviceProfile, EagerFallback, GemmTiming, ProfileError

PER_CALL_S = 5e-6


@dataclass
class FakeGraphs:
    """A `Capture` whose replays take `calls * PER_CALL_S` (one replay in each batch 10x slower, so
    only a median gives PER_CALL_S back); the captures numbered in `fail_at` raise `error`."""

    fail_at: tuple[int, ...] = ()
    error: Exception = field(default_factory=lambda: RuntimeError("operation not permitted when stream is capturing"))
    captured: list[int] = field(default_factory=list)  # calls of each capture tried
    released: int = 0

    @contextlib.contextmanager
    def __call__(self, calls: Sequence[Callable[[], object]]) -> Iterator[Callable[[int], list[float]]]:
        self.captured.append(len(calls))
        if len(self.captured) - 1 in self.fail_at:
            raise self.error
        for call in calls:
            call()
        n = len(calls)
        try:
            yield lambda count: [10 * n * PER_CALL_S] + [n * PER_CALL_S] * (count - 1)
        finally:
            self.released += 1


def _timer(graphs: FakeGraphs) -> MedianTimer:
    return MedianTimer(torch, torch.device("cpu"), 1e-3, capture=graphs)


def test_a_graph_holds_enough_calls_for_a_millisecond_and_no_more() -> None:
    assert graph_calls(40e-6) == 25  # a tiny GEMM at the H100's launch floor
    assert graph_calls(0.3e-3) == 4
    assert graph_calls(1e-6) == graph_calls(0.0) == MAX_GRAPH_CALLS
    assert graph_calls(GRAPH_REPLAY_S) == graph_calls(3e-3) == graph_calls(2.0) == 1  # big calls alone
    sweep = [10 ** (e / 10) for e in range(-70, 10)]
    calls = [graph_calls(s) for s in sweep]
    assert calls == sorted(calls, reverse=True) and min(calls) >= 1
    assert all(n * s <= GRAPH_REPLAY_S + s for n, s in zip(calls, sweep))  # the pool holds ~1 ms of work


def test_a_captured_call_is_priced_per_call_not_per_replay() -> None:
    graphs, count = FakeGraphs(), []
    seconds = _timer(graphs)(lambda: count.append(1))
    assert seconds == pytest.approx(PER_CALL_S)
    calls = graphs.captured[0]
    assert graphs.captured == [calls] and calls > 1  # a no-op's eager call is far below a millisecond
    assert len(count) == 3 + calls  # two warm-ups, the eager estimate, the captured calls
    assert graphs.released == 1


def test_a_call_of_milliseconds_is_captured_alone() -> None:
    graphs = FakeGraphs()
    _timer(graphs)(lambda: time.sleep(3e-3))
    assert graphs.captured == [1]


def test_a_failed_capture_is_timed_eagerly_and_recorded() -> None:
    graphs = FakeGraphs(fail_at=(0,), error=RuntimeError("CUDA error: operation not permitted when stream is "
                                                         "capturing\nCUDA kernel errors might be reported later"))
    timer = _timer(graphs)
    seconds = timer(lambda: time.sleep(2e-3), entry="gemm m=512 n=256 k=256 bf16")
    assert seconds >= 2e-3  # the host's clock around one call, not the fake's 5 us
    assert timer.eager_fallbacks == [EagerFallback(
        entry="gemm m=512 n=256 k=256 bf16",
        reason="RuntimeError: CUDA error: operation not permitted when stream is capturing")]
    assert timer(lambda: None, entry="next") == pytest.approx(PER_CALL_S)  # one failure spoils no other entry
    assert len(timer.eager_fallbacks) == 1


def test_out_of_memory_in_a_capture_falls_back_too() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    timer = _timer(FakeGraphs(fail_at=(0,), error=oom))
    timer(lambda: None, entry="attention forward+backward b=4 h=32 s=16384 d=128 bf16")
    assert timer.eager_fallbacks[0].reason == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_an_error_that_is_no_capture_failure_is_not_swallowed() -> None:
    with pytest.raises(ValueError, match="a bug"):
        _timer(FakeGraphs(fail_at=(0,), error=ValueError("a bug")))(lambda: None)


def test_calls_that_time_themselves_are_never_captured() -> None:
    graphs = FakeGraphs()
    assert _timer(graphs)(lambda: 0.25, timed=False) == 0.25
    assert graphs.captured == []


def test_the_profile_names_its_method_and_the_entries_timed_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The quick grid's order: 8 GEMMs, then per attention sequence its forward and forward+backward.
    graphs = FakeGraphs(fail_at=(9,))
    monkeypatch.setattr(measure_device, "_graph_capture", lambda _torch, _device: graphs)
    profile = profile_device("cpu", quick=True)
    assert profile.timing == "cuda_graph_replay"
    assert profile.eager_fallbacks == (EagerFallback(
        entry="attention forward+backward b=1 h=2 s=32 d=16 fp32",
        reason="RuntimeError: operation not permitted when stream is capturing"),)
    assert [g.seconds for g in profile.gemm] == pytest.approx([PER_CALL_S] * 8)
    assert [a.forward_backward_s == pytest.approx(PER_CALL_S) for a in profile.attention] == [False, True]
    assert ClusterProfile.from_dict(ClusterProfile(device=profile).to_dict()).device == profile


def _device_dict(name: str) -> dict:
    device = DeviceProfile(name=name, torch_version="2.11", measured_on="2026-12-06", timing="cuda_graph_replay",
                           eager_fallbacks=(EagerFallback(entry="gemm m=1 n=1 k=1 bf16", reason="RuntimeError"),),
                           gemm=(GemmTiming(m=512, n=512, k=512, dtype="bf16", seconds=5e-6),))
    return ClusterProfile(device=device).to_dict()


@pytest.mark.parametrize("name, timing", [("NVIDIA H100 80GB HBM3", "events_per_call"), ("cpu", "wall_clock")])
def test_a_profile_written_before_graph_timing_loads_as_it_was_timed(name: str, timing: str) -> None:
    obj = _device_dict(name)
    del obj["device"]["timing"], obj["device"]["eager_fallbacks"]
    device = ClusterProfile.from_dict(obj).device
    assert (device.timing, device.eager_fallbacks) == (timing, ())


def test_a_bad_timing_names_its_field() -> None:
    obj = _device_dict("NVIDIA H100 80GB HBM3")
    obj["device"]["timing"] = "cuda_graphs"
    with pytest.raises(ProfileError, match="device.timing must be one of 'cuda_graph_replay'"):
        ClusterProfile.from_dict(obj)
    obj = _device_dict("NVIDIA H100 80GB HBM3")
    obj["device"]["eager_fallbacks"][0].pop("reason")
    with pytest.raises(ProfileError, match=r"device.eager_fallbacks\[0\].reason is missing"):
        ClusterProfile.from_dict(obj)


class FakeCuda:
    """The part of `torch.cuda` that `CudaGraphCapture` uses, logging each step and the stream
    that fn runs on; `torch.cuda.graph`'s exit raises where `fail` (as a capture_end would after a
    syncing op), leaving the capture stream current as torch does."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail, self.log, self.current, self.streams = fail, [], "caller", 0

    def device(self, _device: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def Stream(self) -> SimpleNamespace:  # noqa: N802 (torch's name)
        self.streams += 1
        return SimpleNamespace(name="side", wait_stream=lambda other: self.log.append(f"side waits {other}"))

    def current_stream(self) -> str:
        return self.current

    def set_stream(self, stream: object) -> None:
        self.current = getattr(stream, "name", stream)

    def synchronize(self) -> None:
        self.log.append("sync")

    @contextlib.contextmanager
    def stream(self, stream: SimpleNamespace) -> Iterator[None]:
        previous, self.current = self.current, stream.name
        yield
        self.current = previous

    def CUDAGraph(self) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(replay=lambda: self.log.append("replay"), reset=lambda: self.log.append("reset"))

    @contextlib.contextmanager
    def graph(self, _graph: object, *, stream: SimpleNamespace) -> Iterator[None]:
        previous, self.current = self.current, stream.name
        self.log.append("capture begin")
        yield
        if self.fail:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.log.append("capture end")
        self.current = previous

    def Event(self, *, enable_timing: bool) -> SimpleNamespace:  # noqa: N802
        assert enable_timing
        return SimpleNamespace(record=lambda: self.log.append(f"event on {self.current}"), synchronize=lambda: None,
                               elapsed_time=lambda _end: 0.4)


def test_the_cuda_capture_warms_up_on_its_stream_then_captures_replays_and_releases() -> None:
    cuda = FakeCuda()
    capture = CudaGraphCapture(SimpleNamespace(cuda=cuda), "cuda:0")
    fn = lambda: cuda.log.append(f"fn on {cuda.current}")  # noqa: E731
    with capture([fn] * 3) as replays:
        assert cuda.log == ["sync", "side waits caller", *["fn on side"] * CAPTURE_WARMUP, "sync",
                            "capture begin", *["fn on side"] * 3, "capture end", "sync"]
        del cuda.log[:]
        assert replays(2) == [0.4e-3, 0.4e-3]
        assert cuda.log == ["replay", "event on caller", "replay", "event on caller",  # one untimed replay first
                            "event on caller", "replay", "event on caller"]
    assert cuda.log[-1] == "reset" and cuda.current == "caller"
    with capture([fn]):
        pass
    assert cuda.streams == 1  # one side stream for every entry: cuBLAS's workspace is taken once


def test_the_cuda_capture_warms_up_on_the_first_calls_and_captures_each_in_order() -> None:
    cuda = FakeCuda()
    capture = CudaGraphCapture(SimpleNamespace(cuda=cuda), "cuda:0")
    calls = [lambda i=i: cuda.log.append(f"copy {i}") for i in (0, 1, 2, 0, 1)]  # operand copies in rotation
    with capture(calls):
        assert cuda.log == ["sync", "side waits caller", *[f"copy {i}" for i in range(CAPTURE_WARMUP)], "sync",
                            "capture begin", "copy 0", "copy 1", "copy 2", "copy 0", "copy 1", "capture end", "sync"]


def test_a_failed_cuda_capture_raises_and_gives_the_caller_its_stream_back() -> None:
    cuda = FakeCuda(fail=True)
    capture = CudaGraphCapture(SimpleNamespace(cuda=cuda), "cuda:0")
    with pytest.raises(RuntimeError, match="during capture"):
        with capture([lambda: None] * 2):
            pass
    assert cuda.current == "caller" and "reset" not in cuda.log
