"""The store contract: what a tier holds and what it promises.

Theory of operation
-------------------
A tier maps an *entry id* to an `Entry`. There are two kinds of entry, both
keyed by the 32-byte chain key of a chunk (see `kvd.protocol.keys`):

* CHUNK: the tensors of one chunk of a token sequence, already cut along their
  token axis by the client, plus the client's opaque msgpack `meta`.
* BOUNDARY: state that is only valid exactly at the end of that chunk
  (recurrent/SSM state, a rotated sliding window), stored apart so that a chunk
  can exist without it and a later PUT can add it.

Tiers never look inside tensors: dtype, shape and bytes are carried as given.
The daemon is single-threaded over a store, so a store need not lock against
concurrent requests; a tier with background work (the SSD spill writer) locks
its own internals.

Rules every tier keeps:
1. `put` never replaces an existing entry (same key means same tokens and the
   same namespace, hence the same bytes); it refreshes its recency instead.
2. `get` and `contains` never return an entry of another namespace: keys are
   seeded by the namespace, and the entry records it for stats and GC.
3. Byte accounting counts tensor bytes plus meta, and the budget is enforced
   before `put` returns.
"""

from __future__ import annotations

import abc
import enum
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, Sequence

import xxhash

from kvd.protocol.codec import Tensor  # noqa: F401  (re-exported: entries hold wire tensors)

CHUNK = 0
BOUNDARY = 1


def entry_id(key: bytes, kind: int = CHUNK) -> bytes:
    """The 33-byte id of an entry: the chunk key, then one byte of kind."""
    return key + bytes((kind,))


@dataclass(slots=True)
class Entry:
    """A chunk (or the boundary state at a chunk's end) as a tier holds it."""

    namespace: str
    key: bytes  # 32-byte chain key of the chunk
    kind: int  # CHUNK or BOUNDARY
    parent: bytes  # chain key of the previous chunk (the root for the first)
    start: int  # token position where the chunk starts
    length: int  # tokens in the chunk (< chunk_tokens only for a tail chunk)
    tensors: tuple[Tensor, ...]
    meta: bytes = b""  # client msgpack, opaque to the daemon
    tail: bool = False  # a CHUNK shorter than its namespace's chunk size
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(t.nbytes for t in self.tensors) + len(self.meta)

    @property
    def id(self) -> bytes:
        return entry_id(self.key, self.kind)

    @property
    def end(self) -> int:
        return self.start + self.length


def as_stored(entry: Entry) -> Entry | None:
    """`entry` as its writer stored it, or None if that is gone.

    Tensors in shared-memory slots carry the xxh3-64 fixed at their COMMIT
    (`data.digest`, kvd.server.shm), and a process of the daemon's user can
    still write into such a slot. So every road by which those bytes leave
    RAM -- a frames reply, the SSD writer, the remote uploader -- takes them
    through here: each such tensor is copied out, and the copy is checked
    (one copy and one xxh3 pass: a scribble after the check cannot reach what
    leaves). An entry without such tensors is returned as it is, uncopied.
    """
    if not any(getattr(t.data, "digest", None) is not None for t in entry.tensors):
        return entry
    copies = []
    for t in entry.tensors:
        digest = getattr(t.data, "digest", None)
        if digest is not None:
            # The slot's arena copies: with pread where another process may
            # cut the segment short (None: it was), never a SIGBUS here.
            slot = getattr(t.data, "slot", None)
            data = slot.arena.copy_out(t.data) if slot is not None else bytes(memoryview(t.data).cast("B"))
            if data is None or xxhash.xxh3_64_intdigest(data) != digest:
                return None
            t = dataclasses.replace(t, data=data)
        copies.append(t)
    return dataclasses.replace(entry, tensors=tuple(copies))


