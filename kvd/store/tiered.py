"""RAM over SSD as one `Store`, and `open_store`, the factory the daemon calls.

Theory of operation
-------------------
The RAM tier is the working set; the SSD tier is a victim cache below it,
fed by RAM's `on_evict`. Caching is inclusive: a blob stays on disk after an
SSD hit promotes its entry to RAM, so when RAM later evicts it again the
spill is "clean" -- a recency update, no write.

Policy table (data, not code paths):

    PUT      RAM, and the SSD write is queued at once (write-behind), so
             disk follows RAM continuously. Write-back: if the queue is full,
             the entry waits in `behind` (oldest first) and `tick()` queues it
             when the writer has made room. The dirty backlog -- the queue,
             `behind`, and the shared-memory grants that will be PUTs -- is
             bounded by bytes (`dirty_max_mb`, or with "auto" the RAM tier's
             budget, at least 256 MiB; plus the PUT admitted last) and by time: with the PUT
             asking it must be writable
             within `stop_write_s` (what a stop leaves the writer) at the pace
             a stop counts on: a third of the writer's recent pace
             (spill.Pace), or spill.FLOOR_PACE if faster or nothing was
             measured yet. Past either bound `refuse_put()` says why and the
             daemon answers write-back PUTs BUSY, so a stop has at most that
             much to write and a client storing faster than the disk writes
             is refused, not everyone stalled. Write-through: the
             queue takes it regardless (the daemon bounds the PUTs waiting on
             it) and `persist()` says which entries a PUT must wait for. An
             entry larger than the whole RAM budget goes to SSD directly.
    GET      RAM, else SSD (its queue, then disk). A GET spanning both is
             served entry by entry: each `get` returns a whole entry.
    PROMOTE  every SSD hit whose entry is at most `promote_max_fraction` of
             the RAM budget is put into RAM (so a re-read of a long prefix
             comes from RAM), which may evict -- and spill -- colder entries.
    LOOKUP   `contains` = RAM or SSD; a yes takes a lease (see ssd.py) so
             the GET that follows finds the entry even if RAM evicts it or
             the SSD tier needs room in between.
    EVICT    `evict(budget)` shrinks the SSD tier (the persistent one; RAM
             keeps its own budget): `tier="ram"` shrinks RAM instead, spilling
             every entry not yet on disk into the queue even when it is full
             (an explicit request to move entries down, never to lose them).
             An LRU eviction of an entry waiting in `behind` moves it into
             the queue at once, past the queue's entry bound (its bytes are
             in the bounded backlog already): the daemon's thread never
             waits for the disk. Any other entry not yet written (one a
             failed write dropped) is offered, waiting briefly when the
             queue is full, and dropped (counted) if the disk is that far
             behind.
    DROP     both tiers and the spill queue.
    CLOSE    (persist=True) every RAM entry not on disk -- the dirty
             backlog, bounded as PUT says -- is queued, oldest first (so
             each sequence is written from its first chunk on, and what a
             slow disk leaves is the newest chunks), and written out, for
             at most `timeout` seconds; then the
             index is closed. Entries already written (all the others) cost
             nothing, so a stop's work does not grow with the RAM tier. A
             clean stop within its time serves everything after a restart;
             past it, what was not written is logged (ssd.py, close).
"""

from __future__ import annotations

import operator
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Generator, Iterable, Sequence

import lmdb

from kvd.protocol.errors import BACKLOG_FULL
from kvd.store.base import CHUNK, Entry, PutOutcome, Store, finish
from kvd.store.ssd.index import IndexBusy
from kvd.store.ram import RamStore
from kvd.store.ssd import DEFAULT_MIN_FREE, SsdStore
from kvd.store.ssd.spill import FLOOR_PACE, PACE_SHARE


# dirty_max_mb = "auto": the RAM tier's budget, but never less than this.
AUTO_DIRTY_MIN = 256 << 20
# RAM entries a step of `stats_steps` looks up in the SSD index (~0.3 ms of
# the daemon's thread): a STATS of a RAM tier holding many is served in turns.
STATS_STEP = 256


