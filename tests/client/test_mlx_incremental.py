"""A growing conversation: each store copies only the chunks the daemon lacks,
uploads go over their own socket, and what comes back is still bit-exact."""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvd_client import Client
from kvd_client._transport import Transport
from kvd_client.mlx_lm import namespace_for
from models import build, prefill, prompt


def test_second_store_snapshots_only_new_chunks_and_fetch_is_exact(kvd_daemon):
    model = build("llama")
    ns = namespace_for(model)
    first = prompt(1000)
    second = first + prompt(300, seed=3)  # the conversation goes on
    cache = make_prompt_cache(model)
    prefill(model, first, cache)

    seen = []
    with Client(kvd_daemon.endpoint, namespace=ns, strict=True) as kv:
        real_put = kv.put

        def spy(tokens, snapshot, **kw):
            seen.append((len(tokens), snapshot.start, {n: t.shape[a] for n, (t, a) in snapshot.sliced.items()}))
            return real_put(tokens, snapshot, **kw)

        kv.put = spy
        assert kv.store(first, cache, wait=True)
        prefill(model, second[1000:], cache)
        assert kv.store(second, cache, wait=True)
    # the first store copies everything; the second only from chunk 3 (768) on
    assert seen[0][1] == 0 and set(seen[0][2].values()) == {1000}
    assert seen[1][0] == 1300 and seen[1][1] == 768 and set(seen[1][2].values()) == {1300 - 768}

    with Client(kvd_daemon.endpoint, namespace=ns, strict=True) as other:
        fetched, n = other.fetch(second + [1])
    assert n == 1300
    cold = make_prompt_cache(model)
    prefill(model, second, cold)
    probe = mx.array([[5]])
    a = model(probe, cache=fetched)
    b = model(probe, cache=cold)
    assert bytes(memoryview(a.astype(mx.float32))) == bytes(memoryview(b.astype(mx.float32)))


def test_uploads_use_their_own_socket_from_the_writer_thread(kvd_daemon, monkeypatch):
    calls = []
    real = Transport.request

    def record(self, mtype, fields, timeout):
        calls.append((id(self), mtype, threading.current_thread().name))
        return real(self, mtype, fields, timeout)

    monkeypatch.setattr(Transport, "request", record)
    model = build("llama")
    tokens = prompt(600)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    with Client(kvd_daemon.endpoint, namespace=namespace_for(model)) as kv:
        assert kv.store(tokens, cache)  # queued; the upload runs on the writer
        assert kv.flush_stores(30)
        main = id(kv._transport)
        upload = [c for c in calls if c[1] in ("PUT", "SLOTS", "COMMIT")]  # frames, or the shm plane
    assert upload and all(t != main and thread == "kvd-writer" for t, _, thread in upload)
    # the caller's own request (store's LOOKUP for what is held) used the caller's socket
    assert any(t == main and m == "LOOKUP" and thread == "MainThread" for t, m, thread in calls)
