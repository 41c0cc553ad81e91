"""Shared-memory data plane, the sans-I/O rules (PROTOCOL.md section 14).

Theory of operation:
control stays on kvd/1 over ZeroMQ, and bulk bytes move through segments the
daemon owns -- files mapped from a `shm/` folder of its private 0700 run
directory, which works the same on macOS and Linux and needs no 31-character
POSIX name. This module holds only the rules both sides must agree on, with no
I/O, so the daemon, the client and the vectors share one definition:

- Names. A segment is `kvd-<run>-<index>`: `run` is 8 hex digits drawn at each
  daemon start, so a starting daemon deletes every name of another run (the
  leftovers of a killed predecessor) and nothing else. The name fits macOS's
  31-character limit, should POSIX shm ever be used instead of files.
- Descriptors. A tensor's bytes are (segment, offset, length). Slots the
  daemon allocates start at multiples of ALIGN, but tensors read from an SSD
  blob sit wherever the blob put them, so a reader copies bytes and never
  assumes alignment; a descriptor pointing past its segment is a BadField,
  never a read out of bounds.
- Proof. Segments are offered only to a peer that echoes the nonce the daemon
  wrote 0600 in its run directory: a peer that cannot read that directory
  (another uid, another host) cannot prove it.
- Leases. A GET's descriptors and a PUT's slots are handed out under a lease
  with a deadline (injected clock). A slot being written is never served; a
  commit turns it readable only while its lease is live; an expired lease frees
  its unwritten slots and unpins its readable ones. The caller keeps a
  lease's slots alive until it ends (the daemon's leases hold the slot
  objects, so eviction drops the store's reference, never the memory).
  Ending the expired leases costs only what expired, however many are live
  (a heap of deadlines: every request runs it).
"""

from __future__ import annotations

import heapq
import hmac
import re
import secrets
from dataclasses import dataclass, field

from kvd.protocol.errors import BadField

ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's item size
_NAME = re.compile(r"^kvd-([0-9a-f]{8})-([0-9]{1,6})$")


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_name(run_id: str, index: int) -> str:
    if not re.fullmatch(r"[0-9a-f]{8}", run_id) or not 0 <= index < 1_000_000:
        raise BadField(f"bad segment id {run_id!r}/{index}")
    return f"kvd-{run_id}-{index}"


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """(run id, index) of a segment name, None for any other file name."""
    m = _NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def stale_segments(names: list[str], run_id: str) -> list[str]:
    """The names a daemon of `run_id` deletes at start: segments of other runs only."""
    return sorted(n for n in names if (p := parse_segment_name(n)) is not None and p[0] != run_id)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: made per tensor of a GET (see codec.Tensor)
class Descriptor:
    segment: int
    offset: int
    length: int
    # xxh3-64 of the bytes, fixed when they were committed (a GET reply's
    # tensors carry it as "xxh3"): a reader may check what it copies out.
    digest: int | None = None

    def to_wire(self) -> list[int]:
        return [self.segment, self.offset, self.length]

    @classmethod
    def from_wire(cls, value, segment_sizes: dict[int, int]) -> "Descriptor":
        """Validate a wire descriptor against the segments the peer knows."""
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise BadField("shm descriptor must be [segment, offset, length]")
        seg, off, length = value
        size = segment_sizes.get(seg)
        if size is None:
            raise BadField(f"unknown shm segment {seg}")
        if off < 0 or length < 0 or off + length > size:
            raise BadField(f"shm descriptor {value} outside segment {seg} of {size} bytes")
        return cls(seg, off, length)


def shm_tensor(name: str, dtype: str, shape: tuple[int, ...], where: Descriptor, digest: int | None) -> dict:
    """A tensor of a GET reply over shared memory, in its wire form: what
    `codec.encode` would make of `Tensor(name, dtype, shape, Descriptor(...,
    digest))`, made at once (a 1 GiB cache's GET has 2,048; `codec.encode` takes
    such a map as it is)."""
    wire = {"name": name, "dtype": dtype, "shape": list(shape), "shm": [where.segment, where.offset, where.length]}
    if digest is not None:
        wire["xxh3"] = digest
    return wire


def check_proof(expected: bytes, offered) -> bool:
    """True when a peer echoed the run directory's nonce (constant-time compare)."""
    return isinstance(offered, bytes) and len(expected) >= 16 and hmac.compare_digest(expected, offered)


WRITING, READABLE = "writing", "readable"


@dataclass
class Lease:
    lease_id: int
    deadline: float
    slots: dict[int, str] = field(default_factory=dict)  # slot id -> WRITING | READABLE


class LeaseTable:
    """Which slots are pinned by whom, until when. Pure state; the caller owns the clock.

    Deadlines sit in a min-heap beside the table, so `expire` pops only the
    leases past theirs: O(expired * log n), not a scan of every live lease
    (it runs before every request). A released lease leaves its heap entry
    behind (skipped when popped); once those outnumber the live leases the
    heap is rebuilt from the table, so it never holds more than about twice
    the live leases (amortized O(1) per release). Nothing moves a deadline."""

    def __init__(self, lease_seconds: float):
        self.lease_seconds = lease_seconds
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease id); may hold ended ones

    def _new_id(self) -> int:
        """A lease id no live lease has: random 63-bit, so a client's stale or
        mistyped id (or one a buggy peer counts up to) names no one else's
        lease; sequential ids had let a peer commit another's half-written
        grant, or release another's read lease."""
        while (lid := secrets.randbits(63) | 1) in self._leases:
            pass
        return lid

    def grant(self, now: float, *, write: list[int] = (), read: list[int] = ()) -> Lease:
        lease = Lease(self._new_id(), now + self.lease_seconds,
                      {**{s: WRITING for s in write}, **{s: READABLE for s in read}})
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        return lease

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def _live(self, lease_id: int, now: float) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or now >= lease.deadline:
            raise BadField(f"no live shm lease {lease_id}")
        return lease

    def commit(self, lease_id: int, slot: int, now: float) -> None:
        """A written slot becomes readable: only under a live lease that is writing it."""
        lease = self._live(lease_id, now)
        if lease.slots.get(slot) != WRITING:
            raise BadField(f"slot {slot} is not being written under lease {lease_id}")
        lease.slots[slot] = READABLE

    @staticmethod
    def _unwritten(lease: Lease) -> list[int]:
        return sorted(s for s, st in lease.slots.items() if st == WRITING)

    def release(self, lease_id: int) -> list[int]:
        """End a lease now; returns its slots never committed (the caller frees them)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return []
        if len(self._deadlines) > 2 * len(self._leases) + 64:  # mostly ended leases: rebuild
            self._deadlines = [(l.deadline, i) for i, l in self._leases.items()]
            heapq.heapify(self._deadlines)
        return self._unwritten(lease)

    def expire_leases(self, now: float) -> list[Lease]:
        """End every lease past its deadline and return them (oldest deadline
        first). Touches only those, and heap entries of leases already released."""
        ended: list[Lease] = []
        heap = self._deadlines
        while heap and now >= heap[0][0]:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                ended.append(lease)
        return ended

    def expire(self, now: float) -> list[int]:
        """End every lease past its deadline; returns the uncommitted slots to free."""
        return sorted(s for lease in self.expire_leases(now) for s in self._unwritten(lease))
