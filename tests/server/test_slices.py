"""Requests served in turns (handler.Sliced, turns.py rule 5): the same
answer as served whole, and other peers' requests served in between."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from kvd.protocol import codec, keys
from kvd.protocol.codec import Message, Tensor
from kvd.protocol.errors import BadField
from kvd.protocol.limits import Limits
from kvd.server.admission.turns import Turns
from kvd.server.daemon import Daemon
from kvd.server.handler import SLICE_CHUNKS, Handler, Sliced
from kvd.store import RamStore
from kvd.store.base import CHUNK, entry_id
from kvd.store.tiered import open_store


def tiny_put(tokens: np.ndarray, indexes=None, boundary: bool = False) -> Message:
    """A PUT of one 4-byte chunk per token (chunk_tokens=1): issue 44's tiny flood."""
    idx = range(len(tokens)) if indexes is None else indexes
    chunks = [{"index": i, "tensors": [Tensor("k", "uint8", (4,), np.full(4, i % 251, np.uint8))], "meta": b"m%d" % i}
              for i in idx]
    fields = {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": 1, "chunks": chunks}
    if boundary:
        fields["boundary"] = {"tensors": [Tensor("b", "uint8", (8,), np.arange(8, dtype=np.uint8))], "meta": b"b"}
    return Message("PUT", fields)


def lookup(tokens: np.ndarray) -> Message:
    return Message("LOOKUP", {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": 1})


def in_turns(h: Handler, msg: Message) -> tuple[tuple, int]:
    """Serve `msg` one step per turn (a budget of 0): (the answer, turns taken)."""
    rtype, sliced = h.handle(msg)
    assert isinstance(sliced, Sliced)
    while (got := sliced.resume(0.0)) is None:
        pass
    assert got[0] == rtype
    return got, sliced.turns


def whole(h: Handler, msg: Message) -> tuple:
    rtype, sliced = h.handle(msg)
    assert isinstance(sliced, Sliced)
    got = sliced.resume(float("inf"))
    assert sliced.turns == 1
    return got


def held(h: Handler, tokens: np.ndarray) -> list:
    """What a GET serves of `tokens` (every page), as plain values."""
    out, start = [], 0
    while True:
        _, r = h.handle(Message("GET", {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": 1,
                                         "max_tokens": None, "need_boundary": True, "start": start}))
        out += [(c["start"], c["length"], c["meta"], [bytes(t.data) for t in c["tensors"]]) for c in r["chunks"]]
        if "boundary" in r:
            out.append(("boundary", r["boundary"]["at"], r["boundary"]["meta"]))
        if r["end"] >= r["n"]:
            return out
        start = r["end"]


def test_a_put_served_in_turns_stores_and_answers_what_a_whole_one_does():
    toks = np.arange(3000)
    a, b = Handler(RamStore(1 << 30), Limits()), Handler(RamStore(1 << 30), Limits())
    got, turns = in_turns(a, tiny_put(toks, boundary=True))
    assert turns > 3000 // 64  # a turn per block of chunks, for the keys and again for the stores
    assert got == whole(b, tiny_put(toks, boundary=True)) == ("PUT", {"stored": 3001, "duplicate": 0, "too_big": 0, "dropped": 0})
    assert held(a, toks) == held(b, toks) and len(held(a, toks)) == 3001
    # Again: all duplicates, in turns too.
    assert in_turns(a, tiny_put(toks))[0] == ("PUT", {"stored": 0, "duplicate": 3000, "too_big": 0, "dropped": 0})


def test_a_put_refused_in_turns_stores_nothing_and_short_ones_are_served_whole():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(2000)
    rtype, sliced = h.handle(tiny_put(toks, indexes=[*range(1999), 5000]))
    with pytest.raises(BadField, match="past the last chunk"):
        while sliced.resume(0.0) is None:
            pass
    assert sliced.turns > 1 and h.store.stats()["tiers"]["ram"]["entries"] == 0
    short = np.arange(SLICE_CHUNKS)
    assert h.handle(tiny_put(short))[1]["stored"] == SLICE_CHUNKS  # not Sliced: a dict
    assert h.handle(lookup(short))[1]["n"] == SLICE_CHUNKS


def test_a_lookup_served_in_turns_gives_exactly_the_answer_of_a_whole_one():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(4096)
    h.handle(tiny_put(toks[:3000], boundary=True))[1].resume(float("inf"))
    for query in (toks, toks[:3000], toks[:2999], np.concatenate([toks[:1500], toks[:10]])):
        got, turns = in_turns(h, lookup(query))
        assert got == whole(h, lookup(query))
        assert turns > 1
    assert in_turns(h, lookup(toks))[0] == ("LOOKUP", {"n": 3000, "boundaries": [3000]})
    # A chunk dropped between turns ends the match where a later LOOKUP's would.
    rtype, sliced = h.handle(lookup(toks))
    assert sliced.resume(0.0) is None
    assert h.store.discard(entry_id(h.chains.chain("n", 1, keys.token_bytes(toks))[2000], CHUNK))
    while (got := sliced.resume(0.0)) is None:
        pass
    assert got == whole(h, lookup(toks)) == ("LOOKUP", {"n": 2000, "boundaries": []})


def test_a_stats_of_a_big_ram_tier_is_served_in_turns_and_counts_what_a_whole_one_does(tmp_path, monkeypatch):
    """STATS asks the SSD index about every RAM entry (tiered.STATS_STEP of
    them a step, here 64): over 1,000 entries it takes turns, and answers
    what one served whole does."""
    import kvd.store.tiered as tiered

    store = open_store(1 << 30, tmp_path, ssd_bytes=64 << 20, min_free_bytes=0)
    try:
        h = Handler(store, Limits())
        whole(h, tiny_put(np.arange(1000)))
        assert store.flush(10)
        monkeypatch.setattr(tiered, "STATS_STEP", 64)
        got, turns = in_turns(h, Message("STATS", {}))
        assert turns == 1000 // 64 + 1
        monkeypatch.setattr(tiered, "STATS_STEP", 1 << 20)
        once = whole(h, Message("STATS", {}))
        for stats in (got[1]["stats"], once[1]["stats"]):
            assert stats["namespaces"]["n"]["entries"] == 1000 and stats["namespaces"]["n"]["ssd_entries"] == 1000
        assert got[1]["stats"]["namespaces"] == once[1]["stats"]["namespaces"]
        assert got[1]["stats"]["tiers"]["ram"] == once[1]["stats"]["tiers"]["ram"]
    finally:
        store.close(persist=False)


@pytest.mark.parametrize("room", [True, False])
def test_a_ping_sent_while_a_long_put_is_in_progress_is_answered_before_the_puts_reply(tmp_path, room):
    """One peer's PUT of 4,096 tiny chunks arrives first, a client's PING
    second: the PING's reply is sent after the PUT's first turn, before the
    PUT's own (served whole, as before, the PUT went first). One step a
    turn (slice_seconds 0): the order of events alone, whatever the machine's
    speed. Without room to wait (turns.py rule 3), the PUT is served to its end first."""
    d = Daemon(RamStore(64 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    # No share to wait for: turns come as soon as the socket is quiet.
    d.turns = Turns(active_s=0.0) if room else Turns(active_s=0.0, max_waiting=0)
    d.handler.slice_seconds = 0.0
    d.bind()
    ctx = zmq.Context.instance()
    peer, client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    waiting: list = []

    def arrive() -> None:
        deadline = time.monotonic() + 10
        while not d._sock.poll(100):
            assert time.monotonic() < deadline, "the request did not arrive"
        waiting.append(d._recv(d._sock, whole=True))

    def recv():
        if not waiting:
            raise zmq.Again()
        return waiting.pop(0)

    try:
        for s in (peer, client):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
        toks = keys.token_bytes(range(4096))
        chunks = [{"index": i, "tensors": [codec.Tensor("k", "uint8", (4,), bytes([i % 256]) * 4)], "meta": b""}
                  for i in range(4096)]
        peer.send_multipart(codec.encode("PUT", {"ns": "t", "tokens": toks, "chunk_tokens": 1, "chunks": chunks}, id=5))
        arrive()  # the PUT is in before the PING is sent
        client.send_multipart(codec.encode("PING", {}, id=6))
        arrive()
        d._serve_waiting(recv, most=8)  # the PUT's first turn, the PING, a few more of the PUT's turns
        if not room:
            assert peer.poll(5000) and client.poll(5000)
            assert codec.decode_reply(peer.recv_multipart())["stored"] == 4096
            assert d.turns.stats()["sliced"] == 0
            return
        assert client.poll(5000), "the PING was not answered"
        assert msgpack.unpackb(client.recv_multipart()[0])["type"] == "PING"
        assert not peer.poll(0), "the PUT was answered before the PING"
        assert d.turns.stats()["sliced"] > 0 and len(d.turns) == 1
        while not peer.poll(0):
            d._serve_waiting(recv)
        reply = codec.decode_reply(peer.recv_multipart())
        assert reply.type == "PUT" and reply.id == 5 and reply["stored"] == 4096
        assert len(d.turns) == 0 and d.turns.stats()["waiting_turn"] == 0
    finally:
        peer.close()
        client.close()
        d.close()


@pytest.mark.parametrize("damage, code", [
    ("dtype", "BAD_DTYPE"),  # chunk 3,000's tensor: an unknown dtype
    ("frame", "BAD_FRAME_INDEX"),  # a frame no tensor references
])
def test_a_long_put_broken_far_into_its_chunks_is_refused_with_the_exact_error_and_stores_nothing(tmp_path, damage, code):
    """A PUT of 4,096 tiny chunks over the wire: its chunks are decoded in its
    turns (codec.LazyChunks), and a break at chunk 3,000 (or a frame left
    over) is the error a whole decode gives, with nothing stored."""
    d = Daemon(RamStore(64 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.handler.slice_seconds = 0.0  # one step a turn: the break is found turns after the first
    d.bind()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(d.endpoint)
        n = 4096
        toks = keys.token_bytes(range(n))
        chunks = [{"index": i, "tensors": [codec.Tensor("k", "uint8", (4,), bytes([i % 256]) * 4)], "meta": b""}
                  for i in range(n)]
        frames = codec.encode("PUT", {"ns": "t", "tokens": toks, "chunk_tokens": 1, "chunks": chunks}, id=5)
        header = msgpack.unpackb(frames[0], raw=False)
        if damage == "dtype":
            header["chunks"][3000]["tensors"][0]["dtype"] = "float7"
        else:
            frames.append(b"left over")
        frames[0] = msgpack.packb(header, use_bin_type=True)
        assert isinstance(codec.decode_request(frames, d.limits)["chunks"], codec.LazyChunks)
        peer.send_multipart(frames)
        deadline = time.monotonic() + 30
        while not peer.poll(0):
            assert time.monotonic() < deadline, "no answer"
            d._serve_waiting(lambda: d._recv(d._sock) if d._sock.poll(10) else (_ for _ in ()).throw(zmq.Again()))
        reply = codec.decode_reply(peer.recv_multipart())
        assert reply.type == "ERROR" and reply["name"] == code and reply.id == 5
        assert d.turns.stats()["sliced"] > 10  # refused turns after its first, not at decode
        assert d.store.stats()["tiers"]["ram"]["entries"] == 0
    finally:
        peer.close()
        d.close()
