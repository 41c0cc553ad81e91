"""A cache keeps what it is given (issue 42): four model-server processes,
each storing a 256 MiB mlx-lm cache one every 100 ms into a daemon with the
default settings and its SSD tier on, are all stored (no BUSY while RAM has
room), a SIGTERM right after still ends within `stop_timeout`, and what
docs/durability.md promises a clean stop writes (with the defaults: every
acknowledged chunk, the disk keeping its measured pace) is on disk: after a
restart all four come back from the SSD tier, bit for bit.

Each child builds its cache (32 layers x 8 KV heads x 2,048 tokens x 128,
bf16, keys and values: 256 MiB) from a seeded pattern, says READY, and
stores with `Client.store(wait=True)` when told GO; this process rebuilds
the same pattern to compare what a fetch returns.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from support import TESTS

LAYERS, HEADS, TOKENS, DIM = 32, 8, 2048, 128  # 256 MiB of bf16 keys and values
CHILDREN = 4
NS = "keeps"


@functools.cache
def _spread() -> np.ndarray:
    """The part of every `rows` that is the same for all (made once: 64 of them a cache)."""
    x = np.arange(HEADS * TOKENS * DIM, dtype=np.uint32)
    x *= np.uint32(2654435761)
    return x


def rows(seed: int, layer: int, which: int) -> np.ndarray:
    """A layer's keys (which=0) or values (1) as uint16 bits, distinct per cache."""
    x = _spread() + np.uint32((seed * 1000 + layer * 2 + which) * 40503)
    x >>= 16
    return x.astype(np.uint16).reshape(1, HEADS, TOKENS, DIM)


def tokens_of(seed: int) -> list[int]:
    return list(range(100_000 * (seed + 1), 100_000 * (seed + 1) + TOKENS))


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{here!r}, {tests!r}]
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvd_client import Client
    from test_backlog_keeps import LAYERS, NS, rows, tokens_of
    seed = {seed}
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.array(rows(seed, layer, 0)).view(mx.bfloat16)
        v = mx.array(rows(seed, layer, 1)).view(mx.bfloat16)
        mx.eval(c.update_and_fetch(k, v))
        caches.append(c)
    del k, v
    with Client({endpoint!r}, namespace=NS, strict=True, timeout=30) as kv:
        assert kv.ping() is not None
        print("READY", flush=True)
        sys.stdin.readline()
        t = time.monotonic()
        try:
            ok = kv.store(tokens_of(seed), caches, wait=True)
        except Exception as exc:  # strict: the daemon's refusal, said
            print("REFUSED", type(exc).__name__, exc, flush=True)
            sys.exit(1)
        print("STORED" if ok else "NOT STORED", round(time.monotonic() - t, 3), flush=True)
    """
)


def _child(endpoint: str, seed: int) -> subprocess.Popen:
    code = CHILD.format(here=str(Path(__file__).resolve().parent), tests=str(TESTS), endpoint=endpoint, seed=seed)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _same(seed: int, caches: list) -> bool:
    for layer, c in enumerate(caches):
        k, v, offset = c.state[0], c.state[1], c.offset
        if offset != TOKENS:
            return False
        for which, got in enumerate((k, v)):
            got = np.asarray(got[:, :, :TOKENS, :].view(mx.uint16))
            if not np.array_equal(got, rows(seed, layer, which)):
                return False
    return True


def test_four_stores_100ms_apart_are_kept_and_a_stop_writes_them(daemon_factory):
    d = daemon_factory()  # the default settings: the SSD tier on, write-back, dirty_max_mb auto
    children = [_child(d.endpoint, seed) for seed in range(CHILDREN)]
    try:
        for p in children:
            line = p.stdout.readline()
            assert line.startswith("READY"), (line, p.stderr.read()[-3000:] if p.poll() is not None else "")
        t0 = time.monotonic()
        for i, p in enumerate(children):
            # One every 100 ms, as model servers finishing prompts would.
            while time.monotonic() < t0 + 0.1 * i:
                time.sleep(0.005)
            p.stdin.write("GO\n")
            p.stdin.flush()
        outs = []
        for p in children:
            out, err = p.communicate(timeout=120)
            outs.append(out.strip())
            assert p.returncode == 0 and "STORED" in out, (outs, err[-3000:], d.log()[-3000:])
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()
    with d.client(NS) as c:
        store = c.stats()["store"]
    assert store["backlog_refusals"] == 0, store

    # A stop right after: within stop_timeout (the default, 10 s) and clean.
    t = time.monotonic()
    assert d.stop(signal.SIGTERM, timeout=30) == 0
    took = time.monotonic() - t
    print(f"dirty at the stop: {store['dirty_bytes'] >> 20} MiB; the stop took {took:.2f} s; stores {outs}")
    assert took < 10.0, (took, d.log()[-3000:])
    assert "not persisted" not in d.log(), d.log()[-3000:]  # the promise with the defaults: all of it

    # After a restart every acknowledged chunk comes back from the disk, bit for bit.
    d.start()
    with d.client(NS, timeout=60) as c:
        for seed in range(CHILDREN):
            caches, n = c.fetch(tokens_of(seed) + [1])
            assert n == TOKENS, (seed, n, store)
            assert _same(seed, caches), seed
