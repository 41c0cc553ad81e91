"""Put and get snapshots of 16 MiB to 4 GiB through a real daemon, warm and freshly started.

    python bench/bench_wire.py [--reps 5] [--big-reps 3] [--sizes 16,64,256] [--daemons warm,fresh]
                               [--clients 3] [--transports frames,shm,shm-noverify] [--host auto|portable]
                               [--pressure-source auto|off] [--load-pause-s 2] [--layers 32]

Issue 42's table: `--sizes 256,1024,4096 --transports frames,shm`.

Prints, per size and data plane (frames over ipc; shm, the shared-memory
plane of PROTOCOL.md section 14), the throughput of Client.put and Client.get
and their ratio to three baselines measured in the same run on the same machine:
  * raw pyzmq: the same bytes over the same ipc transport, zero-copy both
    ways, no kvd code at all, the receiver keeping only the last message:
    the transport's limit;
  * memcpy: numpy copying the same bytes into an already-touched buffer;
  * fresh: numpy copying them into freshly allocated memory (page faults
    included) -- what a get must at least do, since it returns new arrays.
    `t/fresh` is the get's time over that copy's (issue 13's target: <= 1.2x
    over shm); for put, `kvd/memcpy` is the throughput ratio (target >= 0.5).
The daemon runs with the RAM tier only, one per size and plane, measured
  warm     at steady state (its RAM tier already full, so every put also
           evicts; one long-lived client), and the first put of each of
           `--clients` new clients of that warm daemon (`new client`);
  fresh    started just before, one per rep: the puts that fill its RAM
           tier (`fresh`, their median; `fresh 1st`, the first put's), then
           its first get; put at once after the start, and again as a model
           server meets it (`fresh+load`, `load 1st`: the client connects,
           then `--load-pause-s` of model loading before the first put), and
           restarted on its endpoint after a run that was given the same
           chunks (`restart+load`, with that pause: the window is prepared in
           the size its last run noted, kvd/server/shm/folders.py).
On this VM receiving into a process whose memory is still growing is
several times slower, for raw pyzmq too. A line per fresh row gives its
fill in all (every put of every rep: the median hides the puts that outran
the window) and each put of its first rep; the run's last line, the rate
this machine makes new shared memory ready at, a GiB at a time, as much as
the biggest fill (`new_memory`): past its window a fill can go no faster.
`x steady` is a put's rate over the
warm steady state's, and a line per size ends the run: issue 42's targets,
a fresh daemon's fill and a new client's first put each >= 0.5x the steady
state (the fill both at once and after the model load's pause). A get
served short (fewer tokens than were put) prints no figure but how many and why (_util.short_reason). A size is skipped, saying so, if the
machine has not the memory for it (~13 GiB at 4 GiB). `shm-noverify` is
the shm plane with `Client(verify=False)`: a get that does not check the
digests fixed at COMMIT (the price of the check).
`--host portable` runs the daemon on the portable host (KVD_HOST: shm_open
segments, as on macOS, instead of sealed memfds).
The snapshot is a realistic layout: 32 layers x (keys, values) of
(1, 8 KV heads, T tokens, 128) bfloat16, T chosen to hit the size: an 8B
model's, 32 MiB per 256-token chunk. `--layers 80` is a 70B-class model's,
80 MiB per chunk: bigger than the daemon's segments (at most 64 MiB).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import (GiB, MiB, daemon, load_average, machine, median_time, ratio_verdict, room_for,  # noqa: E402
                   short_reason, times_of)

from kvd_client import Client, HostTensor, Snapshot  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2

RAW_SERVER = textwrap.dedent(
    """
    import sys, zmq, collections
    ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind(sys.argv[1])
    kept = collections.deque(maxlen=int(sys.argv[2]))  # like a cache: keep the last K
    while True:
        ident, op, *rest = s.recv_multipart(copy=False)
        op = op.bytes
        if op == b"put":
            kept.append(rest)  # keep the frames, as the daemon does
            s.send_multipart([ident, b"ok"])
        elif op == b"get":
            s.send_multipart([ident, *kept[-1]], copy=False)
        else:
            s.send_multipart([ident, b"bye"]); break
    """
)


def snapshot(n_tokens: int, seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    sliced = {}
    for layer in range(LAYERS):
        for kind in ("k", "v"):
            bits = rng.integers(0, 1 << 16, size=(1, HEADS, n_tokens, DIM), dtype=np.uint16)
            sliced[f"{layer}.{kind}"] = (HostTensor.bfloat16(bits), 2)
    return Snapshot(sliced=sliced)


def raw_zmq(frames: list[np.ndarray], reps: int, keep: int) -> tuple[float, float]:
    """Median put and get times of raw pyzmq; the receiver keeps the last `keep` puts."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-raw-", dir="/tmp"))
    endpoint = f"ipc://{workdir / 'raw.sock'}"
    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, endpoint, str(keep)])
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    time.sleep(0.3)

    def put():
        s.send_multipart([b"put", *frames], copy=False)
        s.recv_multipart()

    def get():
        s.send_multipart([b"get"])
        got = s.recv_multipart(copy=False)
        assert sum(len(f) for f in got) == sum(f.nbytes for f in frames)

    for _ in range(keep):  # reach the steady state: the receiver holds `keep` puts
        put()
    t_put = median_time(put, reps)
    t_get = median_time(get, reps)
    s.send_multipart([b"stop"])
    s.recv_multipart()
    s.close()
    proc.wait(10)
    return t_put, t_get


