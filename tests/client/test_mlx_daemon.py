"""Process to process through a real `kvd serve`: store in one process, fetch in another.

Each child process builds the same tiny random-weight models (seeded, so
bit-identical), computes its namespace with `namespace_for`, and talks to
the daemon started by the `kvd_daemon` fixture. The fetching child compares,
bit for bit, continuing from the fetched cache against its own cold prefill
of the same prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import TESTS


CHUNK = 64  # small chunks, so chunk granularity shows with tiny prompts

# name, KV bits (None: plain), stored prompt length, shared prefix of the
# second prompt, new tokens after it, n expected from fetch/lookup
CASES = [
    ("llama", None, 300, 270, 20, 256),  # diverges inside a chunk: whole chunks are reused
    ("llama", None, 300, 256, 0, 255),  # a stored prefix as the whole prompt: trimmed by one token to feed
    ("llama", 4, 300, 200, 20, 192),  # quantized triples, trimmed on the way out
    ("gemma3", None, 120, 120, 20, 120),  # sliding window: resumes at the stored end
    ("qwen3_next", None, 90, 90, 20, 90),  # recurrent state (ArraysCache) + KV
    ("mamba", None, 70, 70, 20, 70),  # recurrent only: chunks carry no tensors, the boundary all
]

CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r})
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from models import build, greedy, prefill, prompt, raw
from kvd_client import Client
from kvd_client.mlx_lm import namespace_for

role, endpoint, cases, transport = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
sys.stdin.readline()  # GO: imported, now to work
out = []
with mx.stream(mx.new_thread_local_stream(mx.cpu)):
    for name, bits, stored, shared, extra, _ in cases:
        model = build(name)
        kv = Client(endpoint, namespace=namespace_for(model, kv_bits=bits, kv_group_size=32), chunk_tokens={chunk}, strict=True, transport=transport)
        first = prompt(stored)
        second = first[:shared] + prompt(extra, seed=5)

        def cold(tokens):
            c = make_prompt_cache(model)
            prefill(model, tokens, c)
            return [x.to_quantized(group_size=32, bits=bits) for x in c] if bits else c

        def cont(cache, block):
            logits = model(mx.array(block)[None], cache=cache)
            toks, rows = greedy(model, int(mx.argmax(logits[0, -1]).item()), cache, 5)
            return [raw(logits)[2].hex()] + [raw(r)[2].hex() for r in rows], toks

        if role == "store":
            cache = cold(first)
            ok = kv.store(first, cache)
            kv.flush_stores(30)
            out.append(dict(queued=ok, stored=kv.counters.get("stored", 0), shm=kv.counters.get("shm_puts", 0),
                            dedup=kv.counters.get("put_deduplicated", 0)))
        else:
            n_lookup = kv.lookup(second)
            t0 = time.perf_counter()
            cache, n = kv.fetch(second)
            ok = cache is not None
            got = cont(cache, second[n:]) if ok else None
            want = cont(cold(second[:n]) if n else None, second[n:]) if ok else None
            out.append(dict(n=n, lookup=n_lookup, equal=got == want, types=[type(c).__name__ for c in cache or []],
                            shm=kv.counters.get("shm_gets", 0)))
        kv.close()
print("RESULT " + json.dumps(out))
"""


def start_child(role, endpoint, cases, transport="auto") -> subprocess.Popen:
    """A child that imports what it needs (~1.7 s), then waits for GO on its stdin."""
    return subprocess.Popen(
        [sys.executable, "-c", CHILD.format(here=str(TESTS), chunk=CHUNK), role, endpoint, json.dumps(cases), transport],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def child_result(proc: subprocess.Popen):
    """Tell `proc` GO; its results once it has ended."""
    try:
        out, err = proc.communicate("GO\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_child(role, endpoint, cases, transport="auto"):
    return child_result(start_child(role, endpoint, cases, transport))


# Both data planes, and each way across: bytes written into shared memory are
# read back over frames, and frame-PUT entries move into shared memory when
# first read there (PROTOCOL.md section 14).
@pytest.mark.parametrize("put_via,get_via", [("shm", "shm"), ("frames", "shm"), ("shm", "frames")])
def test_store_in_one_process_fetch_in_another(kvd_daemon, put_via, get_via):
    # The fetching child imports while the storing one works; it starts once that one has ended.
    fetcher = start_child("fetch", kvd_daemon.endpoint, CASES, get_via)
    try:
        stored = run_child("store", kvd_daemon.endpoint, CASES, put_via)
        assert all(r["queued"] and r["stored"] == 1 for r in stored), stored
        assert all(r["shm"] == (put_via == "shm" and not r["dedup"]) for r in stored), stored
        fetched = child_result(fetcher)
    finally:
        if fetcher.poll() is None:  # never told GO
            fetcher.kill()
            fetcher.wait()
    assert all((r["shm"] >= 1) == (get_via == "shm") for r in fetched), fetched
    for (name, bits, _, _, _, expected), r in zip(CASES, fetched):
        assert r["n"] == expected, (name, bits, r)
        assert r["lookup"] == expected, (name, bits, r)
        assert r["equal"], f"{name} (kv_bits={bits}): fetched cache diverges from a cold prefill"
    assert fetched[2]["types"] == ["QuantizedKVCache"] * 2
    assert fetched[4]["types"] == ["ArraysCache"] * 3 + ["KVCache"]
    assert fetched[5]["types"] == ["ArraysCache"] * 2


def test_daemon_down_degrades_to_misses_and_counted_failures(daemon_factory):
    from mlx_lm.models.cache import make_prompt_cache
    from models import build, prefill, prompt

    from kvd_client import Client

    d = daemon_factory(start=False)  # never started: nobody listens on the socket
    kv = Client(d.endpoint, namespace="down", timeout=0.3)
    model = build("llama")
    cache = make_prompt_cache(model)
    prefill(model, prompt(20), cache)
    assert kv.fetch(prompt(30)) == (None, 0)
    assert kv.lookup(prompt(30)) == 0
    assert kv.store(prompt(20), cache) is True  # queued; the writer finds nobody
    assert kv.flush_stores(10)
    assert kv.counters["store_failed"] == 1 and kv.counters["fetch_miss"] == 1
    kv.close()
