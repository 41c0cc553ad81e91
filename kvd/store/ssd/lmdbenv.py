"""One LMDB environment with a reader gate: what the index and the pack share.

LMDB gives one writer and lock-free MVCC readers. Growing the map
(`set_mapsize`) needs no transaction open in this process, so `_grow` closes
a gate that new readers see (they raise IndexBusy and the caller misses
rather than waits), waits for the readers in flight, resizes, and reopens
it. `write(fn)` may run `fn` again after growing: `fn` must not touch state
outside its transaction.

The file under the map. LMDB keeps its data.mdb open and mapped: if the
file is removed (`rm -rf` of its folder) commits go on, synced, into an
inode nobody will ever open again; if it is cut short, the next read of a
page past its end is a SIGBUS. Neither is reported by LMDB. So the
environment remembers which file it opened (st_dev, st_ino) and the largest
size it has seen it at, and `file_fault()` -- one stat -- says whether the
path still names that file and whether it is as long as it was: LMDB never
shrinks data.mdb, so a shorter one was cut by someone else. (Its last page
number is no measure: the file may end before pages a transaction took and
gave back unwritten, which are free and never read; heal.py's check at open
reads the free list to tell those from pages cut away.) The SSD tier asks
before it acknowledges a batch and on its writer's tick (ssd.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb

from kvd.protocol.errors import KvdError

DEFAULT_MAP_SIZE = 1 << 30  # virtual; data.mdb grows only as pages are used
DATA_FILE = "data.mdb"
T = TypeVar("T")


class IndexBusy(KvdError):
    """The LMDB map is being resized; the caller should treat its lookup as a miss."""


class Env:
    """The LMDB environment in the directory `path`, synced on every commit."""

    def __init__(self, path: str | Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE, max_dbs: int = 8):
        self.path = Path(path)
        self.readonly = readonly
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=max_dbs,
            subdir=True,
            readonly=readonly,
            create=not readonly,
            lock=True,
            sync=True,
            metasync=True,
            readahead=False,  # random reads; readahead only pollutes the page cache
            mode=0o600,
        )
        try:
            if not readonly:
                self.env.reader_check()  # clear reader slots left by a killed process
            st = os.stat(self.path / DATA_FILE)
            self._file, self._size = _identity(st), st.st_size  # the largest size seen
        except BaseException:
            self.env.close()
            raise
        self._stat_lock = threading.Lock()  # file_fault's stat and compare, one thread at a time
        self._gate = threading.Condition()
        self._readers = 0
        self._closed_map_size: int | None = None  # set once closed (map_size)
        self._resizing = False

    def close(self) -> None:
        """Close once the readers inside are out (at most 1 s: each holds one
        short transaction); later readers miss (IndexBusy) rather than meet a
        closed environment (a /metrics scrape reads the index with no lock
        held, and may during a stop)."""
        self.retire(timeout=1.0)

    def file_fault(self) -> str | None:
        """Why the data.mdb at this environment's path is no longer the file
        it maps (removed, replaced) or is shorter than it was (cut short: a
        read past its end would be a SIGBUS); None while all is well. One
        stat, under a lock: a stat taken before the file grew, compared
        after another thread had seen it grown, would say "cut short" of a
        file nobody cut (the writer's tick beside a batch written on another
        thread)."""
        with self._stat_lock:
            try:
                st = os.stat(self.path / DATA_FILE)
            except (FileNotFoundError, NotADirectoryError):
                return "was removed"
            except OSError:
                return None  # the disk's own trouble: the writes that meet it say so
            if _identity(st) != self._file:
                return "was replaced by another file"
            if st.st_size < self._size:
                return f"was cut short ({st.st_size} bytes, {self._size} before)"
            self._size = st.st_size
            return None

    def retire(self, timeout: float = 10.0) -> None:
        """Close, once the readers inside are out; new readers miss (IndexBusy)."""
        with self._gate:
            self._resizing = True
            self._gate.wait_for(lambda: self._readers == 0, timeout=timeout)
        if self._closed_map_size is None:
            with contextlib.suppress(lmdb.Error):
                self._closed_map_size = self.env.info()["map_size"]
            self._closed_map_size = self._closed_map_size or 0
        self.env.close()

    @contextmanager
    def reading(self, *, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A read transaction. Raises IndexBusy (never blocks) while the map
        grows. `buffers=True`: values are views into the map, valid inside it."""
        with self._gate:
            if self._resizing:
                raise IndexBusy(f"the LMDB map of {self.path} is being resized")
            self._readers += 1
        try:
            try:
                txn = self.env.begin(buffers=buffers)
            except lmdb.MapResizedError:
                # Another process (the daemon) grew the map since we opened it.
                self.env.set_mapsize(0)
                txn = self.env.begin(buffers=buffers)
            with txn:
                yield txn
        finally:
            with self._gate:
                self._readers -= 1
                self._gate.notify_all()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn(txn)` in a write transaction and commit; grow the map and
        re-run on MapFullError. Returns what `fn` returned."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow()

    def prefetch(self, db, keys: Sequence[bytes], pool: Executor, per_task: int = 8) -> list[Future]:
        """Bring in, several at a time, the pages that writing `keys` into
        `db` will touch: a lookup walks down to the leaf where a missing key
        would go. A write transaction faults its pages in one at a time, so
        when the B-tree has outgrown the page cache every random insert waits
        for its own disk read; these reads wait together (`pool`'s threads,
        LMDB lookups release the GIL). Wait on the futures returned before
        writing. Only a hint: nothing is changed, and a failure is ignored
        (the write then reads the pages itself)."""

        def walk(part: Sequence[bytes]) -> None:
            try:
                with self.reading(buffers=True) as txn:
                    for key in part:
                        txn.get(key, db=db)
            except (IndexBusy, lmdb.Error):
                pass

        return [pool.submit(walk, keys[i : i + per_task]) for i in range(0, len(keys), per_task)]

    def _grow(self) -> None:
        with self._gate:
            self._resizing = True
            try:
                if not self._gate.wait_for(lambda: self._readers == 0, timeout=10.0):
                    raise RuntimeError(f"resizing {self.path}: readers did not finish within 10 s")
                new = self.env.info()["map_size"] * 2
                self.env.set_mapsize(new)
            finally:
                self._resizing = False

    @property
    def map_size(self) -> int:
        if self._closed_map_size is not None:  # closed: what it was
            return self._closed_map_size
        return self.env.info()["map_size"]


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
