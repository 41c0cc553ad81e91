"""Upkeep: the writer's work between batches, and the chain of background steps.

Theory of operation
-------------------
The writer (spill.py) calls `idle` whenever it has no batch in hand, and
between batches while work waits here. One call does a little of each:
heal the index if damage was found (repair.py); every FILE_CHECK_S, look
whether the index's and the pack's files are still the ones mapped (a
file cut short is a SIGBUS at the next read past its end: replace it
before a reader gets there); note the oldest row's last use and flush the
hits recorded (recency.py); hide rows found undecodable; then one step of
the chain.

The chain. Long jobs run in small steps, interleaved with spills, one
after another: an index rebuild from the blobs (heal.rebuild_steps: until
it is done, blobs without rows are entries not yet indexed, not orphans),
then one walk over every page of the index (heal.walk_steps: the
namespaces with boundary entries, and any damage found early), then
reconcile (reconcile.py: temp files, blobs without rows, rows without
blobs). Each is a generator in its own attribute (`STEPS`), None when not
pending; `_pump` runs one step of one, and when the last one ends the tier
is `reconciled`. A heal starts the chain again; replacing the pack queues
a reconcile.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import lmdb

from kvd.store.ssd import heal
from kvd.store.ssd.reconcile import reconcile_steps

FILE_CHECK_S = 0.1  # how often the writer looks at the index's and the pack's files (Env.file_fault)
STEPS = ("_rebuild", "_walk", "_reconcile")  # the chain, in the order its steps run


class Upkeep:
    """The writer's idle tick and the chain of background steps; mixed into `SsdStore`."""

    def _init_upkeep(self, reconcile: bool) -> None:
        self._next_file_check = 0.0
        self.reconciled = threading.Event()
        self._rebuild: Iterator[None] | None = heal.rebuild_steps(self, self.heal) if self.heal else None
        self._walk: Iterator[None] | None = heal.walk_steps(self) if reconcile else None
        self._reconcile: Iterator[None] | None = self._reconcile_steps({}) if reconcile else None
        if not reconcile and self._rebuild is None:
            self.reconciled.set()

    def idle(self, busy: bool) -> bool:
        """Writer-thread periodic work. True if more is waiting right now."""
        if self._heal_wanted is not None and self._rebuild is None:
            self._heal_now()
        if time.monotonic() >= self._next_file_check:
            # Cut short, a file LMDB maps is a SIGBUS at the next read of a
            # page past its end: replace it before a reader gets there (a
            # mitigation only: a read may come first).
            self._next_file_check = time.monotonic() + FILE_CHECK_S
            if self._file_faults() is not None:
                return True
        now = self._clock()
        self._note_recency_floor()
        try:
            if now >= self._next_touch_flush:
                self._next_touch_flush = now + self.touch_flush_s
                self._flush_touches()
        except lmdb.Error as exc:
            if not heal.is_damage(exc):
                # The disk refuses writes (read-only, full): those hits' recency
                # is lost, nothing else. Degraded, said once; the tier keeps serving.
                self._degrade(f"recording hits failed: {exc}")
                return False
            self.want_heal(f"recording hits failed: {exc}")
            return True
        if self.index.damaged:
            self._repair_damaged()
        for name in STEPS:
            if getattr(self, name) is not None:
                more = self._pump(name)
                # One step ended: the next of the chain waits, ask again at once.
                return (more or name != STEPS[-1]) and not busy
        return False

    def _pump(self, name: str) -> bool:
        """Run one step of the chain's generator in attribute `name` (one of
        `STEPS`). True if it has more; when it is done it is cleared, and once
        none of the chain is left, the tier is `reconciled`."""
        try:
            next(getattr(self, name))
            return True
        except StopIteration:
            setattr(self, name, None)
            if all(getattr(self, n) is None for n in STEPS):
                self.reconciled.set()
            return False

    def _finish_rebuild(self) -> None:
        """Run what is left of an index rebuild now (writer thread, or none running)."""
        while self._rebuild is not None and self._pump("_rebuild"):
            pass

    def _reconcile_steps(
        self, report: dict[str, int], dry_run: bool = False, progress: Callable[[str, int, int], None] | None = None
    ) -> Iterator[None]:
        return reconcile_steps(self, report, dry_run, progress)
