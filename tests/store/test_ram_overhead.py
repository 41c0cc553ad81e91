"""The RAM tier charges what an entry costs the process, not only its bytes.

Before kvd.store.overhead, 1.95 M zero-byte entries held 958 MB under a
16 MiB budget whose stats said 0 bytes were used.
"""

from __future__ import annotations

from kvd.store.overhead import PER_ENTRY, PER_TENSOR, entry_overhead
from kvd.store.ram import RamStore

from support import entry


def test_zero_byte_entries_fill_the_budget_not_the_process():
    ram = RamStore(1 << 20, overhead=True)
    for i in range(100_000):
        ram.put(entry(i, nbytes=0))
    cost = PER_ENTRY + PER_TENSOR  # one tensor each
    assert ram.bytes > 0 and ram.bytes <= ram.budget_bytes
    assert len(ram) == (1 << 20) // cost  # 100,000 would cost ~93 MB of process memory
    assert ram.stats()["tiers"]["ram"]["bytes"] == len(ram) * cost
    assert ram.ns_bytes["a"] == ram.bytes


def test_charges_are_symmetric_across_put_evict_and_drop():
    ram = RamStore(10_000, overhead=True)
    for i in range(50):
        ram.put(entry(i, nbytes=100))
    assert ram.bytes == len(ram) * (100 + entry_overhead(entry(0)))
    n, freed = ram.evict(0)
    assert ram.bytes == 0 and freed == n * (100 + entry_overhead(entry(0)))
    ram.put(entry(1, nbytes=100))
    ram.drop(namespace="a")
    assert ram.bytes == 0 and not ram.ns_bytes


def test_an_entry_whose_overhead_alone_is_over_the_budget_is_too_big():
    ram = RamStore(PER_ENTRY, overhead=True)
    assert ram.put(entry(1, nbytes=0)).value == "too_big"


def test_daemon_stats_count_overhead(kvd_daemon):
    import numpy as np
    from kvd_client import HostTensor, Snapshot

    c = kvd_daemon.client("tiny", strict=True, chunk_tokens=16)
    tokens = list(range(16 * 64))
    assert c.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(np.zeros((1, len(tokens), 0), np.uint8)), 1)}))
    ram = c.stats()["tiers"]["ram"]
    assert ram["entries"] == 64 and ram["bytes"] >= 64 * (PER_ENTRY + PER_TENSOR)
