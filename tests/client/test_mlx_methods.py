"""Client.store / fetch / lookup (MlxMethods) against an in-memory daemon.

The generation thread here works like mlx-lm's: it runs everything under its
own `mx.stream(mx.new_thread_local_stream(mx.cpu))`, so an mlx array it has
not evaluated cannot be evaluated anywhere else. Each seed bug kvd must make
impossible has a regression test below (see /work/shared/seeds/):

* 000/001  bf16 KV through numpy, writer threads touching mlx arrays;
* 000      native QuantizedKVCache (packed, scales, biases) skipped;
* 002      offsets not trimmed on quantized layers on a prefix hit;
* 003      a hard-coded KV dtype instead of the model's;
* 004      hybrid models silently never stored.
"""

from __future__ import annotations

import gc
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C
from mlx_lm.models.cache import make_prompt_cache
from models import build, continue_from, prompt, raw
from support import numpy_owner
from fakes import FakeClient

from kvd_client.mlx_lm import SnapshotMismatch, UnsupportedCache, namespace_for
from kvd_client.mlx_lm import _format as F

P = 150


class GenThread:
    """One thread that owns the model, with its own thread-local mlx stream."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="generation")
        self.stream = mx.new_thread_local_stream(mx.cpu)
        self.ident = self.run(threading.get_ident)

    def run(self, fn, *args, **kwargs):
        def call():
            with mx.stream(self.stream):
                return fn(*args, **kwargs)

        return self.pool.submit(call).result()

    def close(self):
        self.pool.shutdown()


@pytest.fixture
def gen():
    g = GenThread()
    yield g
    g.close()


@pytest.fixture(scope="module")
def zoo():
    return {name: build(name) for name in ("llama", "gemma3", "qwen3_next")}


_ns = [0]


def fresh_ns(prefix="t"):
    _ns[0] += 1
    return f"{prefix}-{_ns[0]}"


def lazy_prefill(model, tokens, cache, step=64):
    """Prefill without evaluating anything: the cache holds lazy arrays."""
    for s in range(0, len(tokens), step):
        model(mx.array(tokens[s : s + step])[None], cache=cache)
    return cache


@contextmanager
def mlx_spy():
    """Record (thread id, name) of every call into mlx.core functions and mx.array methods."""
    calls: list[tuple[int, str]] = []
    undo = []

    def wrap(owner, name, fn):
        def spy(*args, **kwargs):
            calls.append((threading.get_ident(), name))
            return fn(*args, **kwargs)

        setattr(owner, name, spy)
        undo.append((owner, name, fn))

    for name in dir(mx):
        fn = getattr(mx, name)
        if not name.startswith("_") and type(fn).__name__ in ("nb_func", "builtin_function_or_method"):
            wrap(mx, name, fn)
    for name, fn in list(vars(mx.array).items()):
        if type(fn).__name__ == "nb_method" and (not name.startswith("__") or name in ("__getitem__", "__setitem__")):
            wrap(mx.array, name, fn)
    try:
        yield calls
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)


def mlx_reachable(root):
    """The first mlx object reachable from `root` (through containers, numpy bases), or None."""
    seen, stack = set(), [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(o))
        if type(o).__module__.startswith("mlx"):
            return o
        if isinstance(o, np.ndarray):
            if o.base is not None:
                stack.append(o.base)
            continue
        stack.extend(gc.get_referents(o))
    return None



# -- threads -------------------------------------------------------------------------


def test_store_and_fetch_never_touch_mlx_off_the_generation_thread(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    tokens = prompt(P)

    # The hazard is real here: a lazy array from the generation thread's
    # stream cannot even be evaluated elsewhere (seed 001's crash).
    lazy = gen.run(lambda: mx.ones((2,)) * 3)
    with pytest.raises(RuntimeError, match="no Stream"):
        np.array(lazy)

    with mlx_spy() as calls:
        warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
        assert gen.run(kv.store, tokens, warm) is True
        assert kv.flush_stores(10)
        cache, n = gen.run(kv.fetch, tokens + [3, 4])
    assert n == P and kv.counters["stored"] == 1
    assert calls and {t for t, _ in calls} == {gen.ident}, "mlx was called off the generation thread"
    assert kv.put_threads and gen.ident not in kv.put_threads  # the upload did run on the writer
    assert mlx_reachable(kv.put_args) is None  # the writer was never handed anything mlx
    for _, (t, _) in kv.put_args[0][1].sliced.items():
        assert numpy_owner(t.array).flags.owndata  # numpy owns the bytes; no alias of mlx memory

    got = gen.run(continue_from, model, cache)
    want = gen.run(continue_from, model, warm)
    assert got == want


def test_store_returns_before_the_upload(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    release = threading.Event()
    real_put = kv.put

    def slow_put(tokens, snap):
        release.wait(10)
        return real_put(tokens, snap)

    kv.put = slow_put
    warm = gen.run(lambda: lazy_prefill(model, prompt(P), make_prompt_cache(model)))
    assert gen.run(kv.store, prompt(P), warm) is True  # would hang if store waited for put
    assert kv.seqs == [] and not kv.flush_stores(0.05)
    # The caller may decode into the cache at once; the snapshot is already a copy.
    gen.run(lambda: mx.eval(model(mx.array([[1, 2, 3]]), cache=warm)))
    release.set()
    assert kv.flush_stores(10) and len(kv.seqs) == 1
    assert kv.seqs[0][1].sliced["0.k"][0].shape[2] == P


# -- seed regressions ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_seed_bf16_kv_rides_as_raw_bits_and_comes_back_in_the_model_dtype(gen, dtype):
    """Seeds 000/001/003: bf16 is neither rejected by numpy nor cast to fp16/fp32."""
    model = build("llama", dtype)
    kv = FakeClient(fresh_ns())
    tokens = prompt(P)
    warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
    assert gen.run(kv.store, tokens, warm, wait=True)
    stored = kv.seqs[0][1].sliced["1.v"][0]
    want = gen.run(lambda: raw(warm[1].values[..., :P, :]))
    assert stored.dtype == str(dtype).rsplit(".", 1)[-1]
    assert stored.array.tobytes() == want[2]
    cache, n = gen.run(kv.fetch, tokens + [9])
    assert n == P and cache[1].values.dtype == dtype
    assert gen.run(raw, cache[1].values) == want


def test_seed_native_quantized_triples_are_stored_not_skipped_or_dequantized(zoo, gen):
    """Seed 000: QuantizedKVCache keys/values are (packed, scales, biases) triples."""
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    tokens = prompt(P)

    def prefill_quantized():
        c = lazy_prefill(model, tokens, make_prompt_cache(model))
        return [x.to_quantized(group_size=64, bits=4) for x in c]

    warm = gen.run(prefill_quantized)
    assert gen.run(kv.store, tokens, warm, wait=True)
    snap = kv.seqs[0][1]
    assert {n: t.dtype for n, (t, _) in snap.sliced.items() if n.startswith("0.k")} == {
        "0.k.q": "uint32", "0.k.s": "bfloat16", "0.k.b": "bfloat16",
    }
    cache, n = gen.run(kv.fetch, tokens + [1])
    assert n == P and all(type(c) is C.QuantizedKVCache and (c.bits, c.group_size) == (4, 64) for c in cache)
    assert gen.run(continue_from, model, cache) == gen.run(continue_from, model, warm)


def test_seed_quantized_prefix_hit_is_trimmed(zoo, gen):
    """Seed 002: a prefix hit on a quantized cache has offset == n and n rows, not the stored length."""
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    tokens = prompt(P)
    warm = gen.run(lambda: [c.to_quantized(32, 8) for c in lazy_prefill(model, tokens, make_prompt_cache(model))])
    assert gen.run(kv.store, tokens, warm, wait=True)
    other = tokens[:100] + prompt(30, seed=99)
    cache, n = gen.run(kv.fetch, other)
    assert n == 100
    for c in cache:
        assert c.offset == 100 and all(x.shape[2] == 100 for x in c.keys + c.values)

    def reference():
        ref = make_prompt_cache(model)
        lazy_prefill(model, tokens, ref)
        ref = [c.to_quantized(32, 8) for c in ref]
        for c in ref:
            c.trim(P - 100)
        return ref

    assert gen.run(continue_from, model, cache, other[100:]) == gen.run(lambda: continue_from(model, reference(), other[100:]))


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_seed_hybrid_and_sliding_window_models_are_stored_and_served(zoo, gen, name):
    """Seed 004: windowed/recurrent models store boundary state and resume from it."""
    model = zoo[name]
    kv = FakeClient(fresh_ns())
    system = prompt(80)
    warm = gen.run(lambda: lazy_prefill(model, system, make_prompt_cache(model)))
    assert gen.run(kv.store, system, warm, wait=True)
    assert kv.seqs[0][1].boundary  # state was stored, not silently dropped
    question = system + prompt(12, seed=5)
    assert gen.run(kv.lookup, question) == 80
    cache, n = gen.run(kv.fetch, question)
    assert n == 80
    assert gen.run(continue_from, model, cache, question[80:]) == gen.run(continue_from, model, warm, question[80:])
    # A prompt that diverges inside the stored span has no boundary to resume from.
    assert gen.run(kv.fetch, system[:60] + prompt(30, seed=6)) == (None, 0)
    assert gen.run(kv.lookup, system[:60] + prompt(30, seed=6)) == 0


# -- how the client knows whether boundary state is needed -------------------------


def spy_get(kv):
    asked = []
    real_get = kv.get
    kv.get = lambda toks, **kw: asked.append(kw["need_boundary"]) or real_get(toks, **kw)
    return asked


def test_unknown_layout_attention_only_reuses_any_prefix(zoo, gen):
    model = zoo["llama"]
    writer, reader = FakeClient("shared-llama"), FakeClient("shared-llama")
    tokens = prompt(P)
    warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
    assert gen.run(writer.store, tokens, warm, wait=True)
    reader.seqs = writer.seqs
    F._layouts.pop("shared-llama")  # the reader is "another process": it has seen nothing
    asked = spy_get(reader)
    partial = tokens[:120] + prompt(10, seed=3)
    assert gen.run(reader.lookup, partial) == 120
    cache, n = gen.run(reader.fetch, partial)
    assert n == 120 and asked == [False]
    assert F.layout_for("shared-llama") == [{"k": "kv"}, {"k": "kv"}]


def test_unknown_layout_hybrid_learns_from_the_hit_and_asks_for_a_boundary(zoo, gen):
    model = zoo["gemma3"]
    writer, reader = FakeClient("shared-gemma"), FakeClient("shared-gemma")
    system = prompt(80)
    longer = system + prompt(20, seed=11)
    for seq in (system, longer):
        warm = gen.run(lambda: lazy_prefill(model, seq, make_prompt_cache(model)))
        assert gen.run(writer.store, seq, warm, wait=True)
    reader.seqs = writer.seqs
    F._layouts.pop("shared-gemma")
    asked = spy_get(reader)
    question = longer[:85] + prompt(10, seed=12)  # shares 85 tokens; boundaries at 80 and 100
    assert gen.run(reader.lookup, question) == 80
    cache, n = gen.run(reader.fetch, question)
    assert n == 80 and asked == [False, True]
    cache, n = gen.run(reader.fetch, question)
    assert n == 80 and asked == [False, True, True]  # learned: asks for a boundary at once


def test_namespace_for_tells_the_client_up_front(zoo, gen):
    model = zoo["llama"]
    ns = gen.run(namespace_for, model)
    writer = FakeClient(ns)
    tokens = prompt(P)
    warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
    assert gen.run(writer.store, tokens, warm, wait=True)
    assert gen.run(writer.lookup, tokens[:77] + [1, 2]) == 77
    assert F.needs_boundary(F.layout_for(gen.run(namespace_for, zoo["gemma3"])))


def test_stale_layout_is_corrected_by_the_hit(zoo, gen):
    model = zoo["gemma3"]
    kv = FakeClient(fresh_ns())
    system = prompt(60)
    warm = gen.run(lambda: lazy_prefill(model, system, make_prompt_cache(model)))
    assert gen.run(kv.store, system, warm, wait=True)
    F.remember(kv.namespace, [{"k": "kv"}])  # wrong: says attention-only
    cache, n = gen.run(kv.fetch, system + [1, 2, 3])
    assert n == 60 and F.needs_boundary(F.layout_for(kv.namespace))


def test_fetch_leaves_a_token_to_feed(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    tokens = prompt(P)
    warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
    gen.run(kv.store, tokens, warm, wait=True)
    cache, n = gen.run(kv.fetch, tokens)
    assert n == P - 1 and all(c.offset == P - 1 for c in cache)
    assert gen.run(kv.fetch, tokens[:1]) == (None, 0)
    assert gen.run(kv.lookup, tokens) == P - 1


# -- failures degrade, and are counted -----------------------------------------------


def test_put_failure_is_counted_not_raised(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns(), fail_puts=True)
    warm = gen.run(lambda: lazy_prefill(model, prompt(40), make_prompt_cache(model)))
    assert gen.run(kv.store, prompt(40), warm) is True
    assert kv.flush_stores(10) and kv.counters["store_failed"] == 1
    strict = FakeClient(fresh_ns(), strict=True, fail_puts=True)
    with pytest.raises(ConnectionError):
        gen.run(strict.store, prompt(40), warm)


def test_full_writer_queue_drops_instead_of_blocking(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    kv.store_queue_bytes = 1  # always admits one; the next waits behind it and is dropped
    release = threading.Event()
    real_put = kv.put
    kv.put = lambda t, s: release.wait(10) and real_put(t, s)
    warm = gen.run(lambda: lazy_prefill(model, prompt(40), make_prompt_cache(model)))
    results = [gen.run(kv.store, prompt(40), warm) for _ in range(3)]
    release.set()
    assert kv.flush_stores(10)
    assert results[0] is True and False in results and kv.counters["store_dropped"] >= 1


def test_unsupported_cache_and_layout_mismatch_are_refused(zoo, gen):
    kv = FakeClient(fresh_ns())
    assert gen.run(kv.store, [1, 2], [C.BatchKVCache([0])]) is False
    assert kv.counters["store_unsupported"] == 1
    with pytest.raises(UnsupportedCache):
        gen.run(FakeClient(fresh_ns(), strict=True).store, [1, 2], [C.BatchKVCache([0])])

    model = zoo["llama"]
    ns = gen.run(namespace_for, model, kv_bits=4)
    q = FakeClient(ns)
    plain = gen.run(lambda: lazy_prefill(model, prompt(40), make_prompt_cache(model)))
    assert gen.run(q.store, prompt(40), plain) is False  # a KVCache in a 4-bit namespace
    assert q.counters["store_layout_mismatch"] == 1 and q.seqs == []
    with pytest.raises(SnapshotMismatch):
        gen.run(FakeClient(ns, strict=True).store, prompt(40), plain)


def test_inconsistent_hit_is_a_counted_miss(zoo, gen):
    model = zoo["llama"]
    kv = FakeClient(fresh_ns())
    tokens = prompt(40)
    warm = gen.run(lambda: lazy_prefill(model, tokens, make_prompt_cache(model)))
    gen.run(kv.store, tokens, warm, wait=True)
    del kv.seqs[0][1].sliced["1.v"]
    assert gen.run(kv.fetch, tokens + [1]) == (None, 0)
    assert kv.counters["fetch_invalid"] == 1
