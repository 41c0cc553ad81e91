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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=400)
    ap.add_argument("--clients", default="1,8")
    a = ap.parse_args()
    print(f"{'mode':>14} {'clients':>7} {'PUT/s':>8} {'p50 ms':>7} {'p99 ms':>7}  ratio to write-back")
    for n in [int(x) for x in a.clients.split(",")]:
        base = measure(False, n, a.puts)
        wt = measure(True, n, a.puts)
        print(f"{'write-back':>14} {n:>7} {base[0]:>8.0f} {base[1]:>7.2f} {base[2]:>7.2f}")
        print(f"{'write-through':>14} {n:>7} {wt[0]:>8.0f} {wt[1]:>7.2f} {wt[2]:>7.2f}  {wt[0] / base[0]:.2f}x PUT/s")


if __name__ == "__main__":
    main()
