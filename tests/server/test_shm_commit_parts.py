"""A big shared-memory PUT committed in parts (PROTOCOL.md section 14, COMMIT in parts,
issue 42's "durable soon after"), against a real `kvd serve` with its SSD
tier: each part goes to the store, and to the disk, while the client copies
the rest; a write-through daemon still answers only once every chunk of the
whole PUT is fsynced and indexed (a kill -9 right after the answer loses
nothing); a part that is refused stores nothing of itself, and a PUT never
finished keeps only the whole parts committed before (a prefix of its
sequence), bit for bit after a restart.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.protocol import codec
from kvd.protocol.errors import BadField
from kvd_client import HostTensor, Snapshot
from kvd_client import _chunking, _core
from support import wait_until

LAYERS, HEADS, DIM, CHUNKS = 4, 8, 128, 8  # bf16 keys and values: 4 MiB a chunk of 256 tokens
TOKENS = 256 * CHUNKS + 100  # and a tail


def _cache(seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << 16, size=(2 * LAYERS, 1, HEADS, TOKENS, DIM), dtype=np.uint16)
    state = HostTensor.from_numpy(rng.integers(0, 1 << 30, size=(4,), dtype=np.int32))
    return Snapshot(sliced={f"{i // 2}.{'kv'[i % 2]}": (HostTensor("bfloat16", raw[i]), 2) for i in range(2 * LAYERS)},
                    boundary={"state": state}, meta={"layout": "parts"})


def _same(hit, snap: Snapshot, n: int) -> None:
    assert hit is not None and hit.n == n
    for name, (t, _) in snap.sliced.items():
        assert hit.sliced[name].array.tobytes() == t.array[:, :, :n].tobytes(), name


@pytest.mark.parametrize("write_through", [True, False])
def test_parts_arrive_as_copied_and_the_answer_covers_them_all(daemon_factory, monkeypatch, write_through):
    monkeypatch.setattr(_core, "_PART_BYTES", 1)  # every chunk but the last a part of its own
    d = daemon_factory("--ram-mb", "256", "--pack-max-kb", "0", *(["--write-through"] if write_through else []))
    toks, snap = np.arange(TOKENS) + 7, _cache(1)
    with d.client("parts", strict=True) as c:
        assert c.put(toks, snap)
        assert c.counters["shm_puts"] == 1 and c.counters["shm_put_parts"] == CHUNKS  # the tail and boundary: final
        s = c.stats()
        assert s["shm"]["commit_parts"] == CHUNKS and s["shm"]["commits"] == 1
        assert s["namespaces"]["parts"]["puts"] == 1 and s["namespaces"]["parts"]["chunks_stored"] == CHUNKS + 2
        if write_through:
            assert s["write_through"]["acknowledged"] == 1 and s["write_through"]["waiting"] == 0
        hit = c.get(toks, need_boundary=True)
        _same(hit, snap, TOKENS)
        assert hit.boundary["state"].array.tobytes() == snap.boundary["state"].array.tobytes()
    if write_through:
        d.kill()  # answered means on disk: nothing of it may be lost now
        d.start()
    else:
        d.restart()  # a clean stop writes the backlog
    # (RAM starts empty: what follows comes from the SSD tier)
    with d.client("parts", strict=True) as c:
        hit = c.get(toks, need_boundary=True)
        _same(hit, snap, TOKENS)
        assert hit.boundary["state"].array.tobytes() == snap.boundary["state"].array.tobytes()


def test_a_daemon_without_parts_gets_one_commit(daemon_factory, monkeypatch):
    """A client that does not see `commit_parts` in HELLO (an older daemon)
    commits once, as before."""
    monkeypatch.setattr(_core, "_PART_BYTES", 1)
    d = daemon_factory("--ram-mb", "256", "--write-through")
    toks, snap = np.arange(TOKENS), _cache(2)
    with d.client("old", strict=True) as c:
        assert c.hello() is not None
        c._features = c._features - {"commit_parts"}
        assert c.put(toks, snap)
        assert c.counters["shm_put_parts"] == 0 and c.stats()["shm"]["commit_parts"] == 0
        _same(c.get(toks), snap, TOKENS)


def test_a_refused_part_stores_nothing_and_an_unfinished_put_keeps_its_whole_parts(daemon_factory):
    d = daemon_factory("--ram-mb", "256", "--pack-max-kb", "0", "--write-through", "--shm-lease-s", "1")
    toks, snap = np.arange(3 * 256) + 11, _cache(3)
    chunks = [snap.sliced[name][0].array for name in snap.sliced]
    with d.client("torn", strict=True) as c:
        link = c._link()
        seq = c._seq(toks)
        spec = [codec.Tensor(name, "bfloat16", (1, HEADS, 256, DIM), None) for name in snap.sliced]
        grant = c._transport.request("SLOTS", {**seq, "shm": link.field(), "chunks": [
            {"index": i, "tensors": spec, "meta": _chunking.chunk_meta(snap)} for i in range(3)]}, 10)
        from kvd_client._chunking import copy_hashed  # the client's copy: bytes and digests as a store makes them

        def fill(i: int) -> list[int]:
            return [copy_hashed(link.view(desc, writable=True), codec.Tensor(name, "bfloat16", (1, HEADS, 256, DIM), a[:, :, 256 * i:256 * (i + 1)]))
                    for desc, a, name in zip(grant["chunks"][i], chunks, snap.sliced)]

        def commit(digests, more=True):
            return c._transport.request("COMMIT", {"lease": grant["lease"], "shm": link.field(), "digests": digests,
                                                   "more": more}, 10)

        first = fill(0)
        # A part answered at once, even write-through: it waits with the final COMMIT.
        assert commit(first)["stored"] == 1
        assert c.stats()["write_through"]["waiting"] == 0
        second = fill(1)
        with pytest.raises(BadField):
            commit(second[:-1])  # not a whole chunk: refused
        with pytest.raises(BadField):
            commit(second + fill(2))  # the last chunk comes with the final COMMIT
        assert c.probe(toks).n == 256  # neither refused part stored a thing
        wait_until(lambda: c.stats()["shm"]["leases"] == 0, what="the unfinished grant's lease to end")
        with pytest.raises(BadField):
            commit(None, more=False)  # too late: the rest is gone
        assert c.probe(toks).n == 256  # the whole part committed, and nothing else
        wait_until(lambda: c.stats()["store"]["dirty_bytes"] == 0, what="the part on disk")
    d.kill()
    d.start()
    with d.client("torn", strict=True) as c:
        _same(c.get(toks), snap, 256)
