"""What a write-through acknowledgement costs, and what group commit buys.

One command:

    .venv/bin/python bench/bench_write_through.py [--puts 400] [--clients 1,8]

Against a real `kvd serve`, each client PUTs one-chunk sequences (256 tokens,
~70 KiB) one after another, waiting for each answer. Run once in write-back
mode (the baseline: answered from RAM) and once with `--write-through`
(answered after fsync + commit), with 1 and with N clients at once: the PUTs
of concurrent clients share the writer's batches (one parallel fsync round and
one LMDB commit each), so write-through throughput grows with the clients.
Prints PUTs/s and p50/p99 latency, and the write-through/baseline ratio.

    .venv/bin/python bench/bench_write_through.py --sizes 256,1024 [--reps 3]

Big stores, durable soon after (issue 42): one client PUTs a cache of SIZE
MiB (bf16, 8 heads x 128, 256-token chunks of 4 MiB per layer-sized tensor)
into a write-through daemon, which answers once every chunk is fsynced and
indexed; against the baseline measured in the same run on the same
filesystem: one `write` + `fsync` of the same bytes into one new file.
Prints the medians and the ratio (target: <= 1.5x).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _util import DaemonProcess  # noqa: E402
from support import prefix_snapshot  # noqa: E402


def measure(write_through: bool, clients: int, puts: int) -> tuple[float, float, float]:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-wt-", dir="/tmp"))
    args = ["--ram-mb", "1024", "--min-free-gb", "0"] + (["--write-through"] if write_through else [])
    d = DaemonProcess(workdir, args).start()
    lat: list[float] = []
    per = puts // clients

    def work(k: int) -> None:
        with d.client("bench-wt", strict=True) as c:
            for i in range(per):
                s = np.arange(256) + 1_000 * (k * per + i)
                snap = prefix_snapshot(s)
                t = time.perf_counter()
                assert c.put(s, snap)
                lat.append(time.perf_counter() - t)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = per * clients / (time.perf_counter() - t0)
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    q = statistics.quantiles(lat, n=100)
    return rate, q[49] * 1e3, q[98] * 1e3


def big_store(size_mib: int, reps: int, transport: str) -> tuple[float, float]:
    """Median seconds of (a write-through PUT of `size_mib`, one write+fsync of
    as many bytes), alternating which goes first."""
    import os

    from kvd_client import HostTensor, Snapshot

    heads, dim = 8, 128
    tokens = size_mib * (1 << 20) // (heads * dim * 2)
    raw = np.random.default_rng(size_mib).integers(0, 1 << 16, size=(1, heads, tokens, dim), dtype=np.uint16)
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-big-", dir="/tmp"))
    args = ["--ram-mb", str(2 * size_mib + 256), "--min-free-gb", "0", "--write-through",
            "--max-message-mb", str(max(512, size_mib + 16))]
    d = DaemonProcess(workdir, args).start()
    kvd_s, raw_s = [], []
    try:
        with d.client("bench-big", strict=True, timeout=120, transport=transport) as c:
            for r in range(reps):
                def kvd_once() -> None:
                    s = np.arange(tokens) + 10_000_000 * (r + 1)
                    snap = Snapshot(sliced={"k": (HostTensor("bfloat16", raw), 2)})
                    t = time.perf_counter()
                    assert c.put(s, snap)
                    kvd_s.append(time.perf_counter() - t)

                def raw_once() -> None:
                    path = d.data_dir / f"raw-{r}"
                    t = time.perf_counter()
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    mv = memoryview(raw).cast("B")
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    os.fsync(fd)
                    os.close(fd)
                    raw_s.append(time.perf_counter() - t)
                    os.unlink(path)

                for fn in ((kvd_once, raw_once) if r % 2 else (raw_once, kvd_once)):
                    fn()
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return statistics.median(kvd_s), statistics.median(raw_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=400)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--sizes", default="", help="MiB per store, e.g. 256,1024: big write-through stores instead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transport", default="shm", choices=["shm", "frames"])
    a = ap.parse_args()
    if a.sizes:
        print(f"{'MiB':>6} {'store s':>8} {'write+fsync s':>13}  ratio (write-through store, {a.transport}; medians of {a.reps})")
        for size in [int(x) for x in a.sizes.split(",")]:
            k, w = big_store(size, a.reps, a.transport)
            print(f"{size:>6} {k:>8.3f} {w:>13.3f}  {k / w:.2f}x")
        return
    print(f"{'mode':>14} {'clients':>7} {'PUT/s':>8} {'p50 ms':>7} {'p99 ms':>7}  ratio to write-back")
    for n in [int(x) for x in a.clients.split(",")]:
        base = measure(False, n, a.puts)
        wt = measure(True, n, a.puts)
        print(f"{'write-back':>14} {n:>7} {base[0]:>8.0f} {base[1]:>7.2f} {base[2]:>7.2f}")
        print(f"{'write-through':>14} {n:>7} {wt[0]:>8.0f} {wt[1]:>7.2f} {wt[2]:>7.2f}  {wt[0] / base[0]:.2f}x PUT/s")


if __name__ == "__main__":
    main()
