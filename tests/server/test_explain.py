"""Misses that explain themselves: `kvd explain` and Client.explain through a real daemon, one test per reason."""

from __future__ import annotations

import json
import time

import numpy as np

from kvd.protocol import keys
from kvd.server.evictions import EvictionRecord
from kvd.server.explain import SequenceRecord, diff_fields, explain
from kvd.store import RamStore

from support import chunk_blob, kvd, prefix_snapshot


def explain_cli(d, ns: str, tokens, tmp_path, *extra: str) -> dict:
    f = tmp_path / f"tokens-{time.monotonic_ns()}.json"
    f.write_text(json.dumps([int(t) for t in tokens]))
    r = kvd("explain", "--endpoint", d.endpoint, "--namespace", ns, "--tokens-file", str(f), "--json", *extra)
    assert r.returncode == 0, r.stderr
    text = kvd("explain", "--endpoint", d.endpoint, "--namespace", ns, "--tokens-file", str(f), *extra)
    out = json.loads(r.stdout)
    assert f"reason     {out['reason']}" in text.stdout and out["message"][:40] in text.stdout
    return out


def seq(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def test_held_never_stored_and_tokens_differ(kvd_daemon, tmp_path):
    a = seq(600, 1)
    with kvd_daemon.client("chat", strict=True) as c:
        assert c.put(a, prefix_snapshot(a))
        e = c.explain(a)
        assert (e.reason, e.n, e.tokens) == ("held", 600, 600)

        out = explain_cli(kvd_daemon, "chat", seq(400, 2), tmp_path)
        assert (out["reason"], out["n"]) == ("never_stored", 0)

        # Same text up to 300, then another template: held up to the chunk before, and the position named.
        b = np.concatenate([a[:300], [7, 7, 7], a[303:]])
        out = explain_cli(kvd_daemon, "chat", b, tmp_path)
        assert (out["reason"], out["n"]) == ("tokens_differ", 256)
        assert out["detail"] == {"at": 300, "query_token": 7, "stored_token": int(a[300])}

        # A continuation of what was stored: it was never stored past its end.
        longer = np.concatenate([a, seq(100, 3)])
        e = c.explain(longer)
        assert (e.reason, e.n, e.detail["stored_until"]) == ("never_stored", 600, 600)


def test_other_namespace_names_the_differing_field(kvd_daemon, tmp_path):
    from kvd_client.mlx_lm import namespace_for
    from models import build

    model = build("llama")
    plain, quantized = namespace_for(model), namespace_for(model, kv_bits=8)
    a = seq(512, 4)
    with kvd_daemon.client(plain, strict=True) as c:
        assert c.put(a, prefix_snapshot(a))  # the PUT carries the namespace's components
    with kvd_daemon.client(quantized, strict=True) as c:
        e = c.explain(a)  # ...and so does the EXPLAIN
    assert (e.reason, e.n, e.detail["namespace"], e.detail["shared_tokens"]) == ("other_namespace", 0, plain, 512)
    assert e.detail["fields"]["kv.bits"] == [8, None]
    assert "kv.group_size" in e.detail["fields"] and "weights" not in e.detail["fields"]
    assert "kv.bits" in e.message
    out = explain_cli(kvd_daemon, quantized, a, tmp_path)  # the daemon keeps both namespaces' metadata
    assert out["reason"] == "other_namespace" and out["detail"]["fields"]["kv.bits"] == [8, None]

    # Namespaces not made by namespace_for: the reason, without fields.
    with kvd_daemon.client("hand-made", strict=True) as c:
        assert c.put(a, prefix_snapshot(a))
    out = explain_cli(kvd_daemon, "hand-made-2", a, tmp_path)
    assert out["reason"] == "other_namespace" and out["detail"]["namespace"] == "hand-made"
    assert "fields" not in out["detail"] and "no component metadata" in out["message"]
    # Another chunk size in the same namespace is a different chain, too.
    out = explain_cli(kvd_daemon, "hand-made", a, tmp_path, "--chunk-tokens", "128")
    assert out["reason"] == "other_namespace" and out["detail"]["chunk_tokens"] == 256


def test_evicted_says_when_which_tier_and_why(daemon_factory, tmp_path):
    d = daemon_factory("--ram-mb", "1", "--data-dir", "none")
    first = seq(512, 5)
    with d.client("busy", strict=True) as c:
        assert c.put(first, prefix_snapshot(first))
        for i in range(10):  # ~1.5 MiB more: the first sequence is the coldest
            s = seq(512, 100 + i)
            assert c.put(s, prefix_snapshot(s))
    out = explain_cli(d, "busy", first, tmp_path)
    assert (out["reason"], out["n"]) == ("evicted", 0)
    det = out["detail"]
    assert (det["at"], det["tier"], det["what"], det["why"], det["namespace"]) == (0, "ram", "evicted", "lru", "busy")
    assert time.time() - 60 < det["when"] <= time.time()
    assert "evicted from the ram tier" in out["message"]


def test_quarantined_chunk(daemon_factory, tmp_path):
    d = daemon_factory("--ram-mb", "64", "--write-through")
    a = seq(600, 6)
    with d.client("q", strict=True) as c:
        assert c.put(a, prefix_snapshot(a))
        deadline = time.monotonic() + 10
        while c.stats()["tiers"]["ssd"]["entries"] < 3:  # the writer thread writes them down
            assert time.monotonic() < deadline
            time.sleep(0.02)
        path = chunk_blob(d.data_dir, "q", a, 1)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(raw)
        c.gc(ram_bytes=0)  # RAM copies gone: the next read is from disk
        hit = c.get(a)
        assert hit.n == 256  # the damaged chunk is a miss...
    out = explain_cli(d, "q", a, tmp_path)
    assert (out["reason"], out["n"], out["detail"]["at"]) == ("quarantined", 256, 256)  # ...and says so
    assert out["detail"]["tier"] == "ssd" and out["detail"]["why"] == "corrupt"


def test_boundary_missing_for_a_hybrid_model(kvd_daemon, tmp_path):
    a = seq(600, 7)
    with kvd_daemon.client("hybrid", strict=True) as c:
        assert c.put(a, prefix_snapshot(a))  # chunks only: no recurrent state stored
        query = np.concatenate([a, seq(50, 8)])
        out = explain_cli(kvd_daemon, "hybrid", query, tmp_path, "--need-boundary")
        assert (out["reason"], out["n"], out["detail"]["chunks_until"], out["boundaries"]) == ("boundary_missing", 0, 600, [])
        assert c.explain(query).reason == "never_stored"  # without layers that need it, chunks suffice
        assert c.put(a, prefix_snapshot(a, boundary=True))  # now with its state
        e = c.explain(query, need_boundary=True)
        assert (e.reason, e.n, e.boundaries) == ("never_stored", 600, (600,))


def test_sequence_record_is_bounded_and_keeps_one_record_per_growing_conversation():
    rec = SequenceRecord(max_tokens=1000, max_sequences=3)
    toks = np.arange(900, dtype=np.uint32)
    for n in (300, 600, 900):  # a conversation growing turn by turn
        tb = keys.token_bytes(toks[:n])
        rec.saw_put("ns", 256, tb, keys.chain("ns", 256, tb))
    assert rec.stats()["sequences"] == 1 and rec.tokens == 900
    for i in range(4):
        tb = keys.token_bytes(np.arange(100, dtype=np.uint32) + 10_000 * (i + 1))
        rec.saw_put("ns", 256, tb, keys.chain("ns", 256, tb))
    assert rec.stats()["sequences"] == 3 and rec.tokens <= 1000  # oldest forgotten first
    assert not rec.note_meta("ns", {"x": "y" * 70_000})  # too big to keep
    assert diff_fields({"a": 1, "kv": {"bits": 8, "gs": 64}}, {"a": 1, "kv": {"bits": None, "gs": 64}}) == {"kv.bits": [8, None]}


def test_metadata_json_cannot_spell_is_shown_not_an_internal_error(kvd_daemon):
    """A namespace's metadata is any small map a peer sends, bytes keys too: an
    EXPLAIN comparing it used to answer INTERNAL to every other namespace."""
    from kvd.protocol import codec

    from support import ask_raw

    toks = keys.token_bytes(range(8))
    put = codec.encode("PUT", {"ns": "A", "tokens": toks, "chunk_tokens": 4, "ns_meta": {"x": {b"k": 1}},
                               "chunks": [{"index": 0, "tensors": [codec.Tensor("k", "float32", (4,), bytes(16))]}]}, id=1)
    assert ask_raw(kvd_daemon.endpoint, put)["stored"] == 1
    ask = codec.encode("EXPLAIN", {"ns": "B", "tokens": toks, "chunk_tokens": 4, "ns_meta": {"x": 1}}, id=2)
    reply = ask_raw(kvd_daemon.endpoint, ask)  # an ERROR reply raises here
    assert reply["reason"] == "other_namespace" and reply["detail"]["fields"]["x"] == [1, "{b'k': 1}"]


def test_namespace_metadata_is_kept_packed_and_bounded_in_bytes():
    rec = SequenceRecord(max_namespaces=10_000)
    big = {"x": "y" * 60_000}
    for i in range(200):  # 12 MB of metadata offered, at most 8 MiB kept
        assert rec.note_meta(f"ns{i}", big)
    assert rec.meta("ns199") == big and rec.meta("ns0") is None
    assert rec._meta_bytes <= 8 << 20 and rec.stats()["namespaces_with_metadata"] == rec._meta_bytes // 60_000


def test_explain_is_sans_io_over_any_store():
    ram = RamStore(1 << 20)
    fields = {"ns": "x", "chunk_tokens": 4, "tokens": keys.token_bytes(range(10)), "need_boundary": False}
    out = explain(ram, EvictionRecord(), SequenceRecord(), fields)
    assert out["reason"] == "never_stored" and out["n"] == 0 and out["tokens"] == 10
