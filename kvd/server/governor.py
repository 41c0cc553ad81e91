"""The RAM tier's budget follows memory pressure: it yields, then grows back.

Theory of operation
-------------------
`RamGovernor.tick()` runs on the daemon thread from its housekeeping tick
(about every 0.1 s, between requests). Every `poll_s` seconds it takes one
sample from its pressure source (`make_source`, below) and moves the RAM
tier's *target* budget between `floor_bytes` and `max_bytes` (`ram_mb`):

    critical  target = floor at once
    warn      target = max(floor, min(target, bytes held) - step), once
              per poll while it lasts: each poll frees another step
    normal    after `calm_s` seconds without pressure, target += step per
              poll, up to max_bytes

where step = (max - floor) / 4. Hysteresis is twofold: levels enter and
leave at different thresholds (kvd/host/pressure.py), and growth waits for a calm
period and then comes back a step at a time.

The target is the RAM tier's `budget_bytes` at once (new PUTs respect it),
but getting down to it is paced: each tick evicts the oldest entries, at
most `step_per_tick` bytes, and in a tiered store no more than the spill
queue can take without waiting (entries move to the queue, and only the
SSD writer frees their memory; evicting faster would only move bytes from
one list to another and then drop them). Entries already written (behind)
or already queued need no room: they go at once. So a wanted entry is spilled, not
lost, whenever the disk keeps up; with no SSD tier, the coldest entries are
dropped. Evictions are recorded with why = "pressure".

Every change of level and every change of budget is logged once, and the
state is in STATS ("pressure") and /metrics (kvd_pressure_*).

Where the level comes from: `make_source(spec)` builds the source from the
`pressure_source` setting:

    auto        this machine (kvd.host.pressure.system_source: what Linux
                and macOS report)
    off         none: the RAM tier keeps its budget
    file:PATH   the first word of PATH ("normal", "warn" or "critical"; a
                missing file is "normal"): the documented hook for tests and
                for operators who compute pressure elsewhere. Only a regular
                file's first 4 KiB are read, without blocking: a FIFO, a
                device or a folder reads as "normal", with a warning

`auto_ram_mb` sizes `ram_mb = "auto"` from the memory this process may use.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

from kvd.endpoint import file_kind
from kvd.host.pressure import LEVELS, Sample, Source, memory_total, system_source

log = logging.getLogger("kvd.server")
MiB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.2f} MiB" if n >= MiB // 100 else f"{n} B"


class RamGovernor:
    """Moves `ram.budget_bytes` with memory pressure; see the module docstring."""

    def __init__(
        self,
        ram: Any,
        source: Source,
        *,
        max_bytes: int,
        floor_bytes: int,
        source_name: str = "auto",
        poll_s: float = 1.0,
        calm_s: float = 30.0,
        step_per_tick: int = 64 * MiB,
        spill_queue: Any = None,
        on_disk: Callable[[bytes], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.ram = ram
        self.source = source
        self.source_name = source_name
        self.max_bytes = int(max_bytes)
        self.floor_bytes = min(int(floor_bytes), self.max_bytes)
        self.step = max(1, (self.max_bytes - self.floor_bytes) // 4)
        self.poll_s = poll_s
        self.calm_s = calm_s
        self.step_per_tick = step_per_tick
        self.queue = spill_queue
        self.on_disk = on_disk  # an entry written (behind) already costs the queue nothing
        self._clock = clock
        self._wall = wall
        self.level = "normal"
        self.sample = Sample("normal", "not sampled yet")
        self.target = self.max_bytes
        self.since = wall()
        self._calm_from = clock()
        self._next_poll = clock()
        self.counters = dict.fromkeys(("samples", "level_changes", "shrinks", "grows", "evictions", "evicted_bytes"), 0)
        ram.budget_bytes = self.target

    # -- the tick ------------------------------------------------------------------
    def tick(self) -> None:
        now = self._clock()
        if now >= self._next_poll:
            self._next_poll = now + self.poll_s
            self._decide(now)
        if self.ram.bytes > self.target:
            self._shrink_step()

    def _decide(self, now: float) -> None:
        try:
            sample = self.source(self.level)
        except Exception as exc:  # a broken source must not stop the daemon
            sample = Sample("normal", f"pressure source failed: {exc}")
        self.counters["samples"] += 1
        self.sample = sample
        level = sample.level if sample.level in LEVELS else "normal"
        if level != self.level:
            self.counters["level_changes"] += 1
            severity = logging.INFO if level == "normal" else logging.WARNING
            log.log(severity, "memory pressure %s -> %s (%s)", self.level, level, sample.reason)
            self.level, self.since = level, self._wall()
        if level != "normal":
            self._calm_from = now
        if level == "critical":
            self._set(self.floor_bytes, "critical")
        elif level == "warn":
            self._set(max(self.floor_bytes, min(self.target, self.ram.bytes) - self.step), "warn")
        elif self.target < self.max_bytes and now - self._calm_from >= self.calm_s:
            self._set(min(self.max_bytes, self.target + self.step), f"calm for {now - self._calm_from:.0f}s")

    def _set(self, target: int, why: str) -> None:
        if target == self.target:
            return
        verb = "shrinks" if target < self.target else "grows"
        self.counters[verb] += 1
        log.info("ram budget %s -> %s (%s: %s)", _mib(self.target), _mib(target), why, self.sample.reason)
        self.target = target
        self.ram.budget_bytes = target

    def _shrink_step(self) -> None:
        """Evict the coldest entries toward the target, paced (module docstring)."""
        allowance = self.step_per_tick
        for entry in list(self._oldest()):
            if self.ram.bytes <= self.target or allowance <= 0:
                break
            if self.queue is not None and not self._clean(entry.id) and not self._queue_room(entry.nbytes):
                break  # the SSD writer is behind: evict more on a later tick
            freed = self.ram.evict_entry(entry.id, "pressure")
            allowance -= freed
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += freed

    def _oldest(self):
        # Enough of the oldest entries for one tick; evicting while iterating
        # the RAM tier's own map is not allowed, hence the copy.
        need, out = self.ram.bytes - self.target, []
        for entry in self.ram.entries():
            out.append(entry)
            need -= entry.nbytes
            if need <= 0 or len(out) >= 4096:
                break
        return out

    def _clean(self, eid: bytes) -> bool:
        """Evicting it needs no room in the queue: queued already, or on disk."""
        return eid in self.queue or (self.on_disk is not None and self.on_disk(eid))

    def _queue_room(self, nbytes: int) -> bool:
        q = self.queue
        entries_ok = q.max_entries is None or len(q) < q.max_entries
        return entries_ok and q.bytes + nbytes <= q.max_bytes

    # -- reporting -----------------------------------------------------------------
    def stats(self, _stats: Any = None) -> dict[str, Any]:
        return {
            "source": self.source_name,
            "level": self.level,
            "level_code": LEVELS.index(self.level),
            "reason": self.sample.reason,
            "since": self.since,
            "available_bytes": self.sample.available,
            "total_bytes": self.sample.total,
            "ram_budget_bytes": self.target,
            "ram_max_bytes": self.max_bytes,
            "ram_floor_bytes": self.floor_bytes,
            **self.counters,
        }


def from_config(cfg: Any, store: Any, ram_bytes: int) -> RamGovernor | None:
    """The governor `kvd serve` runs for `store`, or None with pressure_source = off."""
    source = make_source(cfg.pressure_source)
    if source is None:
        return None
    ssd = getattr(store, "ssd", None)
    return RamGovernor(
        getattr(store, "ram", store), source, max_bytes=ram_bytes, floor_bytes=cfg.ram_floor_mb * MiB,
        source_name=cfg.pressure_source, poll_s=cfg.pressure_poll_s, calm_s=cfg.pressure_calm_s,
        spill_queue=None if ssd is None else ssd.queue,
        on_disk=None if ssd is None else ssd.has_row,
    )


# The level file is read on the serving thread, under the daemon's lock
# (the governor's tick): whatever PATH turns out to be, a sample must not
# block or grow. A FIFO with no writer would block a plain open() or read()
# forever, /dev/zero never ends, and a huge file would be read whole. So the
# file is opened non-blocking, must be a regular file, and only its first
# FILE_READ_MAX bytes are read: the first word is all that counts.
FILE_READ_MAX = 4096


def read_level_file(path: str | os.PathLike) -> tuple[str, str | None]:
    """(the first FILE_READ_MAX bytes of `path` decoded, undecodable bytes
    replaced; None), or ("", what PATH is instead of a regular file). Never
    blocks on a FIFO or a device. Raises FileNotFoundError, or OSError if
    it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return "", f"{file_kind(mode)}, not a regular file"
        data = os.read(fd, FILE_READ_MAX)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace"), None


