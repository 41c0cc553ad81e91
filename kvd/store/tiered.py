"""RAM over SSD as one `Store`, and `open_store`, the factory the daemon calls.

Theory of operation
-------------------
The RAM tier is the working set; the SSD tier is a victim cache below it,
fed by RAM's `on_evict`. Caching is inclusive: a blob stays on disk after an
SSD hit promotes its entry to RAM, so when RAM later evicts it again the
spill is "clean" -- a recency update, no write.

Policy table (data, not code paths):

    PUT      RAM; write-through also queues the SSD write. An entry larger
             than the whole RAM budget goes to SSD directly.
    GET      RAM, else SSD (its queue, then disk). A GET spanning both is
             served entry by entry: each `get` returns a whole entry.
    PROMOTE  every SSD hit whose entry is at most `promote_max_fraction` of
             the RAM budget is put into RAM (so a re-read of a long prefix
             comes from RAM), which may evict -- and spill -- colder entries.
    LOOKUP   `contains` = RAM or SSD; a yes takes a lease (see ssd.py) so
             the GET that follows finds the entry even if RAM evicts it or
             the SSD tier needs room in between.
    EVICT    `evict(budget)` shrinks the SSD tier (the persistent one; RAM
             keeps its own budget): `tier="ram"` shrinks RAM instead, spilling.
    DROP     both tiers and the spill queue.
    CLOSE    RAM is spilled (persist=True), the queue is written out, then
             the index is closed: a clean restart serves everything.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from kvd.store.base import CHUNK, Entry, PutOutcome, Store
from kvd.store.ram import RamStore
from kvd.store.ssd import DEFAULT_MIN_FREE, SsdStore


class TieredStore(Store):
    """RAM over SSD; see the module docstring."""

    def __init__(
        self, ram: RamStore, ssd: SsdStore, *, write_through: bool = False, promote_max_fraction: float = 0.25
    ):
        self.ram = ram
        self.ssd = ssd
        self.write_through = write_through
        self.promote_max_bytes = int(ram.budget_bytes * promote_max_fraction)
        self.counters = {"hits": 0, "misses": 0, "promotions": 0, "promotions_skipped": 0, "ssd_served_bytes": 0}
        ram.on_evict = self._on_ram_evict

    def _on_ram_evict(self, entry: Entry) -> None:
        self.ssd.spill(entry)

    # -- lookups -------------------------------------------------------------
    def contains(self, eid: bytes) -> bool:
        # Lease first, then look (ssd.py explains why the order matters): a
        # yes is then safe from eviction until the GET that follows.
        if not self.ssd.lease(eid):
            return False  # being evicted from the SSD tier this instant
        return self.ram.contains(eid) or self.ssd.contains(eid)

    def get(self, eid: bytes) -> Entry | None:
        entry = self.ram.get(eid)
        if entry is not None:
            self.counters["hits"] += 1
            return entry
        entry = self.ssd.get(eid)
        if entry is None:
            self.counters["misses"] += 1
            return None
        self.counters["hits"] += 1
        self.counters["ssd_served_bytes"] += entry.nbytes
        if entry.nbytes <= self.promote_max_bytes:
            if self.ram.put(entry) is PutOutcome.STORED:
                self.counters["promotions"] += 1
        else:
            self.counters["promotions_skipped"] += 1
        return entry

    def tails(self, parent: bytes) -> Iterable[tuple[int, bytes]]:
        # Keyed by tail key: two tails of one length (sequences that part after
        # the same chunk) must both be listed.
        found = {key: n for n, key in self.ssd.tails(parent)}
        found.update({key: n for n, key in self.ram.tails(parent)})
        return sorted(((n, key) for key, n in found.items()), reverse=True)

    # -- writes --------------------------------------------------------------
    def put(self, entry: Entry) -> PutOutcome:
        if self.ssd.queue.get(entry.id) is not None or (
            not self.ram.contains(entry.id) and self.ssd.has_row(entry.id)
        ):
            # Held below RAM already: refresh it there rather than duplicate.
            return self.ssd.put(entry)
        outcome = self.ram.put(entry)
        if outcome is PutOutcome.TOO_BIG:
            return self.ssd.put(entry)
        if outcome is PutOutcome.STORED and self.write_through:
            self.ssd.spill(entry)
        return outcome

    # -- admin -----------------------------------------------------------------
    def evict(self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ssd") -> tuple[int, int]:
        if tier == "ram":
            return self.ram.evict(budget_bytes, dry_run=dry_run)
        return self.ssd.evict(budget_bytes, dry_run=dry_run)

    def drop(
        self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> tuple[int, int]:
        """Both tiers; an entry held in both counts once per copy."""
        rn, rb = self.ram.drop(namespace=namespace, older_than=older_than, dry_run=dry_run)
        sn, sb = self.ssd.drop(namespace=namespace, older_than=older_than, dry_run=dry_run)
        return rn + sn, rb + sb

    def flush(self, timeout: float | None = None) -> bool:
        return self.ssd.flush(timeout)

    def recheck(self, eids: list[bytes]) -> tuple[int, int]:
        return self.ssd.recheck(eids)

    def remove_orphans(self, *, dry_run: bool = False) -> tuple[int, int]:
        report = self.ssd.reconcile(dry_run=dry_run)
        files = sum(v for k, v in report.items() if k.endswith("s_removed"))
        nbytes = sum(v for k, v in report.items() if k.endswith("_bytes"))
        qn, qb = self.ssd.purge_quarantine(dry_run=dry_run)
        return files + qn, nbytes + qb

    def stats(self) -> dict[str, Any]:
        r, s = self.ram.stats(), self.ssd.stats()
        namespaces: dict[str, dict[str, int]] = {}
        for tier, st in (("ram", r), ("ssd", s)):
            for ns, v in st["namespaces"].items():
                d = namespaces.setdefault(ns, {"entries": 0, "bytes": 0, "tokens": 0, "last_used": 0.0})
                d[f"{tier}_entries"], d[f"{tier}_bytes"] = v["entries"], v["bytes"]
                d[f"{tier}_tokens"] = v.get("tokens", 0)
                d["entries"] += v["entries"]  # copies in both tiers count twice
                d["bytes"] += v["bytes"]
                d["last_used"] = max(d["last_used"], v.get("last_used", 0.0))
        # A chunk can be in both tiers (promoted, or written through): tokens
        # covered are the SSD's plus those of chunks only RAM holds.
        chunks = [e for e in self.ram.entries() if e.kind == CHUNK]
        on_disk = self.ssd.with_rows(e.id for e in chunks)
        ram_only: dict[str, int] = {}
        for entry in chunks:
            if entry.id not in on_disk:
                ram_only[entry.namespace] = ram_only.get(entry.namespace, 0) + entry.length
        for ns, d in namespaces.items():
            d["tokens"] = d.get("ssd_tokens", 0) + ram_only.get(ns, 0)
        return {
            "tiers": {**r["tiers"], **s["tiers"]},
            "store": dict(self.counters, write_through=self.write_through),
            "namespaces": dict(sorted(namespaces.items())),
        }

    def close(self, *, persist: bool = True) -> None:
        """Stop. With `persist`, RAM is first written down to the SSD tier
        (oldest first, so the hottest entries end youngest in its LRU order;
        already-written entries cost nothing), so a restart is warm with the
        whole cache, not only what had spilled."""
        if persist:
            self.ram.evict(0, why="shutdown")
        self.ssd.close()


def open_store(
    ram_bytes: int,
    data_dir: str | os.PathLike | None = None,
    ssd_bytes: int = 0,
    write_through: bool = False,
    min_free_bytes: int = DEFAULT_MIN_FREE,
    **ssd_options: Any,
) -> Store:
    """The store the daemon serves from.

    `data_dir=None` gives a RAM-only `RamStore`. Otherwise a `TieredStore`
    over an `SsdStore` at `data_dir` holding at most `ssd_bytes` on disk
    (created 0700 if missing; locked for this process until `close()`).
    `ssd_options` go to `SsdStore` (queue_bytes, queue_wait_s, lease_s,
    retry_s, durable, ...).

    Raises ValueError for a data dir without an SSD budget, DataDirBusy if
    another process uses the data dir, IncompatibleIndex if a different kvd
    format wrote it.
    """
    if data_dir is None:
        return RamStore(ram_bytes, overhead=True)
    if ssd_bytes <= 0:
        raise ValueError("a data dir needs ssd_bytes > 0 (omit the data dir for RAM only)")
    ssd = SsdStore(data_dir, ssd_bytes, min_free_bytes=min_free_bytes, **ssd_options)
    return TieredStore(RamStore(ram_bytes, overhead=True), ssd, write_through=write_through)
