"""Every mlx-lm cache class, in bf16, fp16 and fp32, stored by one process
and fetched by another through a real `kvd serve`, bit for bit.

The storing child and this process build the same caches from seeded keys
(mlx's random is deterministic across processes). The fetch asks for one
token more than was stored, so `n` can be the stored length even for
boundary-state caches; the fetched cache must hold exactly the original's
state and behave identically under further updates.

The same check runs against caches stored by an mlx-lm 0.31.3 process: its
PUT messages were recorded once by tests/fixtures/make_mlx_lm_031.py and are
replayed here, byte for byte, into a real daemon.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from models import same

from support import TESTS

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
KINDS = ["kv", "quant4", "quant8", "rotating", "arrays", "cachelist", "chunked", "concat"]


def _rows(seed: int, t: int, dtype, h: int = 2, d: int = 64):
    k = mx.random.normal((1, h, t, d), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, h, t, d), key=mx.random.key(seed + 7919)).astype(dtype)
    return k, v


def _feed(cache, dtype, steps, seed):
    for i, t in enumerate(steps):
        if isinstance(cache, C.ChunkedKVCache):
            cache.maybe_trim_front()
        mx.eval(cache.update_and_fetch(*_rows(seed + i, t, dtype)))
    return sum(steps)


def build(kind: str, dtype_name: str):
    """(cache list, token count) for one kind, deterministic."""
    dt = DTYPES[dtype_name]
    seed = 1000 * KINDS.index(kind) + 10 * list(DTYPES).index(dtype_name)
    if kind in ("kv", "quant4", "quant8"):
        c = C.KVCache()
        n = _feed(c, dt, [37, 1, 1], seed)
        if kind != "kv":
            c = c.to_quantized(group_size=32 if kind == "quant4" else 64, bits=4 if kind == "quant4" else 8)
        return [c], n
    if kind == "rotating":
        c = C.RotatingKVCache(max_size=16, keep=2)
        return [c], _feed(c, dt, [20] + [1] * 25, seed)  # wrapped many times
    if kind == "arrays":
        a = C.ArraysCache(3)
        a[0] = mx.random.normal((1, 3, 24), key=mx.random.key(seed)).astype(dt)
        a[2] = mx.random.normal((1, 2, 8, 8), key=mx.random.key(seed + 1))  # fp32 recurrent state
        return [a], 23
    if kind == "cachelist":
        kv = C.KVCache()
        n = _feed(kv, dt, [30], seed)
        a = C.ArraysCache(2)
        a[1] = mx.random.normal((1, 4), key=mx.random.key(seed + 2)).astype(dt)
        return [C.CacheList(a, kv)], n
    if kind == "chunked":
        c = C.ChunkedKVCache(16)
        return [c], _feed(c, dt, [20, 15, 1], seed)
    if kind == "concat":
        c = C.ConcatenateKVCache()
        return [c], _feed(c, dt, [25, 3], seed)
    raise ValueError(kind)


def tokens_for(kind: str, dtype_name: str, n: int) -> list[int]:
    base = 100_000 * (1 + KINDS.index(kind)) + 10_000 * list(DTYPES).index(dtype_name)
    return list(range(base, base + n))


STORE = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{here!r}, {tests!r}]
    import mlx.core as mx
    from test_mlx_xproc import CHUNK_TOKENS, DTYPES, KINDS, build, tokens_for
    from kvd_client import Client
    with mx.stream(mx.new_thread_local_stream(mx.cpu)):
        for kind in {kinds!r}:
            for dt in DTYPES:
                caches, n = build(kind, dt)
                with Client({endpoint!r}, namespace=f"{prefix}-{{kind}}-{{dt}}", chunk_tokens=CHUNK_TOKENS, strict=True) as kv:
                    assert kv.store(tokens_for(kind, dt, n), caches, wait=True)
    import mlx_lm
    print("STORED", mlx_lm.__version__)
    """
)


CHUNK_TOKENS = 16
PREFIX_031 = "x031"
# mlx-lm 0.31's own ChunkedKVCache fails while being filled past a trimmed
# front (a broadcast error in its update_and_fetch), before kvd is involved.
KINDS_031 = [k for k in KINDS if k != "chunked"]
# What a real mlx-lm 0.31.3 process PUT for every kind of KINDS_031 (recorded
# by tests/fixtures/make_mlx_lm_031.py: nothing is downloaded at test time).
RECORDED_031 = TESTS / "fixtures" / "mlx_lm_031_puts.msgpack.gz"


