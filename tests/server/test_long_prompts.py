"""Long prompts on every path: frames and shared memory, each served from the
RAM tier, the SSD tier (after a restart) and the remote tier (a fresh daemon
with no local tiers), at lengths around the internal boundaries.

16,384 tokens is where a prompt's token frame reaches 64 KiB (the daemon then
keeps the frame as a memoryview instead of copying it out: the remote tier's
tail candidates once did `memoryview + bytes` and answered INTERNAL), 16,383
and 16,484 sit either side with a tail chunk, 32,785 is past two such frames
with a tail, and 131,073 tokens (513 chunks) crosses GET page and remote batch
sizes. Each length is stored once and read back bit-exact on both planes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd_client import HostTensor, Snapshot
from redis_server import SKIP_REASON, RedisServer, redis_binary
from support import wait_until

NS = "long-prompts"
LENGTHS = [16_383, 16_384, 16_484, 32_785, 131_073]
PLANES = ["frames", "shm"]


def tokens_of(n: int) -> list[int]:
    return [(7 * i + n) % 50_000 for i in range(n)]


def snapshot(tokens) -> Snapshot:
    """A small cache like a real model's: position t depends on tokens[:t+1] (bf16 and int8)."""
    t = np.asarray(tokens, dtype=np.uint64)
    sig = np.cumsum((t + np.uint64(3)) * np.uint64(2654435761), dtype=np.uint64)
    k = (sig[None, None, :, None] >> np.array([0, 16], dtype=np.uint64)).astype(np.uint16)  # (1, 1, T, 2)
    v = (sig[None, None, :, None] >> np.array([8], dtype=np.uint64)).astype(np.int8)  # (1, 1, T, 1)
    return Snapshot(sliced={"k": (HostTensor.bfloat16(np.ascontiguousarray(k)), 2),
                            "v": (HostTensor.from_numpy(np.ascontiguousarray(v)), 2)})


def check_hit(hit, tokens) -> None:
    assert hit is not None and hit.n == len(tokens), (None if hit is None else hit.n, len(tokens))
    want = snapshot(tokens)
    for name, (ht, _) in want.sliced.items():
        got = hit.sliced[name]
        assert got.dtype == ht.dtype and got.array.tobytes() == ht.array.tobytes(), name


def read_back(daemon, tokens, plane: str, tier: str) -> None:
    with daemon.client(NS, strict=True, transport=plane, timeout=30) as c:
        probe = c.probe(tokens)
        assert probe.n == len(tokens), (tier, plane, probe.n)
        check_hit(c.get(tokens), tokens)
        if plane == "shm":
            assert c.counters["shm_gets"] >= 1


def store_all(daemon) -> None:
    with daemon.client(NS, strict=True, timeout=60) as c:
        for n in LENGTHS:
            assert c.put(tokens_of(n), snapshot(tokens_of(n)))


@pytest.mark.slow
def test_long_prompts_from_ram_and_ssd(daemon_factory):
    d = daemon_factory("--ram-mb", "256")
    store_all(d)
    for n in LENGTHS:
        for plane in PLANES:
            read_back(d, tokens_of(n), plane, "ram")
    d.restart()  # a clean stop writes the backlog; the new process's RAM is empty
    with d.client(NS) as c:
        assert c.stats()["tiers"]["ram"]["entries"] == 0
    for n in LENGTHS:
        for plane in PLANES:
            read_back(d, tokens_of(n), plane, "ssd")


@pytest.mark.slow
@pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)
def test_long_prompts_from_the_remote_tier(daemon_factory):
    server = RedisServer().start()
    try:
        a = daemon_factory("--ram-mb", "256", "--remote-url", server.url)
        store_all(a)
        with a.client(NS) as c:
            wait_until(lambda: (lambda r: r["backlog"] == 0 and r["written"] >= 1)(c.stats()["tiers"]["remote"]),
                       timeout=60, what="written")
            assert c.stats()["tiers"]["remote"]["errors"] == 0
        for plane in PLANES:
            # a fresh daemon with no local copy for each plane, so every read comes from the server
            b = daemon_factory("--ram-mb", "256", "--data-dir", "none", "--remote-url", server.url)
            for n in LENGTHS:
                read_back(b, tokens_of(n), plane, "remote")
            with b.client(NS) as c:
                r = c.stats()["tiers"]["remote"]
                assert r["hits"] > 0 and r["auth_failures"] == 0 and r["checksum_failures"] == 0
            b.stop()
    finally:
        server.close()
