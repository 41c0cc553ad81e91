"""What kvd costs the generation thread, for mlx-lm caches of the size people run.

    python bench/bench_mlx.py [--reps 5] [--big-reps 3] [--sizes 256,1024,4096]
                              [--daemons warm,fresh] [--transports frames,shm] [--pressure-source auto|off] [--no-demo]

Cache: 32 layers of KVCache, 8 KV heads, head dim 128, bfloat16 -- an 8B
model's prompt cache, or a 70B-class model's at a quarter of the tokens:
2,048 tokens are 256 MiB, 8,192 are 1 GiB, 32,768 are 4 GiB (`--sizes`, in
MiB; `--tokens N` for one cache of N tokens). For each size it prints, with
ratios to two baselines measured in the same run on the same arrays:

  memcpy  the cache's bytes copied into an already-touched buffer (the floor
          of one copy), and `fresh`: copied into newly allocated memory;
          also printed: the same copy out of a shared-memory mapping made just
          before (what a new client's first fetch from a fresh daemon must at
          least do: its page tables filled as it reads);
  store   time `Client.store` holds the caller's thread (slice, eval, the
          copy to host; the upload runs on the writer thread): nothing held
          (every chunk copied), and, warm only, a conversation going on (all
          but the last 256 tokens held: one chunk copied);
  fetch   time `Client.fetch` holds the caller's thread (GET, join into mlx
          memory, mlx-lm caches rebuilt and evaluated); below 2 GiB split
          into wire (`get`) and `rebuild`; then each rep's time, in order
          (the first fetch into mlx memory new to the process pays for it);

for each data plane (`frames`: bytes in ZeroMQ messages over ipc; `shm`: the
shared-memory plane, PROTOCOL.md section 14) and each daemon:
  warm    its RAM tier filled until it recycles memory, one long-lived client
          (a daemon that has run for a while);
  fresh   started just before, one per rep: the first store into it (its
          arena empty), then the first fetch from it, by a new client.

A line per size ends it: issue 42's targets (medians), store() <= 1.3x a
touched memcpy and fetch() <= 1.5x, met or not, per daemon and plane. A
fetch that serves fewer tokens than were stored prints no figure: it says
how many it served and why (the read lease, memory pressure, the RAM
budget; _util.short_reason). The RAM tier is sized for what the run holds
(one entry resident at 4 GiB), and a size is skipped, saying so, if the
machine has not the memory for it (~13.5 GiB at 4 GiB).
  demo    fetch vs cold prefill of the same prefix with the demo model
          (examples/demo_shared_prefix.py), i.e. what a hit saves.
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
sys.path.insert(0, str(ROOT.parent / "examples"))
from _util import (GiB, MiB, kv_cache, daemon, load_average, machine, median_time, mem_available,  # noqa: E402
                   ratio_verdict, room_for, short_reason, times_of)

LAYERS, HEADS, DIM = 32, 8, 128
PER_TOKEN = LAYERS * HEADS * DIM * 2 * 2  # keys and values, bf16
BIG = 2 << 30  # from here the RAM tier holds one entry and the get/rebuild split is not run
STORE_TARGET, FETCH_TARGET = 1.3, 1.5  # issue 42, x one touched memcpy


def mlx_client(endpoint, namespace, **kw):
    from kvd_client import Client

    return Client(endpoint, namespace=namespace, timeout=120.0, **kw)


def new_mapping_copy(buffers: list[np.ndarray], reps: int) -> float:
    """Median time to copy `buffers`' bytes into themselves out of a shared
    memory object mapped just before, its pages resident (written by another
    mapping): what a new client's first fetch from a fresh daemon must at least
    do, its page tables filled as it reads (with 4 KiB pages, ~65,000 entries
    per 256 MiB; with 2 MiB shared-memory pages, 128)."""
    from multiprocessing import shared_memory

    nbytes = sum(b.nbytes for b in buffers)
    owner = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        src, at = np.frombuffer(owner.buf, np.uint8), 0
        for b in buffers:
            src[at:at + b.nbytes] = b.reshape(-1).view(np.uint8)
            at += b.nbytes
        del src

        def copy():
            seg = shared_memory.SharedMemory(name=owner.name)
            try:
                view, at = np.frombuffer(seg.buf, np.uint8), 0
                for b in buffers:
                    np.copyto(b.reshape(-1).view(np.uint8), view[at:at + b.nbytes])
                    at += b.nbytes
                del view
            finally:
                seg.close()

        return median_time(copy, reps)
    finally:
        owner.close()
        owner.unlink()


def big_cache(tokens: int):
    return kv_cache(tokens, LAYERS, HEADS, DIM)


def ram_mb_for(nbytes: int) -> int:
    """A warm RAM tier holds two entries beside the one being stored (one
    from 2 GiB: three caches' worth would not fit beside the client's copies
    on this 24 GiB machine, so each store there first empties it)."""
    return (nbytes // MiB + 512) if nbytes >= BIG else (3 * nbytes // MiB + 512)


def main() -> None:
    import mlx.core as mx

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--big-reps", type=int, default=3, help="reps at 2 GiB and above")
    p.add_argument("--sizes", default="256", help="cache sizes in MiB, comma-separated (256,1024,4096)")
    p.add_argument("--tokens", type=int, default=None, help="one cache of this many tokens instead of --sizes")
    p.add_argument("--daemons", default="warm,fresh")
    p.add_argument("--transports", default="frames,shm")
    p.add_argument("--pressure-source", default="auto",
                   help="the daemons' pressure_source (auto, their default: the RAM tier yields to this "
                         "machine's memory pressure and a read comes back short, saying so; off: the paths alone)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-model comparison")
    p.add_argument("--mlx-default-cache", action="store_true",
                   help="keep mlx's buffer cache limit as it is (on Linux CPU, 32 MiB)")
    args = p.parse_args()
    sizes = [args.tokens] if args.tokens else [int(m) * MiB // PER_TOKEN for m in args.sizes.split(",")]
    print(f"# bench_mlx  {LAYERS} layers x {HEADS} KV heads x dim {DIM}, bf16; {machine()}; "
          f"medians of {args.reps} ({args.big_reps} from 2 GiB); load average {load_average()}", flush=True)
    verdicts = []
    for T in sizes:
        nbytes = T * PER_TOKEN  # at most three copies held, or two beside the daemon's RAM tier
        if not room_for(max(3 * nbytes, 2 * nbytes + ram_mb_for(nbytes) * MiB) + GiB, f"{T} tokens"):
            continue
        if not args.mlx_default_cache:
            # mlx keeps freed buffers for reuse up to its cache limit: on Metal that is
            # the memory limit, on Linux CPU only 32 MiB, so a fetch there page-faults
            # fresh memory every time. Keep a fetch's worth and more, as a model server
            # on a Mac would (Metal's default, bounded so 4 GiB runs fit here).
            mx.set_cache_limit(min(mx.get_memory_limit(), T * PER_TOKEN + (1 << 30)))
        verdicts.append(one_size(T, args))
        mx.clear_cache()
    for line in verdicts:
        print(line)
    if not args.no_demo:
        demo(args.reps)


def one_size(T: int, args) -> str:
    import mlx.core as mx

    from kvd_client.mlx_lm import rebuild, snapshot

    nbytes = T * PER_TOKEN
    big = nbytes >= BIG
    reps = args.big_reps if big else args.reps
    toks = list(range(T))
    caches = big_cache(T)
    gibs = lambda s: nbytes / GiB / s  # noqa: E731
    print(f"\n== {T} tokens = {nbytes / MiB:.0f} MiB, medians of {reps}, load average {load_average()} ==")

    # Baselines: the same bytes copied in-process.
    views = [x.view(mx.uint16) for c in caches for x in (c.keys[..., :T, :], c.values[..., :T, :])]
    mx.eval(views)
    fresh = median_time(lambda: [np.array(v) for v in views], reps)
    touched = [np.array(v) for v in views]
    memcpy = median_time(lambda: [np.copyto(d, np.asarray(v)) for d, v in zip(touched, views)], reps)
    try:
        mapped = new_mapping_copy(touched, reps)
    except OSError as err:  # (no room in /dev/shm for 4 GiB more, say)
        print(f"(no new-mapping baseline: {err})")
        mapped = float("nan")
    touched = views = None  # noqa: F841  (freed: at 4 GiB they are 8 GiB)
    mx.clear_cache()  # and out of mlx's buffer cache
    take = median_time(lambda: snapshot(toks, caches), reps)
    print(f"baseline memcpy, touched dest    {memcpy * 1e3:9.1f} ms  {gibs(memcpy):5.2f} GiB/s")
    print(f"baseline copy to fresh numpy     {fresh * 1e3:9.1f} ms  {gibs(fresh):5.2f} GiB/s  {fresh / memcpy:5.2f}x memcpy")
    print(f"baseline copy out of a new map   {mapped * 1e3:9.1f} ms  {gibs(mapped):5.2f} GiB/s  {mapped / memcpy:5.2f}x memcpy  "
          f"(shared memory, pages resident, mapped just before)")
    print(f"snapshot to numpy (in process)   {take * 1e3:9.1f} ms  {gibs(take):5.2f} GiB/s  {take / memcpy:5.2f}x memcpy",
          flush=True)

    def ratio(s: float) -> str:
        return f"{s * 1e3:9.1f} ms  {gibs(s):5.2f} GiB/s  {s / memcpy:5.2f}x memcpy  {s / fresh:4.2f}x fresh"

    ram_mb = ram_mb_for(nbytes)
    ids = lambda r: [(t + 1_000_003 * r) % 2**31 for t in toks]  # noqa: E731  # r: a cache never seen
    rounds = iter(range(1, 10**6))
    found: dict[tuple[str, str], tuple[float, float]] = {}  # (daemon, plane) -> (store, fetch) ratios

    def fetch_times(kv, query, n_reps: int) -> tuple[list[float], list[int]]:
        served = []
        times = times_of(lambda: served.append(kv.fetch(query)[1]), n_reps)
        return times, served

    for kind in args.daemons.split(","):
        for plane in args.transports.split(","):
            tag = f"[{kind:>5} {plane:>6}]"
            # Beside the caches it holds: the daemon's copy and the snapshot or
            # the fetched arrays. Other tenants may have taken memory since.
            if big and mem_available() is not None and mem_available() < 2 * nbytes + GiB:
                # What the rows before left in this process's caches (mlx's buffer
                # cache holds a fetch's arrays, the snapshot pool a store's) is
                # given back first: a fresh 4 GiB row was skipped for it.
                from kvd_client.mlx_lm import _pool

                mx.clear_cache()
                _pool.SHARED.clear()
            if big and not room_for(2 * nbytes + GiB, f"{tag} {nbytes // MiB} MiB"):
                continue
            stats = None
            if kind == "warm":
                with daemon("--ram-mb", str(ram_mb), "--data-dir", "none", "--pressure-source", args.pressure_source) as d, \
                        mlx_client(d.endpoint, f"bench-mlx-{plane}", transport=plane) as kv:
                    for _ in range(ram_mb * MiB // nbytes + 1):  # fill the RAM tier and go on until it recycles
                        assert kv.store(ids(next(rounds)), caches, wait=True), kv.counters
                    state = {}

                    def new_ids():  # token ids the daemon has never seen: every chunk is copied
                        kv.flush_stores(600)
                        if big:
                            kv.gc(ram_bytes=0)  # one entry resident (its memory stays in the arena: warm)
                        state["t"] = ids(next(rounds))

                    store = median_time(lambda: kv.store(state["t"], caches), reps, setup=new_ids)

                    def held_but_last_chunk():  # a conversation going on: one chunk copied
                        new_ids()
                        base = state["t"]
                        assert kv.store(base, caches, wait=True), kv.counters
                        state["t"] = base[: T - 256] + [(t + 7) % 2**31 for t in base[T - 256:]]

                    store_inc = median_time(lambda: kv.store(state["t"], caches), reps, setup=held_but_last_chunk)
                    new_ids()
                    assert kv.store(state["t"], caches, wait=True), kv.counters
                    query = state["t"] + [1]
                    times, served = fetch_times(kv, query, reps)
                    wire = rebuild_s = float("nan")
                    if not big and min(served) == T:  # the split holds two more copies: not at 4 GiB on 24 GiB
                        hit_holder = {}
                        wire = median_time(lambda: hit_holder.__setitem__("hit", kv.get(query, max_tokens=T)), reps)
                        rebuild_s = median_time(lambda: rebuild(hit_holder["hit"]), reps)
                        hit_holder.clear()
                    counters = dict(kv.counters)
                    stats = kv.stats()
            else:
                # A fresh daemon per rep: the first store into an empty arena,
                # then the first fetch from it, each by a new client.
                store_times, times, served = [], [], []
                counters = {}
                store_inc = wire = rebuild_s = float("nan")
                for _ in range(reps):
                    with daemon("--ram-mb", str(ram_mb), "--data-dir", "none", "--pressure-source", args.pressure_source) as d:
                        t = ids(next(rounds))
                        for first in (True, False):
                            with mlx_client(d.endpoint, f"bench-mlx-{plane}", transport=plane) as kv:
                                if first:
                                    t0 = time.perf_counter()
                                    kv.store(t, caches)
                                    store_times.append(time.perf_counter() - t0)
                                    assert kv.flush_stores(600), kv.counters  # (a fetch short of T says why)
                                else:
                                    ts, ns = fetch_times(kv, t + [1], 1)
                                    times += ts
                                    served += ns
                                    stats = kv.stats() if min(ns) < T else stats
                                for k, v in kv.counters.items():
                                    counters[k] = counters.get(k, 0) + v
                store = statistics.median(store_times)
            used = counters.get("shm_gets", 0), counters.get("shm_puts", 0)
            assert (min(used) > 0) == (plane == "shm") or min(served) < T, (plane, used)
            late = counters.get("shm_slots_late", 0)
            print(f"{tag} store(), nothing held       {ratio(store)}" + (f"  ({late} SLOTS late)" if late else ""))
            if store_inc == store_inc:
                print(f"{tag} store(), all but 256 held   {store_inc * 1e3:9.1f} ms")
            fetch = statistics.median(times)
            if min(served) < T:
                print(f"{tag} fetch()                     SHORT: served {sorted(served)} of {T} tokens: "
                      f"{short_reason(counters, stats)}; no figure", flush=True)
                fetch = float("nan")
            else:
                split = "" if wire != wire else f"  (get {wire * 1e3:.1f} ms + rebuild {rebuild_s * 1e3:.1f} ms)"
                print(f"{tag} fetch()                     {ratio(fetch)}{split}", flush=True)
                # Each rep too: a first fetch into mlx memory new to the process pays
                # for that memory (the median hides it; docs/limits.md, new memory).
                print(f"{tag}   each fetch, in order        {' '.join(f'{t * 1e3:.0f}' for t in times)} ms", flush=True)
            found[kind, plane] = (store / memcpy, fetch / memcpy)
    caches = None  # noqa: F841
    parts = []
    for (kind, plane), (s, f) in found.items():
        parts.append(f"{kind} {plane}: " + ratio_verdict("store()", s, STORE_TARGET, at_most=True) + ", "
                     + ratio_verdict("fetch()", f, FETCH_TARGET, at_most=True))
    return f"targets at {nbytes / MiB:.0f} MiB (x one touched memcpy): " + "; ".join(parts)


def demo(reps: int) -> None:
    import mlx.core as mx

    from demo_shared_prefix import build_model
    from demo_shared_prefix import tokens as demo_tokens
    from mlx_lm.models.cache import make_prompt_cache

    from kvd_client.mlx_lm import namespace_for

    with daemon("--ram-mb", "512") as d:
        endpoint = d.endpoint
        # What a hit saves: the demo model, its own cold prefill vs a fetch.
        model = build_model()
        prompt = demo_tokens(1024, seed=1)

        def cold():
            c = make_prompt_cache(model)
            for s in range(0, len(prompt), 512):
                model(mx.array(prompt[s : s + 512])[None], cache=c)
            mx.eval([x.state for x in c])
            return c

        cold()  # warm-up
        demo_cache = cold()
        cold_s = median_time(cold, max(1, reps // 2))
        with mlx_client(endpoint, namespace_for(model)) as dkv:
            dkv.store(prompt, demo_cache, wait=True)
            demo_fetch = median_time(lambda: dkv.fetch(prompt + [1]), reps)
    print(f"demo model, 1024-token prefix: cold prefill {cold_s * 1e3:.1f} ms, fetch {demo_fetch * 1e3:.1f} ms "
          f"-> {cold_s / demo_fetch:.1f}x faster")


if __name__ == "__main__":
    main()
