"""The SSD tier's write-back queue and the one thread that writes.

Theory of operation
-------------------
RAM eviction runs on the daemon thread and must not wait for a disk, so an
evicted entry is only *offered* to `SpillQueue`: a bounded (by bytes)
ordered map of entries waiting to be written. Until its index row is
committed, an entry stays in the queue and is served from there: `get` and
`contains` look in the queue first, so there is no moment at which an entry
is neither in the queue nor in the index.

When the queue is full, `offer` refuses at once (the daemon's thread never
waits for the disk); the caller counts the refusal as a drop, or keeps the
entry and offers it again later. `force=True` admits an entry beyond the bound: the
tier uses it for entries a LOOKUP has just reported, which must not vanish,
and for write-back entries RAM lets go before they were queued (their bytes
are bounded upstream: the daemon refuses PUTs while the backlog is full), so
the daemon's thread never waits here. `outside_bytes` counts queued entries
RAM no longer holds: the daemon's memory ceiling adds them.

`Writer` is the single thread that mutates the SSD tier: it writes batches
of queued entries, runs jobs submitted by other threads (quarantine, admin
evict/drop, reconcile) strictly between batches, and calls the tier's
`idle()` for periodic work. Because every mutation runs on this one thread,
the LMDB index has exactly one writer and the data dir never sees two
writers of the same blob.

Ordering rule: the writer *peeks* a batch (entries stay queued and
servable), writes and commits it, and only then calls `done()` to remove it.
After `done()` it calls the sink's `settled(batch)`: that is how a waiter (a
write-through PUT parked in the daemon) learns which entries are now durable
and which were dropped. Because `done()` comes first, an entry found in the
queue again when the news arrives was queued anew, and the news is not about
that copy.

`Pace` keeps what the writer's recent batches took (entries, bytes, seconds
of its time): how long the backlog would take to write at a third of that
pace (or at FLOOR_PACE, if faster) is what the write-back PUTs are admitted
against (TieredStore.refuse_put), so that a stop can write it within
`stop_timeout` however slow the disk or the writer has become.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

from kvd.store.base import CHUNK, Entry

log = logging.getLogger("kvd.store.spill")


class SpillQueue:
    """Entries waiting for the writer, bounded by `max_bytes` and
    `max_entries` (None: no count bound). Thread-safe."""

    def __init__(self, max_bytes: int, max_entries: int | None = None):
        self.max_bytes = int(max_bytes)
        self.max_entries = max_entries
        self.cond = threading.Condition()
        self._pending: OrderedDict[bytes, Entry] = OrderedDict()
        self._inflight: set[bytes] = set()
        # parent -> {eid: (length, key)} of queued tail chunks: `tails` is asked
        # on every LOOKUP that stops short, and the queue holds every write behind.
        self._tails: dict[bytes, dict[bytes, tuple[int, bytes]]] = {}
        self.bytes = 0
        # Queued entries the RAM tier no longer holds (spilled, or too big for
        # it): the queue is then their only copy in memory, and the daemon's
        # memory ceiling counts them (kvd.server.peers.memory_ceiling).
        self._outside: set[bytes] = set()
        self.outside_bytes = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, eid: bytes) -> bool:
        return eid in self._pending

    def held(self, eids) -> list[bool]:
        """`eid in self` for each of `eids`, at C speed."""
        return list(map(self._pending.__contains__, eids))

    def get(self, eid: bytes) -> Entry | None:
        return self._pending.get(eid)

    def offer(self, entry: Entry, *, force: bool = False, outside: bool = False) -> bool:
        """Queue `entry` for writing. True if queued (or already queued);
        False if the queue is full or closed.
        `outside`: the RAM tier does not (or no longer) hold it."""
        eid = entry.id
        with self.cond:
            if eid in self._pending:
                if outside:
                    self._mark_outside(eid, entry.nbytes)
                return True
            if not force:
                # An entry bigger than the whole queue is admitted alone, into
                # an empty queue, rather than never.
                def room() -> bool:
                    return self.closed or not self._pending or (
                        self.bytes + entry.nbytes <= self.max_bytes
                        and (self.max_entries is None or len(self._pending) < self.max_entries)
                    )

                if not room():
                    return False
            if self.closed:
                return False
            self._pending[eid] = entry
            self.bytes += entry.nbytes
            if outside:
                self._mark_outside(eid, entry.nbytes)
            if entry.tail and entry.kind == CHUNK:
                self._tails.setdefault(entry.parent, {})[eid] = (entry.length, entry.key)
            self.cond.notify_all()
            return True

    def _mark_outside(self, eid: bytes, nbytes: int) -> None:
        if eid not in self._outside:
            self._outside.add(eid)
            self.outside_bytes += nbytes

    def _forget(self, entry: Entry) -> None:
        """Bookkeeping for an entry leaving the queue (the caller pops it)."""
        self.bytes -= entry.nbytes
        if entry.id in self._outside:
            self._outside.discard(entry.id)
            self.outside_bytes -= entry.nbytes
        self._untail(entry)

    def _untail(self, entry: Entry) -> None:
        if entry.tail and entry.kind == CHUNK:
            tails = self._tails.get(entry.parent)
            if tails is not None:
                tails.pop(entry.id, None)
                if not tails:
                    del self._tails[entry.parent]

    def take_batch(self, max_entries: int, max_bytes: int) -> list[Entry]:
        """Up to `max_entries`/`max_bytes` oldest entries not yet in flight
        (at least one if any). They stay queued until `done`."""
        batch, nbytes = [], 0
        with self.cond:
            for eid, entry in self._pending.items():
                if eid in self._inflight:
                    continue
                if batch and (len(batch) >= max_entries or nbytes + entry.nbytes > max_bytes):
                    break
                batch.append(entry)
                nbytes += entry.nbytes
                self._inflight.add(eid)
        return batch

    def done(self, entries: Iterable[Entry]) -> None:
        """Forget `entries` (committed to the index, or dropped)."""
        with self.cond:
            for entry in entries:
                eid = entry.id
                self._inflight.discard(eid)
                if self._pending.pop(eid, None) is not None:
                    self._forget(entry)
            self.cond.notify_all()

    def pending_where(self, pred: Callable[[Entry], bool]) -> list[Entry]:
        """The queued entries `pred` picks (a snapshot; nothing is removed)."""
        with self.cond:
            return [e for e in self._pending.values() if pred(e)]

    def release(self, entries: Iterable[Entry]) -> None:
        """Put `entries` back as not taken (the writer failed them; it takes them again)."""
        with self.cond:
            for entry in entries:
                self._inflight.discard(entry.id)
            self.cond.notify_all()

    def unclaimed(self) -> bool:
        """Whether some queued entry is not yet taken by the writer."""
        return len(self._pending) > len(self._inflight)

    def remove_where(self, pred: Callable[[Entry], bool]) -> list[Entry]:
        """Remove queued entries (not in flight) for which `pred` holds."""
        with self.cond:
            gone = [e for eid, e in self._pending.items() if eid not in self._inflight and pred(e)]
            for e in gone:
                del self._pending[e.id]
                self._forget(e)
            self.cond.notify_all()
        return gone

    def tails(self, parent: bytes) -> list[tuple[int, bytes]]:
        with self.cond:
            return list(self._tails.get(parent, {}).values())

    def idle(self) -> bool:
        return not self._pending


class Sink(Protocol):
    """What the writer drives: the SSD tier."""

    def write_batch(self, batch: list[Entry]) -> None: ...

    def settled(self, batch: list[Entry]) -> None:
        """Called after `write_batch` and `done`: each entry is now durable or dropped."""
        ...

    def idle(self, busy: bool) -> bool:
        """Periodic work; return True if more background work is waiting."""
        ...


RETRIES = 3  # failures in a row before the writer gives a batch up

# The pace a stop counts on from any disk kvd runs on, measured or not:
# (chunks, bytes) a second. Any SSD writes faster in bytes (SATA ~500 MB/s,
# NVMe and a Mac's 1-3 GB/s; this machine ~1.2 GiB/s with fsync); 100
# chunks/s is a file and its fsyncs per chunk on a busy machine (the pack
# does ~700/s). A floor, and not the measured pace alone: a writer that
# wrote only small chunks measured next to nothing in bytes a second, and one
# measured while clients took the CPU measured less than a stop gets.
# Slower disks (a hard disk, a network share) set dirty_max_mb
# (docs/durability.md).
FLOOR_PACE = (100.0, float(256 << 20))
# What a stop counts on of the measured pace: a third (a busy disk slows).
PACE_SHARE = 1 / 3


class Pace:
    """The writer's recent pace: its last batches' entries, bytes and
    seconds, over about `window_s` of its busy time. Written by the writer,
    read by the daemon's thread (one tuple, swapped whole)."""

    def __init__(self, window_s: float = 2.0, min_s: float = 0.05, max_batches: int = 512):
        self.window_s, self.min_s, self.max_batches = window_s, min_s, max_batches
        self._batches: list[tuple[int, int, float]] = []
        self.totals: tuple[int, int, float] = (0, 0, 0.0)  # (entries, bytes, seconds) of those batches

    def observe(self, entries: int, nbytes: int, seconds: float) -> None:
        """Writer thread: a batch of `entries` (`nbytes`) took `seconds`."""
        batches = self._batches
        batches.append((entries, nbytes, max(0.0, seconds)))
        e, b, t = self.totals
        e, b, t = e + entries, b + nbytes, t + max(0.0, seconds)
        drop = 0
        while len(batches) - drop > 1 and (t - batches[drop][2] >= self.window_s or len(batches) - drop > self.max_batches):
            de, db, dt = batches[drop]
            e, b, t, drop = e - de, b - db, t - dt, drop + 1
        del batches[:drop]
        self.totals = (e, b, t)

    def rates(self) -> tuple[float, float] | None:
        """(entries, bytes) a second of the writer's recent work, or None if
        it has not worked long enough to tell."""
        e, b, t = self.totals
        if t < self.min_s or e <= 0:
            return None
        return e / t, b / t

    def seconds_for(self, entries: int, nbytes: int) -> float | None:
        """About how long `entries` of `nbytes` would take the writer at its
        recent pace (the larger of what their count and their bytes say), or
        None if it has not worked long enough to tell."""
        e, b, t = self.totals
        if t < self.min_s or e <= 0:
            return None
        return max(entries * t / e, nbytes * t / b if b > 0 else 0.0)