def file_source(path: str | os.PathLike) -> Source:
    """A source reading its level from a file: the testing and integration hook.

    Anything but a readable regular file -- absent, unreadable, a FIFO, a
    device, a folder -- reads as "normal" with the reason in the sample (shown
    by `kvd stats`); a problem is logged once as a warning, again only after
    the file has been read well in between."""
    path = Path(path)
    warned: list[str] = []  # the problem last logged; cleared by a good read

    def trouble(reason: str) -> Sample:
        if not warned or warned[0] != reason:
            log.warning("pressure source %s: %s (reading it as normal)", path, reason)
            warned[:] = [reason]
        return Sample("normal", f"{path}: {reason}")

    def sample(previous: str = "normal") -> Sample:
        try:
            text, problem = read_level_file(path)
        except FileNotFoundError:
            return Sample("normal", f"{path}: absent")  # the documented "no pressure": not worth a warning
        except OSError as exc:
            return trouble(f"unreadable ({exc.strerror or exc})")
        if problem is not None:
            return trouble(problem)
        warned.clear()
        words = text.split()
        level = words[0].lower() if words else "normal"
        if level not in LEVELS:
            return Sample("normal", f"{path}: unknown level {words[0][:40]!r}")
        return Sample(level, f"{path}: {' '.join(words)[:80]}")

    return sample


def make_source(spec: str) -> Source | None:
    """The source for a `pressure_source` setting; None for "off"."""
    if spec == "off":
        return None
    if spec == "auto":
        return system_source()
    if spec.startswith("file:"):
        return file_source(spec[5:])
    raise ValueError(f"expected auto, off or file:PATH, got {spec!r}")


def auto_ram_mb(total: int | None = None) -> int:
    """`ram_mb = "auto"`: an eighth of the memory this process may use (see
    `memory_total`), at least 256 MiB and at most 32 GiB; 1024 MiB if unknown.
    An eighth leaves the models the rest, and the RAM tier yields under
    pressure anyway."""
    total = memory_total() if total is None else total
    if not total:
        return 1024
    return int(min(32 * 1024, max(256, total // 8 // MiB)))
