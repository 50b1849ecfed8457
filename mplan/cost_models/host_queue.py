"""The host and the device as a queue: how long a stream of ops takes when each must be issued first.

Role: the price of host time. Every op of a rank's program costs the host some seconds (dispatch,
autograd, a kernel launch: ``profile.HostTiming``) before its kernel can start, and the device
cannot run ahead of the host. ``host_cost`` (planner) gives each op its host and device seconds;
this module says what a sequence of them takes.
Input: ``HostQueue.op(host_s, device_s)`` per op, composed in program order with ``then``.
Output: ``makespan``: seconds from the host's first issue (device idle) to the device's last end.

Model, per op i (host issue cost h_i, kernel time d_i), the host issuing back to back::

    issued_i = h_1 + ... + h_i                       (the host never waits for the device)
    end_i    = max(end_{i-1}, issued_i) + d_i        (a kernel starts when issued and the device is free)

A stream is summarised by three numbers, which compose exactly (associatively):
    host_s   = sum h            the host's busy time
    device_s = sum d            the device's busy time
    lag_s    = end_n            the makespan when the device starts idle with the host (>= both)
and A then B: host = hA + hB, device = dA + dB, lag = max(lagA + dB, hA + lagB)
(B's ops are issued hA later, and B's kernels queue behind A's). Limits: with h -> 0 the makespan
is the device time; with d -> 0 it is the host time; in general it lies in [max(H, D), H + D].
Where the device is the host itself (``serial``: a CPU rank, whose kernels run on the host thread)
nothing overlaps and the makespan is H + D.

What it leaves out: the host blocking (a ``.item()``, a host-side wait), which mplan's step does
not do inside a pass; CUDA's launch queue depth (about a thousand kernels), which a pass of a few
hundred ops does not fill; and the host's lead carried from one pipeline action to the next
(each action is priced from an idle device: at most its last op's kernel time too long when the
host binds, its first ops' host time too long when the device does).
Invariants: all fields >= 0; ``lag_s >= max(host_s, device_s)``; ``then`` is associative.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class HostQueue:
    """A stream of ops on one rank: host seconds, device seconds, and the makespan from idle."""

    host_s: float = 0.0
    device_s: float = 0.0
    lag_s: float = 0.0  # device end, the host and device starting together (module docstring)

    @classmethod
    def op(cls, host_s: float, device_s: float) -> HostQueue:
        """One op: issued in `host_s`, then its kernel runs `device_s`."""
        if host_s < 0 or device_s < 0:
            raise ValueError(f"HostQueue.op: seconds must be >= 0, got host {host_s}, device {device_s}")
        return cls(host_s=host_s, device_s=device_s, lag_s=host_s + device_s)

    def then(self, other: HostQueue) -> HostQueue:
        """This stream followed by `other` on the same rank."""
        return HostQueue(host_s=self.host_s + other.host_s, device_s=self.device_s + other.device_s,
                         lag_s=max(self.lag_s + other.device_s, self.host_s + other.lag_s))

    @classmethod
    def sequence(cls, streams: Iterable[HostQueue]) -> HostQueue:
        out = cls()
        for stream in streams:
            out = out.then(stream)
        return out

    def with_device(self, device_s: float) -> HostQueue:
        """The same ops with `device_s` of device time instead: work the ops' own prices do not
        hold (collectives between ops, recomputation, re-priced experts) added at the stream's end,
        or taken off it, never below the host's or the device's own time."""
        extra = device_s - self.device_s
        return HostQueue(host_s=self.host_s, device_s=device_s,
                         lag_s=max(self.lag_s + extra, self.host_s, device_s))

    def with_host(self, host_s: float) -> HostQueue:
        """The same stream issued by a host `host_s` busier, the extra issued before its ops
        (recomputation's re-run forward before a backward)."""
        return HostQueue.op(host_s, 0.0).then(self)

    def makespan(self, serial: bool = False) -> float:
        """Seconds from the first issue to the last kernel's end; `serial`: kernels run on the host."""
        return self.host_s + self.device_s if serial else self.lag_s


def queued_makespan(queues: Sequence[HostQueue], device_s: Sequence[float], host_before: Sequence[float] | None = None,
                    *, serial: bool = False) -> float:
    """``HostQueue.sequence(q.with_device(d).with_host(h) for q, d, h in ...).makespan(serial)``
    (without ``with_host`` where `host_before` is None): each queue given `device_s[i]` of device
    time and, first, `host_before[i]` more host time, one after the other. The same additions and
    maxima in the same order, so the same float, without a ``HostQueue`` made per op: the search
    prices every pipeline chunk of thousands of configs this way (gpt3-175b on 1024 GPUs: 1.3
    million queues a search, a quarter of its time as objects)."""
    host = device = lag = 0.0
    for i, queue in enumerate(queues):
        d = device_s[i]
        queue_host = queue.host_s
        queue_lag = max(queue.lag_s + (d - queue.device_s), queue_host, d)  # with_device
        if host_before is not None:  # with_host: HostQueue.op(h, 0.0).then(...)
            h = host_before[i]
            queue_lag = max(h + d, h + queue_lag)
            queue_host = h + queue_host
        lag = max(lag + d, host + queue_lag)  # then
        host = host + queue_host
        device = device + d
    return host + device if serial else lag