def baselines(frames: list[np.ndarray], nbytes: int, reps: int) -> tuple[float, float]:
    """Median times to copy the snapshot's frames into one already-touched
    buffer (memcpy) and into one freshly allocated block (what a get joins into)."""
    def into(dst: np.ndarray) -> None:
        at = 0
        for f in frames:
            flat = f.reshape(-1).view(np.uint8)
            dst[at:at + flat.nbytes] = flat
            at += flat.nbytes

    dst = np.empty(nbytes, dtype=np.uint8)
    into(dst)
    t_mem = median_time(lambda: into(dst), reps)
    dst = None  # noqa: F841  (freed before the fresh copies)
    t_fresh = median_time(lambda: into(np.empty(nbytes, dtype=np.uint8)), reps)
    return t_mem, t_fresh


HEADER = (f"{'MiB':>5} {'plane':>12} {'daemon':>10} {'op':>4} {'kvd GiB/s':>10} {'raw zmq GiB/s':>14} {'memcpy GiB/s':>13}"
          f" {'fresh GiB/s':>12} {'kvd/raw':>8} {'kvd/memcpy':>11} {'t/fresh':>8} {'x steady':>9}")


def ram_mb_for(mib: int) -> int:
    """The RAM tier for snapshots of `mib`: four of them; from 2 GiB one
    (this machine has 24 GiB and other tenants): the steady state is then
    "each put evicts the last"."""
    return mib + 256 if mib >= 2048 else 4 * mib + 256


def main() -> None:
    global LAYERS, BYTES_PER_TOKEN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-reps", type=int, default=3, help="reps at 2 GiB and above")
    ap.add_argument("--sizes", default="16,64,256", help="snapshot sizes in MiB")
    ap.add_argument("--daemons", default="warm,fresh", help="warm (steady state, new clients), fresh (newly started)")
    ap.add_argument("--clients", type=int, default=3, help="new clients of the warm daemon, one put each")
    ap.add_argument("--transports", default="frames,shm,shm-noverify", help="data planes to measure")
    ap.add_argument("--pressure-source", default="auto",
                    help="the daemons' pressure_source (auto, their default: the RAM tier yields to this "
                         "machine's memory pressure and a read comes back short, saying so; off: the paths alone)")
    ap.add_argument("--load-pause-s", type=float, default=2.0,
                    help="fresh+load: seconds between a fresh daemon's client connecting and its first put "
                         "(a model server loading its model); 0: no such rows")
    ap.add_argument("--host", default="auto", choices=("auto", "portable"), help="the daemon's host (KVD_HOST)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of the cache (80: a 70B-class model)")
    args = ap.parse_args()
    LAYERS = args.layers
    BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2
    sizes = [int(x) for x in args.sizes.split(",")]
    transports = args.transports.split(",")
    kinds = args.daemons.split(",")
    print(f"# bench_wire  {machine()}  reps={args.reps} ({args.big_reps} from 2 GiB; medians)  host={args.host}"
          f"  load average {load_average()}")
    print(HEADER, flush=True)
    verdicts = []
    for mib in sizes:
        # The snapshot, the daemon's RAM tier, a get's copy (and the memcpy's destination, before).
        if room_for((ram_mb_for(mib) + 2 * mib) * MiB + (1 << 30), f"{mib} MiB"):
            verdicts.append(one_size(mib, args, transports, kinds))
    for line in verdicts:
        print(line)
    if "fresh" in kinds and any(t.startswith("shm") for t in transports):
        print(new_memory(max(ram_mb_for(mib) for mib in sizes) + 1024))  # after every daemon: the floor past a window


