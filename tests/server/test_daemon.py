"""Integration: a real `kvd serve` process, real ZeroMQ sockets, real clients."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import zmq

from kvd.protocol import codec
from kvd_client import Client, DaemonUnavailable, Snapshot

from support import TESTS, no_more_threads, prefix_snapshot, random_tensor, snapshot_for

PUT_IN_CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from support import snapshot_for
    from kvd_client import Client
    with Client({endpoint!r}, namespace="xproc", strict=True) as c:
        ok = c.put(np.arange({n}) * 7 % 50000, snapshot_for({n}, seed=5, boundary=True))
    sys.exit(0 if ok else 1)
    """
)


def test_round_trip_every_dtype_between_processes(kvd_daemon):
    n = 700
    code = PUT_IN_CHILD.format(tests=str(TESTS), endpoint=kvd_daemon.endpoint, n=n)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    expected = snapshot_for(n, seed=5, boundary=True)
    with kvd_daemon.client("xproc", strict=True) as c:
        hit = c.get(np.arange(n) * 7 % 50000)
    assert hit is not None and hit.n == n
    for name, (t, axis) in expected.sliced.items():
        got = hit.sliced[name]
        assert hit.axes[name] == axis
        assert got.dtype == t.dtype and got.equal(t), name
    assert hit.sliced["t.bfloat16"].array.dtype == np.uint16  # bf16 bits, never a float container
    assert hit.boundary["state"].equal(expected.boundary["state"])
    assert hit.meta == {"layout": "test"} and hit.boundary_meta == {"at": n}


def test_shared_prefix_stored_once_and_divergent_lookup(kvd_daemon):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 32000, 1000)
    a = np.concatenate([prefix, rng.integers(0, 32000, 300)])
    b = np.concatenate([prefix, rng.integers(0, 32000, 300)])
    with kvd_daemon.client("shared", strict=True) as c:
        assert c.put(a, snapshot_for(len(a)))
        entries_a = c.stats()["tiers"]["ram"]["entries"]
        assert entries_a == 6  # 1300 tokens = 5 full chunks of 256 + a tail of 20
        assert c.put(b, snapshot_for(len(b), seed=1))
        stats = c.stats()
        # b shares 3 full chunks (768 tokens) with a; its other 3 chunks are new.
        assert stats["tiers"]["ram"]["entries"] == 9
        assert stats["namespaces"]["shared"]["chunks_stored"] == 9
        # a third sequence diverging mid-chunk (at 900) gets the last full shared boundary
        third = np.concatenate([prefix[:900], rng.integers(0, 32000, 200)])
        assert c.probe(third).n == 768
        hit = c.get(third)
        assert hit.n == 768
        ref = snapshot_for(len(a))
        for name, (t, _) in ref.sliced.items():
            assert hit.sliced[name].array.tobytes() == np.ascontiguousarray(t.array[:, :, :768]).tobytes()


def test_tail_chunk_serves_a_longer_query(kvd_daemon):
    toks = np.arange(600)
    with kvd_daemon.client("tails", strict=True) as c:
        assert c.put(toks, snapshot_for(600))
        longer = np.concatenate([toks, [1, 2, 3]])
        assert c.probe(longer).n == 600  # 2 full chunks + the stored 88-token tail
        hit = c.get(longer, max_tokens=602)
        assert hit.n == 600
        different_tail = np.concatenate([toks[:590], [9] * 20])
        assert c.probe(different_tail).n == 512


def test_namespace_isolation(kvd_daemon):
    toks = np.arange(300)
    with kvd_daemon.client("model-a", strict=True) as a, kvd_daemon.client("model-b", strict=True) as b:
        assert a.put(toks, snapshot_for(300))
        assert b.probe(toks).n == 0
        assert b.get(toks) is None
        assert a.get(toks).n == 300
        st = a.stats()["namespaces"]
        assert st["model-a"]["entries"] == 2 and "model-b" not in st or st["model-b"]["entries"] == 0


