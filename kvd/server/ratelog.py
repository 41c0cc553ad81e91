"""Log lines for repeated events, one per episode instead of one per event.

Theory of operation
-------------------
A client that sends 613 malformed messages used to produce 613 warning
lines; the operator needs one line saying it started and one saying how
many followed. `RateLimitedLog` keys events by a short string (e.g.
"rejected:BAD_FIELD"). Per key:

    first event          logged at once, as given
    more within `every`  counted, not logged (the last one's text is kept)
    `flush()`            for every key whose window has closed with events
                         counted: one line "... (N more like this in Xs;
                         last: <text>)", then the window restarts
    a quiet window       the key is forgotten: its next event logs at once

The daemon calls `flush()` from its housekeeping tick and `flush(force=True)`
when it stops, so a count is never lost. Counting costs a dict lookup;
nothing is formatted for a suppressed event except its message string,
which the caller already built. The clock is injectable so tests drive the
windows without sleeping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable


def now_and_then(n: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th, ... of a repeated failure counted `n`:
    a few lines, never a flood, without a window to flush (for failures
    with no key of their own, counted where they happen)."""
    return n & (n - 1) == 0


@dataclass(slots=True)
class _Episode:
    opened: float
    suppressed: int = 0
    last: str = ""


class RateLimitedLog:
    """At most one line per key per `every` seconds, plus a count of the rest."""

    def __init__(self, logger: logging.Logger, every: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.every = every
        self._clock = clock
        self._episodes: dict[str, _Episode] = {}
        self.suppressed_total = 0

    def log(self, level: int, key: str, msg: str, *args) -> None:
        """Log `msg % args` now, or count it if `key` logged within `every`."""
        now = self._clock()
        ep = self._episodes.get(key)
        if ep is None or (now - ep.opened >= self.every and not ep.suppressed):
            self._episodes[key] = _Episode(now)
            self.logger.log(level, msg, *args)
            return
        ep.suppressed += 1
        self.suppressed_total += 1
        ep.last = msg % args if args else msg
        if now - ep.opened >= self.every:
            self._summarize(key, ep, now, level)

    def warning(self, key: str, msg: str, *args) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def flush(self, force: bool = False) -> None:
        """Write the count of every closed window (every window with `force`)."""
        now = self._clock()
        for key, ep in list(self._episodes.items()):
            if now - ep.opened < self.every and not force:
                continue
            if ep.suppressed:
                self._summarize(key, ep, now, logging.WARNING)
            else:
                del self._episodes[key]  # quiet for a whole window: next event logs at once

    def _summarize(self, key: str, ep: _Episode, now: float, level: int) -> None:
        self.logger.log(
            level, "%s: %d more like this in %.1fs (last: %s)", key, ep.suppressed, now - ep.opened, ep.last
        )
        self._episodes[key] = _Episode(now)
