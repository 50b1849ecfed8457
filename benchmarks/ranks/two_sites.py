"""Two sites on one machine: gloo ranks in two network namespaces joined by a rate-limited veth
pair, to measure data parallelism across a slow link (issue 36, item 4).

    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.ranks two-sites -o benchmarks/results/two_sites-cpu-2026-12-06.json
    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.ranks two-sites --settings 100:5 --steps 3 --probe-only \\
        -o /tmp/link.json   # the link alone
This case was benchmarks/two_sites.py until 2026-12-07: two_sites-cpu-2026-12-06.json
was made by `sudo .venv/bin/python benchmarks/two_sites.py -o FILE`, the same flags; it printed the
report as well.

What is built (root only; everything named `mplan2s-<pid>-<tag>-*`, so concurrent runs never
collide, and removed in a `finally` on success, failure, Ctrl-C, SIGTERM or `--timeout`):

    namespace site0                          namespace site1
    lo (up)                                  lo (up)
    veth m2<tag>a 10.213.0.1/24 <----------> veth m2<tag>b 10.213.0.2/24
         tbf rate R on egress                     tbf rate R on egress

The veth is created directly inside the namespaces (`ip link add ... netns`), so nothing ever
appears in the host's namespace, and the two namespaces have no other interface and no route
out: the ranks' traffic stays between them. Deleting the namespaces deletes the pair and its
qdiscs. A run killed with SIGKILL cannot clean up: its ranks die with it (`_die_with_parent`), and
the next run deletes namespaces whose creating process is gone (`_remove_stale`).

Ranks: world 4, ranks 0-1 in site0 and 2-3 in site1, each started as `ip netns exec SITE python
-m benchmarks.ranks two-sites --worker ...` (in the extracted tree, `--commit`'s mplan first on its
path) with MASTER_ADDR the site0 veth address (rank 0's TCP store listens
there) and GLOO_SOCKET_IFNAME the namespace's veth. Every rank of a namespace binds that one
address, so two ranks of one site talk to their own namespace's address: the kernel delivers
that through the namespace's loopback, never out of the veth (local routes win), and the tbf
on the veth does not touch it. The probe shows it: the veth's byte counters during an
intra-site transfer, and that transfer's bandwidth against the rate limit.

Which part of the link is real and which injected:
- real (the kernel's path): the bandwidth. Cross-site bytes leave through the veth, are queued
  and paced by `tbf` (token bucket, rate R, on both ends' egress), and carry TCP's behaviour
  (segmentation, acks, windows) as gloo's sockets see it. The probe measures the rate reached.
- injected: the latency. The kernel here has no `netem`, so a one-way delay L cannot be put on
  the wire; it is added where traffic is posted instead (`DelayedLink`): each collective (or
  send) whose group spans both sites is posted `crossings * L` after the rank asked for it, by
  one thread per rank in the order asked; the rank computes on meanwhile and waits only where it
  reads the result, as it would while a message crossed a slow link. `crossings` is the number
  of long-haul hops on the collective's chain of dependent messages around gloo's ring
  (`ring_crossings`): 3 for an all-reduce over the four ranks (its chunks go 6 hops around a
  ring that crosses every other hop), 2 for the two-rank all-reduce between sites, 1 for a send.
  That is the latency a wire delay would add to a ring whose steps wait on each other; paid once
  before the transfer instead of between its steps, it is the same total where the steps do not
  overlap each other. The veth's own latency (about 0.1 ms here, mostly the ranks' scheduling on
  a busy machine) stays beneath it.

The probe (`--probe-only`, and first in every run unless `--no-probe`) measures per setting:
intra-site and cross-site point-to-point bandwidth (set against tbf's rate), the cross-site
one-way latency without and with the injected delay (set against L), and a cross-site
all-reduce against its alpha-beta time.

The training runs time `--steps` steps after `--warmup` (between barriers on every rank; the
median of rank 0's clock) of each layout (`LAYOUTS`, AdamW, bfloat16 by default: the dtype the
planner prices gradients in, so the bytes it expects on the link are the bytes sent), and the
bytes site0's veth sent meanwhile (whole frames):
    flat           dp=4: one ring over the four ranks, crossing the link twice per step of it
    hierarchical   dp=4,sites=2: reduce-scatter inside each site, the shards all-reduced across
                   the sites, all-gather inside each site (mplan/runtime/hierarchical_reduce.py)
    chosen         the planner's own plan, when it is neither of those
`site_sent_bytes` is what site0's veth counted as sent over a step: frames, headers included
(once per segment of up to 64 KB where the kernel hands the veth large segments, so the payload
is between the figure x `PAYLOAD_FRACTION`, which `site_sent_payload_bytes_measured` takes, and
the figure itself). `injected_s` adds the latency given to a step's cross-site messages: the
gradients' (flat: the 4-rank ring, 3 crossings a bucket; hierarchical: the 2-rank all-reduce of
the shards, 2) and the loss's average over dp, a 4-rank all-reduce across the sites in both
layouts (3); the planner prices the same crossings (`collective_cost.long_haul_steps`).
Beside them, the planner's predictions for the same cluster (`two_site_cluster`: this machine's
measured 4-rank CPU profile for the ranks inside a site, the emulated link between the sites),
which layout it chose, and whether that one measured fastest. The runtime's own latency switch
(MPLAN_INTER_SITE_DELAY_MS, one delay per cross-site all-reduce, hierarchical layout only) stays
off: one injection rule, `DelayedLink`'s, serves every layout alike.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import os
import platform
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PREFIX = "mplan2s"
"""Namespace names are `mplan2s-<creator pid>-<random tag>-site<i>`."""
ADDRESSES = ("10.213.0.1", "10.213.0.2")
"""Each site's veth address (the namespaces are private, so every run may use the same ones)."""
RANKS_PER_SITE = 2
DEFAULT_MODEL = "llama:layers=2,hidden=128,heads=4,kv_heads=2,ffn=384,seq=64,vocab=2048"
PROFILE = REPO / "benchmarks" / "results" / "profile_cpu4-2026-12-02.json"
"""`mplan profile` of 4 gloo CPU ranks on this machine: the planner's kernel and loopback-link figures."""
LAYOUTS = {"flat": "dp=4,mbs={mbs},zero=0,sites=1", "hierarchical": "dp=4,mbs={mbs},zero=0,sites=2"}
"""Flat: one ring over the four ranks, crossing the link twice. Hierarchical: reduce-scatter in
each site, the shards all-reduced across, all-gather in each site (mplan/runtime/hierarchical_reduce.py)."""
UNSHAPED_MBIT = 10_000.0
"""What the planner is told of an unshaped veth (`none:` settings), Mbit/s: a placeholder, not measured."""
DEFAULT_SETTINGS = ("100:5", "1000:20", "1000:50")
"""`rate_mbit:delay_ms` pairs (one-way delay): bandwidth-bound (100 Mbit/s, 5 ms), where the
planner's flat and hierarchical prices tie (1 Gbit/s, 20 ms), and latency-bound (1 Gbit/s, 50 ms)."""
MASTER_PORT = 29513
PAYLOAD_FRACTION = 1448 / 1514
"""TCP payload per full Ethernet frame on a 1500-byte MTU with timestamps (tbf counts the frame)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSetting:
    """The emulated inter-site link: `rate_mbit` real (tbf), `delay_ms` injected (one way)."""

    rate_mbit: float | None  # Mbit/s, tbf on both ends' egress; None: the veth unshaped
    delay_ms: float  # milliseconds, one way, injected per cross-site message step (DelayedLink)

    @classmethod
    def parse(cls, text: str) -> LinkSetting:
        rate, _, delay = text.partition(":")
        try:
            return cls(rate_mbit=None if rate in ("", "none") else float(rate), delay_ms=float(delay or 0))
        except ValueError:
            raise SystemExit(f"--settings: {text!r} is not RATE_MBIT:DELAY_MS (e.g. 100:5, none:0)") from None

    @property
    def label(self) -> str:
        return f"{'unshaped' if self.rate_mbit is None else f'{self.rate_mbit:g}mbit'}+{self.delay_ms:g}ms"


# -- the namespaces ------------------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why this machine cannot build the two sites (None when it can): not root, no `ip` or `tc`,
    or a kernel that refuses network namespaces or veth pairs."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"no `{tool}` command (iproute2)"
    try:
        with TwoSites(rate_mbit=1.0):
            pass
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"cannot build namespaces with a veth pair and tbf here: {detail}"
    return None


def namespaces_of(pid: int) -> list[str]:
    """The namespaces a harness process `pid` created that still exist."""
    return [name for name in _namespaces() if name.startswith(f"{PREFIX}-{pid}-")]


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _remove_stale() -> list[str]:
    """Delete namespaces left by a harness that died without its `finally` (SIGKILL), and stop
    what still runs in them (its ranks die with it, `_die_with_parent`, unless that failed)."""
    removed = []
    for name in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+-site\d", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def _die_with_parent() -> None:
    """In a rank, before exec: the kernel kills it when the harness dies, even by SIGKILL
    (PR_SET_PDEATHSIG survives `ip netns exec`'s exec of python)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class TwoSites:
    """Two namespaces joined by a veth pair (optionally tbf-limited); a context manager that
    removes both, and with them the pair and its qdiscs, on exit."""

    def __init__(self, *, rate_mbit: float | None) -> None:
        tag = secrets.token_hex(3)
        self.rate_mbit = rate_mbit
        self.namespaces = tuple(f"{PREFIX}-{os.getpid()}-{tag}-site{i}" for i in range(2))
        self.interfaces = (f"m2{tag}a", f"m2{tag}b")  # under the kernel's 15 characters

    def __enter__(self) -> TwoSites:
        try:
            for name in self.namespaces:
                _ip("netns", "add", name)
            (ns0, ns1), (if0, if1) = self.namespaces, self.interfaces
            _ip("link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
            for ns, interface, address in zip(self.namespaces, self.interfaces, ADDRESSES):
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
                _ip("-n", ns, "link", "set", interface, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate_mbit is not None:
                    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", interface, "root", "tbf",
                                    *self.tbf_arguments()], capture_output=True, text=True, check=True, timeout=30)
        except BaseException:
            self.remove()
            raise
        return self

    def tbf_arguments(self) -> list[str]:
        """Rate R; a bucket of 1 ms at R (at least 64 KiB, one GSO segment, so tbf need not split
        veth's large segments); a queue of up to 200 ms at R before drops (TCP backs off first)."""
        assert self.rate_mbit is not None
        rate_Bps = self.rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_Bps * 1e-3))
        return ["rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", "200ms"]

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for name in self.namespaces:
            _ip("netns", "del", name, check=False)

    def qdiscs(self) -> list[str]:
        """`tc qdisc show` of each veth, as the kernel reports it (recorded in the results)."""
        return [subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", interface], capture_output=True,
                               text=True, timeout=30).stdout.strip()
                for ns, interface in zip(self.namespaces, self.interfaces)]


