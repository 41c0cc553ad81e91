"""Recency: moving used rows forward in the LRU order, cheaply.

Theory of operation
-------------------
A disk hit records (eid, time) in memory (`_touched`, under `_mu`), so the
daemon thread never waits for an LMDB write; the writer moves them in the
LRU order in the next batch's index commit (they "ride" in it, `_riding`:
one synced commit for both), on their own every `touch_flush_s` when no
batch carried them (upkeep.py), and before choosing victims if one of them
was read (`record_hits_on`). A use of a row among the tier's youngest (its
last use within the newest `YOUNG_SHARE` of the span from the oldest row's
to now) is not recorded at all (`_hit`): each move rewrites two random
index pages, and rows that far from eviction need none.

Threads: `_hit` runs on the daemon thread; everything else on the writer.
"""

from __future__ import annotations

import lmdb

from kvd.store.ssd.index import IndexBusy, Row

YOUNG_SHARE = 0.25  # a use of a row this young (a share of the tier's age) does not move it (`_hit`)


class Recency:
    """Hits waiting to move their rows in the LRU order; mixed into `SsdStore`."""

    def _init_recency(self, touch_flush_s: float) -> None:
        self.touch_flush_s = touch_flush_s
        self._touched: dict[bytes, float] = {}  # hits recorded, not yet taken by the writer
        self._riding: dict[bytes, float] = {}  # writer: hits taken to ride in the batch's index commit
        self._next_touch_flush = 0.0
        self.recency_floor: float | None = None  # the oldest row's last use, as the writer last saw it (`_hit`)

    def _hit(self, eid: bytes, row: Row | None) -> None:
        """A use of `eid` (a disk hit, a clean spill, a duplicate PUT; `row`
        its row, None if it has none yet): remembered for the writer to move
        in the recency order -- unless the row is among the tier's youngest
        already, its last use within the newest `YOUNG_SHARE` of the span
        from the oldest row's to now (counted `touches_skipped`). Recency is
        then exact to that share of the tier's age, and the writer is spared
        rewriting rows that are nowhere near eviction: under 8 clients'
        mixed load at 1 M rows, moving every hit's row took 52 s of the
        writer's 68 (two random index pages each), and its pace is what
        PUTs are admitted at. Rows of a group with an SSD quota are always
        moved: the group evicts its own oldest, and the tier's age says
        nothing of the group's."""
        now = self._clock()
        floor = self.recency_floor
        if (row is not None and floor is not None and row.atime >= now - (now - floor) * YOUNG_SHARE
                and not self._quota_on(row.ns)):
            self._count("touches_skipped")
            return
        with self._mu:
            self._touched[eid] = now

    def _quota_on(self, ns: str) -> bool:
        """Whether namespace `ns` is in a group with an SSD quota."""
        if self.quotas is None:
            return False
        rule = self.quotas.rule_for(ns)
        return rule is not None and rule.ssd_bytes is not None

    def _note_recency_floor(self) -> None:
        """Writer thread: the oldest row's last use, for `_hit`."""
        try:
            with self.index.reading() as txn:
                self.recency_floor = self.index.oldest_atime(txn)
        except (IndexBusy, lmdb.Error):
            self.recency_floor = None  # every hit recorded meanwhile

    def record_hits_on(self, victims: list[bytes]) -> bool:
        """Writer thread: True if one of `victims` was read since its row last
        moved -- then every pending hit is recorded now (a commit of its own)
        and the victims must be chosen again: the hit moves that row (and
        others read) out of the way. Only then: hits move rows forward, never
        back, so victims none was read on stay victims, and the hits ride in
        the batch's commit instead (`write_batch`)."""
        riding, touched = self._riding, self._touched
        if (riding or touched) and any(eid in riding or eid in touched for eid in victims):
            self._flush_touches()
            return True
        return False

    def _take_touches(self) -> dict[bytes, float]:
        with self._mu:
            touched, self._touched = self._touched, {}
        return touched

    def _untake_touches(self, touched: dict[bytes, float]) -> None:
        """Hits taken for a commit that did not happen: recorded again."""
        with self._mu:
            keep_latest(self._touched, touched)

    def _flush_touches(self) -> None:
        """Record the hits taken (riding) and recorded since, in a commit of their own."""
        touched, riding, self._riding = self._take_touches(), self._riding, {}
        keep_latest(touched, riding)
        if touched:
            self.index.write(lambda txn: self.index.touch_many(txn, touched))


def keep_latest(into: dict[bytes, float], hits: dict[bytes, float]) -> None:
    """Add `hits` (eid -> time) to `into`, keeping each eid's latest time."""
    for eid, t in hits.items():
        if t > into.get(eid, 0.0):
            into[eid] = t
