"""Does kvd's cost stay flat as the SSD tier grows? (issue 12)

    python bench/bench_scale.py [--sizes 10000,100000,1000000] [--mixed-seconds 600]

Fills one data dir to each size in turn (small 256-token chunks, 4 KiB each,
written offline through SsdStore.write_batch, the writer thread's own path,
so the fill itself takes minutes, not hours), then runs a real daemon on it
(`--ram-mb 16`, write-back) and prints, per size:

  * restart: `kvd serve` started until the first LOOKUP of the 32k-token
    anchor prompt (stored before the fill, so on the SSD tier) answers in full;
  * walk: seconds until the start-up walk of the index and reconcile end
    (background work on the writer thread; the daemon serves meanwhile), and
    LOOKUP p99 during that walk;
  * LOOKUP p50/p99 of that 32k-token prompt (128 chunks walked on the SSD tier;
    1,000 LOOKUPs, so after the first the daemon has its keys from its memo of
    recent chains, as for a model server's LOOKUP, GET and PUT of one prompt)
    once the walk is done, against a PING's p50/p99 on the same socket (the
    round trip with no work) and the p99 of a raw ZeroMQ round trip of the
    same 128 KiB to an echo process (`raw p99`: the floor under any LOOKUP);
  * spill: chunks/s the SSD writer takes in behind a PUT (one PUT of a
    2,000-chunk sequence; the chunks not yet on disk at its reply over the
    time until the SSD tier holds all of it: blob encoding, fsyncs and index
    commits; the median of three such PUTs);
  * stop: SIGTERM until the process exits.
First, the SSD writer's own rate for such chunks (`write_batch`, 64 a batch,
every batch synced), each blob a file against packed (pack.py), same run.
Ratios are against the smallest size. Then (unless --mixed-seconds 0) eight
client processes run mixed PUT/GET on the largest tier (after --warmup
seconds that fill the RAM tier) for that long and the ops per window are
printed, with the last window's ratio to the first. Each client GETs one of
the prompts it stored, at random: its working set grows with time, so GETs
turn from RAM hits into SSD hits as the run goes on; `--recent N` keeps it
to each client's last N prompts instead. An op counts only if it
did its work: a PUT stored, a GET served whole; PUTs refused (BUSY: the
daemon over its memory ceiling, or its write-behind backlog full) are
printed apart.

Targets (issue 12): spill rate and LOOKUP p99 at 1 M within 1.5x of 10 k;
LOOKUP p99 < 1 ms; restart < 2 s; last window >= 0.8x the first.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import DaemonProcess, machine  # noqa: E402

from kvd.protocol import keys  # noqa: E402
from kvd.store.base import CHUNK, Entry, Tensor  # noqa: E402
from kvd_client import Client, HostTensor, Snapshot  # noqa: E402

CT = 256  # tokens per chunk
WIDTH = 4  # (1, CT, WIDTH) float16 keys and values: 4 KiB a chunk
ANCHOR_TOKENS = 32 * 1024
NS = "scale"


def chunk_tensors(seed: int) -> tuple[Tensor, ...]:
    raw = np.random.default_rng(seed).integers(0, 1 << 16, size=(2, 1, CT, WIDTH), dtype=np.uint16).tobytes()
    half = len(raw) // 2
    return (Tensor("k", "float16", (1, CT, WIDTH), raw[:half]), Tensor("v", "float16", (1, CT, WIDTH), raw[half:]))


def fill(data: Path, have: int, want: int) -> float:
    """Write one-chunk sequences offline until the SSD tier holds `want` entries; seconds taken."""
    from kvd.store.ssd import SsdStore

    t0 = time.perf_counter()
    store = SsdStore(data, budget_bytes=1 << 40, durable=False, reconcile=False, background=False)
    try:
        batch: list[Entry] = []
        for i in range(have, want):
            tokens = np.array([i, i >> 16, 7] * (CT // 3) + [1] * (CT % 3), dtype="<u4").tobytes()
            key = keys.chain(NS, CT, tokens)[0]
            batch.append(Entry(namespace=NS, key=key, kind=CHUNK, parent=keys.root_key(NS, CT), start=0, length=CT,
                               tensors=chunk_tensors(i), meta=b"\x80", tail=False))
            if len(batch) == 2048:
                store.write_batch(batch)
                batch = []
        if batch:
            store.write_batch(batch)
    finally:
        store.close()
    return time.perf_counter() - t0


def writer_rate(workdir: Path, pack_max_bytes: int, n: int = 4096) -> float:
    """Blobs/s of the SSD writer's own path (`write_batch`, batches of 64, every
    batch synced) for `n` fresh 256-token chunks, in a data dir of their own."""
    from kvd.store.ssd import SsdStore

    data = workdir / f"writer-{pack_max_bytes}"
    shutil.rmtree(data, ignore_errors=True)
    store = SsdStore(data, budget_bytes=1 << 40, pack_max_bytes=pack_max_bytes, reconcile=False, background=False)
    try:
        batch = [Entry(namespace=NS, key=keys.chain(NS, CT, np.full(CT, i, "<u4").tobytes())[0], kind=CHUNK,
                       parent=keys.root_key(NS, CT), start=0, length=CT, tensors=chunk_tensors(i), meta=b"\x80",
                       tail=False) for i in range(n)]
        t0 = time.perf_counter()
        for i in range(0, n, 64):
            store.write_batch(batch[i : i + 64])
        return n / (time.perf_counter() - t0)
    finally:
        store.close()
        shutil.rmtree(data, ignore_errors=True)


def snapshot(n_tokens: int, seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 1 << 16, size=(1, n_tokens, WIDTH), dtype=np.uint16).view(np.float16)
    v = rng.integers(0, 1 << 16, size=(1, n_tokens, WIDTH), dtype=np.uint16).view(np.float16)
    return Snapshot(sliced={"k": (HostTensor.from_numpy(k), 1), "v": (HostTensor.from_numpy(v), 1)})


def anchor_tokens() -> np.ndarray:
    # uint32, as a server holds its token ids (a list of Python ints would add
    # ~1.5 ms of conversion on the client to every call).
    return np.random.default_rng(12345).integers(0, 50000, size=ANCHOR_TOKENS, dtype=np.uint32)


class Daemon(DaemonProcess):
    """The measured daemon: 16 MiB of RAM over the bench's data dir, its start
    (until the anchor prompt is served in full) and stop timed."""

    def __init__(self, workdir: Path, data: Path, extra: list[str] | None = None):
        super().__init__(workdir, ["--data-dir", str(data), "--ram-mb", "16", *(extra or [])])

    def timed_start(self) -> float:
        """Start the daemon; seconds until the anchor prompt is served in full."""
        t0 = time.perf_counter()
        self.start(wait=False)
        anchor = anchor_tokens()
        with Client(self.endpoint, namespace=NS, timeout=0.5, chunk_tokens=CT) as c:
            while c.probe(anchor).n < ANCHOR_TOKENS:
                if self.proc.poll() is not None or time.perf_counter() - t0 > 600:
                    raise RuntimeError(f"the daemon did not serve the anchor prompt:\n{self.log()}")
                time.sleep(0.002)
        return time.perf_counter() - t0

    def timed_stop(self) -> float:
        """SIGTERM it; seconds until it exited."""
        t0 = time.perf_counter()
        self.stop(timeout=600)
        return time.perf_counter() - t0


def lookup_latency(endpoint: str, n: int = 1000) -> tuple[float, float, float, float]:
    """(LOOKUP p50, LOOKUP p99, PING p50, PING p99) of the anchor prompt, in seconds."""
    anchor = anchor_tokens()
    with Client(endpoint, namespace=NS, timeout=5, chunk_tokens=CT, strict=True) as c:
        for _ in range(20):  # warm the socket and the page cache
            c.probe(anchor)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            assert c.probe(anchor).n == ANCHOR_TOKENS
            times.append(time.perf_counter() - t0)
        pings = sorted(c.ping() for _ in range(n))
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1], statistics.median(pings), pings[int(n * 0.99) - 1]


def _echo(endpoint: str) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        sock.send_multipart(frames, copy=False)
        if bytes(frames[-1]) == b"stop":
            break
    sock.close(linger=0)
    ctx.term()


def raw_round_trip(workdir: Path, nbytes: int, n: int = 1000) -> tuple[float, float]:
    """(p50, p99) seconds of a raw ZeroMQ DEALER -> ROUTER -> DEALER round trip of
    `nbytes` in one frame, to an echo in another process over ipc: the floor
    under a LOOKUP that sends the 32k-token prompt (128 KiB) and gets a small answer."""
    import zmq

    endpoint = f"ipc://{workdir / 'raw.sock'}"
    echo = mp.get_context("spawn").Process(target=_echo, args=(endpoint,), daemon=True)
    echo.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    payload, times = b"\x00" * nbytes, []
    try:
        for i in range(n + 50):
            t0 = time.perf_counter()
            sock.send(payload, copy=False)
            sock.recv()
            if i >= 50:  # warm first
                times.append(time.perf_counter() - t0)
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close(linger=0)
        ctx.term()
        echo.join(10)
    times.sort()
    return statistics.median(times), times[int(n * 0.99) - 1]


def walk(endpoint: str) -> tuple[float, float]:
    """(seconds until the SSD tier's start-up walk and reconcile end, LOOKUP p99 meanwhile)."""
    anchor = anchor_tokens()
    t0 = time.perf_counter()
    times = []
    with Client(endpoint, namespace=NS, timeout=5, chunk_tokens=CT, strict=True) as c:
        while not c.stats()["tiers"]["ssd"].get("reconciled", True):
            for _ in range(50):
                t1 = time.perf_counter()
                c.probe(anchor)
                times.append(time.perf_counter() - t1)
            time.sleep(0.05)
    times.sort()
    return time.perf_counter() - t0, times[int(len(times) * 0.99) - 1] if times else float("nan")


def spill_rate(endpoint: str, n: int = 2000, rounds: int = 3) -> float:
    """Chunks per second the SSD writer takes in behind a PUT: one PUT of an
    `n`-chunk sequence (8 MiB of 4 KiB chunks: it fits the 16 MiB RAM tier,
    and the writer starts on it while the daemon stores it), then the chunks
    not yet on disk at its reply over the time until the SSD tier holds all
    (blob encoding, the pack's and the index's synced commits). The PUT's
    own time is left out: it does not depend on the SSD tier's size. The
    median of `rounds` such PUTs."""
    rates = []
    rng = np.random.default_rng()  # new tokens each time, also on a kept data dir
    with Client(endpoint, namespace=NS, timeout=30, chunk_tokens=CT, strict=True) as c:
        snap = snapshot(n * CT, 7)
        for _ in range(rounds):
            toks = rng.integers(0, 1 << 31, size=n * CT, dtype=np.uint32)
            before = c.stats()["tiers"]["ssd"]["entries"]
            assert c.put(toks, snap)
            t0 = time.perf_counter()
            left = before + n - c.stats()["tiers"]["ssd"]["entries"]
            while c.stats()["tiers"]["ssd"]["entries"] < before + n:
                # Not faster: a STATS costs the daemon's thread ~0.5 ms, and
                # the writer takes ~0.3-1 s for what is left.
                time.sleep(0.01)
            rates.append(left / (time.perf_counter() - t0))
    return statistics.median(rates)


def _mixed_worker(endpoint: str, seed: int, seconds: float, window: float, out, recent: int = 0) -> None:
    """PUT a new 4-chunk prompt or GET one of its own earlier ones, 50/50
    (with `recent`, one of its last `recent` stored). An op counts only if
    it did its work: a PUT stored (not refused BUSY), a GET served whole (a
    prompt whose PUT was refused is not asked for). Per window: (PUTs stored,
    GETs served whole, PUTs refused)."""
    rng = np.random.default_rng(seed)
    counts: list[tuple[int, int, int]] = []
    snap = snapshot(4 * CT, seed)
    stored: list[int] = []
    with Client(endpoint, namespace=NS, timeout=10, chunk_tokens=CT) as c:
        t0 = time.perf_counter()
        puts = gets = refused = 0
        edge = t0 + window
        mine = 0
        while True:
            now = time.perf_counter()
            if now >= edge:
                counts.append((puts, gets, refused))
                puts = gets = refused = 0
                edge += window
                if now - t0 >= seconds:
                    break
            if stored and rng.random() < 0.5:
                pool = stored[-recent:] if recent else stored
                j = pool[int(rng.integers(0, len(pool)))]
                hit = c.get([seed, j, 1] * (4 * CT // 3) + [9] * (4 * CT % 3))
                gets += hit is not None and hit.n == 4 * CT
            else:
                if c.put([seed, mine, 1] * (4 * CT // 3) + [9] * (4 * CT % 3), snap):
                    stored.append(mine)
                    puts += 1
                else:
                    refused += 1
                mine += 1
    out.put(counts)


def mixed(endpoint: str, seconds: float, window: float, clients: int = 8,
          recent: int = 0) -> list[tuple[int, int, int]]:
    """Per window, summed over the clients: (PUTs stored, GETs served whole, PUTs refused)."""
    q: mp.Queue = mp.Queue()
    # Seeds of this run's own: a run on a kept data dir PUTs new prompts, not
    # an earlier run's again (duplicates cost next to nothing).
    base = 1000 + (int(time.time()) % 100_000) * 100
    procs = [mp.Process(target=_mixed_worker, args=(endpoint, base + i, seconds, window, q, recent))
             for i in range(clients)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    n = min(len(r) for r in results)
    return [tuple(sum(r[w][k] for r in results) for k in range(3)) for w in range(n)]


def _timed(f, n: int = 200) -> float:
    """Median seconds of `f()`."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--mixed-seconds", type=float, default=600.0)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=40.0, help="seconds of mixed load before the compared windows")
    ap.add_argument("--keep", help="use (and keep) this work dir instead of a temporary one")
    ap.add_argument("--recent", type=int, default=0,
                    help="mixed GETs pick among each client's last N prompts (0: any it stored): a working set "
                         "that stops growing, so a fall over time is the tier's cost, not RAM hits turning into SSD hits")
    ap.add_argument("--daemon-args", default="", help="more `kvd serve` flags, e.g. '--pack-max-kb 0'")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: measure the data dir as it is (no anchor, no fill), then the mixed load")
    args = ap.parse_args()
    logging.getLogger("kvd_client").setLevel(logging.ERROR)  # "no daemon yet" while one starts
    sizes = [int(s) for s in args.sizes.split(",")][: 1 if args.reuse else None]
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvd-scale-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    if args.reuse and not args.keep:
        ap.error("--reuse needs --keep DIR (a work dir an earlier run kept)")
    if args.keep and not args.reuse and data.exists():
        # The fill counts entries from a fresh dir's (the anchor's): on a used one
        # every row would be mislabelled.
        ap.error(f"{data} exists: --reuse to measure it as it is, or --keep an empty dir")
    print(f"bench_scale: {machine()}; 256-token chunks of 4 KiB; daemon --ram-mb 16, write-back; work dir {workdir}")
    files, packed = writer_rate(workdir, 0), writer_rate(workdir, 64 << 10)
    print(f"SSD writer (write_batch, 64 a batch, synced): a file each {files:.0f} blobs/s, packed {packed:.0f} "
          f"blobs/s: {packed / files:.1f}x")
    prompt = anchor_tokens()
    as_list = prompt.tolist()
    listed, arr = _timed(lambda: keys.token_bytes(as_list)), _timed(lambda: keys.token_bytes(prompt))
    print(f"client: a {ANCHOR_TOKENS}-token prompt to wire bytes (keys.token_bytes, p50): from a list "
          f"{listed * 1e6:.0f} us, from an ndarray {arr * 1e6:.0f} us (in every LOOKUP below: an ndarray)")
    d = Daemon(workdir, data, args.daemon_args.split())
    try:
        if not args.reuse:
            # The anchor: a 32k-token prompt stored first, spilled, so every size has it on SSD.
            first = Daemon(workdir, data)  # without --daemon-args
            try:
                with first.start(timeout=60).client(NS, timeout=30, chunk_tokens=CT) as c:
                    assert c.put(anchor_tokens(), snapshot(ANCHOR_TOKENS, 1))
                    c.gc(ram_bytes=0)
                    while c.stats()["tiers"]["ssd"]["entries"] < ANCHOR_TOKENS // CT:
                        time.sleep(0.01)
            finally:
                first.stop(timeout=600)
        have = ANCHOR_TOKENS // CT
        rows = []
        print(f"{'entries':>9} {'fill s':>7} {'restart s':>9} {'walk s':>7} {'p99 ms':>7} {'lookup p50 ms':>13} "
              f"{'p99 ms':>7} {'ping p50':>8} {'p99':>6} {'raw p99':>7} {'spill/s':>8} {'stop s':>7}")
        for size in sizes:
            fill_s = fill(data, have, size) if size > have and not args.reuse else 0.0
            have = max(have, size)
            restart = d.timed_start()
            if args.reuse:  # the dir's own size, whatever --sizes says
                with Client(d.endpoint, namespace=NS, timeout=30) as c:
                    size = have = c.stats()["tiers"]["ssd"]["entries"]
            walk_s, walk_p99 = walk(d.endpoint)
            p50, p99, ping, ping99 = lookup_latency(d.endpoint)
            _, raw99 = raw_round_trip(workdir, ANCHOR_TOKENS * 4)
            rate = spill_rate(d.endpoint)
            have += 3 * 2000
            stop = d.timed_stop()
            rows.append((size, restart, p99, rate, stop, raw99))
            print(f"{size:>9} {fill_s:>7.1f} {restart:>9.2f} {walk_s:>7.1f} {walk_p99 * 1e3:>7.2f} {p50 * 1e3:>13.3f} "
                  f"{p99 * 1e3:>7.3f} {ping * 1e3:>8.3f} {ping99 * 1e3:>6.3f} {raw99 * 1e3:>7.3f} {rate:>8.0f} "
                  f"{stop:>7.2f}", flush=True)
        for size, _, p99, _, _, raw99 in rows:
            print(f"{size:>9}: lookup p99 {p99 / raw99:.2f}x a raw ZeroMQ round trip of the same 128 KiB")
        base = rows[0]
        for size, restart, p99, rate, stop, _ in rows[1:]:
            print(f"{size:>9} vs {base[0]}: lookup p99 {p99 / base[2]:.2f}x, spill rate {rate / base[3]:.2f}x, "
                  f"restart {restart / base[1]:.2f}x, stop {stop / base[4]:.2f}x")
        if args.mixed_seconds > 0:
            # The first windows fill the 16 MiB RAM tier (no spilling yet): a
            # warm-up, printed but not compared; the issue is decay after it.
            warm = max(1, round(args.warmup / args.window))
            d.timed_start()
            split = mixed(d.endpoint, args.mixed_seconds + warm * args.window, args.window, recent=args.recent)
            windows = [p + g for p, g, _ in split]
            with Client(d.endpoint, namespace=NS, timeout=30) as c:
                ssd = c.stats()["tiers"]["ssd"]
            d.timed_stop()
            print(f"mixed, 8 clients{f', GETs among the last {args.recent} prompts' if args.recent else ''}, "
                  f"ops per {args.window:.0f} s window on {have} entries: warm-up {windows[:warm]}, "
                  f"then {windows[warm:]}")
            print("  of which PUTs stored:  ", [p for p, _, _ in split])
            print("          GETs served:   ", [g for _, g, _ in split])
            print("  and PUTs refused BUSY: ", [r for _, _, r in split])
            if len(windows) > warm:
                print(f"last window / first after warm-up: {windows[-1] / windows[warm]:.2f}x")
            print(f"PUTs refused (not counted as ops): {sum(r for _, _, r in split)}; the SSD writer meanwhile: "
                  f"{ssd['spills']} blobs written, {ssd['drops']} dropped {ssd['drop_reasons']}")
    finally:
        d.stop(signal.SIGKILL)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
