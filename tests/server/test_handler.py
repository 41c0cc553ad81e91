"""The request handler without sockets: paging under a slow tier."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from kvd.protocol import keys
from kvd.protocol.codec import Message, Tensor
from kvd.protocol.errors import BadField
from kvd.protocol.limits import Limits
from kvd.server.handler import Handler
from kvd.store import RamStore
from kvd.store.base import CHUNK, entry_id


class SlowStore(RamStore):
    """A RAM tier whose reads take as long as a disk's (a fault we cannot
    produce on demand for real: a slow disk)."""

    def get(self, eid):
        time.sleep(0.01)
        return super().get(eid)


def put_msg(tokens: np.ndarray, ct: int) -> Message:
    tb = keys.token_bytes(tokens)
    chunks = []
    for i, (s, e) in enumerate(keys.chunk_spans(len(tokens), ct)):
        data = np.arange(s, e, dtype=np.float32)
        chunks.append({"index": i, "tensors": [Tensor("x", "float32", (e - s,), data)], "meta": b""})
    return Message("PUT", {"ns": "n", "tokens": tb, "chunk_tokens": ct, "chunks": chunks})


def get_msg(tokens: np.ndarray, ct: int, start: int = 0, max_tokens=None) -> Message:
    return Message("GET", {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": ct,
                           "max_tokens": max_tokens, "need_boundary": False, "start": start})


def test_slow_reads_cut_pages_and_the_pages_join_to_the_whole():
    h = Handler(SlowStore(1 << 30), Limits())
    h.page_seconds = 0.025  # about 3 reads of 10 ms per page
    toks = np.arange(16 * 10)
    h.handle(put_msg(toks, 16))
    got, start, pages = [], 0, 0
    while True:
        _, reply = h.handle(get_msg(toks, 16, start, max_tokens=len(toks)))
        assert reply["n"] == len(toks)
        pages += 1
        got += [np.frombuffer(t.data, np.float32) for c in reply["chunks"] for t in c["tensors"]]
        if reply["end"] >= reply["n"]:
            break
        assert 1 <= len(reply["chunks"]) < 10
        start = reply["end"]
    assert pages >= 3
    assert np.array_equal(np.concatenate(got), np.arange(160, dtype=np.float32))


def test_fast_tier_serves_one_page():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(16 * 50)
    h.handle(put_msg(toks, 16))
    _, reply = h.handle(get_msg(toks, 16))
    assert reply["end"] == reply["n"] == len(toks) and len(reply["chunks"]) == 50


# -- what the red-team pass of session 13 found (each failed before its fix) --------
def wide_put(tokens: np.ndarray, ct: int, floats: int, indexes=None, boundary_floats: int = 0) -> Message:
    """A PUT whose chunks hold `floats` float32 each (and a boundary of `boundary_floats`)."""
    spans = keys.chunk_spans(len(tokens), ct)
    chunks = [{"index": i, "tensors": [Tensor("x", "float32", (floats,), np.full(floats, i, np.float32))], "meta": b""}
              for i in (range(len(spans)) if indexes is None else indexes)]
    fields = {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": ct, "chunks": chunks}
    if boundary_floats:
        fields["boundary"] = {"tensors": [Tensor("b", "float32", (boundary_floats,), np.zeros(boundary_floats, np.float32))],
                              "meta": b""}
    return Message("PUT", fields)


def page_bytes(reply: dict) -> int:
    """A GET reply's size on the wire, as the client's decoder counts it."""
    from kvd.protocol import codec

    return sum(memoryview(f).nbytes for f in codec.encode("GET", reply, id=1))


def test_a_put_refused_for_a_bad_index_stores_nothing():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(12)
    with pytest.raises(BadField, match="past the last chunk"):
        h.handle(wide_put(toks, 4, 4, indexes=[0, 7]))
    assert h.handle(Message("LOOKUP", {"ns": "n", "tokens": keys.token_bytes(toks), "chunk_tokens": 4}))[1]["n"] == 0
    assert h.store.stats()["tiers"]["ram"]["entries"] == 0


def test_a_get_page_never_exceeds_max_message_bytes():
    limits = Limits(max_message_bytes=1 << 20)
    h = Handler(RamStore(1 << 30), limits)
    toks = np.arange(64)
    # 16 chunks of 192 KiB: five to a page at most, each page under the limit.
    h.handle(wide_put(toks, 4, 48 * 1024))
    start, pages = 0, 0
    while True:
        reply = h.handle(get_msg(toks, 4, start, max_tokens=64))[1]
        assert reply["n"] == 64 and reply["chunks"] and page_bytes(reply) <= limits.max_message_bytes
        pages += 1
        if reply["end"] >= 64:
            break
        start = reply["end"]
    assert pages == 4
    # A boundary that does not fit beside the last page's five chunks comes with a later page.
    toks = np.arange(60)
    h.handle(wide_put(toks, 4, 48 * 1024, boundary_floats=200 * 1024))
    start, boundary, got = 0, None, []
    while True:
        reply = h.handle(get_msg(toks, 4, start, max_tokens=60))[1]
        assert reply["n"] == 60 and reply["chunks"] and page_bytes(reply) <= limits.max_message_bytes
        got += [c["start"] for c in reply["chunks"]]
        boundary = reply.get("boundary")
        if reply["end"] >= 60:
            break
        start = reply["end"]
    assert got == list(range(0, 60, 4)) and boundary is not None and boundary["at"] == 60


def test_a_chunk_too_big_for_any_message_ends_the_prefix_before_it():
    """Stored under a larger max_message_bytes, then the daemon restarted with a
    smaller one: GET served a page the client refused (or BUSY) for ever."""
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(12)
    h.handle(wide_put(toks[:8], 4, 1024))  # two small chunks, then a big one
    h.handle(wide_put(toks, 4, 512 * 1024, indexes=[2]))
    h.limits = Limits(max_message_bytes=1 << 20)
    reply = h.handle(get_msg(toks, 4, max_tokens=12))[1]
    assert reply["n"] == reply["end"] == 8 and len(reply["chunks"]) == 2


def test_a_get_page_starts_at_a_chunk_start():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(12)
    h.handle(wide_put(toks, 4, 4))
    with pytest.raises(BadField, match="chunk's start"):
        h.handle(get_msg(toks, 4, start=5))


def test_counters_are_kept_for_the_most_recently_used_namespaces_only():
    from kvd.server.handler import _MAX_NS_COUNTERS

    h = Handler(RamStore(1 << 30), Limits())
    ask = lambda ns: h.handle(Message("LOOKUP", {"ns": ns, "tokens": b"", "chunk_tokens": 4}))  # noqa: E731
    ask("kept")
    for i in range(_MAX_NS_COUNTERS + 100):
        ask(f"ns{i}")
        if i % 1000 == 0:
            ask("kept")  # used now and then: never the oldest
    assert len(h.ns_counters) == _MAX_NS_COUNTERS
    assert "ns0" not in h.ns_counters and h.ns_counters["kept"]["lookups"] == 6


def test_a_page_past_the_served_prefix_is_a_miss_and_one_at_its_end_carries_nothing():
    """A reply carries at least one chunk, unless the prefix now ends at the
    page's start (`n = end = start`); a start past it is a miss (red-team find:
    `{n: 10, end: 400, chunks: []}` had been answered)."""
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(10)
    h.handle(put_msg(toks, 4))
    for start, cap in ((400, None), (2**64 - 4, None), (4, 2), (12, None)):
        assert h.handle(get_msg(toks, 4, start=start, max_tokens=cap))[1] == {"n": 0, "end": 0, "chunks": []}
    page = h.handle(get_msg(toks, 4, start=8))[1]
    assert (page["n"], page["end"], [c["start"] for c in page["chunks"]]) == (10, 10, [8])
    # The chunk at 8 lost since the first page: the prefix ends at 8.
    h.store.evict_entry(entry_id(keys.chain("n", 4, keys.token_bytes(toks))[2], CHUNK), "test")
    assert h.handle(get_msg(toks, 4, start=8))[1] == {"n": 8, "end": 8, "chunks": []}


def test_a_write_through_put_is_answered_once_its_whole_sequence_is_on_disk(tmp_path):
    """Regression (a red-team find): a client skips the chunks a LOOKUP says are
    held. Held in RAM on their way to the disk (another client's PUT, not yet
    answered), its PUT of no chunks was acknowledged at once, and a kill -9
    then lost what it was told was durable. Now it waits for them as for its own."""
    import threading

    from kvd.server.handler import Deferred
    from kvd.store.tiered import open_store

    store = open_store(64 << 20, tmp_path, ssd_bytes=64 << 20, write_through=True, min_free_bytes=0)
    try:
        h = Handler(store, Limits())
        gate = threading.Event()
        store.ssd.writer.submit(gate.wait)  # the real writer, busy: PUTs stay on their way to the disk
        toks = np.arange(12)
        first = h.handle(put_msg(toks, 4))[1]
        assert isinstance(first, Deferred)
        skipped = Message("PUT", {**put_msg(toks, 4).fields, "chunks": []})
        second = h.handle(skipped)[1]
        assert isinstance(second, Deferred) and set(second.eids) == set(first.eids), second
        gate.set()
        assert store.flush(10)
        assert h.handle(skipped)[1] == {"stored": 0, "duplicate": 0, "too_big": 0, "dropped": 0}  # on disk now
    finally:
        store.close()


def test_a_ram_only_write_through_daemon_never_acknowledges_a_put_of_held_chunks():
    from kvd.protocol.errors import NotPersisted
    from kvd.store.ramonly import RamOnly

    h = Handler(RamOnly(64 << 20, "/nonexistent", "test", write_through=True), Limits())
    toks = np.arange(12)
    with pytest.raises(NotPersisted):
        h.handle(put_msg(toks, 4))
    with pytest.raises(NotPersisted):
        h.handle(Message("PUT", {**put_msg(toks, 4).fields, "chunks": []}))


class DeferOnce(RamStore):
    """A RAM tier that, like the remote-backed store in its deferring mode,
    answers its first read with Pending (the request is parked and served
    again when `redo` is called): a stand-in for a remote read under way."""

    defers = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.parked: list = []
        self.first = True

    def room_to_wait(self) -> bool:
        return True

    @contextlib.contextmanager
    def reading(self, mode, *, fresh=True, local_first=False):
        yield

    def wait(self, pending, redo, token=None) -> bytes:
        self.parked.append(redo)
        return b"token"

    def get(self, eid):
        if self.first:
            from concurrent.futures import Future

            from kvd.store.remote.pending import Pending

            self.first = False
            raise Pending(Future())
        return super().get(eid)


class LeasesFull:
    """The shared-memory plane's GET half with every read lease taken (a peer
    that never releases them): a proof passes, and a GET goes over frames."""

    run_id = "r"

    def expire(self):
        pass

    def admit(self, field):
        return True

    def leases_full(self):
        return True

    def frames_instead(self, reply):
        reply["shm"] = {"run": self.run_id, "segments": []}
        return reply

    def describe_get(self, reply, entries):
        raise AssertionError("no read lease to be had: never described")


def test_a_parked_shm_get_with_no_read_lease_comes_back_over_frames_with_its_shm_field():
    """A GET that proved shared memory, found no read lease and was parked on
    a remote read comes back over frames *with* its `shm` field: without it
    a client takes its proof for refused (a daemon restarted) and drops its
    link for every client of the process (red-team of 5283d93)."""
    store = DeferOnce(1 << 30)
    h = Handler(store, Limits())
    toks = np.arange(32)
    h.handle(put_msg(toks, 16))
    h.shm = LeasesFull()
    msg = Message("GET", {**get_msg(toks, 16).fields, "shm": {"proof": "x"}})
    _, deferred = h.handle(msg)
    assert store.parked, "the GET was parked"
    store.parked[0](b"token")
    reply = deferred.fields
    assert reply["n"] == 32 and reply["shm"]["run"] == "r" and "lease" not in reply["shm"]
    assert not h.shm_proven and not h.over_leases  # nothing carried over to the next request
