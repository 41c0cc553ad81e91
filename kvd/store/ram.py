"""The RAM tier: a byte-budgeted LRU map of entries.

Theory of operation
-------------------
Entries sit in an OrderedDict in recency order (oldest first). `put` adds at
the young end and then evicts from the old end until the tier is back within
`budget_bytes`; `get` moves an entry to the young end. Tensor bytes are kept
exactly as they arrived (for large tensors, the received ZeroMQ frame itself),
so a RAM hit is served without copying.

Eviction hands each evicted entry to `on_evict`, if set: that is the seam a
colder tier (SSD) uses to receive spills. The callback runs on the daemon's
thread and must not block for long (the SSD tier queues the write). The
`observer`, if set, hears of every entry leaving, with why: "lru" (over
budget), "quota", "pressure", "gc", "shutdown", or "drop" (see
kvd/server/evictions.py); it is told before `on_evict`, so a spill the SSD
tier then drops is recorded last.

Every entry is charged its tensor bytes plus what holding it costs the
process (`charge`): with `overhead=True` (the daemon's setting) a measured
constant per entry and per tensor (kvd.store.overhead), so a flood of tiny
entries fills the budget instead of the process. `bytes` and the per-
namespace bytes are these charges.

A tail index (parent key -> {tail length: key}) answers `tails()` without a
scan; it is kept in step with the map on every put, evict and drop.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterable, Iterator, Sequence

from kvd.store.base import CHUNK, Entry, PutOutcome, Store
from kvd.store.overhead import entry_overhead


class RamStore(Store):
    """LRU over `budget_bytes`; see the module docstring."""

    name = "ram"

    def __init__(
        self,
        budget_bytes: int,
        *,
        on_evict: Callable[[Entry], None] | None = None,
        clock: Callable[[], float] = time.time,
        overhead: bool = False,
    ):
        self.budget_bytes = int(budget_bytes)
        self.overhead = overhead
        self.on_evict = on_evict
        self.observer: Callable[[Entry, str], None] | None = None
        self.quotas: Any = None  # kvd.store.quota.Quotas: a group over quota evicts its own first
        self._clock = clock
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._used: dict[bytes, float] = {}
        # parent key -> {tail key: length}: sequences that part after the same
        # chunk may leave tails of equal length (another question of the same
        # size), and each must stay findable.
        self._tails: defaultdict[bytes, dict[bytes, int]] = defaultdict(dict)
        self.bytes = 0
        self.ns_entries: defaultdict[str, int] = defaultdict(int)
        self.ns_bytes: defaultdict[str, int] = defaultdict(int)
        self.ns_tokens: defaultdict[str, int] = defaultdict(int)  # summed chunk lengths
        self.ns_used: dict[str, float] = {}  # latest access, by namespace
        # Namespaces that ever had a boundary entry here (never shrinks: one
        # is a hybrid model's, whose next sequence leaves another).
        self.boundary_ns: set[str] = set()
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "stored", "duplicates", "too_big", "evictions", "evicted_bytes", "dropped", "served_bytes",
             "altered"), 0
        )

    def charge(self, entry: Entry) -> int:
        """Bytes `entry` counts against the budget (see the module docstring)."""
        return entry.nbytes + (entry_overhead(entry) if self.overhead else 0)

    # -- lookups ---------------------------------------------------------
    def get(self, eid: bytes) -> Entry | None:
        entry = self._entries.get(eid)
        if entry is None:
            self.counters["misses"] += 1
            return None
        self._entries.move_to_end(eid)
        self._used[eid] = self.ns_used[entry.namespace] = self._clock()
        self.counters["hits"] += 1
        self.counters["served_bytes"] += entry.nbytes
        return entry

    def contains(self, eid: bytes) -> bool:
        return eid in self._entries

    def peek(self, eid: bytes) -> Entry | None:
        """The entry, if held, as it is: not counted as a use."""
        return self._entries.get(eid)

    def held(self, eids: Sequence[bytes]) -> list[bool]:
        return list(map(self._entries.__contains__, eids))

    def boundary_free(self, namespace: str) -> bool:
        return namespace not in self.boundary_ns

    def tails(self, parent: bytes) -> Iterable[tuple[int, bytes]]:
        return sorted(((n, k) for k, n in self._tails.get(parent, {}).items()), reverse=True)

    # -- writes ----------------------------------------------------------
    def put(self, entry: Entry) -> PutOutcome:
        eid = entry.id
        if eid in self._entries:
            self._entries.move_to_end(eid)
            self._used[eid] = self._clock()
            self.counters["duplicates"] += 1
            return PutOutcome.DUPLICATE
        if self.charge(entry) > self.budget_bytes or (self.quotas is not None and not self.quotas.admit_ram(entry)):
            self.counters["too_big"] += 1
            return PutOutcome.TOO_BIG
        self._entries[eid] = entry
        self._used[eid] = self.ns_used[entry.namespace] = self._clock()
        if entry.tail and entry.kind == CHUNK:
            self._tails[entry.parent][entry.key] = entry.length
        self.bytes += self.charge(entry)
        self.ns_entries[entry.namespace] += 1
        self.ns_bytes[entry.namespace] += self.charge(entry)
        if entry.kind == CHUNK:
            self.ns_tokens[entry.namespace] += entry.length
        else:
            self.boundary_ns.add(entry.namespace)
        self.counters["stored"] += 1
        if self.quotas is not None:
            self.quotas.enforce_ram(self, entry)
        self._evict_to(self.budget_bytes)
        return PutOutcome.STORED

    def _remove(self, eid: bytes) -> Entry:
        entry = self._entries.pop(eid)
        del self._used[eid]
        if entry.kind == CHUNK:
            tails = self._tails.get(entry.parent)
            if tails and entry.key in tails:
                del tails[entry.key]
                if not tails:
                    del self._tails[entry.parent]
        self.bytes -= self.charge(entry)
        ns = entry.namespace
        self.ns_entries[ns] -= 1
        self.ns_bytes[ns] -= self.charge(entry)
        if entry.kind == CHUNK:
            self.ns_tokens[ns] -= entry.length
        if not self.ns_entries[ns]:
            del self.ns_entries[ns], self.ns_bytes[ns]
            self.ns_tokens.pop(ns, None)
            self.ns_used.pop(ns, None)
        return entry

    def discard(self, eid: bytes) -> bool:
        if eid not in self._entries:
            return False
        self._remove(eid)  # not spilled: its bytes are not what was stored
        self.counters["altered"] += 1
        return True

    def _evict_to(self, budget: int, why: str = "lru") -> tuple[int, int]:
        n = nbytes = 0
        while self.bytes > budget and self._entries:
            nbytes += self.evict_entry(next(iter(self._entries)), why)
            n += 1
        return n, nbytes

    def evict_entry(self, eid: bytes, why: str) -> int:
        """Evict one held entry (spilling it, via `on_evict`). Returns its bytes."""
        entry = self._remove(eid)
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += self.charge(entry)
        if self.observer is not None:
            self.observer(entry, why)
        if self.on_evict is not None:
            self.on_evict(entry)
        return self.charge(entry)

    def evict(
        self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ram", why: str = "gc"
    ) -> tuple[int, int]:
        if tier != "ram":
            return 0, 0
        if not dry_run:
            return self._evict_to(max(0, int(budget_bytes)), why)
        n = nbytes = 0
        remaining = self.bytes
        for entry in self._entries.values():
            if remaining <= budget_bytes:
                break
            remaining -= self.charge(entry)
            n += 1
            nbytes += self.charge(entry)
        return n, nbytes

    def drop(
        self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False,
        ids: list[bytes] | None = None,
    ) -> tuple[int, int]:
        """As `Store.drop`; the ids removed (or that would be) are appended to `ids` if given."""
        cutoff = None if older_than is None else self._clock() - older_than
        victims = [
            eid
            for eid, entry in self._entries.items()
            if (namespace is None or entry.namespace == namespace)
            and (cutoff is None or self._used[eid] < cutoff)
        ]
        nbytes = sum(self.charge(self._entries[eid]) for eid in victims)
        if ids is not None:
            ids.extend(victims)
        if not dry_run:
            for eid in victims:
                entry = self._remove(eid)
                if self.observer is not None:
                    self.observer(entry, "drop")
            self.counters["dropped"] += len(victims)
        return len(victims), nbytes

    # -- reporting -------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "tiers": {
                self.name: {
                    "entries": len(self._entries),
                    "bytes": self.bytes,
                    "budget_bytes": self.budget_bytes,
                    **self.counters,
                }
            },
            "namespaces": {
                ns: {
                    "entries": self.ns_entries[ns],
                    "bytes": self.ns_bytes[ns],
                    "tokens": self.ns_tokens[ns],
                    "last_used": self.ns_used.get(ns, 0.0),
                }
                for ns in sorted(self.ns_entries)
            },
        }

    def entries(self) -> Iterator[Entry]:
        """Every held entry, oldest first (do not put or get while iterating)."""
        return iter(self._entries.values())

    def ids(self) -> list[bytes]:
        """Every held entry's id, oldest first: a copy, made at C speed
        (ids only: a caller holding it keeps no entry alive)."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
