"""`KvdPromptCache` in process against a real daemon: mlx-lm's prompt-cache contract.

Two cache objects with the same model stand for two servers. Checked: a kvd
hit leaves at least one token; sliceable caches are served at any stored
prefix, windowed ones only where their state was stored; a local entry that
covers more wins without a transfer; quantized and plain caches of one
server go to their own namespaces; no daemon, or a daemon that dies, costs
nothing but misses.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from kvd_client.mlx_lm_server import KvdPromptCache, ModelRef
from models import build, greedy, llama_model, prefill, prompt  # noqa: F401  (the fixture `llama`)

KEY = ("model", None, None)


@pytest.fixture(scope="module")
def swa():
    return build("llama_swa")


def _server(daemon, model, endpoint=None, **ref):
    return KvdPromptCache(
        4, resolve=lambda key: ModelRef(model, **ref) if key == KEY else None,
        endpoint=endpoint or daemon.endpoint, timeout=2.0,
    )


def _filled(model, tokens):
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    return cache


def _continue(model, cache, rest, n=6):
    """Feed `rest` and decode greedily: the tokens a server would answer."""
    logits = prefill(model, rest, cache)
    out, _ = greedy(model, int(mx.argmax(logits).item()), cache, n)
    return out


def test_second_server_hits_any_prefix_and_answers_the_same(kvd_daemon, llama):
    a, b = _server(kvd_daemon, llama), _server(kvd_daemon, llama)
    system = prompt(300, seed=1)
    a.insert_cache(KEY, system, _filled(llama, system), cache_type="system")
    assert a.flush(10)

    # A prefix of a stored entry is served down to a chunk boundary (256), the
    # way mlx-lm trims a longer trimmable entry.
    query = system[:280] + prompt(20, seed=2)
    cache, rest = b.fetch_nearest_cache(KEY, query)
    assert cache is not None and rest == query[256:]
    assert cache[0].offset == 256
    assert _continue(llama, cache, rest) == _continue(llama, make_prompt_cache(llama), query)

    # The whole stored sequence asked again: at least one token is left.
    cache, rest = b.fetch_nearest_cache(KEY, system)
    assert len(rest) == 1 and cache[0].offset == 299
    assert b.counters["kvd_hits"] == 2

    # Same sequence inserted again: kvd already holds it, no snapshot taken.
    b.insert_cache(KEY, system, _filled(llama, system))
    assert b.counters.get("kvd_store_skipped") == 1
    a.close(), b.close()


def test_local_entry_that_covers_more_wins(kvd_daemon, llama):
    a = _server(kvd_daemon, llama)
    seq = prompt(200, seed=3)
    a.insert_cache(KEY, seq, _filled(llama, seq))
    assert a.flush(10)
    cache, rest = a.fetch_nearest_cache(KEY, seq + [5, 6])
    assert len(rest) == 2  # the local LRU answered: exact prefix
    assert "kvd_hits" not in a.counters
    assert len(a) == 1 and a.nbytes > 0 and a.stats_by_type()["assistant"]["n_sequences"] == 1
    a.trim_to(n_sequences=0)
    assert len(a) == 0
    cache, rest = a.fetch_nearest_cache(KEY, seq + [5, 6])  # now from kvd
    assert len(rest) == 2 and a.counters["kvd_hits"] == 1
    a.close()


def test_windowed_model_resumes_only_where_state_was_stored(kvd_daemon, swa):
    a, b = _server(kvd_daemon, swa), _server(kvd_daemon, swa)
    seq = prompt(120, seed=4)
    a.insert_cache(KEY, seq, _filled(swa, seq))
    assert a.flush(10)
    cache, rest = b.fetch_nearest_cache(KEY, seq[:100] + [1, 2, 3])
    assert cache is None and len(rest) == 103  # no state stored at 100: a miss, like mlx-lm's untrimmable entries
    query = seq + [1, 2, 3]
    cache, rest = b.fetch_nearest_cache(KEY, query)
    assert cache is not None and rest == [1, 2, 3]
    assert _continue(swa, cache, rest) == _continue(swa, make_prompt_cache(swa), query)
    a.close(), b.close()


def test_quantized_and_plain_caches_use_their_own_namespaces(kvd_daemon, llama):
    ref = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=150)
    a, b = _server(kvd_daemon, llama, **ref), _server(kvd_daemon, llama, **ref)
    short = prompt(100, seed=5)  # below quantized_kv_start: mlx-lm keeps a plain KVCache
    a.insert_cache(KEY, short, _filled(llama, short))
    long = prompt(260, seed=6)
    qcache = [c.to_quantized(group_size=64, bits=8) for c in _filled(llama, long)]
    a.insert_cache(KEY, long, qcache)
    assert a.flush(10)
    assert a.counters["kvd_stores"] == 2 and "store_layout_mismatch" not in str(a.kvd_stats())
    assert len(a.kvd_stats()["clients"]) == 2

    cache, rest = b.fetch_nearest_cache(KEY, short + [9])
    assert cache is not None and rest == [9] and type(cache[0]).__name__ == "KVCache"
    cache, rest = b.fetch_nearest_cache(KEY, long + [9])
    assert cache is not None and rest == [9] and all(type(c) is QuantizedKVCache for c in cache)
    a.close(), b.close()


def _served(model, cache, rest, settings, n=4):
    """What mlx_lm.server computes for `rest` on `cache` with its KV settings
    (mlx-lm's own generate_step): the greedy tokens and each logprob row's bytes."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=n, prefill_step_size=64, **settings)
    return [(int(tok), bytes(memoryview(lp.astype(mx.float32)))) for tok, lp in steps]


@pytest.mark.parametrize("start", [150, 300])
def test_a_kv_bits_server_reuses_a_plain_cache_only_below_its_quantized_start(kvd_daemon, llama, start):
    """A server without --kv-bits stores a plain 300-token cache; a --kv-bits
    server quantizes at --quantized-kv-start, so it never holds a plain cache
    that long. Below its start the plain hit (256 tokens) is what it would hold
    itself and answers bit-exact; at 150 it would not be (logprobs off by
    ~0.06 on this model), so it is not used."""
    settings = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=start)
    plain, quant = _server(kvd_daemon, llama), _server(kvd_daemon, llama, **settings)
    system = prompt(300, seed=1)
    plain.insert_cache(KEY, system, _filled(llama, system))
    assert plain.flush(10)
    query = system[:280] + prompt(30, seed=2)

    cache, rest = quant.fetch_nearest_cache(KEY, query)
    if start == 150:
        assert cache is None and rest == query and quant.counters["kvd_misses"] == 1
    else:
        assert type(cache[0]).__name__ == "KVCache" and cache[0].offset == 256 and rest == query[256:]
        assert _served(llama, cache, rest, settings) == _served(llama, make_prompt_cache(llama), query, settings)
    plain.close(), quant.close()


