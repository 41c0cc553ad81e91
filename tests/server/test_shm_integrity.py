"""Shared memory is not a corruption channel (PROTOCOL.md §14, "Known weaknesses").

A process of the daemon's user can map the arena's segments and write into
any slot: a buggy engine that kept a view of the slot it stored into, or a
reader that writes into its own GET lease through a writable mapping it made
itself. Every later reader gets the stored bytes or a miss: shared-memory
readers check the digest fixed at COMMIT while they copy, a frames reply is
checked on a private copy (the entry then leaves RAM), and neither the SSD
tier nor the remote tier ever takes the altered bytes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import xxhash

from kvd.store.base import CHUNK, Entry, Tensor, as_stored
from redis_server import SKIP_REASON, RedisServer, redis_binary, session_key
from support import assert_prefix_hit, assert_wide_hit, make_entry, prefix_snapshot, wait_until, wide_snapshot

NS = "integrity"


class Slotted(np.ndarray):
    """Bytes with the digest a COMMIT fixed (what kvd.server.shm's SlotArray carries)."""

    digest: int | None = None

    def __array_finalize__(self, obj):
        self.digest = None


def committed(entry: Entry) -> tuple[Entry, list[np.ndarray]]:
    """`entry` with each tensor in a writable buffer whose digest is fixed now."""
    tensors, bufs = [], []
    for t in entry.tensors:
        buf = np.frombuffer(bytearray(bytes(memoryview(t.data).cast("B"))), np.uint8).view(Slotted)
        buf.digest = xxhash.xxh3_64_intdigest(buf)
        tensors.append(dataclasses.replace(t, data=buf))
        bufs.append(buf)
    return dataclasses.replace(entry, tensors=tuple(tensors)), bufs


def test_as_stored_copies_checks_and_refuses_what_changed():
    e, bufs = committed(make_entry(1, NS))
    whole = as_stored(e)
    assert whole is not None and all(isinstance(t.data, bytes) for t in whole.tensors)
    bufs[0][3] ^= 1  # written into after the commit
    assert as_stored(e) is None
    assert bytes(whole.tensors[0].data) != bytes(bufs[0])  # the earlier copy is not the live buffer
    plain = make_entry(2, NS)
    assert as_stored(plain) is plain  # no digest: nothing to check, nothing copied


def _segment_writable(client, desc):
    """What a hostile process of the same user does: its own writable mapping."""
    link = client._link()
    return link.view(desc, writable=True)


def test_bytes_written_into_a_slot_after_commit_are_never_served(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")  # RAM only: no whole copy on disk to fall back to
    toks = np.arange(512)
    with d.client(NS, strict=False, transport="shm") as writer, \
            d.client(NS, strict=False, transport="shm") as shm_reader, \
            d.client(NS, strict=False, transport="frames") as frames_reader:
        assert writer.put(toks, prefix_snapshot(toks)) and writer.counters["shm_puts"] == 1
        # where chunk 1's tensors live: a GET over shm names them
        link = writer._link()
        reply = writer._transport.request("GET", {**writer._seq(toks), "shm": link.field()}, 5)
        desc = next(t.data for t in reply["chunks"][1]["tensors"])
        assert desc.digest is not None  # the reply carries the digest fixed at COMMIT
        link.done(reply["shm"]["lease"])
        slot = _segment_writable(writer, desc)
        original = bytes(slot)
        slot[: 8] = bytes(x ^ 0xFF for x in original[:8])  # a scribble after COMMIT
        # a reader over shared memory: a miss (it checks while it copies), never the scribble
        hit = shm_reader.get(toks)
        assert hit is None or hit.n <= 256
        assert shm_reader.counters["shm_damaged"] == 1
        # a reader over frames: the daemon checks a private copy; chunk 0 is still served
        hit = frames_reader.get(toks)
        assert hit is not None and hit.n == 256
        assert_prefix_hit(hit, toks[:256])
        ram = frames_reader.stats()["tiers"]["ram"]
        assert ram["altered"] == 1  # the altered entry left the RAM tier
        # and it is gone for every reader, not served by any road
        assert shm_reader.get(toks).n == 256
        slot[: 8] = original[:8]  # even put back, it is not in RAM any more
        assert frames_reader.get(toks).n == 256



@pytest.mark.parametrize("wide", [False, True], ids=["small-blobs-via-the-heap", "blob-files-into-the-slot"])
def test_an_entry_read_back_from_the_ssd_tier_is_never_served_altered(daemon_factory, wide):
    """An entry read back from the SSD tier is checked (the blob's checksum) in
    private memory and reaches the arena with its digests fixed from those
    bytes: a small blob read into the heap and moved in by the shm GET; a blob
    file of a bounce buffer or more read piece by piece through a private
    buffer straight into its slot (blobfile.read_to_slots; where segments can
    be cut short, through the heap too). A write into its slot after that is a
    miss for every reader, as for an entry stored over shared memory. (Read
    straight into a slot and checked there, session 39 found, it carried no
    digest, and the scribble was served over both roads.)"""
    snapshot, same = (wide_snapshot, assert_wide_hit) if wide else (prefix_snapshot, assert_prefix_hit)
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(512)
    with d.client(NS, strict=False, transport="shm") as shm_reader, \
            d.client(NS, strict=False, transport="frames") as frames_reader:
        assert shm_reader.put(toks, snapshot(toks))
        assert wait_until(lambda: shm_reader.stats()["tiers"]["ssd"]["entries"] >= 2, 10)
        shm_reader.gc(ram_bytes=0)  # out of RAM: the next GET reads both chunks back from the SSD tier
        link = shm_reader._link()
        reply = shm_reader._transport.request("GET", {**shm_reader._seq(toks), "shm": link.field()}, 5)
        assert reply["n"] == 512
        desc = next(t.data for t in reply["chunks"][1]["tensors"])
        assert desc.digest is not None  # fixed from the private bytes the SSD tier read
        link.done(reply["shm"]["lease"])
        slot = _segment_writable(shm_reader, desc)
        slot[-8:] = bytes(x ^ 0xFF for x in bytes(slot[-8:]))  # a scribble into the slot it is in
        hit = shm_reader.get(toks)  # over shared memory: a miss past chunk 0, never the scribble
        assert hit is None or hit.n <= 256
        assert shm_reader.counters["shm_damaged"] == 1
        if hit is not None:
            same(hit, toks)
        hit = frames_reader.get(toks)  # over frames: checked on a private copy
        assert hit is not None and hit.n in (256, 512)
        same(hit, toks)  # chunk 1, if served, is its stored bytes (read again from disk)
        stats = frames_reader.stats()
        assert stats["tiers"]["ram"]["altered"] == 1
        straight = wide and stats["host"]["shared_memory"] == "memfd"
        assert (stats["tiers"]["ssd"]["read_to_slots"] >= 2) == straight


def test_a_get_over_frames_for_want_of_read_leases_never_serves_a_scribble(daemon_factory):
    """A peer that never releases its GETs' read leases fills them (READ_LEASES);
    a shared-memory GET is then answered over frames. Its entries are read as
    for any frames GET, checked on private copies: a slot written into after
    COMMIT is a miss there too. (It went out as the slot's bytes, unchecked.)"""
    from kvd.server.shm.reads import READ_LEASES

    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = np.arange(512)
    with d.client(NS, strict=False, transport="shm") as hog, d.client(NS, strict=False, transport="shm") as reader:
        assert hog.put(toks, prefix_snapshot(toks)) and hog.counters["shm_puts"] == 1
        link = hog._link()
        body = {**hog._seq(toks), "shm": link.field()}
        desc = None
        for _ in range(READ_LEASES):  # never released
            reply = hog._transport.request("GET", body, 5)
            desc = desc or next(t.data for t in reply["chunks"][1]["tensors"])
        assert "lease" in reply["shm"] and hog.stats()["shm"]["leases"] >= READ_LEASES
        slot = _segment_writable(hog, desc)
        slot[:8] = bytes(x ^ 0xFF for x in bytes(slot[:8]))  # a scribble after COMMIT
        hit = reader.get(toks)
        stats = reader.stats()
        assert stats["shm"]["frames_over_leases"] >= 1
        assert hit is not None and hit.n == 256  # chunk 1 altered: a miss from there, never the scribble
        assert_prefix_hit(hit, toks[:256])
        assert stats["tiers"]["ram"]["altered"] == 1



@pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)
def test_an_entry_read_from_the_remote_tier_is_never_served_altered(daemon_factory):
    """The same for the remote tier: a value is checked (its MAC) in private
    memory, and a GET over shared memory moves it into the arena with digests
    fixed from those bytes; a write into its slot after that is a miss."""
    server = RedisServer().start()
    try:
        toks = np.arange(512)
        a = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
        with a.client(NS, strict=False) as c:
            assert c.put(toks, prefix_snapshot(toks))
            assert wait_until(lambda: (lambda r: r["backlog"] == 0 and r["written"] >= 2)(c.stats()["tiers"]["remote"]), 30)
        b = daemon_factory("--ram-mb", "64", "--data-dir", "none", "--remote-url", server.url)  # no local copy
        with b.client(NS, strict=False, transport="shm") as shm_reader, \
                b.client(NS, strict=False, transport="frames") as frames_reader:
            link = shm_reader._link()
            reply = shm_reader._transport.request("GET", {**shm_reader._seq(toks), "shm": link.field()}, 10)
            assert reply["n"] == 512 and shm_reader.stats()["tiers"]["remote"]["hits"] >= 1
            k = len(reply["chunks"]) - 1  # the last chunk of this page (a remote GET may page)
            desc = next(t.data for t in reply["chunks"][k]["tensors"])
            assert desc.digest is not None  # fixed from the private bytes the remote tier checked
            link.done(reply["shm"]["lease"])
            slot = _segment_writable(shm_reader, desc)
            slot[: 8] = bytes(x ^ 0xFF for x in bytes(slot[:8]))
            hit = shm_reader.get(toks)  # over shared memory: a miss from chunk k on, never the scribble
            assert hit is None or hit.n <= 256 * k
            assert shm_reader.counters["shm_damaged"] == 1
            hit = frames_reader.get(toks)  # over frames: checked on a private copy
            assert hit is None or hit.n in (0, 256, 512)
            if hit is not None:
                assert_prefix_hit(hit, toks[: hit.n])
    finally:
        server.close()

def test_a_reader_cannot_write_through_its_own_lease(daemon_factory):
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(512)
    with d.client(NS, strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks))
        link = c._link()
        reply = c._transport.request("GET", {**c._seq(toks), "shm": link.field()}, 5)
        view = link.view(reply["chunks"][0]["tensors"][0].data)  # the client's own mapping: read-only
        with pytest.raises(TypeError):
            view[:1] = b"\x00"
        link.done(reply["shm"]["lease"])
        assert_prefix_hit(c.get(toks), toks)


@pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)
def test_the_remote_uploader_never_signs_altered_bytes():
    from kvd.store.remote.tier import RemoteTier

    server = RedisServer().start()
    try:
        tier = RemoteTier(server.url, auth=session_key(), timeout=5.0)
        good, _ = committed(make_entry(1, NS))
        bad, bufs = committed(make_entry(2, NS))
        bufs[1][0] ^= 0x80
        tier.offer(good)
        tier.offer(bad)
        assert tier.flush(10)
        assert tier.counters["written"] == 2 and tier.counters["altered"] == 1
        got = tier.fetch([good.id, bad.id])
        assert set(got) == {good.id}  # the altered entry was never written
        assert [bytes(t.data) for t in got[good.id].tensors] == [bytes(t.data) for t in good.tensors]
        tier.close()
    finally:
        server.close()


@pytest.mark.parametrize("pack_max_bytes", [0, 1 << 20])  # its own file, or a value in the pack
def test_the_ssd_writer_never_writes_altered_bytes(tmp_path, pack_max_bytes):
    from kvd.store.ssd import SsdStore

    ssd = SsdStore(tmp_path / "d", 64 << 20, min_free_bytes=0, background=False, pack_max_bytes=pack_max_bytes)
    try:
        good, _ = committed(make_entry(1, NS))
        bad, bufs = committed(make_entry(2, NS))
        bufs[0][5] ^= 0x01
        ssd.write_batch([good, bad])
        assert ssd.contains(good.id) and not ssd.contains(bad.id)
        assert ssd.drop_reasons.get("altered") == 1
        got = ssd.get(good.id)
        assert [bytes(memoryview(t.data).cast("B")) for t in got.tensors] == [bytes(t.data) for t in good.tensors]
    finally:
        ssd.close()
