"""What `store()` and `fetch()` hold the caller's thread, against one touched memcpy, interleaved.

    python bench/bench_snapshot.py [--sizes 256,1024] [--reps 7] [--transports shm,frames]

Cache: 32 layers of KVCache, 8 KV heads, head dim 128, bfloat16 (256 MiB at
2,048 tokens, 1 GiB at 8,192). Each repetition measures, back to back, a
memcpy of the cache's bytes into an already-touched numpy buffer (the floor,
issue 42's yardstick), then `store()` of token ids the daemon has never seen
(after the previous upload is flushed), then `fetch()` of the whole cache. On a
machine shared with other work the load drifts within a run; measuring the
baseline inside every repetition keeps each ratio honest. Prints medians of
each, and the median of the per-repetition ratios.

It uses only the public client, so it runs against another source tree too
(`PYTHONPATH` with `kvd_client` and `kvd` of a baseline checkout, from a
directory outside this one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _util import kv_cache, daemon, machine  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128


def cache_of(tokens: int):
    return kv_cache(tokens, LAYERS, HEADS, DIM)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(size_mib: int, reps: int, plane: str) -> None:
    import mlx.core as mx

    from kvd_client import Client

    T = size_mib * 2048 // 256
    caches = cache_of(T)
    views = [x.view(mx.uint16) for c in caches for x in (c.keys[..., :T, :], c.values[..., :T, :])]
    mx.eval(views)
    nbytes = sum(v.nbytes for v in views)
    touched = [np.array(v) for v in views]
    memcpy = lambda: [np.copyto(d, np.asarray(v)) for d, v in zip(touched, views)]  # noqa: E731
    toks = list(range(T))
    rows: dict[str, list[float]] = {"memcpy": [], "store": [], "fetch": []}
    misses = 0
    ram_mb = max(2048, 3 * nbytes // 2**20 + 256)
    with daemon("--ram-mb", str(ram_mb), "--data-dir", "none") as d:
        with Client(d.endpoint, namespace=f"bench-snap-{plane}", transport=plane, timeout=60.0) as kv:
            assert kv.store(toks, caches, wait=True), kv.counters
            memcpy()
            for r in range(1, reps + 1):
                kv.flush_stores(300)
                ids = [(t + 1_000_003 * r) % 2**31 for t in toks]
                rows["memcpy"].append(timed(memcpy))
                rows["store"].append(timed(lambda: kv.store(ids, caches)))
                kv.flush_stores(300)
                got = {}
                took = timed(lambda: got.setdefault("hit", kv.fetch(ids + [1])))
                hit = got["hit"][1] == T
                rows["fetch"].append(took if hit else None)  # a miss (seen under heavy load): left out
                misses += not hit
                got.clear()  # the fetched arrays go before the next repetition
            counters = dict(kv.counters)
    if misses:
        why = {k: v for k, v in counters.items() if "fail" in k or "drop" in k or "miss" in k or "busy" in k}
        print(f"{size_mib:5d} MiB [{plane:>6}] fetch() missed {misses} of {reps} (left out; {why})")
    m = statistics.median(rows["memcpy"])
    for k in ("store", "fetch"):
        pairs = [(a, b) for a, b in zip(rows[k], rows["memcpy"]) if a is not None]
        if not pairs:
            continue
        med = statistics.median(a for a, _ in pairs)
        ratios = [a / b for a, b in pairs]
        print(f"{size_mib:5d} MiB [{plane:>6}] {k}() {med * 1e3:8.1f} ms  {nbytes / 2**30 / med:5.2f} GiB/s  "
              f"memcpy {m * 1e3:6.1f} ms  -> {med / m:4.2f}x (median of per-rep ratios "
              f"{statistics.median(ratios):4.2f}x; all: {' '.join(f'{r:.2f}' for r in ratios)})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024", help="cache sizes in MiB (multiples of 128)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--transports", default="shm,frames")
    p.add_argument("--mlx-default-cache", action="store_true",
                   help="keep mlx's buffer cache limit as it is (on Linux CPU, 32 MiB)")
    args = p.parse_args()
    import mlx.core as mx

    if not args.mlx_default_cache:
        mx.set_cache_limit(mx.get_memory_limit())  # Metal's default, as bench_mlx.py does
    print(f"kvd snapshot bench: {LAYERS} layers x {HEADS} KV heads x dim {DIM} bf16; {machine()}; "
          f"{args.reps} reps, memcpy measured in each")
    for size in (int(s) for s in args.sizes.split(",")):
        for plane in args.transports.split(","):
            run(size, args.reps, plane)


if __name__ == "__main__":
    main()