def test_no_daemon_is_local_only_and_said_once(daemon_factory, llama, caplog):
    absent = daemon_factory(start=False)
    with caplog.at_level(logging.WARNING):
        a = _server(None, llama, endpoint=absent.endpoint)
        seq = prompt(100, seed=7)
        for _ in range(3):
            a.insert_cache(KEY, seq, _filled(llama, seq))
            cache, rest = a.fetch_nearest_cache(KEY, seq + [1])
            assert rest == [1]  # the local tier still works
    said = [r for r in caplog.records if "no daemon answering" in r.getMessage()]
    assert len(said) == 1
    assert a.counters["kvd_outages"] == 1 and "kvd_hits" not in a.counters
    a.close()


def test_daemon_dying_mid_run_costs_misses_only(daemon_factory, llama):
    d = daemon_factory("--ram-mb", "64")
    a = _server(d, llama)
    seq = prompt(100, seed=8)
    a.insert_cache(KEY, seq, _filled(llama, seq))
    assert a.flush(10)
    d.kill()
    other = prompt(90, seed=9)
    for i in range(3):
        cache, rest = a.fetch_nearest_cache(KEY, other + [1])
        assert len(rest) == (91 if i == 0 else 1)  # a miss, then the local tier
        a.insert_cache(KEY, other, _filled(llama, other))
    assert a.kvd_stats()["down"] and a.counters["kvd_outages"] == 1
    # Back again (its RAM tier is empty): after the back-off kvd is used again.
    d.start()
    a._breaker.down_until = 0.0  # skip the back-off wait
    a.insert_cache(KEY, other, _filled(llama, other))
    assert a.flush(10) and not a.kvd_stats()["down"]
    with d.client(a.kvd_stats()["clients"].popitem()[0]) as c:
        assert c.probe(other).n == len(other)
    a.close()


def test_keys_kvd_cannot_hold_stay_local(kvd_daemon, llama):
    a = KvdPromptCache(4, resolve=lambda key: None, endpoint=kvd_daemon.endpoint)
    seq = prompt(50, seed=10)
    a.insert_cache(KEY, seq, _filled(llama, seq))
    a.insert_cache(KEY, [-5, *seq], _filled(llama, [1, *seq]))  # image placeholder ids
    assert "kvd_stores" not in a.counters
    assert KvdPromptCache(4).kvd_stats()["enabled"] is False  # no resolver: a plain LRU
    a.close()
