"""What kvd costs the generation thread, for a realistic mlx-lm cache.

    python bench/bench_mlx.py [--reps 5] [--tokens 2048] [--transports frames,shm] [--no-demo]

Cache: 32 layers of KVCache, 8 KV heads, head dim 128, bfloat16, 2,048
tokens (256 MiB) -- a 7-8B model's prompt cache. Prints, with ratios to
baselines measured in the same run:

  store  time `Client.store` holds the caller's thread (slice, eval, copy to
         host; the upload runs on the writer thread), vs a plain in-process
         copy of the same arrays to fresh numpy memory, and vs memcpy into an
         already-touched buffer: cold (nothing held), and for a conversation
         going on (the daemon holds all but the last 256 tokens: one chunk is
         copied);
  fetch  time `Client.fetch` holds the caller's thread (GET, join,
         mlx arrays rebuilt and evaluated), split into wire and rebuild;

store and fetch are measured for each data plane (`frames`: bytes inside
ZeroMQ messages over ipc; `shm`: the shared-memory plane, PROTOCOL.md
section 14), against the same baselines.
  demo   fetch vs cold prefill of the same prefix with the demo model
         (examples/demo_shared_prefix.py), i.e. what a hit saves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "examples"))
from _util import GiB, daemon, machine, median_time  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128


def mlx_client(endpoint, namespace, **kw):
    from kvd_client import Client

    return Client(endpoint, namespace=namespace, timeout=60.0, **kw)


def big_cache(tokens: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for i in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, tokens, DIM), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(k, k + 1)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def main() -> None:
    import mlx.core as mx

    from demo_shared_prefix import build_model
    from demo_shared_prefix import tokens as demo_tokens
    from mlx_lm.models.cache import make_prompt_cache

    from kvd_client.mlx_lm import namespace_for, rebuild, snapshot

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--transports", default="frames,shm")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-model comparison")
    p.add_argument("--mlx-default-cache", action="store_true",
                   help="keep mlx's buffer cache limit as it is (on Linux CPU, 32 MiB)")
    args = p.parse_args()
    if not args.mlx_default_cache:
        # mlx keeps freed buffers for reuse up to its cache limit: on Metal that is
        # the memory limit, on Linux CPU only 32 MiB, so a 256 MiB fetch there
        # page-faults fresh memory every time (~150 ms of zeroing here). Use
        # Metal's default, as a model server on a Mac runs.
        before = mx.set_cache_limit(mx.get_memory_limit())
        print(f"mlx buffer cache limit {before >> 20} MiB -> {mx.get_memory_limit() >> 20} MiB (Metal's default; "
              "--mlx-default-cache keeps it)")
    T, reps = args.tokens, args.reps
    toks = list(range(T))
    caches = big_cache(T)
    nbytes = sum(c.keys[..., :T, :].nbytes * 2 for c in caches)
    print(f"kvd mlx bench: {LAYERS} layers x {HEADS} KV heads x dim {DIM}, {T} tokens bf16 = "
          f"{nbytes / 2**20:.0f} MiB; {machine()}; median of {reps}")

    # Baselines: the same bytes copied in-process.
    views = [x.view(mx.uint16) for c in caches for x in (c.keys[..., :T, :], c.values[..., :T, :])]
    mx.eval(views)
    fresh = median_time(lambda: [np.array(v) for v in views], reps)
    touched = [np.array(v) for v in views]
    memcpy = median_time(lambda: [np.copyto(d, np.asarray(v)) for d, v in zip(touched, views)], reps)

    take = median_time(lambda: snapshot(toks, caches), reps)

    gibs = lambda s: nbytes / GiB / s  # noqa: E731
    print(f"baseline copy to fresh numpy   {fresh * 1e3:8.1f} ms  {gibs(fresh):5.2f} GiB/s")
    print(f"baseline memcpy, touched dest  {memcpy * 1e3:8.1f} ms  {gibs(memcpy):5.2f} GiB/s")
    print(f"snapshot (take) on caller      {take * 1e3:8.1f} ms  {gibs(take):5.2f} GiB/s  "
          f"{take / fresh:4.2f}x fresh copy  {take / memcpy:4.2f}x memcpy", flush=True)
    ram_mb = max(2048, 3 * nbytes // 2**20 + 256)
    with daemon("--ram-mb", str(ram_mb), "--data-dir", "none") as d:
        endpoint = d.endpoint
        for plane in args.transports.split(","):
            with mlx_client(endpoint, f"bench-mlx-{plane}", transport=plane) as kv:
                assert kv.store(toks, caches, wait=True), kv.counters
                rounds = iter(range(1, 10**6))
                state = {}

                # Cold: token ids the daemon has never seen, so every chunk is copied.
                def fresh_ids():
                    kv.flush_stores(300)
                    r = next(rounds)
                    state["t"] = [(t + 1_000_003 * r) % 2**31 for t in toks]

                store = median_time(lambda: kv.store(state["t"], caches), reps, setup=fresh_ids)

                # A conversation going on: the daemon holds all but the last 256
                # tokens, so store copies one chunk (plus a probe round trip).
                def held_but_last_chunk():
                    kv.flush_stores(300)
                    r = next(rounds)
                    base = [(t + 1_000_003 * r) % 2**31 for t in toks]
                    assert kv.store(base, caches, wait=True)
                    state["t"] = base[: T - 256] + [(t + 7) % 2**31 for t in base[T - 256 :]]

                store_inc = median_time(lambda: kv.store(state["t"], caches), reps, setup=held_but_last_chunk)
                kv.flush_stores(300)
                assert kv.store(toks, caches, wait=True)  # held again if the stores above evicted it
                query = toks + [1]
                hit_holder = {}

                def get():
                    hit_holder["hit"] = kv.get(query, max_tokens=T)

                get()  # warm-up: the daemon's first read of fresh chunks is not what we measure
                fetch = median_time(lambda: kv.fetch(query), reps)
                wire = median_time(get, reps)
                rebuild_s = median_time(lambda: rebuild(hit_holder["hit"]), reps)
                cache, n = kv.fetch(query)
                assert n == T, n
                used = kv.counters["shm_gets"], kv.counters["shm_puts"]
                assert (min(used) > 0) == (plane == "shm"), (plane, used)
                del cache, hit_holder["hit"]
            print(f"[{plane:>6}] store() on caller, nothing held {store * 1e3:7.1f} ms  {gibs(store):5.2f} GiB/s  "
                  f"{store / fresh:4.2f}x fresh copy  {store / memcpy:4.2f}x memcpy")
            print(f"[{plane:>6}] store() on caller, all but 256 held {store_inc * 1e3:5.1f} ms  "
                  f"({store_inc / fresh:4.2f}x a fresh copy of the whole cache)")
            print(f"[{plane:>6}] fetch() on caller              {fetch * 1e3:8.1f} ms  {gibs(fetch):5.2f} GiB/s  "
                  f"{fetch / fresh:4.2f}x fresh copy  (get {wire * 1e3:.1f} ms + rebuild {rebuild_s * 1e3:.1f} ms)",
                  flush=True)
    if args.no_demo:
        return
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
