"""The shared-memory plane's sans-I/O rules (kvd/protocol/shm.py): names that
let a starting daemon sweep only a previous run's leftovers, descriptors that
can never point outside their segment, the run-dir nonce proof, and the lease
table's rules (a commit only while the lease lives, an expired lease frees
what it was writing). Injected clock only; the daemon's side (a leased slot
outlives eviction) is test_shm_daemon.py's."""

from __future__ import annotations

import pytest

from kvd.protocol import shm
from kvd.protocol.errors import BadField


def test_segment_names_fit_macos_and_parse_back():
    name = shm.segment_name("0123abcd", 999_999)
    assert len("/" + name) <= 31
    assert shm.parse_segment_name(name) == ("0123abcd", 999_999)
    for bad in ("kvd-0123ABCD-1", "kvd-0123abcd-", "kvd-0123abcd-1.tmp", "nonce", "kvd-123-1"):
        assert shm.parse_segment_name(bad) is None
    with pytest.raises(BadField):
        shm.segment_name("xyz", 0)
    with pytest.raises(BadField):
        shm.segment_name("0123abcd", -1)


def test_a_starting_daemon_sweeps_other_runs_only():
    names = ["kvd-aaaaaaaa-0", "kvd-aaaaaaaa-7", "kvd-bbbbbbbb-0", "nonce", "kvd-bbbbbbbb-x"]
    assert shm.stale_segments(names, "bbbbbbbb") == ["kvd-aaaaaaaa-0", "kvd-aaaaaaaa-7"]
    assert shm.stale_segments(names, "cccccccc") == ["kvd-aaaaaaaa-0", "kvd-aaaaaaaa-7", "kvd-bbbbbbbb-0"]


def test_descriptors_stay_inside_their_segment():
    sizes = {0: 4096, 3: 128}
    d = shm.Descriptor.from_wire([3, 64, 64], sizes)
    assert d == shm.Descriptor(3, 64, 64) and d.to_wire() == [3, 64, 64]
    assert shm.Descriptor.from_wire([0, 0, 4096], sizes).length == 4096
    assert shm.Descriptor.from_wire([0, 1, 8], sizes).offset == 1  # a tensor inside an SSD blob
    for bad in ([3, 64, 65], [1, 0, 1], [0, 4090, 8], [0, -64, 8], [0, 0, -1], [0, 0], "x",
                [0, 0, True], [0.0, 0, 1]):
        with pytest.raises(BadField):
            shm.Descriptor.from_wire(bad, sizes)


def test_align_up_suits_every_dtype():
    assert [shm.align_up(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    assert shm.ALIGN % 16 == 0


def test_proof_needs_the_exact_nonce():
    nonce = bytes(range(32))
    assert shm.check_proof(nonce, bytes(range(32)))
    assert not shm.check_proof(nonce, bytes(range(31)) + b"\0")
    assert not shm.check_proof(nonce, "not bytes")
    assert not shm.check_proof(b"short", b"short")  # a daemon never accepts a weak nonce


def test_a_commit_is_taken_once_while_live_and_expiry_frees_only_unwritten_slots():
    t = shm.LeaseTable(lease_seconds=10)
    lease = t.grant(now=100.0, write=[1, 2])
    t.commit(lease.lease_id, 1, now=105.0)
    with pytest.raises(BadField):  # committing twice, or a slot not being written
        t.commit(lease.lease_id, 1, now=105.0)
    with pytest.raises(BadField):
        t.commit(lease.lease_id, 3, now=105.0)
    assert t.expire(now=109.999) == [] and lease.lease_id in t  # not yet
    with pytest.raises(BadField):  # a commit after the deadline is refused
        t.commit(lease.lease_id, 2, now=110.0)
    assert t.expire(now=110.0) == [2]  # the half-written slot is freed, the committed one kept
    assert lease.lease_id not in t


def test_read_leases_end_at_release_or_deadline_and_free_nothing():
    t = shm.LeaseTable(lease_seconds=5)
    a = t.grant(now=0.0, read=[7])
    b = t.grant(now=1.0, read=[7])
    assert t.release(a.lease_id) == [] and a.lease_id not in t and b.lease_id in t
    assert t.expire(now=5.5) == [] and b.lease_id in t
    assert t.expire(now=6.0) == [] and b.lease_id not in t
    assert t.release(b.lease_id) == []  # releasing twice is harmless
