"""The RAM tier alone, standing in for RAM over SSD when the data dir cannot be used.

A cache that refuses to start takes every model server's cache with it; a
read-only, full or unreadable data dir at start therefore means serving from
RAM (kvd/cli/serve.py), and saying so wherever an operator looks: `stats`
shows an empty SSD tier, degraded, naming the folder and why, so `kvd
stats`, `--json` and /metrics (`kvd_tier_degraded{tier="ssd"} 1`) tell.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

from kvd.store.base import Entry
from kvd.store.ram import RamStore


class RamOnly(RamStore):
    """A RamStore whose stats carry a degraded, empty SSD tier (see module docstring)."""

    def __init__(self, ram_bytes: int, data_dir: str | os.PathLike, reason: str, *, write_through: bool = False):
        super().__init__(ram_bytes)
        self.unusable = {"data_dir": str(data_dir), "reason": reason, "since": time.time()}
        # Configured write-through, a PUT's acknowledgement means "on disk":
        # with no disk, every PUT is answered NOT_PERSISTED (held in RAM all
        # the same, and served), never acknowledged as durable.
        self.write_through = write_through

    def persist(self, entries: Iterable[Entry], also: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        if not self.write_through:
            return [], []
        return [], [e.id for e in entries] + [eid for eid in also if self.contains(eid)]

    def stats(self) -> dict[str, Any]:
        st = super().stats()
        st["tiers"]["ssd"] = {
            "entries": 0, "bytes": 0, "budget_bytes": 0,
            "degraded": True,
            "degraded_reason": f"data dir {self.unusable['data_dir']} unusable at start ({self.unusable['reason']}); "
                               "RAM only until restarted",
            "degraded_since": self.unusable["since"],
            "data_dir": None,  # offline commands: this daemon keeps nothing on disk
            "unusable_data_dir": self.unusable["data_dir"],
        }
        return st
