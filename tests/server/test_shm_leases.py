"""Leases of the shared-memory plane under floods (kvd/protocol/shm.py,
kvd/server/shm/plane.py): expiring leases costs what expired, never every live lease
(every request runs it); grants awaiting COMMIT are bounded in number and in
the request bytes they keep (BUSY past either, a grant already made is never
taken back); a SLOTS that places nothing is BAD_FIELD. Unit tests count work
on injected clocks; the daemon test floods a real `kvd serve` and checks that a
normal client's PUT still lands, over frames while the bound is reached and
over shared memory once the grants are committed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.protocol import codec, shm
from kvd.protocol.errors import BadField, Busy
from kvd.server.shm.plane import ShmPlane
from support import FakeClock, assert_prefix_hit, prefix_snapshot


class CountingNow(float):
    """A time that counts how often it is compared (a lease table compares it
    with a deadline once per lease it looks at)."""

    compared = 0

    def _count(op):  # noqa: N805 - builds the methods below
        def compare(self, other):
            CountingNow.compared += 1
            return getattr(float, op)(self, other)
        return compare

    __ge__, __gt__, __le__, __lt__ = _count("__ge__"), _count("__gt__"), _count("__le__"), _count("__lt__")


def _at(t: float) -> CountingNow:
    CountingNow.compared = 0
    return CountingNow(t)


def test_lease_table_expiry_touches_only_the_expired():
    n = 10_000
    t = shm.LeaseTable(lease_seconds=100)
    ids = [t.grant(float(i), write=[i]).lease_id for i in range(n)]  # deadline 100 + i
    assert t.expire(_at(109.5)) == list(range(10))  # leases 0..9 ended: their unwritten slots freed
    assert CountingNow.compared <= 2 * 10 + 1
    assert not any(i in t for i in ids[:10]) and all(i in t for i in ids[10:])
    assert t.expire(_at(109.5)) == [] and CountingNow.compared <= 1  # nothing more: a peek
    with pytest.raises(BadField):
        t.commit(ids[0], 0, now=50.0)  # an expired lease is gone, even asked with an earlier time
    t.commit(ids[10], 10, now=50.0)

    # Released leases leave heap entries behind; they are skipped, and rebuilt
    # away once they outnumber the live leases, so the heap stays bounded.
    for i in ids[10:9_010]:
        t.release(i)
    assert len(t._deadlines) <= 2 * 990 + 65
    assert t.expire(_at(9_009.5)) == [] and CountingNow.compared <= 2 * 65 + 1  # only released ones
    assert t.expire(_at(10_000.0)) == list(range(9_010, 9_901))
    assert all(i in t for i in ids[9_901:]) and CountingNow.compared <= 2 * 891 + 1


def test_lease_table_expires_by_deadline_not_by_grant_order():
    t = shm.LeaseTable(lease_seconds=10)
    late = t.grant(50.0, write=[1])  # an injected clock may step back
    early = t.grant(10.0, write=[2])
    assert t.expire(25.0) == [2] and late.lease_id in t and early.lease_id not in t
    assert t.expire(60.0) == [1]


class CountingDict(dict):
    """A dict that counts the keys anyone walks through."""

    walked = 0

    def __iter__(self):
        for k in super().__iter__():
            CountingDict.walked += 1
            yield k


def _slots(tokens: int = 4, chunks: int = 1, ns_meta=None) -> codec.Message:
    spec = [codec.Tensor("k", "float32", (1, 4), None)]
    fields = {"ns": "f", "tokens": b"\1\0\0\0" * tokens, "chunk_tokens": 256,
              "chunks": [{"index": i, "tensors": spec, "meta": b""} for i in range(chunks)], "shm": {}}
    if ns_meta is not None:
        fields["ns_meta"] = ns_meta
    return codec.Message("SLOTS", fields)


@pytest.fixture
def plane(tmp_path):
    made: list[ShmPlane] = []

    def make(**kw) -> ShmPlane:
        p = ShmPlane(tmp_path / f"plane{len(made)}", capacity=64 << 20, lease_seconds=100,
                     segment_bytes=1 << 20, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_plane_expiry_touches_only_the_expired(plane, monkeypatch):
    clock = FakeClock(0.0)
    p = plane(clock=clock, max_pending=100_000, max_pending_bytes=1 << 40)
    n = 5_000
    for i in range(n):
        clock.now = float(i)
        p.grant(_slots(), 1 << 30)
    used, pending = p.arena.used, p.pending_bytes
    looked = [0]
    contains = shm.LeaseTable.__contains__

    def counting_contains(self, lease_id):
        looked[0] += 1
        return contains(self, lease_id)

    monkeypatch.setattr(shm.LeaseTable, "__contains__", counting_contains)
    p._held = CountingDict(p._held)
    CountingDict.walked = 0
    clock.now = 109.5
    p.expire()
    assert looked[0] + CountingDict.walked <= 10
    s = p.stats()
    assert s["expired"] == 10 and s["leases"] == s["pending"] == n - 10
    assert p.arena.used == used - 10 * shm.ALIGN  # the uncommitted grants' slots are freed
    assert p.pending_bytes == pending * (n - 10) // n  # and what their requests held


def test_slots_placing_nothing_is_bad_field(plane):
    p = plane()
    empty = _slots(tokens=1 << 20, chunks=0)  # 4 MiB of tokens, nothing to place
    for _ in range(100):
        with pytest.raises(BadField):
            p.grant(empty, 16 << 20)
    s = p.stats()
    assert s["leases"] == s["pending"] == s["pending_bytes"] == s["grants"] == 0


def test_pending_grants_are_bounded_by_count_and_bytes(plane):
    clock = FakeClock(0.0)
    p = plane(clock=clock, max_pending=4)
    granted = [p.grant(_slots(), 1 << 30)["lease"] for _ in range(4)]
    with pytest.raises(Busy):
        p.grant(_slots(), 1 << 30)
    assert p.stats()["busy_pending"] == 1 and p.stats()["pending"] == 4
    p.commit(granted.pop(0))  # a grant made before the bound was reached is never taken back
    granted.append(p.grant(_slots(), 1 << 30)["lease"])  # and its place is free again
    for lease in granted:
        assert p.commit(lease).type == "PUT"
    assert p.stats()["pending"] == p.pending_bytes == 0

    # Bytes: what pending requests keep (tokens, metas, ns_meta), at most
    # min(max_message_bytes, max_pending_bytes) however few they are.
    q = plane(clock=clock)
    big = _slots(tokens=1 << 20)  # 4 MiB of tokens, one tiny chunk
    leases = [q.grant(big, 16 << 20)["lease"] for _ in range(3)]
    assert 12 << 20 < q.pending_bytes <= 16 << 20
    with pytest.raises(Busy):
        q.grant(big, 16 << 20)
    with pytest.raises(Busy):  # ns_meta counts too
        q.grant(_slots(ns_meta={"junk": ["x" * 1000] * 5000}), 16 << 20)
    assert q.grant(_slots(), 16 << 20)["lease"]  # a small request still fits
    assert q.stats()["busy_pending"] == 2
    clock.advance(100)  # the leases end; what they held goes with them
    q.expire()
    assert q.stats()["pending"] == q.pending_bytes == 0 and q.stats()["expired"] == 4
    with pytest.raises(BadField):
        q.commit(leases[0])
    r = plane(clock=clock, max_pending_bytes=1 << 20)  # the plane's own bound, below max_message_bytes
    with pytest.raises(Busy):
        r.grant(big, 16 << 20)
    assert r.grant(_slots(), 16 << 20)["lease"]


def test_slots_floods_are_refused_and_puts_still_work(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--max-message-mb", "16")
    spec = [codec.Tensor("k", "float32", (1, 4), None)]
    with d.client("flood", strict=True, transport="shm") as c:
        link = c._link()
        rq = c._transport.request
        huge = {"ns": "f", "tokens": b"\1" * (4 << 20), "chunk_tokens": 65536}

        for _ in range(50):  # the reported flood: 4 MiB of tokens and nothing to place
            with pytest.raises(BadField):
                rq("SLOTS", {**huge, "chunks": [], "shm": link.field()}, 5)
        s = c.stats()["shm"]
        assert s["leases"] == s["pending"] == s["pending_bytes"] == s["grants"] == 0

        # The same with one tiny chunk: a few grants, then BUSY (bytes).
        big = []
        for _ in range(10):
            try:
                big.append(rq("SLOTS", {**huge, "chunks": [{"index": 0, "tensors": spec}], "shm": link.field()}, 5))
            except Busy:
                break
        else:
            pytest.fail("10 SLOTS of 4 MiB of tokens each were all granted under 16 MiB messages")
        s = c.stats()["shm"]
        assert 2 <= len(big) <= 4 and s["pending"] == len(big) and s["pending_bytes"] <= 16 << 20
        for g in big:
            assert rq("COMMIT", {"lease": g["lease"], "shm": link.field()}, 5)["stored"] in (0, 1)

        # Many small ones: BUSY past 1,024 awaiting COMMIT (count).
        small = {**c._seq(np.arange(300)), "chunks": [{"index": 0, "tensors": spec}]}
        grants = [rq("SLOTS", {**small, "shm": link.field()}, 5) for _ in range(1024)]
        with pytest.raises(Busy):
            rq("SLOTS", {**small, "shm": link.field()}, 5)
        assert c.stats()["shm"]["pending"] == 1024

        # Meanwhile a normal PUT lands, over frames.
        toks = np.arange(10_000, 10_600)
        assert c.put(toks, prefix_snapshot(toks))
        assert c.counters["shm_put_fallback"] == 1 and c.counters["shm_puts"] == 0
        assert_prefix_hit(c.get(toks), toks)

        # The grants made before the bound still commit; then PUTs use shm again.
        for g in grants:
            rq("COMMIT", {"lease": g["lease"], "shm": link.field()}, 5)
        s = c.stats()["shm"]
        assert s["pending"] == s["pending_bytes"] == 0 and s["busy_pending"] == 3  # bytes, count, the PUT
        toks = np.arange(20_000, 20_600)
        assert c.put(toks, prefix_snapshot(toks))
        assert c.counters["shm_puts"] == 1 and c.counters["shm_put_fallback"] == 1
        assert_prefix_hit(c.get(toks), toks)


def test_namespace_metadata_waits_packed_and_comes_back_whole(plane):
    p = plane()
    meta = {"class": "Llama", "kv": {"bits": 8}, b"raw": [1, 2]}
    lease = p.grant(_slots(ns_meta=meta), 1 << 30)["lease"]
    assert isinstance(p._pending[lease]["ns_meta"], bytes)
    assert p.commit(lease)["ns_meta"] == meta


def test_read_leases_are_bounded_then_gets_are_frames(plane):
    """A peer that never releases its GETs' read leases (a client releases each
    with its next request) used to pile one up per GET for lease_s."""
    p = plane(max_read_leases=3)
    lease = p.grant(_slots(), 1 << 30)["lease"]
    entry = p.commit(lease)["chunks"][0]["tensors"][0]  # a tensor that lives in the arena

    def get() -> dict:
        reply = {"n": 4, "end": 4, "chunks": [{"start": 0, "length": 4, "tensors": [entry]}]}
        return p.frames_instead(reply) if p.leases_full() else p.describe_get(reply, [])

    for _ in range(3):
        assert "lease" in get()["shm"]
    assert p.leases_full()  # the handler then reads the GET's entries as for frames (as_stored)
    over = get()
    assert "lease" not in over["shm"] and over["chunks"][0]["tensors"][0] is entry
    assert p.stats()["frames_over_leases"] == 1 and p.stats()["leases"] == 3


def test_a_writer_late_past_its_lease_never_writes_over_another_entry(plane):
    """A client stopped mid-copy (SIGSTOP, swapped out) writes on when it
    resumes, whatever the deadline: its slot, freed when the lease ended, was
    another client's entry by then (red-team: 70-95 % of a 192 MiB entry
    overwritten). Now its range is lost: never allocated from again."""
    import mmap as _mmap

    clock = FakeClock(0.0)
    p = plane(clock=clock)
    seg, off, length = p.grant(_slots(), 1 << 30)["chunks"][0][0]
    with open(p.folder / shm.segment_name(p.run_id, seg), "r+b") as f:
        late = _mmap.mmap(f.fileno(), 0)  # mapped as the client maps it, at its grant
    clock.advance(101)  # past the lease: it ends uncommitted
    p.expire()
    assert seg not in p.arena.live() and p.stats()["lost_slots"] == 1  # nothing else lived there: gone
    other = p.grant(_slots(), 1 << 30)
    oseg, ooff, olen = other["chunks"][0][0]
    with open(p.folder / shm.segment_name(p.run_id, oseg), "r+b") as f:
        mine = _mmap.mmap(f.fileno(), 0)
    mine[ooff:ooff + olen] = b"\x11" * olen
    stored = p.commit(other["lease"])["chunks"][0]["tensors"][0]
    late[off:off + length] = b"\xaa" * length  # the late writer resumes
    assert bytes(stored.data) == b"\x11" * olen
    late.close()
    mine.close()


def test_a_lost_grant_hands_its_pages_back_and_its_segment_goes_with_its_last_entry(plane):
    """One expired grant of a whole segment next to a tiny live entry, in
    every segment (red-team: 33 segments retired whole for 2 KiB of live
    entries held 132 MiB of pages; then, with the lost ranges counted against
    the capacity, the plane refused every SLOTS while those 2 KiB lived). The
    lost ranges' pages are handed back at once and their segment drains:
    nothing more is allocated in it, it counts only its live bytes, and it
    goes with its last entry. Segments (a descriptor each) stay bounded."""
    import os as _os

    clock = FakeClock(0.0)
    p = plane(clock=clock)  # 64 MiB, 1 MiB segments
    seg_bytes = p.arena.segment_bytes
    live = []
    for _ in range(p.arena.capacity // seg_bytes):
        big = _slots()
        big["chunks"][0]["tensors"] = [codec.Tensor("k", "uint8", (seg_bytes - 64,), None)]
        p.grant(big, 1 << 30)  # never committed
        live.append(p.arena.alloc(64))  # a tiny live entry beside it
    held = sum(_os.fstat(fd).st_blocks * 512 for fd in p.arena._fds if fd >= 0)
    assert held >= len(live) * (seg_bytes - 64)  # every grant's pages reserved
    clock.advance(101)
    p.expire()
    s = p.stats()
    assert s["lost_slots"] == len(live) and s["lost_bytes"] == len(live) * (seg_bytes - 64)
    assert s["segments"] == s["draining_segments"] == len(live)  # each kept by its live entry
    held = sum(_os.fstat(fd).st_blocks * 512 for fd in p.arena._fds if fd >= 0)
    assert held <= len(live) * 2 * 4096  # the lost pages went back: a page or two per live entry remain
    draining = set(p.arena.live())
    fresh = p.arena.alloc(seg_bytes // 2)  # the capacity is there: 64 live entries of 64 bytes use it
    assert fresh is not None and fresh.slot.seg not in draining
    assert p.arena.alloc(64).slot.seg == fresh.slot.seg  # nothing more lands in a draining segment
    seg = live[0].slot.seg
    del live[0]
    assert seg not in p.arena.live() and p.stats()["lost_bytes"] == len(live) * (seg_bytes - 64)
    # Segments stay bounded whatever is lost: about twice what the capacity holds.
    more = []
    while True:
        big = _slots()
        big["chunks"][0]["tensors"] = [codec.Tensor("k", "uint8", (seg_bytes - 64,), None)]
        try:
            p.grant(big, 1 << 30)
        except Busy:
            break
        tiny = p.arena.alloc(64)
        if tiny is None:
            break
        more.append(tiny)
        clock.advance(101)
        p.expire()
        assert len(more) < 1000
    assert len(p.arena.live()) == 2 * (p.arena.capacity // seg_bytes) + 8  # the bound, reached


def test_lease_ids_name_no_other_lease_by_counting(plane):
    """Lease ids were 1, 2, 3, ...: a peer's stale or off-by-one id committed
    another's half-written grant, or released another's read lease. Ids are
    random now: none of the 200 around a peer's own is anyone's."""
    p = plane()
    a = p.grant(_slots(), 1 << 30)["lease"]
    b = p.grant(_slots(), 1 << 30)["lease"]
    for guess in range(b - 100, b + 101):
        if guess not in (a, b) and guess > 0:
            with pytest.raises(BadField):
                p.commit(guess)
    assert p.commit(a) is not None and p.stats()["commits"] == 1