# -- the ranks -----------------------------------------------------------------------------------

def site_of(rank: int) -> int:
    return rank // RANKS_PER_SITE


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the job ran past its time; the message carries its log's tail."""


def run_ranks(sites: TwoSites, worker_args: Sequence[str], *, timeout_s: float, logs: Path,
              tree: Path) -> dict[str, Any]:
    """Start 2 x RANKS_PER_SITE ranks of `--worker worker_args` in their sites' namespaces, with
    `tree`'s `mplan` first on the path, wait for all (killing every one of them on failure or
    timeout), and return rank 0's JSON line."""
    world = 2 * RANKS_PER_SITE
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            site = site_of(rank)
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % RANKS_PER_SITE),
                   "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": str(MASTER_PORT),
                   "GLOO_SOCKET_IFNAME": sites.interfaces[site], "OMP_NUM_THREADS": "1",
                   "MPLAN_TWO_SITES_IFNAME": sites.interfaces[site],
                   "PYTHONPATH": os.pathsep.join([str(tree), str(REPO), os.environ.get("PYTHONPATH", "")])}
            # in `tree`, so that no other `mplan` comes before its own on the rank's path; rank 0 prints its
            # result as a JSON line, the harness writes no report (--out is the harness's, unused)
            with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
                procs.append(subprocess.Popen(["ip", "netns", "exec", sites.namespaces[site], sys.executable,
                                               "-m", "benchmarks.ranks", "two-sites", "--worker", *worker_args,
                                               "--out", os.devnull],
                                              env=env, stdout=out, stderr=err, cwd=tree, start_new_session=True,
                                              preexec_fn=_die_with_parent))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [rank for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                raise RanksFailed(f"rank {failed[0]} exited with {procs[failed[0]].returncode}:\n"
                                  + (logs / f"rank{failed[0]}.err").read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RanksFailed(f"ranks still running after {timeout_s:.0f} s:\n"
                                  + (logs / "rank0.err").read_text()[-3000:])
            time.sleep(0.05)
        failed = [rank for rank, p in enumerate(procs) if p.returncode]
        if failed:
            raise RanksFailed(f"rank {failed[0]} exited with {procs[failed[0]].returncode}:\n"
                              + (logs / f"rank{failed[0]}.err").read_text()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the rank itself: `ip netns exec` execs into python, so this is its pid
        for p in procs:
            p.wait()
    lines = [line for line in (logs / "rank0.out").read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise RanksFailed("rank 0 printed no result:\n" + (logs / "rank0.err").read_text()[-3000:])
    result = json.loads(lines[-1])
    if not Path(result.pop("mplan")).resolve().is_relative_to(tree.resolve()):
        raise RanksFailed(f"the ranks imported mplan from outside {tree}")
    return result


# -- inside a rank -------------------------------------------------------------------------------

RING_STEPS: dict[str, Callable[[int], int]] = {
    "all_reduce": lambda g: 2 * (g - 1),
    "reduce_scatter": lambda g: g - 1, "reduce_scatter_tensor": lambda g: g - 1,
    "all_gather": lambda g: g - 1, "all_gather_into_tensor": lambda g: g - 1,
    "broadcast": lambda g: 1, "send": lambda g: 1,
    "barrier": lambda g: 0,
}
"""How many hops along gloo's ring (rank i sends to i + 1 in the group's order) each piece of a
collective over g ranks travels, one after the other: a ring all-reduce's chunk goes g - 1 hops
reducing and g - 1 gathering. A point-to-point message or a broadcast from the root is one hop.
A barrier is given none (the timing's own barriers): it goes through the queue only to keep its
place in each group's order. `isend` stays torch's own: the pipeline executor's `P2POp` takes only
that function, and a plan's pipeline sends never cross sites (pp groups stay inside one)."""


def ring_crossings(sites: Sequence[int], steps: int) -> int:
    """The most long-haul hops among `steps` consecutive hops of the ring through ranks on `sites`
    (in ring order): the latency a ring collective pays is that many one-way delays, since each
    rank's next step waits for the previous step's message and the chain of waits runs back
    around the ring (4 ranks on 2 sites, 0 1 | 2 3: an all-reduce's 6 hops cross 3 times; 2
    ranks, one a site: 2 hops, both across)."""
    g = len(sites)
    across = [sites[i] != sites[(i + 1) % g] for i in range(g)]
    return max(sum(across[(start + hop) % g] for hop in range(steps)) for start in range(g))


ASYNC = {"send": "isend"}
"""Posted from the delaying thread in their asynchronous form; the caller waits if it asked to."""


class _Deferred:
    """A collective the delaying thread will post: `wait()` waits for the posting, then the work."""

    def __init__(self, posted: Future) -> None:
        self._posted = posted

    def wait(self, timeout: Any = None) -> bool:
        work = self._posted.result()
        return True if work is None else work.wait()


class DelayedLink:
    """Injects the inter-site latency (module docstring): every collective and send over a group
    spanning both sites is posted `ring_crossings(...) * delay_s` after the rank asked for it,
    by one thread, in the order asked (so every group sees the same order on every rank); the
    rank's own thread goes on meanwhile, as it would while a message crossed a slow link, and waits
    only where it reads the result (a blocking call, or `wait()` on an asynchronous one's work).
    `injected_s` adds up the latency given to the messages posted."""

    def __init__(self, delay_s: float, world_size: int) -> None:
        import torch.distributed as dist

        self.delay_s, self.world_size, self.injected_s = delay_s, world_size, 0.0
        self._dist = dist
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="two-sites-link")
        self._crossings: dict[tuple[str, int], int | None] = {}
        for name in RING_STEPS:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _across(self, name: str, group: Any, peer: int | None) -> int | None:
        """The long-haul hops of `name` over `group` (or to `peer`); None where it stays in a site."""
        dist = self._dist
        if peer is not None:
            return 1 if site_of(dist.get_rank()) != site_of(peer) else None
        key = (name, id(group))
        if key not in self._crossings:
            ranks = list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
            sites = [site_of(rank) for rank in ranks]
            self._crossings[key] = (ring_crossings(sites, RING_STEPS[name](len(ranks)))
                                    if len(set(sites)) > 1 else None)
        return self._crossings[key]

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        dist = self._dist
        posting = getattr(dist, ASYNC.get(name, name))
        point_to_point = name == "send"
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            named = signature.bind_partial(*args, **kwargs).arguments
            group = named.get("group")
            peer = named.get("dst") if point_to_point else None
            across = self._across(name, group, peer)
            if across is None:
                return original(*args, **kwargs)
            delay = across * self.delay_s
            self.injected_s += delay
            wanted_async = named.get("async_op", False)
            if not point_to_point:
                kwargs = {**kwargs, "async_op": True}
            deferred = _Deferred(self._thread.submit(_post_at, time.monotonic() + delay, posting, args, kwargs))
            if wanted_async:
                return deferred
            deferred.wait()
            return None
        return call


def _post_at(due: float, post: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    time.sleep(max(0.0, due - time.monotonic()))  # the injected one-way latency
    return post(*args, **kwargs)


def _veth_bytes(directions: tuple[str, ...] = ("tx", "rx")) -> int:
    """Bytes (whole frames) this namespace's veth sent and/or received (its sysfs counters)."""
    base = Path("/sys/class/net") / os.environ["MPLAN_TWO_SITES_IFNAME"] / "statistics"
    return sum(int((base / f"{direction}_bytes").read_text()) for direction in directions)


def _probe(args: argparse.Namespace) -> dict[str, Any]:
    """The link alone: bandwidths, latencies and one all-reduce, measured against what was set."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    delay_s = args.delay_ms / 1e3
    out: dict[str, Any] = {}

    def transfer(peer_of: dict[int, int], nbytes: int, repeats: int) -> list[float]:
        """Senders push `nbytes` to their peer, which answers one byte; seconds until the answer."""
        data = torch.empty(nbytes, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank in peer_of and peer_of[rank] > rank:
                dist.send(data, peer_of[rank])
                dist.recv(ack, peer_of[rank])
            elif rank in peer_of:
                dist.recv(data, peer_of[rank])
                dist.send(ack, peer_of[rank])
            times.append(time.perf_counter() - start)
        return times

    # 1. intra-site: 0 -> 1 in site0 and 2 -> 3 in site1 at once; the veth must carry none of it
    intra_bytes = args.intra_mb * 2**20
    before = _veth_bytes()
    intra = transfer({0: 1, 1: 0, 2: 3, 3: 2}, intra_bytes, 3)
    veth_during_intra = _veth_bytes() - before
    # 2. cross-site one-way latency, real (no injection): 1-byte ping-pong 0 <-> 2
    pingpong = transfer({0: 2, 2: 0}, 1, 20)
    real_one_way = statistics.median(pingpong) / 2
    # 3. cross-site bandwidth: 0 -> 2, sized for about half a second at the set rate
    rate_Bps = None if args.rate_mbit is None else args.rate_mbit * 1e6 / 8
    cross_bytes = int(min(64 * 2**20, max(2**20, 0.5 * rate_Bps))) if rate_Bps else 64 * 2**20
    cross = transfer({0: 2, 2: 0}, cross_bytes, 3)
    # 4. with the injected delay: one-way latency, and an all-reduce over the pair {0, 2}
    link = DelayedLink(delay_s, world)
    injected = transfer({0: 2, 2: 0}, 1, 10)
    pair = dist.new_group([0, 2])
    reduce_bytes = args.allreduce_mb * 2**20
    tensor = torch.ones(reduce_bytes // 4, dtype=torch.float32)
    reduces = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if rank in (0, 2):
            dist.all_reduce(tensor, group=pair)
        reduces.append(time.perf_counter() - start)
    if rank == 0:
        out = {
            "intra_site": {"bytes": intra_bytes, "seconds_median": statistics.median(intra),
                           "MBps": intra_bytes / statistics.median(intra) / 1e6,
                           "veth_bytes_during": veth_during_intra,
                           "note": "0 -> 1 and 2 -> 3 at once; veth_bytes_during: site0's veth tx+rx meanwhile "
                                   "(the barriers' few hundred bytes), so intra-site traffic did not cross"},
            "cross_site_bandwidth": {"bytes": cross_bytes, "seconds_median": statistics.median(cross),
                                     "MBps_measured": cross_bytes / (statistics.median(cross) - real_one_way * 2) / 1e6,
                                     "MBps_set": None if rate_Bps is None else rate_Bps / 1e6,
                                     "MBps_set_payload": None if rate_Bps is None else rate_Bps * PAYLOAD_FRACTION / 1e6},
            "cross_site_latency": {"one_way_s_real": real_one_way,
                                   "one_way_s_with_injection": statistics.median(injected) / 2,
                                   "one_way_s_set": delay_s},
            "cross_site_allreduce": {"bytes": reduce_bytes, "ranks": [0, 2],
                                     "seconds_median": statistics.median(reduces),
                                     "seconds_alpha_beta": 2 * delay_s + (reduce_bytes / (rate_Bps * PAYLOAD_FRACTION)
                                                                          if rate_Bps else 0.0),
                                     "note": "2 ranks, one per site: 2 crossings of the injected delay, and each rank "
                                             "sends its half twice (N bytes each way) through tbf"},
            "injected_s_total": link.injected_s,
        }
    return out


def _train(args: argparse.Namespace) -> dict[str, Any]:
    """`--steps` timed training steps of `args.model` under `args.plan` (after `--warmup`)."""
    import torch
    import torch.distributed as dist

    import mplan
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.models import build_model

    link = DelayedLink(args.delay_ms / 1e3, dist.get_world_size())
    model = build_model(args.model, device="cpu", dtype=getattr(torch, args.dtype), seed=0)
    ids = torch.randint(0, model.config.vocab, (args.batch, model.config.seq_len),
                        generator=torch.Generator().manual_seed(0))
    cluster = ClusterSpec.from_json(args.cluster)
    # planned first, then run: the Plan the planner prices is the one measured (autoparallel's own
    # binding of a spec string leaves its sites out at this commit)
    plan = mplan.plan(model, (ids,), cluster=cluster, global_batch=args.batch, spec=args.plan, progress="quiet")
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            global_batch=args.batch, plan=plan, progress="quiet", cluster=cluster)
    steps, injected, crossed = [], [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        link.injected_s = 0.0
        sent = _veth_bytes(("tx",))
        start = time.perf_counter()
        pm.train_step(ids, ids)
        dist.barrier()
        if step >= args.warmup:
            steps.append(time.perf_counter() - start)
            injected.append(link.injected_s)
            crossed.append(_veth_bytes(("tx",)) - sent)
    # rank 0's figure: what its site sent to the other over a step (frames, with the barrier's)
    return {"plan": pm.plan.spec(), "sites": pm.groups.sites, "step_s": steps, "injected_s": injected,
            "site_sent_bytes": crossed, "load": os.getloadavg()[0],
            "dp_links_predicted": None if pm.plan.predicted.dp_links is None
            else dataclasses.asdict(pm.plan.predicted.dp_links),
            "parameters": sum(p.numel() for p in model.parameters())}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    result = _probe(args) if args.mode == "probe" else _train(args)
    if dist.get_rank() == 0:
        import mplan

        print(json.dumps({**result, "mplan": mplan.__file__}), flush=True)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------

def _extract(commit: str, into: Path) -> None:
    """`commit`'s `mplan` package under `into` (readable from inside the namespaces: same filesystem)."""
    into.mkdir()
    archive = subprocess.run(["git", "archive", commit, "mplan"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


class Interrupted(BaseException):
    """SIGTERM, SIGHUP or the overall `--timeout`: unwinds to the `finally` that removes the sites."""


@contextlib.contextmanager
def _bounded(timeout_s: float) -> Iterator[None]:
    """Raise `Interrupted` in the main thread on SIGTERM/SIGHUP or after `timeout_s` seconds."""
    def stop(signum: int, _frame: object) -> None:
        raise Interrupted("timed out" if signum == signal.SIGALRM else signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def two_site_cluster(setting: LinkSetting) -> Any:
    """The cluster the planner prices for `setting`: the measured 4-rank CPU profile of this
    machine (`PROFILE`: its kernels, and its gloo-over-loopback link fits for the ranks inside a
    site), as 2 sites of one node of `RANKS_PER_SITE` ranks, joined by the emulated link: the rate
    a TCP transfer reaches through tbf (the set rate x `PAYLOAD_FRACTION`, which the probe
    measures) and the injected one-way delay."""
    from mplan.cost_models.cluster import ClusterSpec, LinkHierarchy

    base = ClusterSpec.from_json(str(PROFILE))
    intra = base.links.intra_node
    # each site is one node, so nothing is priced on an inter-node link inside a site
    unused = dataclasses.replace(intra, kind="roce", source="unused: each site is one node of ranks")
    rate_gbps = (setting.rate_mbit if setting.rate_mbit is not None else UNSHAPED_MBIT) * PAYLOAD_FRACTION / 1e3
    cluster = dataclasses.replace(base, name="two-sites-cpu", num_nodes=2, gpus_per_node=RANKS_PER_SITE,
                                  links=LinkHierarchy(intra_node=intra, inter_node=unused),
                                  source=f"{base.source}; as 2 sites of {RANKS_PER_SITE} ranks "
                                         "(benchmarks.ranks two-sites)")
    return cluster.with_sites(2, inter_site_gbps=rate_gbps, inter_site_latency_ms=setting.delay_ms,
                              source=f"emulated: tbf {setting.rate_mbit or 'unshaped'} Mbit/s x {PAYLOAD_FRACTION:.3f} "
                                     f"(TCP payload), {setting.delay_ms:g} ms injected one way")


def _predict(cluster: Any, args: argparse.Namespace, specs: dict[str, str]) -> dict[str, Any]:
    """The planner's prices for each layout's spec, and its own choice, on `cluster` (predictions);
    what the planner refuses is recorded as `error` (the measurements still run)."""
    from mplan.bench import bench_plans

    try:  # one capture prices every layout and searches ("auto": the planner's choice)
        rows = bench_plans(args.model, cluster, args.batch, [*specs.values(), "auto"])
    except Exception as exc:  # noqa: BLE001  (a refusal or a bug alike: say which, measure anyway)
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {name: {key: row.get(key) for key in ("spec", "resolved_spec", "predicted", "error")}
           for name, row in zip([*specs, "chosen"], rows)}
    out["chosen"]["spec"] = out["chosen"].pop("resolved_spec")
    return out


def _measure_setting(setting: LinkSetting, args: argparse.Namespace, scratch: Path, tree: Path) -> dict[str, Any]:
    common = ["--delay-ms", str(setting.delay_ms), "--rate-mbit", str(setting.rate_mbit or "none")]
    cluster = two_site_cluster(setting)
    cluster_file = scratch / "cluster.json"
    cluster.to_json(str(cluster_file))
    specs = {layout: LAYOUTS[layout].format(mbs=args.mbs) for layout in args.layouts if layout in LAYOUTS}
    row: dict[str, Any] = {"setting": asdict(setting),
                           "cluster": {"sites": dataclasses.asdict(cluster.sites), "intra_site": cluster.links.intra_node.source,
                                       "profile": PROFILE.name, "figures": cluster.figures}}
    if not args.probe_only:
        row["predicted"] = _predict(cluster, args, specs)
        chosen = row["predicted"].get("chosen", {}).get("spec")
        if "chosen" in args.layouts and chosen and all(row["predicted"][layout]["resolved_spec"] != chosen
                                                       for layout in specs):
            specs["chosen"] = chosen  # the planner's choice is none of the layouts: measure it as well
    with TwoSites(rate_mbit=setting.rate_mbit) as sites:
        row["qdiscs"] = sites.qdiscs()
        if not args.no_probe:
            row["probe"] = run_ranks(sites, ["--mode", "probe", *common, "--intra-mb", str(args.intra_mb),
                                             "--allreduce-mb", str(args.allreduce_mb)],
                                     timeout_s=args.rank_timeout, logs=scratch, tree=tree)
            print(f"{setting.label}: probe {json.dumps(row['probe'])}", file=sys.stderr)
        if not args.probe_only:
            runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in specs}
            for round_ in range(args.rounds):  # the layouts take turns: a busy machine's drift falls on all
                for layout, spec in specs.items():
                    runs[layout].append(_train_job(sites, layout, spec, common, cluster_file, args, scratch, tree))
                    print(f"{setting.label} round {round_ + 1}/{args.rounds}: {layout} "
                          f"{statistics.median(runs[layout][-1]['step_s']):.4f} s a step "
                          f"({statistics.median(runs[layout][-1]['injected_s']):.4f} s of latency injected)",
                          file=sys.stderr)
            row["measured"] = {layout: _pooled(jobs) for layout, jobs in runs.items()}
    if "measured" in row and "error" not in row["predicted"]:
        row["comparison"] = _compare(row)
    return row


def _train_job(sites: TwoSites, layout: str, spec: str, common: list[str], cluster_file: Path,
               args: argparse.Namespace, scratch: Path, tree: Path) -> dict[str, Any]:
    """One job of ranks training `spec`; refused where the runtime ran other sites than `layout` names."""
    result = run_ranks(sites, ["--mode", "train", *common, "--model", args.model, "--plan", spec,
                               "--cluster", str(cluster_file), "--batch", str(args.batch), "--dtype", args.dtype,
                               "--mbs", str(args.mbs), "--warmup", str(args.warmup), "--steps", str(args.steps)],
                       timeout_s=args.rank_timeout, logs=scratch, tree=tree)
    wanted = {"flat": 1, "hierarchical": 2}.get(layout, result["sites"])
    if result["sites"] != wanted:
        raise RanksFailed(f"{layout} ({spec}) ran over {result['sites']} site(s), not {wanted}: "
                          f"this commit's runtime does not take the plan's sites")
    return result


def _pooled(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """A layout's jobs as one record: every timed step, their medians, and each job's median."""
    pooled = {**{k: v for k, v in jobs[0].items() if k != "load"}, **{key: [x for job in jobs for x in job[key]]
                             for key in ("step_s", "injected_s", "site_sent_bytes")}}
    return {**pooled, "step_s_median": statistics.median(pooled["step_s"]),
            "step_s_median_by_round": [statistics.median(job["step_s"]) for job in jobs],
            "load_by_round": [job["load"] for job in jobs],
            "injected_s_median": statistics.median(pooled["injected_s"]),
            "site_sent_bytes_median": statistics.median(pooled["site_sent_bytes"])}


def _compare(row: dict[str, Any]) -> dict[str, Any]:
    """Measured against predicted per layout, and whether the planner's choice measured fastest."""
    measured, predicted = row["measured"], row["predicted"]
    by_layout = {}
    for layout, result in measured.items():
        price = predicted[layout]["predicted"] or {}
        step = price.get("step_time_s")
        crossing = (result["dp_links_predicted"] or {}).get("inter_site_gb")  # the run Plan's own
        by_layout[layout] = {"plan": result["plan"], "measured_step_s": result["step_s_median"],
                             "predicted_step_s": step,
                             "predicted_over_measured": None if step is None else step / result["step_s_median"],
                             "site_sent_bytes_measured": result["site_sent_bytes_median"],
                             "site_sent_payload_bytes_measured": result["site_sent_bytes_median"] * PAYLOAD_FRACTION,
                             "inter_site_bytes_predicted": None if crossing is None else crossing * 1e9}
    fastest = min(measured, key=lambda layout: measured[layout]["step_s_median"])
    chosen = predicted["chosen"]["spec"]
    return {"layouts": by_layout, "measured_fastest": fastest, "planner_chose": chosen,
            "planner_choice_measured_fastest": measured[fastest]["plan"] == chosen}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS),
                        help="RATE_MBIT:DELAY_MS per setting (RATE 'none': the veth unshaped)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float64"),
                        help="parameters' and gradients' dtype (bfloat16: the one the planner prices)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps timed per job")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per layout and setting, the layouts taking turns")
    parser.add_argument("--intra-mb", type=int, default=16, help="MiB of the intra-site probe transfer")
    parser.add_argument("--allreduce-mb", type=int, default=2, help="MiB of the cross-site all-reduce probe")
    parser.add_argument("--layouts", nargs="+", choices=(*LAYOUTS, "chosen"), default=[*LAYOUTS, "chosen"],
                        help="what to measure ('chosen': the planner's plan, where it is none of the others)")
    parser.add_argument("--probe-only", action="store_true", help="measure the link, train nothing")
    parser.add_argument("--no-probe", action="store_true", help="train only, without measuring the link first")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--rank-timeout", type=float, default=300, help="seconds for one job of ranks")
    parser.add_argument("--commit", default="HEAD",
                        help="the commit whose mplan package the ranks import (extracted, so that edits to "
                             "the working tree meanwhile change nothing)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("probe", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--rate-mbit", type=lambda s: None if s == "none" else float(s), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The driver (root): every setting's sites built, measured and removed; or, with `--worker`, one rank."""
    if args.worker:
        _worker(args)
        return None
    if os.geteuid() != 0:
        raise SystemExit("two-sites: network namespaces need root")
    stale = _remove_stale()
    if stale:
        print(f"removed namespaces left by dead runs: {', '.join(stale)}", file=sys.stderr)
    settings = [LinkSetting.parse(text) for text in args.settings]
    import torch

    commit = subprocess.run(["git", "rev-parse", args.commit], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    rows = []
    try:
        with _bounded(args.timeout), tempfile.TemporaryDirectory(prefix="mplan_two_sites_") as scratch:
            tree = Path(scratch) / "tree"
            _extract(commit, tree)
            sys.path.insert(0, str(tree))  # the planner's predictions come from the same commit as the ranks
            for setting in settings:
                rows.append(_measure_setting(setting, args, Path(scratch), tree))
    except (Interrupted, KeyboardInterrupt) as exc:
        raise SystemExit(f"two-sites: stopped ({exc or 'interrupted'}); its namespaces are removed") from None
    except RanksFailed as exc:
        raise SystemExit(f"two-sites: {exc}") from None
    return {"date": datetime.date.today().isoformat(),
            "machine": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "kernel": platform.release(), "torch": torch.__version__, "python": platform.python_version(),
            "iproute2": _ip("-V").stdout.strip(), "mplan_commit": commit, "backend": "gloo",
            "ranks": 2 * RANKS_PER_SITE,
            "ranks_per_site": RANKS_PER_SITE, "threads_per_rank": 1, "dtype": args.dtype, "model": args.model,
            "global_batch": args.batch, "mbs": args.mbs, "warmup": args.warmup, "steps": args.steps,
            "rounds": args.rounds,
            "link": "real: veth pair between two network namespaces, tbf rate limit on both ends' egress; "
                    "injected: the one-way delay, each cross-site collective posted crossings x delay after it "
                    "was asked for (the long-haul hops on its ring's chain of dependent messages: 3 for the "
                    "4-rank all-reduce, 2 for the 2-rank one between sites, 1 for a send), the rank computing on",
            "settings": rows}
