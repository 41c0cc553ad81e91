"""Pages of the arena made ready ahead of demand (kvd/server/shm/prepare.py,
issue 42), against a real `kvd serve`: nothing before the first PUT (a
daemon in a tight memory cgroup sees no jump at start), then whole reserved
segments ahead of demand, within the RAM budget's ceiling."""

from __future__ import annotations

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
