"""Leases: a LOOKUP's promise that the entries it reported stay for GET.

Theory of operation
-------------------
LOOKUP and the GET that follows are separate requests. `lease(eid)` (taken
by the tiered store *before* `contains` looks) protects the entry for
`lease_s` seconds: LRU eviction skips leased entries, and a leased entry
evicted from RAM enters the spill queue even when it is full. The writer
picks victims, then -- under `_mu`, the lock `lease` takes -- drops any
leased since and marks the rest `_evicting` until their rows are gone
(`_mark_evicting`, `_unmark_evicting`); `lease` refuses an entry being
evicted. So a lease and an eviction are ordered: either the lease came
first and the entry stays, or the eviction did and `contains` answers no.
The whole argument is in store.py ("Why `contains` does not lie").

Threads: leases are taken on the daemon thread, victims marked on the
writer; everything here runs under the store's `_mu`.
"""

from __future__ import annotations

import itertools
from typing import Sequence


class Leases:
    """The lease table and the set of entries being evicted; mixed into `SsdStore`."""

    def _init_leases(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._leases: dict[bytes, float] = {}
        self._lease_sweep_at = 4096
        self._evicting: set[bytes] = set()  # victims whose rows are being deleted
        # Evictions begun or ended so far (each counts twice): unchanged across a
        # LOOKUP's look, no row can have gone in between (TieredStore.held).
        self.eviction_events = 0

    def lease(self, eid: bytes) -> bool:
        """Protect `eid` from LRU eviction for `lease_s` seconds (a LOOKUP is
        about to report it). False if it is being evicted right now: then it
        must be reported absent."""
        now = self._clock()
        with self._mu:
            if eid in self._evicting:
                return False
            self._leases[eid] = now + self.lease_s
            self._sweep_leases(now)
        return True

    def _sweep_leases(self, now: float) -> None:
        """Under `_mu`: drop expired leases once there are twice as many as
        after the last sweep (amortized O(1) per lease taken)."""
        if len(self._leases) > self._lease_sweep_at:
            self._leases = {k: t for k, t in self._leases.items() if t > now}
            self._lease_sweep_at = max(4096, 2 * len(self._leases))

    def leased(self, eid: bytes) -> bool:
        t = self._leases.get(eid)
        return t is not None and t > self._clock()

    def lease_many(self, eids: Sequence[bytes]) -> list[bool]:
        """`lease` for each of `eids`, under one lock."""
        now = self._clock()
        until = now + self.lease_s
        with self._mu:
            evicting = self._evicting
            if evicting:
                out = [eid not in evicting for eid in eids]
                self._leases.update((eid, until) for eid, ok in zip(eids, out) if ok)
            else:  # the usual case, at C speed: a LOOKUP of 32k tokens leases 256 ids
                out = [True] * len(eids)
                self._leases.update(dict.fromkeys(eids, until))
            self._sweep_leases(now)
        return out

    def lease_found(self, eids: Sequence[bytes], found: list[bool], since: int) -> bool:
        """Lease those of `eids` that `found` says are held, if no eviction
        began or ended since `since` (`eviction_events` read before they were
        looked up): then none of them can have gone in between, and the
        victims of one still in progress are answered no (`found` is changed
        in place). False, with nothing leased, otherwise: look again, lease
        first (TieredStore.held)."""
        until = self._clock() + self.lease_s
        with self._mu:
            if self.eviction_events != since:
                return False
            if self._evicting:
                evicting = self._evicting
                found[:] = [ok and eid not in evicting for eid, ok in zip(eids, found)]
            self._leases.update(dict.fromkeys(itertools.compress(eids, found), until))
            self._sweep_leases(until - self.lease_s)
        return True

    def _mark_evicting(self, victims: list[bytes]) -> None:
        """Under `_mu`: `lease` refuses `victims` until `_unmark_evicting`;
        both count in `eviction_events` (see `lease_found`)."""
        self._evicting.update(victims)
        self.eviction_events += 1

    def _unmark_evicting(self, victims: list[bytes]) -> None:
        with self._mu:
            self._evicting.difference_update(victims)
            self.eviction_events += 1