def test_lru_eviction_under_small_budget(daemon_factory):
    d = daemon_factory("--ram-mb", "1", "--data-dir", "none")  # the RAM tier alone
    # each sequence: 256 tokens x 7 tensors x 16 values x itemsize ~ 86 KiB per chunk
    with d.client("lru", strict=True) as c:
        seqs = [np.arange(256) + 1000 * i for i in range(20)]
        for i, s in enumerate(seqs):
            assert c.put(s, snapshot_for(256, seed=i))
        c.get(seqs[0])  # a miss (evicted long ago) ...
        stats = c.stats()["tiers"]["ram"]
        assert stats["bytes"] <= 1 << 20
        assert stats["evictions"] == 20 - stats["entries"]
        assert c.probe(seqs[-1]).n == 256
        assert c.probe(seqs[0]).n == 0
        # touching an old survivor makes it outlive a newer one
        survivors = [i for i, s in enumerate(seqs) if c.probe(s).n]
        oldest = survivors[0]
        assert c.get(seqs[oldest]) is not None
        assert c.put(np.arange(256) + 99999, snapshot_for(256, seed=77))
        assert c.probe(seqs[oldest]).n == 256
        assert c.probe(seqs[survivors[1]]).n == 0


def test_stats_counters_match_what_happened(kvd_daemon):
    with kvd_daemon.client("count", strict=True, transport="frames") as c:  # message counts of the frame path
        c.put(np.arange(512), snapshot_for(512))  # LOOKUP + HELLO + PUT
        c.get(np.arange(512))  # hit
        c.get(np.arange(512) + 1)  # miss
        c.probe(np.arange(100))
        s = c.stats()
    ns = s["namespaces"]["count"]
    assert (ns["gets"], ns["hits"], ns["misses"], ns["tokens_served"]) == (2, 1, 1, 512)
    assert ns["lookups"] == 2 and ns["puts"] == 1 and ns["chunks_stored"] == 2 and ns["entries"] == 2
    assert s["server"]["requests"] == {"PING": 1, "HELLO": 1, "LOOKUP": 2, "PUT": 1, "GET": 2, "STATS": 1}  # PING: the fixture's readiness probe
    assert s["tiers"]["ram"]["hits"] == 2 and s["tiers"]["ram"]["stored"] == 2


def raw_request(endpoint: str, frames: list[bytes], timeout_ms: int = 3000) -> list[bytes]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "daemon did not reply"
        return s.recv_multipart()
    finally:
        s.close()


def tensor_put(**over) -> list[bytes]:
    t = {"name": "k", "dtype": "float32", "shape": [2, 2], "frame": 1}
    t.update(over.pop("tensor", {}))
    header = {"v": 1, "type": "PUT", "id": 9, "ns": "x", "tokens": b"\x01\x00\x00\x00", "chunks": [{"index": 0, "tensors": [t]}]}
    header.update(over.pop("header", {}))
    frames = over.pop("frames", [b"\x00" * 16])
    return [__import__("msgpack").packb(header), *frames]