def _store(work: Path, prefix: str):
    """A daemon holding what a child process running this mlx-lm stored."""
    from conftest import DaemonProcess

    d = DaemonProcess(work, ["--ram-mb", "256"]).start()
    r = subprocess.run([sys.executable, "-c", STORE.format(here=str(Path(__file__).resolve().parent), tests=str(TESTS), endpoint=d.endpoint, prefix=prefix, kinds=list(KINDS))],
                       capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or "STORED" not in r.stdout:
        d.stop()
        raise AssertionError(r.stderr[-3000:])
    return d


def _replay(endpoint: str, record: dict) -> dict[str, int]:
    """Send the recorded PUTs byte for byte (a raw DEALER: no client code of
    this process touches them); the daemon's `stored` count per namespace."""
    import zmq

    from kvd.protocol import codec

    stored: dict[str, int] = {}
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for put in record["puts"]:
            sock.send_multipart(put["frames"])
            assert sock.poll(30_000), "no reply to a recorded PUT"
            reply = codec.decode_reply(sock.recv_multipart())
            assert reply.type == "PUT", reply.fields
            assert reply["too_big"] == 0 and not reply.fields.get("dropped"), reply.fields
            stored[put["ns"]] = stored.get(put["ns"], 0) + reply["stored"]
    finally:
        sock.close()
    return stored


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    d = _store(tmp_path_factory.mktemp("xproc"), "xproc")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def stored_by_031(tmp_path_factory):
    import gzip

    import msgpack

    from conftest import DaemonProcess

    record = msgpack.unpackb(gzip.decompress(RECORDED_031.read_bytes()), raw=False)
    # the recording really came from the old mlx-lm, with this test's settings
    assert record["mlx_lm"] == "0.31.3" and record["chunk_tokens"] == CHUNK_TOKENS
    d = DaemonProcess(tmp_path_factory.mktemp("x031"), ["--ram-mb", "256"]).start()
    try:
        stored = _replay(d.endpoint, record)
        assert sorted(stored) == sorted(f"{PREFIX_031}-{k}-{dt}" for k in KINDS_031 for dt in DTYPES)
        assert all(n > 0 for n in stored.values()), stored
    except BaseException:
        d.stop()
        raise
    yield d
    d.stop()


def _state_equal(a, b) -> None:
    if isinstance(a, C.CacheList):
        for x, y in zip(a.caches, b.caches):
            _state_equal(x, y)
        return
    if isinstance(a, C.ArraysCache):
        for x, y in zip(a.cache, b.cache):
            assert (x is None and y is None) or same(x, y)
        return
    assert a.offset == b.offset and type(b.offset) is int
    if isinstance(a, C.RotatingKVCache):
        assert (a._idx, a.max_size, a.keep) == (b._idx, b.max_size, b.keep)
        assert same(a.keys[..., : a._idx if a.offset < a.max_size else a.keys.shape[2], :],
                    b.keys[..., : a._idx if a.offset < a.max_size else b.keys.shape[2], :])
    elif isinstance(a, C.QuantizedKVCache):
        for x, y in zip(a.keys, b.keys):
            assert same(x[..., : a.offset, :], y[..., : a.offset, :])
        assert (a.bits, a.group_size) == (b.bits, b.group_size)
    else:
        ka, _ = a.state[:2] if not isinstance(a, C.ChunkedKVCache) else (a.keys, a.values)
        kb, _ = b.state[:2] if not isinstance(b, C.ChunkedKVCache) else (b.keys, b.values)
        live = a.offset - getattr(a, "start_position", 0)
        assert same(ka[..., :live, :], kb[..., :live, :])


def _check_fetch(daemon, prefix: str, kind: str, dtype_name: str) -> None:
    original, n = build(kind, dtype_name)
    from kvd_client import Client

    with Client(daemon.endpoint, namespace=f"{prefix}-{kind}-{dtype_name}", chunk_tokens=CHUNK_TOKENS, strict=True) as kv:
        fetched, got = kv.fetch(tokens_for(kind, dtype_name, n) + [7])
    assert got == n and fetched is not None
    assert [type(c) for c in fetched] == [type(c) for c in original]
    for a, b in zip(original, fetched):
        _state_equal(a, b)
        if not isinstance(a, (C.ArraysCache, C.CacheList)):
            dt = DTYPES[dtype_name]
            for i, t in enumerate((1, 5, 1)):  # behave identically from here on
                k, v = _rows(99_000 + i, t, dt)
                assert same(a.update_and_fetch(k, v), b.update_and_fetch(k, v))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_fetched_in_another_process_bit_exact(stored, kind, dtype_name):
    _check_fetch(stored, "xproc", kind, dtype_name)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS_031)
def test_stored_by_mlx_lm_031_fetched_by_032(stored_by_031, kind, dtype_name):
    """A 0.31.3 process (sliced `state`, `meta_state`) stored (its PUTs replayed
    from the recording); this 0.32 process fetches and gets the state its own
    0.32 caches would hold."""
    _check_fetch(stored_by_031, PREFIX_031, kind, dtype_name)


def test_store_1000_query_sharing_600_reuses_512_and_matches_cold_prefill(kvd_daemon):
    """Issue 3's partial-reuse case, at the default chunk size (256)."""
    code = textwrap.dedent(
        f"""
        import sys, json
        sys.path.insert(0, {str(TESTS)!r})
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache
        from models import build, prefill, prompt
        from kvd_client import Client
        from kvd_client.mlx_lm import namespace_for
        model = build("llama")
        kv = Client({kvd_daemon.endpoint!r}, namespace=namespace_for(model), strict=True)
        first = prompt(1000)
        if sys.argv[1] == "store":
            c = make_prompt_cache(model); prefill(model, first, c)
            assert kv.store(first, c, wait=True)
            print("RESULT ok")
        else:
            second = first[:600] + prompt(50, seed=9)
            cache, n = kv.fetch(second)
            warm = model(mx.array(second[n:])[None], cache=cache)
            # cold, split where the hit ends: must be bit for bit the same
            split = make_prompt_cache(model)
            model(mx.array(second[:n])[None], cache=split)
            cold_split = model(mx.array(second[n:])[None], cache=split)
            bits = lambda x: bytes(memoryview(x.astype(mx.float32)))
            # cold in one pass: equal up to matmul blocking
            one = model(mx.array(second)[None], cache=make_prompt_cache(model))
            print("RESULT " + json.dumps(dict(
                n=n, lookup=kv.lookup(second),
                bitwise=bits(warm) == bits(cold_split),
                close=bool(mx.allclose(warm[0, -1], one[0, -1], atol=1e-4).item()),
            )))
        """
    )
    for role in ("store", "fetch"):
        r = subprocess.run([sys.executable, "-c", code, role], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    import json

    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result["n"] == 512 and result["lookup"] == 512
    assert result["bitwise"] and result["close"], result