def one_size(mib: int, args, transports: list[str], kinds: list[str]) -> str:
    n_tokens = mib * MiB // BYTES_PER_TOKEN
    big = mib >= 2048
    reps = args.big_reps if big else args.reps
    snap = snapshot(n_tokens, seed=mib)
    nbytes = snap.nbytes
    frames = [t.array for t, _ in snap.sliced.values()]
    raw_put, raw_get = raw_zmq(frames, reps, keep=1) if mib <= 1024 else (float("nan"),) * 2
    t_mem, t_fresh = baselines(frames, nbytes, reps)
    # RAM tier only: this measures the wire and the RAM tier. With an SSD tier
    # a full RAM tier spills, and write-back pressure bounds PUT by the disk
    # (that is bench_ssd.py's subject).
    ram_mb = ram_mb_for(mib)
    env = {"KVD_HOST": args.host}
    counter = iter(range(1, 10**9))
    steady: dict[str, float] = {}
    found: dict[tuple[str, str], float] = {}  # (plane, row) -> x steady
    fills_of: dict[tuple[str, str], str] = {}  # (plane, kind) -> a fresh daemon's fill, every put of it

    def row(plane: str, kind: str, op: str, t: float, raw: float, served: list[int] | None = None,
            reason: str = "") -> None:
        if served is not None and min(served) < n_tokens:
            print(f"{mib:>5} {plane:>12} {kind:>10} {op:>4}  SHORT: served {sorted(served)} of {n_tokens} tokens: "
                  f"{reason}; no figure", flush=True)
            return
        x = f"{steady[plane] / t:>9.2f}" if op == "put" and plane in steady else f"{'':>9}"
        print(f"{mib:>5} {plane:>12} {kind:>10} {op:>4} {nbytes / t / GiB:>10.2f} {nbytes / raw / GiB:>14.2f}"
              f" {nbytes / t_mem / GiB:>13.2f} {nbytes / t_fresh / GiB:>12.2f} {raw / t:>8.2f}"
              f" {t_mem / t:>11.3f} {t / t_fresh:>8.2f} {x}", flush=True)

    def client(d, plane: str) -> Client:
        return Client(d.endpoint, namespace=f"bench-{mib}-{plane}", timeout=120, strict=True,
                      transport="shm" if plane.startswith("shm") else plane, verify=plane != "shm-noverify")

    def new_tokens() -> np.ndarray:  # new token ids each put, so nothing dedups
        return np.arange(n_tokens) + next(counter) * 1_000_000

    def timed_put(c: Client) -> float:
        toks = new_tokens()
        t0 = time.perf_counter()
        assert c.put(toks, snap)
        t = time.perf_counter() - t0
        timed_put.last = toks
        return t

    def timed_get(c: Client, toks) -> tuple[list[float], list[int]]:
        served = []
        times = times_of(lambda: served.append(getattr(c.get(toks), "n", 0)), 1)
        return times, served

    for plane in transports:
        kind = "shm" if plane.startswith("shm") else plane
        # Beside the snapshot: the daemon's copy and a get's. Other tenants may have taken memory since.
        if big and not room_for(2 * nbytes + (1 << 30), f"{mib} MiB {plane}"):
            continue
        if "warm" in kinds:
            with daemon("--ram-mb", str(ram_mb), "--data-dir", "none", "--pressure-source", args.pressure_source,
                        env=env) as d:
                with client(d, plane) as c:
                    def fresh_ids():
                        timed_put.next = new_tokens()
                        if big:  # one snapshot at a time: empty the RAM tier first
                            c.gc(ram_bytes=0)

                    def put():
                        assert c.put(timed_put.next, snap)

                    for _ in range(1 if big else ram_mb // mib + 1):  # steady state: a full RAM tier
                        fresh_ids()
                        put()
                    t_put = median_time(put, reps, setup=fresh_ids)
                    hit_tokens = timed_put.next
                    got = []

                    def get():
                        got.append(getattr(c.get(hit_tokens), "n", 0))

                    get()
                    t_get = median_time(get, reps)
                    used = c.counters["shm_puts"], c.counters["shm_gets"]
                    assert (used[0] > 0 and used[1] > 0) == (kind == "shm") or min(got) < n_tokens, (plane, used)
                    reason = short_reason(c.counters, c.stats()) if min(got) < n_tokens else ""
                steady[plane] = t_put
                row(plane, "warm", "put", t_put, raw_put)
                row(plane, "warm", "get", t_get, raw_get, got, reason)
                firsts = []
                for _ in range(max(1, args.clients)):  # each its own mappings, as a newly started model server
                    with client(d, plane) as c2:
                        if big:
                            c2.gc(ram_bytes=0)
                        firsts.append(timed_put(c2))
                t_new = statistics.median(firsts)
                row(plane, "new client", "put", t_new, raw_put)
                found[plane, "new client's first put"] = t_put / t_new
        # A fresh daemon met three ways: put at once after its start
        # ("fresh"); as a model server meets it ("fresh+load": started, the
        # client connected and its HELLO answered, then a model load's pause
        # of --load-pause-s before the first put); and so after a restart on
        # its endpoint, its last run given these chunks ("restart+load").
        for kind, pause in (("fresh", 0.0), ("fresh+load", args.load_pause_s), ("restart+load", args.load_pause_s)):
            if "fresh" not in kinds or (pause and args.load_pause_s <= 0):
                continue
            fills, first_puts, gets, got, counters, stats, totals = [], [], [], [], {}, None, []
            for _ in range(reps):
                with daemon("--ram-mb", str(ram_mb), "--data-dir", "none", "--pressure-source", args.pressure_source,
                            env=env) as d:
                    if kind == "restart+load":
                        with client(d, plane) as c:
                            timed_put(c)  # the last run: given these chunks (it notes their size)
                        d.restart()  # RAM only: the new run holds nothing
                    with client(d, plane) as c:
                        if pause:
                            c.limits()  # connected: HELLO asked and answered
                            time.sleep(pause)  # the model loads (the pause modelled, not a wait for the daemon)
                        fill = [timed_put(c) for _ in range(max(1, ram_mb // mib))]  # the puts that fill its RAM tier
                        fills += fill
                        totals.append(fill)
                        first_puts.append(fill[0])
                        ts, ns = timed_get(c, timed_put.last)
                        gets += ts
                        got += ns
                        for k, v in c.counters.items():
                            counters[k] = counters.get(k, 0) + v
                        stats = c.stats() if min(ns) < n_tokens else stats
            t_fill = statistics.median(fills)
            row(plane, kind, "put", t_fill, raw_put)
            row(plane, {"fresh": "fresh 1st", "fresh+load": "load 1st", "restart+load": "restart 1st"}[kind], "put",
                statistics.median(first_puts), raw_put)
            row(plane, kind, "get", statistics.median(gets), raw_get, got,
                short_reason(counters, stats) if min(got) < n_tokens else "")
            done = sum(map(sum, totals))
            fills_of[plane, kind] = (f"{mib:>5} {plane:>12} {kind:>10} fill in all: {sum(map(len, totals))} puts,"
                                     f" {nbytes * sum(map(len, totals)) / done / GiB:.2f} GiB/s"
                                     + (f" ({steady[plane] * sum(map(len, totals)) / done:.2f}x steady)" if plane in steady else "")
                                     + "; each put of the first rep, ms: " + " ".join(f"{t * 1e3:.0f}" for t in totals[0]))
            if plane in steady:
                what = {"fresh": "fresh daemon's fill", "fresh+load": f"fresh daemon's fill after a {pause:g} s model load",
                        "restart+load": f"restarted daemon's fill after a {pause:g} s model load"}[kind]
                found[plane, what] = steady[plane] / t_fill
    parts = [ratio_verdict(f"{plane} {what}", x, 0.5, at_most=False) for (plane, what), x in sorted(found.items())]
    return "\n".join([*fills_of.values(), f"targets at {mib} MiB (x the steady state's put): " + "; ".join(parts)])


def new_memory(mib: int) -> str:
    """What this machine gives a fresh daemon's fill once past its window: the
    rate of making `mib` MiB of new shared memory ready (zeros written through
    a memfd, as the daemon's preparer does, kvd.host.segments.clear), a GiB
    at a time, then freed. On this VM memory no process used lately comes
    from the VM's host at a fraction of the rate of memory freed moments
    before (anonymous memory the same), so a fill that outruns its window
    cannot be faster than this."""
    import os

    from kvd.host.segments import clear

    if not hasattr(os, "memfd_create"):
        return "new memory: no memfd here, not measured"
    fds, rates = [], []
    try:
        for _ in range(-(-mib // 1024)):
            fd = os.memfd_create("kvd-bench-new-memory")
            fds.append(fd)
            os.ftruncate(fd, 1 << 30)
            t0 = time.perf_counter()
            if not clear(fd, 1 << 30):
                break
            rates.append(1 / (time.perf_counter() - t0))
    finally:
        for fd in fds:
            os.close(fd)
    return (f"this machine now: new shared memory made ready, {len(rates)} GiB a GiB at a time (GiB/s): "
            + " ".join(f"{r:.2f}" for r in rates))


if __name__ == "__main__":
    main()