BAD_INPUTS = {
    "truncated msgpack": ([b"\x85\xa1v\x01"], 100),
    "header not a map": ([__import__("msgpack").packb([1, 2, 3])], 100),
    "garbage": ([b"\xc1\xff\x00garbage"], 100),
    "empty header frame": ([b""], 100),
    "unknown version": ([__import__("msgpack").packb({"v": 99, "type": "PING"})], 101),
    "unknown type": ([__import__("msgpack").packb({"v": 1, "type": "FROB"})], 102),
    "wrong field type": ([__import__("msgpack").packb({"v": 1, "type": "LOOKUP", "ns": 5, "tokens": b""})], 103),
    "missing field": ([__import__("msgpack").packb({"v": 1, "type": "LOOKUP", "ns": "x"})], 103),
    "unknown dtype": (tensor_put(tensor={"dtype": "float8"}), 104),
    "byte length mismatch": (tensor_put(frames=[b"\x00" * 15]), 105),
    "rank too high": (tensor_put(tensor={"shape": [1] * 9}, frames=[b"\x00" * 4]), 105),
    "frame index out of range": (tensor_put(tensor={"frame": 2}), 106),
    "unreferenced frame": (tensor_put(frames=[b"\x00" * 16, b"extra"]), 106),
    "too many tokens": ([__import__("msgpack").packb({"v": 1, "type": "LOOKUP", "ns": "x", "tokens": b"\x00" * 4 * ((1 << 20) + 1)})], 109),
    "too many frames": ([__import__("msgpack").packb({"v": 1, "type": "PING"}), *[b""] * 65536], 108),
    "chunk index past the end": (tensor_put(header={"chunks": [{"index": 5, "tensors": [{"name": "k", "dtype": "float32", "shape": [2, 2], "frame": 1}]}]}), 103),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_typed_error_and_daemon_keeps_serving(kvd_daemon, case):
    frames, code = BAD_INPUTS[case]
    with kvd_daemon.client("good", strict=True) as good:
        assert good.put(np.arange(300), snapshot_for(300))
        reply = codec.decode_reply(raw_request(kvd_daemon.endpoint, frames))
        assert reply.type == "ERROR" and reply["code"] == code, reply
        assert good.get(np.arange(300)).n == 300  # nothing lost, still serving
        assert good.stats()["server"]["errors"][reply["name"]] == 1


def test_oversize_message_rejected(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--max-message-mb", "1", "--data-dir", "none")
    big = [*tensor_put(tensor={"shape": [512, 512]}, frames=[b"\x00" * (1 << 20)])]
    reply = codec.decode_reply(raw_request(d.endpoint, big))
    assert reply["code"] == 107
    # and the client splits a large put into messages under the advertised limit
    with d.client("split", strict=True) as c:
        big_snap = Snapshot(sliced={"k": (random_tensor("float32", (1, 8, 2048, 64), 3), 2)})
        assert c.put(np.arange(2048), big_snap)  # 4 MiB over 8 chunks of 512 KiB
        hit = c.get(np.arange(2048))  # served in pages under 1 MiB
        assert hit.n == 2048 and hit.sliced["k"].equal(big_snap.sliced["k"][0])


@pytest.mark.parametrize("transport", ["frames", "shm"])
def test_a_put_of_many_small_chunks_is_split_by_its_header_too(daemon_factory, transport):
    """A PUT's header grows with its chunks (each tensor's map, ~70 bytes
    here beside 16 of bytes): the client counts it, so no batch is over
    max_message_bytes (the daemon answers TOO_LARGE, the whole batch lost).
    512 chunks of 64 tiny tensors: 512 KiB of tensors and ~2.3 MiB of maps,
    which a 1 MiB allowance for headers sent as one 2.8 MiB message."""
    d = daemon_factory("--ram-mb", "64", "--max-message-mb", "2", "--data-dir", "none")
    toks = np.arange(8192)
    snap = Snapshot(sliced={f"layer.{i:02d}.keys": (random_tensor("uint8", (1, 1, 8192, 1), i), 2) for i in range(64)})
    with d.client("small-chunks", strict=True, chunk_tokens=16, transport=transport) as c:
        assert c.put(toks, snap)
        assert c.counters["put_ok"] == 1
        hit = c.get(toks)
        assert hit.n == 8192 and all(hit.sliced[k].equal(t) for k, (t, _) in snap.sliced.items())
        assert c.stats()["server"]["errors"].get("TOO_LARGE", 0) == 0


def test_second_daemon_on_same_endpoint_refused(kvd_daemon, daemon_factory):
    other_data = kvd_daemon.workdir / "other-data"
    second = daemon_factory("--ram-mb", "16", "--data-dir", str(other_data), start=False, workdir=kvd_daemon.workdir)
    second.log_path = kvd_daemon.workdir / "second.log"
    second.start(wait=False)
    assert second.proc.wait(20) == 4
    assert "already serving" in second.log()
    with kvd_daemon.client(strict=True) as c:
        assert c.ping() is not None


def test_daemon_killed_then_restarted_same_client(kvd_daemon):
    toks = np.arange(300)
    c = kvd_daemon.client("restart", timeout=1.0)
    assert c.put(toks, snapshot_for(300))
    kvd_daemon.kill()
    for call in (lambda: c.probe(toks).n, lambda: c.get(toks), lambda: c.put(toks, snapshot_for(300))):
        t0 = time.monotonic()
        assert call() in (0, None, False)
        assert time.monotonic() - t0 < 1.5
    assert c.counters["lookup_failed"] >= 1
    with pytest.raises(DaemonUnavailable):
        Client(kvd_daemon.endpoint, namespace="s", timeout=0.5, strict=True).ping()
    kvd_daemon.start()
    deadline = time.monotonic() + 5
    while c.ping() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.put(toks, snapshot_for(300))  # RAM tier: empty after restart, refilled
    assert c.get(toks).n == 300
    c.close()


def test_a_reply_that_vanishes_after_poll_is_a_timeout_never_a_hang(kvd_daemon, monkeypatch):
    # With ZMQ_IMMEDIATE, a connection that drops (the daemon killed -9 just as
    # it answered) discards its pipe's unread messages at once: poll() may have
    # seen a reply that recv() then no longer finds. That moment cannot be hit
    # on demand, so the wait lies about it here: it says a reply is in, and
    # there is none (the real daemon behind it is busy: it never answers).
    from kvd_client._transport import Transport

    monkeypatch.setattr(Transport, "_await_reply", lambda self, sock, deadline: True)
    c = Client(kvd_daemon.endpoint, namespace="vanish", timeout=0.5, strict=True)
    done = threading.Event()
    outcome = []

    def call():
        try:
            c.ping()
        except DaemonUnavailable as exc:
            outcome.append(exc)
        done.set()

    assert c.ping() is not None  # connected (a lying poll costs a live daemon nothing)
    kvd_daemon.proc.send_signal(signal.SIGSTOP)  # nothing is answered
    try:
        threading.Thread(target=call, daemon=True).start()
        assert done.wait(10), "the client hung in a blocking recv"
    finally:
        kvd_daemon.proc.send_signal(signal.SIGCONT)
    assert len(outcome) == 1 and "no reply" in str(outcome[0])
    monkeypatch.undo()
    assert c.ping() is not None  # the same client, a fresh socket: served again
    c.close()


def test_sigterm_shuts_down_cleanly(kvd_daemon):
    assert kvd_daemon.stop() == 0
    assert "stopped" in kvd_daemon.log()
    assert not (kvd_daemon.workdir / "kvd.sock").exists()


def test_slow_daemon_is_a_miss_not_a_hang(kvd_daemon):
    import signal

    toks = np.arange(300)
    c = kvd_daemon.client("slow", timeout=0.5)
    assert c.put(toks, prefix_snapshot(toks))
    kvd_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert c.get(toks) is None
        assert time.monotonic() - t0 < 1.0
    finally:
        kvd_daemon.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while c.ping() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    hit = c.get(toks)  # the late reply to the timed-out GET is never mistaken for this one
    assert hit is not None and hit.n == 300
    assert c.counters["error_unavailable"] >= 1
    c.close()


def test_second_daemon_on_same_data_dir_refused(kvd_daemon, daemon_factory):
    second = daemon_factory("--data-dir", str(kvd_daemon.data_dir), start=False)
    second.start(wait=False)
    assert second.proc.wait(20) == 4
    assert "in use by another kvd process" in second.log()


def test_fast_round_trips_never_lose_a_reply(kvd_daemon):
    # libzmq throttles command processing in non-blocking calls; replies must
    # still never be dropped for a client that reads every one of them.
    with kvd_daemon.client("burst", strict=True) as c:
        for _ in range(3000):
            c.ping()
        assert c.stats()["server"]["requests"]["PING"] >= 3000


def test_sequences_parting_after_one_chunk_with_equal_length_tails_are_both_served(kvd_daemon):
    # A system prompt of one chunk, then two questions of the same length: both
    # tails hang off the same key and must both stay matchable (RAM and tiered
    # indexes once kept one tail per length).
    import numpy as np

    from kvd_client import HostTensor, Snapshot

    system = list(range(1, 9))
    with kvd_daemon.client("tails", chunk_tokens=8, strict=True) as kv:
        for seed, ask in enumerate(([20, 21, 22], [30, 31, 32], [40, 41, 42])):
            arr = np.random.default_rng(seed).standard_normal((1, 11, 2)).astype(np.float32)
            assert kv.put(system + ask, Snapshot(sliced={"k": (HostTensor.from_numpy(arr), 1)}))
        for ask in ([20, 21, 22], [30, 31, 32], [40, 41, 42]):
            assert kv.probe(system + ask + [7]).n == 11


def test_a_big_reply_with_no_thread_to_spare_is_sent_and_the_daemon_lives(daemon_factory):
    """Regression (a red-team find): the first reply big enough to be sent
    zero-copy made pyzmq start its collector thread and socket; a thread
    limit reached by then (a pids cgroup) ended the serving loop with
    RuntimeError, an fd table full made libzmq abort. Both are started when
    the daemon binds now, and a send that fails anyway is answered BUSY."""
    from kvd_client import HostTensor, Snapshot

    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(512)
    kv = np.random.default_rng(0).integers(0, 255, (1, 512, 1024), np.uint8)
    with d.client("big", strict=True, transport="frames") as c:
        assert c.put(toks, Snapshot(sliced={"k": (HostTensor.from_numpy(kv), 1)}))  # small replies only so far
        with no_more_threads(d.proc.pid):
            hit = c.get(toks)  # frames of 256 KiB: zero-copy, tracked
            assert hit is not None and np.array_equal(hit.sliced["k"].array, kv)
            assert c.ping() is not None and d.proc.poll() is None