class TieredStore(Store):
    """RAM over SSD; see the module docstring."""

    def __init__(
        self, ram: RamStore, ssd: SsdStore, *, write_through: bool = False, promote_max_fraction: float = 0.25,
        stop_write_s: float | None = None, dirty_max_bytes: int | None = None,
    ):
        self.ram = ram
        self.ssd = ssd
        self.write_through = write_through
        # Write-back: the backlog is also bounded by time, what a stop leaves
        # the writer (refuse_put; the daemon derives it from stop_timeout).
        self.stop_write_s = stop_write_s
        # ... and by bytes: `dirty_max_mb`, or None ("auto"): the RAM tier's budget.
        self.dirty_max_bytes = dirty_max_bytes
        self.promote_max_bytes = int(ram.budget_bytes * promote_max_fraction)
        self.counters = {"hits": 0, "misses": 0, "promotions": 0, "promotions_skipped": 0, "ssd_served_bytes": 0,
                         "backlog_refusals": 0}
        # Write-back entries in RAM waiting for room in the queue, oldest first.
        self.behind: OrderedDict[bytes, Entry] = OrderedDict()
        self.behind_bytes = 0
        self._moving_down = False  # an explicit evict(tier="ram") is running
        ram.on_evict = self._on_ram_evict

    def _on_ram_evict(self, entry: Entry) -> None:
        was_behind = self._unbehind(entry.id)
        self.ssd.spill(entry, force=self._moving_down or was_behind)

    def _unbehind(self, eid: bytes) -> bool:
        entry = self.behind.pop(eid, None)
        if entry is None:
            return False
        self.behind_bytes -= entry.nbytes
        return True

    def set_settled_callback(self, callback) -> None:
        """`callback(results, degraded)` after each SSD batch (see SsdStore.on_settled)."""
        self.ssd.on_settled = callback

    # -- lookups -------------------------------------------------------------
    def contains(self, eid: bytes) -> bool:
        # Lease first, then look (ssd.py explains why the order matters): a
        # yes is then safe from eviction until the GET that follows.
        if not self.ssd.lease(eid):
            return False  # being evicted from the SSD tier this instant
        return self.ram.contains(eid) or self.ssd.contains(eid)

    def held(self, eids: Sequence[bytes]) -> list[bool]:
        # A lease protects a yes only: a no leased would keep the row its PUT
        # writes next from eviction for `lease_s`. So look, then lease what was
        # found -- safe unless an SSD eviction began or ended in between, in
        # which case lease first and look again, as `contains` does.
        ssd = self.ssd
        since = ssd.eviction_events
        out = ssd.held(eids, also=self.ram.held(eids))  # in RAM, or on the SSD tier
        if ssd.lease_found(eids, out, since):
            return out
        leased = ssd.lease_many(eids)
        out = ssd.held(eids, also=self.ram.held(eids))
        return out if all(leased) else list(map(operator.and_, leased, out))

    def boundary_free(self, namespace: str) -> bool:
        return self.ram.boundary_free(namespace) and self.ssd.boundary_free(namespace)

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
        return self._put(entry, None)

    def put_many(self, entries: Sequence[Entry]) -> list[PutOutcome]:
        ram, queue = self.ram, self.ssd.queue
        ids = [entry.id for entry in entries]
        ask = [eid for eid in ids if not ram.contains(eid) and queue.get(eid) is None]
        rows = dict(zip(ask, self.ssd.has_rows(ask))) if len(ask) > 1 else {}
        # (An id not asked -- in RAM or queued a moment ago -- is asked alone
        # if it is neither by its turn: the writer may have committed it.)
        return [self._put(entry, rows.get(eid)) for entry, eid in zip(entries, ids)]

    def _put(self, entry: Entry, on_disk: bool | None) -> PutOutcome:
        """`put`; `on_disk`: whether the index has its row, if asked already."""
        if self.ssd.queue.get(entry.id) is not None or (
            not self.ram.contains(entry.id) and (self.ssd.has_row(entry.id) if on_disk is None else on_disk)
        ):
            # Held below RAM already: refresh it there rather than duplicate.
            return self.ssd.put(entry)
        outcome = self.ram.put(entry)
        if outcome is PutOutcome.TOO_BIG:
            # Into the queue at once, in either mode: write-through bounds what
            # waits on it, write-back's PUTs were admitted under refuse_put.
            return self.ssd.put(entry, force=True)
        if outcome is PutOutcome.STORED and self.ram.contains(entry.id):
            if self.write_through:
                self.ssd.queue.offer(entry, force=True)
            elif self.behind or not self.ssd.queue.offer(entry):
                self._unbehind(entry.id)
                self.behind[entry.id] = entry  # after those already waiting: disk order = arrival order
                self.behind_bytes += entry.nbytes
        return outcome

    def refuse_put(self, nbytes: int = 0, entries: int = 0, granted: int = 0, *, count: bool = True,
                   headroom: float = 1.0) -> str | None:
        """Write-back: why a PUT of `entries` chunks, `nbytes`, is refused
        now (the dirty backlog is at its bound in bytes, or with this PUT
        would pass it in time, see PUT above; the refusal is counted), or
        None. `granted`: shared-memory slot bytes granted and not yet
        committed (PUTs on their way). A PUT into an empty backlog is taken
        whatever its size. `count=False`: only asked (the refusal is counted
        where it is answered). `headroom` < 1: asked against that share of
        the bounds (is there room for more than a little?)."""
        if self.write_through:
            return None
        queue = self.ssd.queue
        held = queue.bytes + self.behind_bytes
        if not held + granted:
            return None
        dirty, n = held + granted + nbytes, len(queue) + len(self.behind) + entries
        cap = int(self.dirty_max() * headroom)
        # Bytes are memory: what is committed is held to the cap (plus the PUT
        # admitted last), the grants are the arena's. Time is the stop's:
        # everything on its way counts.
        if held >= cap:
            self.counters["backlog_refusals"] += count
            what = f"dirty_max_mb is {cap >> 20}" if self.dirty_max_bytes is not None else \
                f"dirty_max_mb is auto: the RAM tier's {cap >> 20} MiB"
            return f"{held >> 20} MiB stored are {BACKLOG_FULL} ({what}): the disk is behind"
        if self.stop_write_s is None:
            return None
        # By time too: a stop must write the backlog within stop_timeout, and
        # 256 MiB of 4 KiB chunks is 30 s of a writer at 2k chunks/s (a slow
        # disk, a quota churning, a loaded machine: slower still).
        seconds = self.stop_seconds(n, dirty)
        if seconds <= self.stop_write_s * headroom:
            return None
        self.counters["backlog_refusals"] += count
        return (f"with this PUT {n} chunks ({dirty >> 20} MiB) stored are {BACKLOG_FULL}: about {seconds:.1f} s of "
                f"writing at the pace a stop counts on, past the {self.stop_write_s:g} s a stop leaves for it: "
                f"the disk is behind")

    def dirty_max(self) -> int:
        """The backlog's bound in bytes: `dirty_max_mb`, or with "auto" the
        RAM tier's budget as the governor has it now, at least AUTO_DIRTY_MIN
        (a RAM tier of a few MiB, there to make entries spill, still lets the
        disk fall that far behind, as the former default did)."""
        if self.dirty_max_bytes is not None:
            return self.dirty_max_bytes
        return max(self.ram.budget_bytes, AUTO_DIRTY_MIN)

    def stop_seconds(self, entries: int, nbytes: int) -> float:
        """How long a stop would take to write `entries` of `nbytes`: at a
        third of the writer's recent pace, or at FLOOR_PACE if that is faster
        (or nothing was measured yet)."""
        rates = self.ssd.writer.pace.rates()
        per_entry, per_byte = FLOOR_PACE
        if rates is not None:
            per_entry = max(per_entry, rates[0] * PACE_SHARE)
            per_byte = max(per_byte, rates[1] * PACE_SHARE)
        return max(entries / per_entry, nbytes / per_byte)

    def persist(self, entries: Iterable[Entry], also: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        """Write-through: (ids still being written, ids that cannot be) among
        `entries` and, of `also`, those held (see Store.persist); the rest
        are on disk. Entries neither on disk nor queued (dropped by an earlier
        write, say) are queued again. Write-back, or no SSD tier: nothing to
        wait for."""
        if not self.write_through:
            return [], []
        pending, failed = [], []
        queue = self.ssd.queue
        # Held in RAM, or only in the queue (RAM let it go): waited for as if carried.
        held = [e for eid in also if (e := self.ram.peek(eid) or queue.get(eid)) is not None]
        for entry in [*entries, *held]:
            eid = entry.id
            # The queue before the index: the writer commits, then leaves the queue.
            if eid in queue:
                pending.append(eid)
            elif self.ssd.has_row(eid):
                continue
            elif queue.offer(entry, force=True):
                pending.append(eid)
            else:
                failed.append(eid)
        return pending, failed

    def queued(self, eid: bytes) -> bool:
        return eid in self.ssd.queue

    def tick(self) -> None:
        """Daemon thread: queue write-back entries as the writer makes room."""
        behind, queue = self.behind, self.ssd.queue
        while behind:
            eid, entry = next(iter(behind.items()))
            if self.ram.contains(eid) and not queue.offer(entry):
                return
            self._unbehind(eid)

    def dirty(self) -> tuple[int, int]:
        """(entries, bytes) acknowledged but not yet on disk: the queue and `behind`."""
        return len(self.ssd.queue) + len(self.behind), self.ssd.queue.bytes + self.behind_bytes

    # -- admin -----------------------------------------------------------------
    def evict(self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ssd") -> tuple[int, int]:
        if tier == "ram":
            self._moving_down = True
            try:
                return self.ram.evict(budget_bytes, dry_run=dry_run)
            finally:
                self._moving_down = False
        return self.ssd.evict(budget_bytes, dry_run=dry_run)

    def drop(
        self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> tuple[int, int]:
        """Both tiers. An entry held in both (most are: written behind) counts
        once; its bytes count in each tier (memory and disk freed)."""
        ids: list[bytes] = []
        _, rb = self.ram.drop(namespace=namespace, older_than=older_than, dry_run=dry_run, ids=ids)
        _, sb = self.ssd.drop(namespace=namespace, older_than=older_than, dry_run=dry_run, ids=ids)
        for eid in ids:
            self._unbehind(eid)
        return len(set(ids)), rb + sb

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every acknowledged entry is on disk (the queue and `behind`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.tick()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.ssd.flush(left):
                return False
            if not self.behind:
                return True

    def discard(self, eid: bytes) -> bool:
        return self.ram.discard(eid)

    def recheck(self, eids: list[bytes]) -> tuple[int, int]:
        return self.ssd.recheck(eids)

    def remove_orphans(self, *, dry_run: bool = False) -> tuple[int, int]:
        report = self.ssd.reconcile(dry_run=dry_run)
        files = sum(v for k, v in report.items() if k.endswith("s_removed"))
        nbytes = sum(v for k, v in report.items() if k.endswith("_bytes"))
        qn, qb = self.ssd.purge_quarantine(dry_run=dry_run)
        return files + qn, nbytes + qb

    def stats(self) -> dict[str, Any]:
        return finish(self.stats_steps())

    def stats_steps(self, *, namespaces: bool = True) -> Generator[None, None, dict[str, Any]]:
        """The stats in steps (Store.stats_steps). A namespace's entries and
        tokens are the SSD's plus those only RAM holds, which asks the index
        about every RAM entry (~1-3 us each: 160 ms of the daemon's thread at
        64,000 entries, in one piece before): STATS_STEP entries a step. The
        first step reads the RAM tier and the backlog (the daemon's thread's;
        RAM's ids are copied, at C speed); the others read only the
        index (and RAM's entries one by one, each a dict lookup, atomic
        under the GIL), each step in a read transaction
        of its own, so they may run with no lock held and never keep the
        map from growing. Only ids are held across steps: entries RAM lets
        go meanwhile are freed (a snapshot of the entries pinned them, twice
        the tier's memory while a STATS was in turns).

        One step (RAM holds at most STATS_STEP entries) reads the SSD's
        namespaces and which RAM entries it holds in one snapshot: an entry
        the writer commits meanwhile counts in exactly one tier. Over
        several steps the namespaces are read with the last: an entry the
        writer commits while a STATS is in turns may count twice, one the
        SSD tier evicts meanwhile not at all, and one RAM lets go meanwhile
        as RAM's no longer, until the next STATS."""
        r = self.ram.stats()
        dirty_entries, dirty_bytes = self.dirty()
        store = dict(
            self.counters, write_through=self.write_through, dirty_entries=dirty_entries, dirty_bytes=dirty_bytes,
            # The backlog's bounds now (refuse_put): bytes, and what a stop would take to write it.
            dirty_max_bytes=self.dirty_max(),
            dirty_stop_s=round(self.stop_seconds(dirty_entries, dirty_bytes), 3), stop_write_s=self.stop_write_s,
        )
        ids = self.ram.ids() if namespaces else []
        index, ssd_ns, peek = self.ssd.index, None, self.ram.peek
        ram_only: dict[str, list[int]] = {}  # namespace -> [entries, tokens] RAM holds and the SSD does not

        def only_in_ram(at: int, on_disk: Callable[[bytes], bool]) -> None:
            for eid in ids[at:at + STATS_STEP]:
                if not on_disk(eid) and (entry := peek(eid)) is not None:  # (None: evicted since)
                    n = ram_only.setdefault(entry.namespace, [0, 0])
                    n[0] += 1
                    n[1] += entry.length if entry.kind == CHUNK else 0

        for at in range(0, len(ids) or 1, STATS_STEP) if namespaces else ():
            if at:
                yield
            try:
                with index.reading() as txn:
                    if at + STATS_STEP >= len(ids):
                        ssd_ns = index.namespaces(txn)
                    only_in_ram(at, lambda eid: index.has(txn, eid))
            except (IndexBusy, lmdb.Error, ValueError, TypeError):
                # Resizing, or damaged (ssd.stats counts it and asks for a
                # heal): the SSD's namespaces as ssd.stats reads them, rows one by one.
                ssd_ns = None
                only_in_ram(at, self.ssd.with_rows(ids[at:at + STATS_STEP]).__contains__)
        s = self.ssd.stats()
        if ssd_ns is not None:
            s["namespaces"] = ssd_ns
        out: dict[str, dict[str, Any]] = {}
        for tier, st in (("ram", r), ("ssd", s)):
            for ns, v in st["namespaces"].items():
                d = out.setdefault(ns, {"entries": 0, "bytes": 0, "tokens": 0, "last_used": 0.0})
                d[f"{tier}_entries"], d[f"{tier}_bytes"] = v["entries"], v["bytes"]
                d[f"{tier}_tokens"] = v.get("tokens", 0)
                d["bytes"] += v["bytes"]  # memory plus disk: copies in both tiers count twice
                d["last_used"] = max(d["last_used"], v.get("last_used", 0.0))
        # Most entries are in both tiers (written behind, promoted, written
        # through): entries and tokens held are the SSD's plus those only RAM holds.
        for ns, d in out.items():
            entries, tokens = ram_only.get(ns, (0, 0))
            d["entries"] = d.get("ssd_entries", 0) + entries
            d["tokens"] = d.get("ssd_tokens", 0) + tokens
        return {"tiers": {**r["tiers"], **s["tiers"]}, "store": store,
                "namespaces": dict(sorted(out.items())) if namespaces else {}}

    def close(self, *, persist: bool = True, timeout: float | None = None) -> None:
        """Stop. With `persist`, every RAM entry not yet on disk is written
        first (oldest first, so the hottest end youngest in the SSD tier's
        LRU order), for at most `timeout` seconds (None: however long it
        takes); what is left then is logged and lost. See CLOSE above."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if persist:
            entries = list(self.ram.entries())
            on_disk = self.ssd.with_rows(e.id for e in entries)
            for entry in entries:
                if entry.id not in on_disk:
                    self.ssd.queue.offer(entry, force=True)  # already queued: a no-op
            self.behind.clear()
            self.behind_bytes = 0
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.ssd.close(timeout=left)


def open_store(
    ram_bytes: int,
    data_dir: str | os.PathLike | None = None,
    ssd_bytes: int = 0,
    write_through: bool = False,
    min_free_bytes: int = DEFAULT_MIN_FREE,
    remote_url: str | None = None,
    remote_options: dict[str, Any] | None = None,
    stop_write_s: float | None = None,
    dirty_max_bytes: int | None = None,
    **ssd_options: Any,
) -> Store:
    """The store the daemon serves from.

    `data_dir=None` gives a RAM-only `RamStore`. Otherwise a `TieredStore`
    over an `SsdStore` at `data_dir` holding at most `ssd_bytes` on disk
    (created 0700 if missing; locked for this process until `close()`).
    `ssd_options` go to `SsdStore` (queue_bytes, lease_s,
    retry_s, durable, ...). With `remote_url`, the local store is wrapped
    in `WithRemote` (kvd/store/remote/): a shared Redis/Valkey tier behind
    it, made with `remote_options` (ttl_s, timeout, part_bytes, ...).
    `stop_write_s`: write-back PUTs are refused while the dirty backlog
    would take a stop longer to write (TieredStore.stop_seconds; None: no
    bound by time); `dirty_max_bytes`: nor may it hold more bytes (None:
    the RAM tier's budget).

    Raises ValueError for a data dir without an SSD budget, DataDirBusy if
    another process uses the data dir, IncompatibleIndex if a different kvd
    format wrote it.
    """
    local: Store
    if data_dir is None:
        local = RamStore(ram_bytes, overhead=True)
    else:
        if ssd_bytes <= 0:
            raise ValueError("a data dir needs ssd_bytes > 0 (omit the data dir for RAM only)")
        ssd = SsdStore(data_dir, ssd_bytes, min_free_bytes=min_free_bytes, **ssd_options)
        local = TieredStore(RamStore(ram_bytes, overhead=True), ssd, write_through=write_through,
                            stop_write_s=stop_write_s, dirty_max_bytes=dirty_max_bytes)
    return with_remote(local, remote_url, remote_options)


def with_remote(local: Store, remote_url: str | None, remote_options: dict[str, Any] | None = None) -> Store:
    """`local` with the shared Redis/Valkey tier behind it (kvd/store/remote/),
    or `local` itself when `remote_url` is None. Closes `local` if that fails."""
    if remote_url is None:
        return local
    from kvd.store.remote.layered import WithRemote
    from kvd.store.remote.tier import RemoteTier  # imports redis: only when the tier is on

    try:
        return WithRemote(local, RemoteTier(remote_url, **(remote_options or {})))
    except BaseException:
        local.close()
        raise
