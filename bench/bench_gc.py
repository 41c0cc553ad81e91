"""Does a big RAM tier make every client wait for the garbage collector? (issue 12)

    python bench/bench_gc.py [--seconds 30] [--ram-mb 3000]

One client fills a RAM-only daemon with small entries (PUTs of 1,024 tokens in
16 chunks of 4 KiB, as fast as answered: ~150 k entries in 30 s) while another
GETs a 300-token RAM hit in a closed loop the whole time. Twice, in this order:
with CPython's own collector (`--no-gc-on-tick`, the baseline) and with the
daemon's (`gc_on_tick`, the default: kvd/server/collector.py). Prints the good
client's latency (p50, p99, p99.9, max, GETs over 20 ms) and the ratios.
CPython's collector scans every tracked object whenever the long-lived ones have
grown by a quarter: the pauses grow with the tier and land on whoever is served.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import daemon, machine  # noqa: E402

from kvd_client import Client, HostTensor, Snapshot  # noqa: E402

FILL = r"""
import sys, time, numpy as np
from kvd_client import Client, HostTensor, Snapshot
ep, secs = sys.argv[1], float(sys.argv[2])
snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.full((1, 1024, 4), 1, np.uint8)), 1)})
with Client(ep, namespace="fill", timeout=10, chunk_tokens=64) as c:
    i, end = 0, time.monotonic() + secs
    while time.monotonic() < end:
        assert c.put([i, 7, 9, 11] * 256, snap)
        i += 1
print(i, flush=True)
"""


def run(seconds: float, ram_mb: int, *flags: str) -> dict:
    with daemon("--data-dir", "none", "--ram-mb", str(ram_mb), *flags) as d:
        endpoint = d.endpoint
        with Client(endpoint, namespace="good", timeout=5, chunk_tokens=256) as good:
            tokens = list(range(300))
            assert good.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(np.ones((1, 300, 8), np.float16)), 1)}))
            filler = subprocess.Popen([sys.executable, "-c", FILL, endpoint, str(seconds)], stdout=subprocess.PIPE)
            times = []
            while filler.poll() is None:
                t0 = time.perf_counter()
                assert good.get(tokens) is not None
                times.append(time.perf_counter() - t0)
            puts = int(filler.stdout.read())
            stats = good.stats()
    ms = np.sort(np.array(times)) * 1e3
    at = lambda q: float(ms[min(len(ms) - 1, int(len(ms) * q))])  # noqa: E731
    return {"puts": puts, "entries": stats["tiers"]["ram"]["entries"], "n": len(ms), "p50": at(0.5), "p99": at(0.99),
            "p999": at(0.999), "max": float(ms[-1]), "over20": int((ms > 20).sum()), "gc": stats.get("gc", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--ram-mb", type=int, default=3000)
    args = ap.parse_args()
    print(f"bench_gc: {machine()}; {args.seconds:.0f} s of PUTs into a RAM-only daemon (--ram-mb {args.ram_mb}) "
          f"beside a closed loop of GETs")
    rows = [("CPython's collector", run(args.seconds, args.ram_mb, "--no-gc-on-tick")),
            ("on the tick", run(args.seconds, args.ram_mb))]
    print(f"{'collection':>20} {'entries':>8} {'GETs':>6} {'p50 ms':>7} {'p99':>6} {'p99.9':>6} {'max':>7} {'>20 ms':>6}")
    for name, r in rows:
        print(f"{name:>20} {r['entries']:>8} {r['n']:>6} {r['p50']:>7.2f} {r['p99']:>6.2f} {r['p999']:>6.2f} "
              f"{r['max']:>7.1f} {r['over20']:>6}")
    base, tick = rows[0][1], rows[1][1]
    print(f"on the tick / CPython's: p99 {tick['p99'] / base['p99']:.2f}x, p99.9 {tick['p999'] / base['p999']:.2f}x, "
          f"max {tick['max'] / base['max']:.2f}x; the daemon's own count: {tick['gc'].get('young_collections')} tick "
          f"collections, {tick['gc'].get('full_collections')} full")


if __name__ == "__main__":
    main()
