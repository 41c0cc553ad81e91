"""Where a warm shared-memory `fetch()` spends its time (issue 42), stage by stage.

    python bench/probe_fetch.py [--mib 256] [--reps 7] [--transport shm]

One warm daemon (RAM tier only), one long-lived client, one cache of the
bench_mlx shape (32 layers x 8 KV heads x 128, bf16) stored once, then
`--reps` fetches of it. Prints, as medians against one touched memcpy of the
same bytes measured in the same run (alternating with the fetches):

  fetch     Client.fetch as the caller sees it;
  requests  the GET round trips (the daemon's side and the wire);
  join      check, allocation of the mlx memory, the copy (and hash) into it,
            of which `loaded` or `zeroed` is the memory's road (_blocks), and
            `readinto` the copy and hash within the loaded road;
  rebuild   mlx-lm cache objects over that memory, evaluated;
  gc        Python's cyclic garbage collector, wherever it ran.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _util import MiB, daemon, kv_cache, load_average, machine  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128
PER_TOKEN = LAYERS * HEADS * DIM * 2 * 2


class Stages:
    """Wall time spent inside named functions during one fetch."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr, None)
        if inner is None:  # an older tree without this stage
            return

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)


def main() -> None:
    import mlx.core as mx

    from kvd_client import Client, _chunking, _core
    from kvd_client.mlx_lm import _rebuild
    try:
        from kvd_client.mlx_lm import _blocks
    except ImportError:  # an older tree (the baseline): no such stage
        _blocks = None

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--transport", default="shm")
    p.add_argument("--no-verify", action="store_true", help="skip the digest checks (to see what they cost)")
    p.add_argument("--mlx-default-cache", action="store_true",
                   help="keep mlx's buffer cache limit as it is (on Linux CPU, 32 MiB), as bench_snapshot does")
    args = p.parse_args()
    T = args.mib * MiB // PER_TOKEN
    nbytes = T * PER_TOKEN
    if not args.mlx_default_cache:
        mx.set_cache_limit(min(mx.get_memory_limit(), nbytes + (1 << 30)))  # as bench_mlx: a fetch's worth reused
    caches = kv_cache(T, LAYERS, HEADS, DIM)
    views = [x.view(mx.uint16) for c in caches for x in (c.keys[..., :T, :], c.values[..., :T, :])]
    mx.eval(views)
    touched = [np.array(v) for v in views]

    def memcpy():
        for d, v in zip(touched, views):
            np.copyto(d, np.asarray(v))

    stages = Stages()
    collecting = {}

    def gc_timer(phase, info):  # Python's cyclic collector, wherever it runs
        if phase == "start":
            collecting["t"] = time.perf_counter()
        elif "t" in collecting:
            stages.spent["gc"] = stages.spent.get("gc", 0.0) + time.perf_counter() - collecting.pop("t")

    gc.callbacks.append(gc_timer)
    stages.wrap(_core.Core, "_call", "requests")
    stages.wrap(_chunking, "join", "join")
    stages.wrap(_blocks, "_loaded", "loaded")
    if _blocks is not None:
        stages.wrap(_blocks._Source, "readinto", "readinto")  # the copy and hash, inside mx.load
    stages.wrap(_blocks, "_zeroed", "zeroed")
    stages.wrap(_rebuild, "rebuild", "rebuild")
    # _methods imports rebuild at call time from the module: the wrapper is what it finds.
    print(f"# probe_fetch  {nbytes / MiB:.0f} MiB over {args.transport}; {machine()}; load average {load_average()}")
    # pressure_source off: a RAM tier yielding to other tenants here would make a fetch short, not slow
    with daemon("--ram-mb", str(nbytes // MiB + 512), "--data-dir", "none", "--pressure-source", "off") as d, \
            Client(d.endpoint, namespace="probe", transport=args.transport, timeout=120.0, verify=not args.no_verify) as kv:
        toks = list(range(T))
        assert kv.store(toks, caches, wait=True), kv.counters
        rows: dict[str, list[float]] = {"memcpy": [], "fetch": []}
        for _ in range(args.reps):
            t0 = time.perf_counter()
            memcpy()
            rows["memcpy"].append(time.perf_counter() - t0)
            stages.spent.clear()
            t0 = time.perf_counter()
            cache, n = kv.fetch(toks + [1])
            rows["fetch"].append(time.perf_counter() - t0)
            assert n == T, (n, kv.counters)
            for k, v in stages.spent.items():
                rows.setdefault(k, []).append(v)
            cache = None  # noqa: F841  (its memory back to mlx's cache, as a server's would be in time)
        base = statistics.median(rows["memcpy"])
        for k, v in rows.items():
            m = statistics.median(v)
            print(f"{k:10s} {m * 1e3:8.1f} ms  {m / base:5.2f}x memcpy  (min {min(v) * 1e3:.1f})")
        print({k: v for k, v in kv.counters.items() if k.startswith(("shm", "get"))})


if __name__ == "__main__":
    main()
