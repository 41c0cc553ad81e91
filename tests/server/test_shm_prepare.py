"""Pages of the arena made ready ahead of demand (kvd/server/shm/prepare.py,
issue 42), against a real `kvd serve`: nothing before the first PUT (a
daemon in a tight memory cgroup sees no jump at start), then whole reserved
segments ahead of demand, within the RAM budget's ceiling."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from support import assert_prefix_hit, prefix_snapshot, wait_until

MiB = 1 << 20


def test_pages_are_prepared_ahead_once_puts_come_never_past_the_budget(daemon_factory):
    d = daemon_factory("--ram-mb", "256", "--data-dir", "none")
    toks = [np.arange(2048) + i * 100_000 for i in range(12)]
    with d.client("prep", strict=True, transport="shm") as c:
        def shm():
            return c.stats()["shm"]

        s = shm()
        assert s["prepared_bytes"] == 0 and s["mapped_bytes"] == 0  # no jump at start (a tight cgroup)
        assert c.put(toks[0], prefix_snapshot(toks[0]))
        seg = 8 * MiB  # a thirty-second of 256 MiB
        s = wait_until(lambda: (x := shm())["prepared_bytes"] >= 2 * seg and x, what="segments prepared ahead")
        ceiling = s["capacity_bytes"] // 2 + seg
        for t in toks[1:]:
            assert c.put(t, prefix_snapshot(t))
        assert c.counters["shm_puts"] == len(toks)
        for t in toks:
            assert_prefix_hit(c.get(t), t)
        s = shm()
        assert s["prepared_bytes"] <= ceiling  # the preparer never went past the budget
        assert s["mapped_bytes"] <= s["capacity_bytes"] and s["prepare_failures"] == 0
    assert d.proc.poll() is None


def test_what_a_fill_leaves_resident_stays_within_the_ram_budget_and_two_segments(daemon_factory):
    # The arena's resident pages (the segments' allocated blocks), after a fill
    # that evicts: the RAM tier's budget plus the free memory kept warm for the
    # next puts (Arena.keep_free) and what the preparer holds ahead, within
    # the budget and two segments (the preparer's ceiling is half the arena's
    # capacity plus a segment); and a client's bulk prefault of
    # its grants (client/_pages.py) adds no page to it.
    from kvd_client import _pages

    ram = 8 * MiB
    d = daemon_factory("--ram-mb", "8", "--data-dir", "none")
    toks = [np.arange(2048) + i * 100_000 for i in range(40)]  # ~0.55 MiB each: 22 MiB through 8
    with d.client("fill", strict=True, transport="shm") as c:
        for t in toks:
            assert c.put(t, prefix_snapshot(t))
        s = c.stats()["shm"]
        folder = Path(s["dir"])
        resident = sum(os.stat(p).st_blocks * 512 for p in folder.iterdir() if p.name != "nonce")
    assert c.counters["shm_puts"] == len(toks) and _pages.counters["prefaulted_bytes"] > 0
    assert s["used_bytes"] <= ram
    seg = 4 * MiB  # a thirty-second of 8 MiB, at least 4
    assert resident <= s["mapped_bytes"] <= ram + 2 * seg, (resident, s)  # measured: 11 MiB resident, 12 mapped
