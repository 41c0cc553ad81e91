"""A put into a freshly started daemon against a warm one's (issue 42).

    python bench/bench_fresh.py [--mib 256] [--ram-mb 2048] [--steady 5] [--host auto|portable] [--gap-ms 0] [--clients 5]
                                [--prefill-ms 500] [--daemon-python PATH]

Starts a daemon (RAM tier only, `--ram-mb`), and over the shared-memory plane
puts snapshots of `--mib` MiB (bench_wire.py's layout: 32 layers x keys and
values, bf16) with fresh token ids each time, from one client:
  * fresh: the puts that fill the RAM tier of the new daemon (its arena
    growing), their median and the very first one;
  * steady: `--steady` puts once the tier is full (each evicts the oldest);
  * new client: the first put of a client that connects to the warm daemon,
    the median over `--clients` clients one after another (each its own
    mappings, as a newly started model server has): at once, and as a model
    server's comes, after a fetch (a miss) and a prefill (`--prefill-ms`).
Each is printed in GiB/s and as a ratio to steady (targets: fresh >= 0.5,
new client's first >= 0.5), with numpy baselines from the same run: a copy
into an already-touched buffer (memcpy) and into fresh memory; and the rate
at which this machine makes new shared pages, what a fresh daemon's fill
cannot outrun: segments of the arena's size (64 MiB) made as kvd-shm-prep
makes them on Linux (a memfd, zeros written through its fd: pages allocated,
cleared and resident, mapped nowhere), one thread and two (Linux only;
elsewhere not printed).
The fill and the steady state are measured with nothing else running. Then
again on a second new daemon, another client (a process of its own, over
frames) PINGing it back to back through both: the fill against the steady
state under that same load (before session 35 the fill alone had the pinger
beside it, and its ~0.7 of a core, against a steady state without: 0.36x
where the quiet ratio was 0.5x), the pinger's longest round trip and p99
during the fill, and its p99 idle afterwards (a fresh daemon's first SLOTS
must not hold the serving thread: issue 44).
`--gap-ms` waits between puts, as a model server's puts are spaced by
generation (0: back to back, the worst case). `--daemon-python` runs the
daemon with another interpreter (an older checkout's, to compare). The lead re-runs figures on a
quiet machine; on a shared one, read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import GiB, MiB, daemon, machine, median_time  # noqa: E402
from bench_wire import BYTES_PER_TOKEN, snapshot  # noqa: E402

from kvd_client import Client  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ram-mb", type=int, default=2048)
    ap.add_argument("--steady", type=int, default=5)
    ap.add_argument("--host", default="auto", choices=("auto", "portable"))
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--daemon-python", default=sys.executable)
    ap.add_argument("--prefill-ms", type=float, default=500.0,
                    help="a new client's fetch (a miss) and this long before its first put")
    args = ap.parse_args()
    n_tokens = args.mib * MiB // BYTES_PER_TOKEN
    snap = snapshot(n_tokens, seed=1)
    nbytes = snap.nbytes
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    t_mem = median_time(lambda: np.copyto(dst, src), 5)
    t_fresh = median_time(lambda: src.copy(), 5)
    del dst
    pages = {n: page_rate(args.ram_mb * MiB, n) for n in (1, 2)}  # as much as the fill makes
    counter = iter(range(1, 10**9))

    def put(c) -> float:
        toks = np.arange(n_tokens) + next(counter) * 1_000_000
        if args.gap_ms:
            time.sleep(args.gap_ms / 1000)  # a model server generating between puts
        t0 = time.perf_counter()
        assert c.put(toks, snap)
        return time.perf_counter() - t0

    fill = max(1, args.ram_mb // args.mib)

    def fill_and_steady(d, pinger: bool):
        """The fill of a new daemon, then its steady state, from one client: with
        another client PINGing back to back through both, or with none."""
        with Client(d.endpoint, namespace="fresh", timeout=60, strict=True, transport="shm") as c:
            with _Pinger(d.endpoint) if pinger else contextlib.nullcontext() as pings:
                fresh = [put(c) for _ in range(fill)]
            idle = None
            if pinger:
                with _Pinger(d.endpoint) as idle:
                    time.sleep(1.0)  # the daemon idle: the pinger's own round trips
            with _Pinger(d.endpoint) if pinger else contextlib.nullcontext():
                steady = [put(c) for _ in range(args.steady)]
            # (a put over max_message_mb goes as several SLOTS: each counts)
            assert c.counters["shm_puts"] >= fill + args.steady and not c.counters["shm_put_fallback"]
            return fresh, steady, pings, idle, c.stats().get("host", {})

    opts = dict(env={"KVD_HOST": args.host}, python=args.daemon_python)
    with daemon("--ram-mb", str(args.ram_mb), "--data-dir", "none", **opts) as d:
        busy_fresh, busy_steady, pings, idle, _ = fill_and_steady(d, pinger=True)
    with daemon("--ram-mb", str(args.ram_mb), "--data-dir", "none", **opts) as d:
        fresh, steady, _, _, host = fill_and_steady(d, pinger=False)
        firsts, seconds, served = [], [], []
        for _ in range(max(1, args.clients)):
            with Client(d.endpoint, namespace="fresh", timeout=60, strict=True, transport="shm") as c2:
                firsts.append(put(c2))
                seconds.append(put(c2))
            with Client(d.endpoint, namespace="fresh", timeout=60, strict=True, transport="shm") as c3:
                assert c3.get(np.arange(64) + 4_000_000_000) is None  # a model server's fetch: a miss
                time.sleep(args.prefill_ms / 1000)  # its prefill
                served.append(put(c3))
        first_new, again, after = statistics.median(firsts), statistics.median(seconds), statistics.median(served)
    rate = lambda t: nbytes / t / GiB  # noqa: E731
    t_steady = statistics.median(steady)
    print(f"# bench_fresh  {machine()}  {args.mib} MiB puts, ram_mb={args.ram_mb}, host={host}, gap={args.gap_ms} ms")
    print(f"baselines: memcpy {rate(t_mem):.2f} GiB/s, fresh-memory copy {rate(t_fresh):.2f} GiB/s")
    if pages[1]:
        print(f"new shared pages (kvd-shm-prep's way, {args.ram_mb} MiB): {pages[1] / GiB:.2f} GiB/s on one thread, "
              f"{pages[2] / GiB:.2f} on two: {pages[1] / (nbytes / t_steady):.2f}x / {pages[2] / (nbytes / t_steady):.2f}x "
              f"the steady state's put; the fill {nbytes / statistics.median(fresh) / pages[1]:.2f}x the one-thread rate")
    rows = [("fresh daemon, median of the fill", statistics.median(fresh)), ("fresh daemon, first put", fresh[0]),
            ("steady state", t_steady), (f"new client, first put (median of {len(firsts)})", first_new), ("new client, second put", again),
            (f"new client, first put after a fetch + {args.prefill_ms:g} ms", after)]
    for label, t in rows:
        print(f"{label:46s} {rate(t):6.2f} GiB/s  {t_steady / t:5.2f}x steady  {t_mem / t:5.2f}x memcpy")
    print("fill puts GiB/s:", " ".join(f"{rate(t):.2f}" for t in fresh))
    t_busy = statistics.median(busy_steady)
    print(f"another client PINGing back to back (a daemon of its own): the fill {rate(statistics.median(busy_fresh)):.2f} GiB/s, "
          f"steady state {rate(t_busy):.2f} GiB/s: {t_busy / statistics.median(busy_fresh):.2f}x steady")
    print(f"another client's PINGs during the fill: {len(pings.times)}, longest {max(pings.times) * 1e3:.1f} ms, "
          f"p99 {p99(pings.times) * 1e3:.2f} ms; idle after: longest {max(idle.times) * 1e3:.1f} ms, "
          f"p99 {p99(idle.times) * 1e3:.2f} ms; p99 {p99(pings.times) / p99(idle.times):.1f}x idle")
    print("new clients' first puts GiB/s:", " ".join(f"{rate(t):.2f}" for t in firsts))


def page_rate(nbytes: int, threads: int) -> float | None:
    """Bytes a second this machine makes into new shared pages, as
    kvd-shm-prep makes them on Linux (module docstring; kvd.host.segments.clear,
    the same syscalls written out here: a baseline owes nothing to the code it
    measures), `nbytes` in all on `threads` threads, in segments of the
    arena's size for that RAM tier (a thirty-second, 4 to 64 MiB:
    kvd.server.shm.startup.segment_bytes); None off Linux or where a segment
    could not be made (no memory)."""
    from types import SimpleNamespace

    from kvd.server.shm.startup import segment_bytes

    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return None
    seg = segment_bytes(SimpleNamespace(budget_bytes=nbytes))
    count = max(threads, nbytes // seg)
    zeros = [bytes(256 << 10)] * 16  # 4 MiB a call
    kept: list = []
    failed: list = []

    def make(n: int) -> None:
        for _ in range(n):
            fd = os.memfd_create("kvd-bench")
            kept.append(fd)  # closed below, whatever happens
            try:
                os.ftruncate(fd, seg)
                for off in range(0, seg, 4 * MiB):  # (segments are whole MiB multiples of 4)
                    if os.pwritev(fd, zeros, off) != 4 * MiB:
                        failed.append("short write")
                        return
            except OSError as err:
                failed.append(err)
                return

    t0 = time.perf_counter()
    workers = [threading.Thread(target=make, args=(count // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    t = time.perf_counter() - t0
    for fd in kept:
        os.close(fd)
    return None if failed else len(kept) * seg / t


def p99(times: list[float]) -> float:
    return sorted(times)[min(len(times) - 1, int(len(times) * 0.99))]


_PING = r"""
import select, sys, time
from kvd_client import Client
with Client(sys.argv[1], namespace="pinger", timeout=10, strict=True, transport="frames") as c:
    c.ping()
    print("ready", flush=True)
    times = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        t0 = time.perf_counter()
        c.ping()
        times.append(time.perf_counter() - t0)
    print(" ".join(f"{t:.6f}" for t in times), flush=True)
"""


class _Pinger:
    """A client in a process of its own PINGing back to back while the block runs (`times`)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.times: list[float] = []

    def __enter__(self) -> "_Pinger":
        self.proc = subprocess.Popen([sys.executable, "-c", _PING, self.endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        self.times = [float(x) for x in out.split()] or [float("nan")]


if __name__ == "__main__":
    main()