def finish(steps: Generator[None, None, Any]) -> Any:
    """Run `steps` (a generator of steps, like `Store.stats_steps`) to the end: what they return."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class PutOutcome(enum.Enum):
    STORED = "stored"  # new entry kept
    DUPLICATE = "duplicate"  # already held; recency refreshed
    TOO_BIG = "too_big"  # larger than the tier's whole budget; not kept
    DROPPED = "dropped"  # not kept this time (spill queue full, tier degraded); counted


class Store(abc.ABC):
    """What the server needs from a tier (or a stack of tiers)."""

    @abc.abstractmethod
    def get(self, eid: bytes) -> Entry | None:
        """The entry, refreshing its recency; None if absent (counted as a miss)."""

    @abc.abstractmethod
    def contains(self, eid: bytes) -> bool:
        """Whether `get(eid)` would currently return an entry. No recency change."""

    def held(self, eids: Sequence[bytes]) -> list[bool]:
        """`contains` for each of `eids`, in one pass: a tier with an on-disk
        index answers them all from one read transaction (a LOOKUP of a 32k-token
        prompt asks 256 of them; one transaction each cost ~10 us)."""
        return [self.contains(eid) for eid in eids]

    def boundary_free(self, namespace: str) -> bool:
        """True only if this store certainly holds no boundary entry of
        `namespace`: a prefix match then asks about chunks alone (a plain
        attention model's namespace never has one; asking cost a LOOKUP of
        32k tokens 128 index descents). False if it may, or cannot tell."""
        return False

    @abc.abstractmethod
    def put(self, entry: Entry) -> PutOutcome:
        """Keep `entry`, evicting least-recently-used entries to stay in budget."""

    def put_many(self, entries: Sequence[Entry]) -> list[PutOutcome]:
        """`put` for each of `entries`, in order: a tier with an on-disk index
        asks it about them all in one read transaction."""
        return [self.put(entry) for entry in entries]

    @abc.abstractmethod
    def tails(self, parent: bytes) -> Iterable[tuple[int, bytes]]:
        """(length, key) of every held tail chunk (shorter than a full chunk)
        whose parent is `parent`."""

    def tails_for(self, parent: bytes, candidates: Iterable[tuple[int, bytes]]) -> Iterable[tuple[int, bytes]]:
        """`tails(parent)` for one query, whose possible tails are `candidates`
        ((length, key), lazily): a store whose tail lists can be huge (the
        shared remote tier) asks about those only. Others list them all."""
        return self.tails(parent)

    @abc.abstractmethod
    def evict(self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ram") -> tuple[int, int]:
        """Evict LRU entries of `tier` ("ram" or "ssd") until at most
        `budget_bytes` remain there. Returns (entries, bytes) evicted (or that
        would be, with dry_run); (0, 0) for a tier this store does not have."""

    @abc.abstractmethod
    def drop(
        self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> tuple[int, int]:
        """Remove every entry of `namespace` and/or last used more than
        `older_than` seconds ago. Returns (entries, bytes) removed."""

    def discard(self, eid: bytes) -> bool:
        """Forget the RAM tier's copy of `eid`, found altered (`as_stored`; the SSD tier's,
        written when it was still whole, stays). True if one was held."""
        return False

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and sizes: {"tiers": {name: {...}}, "namespaces": {ns: {...}}}."""

    def stats_steps(self, *, namespaces: bool = True) -> Generator[None, None, dict[str, Any]]:
        """`stats()` in steps, each a bounded piece of work (a generator: what
        it returns is the stats), for the daemon to serve in turns. The first
        step reads what the daemon's thread owns; a store may run the others
        with no lock held (see TieredStore). `namespaces=False`: the
        "namespaces" map may be left out. A store whose stats are cheap takes
        one step."""
        return self.stats()
        yield  # (a generator)

    def recheck(self, eids: list[bytes]) -> tuple[int, int]:
        """Re-verify the stored bytes of these entries now, quarantining any
        that fail. Returns (checked, failed). A tier without checksums has
        nothing to recheck."""
        return 0, 0

    def remove_orphans(self, *, dry_run: bool = False) -> tuple[int, int]:
        """Remove storage no entry accounts for (orphaned and quarantined blobs).
        Returns (files, bytes). A tier with nothing on disk has none."""
        return 0, 0

    def persist(self, entries: Iterable[Entry], also: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        """Write-through: (ids of `entries` still being written to disk, ids
        that cannot be); the others are on disk. `also`: ids of the same
        sequence the PUT did not carry (a client skips what a LOOKUP said is
        held), waited for alike if held but not on disk yet. A tier that is
        not write-through, or has no disk, has nothing to wait for."""
        return [], []

    def queued(self, eid: bytes) -> bool:
        """Whether `eid` is waiting to be written to disk."""
        return False

    def tick(self) -> None:
        """Periodic work on the daemon's thread (write-back: feed the writer)."""

    def close(self, *, timeout: float | None = None) -> None:
        """Release resources (flush a write-back queue, close files), taking
        at most about `timeout` seconds to flush when given."""