class Writer:
    """The SSD tier's only mutating thread. See the module docstring."""

    def __init__(
        self,
        queue: SpillQueue,
        sink: Sink,
        *,
        batch_entries: int = 64,
        batch_bytes: int = 256 << 20,
        tick: float = 0.1,
        name: str = "kvd-spill",
    ):
        self.queue = queue
        self.sink = sink
        self.batch_entries = batch_entries
        self.batch_bytes = batch_bytes
        self.tick = tick
        self._jobs: list[tuple[Callable[[], object], Future]] = []
        self._stop = False
        self._busy = False  # a batch or job is being worked on
        self._failures = 0  # batches failed in a row by an unexpected error
        self.abandoned = 0  # entries given up after RETRIES failures in a row (never written)
        self.pace = Pace()  # what its batches took lately (see Pace)
        # Seconds the writer has stepped aside so far for the serving thread
        # (kvd.store.courtesy: a request being served, rule 1, and its duty
        # cycle while reads come, rule 2; the daemon sets it): not what a
        # batch took, for a stop, which serves nobody, does neither.
        self.rested: Callable[[], float] = lambda: 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the writer thread between batches; its Future carries the result."""
        fut: Future = Future()
        with self.queue.cond:
            if not self.alive:
                # No thread (offline use, or after close): run inline.
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
                return fut
            self._jobs.append((fn, fut))
            self.queue.cond.notify_all()
        return fut

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and the writer is between batches."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.queue.cond:
            while not self.queue.idle() or self._jobs or self._busy:
                if not self.alive:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.queue.cond.wait(timeout=min(left, 0.5) if left is not None else 0.5)
        return True

    def stop(self, timeout: float | None = None) -> None:
        with self.queue.cond:
            self._stop = True
            self.queue.cond.notify_all()
        if self.alive:
            self._thread.join(timeout)

    def _write(self, batch: list[Entry]) -> None:
        """Write a batch. An unexpected error (no thread to start, a bug) puts
        it back to be taken again; after RETRIES in a row it is given up,
        counted (`abandoned`) and logged, and waiters hear it is not durable:
        an entry is never forgotten unsaid."""
        t0, rested = time.perf_counter(), self.rested()
        try:
            self.sink.write_batch(batch)
        except Exception as exc:
            self._failures += 1
            if self._failures < RETRIES:
                log.warning("spill writer: a batch of %d failed (%s); taking it again", len(batch), exc)
                self.queue.release(batch)
                time.sleep(self.tick)
                return
            self._failures = 0
            self.abandoned += len(batch)
            log.exception("spill writer: a batch of %d failed %d times; given up, not written (%d so far)",
                          len(batch), RETRIES, self.abandoned)
        else:
            self._failures = 0
        self.queue.done(batch)
        self.sink.settled(batch)
        took = time.perf_counter() - t0 - (self.rested() - rested)
        nbytes = sum(e.nbytes for e in batch)
        self.pace.observe(len(batch), nbytes, took)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("spill writer: batch of %d (%d bytes) in %.3f s", len(batch), nbytes, took)

    def _run(self) -> None:
        more = True  # background work (e.g. reconcile) may be waiting
        while True:
            with self.queue.cond:
                if not self._stop and not self._jobs and not self._pending_unclaimed():
                    self.queue.cond.wait(timeout=0 if more else self.tick)
                if self._stop:
                    return
                jobs, self._jobs = self._jobs, []
                self._busy = True
            try:
                for fn, fut in jobs:
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the submitter
                        fut.set_exception(exc)
                batch = self.queue.take_batch(self.batch_entries, self.batch_bytes)
                if batch:
                    self._write(batch)
                more = self.sink.idle(busy=bool(batch))
            except Exception:  # a bug; the thread must outlive it or the tier silently stops
                log.exception("spill writer: unexpected error (continuing)")
                time.sleep(self.tick)
            finally:
                with self.queue.cond:
                    self._busy = False
                    self.queue.cond.notify_all()

    def _pending_unclaimed(self) -> bool:
        return self.queue.unclaimed()
