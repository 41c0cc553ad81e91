"""Pages of the arena made ready ahead of demand (kvd/server/shm/prepare.py,
issue 42), against a real `kvd serve`: a fresh daemon prepares segments
before any PUT, whole and reserved, within the RAM budget's ceiling; puts
then take their slots from them, and the ceiling still holds after a fill."""

from __future__ import annotations

import numpy as np

from support import assert_prefix_hit, prefix_snapshot, wait_until

MiB = 1 << 20


def test_a_fresh_daemon_prepares_pages_before_the_first_put_within_its_budget(daemon_factory):
    d = daemon_factory("--ram-mb", "256", "--data-dir", "none")
    with d.client("prep", strict=True, transport="shm") as c:
        def shm():
            return c.stats()["shm"]

        s = wait_until(lambda: (x := shm())["prepared_bytes"] >= 64 * MiB and x, what="segments prepared ahead")
        seg = 8 * MiB  # a thirty-second of 256 MiB
        ceiling = s["capacity_bytes"] // 2 + seg
        assert s["used_bytes"] == 0 and s["allocs"] == 0  # before any PUT
        assert s["mapped_bytes"] <= ceiling
        toks = [np.arange(2048) + i * 100_000 for i in range(12)]
        for t in toks:
            assert c.put(t, prefix_snapshot(t))
        assert c.counters["shm_puts"] == len(toks)
        for t in toks:
            assert_prefix_hit(c.get(t), t)
        s = shm()
        assert s["allocs"] > 0 and s["prepared_bytes"] <= ceiling  # the preparer never went past the budget
        assert s["mapped_bytes"] <= s["capacity_bytes"]
        assert s["prepare_failures"] == 0
    assert d.proc.poll() is None
